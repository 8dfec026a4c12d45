//! Delete-after-insert outboxes (issue 40, R47): the relay keeps what it needs to release a
//! parked or held event (the record as it would have produced it, with an integrity tag only
//! its key makes), so one operator decision per poison releases the aggregate in order without
//! the outbox row, and nothing written through the database alone is ever published.

use outboxd_tests::*;
use std::time::Duration;

const ACCT: &str = "outbox.event.acct";
/// The relay's integrity key in these tests (`OUTBOXD_PARKED_KEY`, or `parked.key_file`).
const KEY: &str = "test-only-parked-integrity-key-0123456789abcdef";

fn ev(agg: &str, v: i64, payload: serde_json::Value) -> NewEvent {
    NewEvent::new("acct", agg, v, "Deposited", payload)
}

/// Too large for the broker of [`env`] (`message.max.bytes` = 20000).
fn big() -> serde_json::Value {
    serde_json::json!({"blob": "x".repeat(30_000)})
}

/// An env whose broker refuses records over 20 KB.
async fn env(name: &str) -> anyhow::Result<Env> {
    let mut env = Env::start(name).await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    Ok(env)
}

/// The relay of `env` with the integrity key from the environment.
fn relay_with_key(env: &Env) -> anyhow::Result<Relay> {
    Ok(Relay::start(outboxd::Config::from_toml_and_env(
        &env.toml(),
        [("OUTBOXD_PARKED_KEY".to_string(), KEY.to_string())],
    )?))
}

/// Makes the outbox a delete-after-insert table: an AFTER INSERT trigger deletes each row in
/// its own transaction, so only the WAL carries the event (Debezium's recommended pattern).
async fn delete_after_insert(c: &tokio_postgres::Client) -> anyhow::Result<()> {
    c.batch_execute(
        "CREATE FUNCTION outbox_gone() RETURNS trigger LANGUAGE plpgsql AS $$ \
           BEGIN DELETE FROM outbox WHERE event_id = NEW.event_id; RETURN NULL; END $$; \
         CREATE TRIGGER outbox_gone AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION outbox_gone()",
    )
    .await?;
    Ok(())
}

/// (event_id, state, error_class) of every parked row, in stream order.
async fn parked(c: &tokio_postgres::Client) -> anyhow::Result<Vec<(String, String, String)>> {
    Ok(c.query(
        "SELECT event_id, state, error_class FROM outbox_parked ORDER BY id",
        &[],
    )
    .await?
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect())
}

/// Versions of aggregate `agg` on the acct topic, in topic order (first copies only), once
/// `n` records are there.
fn versions_of(env: &Env, agg: &str, n: usize) -> anyhow::Result<Vec<i64>> {
    let recs = read_topic(&env.bootstrap(), ACCT, n, Duration::from_secs(30))?;
    let mut seen = std::collections::HashSet::new();
    Ok(recs
        .iter()
        .filter(|r| {
            r.header("aggregate_id") == agg && seen.insert(r.header("event_id").to_string())
        })
        .map(|r| r.header("aggregate_version").parse().unwrap())
        .collect())
}

/// A poison of A with 10 held followers; one `parked retry --payload` (`discard`: one
/// `parked discard`) delivers all 11 (the 10) in version order, and nothing stays parked.
async fn one_retry_releases_the_aggregate(
    name: &str,
    deletes: bool,
    discard: bool,
) -> anyhow::Result<()> {
    let env = env(name).await?;
    create_topics(&env.bootstrap(), &[ACCT], 1).await?;
    let mut c = env.sql().await?;
    if deletes {
        delete_after_insert(&c).await?;
    }
    let relay = relay_with_key(&env)?;
    let head = ev("A", 1, big());
    write_events(&mut c, std::slice::from_ref(&head), false).await?;
    for v in 2..=11 {
        write_events(&mut c, &[ev("A", v, serde_json::json!({"n": v}))], false).await?;
    }
    write_events(&mut c, &[ev("B", 1, serde_json::json!({"n": 0}))], false).await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let rows = parked(&c).await?;
    assert_eq!(rows.len(), 11, "{rows:?}");
    assert!(rows[1..].iter().all(|r| r.1 == "blocked"), "{rows:?}");
    if deletes {
        let left: i64 = c
            .query_one("SELECT count(*) FROM outbox", &[])
            .await?
            .get(0);
        assert_eq!(left, 0, "the trigger deletes every row");
    }

    let cfg = env.config_file()?;
    // `status` names the stuck aggregate, its head and what it holds.
    let (_, out) = outboxd_cli(&["status"], &cfg);
    let stuck = out
        .lines()
        .find(|l| l.contains("acct/A behind"))
        .unwrap_or_default();
    assert!(
        stuck.contains(&head.event_id.to_string())
            && stuck.contains("too_large")
            && stuck.contains("10 held"),
        "{out}"
    );
    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"blob": "trimmed"}"#)?;
    let started = std::time::Instant::now();
    let id = head.event_id.to_string();
    let payload = fixed.to_str().unwrap();
    let (code, out) = match discard {
        false => outboxd_cli(
            &[
                "parked",
                "retry",
                &id,
                "--payload",
                payload,
                "--reason",
                "trim blob",
            ],
            &cfg,
        ),
        true => outboxd_cli(&["parked", "discard", &id, "--reason", "obsolete"], &cfg),
    };
    assert_eq!(code, 0, "{out}");
    eventually(Duration::from_secs(30), || async {
        Ok(parked(&c).await?[1..].iter().all(|r| r.1 == "delivered"))
    })
    .await?;
    let head_state = &parked(&c).await?[0].1;
    assert_eq!(head_state, if discard { "discarded" } else { "delivered" });
    // The one decision is in the audit trail of every event it released, by name and reason.
    let followers: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox_parked_audit WHERE event_id <> $1 AND action = 'retry' \
             AND reason LIKE 'held behind ' || $1 || ', released by its %'",
            &[&id],
        )
        .await?
        .get(0);
    assert_eq!(followers, 10);
    eprintln!(
        "{name}: 1 decision released the aggregate in {:?}",
        started.elapsed()
    );
    let first = if discard { 2 } else { 1 };
    let n = 12 - first as usize + 1;
    assert_eq!(versions_of(&env, "A", n)?, (first..=11).collect::<Vec<_>>());
    assert_eq!(versions_of(&env, "B", n)?, [1]);
    relay.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_after_insert_one_retry_releases_ten_held_followers_in_order() -> anyhow::Result<()>
{
    one_retry_releases_the_aggregate("integrity_dai", true, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_after_insert_one_discard_releases_ten_held_followers_in_order() -> anyhow::Result<()>
{
    one_retry_releases_the_aggregate("integrity_dai_discard", true, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_table_one_retry_releases_ten_held_followers_in_order() -> anyhow::Result<()> {
    one_retry_releases_the_aggregate("integrity_ord", false, false).await
}

async fn connect(dsn: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (c, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(c)
}

/// Waits until `id`'s row is parked with error class `class` after at least `attempts`.
async fn refused_as(
    c: &tokio_postgres::Client,
    id: &str,
    class: &str,
    attempts: i32,
) -> anyhow::Result<i32> {
    let row = || async {
        let r = c
            .query_one(
                "SELECT state, error_class, attempts FROM outbox_parked WHERE event_id = $1",
                &[&id],
            )
            .await?;
        anyhow::Ok((
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, i32>(2),
        ))
    };
    eventually(Duration::from_secs(30), || async {
        let (state, c, n) = row().await?;
        Ok(state == "parked" && c == class && n >= attempts)
    })
    .await
    .map_err(|e| anyhow::anyhow!("{id} not refused as {class}: {e}"))?;
    Ok(row().await?.2)
}

/// With the relay's database credential (sql/roles.sql), rows forged into `outbox_parked` —
/// an exact copy of a delivered event whose outbox row is there, an event never written, one
/// carrying a real row's tag, a parked head — are never published, not behind a resolved head
/// and not when an operator retries them one by one; the relay's own held event is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_forged_with_the_relay_credential_are_never_published() -> anyhow::Result<()> {
    let env = env("integrity_forged").await?;
    create_topics(&env.bootstrap(), &[ACCT], 1).await?;
    let app = env.sql().await?;
    let roles = include_str!("../../sql/roles.sql");
    let (create, grants) = roles.split_once("-- ---- 2.").expect("two blocks");
    app.batch_execute(create).await?;
    app.batch_execute(&format!("--{grants}")).await?;
    let pg = format!("postgres:{}@", testkit::PG_PASSWORD);
    let as_role = |role: &str, pw: &str| {
        env.toml()
            .replace(&pg, &format!("{role}:{pw}@"))
            .replace("[relay]\n", "[relay]\nrepair_interval_ms = 200\n")
    };
    let repair = env.dir.path().join("repair.toml");
    std::fs::write(&repair, as_role("outboxd_repair", "change-me-repair"))?;
    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &as_role("outboxd_relay", "change-me-relay"),
        [("OUTBOXD_PARKED_KEY".to_string(), KEY.to_string())],
    )?);
    // F (X v0) is delivered; P1 (X v1) too large, parked; P2 (X v2) held behind it.
    let (f, p1, p2) = (
        ev("X", 0, serde_json::json!({"n": 0})),
        ev("X", 1, big()),
        ev("X", 2, serde_json::json!({"n": 2})),
    );
    let mut c = env.sql().await?;
    for e in [&f, &p1, &p2] {
        write_events(&mut c, std::slice::from_ref(e), false).await?;
    }
    env.caught_up(Duration::from_secs(30)).await?;

    let r = connect(
        &env.pg
            .dsn(&env.db)
            .replace(&pg, "outboxd_relay:change-me-relay@"),
    )
    .await?;
    let slot = &env.slot;
    let cols = "slot, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, \
                topic, payload, headers, state, blocks_aggregate, blocked_by, error_class, \
                error_message, integrity_tag";
    let (never, stolen, head) = (
        uuid::Uuid::now_v7().to_string(),
        uuid::Uuid::now_v7().to_string(),
        uuid::Uuid::now_v7().to_string(),
    );
    let (fs, p1s, p2s) = (
        f.event_id.to_string(),
        p1.event_id.to_string(),
        p2.event_id.to_string(),
    );
    r.batch_execute(&format!(
        "INSERT INTO outbox_parked ({cols}) VALUES \
           ('{slot}', '{fs}', 'acct', 'X', 0, 'Deposited', '{ACCT}', '{{\"n\": 0}}', '[]', 'blocked', true, '{p1s}', 'blocked', 'x', NULL), \
           ('{slot}', '{never}', 'acct', 'X', 3, 'Deposited', '{ACCT}', '{{\"n\": 3}}', '[]', 'blocked', true, '{p1s}', 'blocked', 'x', NULL), \
           ('{slot}', '{stolen}', 'acct', 'X', 4, 'Deposited', '{ACCT}', '{{\"n\": 4}}', '[]', 'blocked', true, '{p1s}', 'blocked', 'x', \
              (SELECT integrity_tag FROM outbox_parked WHERE event_id = '{p2s}')), \
           ('{slot}', '{head}', 'acct', 'Z', 1, 'Deposited', '{ACCT}', '{{\"n\": 9}}', '[]', 'parked', true, NULL, 'x', 'x', NULL)"
    ))
    .await?;
    let tagged: i64 = app
        .query_one(
            "SELECT count(*) FROM outbox_parked WHERE integrity_tag IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(tagged, 3, "the relay seals what it parks and holds");

    let cli = |args: &[&str]| {
        let (code, out) = outboxd_cli(args, &repair);
        assert_eq!(code, 0, "{args:?}: {out}");
    };
    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"blob": "trimmed"}"#)?;
    let payload = fixed.to_str().unwrap();
    cli(&[
        "parked",
        "retry",
        &p1s,
        "--payload",
        payload,
        "--reason",
        "fixed",
    ]);
    // The copy of F heads X once P1 and P2 are out; an operator retrying it gets nowhere.
    let n = refused_as(&app, &fs, "untagged", 1).await?;
    cli(&["parked", "retry", &fs, "--reason", "looks real"]);
    refused_as(&app, &fs, "untagged", n + 1).await?;
    cli(&["parked", "discard", &fs, "--reason", "forged"]);
    let n = refused_as(&app, &never, "untagged", 1).await?;
    cli(&["parked", "retry", &never, "--reason", "scripted"]);
    refused_as(&app, &never, "untagged", n + 1).await?;
    cli(&["parked", "discard", &never, "--reason", "forged"]);
    let n = refused_as(&app, &stolen, "forged", 1).await?;
    cli(&["parked", "retry", &stolen, "--reason", "scripted"]);
    refused_as(&app, &stolen, "forged", n + 1).await?;
    cli(&["parked", "retry", &head, "--reason", "scripted"]);
    refused_as(&app, &head, "untagged", 2).await?;
    let (_, out) = outboxd_cli(&["parked", "list"], &repair);
    assert!(out.contains("forged") && out.contains("untagged"), "{out}");

    // On the topic: F once, P1 with the operator's payload, P2; nothing forged.
    let recs = read_topic(&env.bootstrap(), ACCT, 3, Duration::from_secs(10))?;
    let seen: Vec<(String, Vec<u8>)> = recs
        .iter()
        .map(|r| (r.header("event_id").to_string(), r.value.clone()))
        .collect();
    assert_eq!(
        seen,
        [
            (fs.clone(), br#"{"n": 0}"#.to_vec()),
            (p1s, br#"{"blob": "trimmed"}"#.to_vec()),
            (p2s, br#"{"n": 2}"#.to_vec()),
        ]
    );
    relay.shutdown().await?;
    Ok(())
}

/// The store is bounded (`[parked] max_record_bytes`, `max_open_bytes`): past a bound the relay
/// halts at the event (the slot keeps it; nothing is parked past the bound, nothing dropped,
/// nothing after it delivered), and goes on once the bound allows it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_parked_store_bounds_the_relay_halts_and_drops_nothing() -> anyhow::Result<()> {
    let env = env("integrity_bounds").await?;
    create_topics(&env.bootstrap(), &[ACCT], 1).await?;
    let mut c = env.sql().await?;
    let q_sql = env.sql().await?;
    let bounded = |record: &str, open: &str| {
        outboxd::Config::from_toml_and_env(
            &env.toml(),
            [
                ("OUTBOXD_PARKED_KEY".to_string(), KEY.to_string()),
                ("OUTBOXD_PARKED_MAX_RECORD_BYTES".into(), record.into()),
                ("OUTBOXD_PARKED_MAX_OPEN_BYTES".into(), open.into()),
            ],
        )
    };
    let count = |sql: &'static str| {
        let c = &q_sql;
        async move { anyhow::Ok(c.query_one(sql, &[]).await?.get::<_, i64>(0)) }
    };
    // Too large for the broker (30 KB) and for max_record_bytes (20 000): halts, parks nothing.
    let relay = Relay::start(bounded("20000", "40000")?);
    let (p, q) = (ev("P", 1, big()), ev("Q", 1, big()));
    write_events(&mut c, std::slice::from_ref(&p), false).await?;
    write_events(&mut c, &[ev("B", 1, serde_json::json!({"n": 1}))], false).await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(count("SELECT count(*) FROM outbox_parked").await?, 0);
    assert!(
        env.confirmed_lsn().await? < env.current_lsn().await?,
        "the slot keeps it"
    );
    assert!(!relay.is_finished(), "halted, retrying: not stopped");
    relay.shutdown().await?;
    // Room for one record, not two: P parks, then Q (another aggregate) halts the relay.
    let relay = Relay::start(bounded("35000", "40000")?);
    eventually(Duration::from_secs(30), || async {
        Ok(count("SELECT count(*) FROM outbox_parked").await? == 1)
    })
    .await?;
    assert_eq!(
        versions_of(&env, "B", 1)?,
        [1],
        "what follows P is delivered"
    );
    write_events(&mut c, std::slice::from_ref(&q), false).await?;
    write_events(&mut c, &[ev("B", 2, serde_json::json!({"n": 2}))], false).await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        count("SELECT count(*) FROM outbox_parked").await?,
        1,
        "Q is not parked"
    );
    assert_eq!(
        versions_of(&env, "B", 1)?,
        [1],
        "nothing after Q is delivered"
    );
    // Resolving P makes room: the halted relay parks Q and goes on.
    let cfg = env.config_file()?;
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "discard",
            &p.event_id.to_string(),
            "--reason",
            "too big",
        ],
        &cfg,
    );
    assert_eq!(code, 0, "{out}");
    eventually(Duration::from_secs(30), || async {
        Ok(
            count("SELECT count(*) FROM outbox_parked WHERE state = 'parked'").await? == 1
                && count("SELECT count(*) FROM outbox_parked").await? == 2,
        )
    })
    .await?;
    assert_eq!(versions_of(&env, "B", 2)?, [1, 2]);
    relay.shutdown().await?;
    Ok(())
}
