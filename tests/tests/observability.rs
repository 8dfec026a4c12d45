//! Observability (issue 5): metrics checked against ground truth (lag, oldest pending age while
//! the broker is cut, errors per class), readiness of active and standby instances, `outboxd
//! status`, generated alert rules and the Grafana dashboard use only exported metric names,
//! heartbeats keep the slot moving while another database is busy, and logs never contain
//! payloads or credentials.

use outboxd::obs;
use outboxd_tests::testkit::{free_port, Mode};
use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

/// Value of `name{labels...}` (all given labels must match) in a Prometheus text scrape.
fn metric(scrape: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, lbl) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let ok = labels
                .iter()
                .all(|(k, v)| lbl.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            ok.then(|| value.parse().ok()).flatten()
        })
}

fn names_in(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("outboxd_"))
        .map(|w| {
            w.trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count")
                .to_string()
        })
        .collect()
}

fn ev(agg: &str, v: i64, event_type: &str, payload: serde_json::Value) -> NewEvent {
    NewEvent::new("parcel", agg, v, event_type, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_status_and_readiness_match_ground_truth() -> anyhow::Result<()> {
    let mut env = Env::start_with_proxies("obs").await?;
    let maddr = format!("127.0.0.1:{}", free_port());
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    env.extra_toml = format!(
        "[metrics]\nlisten = \"{maddr}\"\n[heartbeat]\ninterval_ms = 500\nstall_timeout_ms = 5000\n\
         [alerts.delivery_budget_seconds]\nShipped = 60\ndefault = 300\n"
    );
    create_topics(&env.bootstrap(), &["outbox.event.parcel"], 2).await?;
    let cfg = env.config_file()?;
    let mut relay = RelayProcess::spawn(&cfg, env.dir.path().join("relay.log"))?;
    let scrape = || http_get(&maddr, "/metrics").1;
    eventually(Duration::from_secs(30), || async {
        Ok(http_get(&maddr, "/readyz").0 == 200)
    })
    .await?;
    assert_eq!(http_get(&maddr, "/healthz").0, 200);

    let mut c = env.sql().await?;
    for v in 1..=3 {
        write_events(
            &mut c,
            &[ev("p-1", v, "Shipped", serde_json::json!({"v": v}))],
            false,
        )
        .await?;
    }
    eventually(Duration::from_secs(30), || async {
        Ok(metric(
            &scrape(),
            obs::PUBLISHED,
            &[("event_type", "Shipped"), ("topic", "outbox.event.parcel")],
        ) == Some(3.0))
    })
    .await?;
    eventually(Duration::from_secs(10), || async {
        let s = scrape();
        Ok(metric(&s, obs::HEARTBEAT_AGE, &[]).is_some_and(|a| a < 3.0)
            && metric(&s, obs::HEARTBEAT_DELAY, &[]).is_some_and(|d| (0.0..3.0).contains(&d)))
    })
    .await?;

    // Broker cut: pending events and their age are the ground truth; the slot lags.
    let proxy = env.broker_proxy.as_ref().unwrap();
    proxy.set_mode(Mode::Down);
    let cut_at = std::time::Instant::now();
    for v in 4..=8 {
        write_events(
            &mut c,
            &[ev("p-1", v, "Shipped", serde_json::json!({"v": v}))],
            false,
        )
        .await?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s = scrape();
    assert_eq!(
        metric(&s, obs::PENDING_EVENTS, &[]),
        Some(5.0),
        "pending events"
    );
    let age = metric(&s, obs::OLDEST_PENDING_AGE, &[("event_type", "Shipped")]).unwrap_or(0.0);
    assert!(
        age >= 2.0 && age <= cut_at.elapsed().as_secs_f64() + 1.0,
        "oldest pending age {age}"
    );
    eventually(Duration::from_secs(15), || async {
        let truth = env
            .current_lsn()
            .await?
            .saturating_sub(env.confirmed_lsn().await?);
        let m = metric(&scrape(), obs::SLOT_LAG_BYTES, &[]).unwrap_or(0.0);
        Ok(m > 0.0 && m <= truth as f64)
    })
    .await?;
    // `outboxd status` shows what /readyz knows (it used to say `errors {}`, `last error -`).
    eventually(Duration::from_secs(30), || async {
        let (_, out) = outboxd_cli(&["status"], &cfg);
        Ok(out.contains("broker unreachable") && out.contains("5 event(s) wait"))
    })
    .await?;
    proxy.set_mode(Mode::Pass);
    eventually(Duration::from_secs(60), || async {
        let s = scrape();
        Ok(metric(&s, obs::PENDING_EVENTS, &[]) == Some(0.0)
            && metric(&s, obs::OLDEST_PENDING_AGE, &[("event_type", "Shipped")]) == Some(0.0)
            && metric(&s, obs::PUBLISHED, &[("event_type", "Shipped")]) == Some(8.0))
    })
    .await?;

    // Errors per class: an oversized event and a follower held behind it.
    let big = ev(
        "p-2",
        1,
        "Big",
        serde_json::json!({"blob": "x".repeat(30_000)}),
    );
    write_events(&mut c, std::slice::from_ref(&big), false).await?;
    write_events(
        &mut c,
        &[ev("p-2", 2, "Big", serde_json::json!({"small": 1}))],
        false,
    )
    .await?;
    eventually(Duration::from_secs(20), || async {
        let s = scrape();
        Ok(metric(
            &s,
            obs::POISON,
            &[("class", "too_large"), ("event_type", "Big")],
        ) == Some(1.0)
            && metric(
                &s,
                obs::PUBLISH_ERRORS,
                &[("class", "too_large"), ("event_type", "Big")],
            ) == Some(1.0)
            && metric(&s, obs::BLOCKED, &[("event_type", "Big")]) == Some(1.0)
            && metric(
                &s,
                obs::PARKED,
                &[("event_type", "Big"), ("state", "parked")],
            ) == Some(1.0))
    })
    .await?;
    let s_active = scrape();
    assert_eq!(metric(&s_active, obs::ROLE_ACTIVE, &[]), Some(1.0));

    // A standby instance: up, not ready, role 0.
    let maddr2 = format!("127.0.0.1:{}", free_port());
    let cfg2 = env.dir.path().join("standby.toml");
    std::fs::write(
        &cfg2,
        std::fs::read_to_string(&cfg)?.replace(&maddr, &maddr2),
    )?;
    let _standby = RelayProcess::spawn(&cfg2, env.dir.path().join("standby.log"))?;
    eventually(Duration::from_secs(30), || async {
        let (code, body) = http_get(&maddr2, "/readyz");
        Ok(code == 503 && body.contains("standby"))
    })
    .await?;
    eventually(Duration::from_secs(20), || async {
        Ok(metric(
            &http_get(&maddr2, "/metrics").1,
            obs::SESSION_RESTARTS,
            &[("class", "slot_busy")],
        )
        .is_some())
    })
    .await?;
    let s_standby = http_get(&maddr2, "/metrics").1;
    assert_eq!(metric(&s_standby, obs::ROLE_ACTIVE, &[]), Some(0.0));

    // Every metric of the catalogue is exported (safe_wal_size only with max_slot_wal_keep_size).
    let exported: String = format!("{s_active}\n{s_standby}");
    for (name, _) in obs::METRICS {
        // safe_wal_size only with max_slot_wal_keep_size, shadow metrics only in shadow mode.
        if ![
            obs::SLOT_SAFE_WAL_SIZE_BYTES,
            obs::SHADOW_EVENTS,
            obs::SHADOW_PENDING,
            // Only with several outbox tables (tests/tests/multi_table.rs).
            obs::TABLE_PUBLISHED,
            obs::TABLE_POISON,
            // Only with the slot on a standby (tests/tests/standby_decoding.rs).
            obs::STANDBY_REPLAY_LAG_BYTES,
        ]
        .contains(name)
        {
            assert!(exported.contains(name), "{name} not exported");
        }
    }
    for l in exported.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            !l.contains("event_id=") && !l.contains("aggregate_id="),
            "unbounded label: {l}"
        );
    }

    // `outboxd status --json` agrees with the server and the relay (which reports every 5 s).
    let status = || -> anyhow::Result<serde_json::Value> {
        let (code, out) = outboxd_cli(&["status", "--json"], &cfg);
        anyhow::ensure!(code == 0, "{out}");
        Ok(serde_json::from_str(&out)?)
    };
    eventually(Duration::from_secs(20), || async {
        Ok(status()?["reported"]["errors"]["too_large"].as_i64() == Some(1))
    })
    .await?;
    let v = status()?;
    assert_eq!(
        v["active_relay"]["relay_pid"],
        relay.child.id() as i64,
        "{v}"
    );
    assert!(v["slot"]["lag_bytes"].as_i64().is_some(), "{v}");
    assert_eq!(v["slot"]["wal_status"], "reserved");
    let parked = v["parked"].as_array().cloned().unwrap_or_default();
    assert!(
        parked
            .iter()
            .any(|p| p["event_type"] == "Big" && p["state"] == "parked" && p["count"] == 1),
        "{v}"
    );
    assert_eq!(v["reported"]["pending_events"], 0, "{v}");
    assert!(
        v["reported"]["heartbeat_age_seconds"]
            .as_f64()
            .is_some_and(|a| a < 30.0),
        "{v}"
    );
    let (code, human) = outboxd_cli(&["status"], &cfg);
    assert!(
        code == 0 && human.contains("lag bytes") && human.contains("Big parked x1"),
        "{human}"
    );

    // Resolving the parked event releases its follower, and the parked gauges return to 0
    // (else the parked-events alert would fire forever).
    let id = big.event_id.to_string();
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "discard",
            &id,
            "--operator",
            "ops",
            "--reason",
            "obs test",
        ],
        &cfg,
    );
    assert_eq!(code, 0, "{out}");
    eventually(Duration::from_secs(20), || async {
        let s = scrape();
        Ok(["parked", "blocked"].iter().all(|st| {
            metric(&s, obs::PARKED, &[("event_type", "Big"), ("state", st)]) == Some(0.0)
        }) && metric(&s, obs::PARKED_OLDEST_AGE, &[("event_type", "Big")]) == Some(0.0))
    })
    .await?;

    // Alert rules and the dashboard only use exported names.
    let (code, rules) = outboxd_cli(&["alerts"], &cfg);
    assert_eq!(code, 0, "{rules}");
    assert!(
        rules.contains("event_type=\\\"Shipped\\\"}) > 60"),
        "{rules}"
    );
    let dashboard = std::fs::read_to_string(
        outboxd_tests::testkit::workspace_root().join("docs/grafana-dashboard.json"),
    )?;
    let _: serde_json::Value = serde_json::from_str(&dashboard)?;
    let known: Vec<&str> = obs::METRICS.iter().map(|(n, _)| *n).collect();
    for n in names_in(&rules).iter().chain(names_in(&dashboard).iter()) {
        assert!(known.contains(&n.as_str()), "{n} is not an exported metric");
    }
    assert!(names_in(&dashboard).len() >= 15);

    let st = relay.sigterm()?;
    assert!(st.success());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_the_slot_moving_while_another_database_is_busy() -> anyhow::Result<()> {
    let mut env = Env::start("hb").await?;
    env.extra_toml = "[heartbeat]\ninterval_ms = 500\nstall_timeout_ms = 5000\n".into();
    let with_hb = Relay::start(env.config()?);
    // A second relay on its own slot with heartbeats off, for comparison.
    let slot_hb = env.slot.clone();
    env.slot = format!("{slot_hb}_nohb");
    env.extra_toml = "[heartbeat]\ninterval_ms = 0\n".into();
    let without = Relay::start(env.config()?);
    let (a, b) = (slot_hb.clone(), env.slot.clone());
    let c = env.sql().await?;
    let lag = |slot: String| {
        let c = &c;
        async move {
            let r = c
                .query_opt(
                    "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await?;
            anyhow::Ok(
                r.and_then(|r| r.get::<_, Option<i64>>(0))
                    .unwrap_or(i64::MAX),
            )
        }
    };
    eventually(Duration::from_secs(30), || async {
        Ok(lag(a.clone()).await? < 1 << 16 && lag(b.clone()).await? < 1 << 20)
    })
    .await?;
    env.pg.create_database("busy").await?;
    let busy = env.pg.connect("busy").await?;
    busy.batch_execute("CREATE TABLE noise (id bigserial primary key, pad text)")
        .await?;
    for _ in 0..15 {
        busy.batch_execute(
            "INSERT INTO noise (pad) SELECT repeat('x', 1000) FROM generate_series(1, 2000)",
        )
        .await?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (la, lb) = (lag(a.clone()).await?, lag(b.clone()).await?);
    eprintln!("slot lag after ~30 MB in another database: heartbeats on {la} B, off {lb} B");
    assert!(la < 1 << 20, "with heartbeats the slot retains {la} bytes");
    with_hb.shutdown().await?;
    without.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_carry_identifiers_but_never_payloads_or_credentials() -> anyhow::Result<()> {
    let mut env = Env::start("logs").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    env.extra_toml = "[log]\nformat = \"json\"\n".into();
    let cfg = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let f = std::fs::File::create(&log)?;
    let mut child = std::process::Command::new(relay_bin())
        .args(["run", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "debug")
        .stdout(f.try_clone()?)
        .stderr(f)
        .spawn()?;
    let c = env.sql().await?;
    let id = Uuid::now_v7();
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers) \
         VALUES ($1, 'parcel', 'p-9', 1, 'Shipped', '{\"card\": \"TOPSECRET-PAYLOAD-7f3a\"}', \
                 '{\"authorization\": \"Bearer TOPSECRET-TOKEN-91c2\"}')",
        &[&id],
    )
    .await?;
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
         VALUES ($1, 'parcel', 'p-9', 2, 'Shipped', jsonb_build_object('blob', 'TOPSECRET-PAYLOAD-7f3a' || repeat('y', 30000)))",
        &[&Uuid::now_v7()],
    )
    .await?;
    eventually(Duration::from_secs(30), || async {
        Ok(std::fs::read_to_string(&log)?.contains("event parked"))
    })
    .await?;
    eventually(Duration::from_secs(30), || async {
        Ok(std::fs::read_to_string(&log)?.contains("\"delivered\""))
    })
    .await?;
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    child.wait()?;
    let text = std::fs::read_to_string(&log)?;
    for secret in [
        "TOPSECRET-PAYLOAD-7f3a",
        "TOPSECRET-TOKEN-91c2",
        outboxd_tests::testkit::PG_PASSWORD,
    ] {
        assert!(!text.contains(secret), "log contains {secret}");
    }
    let delivered = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["fields"]["message"] == "delivered")
        .expect("a JSON delivery line");
    let f = &delivered["fields"];
    assert_eq!(f["event_id"], id.to_string());
    assert_eq!(f["aggregate_id"], "p-9");
    assert_eq!(f["aggregate_version"], "1");
    assert_eq!(f["event_type"], "Shipped");
    assert!(
        f["attempt"].is_u64() && f["partition"].is_i64() && f["offset"].is_i64(),
        "{delivered}"
    );
    Ok(())
}
