//! Alert rules and the dashboard, checked by Prometheus's own tools (issue 20): `outboxd alerts`
//! passes `promtool check rules` (also with hostile event type names), `promtool test rules`
//! fires each alert on synthetic series and keeps it quiet where it must stay quiet
//! (tests/alerts/outboxd.test.yml), every Grafana query parses, and a real Prometheus scraping a
//! running relay evaluates every rule without error, answers a query with the ground truth and
//! fires the parked-events alert.
//!
//! promtool and prometheus come from Debian's `prometheus` package (scripts/deps.sh).

use outboxd_tests::testkit::{die_with_parent, free_port, workspace_root};
use outboxd_tests::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn tool(name: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p;
        }
    }
    panic!("{name} not found: run scripts/deps.sh (installs Debian's prometheus package)");
}

/// Runs promtool in `dir`; panics with its output unless it succeeds.
fn promtool(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(tool("promtool"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

fn generate_rules(config: &Path, out: &Path) {
    let (code, rules) = outboxd_cli(&["alerts"], config);
    assert_eq!(code, 0, "{rules}");
    std::fs::write(out, rules).unwrap();
}

#[test]
fn generated_rules_pass_promtool_check_and_unit_tests() {
    let dir = outboxd_tests::testkit::tempdir("alerts-").unwrap();
    let fixtures = workspace_root().join("tests/alerts");
    generate_rules(
        &fixtures.join("outboxd.toml"),
        &dir.path().join("rules.yml"),
    );
    std::fs::copy(
        fixtures.join("outboxd.test.yml"),
        dir.path().join("outboxd.test.yml"),
    )
    .unwrap();
    let checked = promtool(dir.path(), &["check", "rules", "rules.yml"]);
    assert!(checked.contains("SUCCESS: 12 rules found"), "{checked}");
    promtool(dir.path(), &["test", "rules", "outboxd.test.yml"]);
}

#[test]
fn hostile_event_type_names_still_make_valid_rules() {
    let dir = outboxd_tests::testkit::tempdir("alerts-").unwrap();
    let config = dir.path().join("outboxd.toml");
    std::fs::write(
        &config,
        r#"[source]
dsn = "postgres://app@127.0.0.1:5432/app"
publication = "p"
slot = "s"
[sink.kafka]
"bootstrap.servers" = "127.0.0.1:9092"
[alerts.delivery_budget_seconds]
'quote"d' = 10
'back\slash' = 20
"Order.Placed|.*" = 30
"ünï cødé" = 40
"new\nline" = 50
"}) or vector(1) #" = 60
default = 70
"#,
    )
    .unwrap();
    generate_rules(&config, &dir.path().join("rules.yml"));
    let checked = promtool(dir.path(), &["check", "rules", "rules.yml"]);
    assert!(checked.contains("SUCCESS: 16 rules found"), "{checked}");
}

#[test]
fn every_dashboard_query_parses() {
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(workspace_root().join("docs/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(e) = target["expr"].as_str() {
                exprs.push(e.to_string());
            }
        }
    }
    assert!(exprs.len() >= 20, "{} queries", exprs.len());
    // promtool parses expressions inside rule files: one recording rule per query.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(e).unwrap()
        ));
    }
    let dir = outboxd_tests::testkit::tempdir("alerts-").unwrap();
    std::fs::write(dir.path().join("dashboard.yml"), rules).unwrap();
    let checked = promtool(dir.path(), &["check", "rules", "dashboard.yml"]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", exprs.len())),
        "{checked}"
    );
}

/// A Prometheus server on a free port, killed on drop.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Prometheus {
    fn start(dir: &Path, target: &str, rules: &Path) -> Self {
        let addr = format!("127.0.0.1:{}", free_port());
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
                 scrape_configs:\n  - job_name: outboxd\n    static_configs:\n      - targets: ['{target}']\n",
                rules.display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let mut cmd = Command::new(tool("prometheus"));
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(log);
        die_with_parent(&mut cmd);
        let child = cmd.spawn().expect("start prometheus");
        Self { child, addr }
    }

    /// A JSON answer of the HTTP API.
    fn get(&self, path_and_query: &str) -> Option<serde_json::Value> {
        let (status, body) = http_get_10(&self.addr, path_and_query);
        (status == 200).then_some(())?;
        serde_json::from_str(&body).ok()
    }

    /// The value of a PromQL query that returns one sample.
    fn query(&self, promql: &str) -> Option<f64> {
        let v = self.get(&format!("/api/v1/query?query={}", percent(promql)))?;
        let r = v["data"]["result"].as_array()?;
        (r.len() == 1).then_some(())?;
        r[0]["value"][1].as_str()?.parse().ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_relay_and_fires_the_parked_alert() -> anyhow::Result<()> {
    let mut env = Env::start("alerts_prom").await?;
    let maddr = format!("127.0.0.1:{}", free_port());
    // Records over 20 kB are refused by the broker client: a deterministic poison event.
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    env.extra_toml = format!(
        "[metrics]\nlisten = \"{maddr}\"\n[alerts.delivery_budget_seconds]\nShipped = 60\ndefault = 300\n"
    );
    create_topics(&env.bootstrap(), &["outbox.event.parcel"], 1).await?;
    let cfg = env.config_file()?;
    let rules = env.dir.path().join("rules.yml");
    generate_rules(&cfg, &rules);
    let mut relay = RelayProcess::spawn(&cfg, env.dir.path().join("relay.log"))?;
    eventually(Duration::from_secs(30), || async {
        Ok(http_get(&maddr, "/readyz").0 == 200)
    })
    .await?;

    let mut c = env.sql().await?;
    for v in 1..=5 {
        let e = NewEvent::new("parcel", "p-1", v, "Shipped", serde_json::json!({ "v": v }));
        write_events(&mut c, &[e], false).await?;
    }
    let big = serde_json::json!({ "blob": "x".repeat(30_000) });
    write_events(
        &mut c,
        &[NewEvent::new("parcel", "p-2", 1, "Big", big)],
        false,
    )
    .await?;

    let prom_dir = env.dir.path().join("prometheus");
    std::fs::create_dir_all(&prom_dir)?;
    let prom = Prometheus::start(&prom_dir, &maddr, &rules);
    let log = || std::fs::read_to_string(prom_dir.join("prometheus.log")).unwrap_or_default();

    // The scrape works and a query returns the ground truth.
    let within = Duration::from_secs(60);
    let res = eventually(within, || async {
        Ok(prom.query("up{job=\"outboxd\"}") == Some(1.0)
            && prom.query("sum(outboxd_events_published_total{event_type=\"Shipped\"})")
                == Some(5.0))
    })
    .await;
    assert!(res.is_ok(), "no ground truth from Prometheus:\n{}", log());

    // Every generated rule was loaded and evaluates without error.
    let res = eventually(within, || async {
        let Some(v) = prom.get("/api/v1/rules") else {
            return Ok(false);
        };
        let rules: Vec<&serde_json::Value> = v["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .collect();
        Ok(rules.len() == 11
            && rules
                .iter()
                .all(|r| r["health"] == "ok" && r["lastError"].as_str().unwrap_or("").is_empty()))
    })
    .await;
    assert!(
        res.is_ok(),
        "rules not all healthy: {}\n{}",
        prom.get("/api/v1/rules").unwrap_or_default(),
        log()
    );

    // The parked event fires its alert, naming the event type; nothing pages on a healthy relay.
    let res = eventually(within, || async {
        let Some(v) = prom.get("/api/v1/alerts") else {
            return Ok(false);
        };
        let alerts = v["data"]["alerts"].as_array().cloned().unwrap_or_default();
        Ok(alerts.iter().any(|a| {
            a["labels"]["alertname"] == "OutboxdParkedEvents"
                && a["labels"]["event_type"] == "Big"
                && a["state"] == "firing"
        }))
    })
    .await;
    assert!(
        res.is_ok(),
        "parked alert did not fire: {}",
        prom.get("/api/v1/alerts").unwrap_or_default()
    );
    // Firing ones only: Prometheus may evaluate the rules once before its first scrape has
    // landed, when `absent(outboxd_up)` holds, and OutboxdDown is then pending for its `for`.
    let alerts = prom.get("/api/v1/alerts").unwrap_or_default();
    let names: Vec<&str> = alerts["data"]["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["state"] == "firing")
        .filter_map(|a| a["labels"]["alertname"].as_str())
        .collect();
    assert_eq!(names, ["OutboxdParkedEvents"], "{alerts}");

    drop(prom);
    assert!(relay.sigterm()?.success());
    Ok(())
}
