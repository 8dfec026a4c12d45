//! Poison events (issue 6): one bad event neither stalls all traffic nor is silently skipped.
//! Real Postgres and broker; librdkafka's mock cluster for broker error codes.

use outboxd_tests::*;
use std::time::Duration;

fn ev(agg: &str, v: i64, event_type: &str, payload: serde_json::Value) -> NewEvent {
    NewEvent::new("acct", agg, v, event_type, payload)
}

fn big() -> serde_json::Value {
    serde_json::json!({"blob": "x".repeat(30_000)})
}

/// Event ids on the topic per aggregate, in topic order (first copies only).
fn by_aggregate(recs: &[Record]) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut seen = std::collections::HashSet::new();
    let mut m: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for r in recs {
        if seen.insert(r.header("event_id").to_string()) {
            m.entry(r.header("aggregate_id").to_string())
                .or_default()
                .push(r.header("aggregate_version").to_string());
        }
    }
    m
}

/// Reads `n` records of the acct topic: versions per aggregate, first copies only.
fn acct_by_aggregate(
    env: &Env,
    n: usize,
) -> anyhow::Result<std::collections::BTreeMap<String, Vec<String>>> {
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        n,
        Duration::from_secs(20),
    )?;
    Ok(by_aggregate(&recs))
}

async fn parked_rows(env: &Env) -> anyhow::Result<Vec<(String, String, String, i32, String)>> {
    let c = env.sql().await?;
    Ok(c.query(
        "SELECT event_id, state, error_class, attempts, error_message FROM outbox_parked ORDER BY id",
        &[],
    )
    .await?
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
    .collect())
}

async fn caught_up(env: &Env) -> anyhow::Result<()> {
    eventually(Duration::from_secs(30), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_event_parks_followers_then_retry_releases_them_in_order() -> anyhow::Result<()> {
    let mut env = Env::start("poison_agg").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    create_topics(&env.bootstrap(), &["outbox.event.acct"], 2).await?;
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let a1 = ev("A", 1, "Deposited", big());
    write_events(&mut c, std::slice::from_ref(&a1), false).await?;
    write_events(
        &mut c,
        &[ev("B", 1, "Deposited", serde_json::json!({"n": 1}))],
        false,
    )
    .await?;
    write_events(
        &mut c,
        &[ev("A", 2, "Deposited", serde_json::json!({"n": 2}))],
        false,
    )
    .await?;
    write_events(
        &mut c,
        &[
            ev("A", 3, "Deposited", serde_json::json!({"n": 3})),
            ev("B", 2, "Deposited", serde_json::json!({"n": 4})),
        ],
        false,
    )
    .await?;
    // The slot passes everything: the poison event and its followers are durably parked.
    caught_up(&env).await?;
    let rows = parked_rows(&env).await?;
    let states: Vec<(&str, &str)> = rows.iter().map(|r| (r.1.as_str(), r.2.as_str())).collect();
    assert_eq!(
        states,
        [
            ("parked", "too_large"),
            ("blocked", "blocked"),
            ("blocked", "blocked")
        ]
    );
    assert_eq!(rows[0].0, a1.event_id.to_string());
    let m = acct_by_aggregate(&env, 2)?;
    assert_eq!(
        m.get("B").map(Vec::as_slice),
        Some(&["1".to_string(), "2".to_string()][..]),
        "other aggregates continue"
    );
    assert!(
        !m.contains_key("A"),
        "followers overtook the parked event: {m:?}"
    );

    // Operator repair: corrected payload, same event_id; followers released in version order.
    let cfg = env.config_file()?;
    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"blob": "trimmed"}"#)?;
    let id = a1.event_id.to_string();
    let (code, out) = outboxd_cli(&["parked", "list"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&id) && out.contains("too_large") && out.contains("3 event(s)"),
        "{out}"
    );
    let (code, out) = outboxd_cli(&["parked", "show", &id], &cfg);
    assert!(
        code == 0 && out.contains("Message size too large") || out.contains("too large"),
        "{out}"
    );
    // A 30 KB payload is cut at 1 KiB unless --full (issue 17: 2 MB went to the terminal).
    assert!(
        out.len() < 5_000 && out.contains("--full shows everything"),
        "{}",
        out.len()
    );
    let (code, out) = outboxd_cli(&["parked", "show", &id, "--full"], &cfg);
    assert!(code == 0 && out.len() > 30_000, "{}", out.len());
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "retry",
            &id,
            "--payload",
            fixed.to_str().unwrap(),
            "--operator",
            "alice",
            "--reason",
            "trim blob",
        ],
        &cfg,
    );
    assert_eq!(code, 0, "{out}");
    let mut recs = Vec::new();
    for _ in 0..50 {
        recs = read_topic(
            &env.bootstrap(),
            "outbox.event.acct",
            5,
            Duration::from_secs(2),
        )?;
        if by_aggregate(&recs).get("A").map(Vec::len) == Some(3) {
            break;
        }
    }
    let m = by_aggregate(&recs);
    assert_eq!(m["A"], ["1", "2", "3"], "released in order");
    let a1_rec = recs.iter().find(|r| r.header("event_id") == id).unwrap();
    assert_eq!(a1_rec.value, br#"{"blob": "trimmed"}"#);
    assert_eq!(a1_rec.header("aggregate_version"), "1");
    let states: Vec<String> = parked_rows(&env).await?.into_iter().map(|r| r.1).collect();
    assert_eq!(states, ["delivered", "delivered", "delivered"]);
    let audit = c
        .query_one("SELECT operator, reason, old_payload IS NOT NULL FROM outbox_parked_audit WHERE event_id = $1", &[&id])
        .await?;
    assert_eq!(
        (
            audit.get::<_, String>(0),
            audit.get::<_, String>(1),
            audit.get::<_, bool>(2)
        ),
        ("alice".into(), "trim blob".into(), true)
    );
    // After the release, new events of A flow directly again.
    write_events(
        &mut c,
        &[ev("A", 4, "Deposited", serde_json::json!({"n": 5}))],
        false,
    )
    .await?;
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        6,
        Duration::from_secs(20),
    )?;
    assert_eq!(by_aggregate(&recs)["A"], ["1", "2", "3", "4"]);
    relay.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_none_lets_followers_pass_and_discard_is_audited() -> anyhow::Result<()> {
    let mut env = Env::start("poison_none").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    env.extra_toml = "[policy.event_types.EmailRequested]\nordering = \"none\"\n".into();
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let bad = ev("U", 1, "EmailRequested", big());
    write_events(&mut c, std::slice::from_ref(&bad), false).await?;
    write_events(
        &mut c,
        &[ev("U", 2, "EmailRequested", serde_json::json!({"to": "x"}))],
        false,
    )
    .await?;
    caught_up(&env).await?;
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        1,
        Duration::from_secs(20),
    )?;
    assert_eq!(
        by_aggregate(&recs)["U"],
        ["2"],
        "follower passes under ordering = none"
    );
    let rows = parked_rows(&env).await?;
    assert_eq!(rows.len(), 1);
    let cfg = env.config_file()?;
    let id = bad.event_id.to_string();
    let (code, out) = outboxd_cli(&["parked", "discard", &id, "--operator", "bob"], &cfg);
    assert_ne!(code, 0, "discard without a reason must fail: {out}");
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "discard",
            &id,
            "--operator",
            "bob",
            "--reason",
            "user deleted",
        ],
        &cfg,
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(parked_rows(&env).await?[0].1, "discarded");
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox_parked_audit WHERE action = 'discard'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(n, 1);
    relay.shutdown().await?;
    Ok(())
}

/// A relay that refuses records over 20 kB (so `big()` is poison), already past version 1 of
/// `agg` (an event of `event_type`).
async fn relay_past_one_event(
    name: &str,
    extra_toml: &str,
    (agg, event_type): (&str, &str),
) -> anyhow::Result<(Env, Relay, tokio_postgres::Client)> {
    let mut env = Env::start(name).await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    env.extra_toml = extra_toml.into();
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    write_events(
        &mut c,
        &[ev(agg, 1, event_type, serde_json::json!({"n": 1}))],
        false,
    )
    .await?;
    caught_up(&env).await?;
    Ok((env, relay, c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn halt_mode_stops_and_holds_the_slot() -> anyhow::Result<()> {
    let (env, relay, mut c) = relay_past_one_event(
        "poison_halt",
        "[policy.event_types.BalanceChanged]\non_poison = \"halt\"\n",
        ("W", "BalanceChanged"),
    )
    .await?;
    // Inside the halting event's transaction: the slot may move over WAL before it (the
    // relay's own status row), never to or past it.
    let inside = write_events_returning_lsn(&mut c, &[ev("W", 2, "BalanceChanged", big())]).await?;
    write_events(
        &mut c,
        &[ev("Z", 1, "BalanceChanged", serde_json::json!({"d": 3}))],
        false,
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        !relay.is_finished(),
        "halt keeps the process up (not ready), it does not exit"
    );
    let confirmed = env.confirmed_lsn().await?;
    assert!(
        confirmed <= inside,
        "slot advanced past a halting event: confirmed {confirmed:X}, event at {inside:X}"
    );
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        1,
        Duration::from_secs(5),
    )?;
    assert_eq!(
        recs.len(),
        1,
        "nothing after the halting event is published"
    );
    assert!(parked_rows(&env).await?.is_empty(), "halt does not park");
    // `outboxd status` shows the halt, the failure class and when the next attempt comes.
    let (code, out) = outboxd_cli(&["status", "--json"], &env.config_file()?);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(v["reported"]["halted"], true, "{v}");
    assert_eq!(v["reported"]["last_error_class"], "halted", "{v}");
    assert!(v["reported"]["attempt"].as_i64() >= Some(1), "{v}");
    assert!(
        v["reported"]["next_attempt_in_seconds"].as_f64().is_some(),
        "{v}"
    );
    relay.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_invalid_event_is_parked_with_a_useful_message() -> anyhow::Result<()> {
    let mut env = Env::start("poison_schema").await?;
    let schemas = env.dir.path().join("schemas");
    std::fs::create_dir_all(schemas.join("Deposited"))?;
    std::fs::write(
        schemas.join("Deposited/1.json"),
        r#"{"type": "object", "required": ["amount"], "properties": {"amount": {"type": "integer", "minimum": 1}}}"#,
    )?;
    env.extra_toml = format!("[validation]\nschema_dir = \"{}\"\n", schemas.display());
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    write_events(
        &mut c,
        &[ev("S", 1, "Deposited", serde_json::json!({"amount": -5}))],
        false,
    )
    .await?;
    write_events(
        &mut c,
        &[ev("T", 1, "Deposited", serde_json::json!({"amount": 5}))],
        false,
    )
    .await?;
    caught_up(&env).await?;
    let rows = parked_rows(&env).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].2, "schema_invalid");
    assert!(
        rows[0].4.contains("Deposited/1.json") && rows[0].4.contains("minimum"),
        "{}",
        rows[0].4
    );
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        1,
        Duration::from_secs(20),
    )?;
    assert_eq!(by_aggregate(&recs).keys().collect::<Vec<_>>(), ["T"]);
    relay.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_parking_and_confirming_loses_nothing_and_parks_once() -> anyhow::Result<()> {
    let mut env = Env::start("poison_crash").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    let cfg = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let mut c = env.sql().await?;
    let mut relay =
        RelayProcess::spawn_with_env(&cfg, log.clone(), &[("OUTBOXD_FAILPOINTS", "parked")])?;
    let bad = ev("P", 1, "Deposited", big());
    write_events(
        &mut c,
        &[
            bad.clone(),
            ev("Q", 1, "Deposited", serde_json::json!({"ok": 1})),
        ],
        false,
    )
    .await?;
    let st = relay.wait_exit(Duration::from_secs(30))?;
    let text = std::fs::read_to_string(env.dir.path().join("relay.log")).unwrap_or_default();
    assert!(!st.success(), "the failpoint aborts the relay: {text}");
    assert!(text.contains("failpoint parked"), "{text}");
    assert_eq!(parked_rows(&env).await?.len(), 1, "parked before the crash");
    let relay2 = RelayProcess::spawn(&cfg, log)?;
    caught_up(&env).await?;
    let rows = parked_rows(&env).await?;
    assert_eq!(rows.len(), 1, "not double-parked");
    assert!(rows[0].3 >= 2, "the replay counted as another attempt");
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        1,
        Duration::from_secs(20),
    )?;
    assert_eq!(by_aggregate(&recs).keys().collect::<Vec<_>>(), ["Q"]);
    drop(relay2);
    Ok(())
}

/// The parking table locked by someone else (a long maintenance transaction): parking cannot
/// finish, so the session gives up after its SQL bound and retries, reports why, and never
/// moves the slot past the event. Once the lock goes, the event is parked once and its
/// neighbours flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parking_behind_a_lock_retries_and_never_skips() -> anyhow::Result<()> {
    let (env, relay, mut c) = relay_past_one_event("poison_lock", "", ("K", "Deposited")).await?;
    let mut locker = env.sql().await?;
    let lock = locker.transaction().await?;
    lock.batch_execute("LOCK TABLE outbox_parked IN ACCESS EXCLUSIVE MODE")
        .await?;
    let bad = ev("K", 2, "Deposited", big());
    let at = write_events_returning_lsn(&mut c, std::slice::from_ref(&bad)).await?;
    write_events(
        &mut c,
        &[ev("L", 1, "Deposited", serde_json::json!({"n": 2}))],
        false,
    )
    .await?;
    let cfg = env.config_file()?;
    eventually(Duration::from_secs(40), || async {
        let (code, out) = outboxd_cli(&["status", "--json"], &cfg);
        anyhow::ensure!(code == 0, "{out}");
        let v: serde_json::Value = serde_json::from_str(&out)?;
        // `status` itself does not hang on the lock: it says what it could not read.
        anyhow::ensure!(v["parked"]["unavailable"].is_string(), "{v}");
        Ok(v["reported"]["last_error_class"] == "postgres"
            && v["reported"]["last_error"]
                .as_str()
                .is_some_and(|m| m.contains("pg_locks")))
    })
    .await?;
    assert!(
        !relay.is_finished(),
        "a lock is transient: the relay stays up"
    );
    let confirmed = env.confirmed_lsn().await?;
    assert!(
        confirmed <= at,
        "slot passed an event it could not park: confirmed {confirmed:X}, event at {at:X}"
    );
    lock.rollback().await?;
    caught_up(&env).await?;
    let rows = parked_rows(&env).await?;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].0, bad.event_id.to_string());
    let m = acct_by_aggregate(&env, 2)?;
    assert_eq!(
        (m["K"].as_slice(), m["L"].as_slice()),
        (&["1".to_string()][..], &["1".to_string()][..])
    );
    relay.shutdown().await?;
    Ok(())
}
