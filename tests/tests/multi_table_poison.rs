//! Poison events with several outbox tables (issue 30, R44): each table's own policy and
//! schemas (`[source.tables.policy]`, `[source.tables.validation]`), holds per table (a parked
//! event of table T holds later events of its aggregate in T only), parked events of no table
//! or of a table no longer listed, and the configurations that are refused.
//!
//! The tables and helpers are `outboxd_tests::multi`'s: `billing.outbox` and `shipping.outbox`
//! (outboxd's shape) and `legacy.outbox` (Debezium's), the same aggregate ids in each.

use outboxd_tests::multi::*;
use outboxd_tests::*;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// `(event_id, state, error_class)` of every parked row, oldest first.
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

async fn wait_parked(c: &tokio_postgres::Client, n: usize) -> anyhow::Result<()> {
    eventually(Duration::from_secs(30), || async {
        Ok(parked(c).await?.len() == n)
    })
    .await
}

fn big(v: i64) -> serde_json::Value {
    serde_json::json!({"v": v, "blob": "x".repeat(30_000)})
}

/// Waits until `event_id` is on `topic`; how long that took.
fn arrival(env: &Env, topic: &str, event_id: Uuid) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        let recs = read_topic(&env.bootstrap(), topic, 1, Duration::from_millis(500))?;
        if recs
            .iter()
            .any(|r| r.header("event_id") == event_id.to_string())
        {
            return Ok(start.elapsed());
        }
    }
    anyhow::bail!("{event_id} never reached {topic}")
}

/// `[policy] on_poison = "halt"` for the relay, `"park"` for billing. A poison event in
/// billing parks and holds billing's later events of its aggregate only: shipping's events of
/// the same aggregate id flow on, undelayed. A poison event in shipping (no policy of its own:
/// the top-level one) halts the relay, and nothing past it is confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_parks_or_halts_per_its_tables_policy() -> anyhow::Result<()> {
    let (mut env, _) = tables_env(
        "mtp_policy",
        "[policy]\non_poison = \"halt\"\n",
        &tables_toml("policy = { on_poison = \"park\" }", ""),
    )
    .await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let tx = c.transaction().await?;
    let poison = insert(&tx, "billing.outbox", "P", 1, big(1)).await?;
    tx.commit().await?;
    wait_parked(&c, 1).await?;

    let tx = c.transaction().await?;
    let follower = insert(&tx, "billing.outbox", "P", 2, serde_json::json!({"v": 2})).await?;
    let same_id = insert(&tx, "shipping.outbox", "P", 1, serde_json::json!({"v": 1})).await?;
    tx.commit().await?;
    let took = arrival(&env, "shipping.events", same_id)?;
    eprintln!("shipping's P behind billing's parked P: delivered in {took:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    let mut written = write_rounds(&mut c, 1, 3).await?;
    written.get_mut("shipping.outbox").unwrap().push(same_id);
    delivered(&env, &written)?;
    assert_eq!(
        parked(&c).await?,
        [
            (poison.to_string(), "parked".into(), "too_large".into()),
            (follower.to_string(), "blocked".into(), "blocked".into()),
        ]
    );

    // Shipping's own poison event: the top-level policy halts.
    let tx = c.transaction().await?;
    insert(&tx, "shipping.outbox", "H", 1, big(1)).await?;
    tx.commit().await?;
    let lsn = env.current_lsn().await?;
    let config = env.config_file()?;
    eventually(Duration::from_secs(30), || async {
        let (_, out) = outboxd_cli(&["status", "--json"], &config);
        let v: serde_json::Value = serde_json::from_str(&out)?;
        Ok(v["reported"]["halted"] == true)
    })
    .await?;
    assert!(env.confirmed_lsn().await? < lsn, "confirmed past the halt");
    assert_eq!(parked(&c).await?.len(), 2, "halt parks nothing");
    relay.shutdown().await?;
    Ok(())
}

/// Billing validates against a schema of its own; shipping validates nothing. The same
/// payload is parked in billing (`schema_invalid`) and delivered from shipping; a corrected
/// payload for billing's parked event is checked against billing's schema too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tables_schema_rejects_what_another_accepts() -> anyhow::Result<()> {
    let schemas = testkit::tempdir("mtp-schemas")?;
    std::fs::create_dir_all(schemas.path().join("Deposited"))?;
    std::fs::write(
        schemas.path().join("Deposited/1.json"),
        r#"{"type": "object", "required": ["v"], "properties": {"v": {"type": "integer", "maximum": 100}}}"#,
    )?;
    let billing = format!(
        "validation = {{ schema_dir = \"{}\" }}",
        schemas.path().display()
    );
    let (env, _) = tables_env("mtp_schema", "", &tables_toml(&billing, "")).await?;
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let tx = c.transaction().await?;
    let rejected = insert(
        &tx,
        "billing.outbox",
        "S",
        1,
        serde_json::json!({"v": 1000}),
    )
    .await?;
    let accepted = insert(
        &tx,
        "shipping.outbox",
        "S",
        1,
        serde_json::json!({"v": 1000}),
    )
    .await?;
    let fine = insert(&tx, "billing.outbox", "T", 1, serde_json::json!({"v": 5})).await?;
    tx.commit().await?;
    arrival(&env, "shipping.events", accepted)?;
    arrival(&env, "billing.acct", fine)?;
    wait_parked(&c, 1).await?;
    assert_eq!(
        parked(&c).await?,
        [(
            rejected.to_string(),
            "parked".into(),
            "schema_invalid".into()
        )]
    );
    let config = env.config_file()?;
    let (_, out) = outboxd_cli(&["check"], &config);
    let dir = schemas.path().display().to_string();
    assert!(
        out.lines()
            .any(|l| l.contains("ok    schemas of billing.outbox ") && l.ends_with(&dir)),
        "{out}"
    );

    // The retry's correction goes through billing's schema, not the shared (absent) one.
    let fix = |v: i64| -> anyhow::Result<String> {
        let p = env.dir.path().join(format!("fix-{v}.json"));
        std::fs::write(&p, format!("{{\"v\": {v}}}"))?;
        Ok(p.display().to_string())
    };
    let id = rejected.to_string();
    let retry = |payload: String| {
        outboxd_cli(
            &[
                "parked",
                "retry",
                &id,
                "--payload",
                &payload,
                "--reason",
                "r",
            ],
            &config,
        )
    };
    let (code, out) = retry(fix(500)?);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("fails the event's schema"), "{out}");
    let (code, out) = retry(fix(50)?);
    assert_eq!(code, 0, "{out}");
    arrival(&env, "billing.acct", rejected)?;
    relay.shutdown().await?;
    Ok(())
}

/// A one-table relay parks a poison event (its record names no table); then the relay lists
/// several tables. The old parked event holds its aggregate in every table (nothing says which
/// it came from) and is not released; `status` and `parked` say so. A parked event of a table
/// that is no longer listed holds nothing and is reported by name. Discarding the old event
/// releases what waited behind it, each through its own table. The relay also replaces a
/// parking guard of an earlier version (one that holds across tables) when it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_parked_event_without_a_table_holds_everywhere_and_is_reported() -> anyhow::Result<()>
{
    let all = tables_toml("", "");
    let (mut env, _) = tables_env("mtp_old", "", &all).await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    // One table: billing alone (one entry is the one-table shorthand).
    env.extra_toml = "[[source.tables]]\nname = \"billing.outbox\"\n\
                      topic = \"billing.{aggregate_type}\"\n"
        .into();
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let tx = c.transaction().await?;
    let old = insert(&tx, "billing.outbox", "P", 1, big(1)).await?;
    tx.commit().await?;
    wait_parked(&c, 1).await?;
    env.confirmed_past_now(Duration::from_secs(10)).await?;
    relay.shutdown().await?;
    let headers: serde_json::Value = c
        .query_one("SELECT headers FROM outbox_parked", &[])
        .await?
        .get(0);
    assert!(!headers.to_string().contains("source_table"), "{headers}");
    // A parked event of a table this configuration does not list, and a guard of an earlier
    // version (without per-table holds).
    c.batch_execute(&format!(
        "INSERT INTO outbox_parked (slot, event_id, aggregate_type, aggregate_id, event_type, \
           headers, blocks_aggregate, error_class, error_message) \
         VALUES ('{}', 'gone-1', 'acct', 'P', 'Deposited', '[[\"source_table\", \"gone.outbox\"]]', \
           true, 'too_large', 'm'); \
         CREATE OR REPLACE FUNCTION outbox_parked_guard() RETURNS trigger LANGUAGE plpgsql \
           SET search_path = pg_catalog, pg_temp AS $$ BEGIN RETURN NEW; END $$;",
        env.slot
    ))
    .await?;

    env.extra_toml = all;
    let relay = Relay::start(env.config()?);
    let tx = c.transaction().await?;
    let billing_p = insert(&tx, "billing.outbox", "P", 2, serde_json::json!({"v": 2})).await?;
    let shipping_p = insert(&tx, "shipping.outbox", "P", 1, serde_json::json!({"v": 1})).await?;
    tx.commit().await?;
    let written = write_rounds(&mut c, 1, 2).await?;
    delivered(&env, &written)?;
    let guard: String = c
        .query_one(
            "SELECT prosrc FROM pg_proc WHERE oid = 'outbox_parked_guard'::regproc",
            &[],
        )
        .await?
        .get(0);
    assert!(guard.contains("source_table"), "the guard was not upgraded");
    wait_parked(&c, 4).await?;
    // Sorted: shipping.outbox was published but not read by the one-table relay, so the first
    // session that lists it republishes what it holds before streaming (crate::slot::join);
    // shipping's P may then be held before billing's.
    let mut now = parked(&c).await?;
    now[2..].sort();
    let mut held = [billing_p.to_string(), shipping_p.to_string()];
    held.sort();
    assert_eq!(
        now,
        [
            (old.to_string(), "parked".into(), "too_large".into()),
            ("gone-1".into(), "parked".into(), "too_large".into()),
            (held[0].clone(), "blocked".into(), "blocked".into()),
            (held[1].clone(), "blocked".into(), "blocked".into()),
        ],
        "the event of no table holds P in every table; gone.outbox's holds none"
    );
    let blocked_by: Vec<String> = c
        .query(
            "SELECT blocked_by FROM outbox_parked WHERE state = 'blocked' ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(blocked_by, [old.to_string(), old.to_string()]);

    let config = env.config_file()?;
    let (code, out) = outboxd_cli(&["status", "--json"], &config);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let tables = v["tables"].as_array().unwrap();
    let entry = |t: serde_json::Value| tables.iter().find(|e| e["table"] == t).cloned();
    assert_eq!(entry("billing.outbox".into()).unwrap()["open_parked"], 1);
    assert_eq!(entry("shipping.outbox".into()).unwrap()["open_parked"], 1);
    let gone = entry("gone.outbox".into()).unwrap();
    assert_eq!(
        (gone["listed"].clone(), gone["open_parked"].clone()),
        (false.into(), 1.into())
    );
    let none = entry(serde_json::Value::Null).unwrap();
    assert_eq!(
        (none["listed"].clone(), none["open_parked"].clone()),
        (false.into(), 1.into())
    );
    let (_, human) = outboxd_cli(&["status"], &config);
    assert!(
        human.contains("gone.outbox: NOT LISTED, open parked 1"),
        "{human}"
    );
    let (_, list) = outboxd_cli(&["parked", "list"], &config);
    assert!(
        list.contains("gone.outbox (not listed)") && list.contains("(none)"),
        "{list}"
    );
    let (_, show) = outboxd_cli(&["parked", "show", &old.to_string()], &config);
    assert!(show.contains("not released:"), "{show}");
    // Neither is retried through a listed table's mapping.
    let (code, out) = outboxd_cli(
        &["parked", "retry", &old.to_string(), "--reason", "r"],
        &config,
    );
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("one-table configuration"), "{out}");
    let (code, out) = outboxd_cli(&["parked", "retry", "gone-1", "--reason", "r"], &config);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("gone.outbox") && out.contains("does not list"),
        "{out}"
    );

    // Discarding the old event releases both held ones, each through its own table.
    let (code, out) = outboxd_cli(
        &["parked", "discard", &old.to_string(), "--reason", "r"],
        &config,
    );
    assert_eq!(code, 0, "{out}");
    arrival(&env, "billing.acct", billing_p)?;
    arrival(&env, "shipping.events", shipping_p)?;
    relay.shutdown().await?;
    Ok(())
}

/// Per-table policies and schemas that leave open which setting applies are refused before
/// anything connects, naming the entry and the fix.
#[test]
fn ambiguous_table_policies_are_refused_with_the_fix() -> anyhow::Result<()> {
    let dir = testkit::tempdir("mtp-config")?;
    let refused = |tables: &str| -> anyhow::Result<String> {
        let p = dir.path().join("outboxd.toml");
        std::fs::write(
            &p,
            format!(
                "[source]\ndsn = \"postgres://u@127.0.0.1:1/db\"\n\
                 [sink.kafka]\n\"bootstrap.servers\" = \"127.0.0.1:1\"\n{tables}"
            ),
        )?;
        let (code, out) = outboxd_cli(&["check"], &p);
        assert_ne!(code, 0, "{out}");
        Ok(out)
    };
    let out = refused(
        "[policy.event_types.Ledger]\non_poison = \"halt\"\n\
         [[source.tables]]\nname = \"a.outbox\"\npolicy = { on_poison = \"park\" }\n\
         [[source.tables]]\nname = \"b.outbox\"\n",
    )?;
    assert!(
        out.contains("source.tables[0] (a.outbox): policy.on_poison")
            && out.contains("[source.tables.policy.event_types.Ledger]"),
        "{out}"
    );
    let out = refused(
        "[[source.tables]]\nname = \"a.outbox\"\nvalidation = { require_schema = true }\n\
         [[source.tables]]\nname = \"b.outbox\"\n",
    )?;
    assert!(out.contains("schema_dir"), "{out}");
    let out = refused(
        "[[source.tables]]\nname = \"a.outbox\"\n[source.tables.policy]\nordering = \"table\"\n",
    )?;
    assert!(out.contains("ordering") || out.contains("table"), "{out}");
    Ok(())
}

/// A relay with several tables, running as the least-privilege relay role of sql/roles.sql,
/// meets a parking guard of an earlier version (one that holds aggregates across tables) that
/// it may not replace: it refuses to start, naming the fix, rather than fail at every release
/// that is in order. `init` as the admin installs this version's guard and the relay runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_cannot_replace_an_earlier_guard_refuses_several_tables() -> anyhow::Result<()>
{
    let (env, _) = tables_env("mtp_guard", "", &tables_toml("", "")).await?;
    let app = env.sql().await?; // the superuser: application and admin here
    let roles = include_str!("../../sql/roles.sql");
    let (create, grants) = roles.split_once("-- ---- 2.").expect("two blocks");
    app.batch_execute(create).await?;
    app.batch_execute(&format!("--{grants}")).await?;
    app.batch_execute(
        "GRANT USAGE ON SCHEMA billing, shipping, legacy TO outboxd_relay; \
         GRANT SELECT ON billing.outbox, shipping.outbox, legacy.outbox TO outboxd_relay; \
         CREATE OR REPLACE FUNCTION outbox_parked_guard() RETURNS trigger LANGUAGE plpgsql \
           SET search_path = pg_catalog, pg_temp AS $$ BEGIN RETURN NEW; END $$;",
    )
    .await?;
    let relay_cfg = || {
        outboxd::Config::from_toml_and_env(
            &env.toml().replace(
                &format!("postgres:{}@", testkit::PG_PASSWORD),
                "outboxd_relay:change-me-relay@",
            ),
            Vec::<(String, String)>::new(),
        )
    };
    let err = Relay::start(relay_cfg()?).join().await.unwrap_err();
    assert!(
        err.to_string().contains("guard is of an earlier version")
            && err.to_string().contains("outboxd init"),
        "{err}"
    );
    outboxd::init(&env.config()?).await?;
    let relay = Relay::start(relay_cfg()?);
    let mut c = env.sql().await?;
    let written = write_rounds(&mut c, 1, 2).await?;
    delivered(&env, &written)?;
    relay.shutdown().await?;
    Ok(())
}
