//! The status page (issue 44): two relay instances (active + standby) and a parked event whose
//! aggregate id carries HTML metacharacters. Headless Chromium (Debian package `chromium`,
//! scripts/deps.sh) renders each instance's page after its script ran: the active one names
//! the slot, says active and lists the parked event; the standby's says standby.
//! `/status.json` carries the same facts in the documented layout; the page and the JSON are
//! protected by `metrics.status_token` while `/metrics` and the probes are not; anything but
//! GET/HEAD is 405; neither the DSN's password nor the token appears anywhere; row values are
//! escaped.

use outboxd_tests::testkit::{free_port, PG_PASSWORD};
use outboxd_tests::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const TOPIC: &str = "outbox.event.acct";
const TOKEN: &str = "status-token-5f1c9a7e2b";
/// An aggregate id a browser would run if it were not escaped.
const HOSTILE: &str = "<img src=x onerror=alert(1)>&\"'";

fn repo_root() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One HTTP/1.0 request: (status, lower-cased headers, body).
fn request(addr: &str, method: &str, path: &str, auth: bool) -> (u16, String, String) {
    let auth = if auth {
        format!("Authorization: Bearer {TOKEN}\r\n")
    } else {
        String::new()
    };
    http_exchange(
        addr,
        &format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{auth}Content-Length: 0\r\n\r\n"),
    )
}

fn status_json(addr: &str) -> Option<Value> {
    let (code, _, body) = request(addr, "GET", "/status.json", true);
    (code == 200)
        .then(|| serde_json::from_str(&body).ok())
        .flatten()
}

/// Chromium on PATH (`chromium`, `chromium-browser`); `None` only when it is not installed.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser"].iter().find_map(|n| {
        std::env::split_paths(&path)
            .map(|d| d.join(n))
            .find(|f| f.is_file())
    })
}

/// The DOM of `url` after the page's script ran (virtual time lets its fetch finish).
fn rendered_dom(browser: &PathBuf, url: &str, profile: &std::path::Path) -> String {
    let out = Command::new("timeout")
        .arg("90")
        .arg(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(url)
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && dom.contains("<html"),
        "chromium failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    dom
}

/// The documented layout of `/status.json` (docs/operations.md, "Status page").
fn assert_schema(v: &Value) {
    let is = |path: &str, ok: fn(&Value) -> bool| {
        let got = v.pointer(path).unwrap_or(&Value::Null);
        assert!(ok(got), "{path}: unexpected {got} in {v:#}");
    };
    let opt_str: fn(&Value) -> bool = |x| x.is_null() || x.is_string();
    let opt_num: fn(&Value) -> bool = |x| x.is_null() || x.is_number();
    is("/schema", |x| x == 1);
    is("/instance", Value::is_string);
    is("/version", Value::is_string);
    is("/features", Value::is_array);
    is("/generated_at", Value::is_string);
    is("/role", |x| {
        ["active", "standby", "halted", "starting"].contains(&x.as_str().unwrap_or(""))
    });
    is("/ready", Value::is_boolean);
    is("/not_ready", opt_str);
    is("/slot/name", Value::is_string);
    is("/slot/location", |x| x == "primary" || x == "standby");
    is("/slot/holder", opt_str);
    is("/slot/confirmed_lsn", opt_str);
    is("/slot/lag_bytes", opt_num);
    is("/slot/lag_seconds", opt_num);
    is("/events/relayed", Value::is_u64);
    is("/events/rate_per_second", Value::is_number);
    is("/events/pending", Value::is_u64);
    is("/events/pending_bytes", Value::is_u64);
    is("/oldest_undelivered", Value::is_array);
    is("/parked/count", Value::is_i64);
    is("/parked/events", Value::is_array);
    is("/errors/counts", Value::is_object);
    is("/errors/last", Value::is_array);
    is("/lag_history", Value::is_array);
    is("/config", Value::is_object);
    for p in v["parked"]["events"].as_array().unwrap() {
        for k in [
            "event_id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "state",
            "reason_class",
            "fix",
        ] {
            assert!(p[k].is_string(), "parked.events[].{k} in {p}");
        }
        assert!(opt_num(&p["age_seconds"]), "{p}");
    }
    for s in v["lag_history"].as_array().unwrap() {
        for k in ["at", "lag_bytes", "lag_seconds"] {
            assert!(s[k].is_number(), "lag_history[].{k} in {s}");
        }
    }
    for t in v["oldest_undelivered"].as_array().unwrap() {
        assert!(
            t["event_type"].is_string() && t["age_seconds"].is_number(),
            "{t}"
        );
    }
    for e in v["errors"]["last"].as_array().unwrap() {
        for k in ["at", "class", "message", "fix"] {
            assert!(e[k].is_string(), "errors.last[].{k} in {e}");
        }
    }
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in [PG_PASSWORD, TOKEN] {
        assert!(!text.contains(secret), "{what} shows a secret ({secret})");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_of_an_active_and_a_standby_instance() -> anyhow::Result<()> {
    let mut env = Env::start("status_page").await?;
    let maddr = format!("127.0.0.1:{}", free_port());
    let maddr2 = format!("127.0.0.1:{}", free_port());
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    env.extra_toml = format!(
        "standby_poll_ms = 500\nrepair_interval_ms = 500\n[metrics]\nlisten = \"{maddr}\"\nstatus_token = \"{TOKEN}\"\n"
    );
    assert!(
        env.toml().contains(PG_PASSWORD),
        "the DSN carries a password"
    );
    create_topics(&env.bootstrap(), &[TOPIC], 1).await?;
    let cfg = env.config_file()?;
    let _active = RelayProcess::spawn(&cfg, env.dir.path().join("active.log"))?;
    eventually(Duration::from_secs(30), || async {
        Ok(http_get(&maddr, "/readyz").0 == 200)
    })
    .await?;

    let mut c = env.sql().await?;
    let poison = NewEvent::new(
        "acct",
        HOSTILE,
        1,
        "Deposited",
        serde_json::json!({"blob": "x".repeat(30_000)}),
    );
    let poison_id = poison.event_id.to_string();
    write_events(&mut c, std::slice::from_ref(&poison), false).await?;
    write_events(
        &mut c,
        &[NewEvent::new(
            "acct",
            "B",
            1,
            "Deposited",
            serde_json::json!({"n": 1}),
        )],
        false,
    )
    .await?;
    eventually(Duration::from_secs(40), || async {
        Ok(status_json(&maddr).is_some_and(|v| {
            v["parked"]["count"] == 1
                && v["events"]["relayed"].as_u64() >= Some(1)
                && v["lag_history"].as_array().is_some_and(|h| !h.is_empty())
        }))
    })
    .await?;

    let cfg2 = env.dir.path().join("standby.toml");
    std::fs::write(
        &cfg2,
        std::fs::read_to_string(&cfg)?.replace(&maddr, &maddr2),
    )?;
    let _standby = RelayProcess::spawn(&cfg2, env.dir.path().join("standby.log"))?;
    eventually(Duration::from_secs(30), || async {
        Ok(status_json(&maddr2)
            .is_some_and(|v| v["role"] == "standby" && v["slot"]["holder"].is_string()))
    })
    .await?;

    // /status.json: the documented layout, the same facts as the page.
    let a = status_json(&maddr).expect("active status.json");
    let s = status_json(&maddr2).expect("standby status.json");
    assert_schema(&a);
    assert_schema(&s);
    assert_eq!(a["role"], "active");
    assert_eq!(a["slot"]["name"], env.slot.as_str());
    assert_eq!(a["slot"]["location"], "primary");
    assert_eq!(a["slot"]["holder"], a["instance"]);
    assert!(a["slot"]["confirmed_lsn"].as_str().unwrap().contains('/'));
    let parked = &a["parked"]["events"][0];
    assert_eq!(parked["event_id"], poison_id.as_str());
    assert_eq!(parked["aggregate_id"], HOSTILE);
    assert_eq!(parked["state"], "parked");
    assert_eq!(parked["reason_class"], "too_large");
    assert!(parked["fix"].as_str().unwrap().contains(&poison_id));
    assert_eq!(s["role"], "standby");
    assert_eq!(s["slot"]["name"], env.slot.as_str());
    assert!(
        s["slot"]["holder"].is_string(),
        "the standby names the holder: {s}"
    );
    assert!(a["config"]["source"]["dsn"]
        .as_str()
        .unwrap()
        .contains("[redacted]"));

    // Read-only, token-protected where it should be, no secret, escaped.
    for path in ["/", "/status.json", "/metrics", "/healthz"] {
        let (code, head, _) = request(&maddr, "POST", path, true);
        assert_eq!(code, 405, "POST {path}");
        assert!(head.contains("allow: get, head"), "{head}");
    }
    assert_eq!(request(&maddr, "DELETE", "/", true).0, 405);
    assert_eq!(request(&maddr, "GET", "/", false).0, 401);
    assert_eq!(request(&maddr, "GET", "/status.json", false).0, 401);
    assert_eq!(request(&maddr, "HEAD", "/", true).0, 200);
    assert_eq!(http_get(&maddr, "/metrics").0, 200, "/metrics stays open");
    assert_eq!(http_get(&maddr, "/healthz").0, 200, "/healthz stays open");
    let (code, head, html) = request(&maddr, "GET", "/", true);
    assert_eq!(code, 200);
    assert!(head.contains("text/html") && head.contains("content-security-policy"));
    assert!(
        !html.contains("<img src=x")
            && html.contains("&lt;img src=x onerror=alert(1)&gt;&amp;&quot;&#39;"),
        "the aggregate id is escaped"
    );
    assert!(html.contains(&poison_id) && html.contains("role-active"));
    assert!(
        !html.contains("src=\"http") && !html.contains("href=\"http"),
        "nothing external"
    );
    let (_, _, html2) = request(&maddr2, "GET", "/", true);
    for (what, text) in [
        ("active page", &html),
        ("standby page", &html2),
        ("active JSON", &a.to_string()),
        ("standby JSON", &s.to_string()),
    ] {
        assert_no_secret(what, text);
    }

    // A real browser, after the script refreshed the page from /status.json.
    let Some(browser) = chromium() else {
        eprintln!(
            "SKIPPED the browser part: chromium is not installed (Debian package `chromium`; run scripts/deps.sh)"
        );
        return Ok(());
    };
    let profile = env.dir.path().join("chromium");
    let dom = rendered_dom(
        &browser,
        &format!("http://{maddr}/?token={TOKEN}"),
        &profile,
    );
    assert!(
        dom.contains("data-refreshes=\""),
        "the script refreshed the page: {dom}"
    );
    assert!(dom.contains("live: updated"), "{dom}");
    assert!(dom.contains(&env.slot), "names the slot");
    assert!(dom.contains(">active<"), "says active");
    assert!(dom.contains(&poison_id), "lists the parked event");
    assert!(
        !dom.contains("<img src=\"x\"") && !dom.contains("<img src=x"),
        "the hostile aggregate id stayed text: {dom}"
    );
    assert_no_secret(
        "active page in the browser",
        &dom.replace(&format!("token={TOKEN}"), ""),
    );
    let dom2 = rendered_dom(
        &browser,
        &format!("http://{maddr2}/?token={TOKEN}"),
        &profile,
    );
    assert!(dom2.contains("data-refreshes=\""), "{dom2}");
    assert!(dom2.contains(">standby<"), "says standby");
    assert!(dom2.contains(&env.slot));
    assert_no_secret(
        "standby page in the browser",
        &dom2.replace(&format!("token={TOKEN}"), ""),
    );
    // The screenshot script a person uses (docs/operations.md, "Status page"); with
    // OUTBOXD_STATUS_SCREENSHOT=<path> the PNG is kept there (how the docs' image was made).
    let png = env.dir.path().join("status.png");
    let out = Command::new(repo_root().join("scripts/status-screenshot.sh"))
        .arg(format!("http://{maddr}/"))
        .arg(&png)
        .env("STATUS_TOKEN", TOKEN)
        .output()?;
    assert!(
        out.status.success(),
        "status-screenshot.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&png)?;
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
        "a PNG"
    );
    if let Some(keep) = std::env::var_os("OUTBOXD_STATUS_SCREENSHOT") {
        std::fs::copy(&png, keep)?;
    }
    // Without the token the browser gets no facts.
    let dom3 = rendered_dom(&browser, &format!("http://{maddr}/"), &profile);
    assert!(
        !dom3.contains(&poison_id) && dom3.contains("unauthorized"),
        "{dom3}"
    );
    Ok(())
}
