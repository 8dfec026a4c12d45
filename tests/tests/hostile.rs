//! Hostile input (issue 15): rows, names and repairs written by someone who wants to bend the
//! relay, or by a careless operator. Each test failed before its fix.

use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

/// A row whose `headers` column sets the relay's own header names would replace the event's
/// identity for consumers (the inbox used to keep the last value it saw): such a row is parked
/// as `reserved_header`, later events of its aggregate wait behind it, and nothing spoofed ever
/// reaches the topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_cannot_spoof_the_relays_headers() -> anyhow::Result<()> {
    let env = Env::start("hostile_headers").await?;
    let relay = Relay::start(env.config()?);
    let c = env.sql().await?;
    let spoofed = Uuid::nil().to_string();
    let insert = "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                  event_type, payload, headers) VALUES ($1, 'acct', $2, $3, 'Deposited', '{}', $4::text::jsonb)";
    // Every reserved name, in any letter case, is refused; other headers pass.
    let mut bad = Vec::new();
    for (i, name) in [
        "event_id",
        "aggregate_version",
        "Event_Type",
        "AGGREGATE_ID",
        "aggregate_type",
        "schema_version",
    ]
    .iter()
    .enumerate()
    {
        let id = Uuid::now_v7();
        let headers = format!(r#"{{"traceparent": "00-1", "{name}": "{spoofed}"}}"#);
        let agg = format!("H{i}");
        c.execute(insert, &[&id, &agg, &1i64, &headers]).await?;
        // The aggregate's next event is held behind the parked one.
        c.execute(
            insert,
            &[&Uuid::now_v7(), &agg, &2i64, &r#"{"n": "2"}"#.to_string()],
        )
        .await?;
        bad.push(id.to_string());
    }
    let good = Uuid::now_v7();
    c.execute(
        insert,
        &[
            &good,
            &"G",
            &1i64,
            &r#"{"traceparent": "00-2"}"#.to_string(),
        ],
    )
    .await?;
    env.caught_up(Duration::from_secs(30)).await?;

    let rows = c
        .query(
            "SELECT event_id, state, error_class, error_message FROM outbox_parked ORDER BY id",
            &[],
        )
        .await?;
    let parked: Vec<(String, String, String, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(parked.len(), 12, "{parked:?}");
    for (id, state, class, message) in parked.iter().filter(|p| p.1 == "parked") {
        assert!(bad.contains(id), "{id} {state}");
        assert_eq!(class, "reserved_header");
        assert!(message.contains("may not override"), "{message}");
    }
    assert_eq!(parked.iter().filter(|p| p.1 == "blocked").count(), 6);

    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        1,
        Duration::from_secs(20),
    )?;
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].header("event_id"), good.to_string());
    assert_eq!(recs[0].header("traceparent"), "00-2");
    // The parked records keep the row's identity, never the spoofed one.
    let stored = c
        .query(
            "SELECT count(*) FROM outbox_parked WHERE headers::text LIKE '%' || $1 || '%'",
            &[&spoofed],
        )
        .await?;
    assert_eq!(stored[0].get::<_, i64>(0), 0);
    relay.shutdown().await?;
    Ok(())
}

/// `source.table` is spliced into DDL (`init`) and recovery queries: a name that is not a plain
/// identifier is refused before anything runs, and a mixed-case schema and table work end to
/// end, because every use quotes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_names_cannot_inject_sql_and_odd_case_works() -> anyhow::Result<()> {
    let env = Env::start("hostile_names").await?;
    let c = env.sql().await?;
    c.batch_execute("CREATE TABLE victim (id int); CREATE SCHEMA \"Billing\"")
        .await?;
    let with_table = |table: &str, publication: &str| {
        env.toml()
            .replace(
                "status_interval_ms = 200",
                &format!(
                    "status_interval_ms = 200\ntable = {table:?}\npublication = \"{publication}\""
                ),
            )
            .replace(
                &format!("slot = \"{}\"", env.slot),
                &format!("slot = \"{}_odd\"", env.slot),
            )
    };
    let file = env.dir.path().join("hostile.toml");
    for table in [
        "public.i ON victim (id); DROP TABLE victim; CREATE INDEX j",
        "public.\"outbox\"",
        "a.b.c",
        "",
        "public.",
    ] {
        std::fs::write(&file, with_table(table, "odd_pub"))?;
        for cmd in ["init", "check", "run"] {
            let (code, out) = outboxd_cli(&[cmd], &file);
            assert_ne!(code, 0, "{cmd} accepted {table:?}: {out}");
            assert!(
                out.contains("plain SQL identifier"),
                "{cmd} {table:?}: {out}"
            );
        }
    }
    let victim: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename = 'victim'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(victim, 1, "the victim table was dropped");

    // Mixed case, used exactly as written.
    std::fs::write(&file, with_table("Billing.Outbox_Events", "billing_pub"))?;
    let (code, out) = outboxd_cli(&["init"], &file);
    assert_eq!(code, 0, "{out}");
    let id = Uuid::now_v7();
    c.execute(
        "INSERT INTO \"Billing\".\"Outbox_Events\" (event_id, aggregate_type, aggregate_id, \
         aggregate_version, event_type, payload) VALUES ($1, 'acct', 'B-1', 1, 'Billed', '{}')",
        &[&id],
    )
    .await?;
    let cfg = outboxd::Config::from_toml_and_env(
        &with_table("Billing.Outbox_Events", "billing_pub"),
        Vec::<(String, String)>::new(),
    )?;
    let relay = Relay::start(cfg);
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        1,
        Duration::from_secs(30),
    )?;
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].header("event_id"), id.to_string());
    relay.shutdown().await?;
    Ok(())
}

/// `outbox_parked` used to be a publish-anything door: the relay republished any row in state
/// `retry` as stored (any topic, key, headers). Now a release needs its operator's audit row,
/// goes through the live router (topic template, identity from the columns) and the schema
/// check; a corrected payload is validated before anything changes; the audit records the
/// database role; and a row that cannot be routed can still be resolved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_parked_rows_publish_nothing_and_repairs_use_the_live_router() -> anyhow::Result<()>
{
    let mut env = Env::start("hostile_parked").await?;
    let schemas = env.dir.path().join("schemas");
    std::fs::create_dir_all(schemas.join("Deposited"))?;
    std::fs::write(
        schemas.join("Deposited/1.json"),
        r#"{"type": "object", "required": ["amount"], "properties": {"amount": {"type": "integer", "minimum": 1}}}"#,
    )?;
    env.extra_toml = format!("[validation]\nschema_dir = \"{}\"\n", schemas.display());
    let env_toml = env
        .toml()
        .replace("[relay]\n", "[relay]\nrepair_interval_ms = 200\n");
    let cfg = env.dir.path().join("parked.toml");
    std::fs::write(&cfg, &env_toml)?;
    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &env_toml,
        Vec::<(String, String)>::new(),
    )?);
    let c = env.sql().await?;
    let insert = "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                  event_type, payload) VALUES ($1, 'acct', 'P', $2, 'Deposited', $3::text::jsonb)";
    let (a1, a2) = (Uuid::now_v7(), Uuid::now_v7());
    c.execute(insert, &[&a1, &1i64, &r#"{"amount": -5}"#.to_string()])
        .await?;
    c.execute(insert, &[&a2, &2i64, &r#"{"amount": 5}"#.to_string()])
        .await?;
    env.caught_up(Duration::from_secs(30)).await?;

    // Forgeries: a row born in state retry, and the parked head tampered with, are refused by
    // the table's guard (even for this superuser); an unroutable parked row can be written.
    let err = c
        .batch_execute(&format!(
            "INSERT INTO outbox_parked (slot, event_id, aggregate_type, aggregate_id, event_type, topic, \
               record_key, payload, headers, state, error_class, error_message) \
             VALUES ('{slot}', 'forged-1', 'acct', 'F', 'Deposited', 'evil.topic', 'k', '{{\"amount\": 1}}', \
               '[[\"event_id\", \"forged\"]]', 'retry', 'x', 'x')",
            slot = env.slot
        ))
        .await
        .expect_err("a row born in state retry");
    assert!(
        format!("{err:?}").contains("a new row is parked or blocked"),
        "{err:?}"
    );
    let err = c
        .batch_execute(&format!(
            "UPDATE outbox_parked SET topic = 'evil.topic', record_key = 'evil', \
               headers = '[[\"event_id\", \"00000000-0000-0000-0000-000000000000\"], [\"traceparent\", \"00-7\"]]' \
             WHERE event_id = '{a1}'"
        ))
        .await
        .expect_err("a parked record changed");
    assert!(
        format!("{err:?}").contains("what was parked cannot change"),
        "{err:?}"
    );
    c.batch_execute(&format!(
        "INSERT INTO outbox_parked (slot, event_id, event_type, payload, state, error_class, error_message) \
         VALUES ('{slot}', 'forged-2', 'Deposited', '{{}}', 'parked', 'invalid_event', 'x')",
        slot = env.slot
    ))
    .await?;
    // A repair role of its own: the audit names it.
    c.batch_execute(
        "CREATE ROLE repairer LOGIN PASSWORD 'repair-pw'; \
         GRANT SELECT, UPDATE (state, last_seen, resolved_at, retry_audit_id) ON outbox_parked TO repairer; \
         GRANT SELECT, INSERT ON outbox_parked_audit TO repairer; \
         GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO repairer; \
         GRANT SELECT, INSERT, UPDATE ON outboxd_status TO repairer",
    )
    .await?;
    let repair_dsn = env.pg.dsn(&env.db).replace(
        &format!("postgres:{}", outboxd_tests::testkit::PG_PASSWORD),
        "repairer:repair-pw",
    );

    let bad = env.dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"amount": 0}"#)?;
    let a1s = a1.to_string();
    let retry = |payload: &std::path::Path| {
        outboxd_cli(
            &[
                "parked",
                "retry",
                &a1s,
                "--payload",
                payload.to_str().unwrap(),
                "--operator",
                "alice",
                "--reason",
                "fix amount",
                "--dsn",
                &repair_dsn,
            ],
            &cfg,
        )
    };
    let (code, out) = retry(&bad);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("fails the event's schema"), "{out}");
    // Unroutable: cannot be retried, but can be discarded.
    let (code, out) = outboxd_cli(&["parked", "retry", "forged-2", "--reason", "r"], &cfg);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("cannot be routed"), "{out}");
    let (code, out) = outboxd_cli(&["parked", "discard", "forged-2", "--reason", "junk"], &cfg);
    assert_eq!(code, 0, "{out}");

    let good = env.dir.path().join("good.json");
    std::fs::write(&good, r#"{"amount": 7}"#)?;
    let (code, out) = retry(&good);
    assert_eq!(code, 0, "{out}");
    let mut recs = Vec::new();
    for _ in 0..30 {
        recs = read_topic(
            &env.bootstrap(),
            "outbox.event.acct",
            2,
            Duration::from_secs(2),
        )?;
        if recs.len() >= 2 {
            break;
        }
    }
    // The head, then the event held behind it; the forged retry row stays where it is.
    let ids: Vec<&str> = recs.iter().map(|r| r.header("event_id")).collect();
    assert_eq!(ids, [a1.to_string(), a2.to_string()], "{recs:?}");
    assert_eq!(recs[0].header("aggregate_version"), "1");
    assert_eq!(recs[0].key, b"P");
    assert_eq!(recs[0].value, br#"{"amount": 7}"#);
    assert!(read_topic(&env.bootstrap(), "evil.topic", 0, Duration::from_secs(2))?.is_empty());
    let (_, out) = outboxd_cli(&["parked", "show", &a1s], &cfg);
    assert!(
        out.contains("retry by alice (database role repairer)"),
        "{out}"
    );
    relay.shutdown().await?;
    Ok(())
}

/// outboxd's own tables used to be named unqualified on the role's search_path: a schema earlier
/// on it (or a `public` anyone may write, PG <= 14) could hold decoys the relay would use. Now
/// every relay connection searches `source.relay_schema` alone, and `init` creates it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_tables_live_in_their_schema_whatever_the_search_path() -> anyhow::Result<()> {
    let env = Env::start("hostile_schema").await?;
    let c = env.sql().await?;
    c.batch_execute(&format!(
        "CREATE SCHEMA shadow; \
         CREATE TABLE shadow.outbox_parked (decoy int); \
         CREATE TABLE shadow.outboxd_status (decoy int); \
         CREATE TABLE shadow.outboxd_slot_state (decoy int); \
         ALTER DATABASE {} SET search_path = shadow, public",
        env.db
    ))
    .await?;
    let toml = env.toml().replace(
        "status_interval_ms = 200",
        "status_interval_ms = 200\nrelay_schema = \"outboxd\"",
    );
    let file = env.dir.path().join("schema.toml");
    std::fs::write(&file, &toml)?;
    let (code, out) = outboxd_cli(&["init"], &file);
    assert_eq!(code, 0, "{out}");
    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &toml,
        Vec::<(String, String)>::new(),
    )?);
    let c = env.sql().await?; // a new session: the database's search_path applies
    c.execute(
        "INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
         event_type, payload, headers) VALUES ($1, 'acct', 'S-1', 1, 'Deposited', '{}', \
         '{\"event_id\": \"x\"}')",
        &[&Uuid::now_v7()],
    )
    .await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let count = |q: &'static str| {
        let c = &c;
        async move { anyhow::Ok(c.query_one(q, &[]).await?.get::<_, i64>(0)) }
    };
    assert_eq!(
        count("SELECT count(*) FROM outboxd.outbox_parked").await?,
        1
    );
    assert_eq!(count("SELECT count(*) FROM shadow.outbox_parked").await?, 0);
    eventually(Duration::from_secs(20), || async {
        Ok(count("SELECT count(*) FROM outboxd.outboxd_status").await? == 1)
    })
    .await?;
    assert_eq!(
        count("SELECT count(*) FROM outboxd.outboxd_slot_state").await?,
        1
    );
    let (code, out) = outboxd_cli(&["parked", "list"], &file);
    assert!(code == 0 && out.contains("reserved_header"), "{out}");
    relay.shutdown().await?;
    Ok(())
}

/// The roles of sql/roles.sql are enough to run, repair and re-run `init`; before the grants,
/// `check` names each missing one with its GRANT and `run` stops with a setup error instead of
/// retrying "permission denied" forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_roles_are_enough_and_missing_grants_are_named() -> anyhow::Result<()> {
    let env = Env::start("hostile_roles").await?;
    let c = env.sql().await?;
    let roles = include_str!("../../sql/roles.sql");
    let (create, grants) = roles
        .split_once("-- ---- 2.")
        .expect("roles.sql has two blocks");
    c.batch_execute(create).await?;
    let as_role = |role: &str, pw: &str| {
        env.toml().replace(
            &format!("postgres:{}@", outboxd_tests::testkit::PG_PASSWORD),
            &format!("{role}:{pw}@"),
        )
    };
    let relay_toml = as_role("outboxd_relay", "change-me-relay");
    let file = env.dir.path().join("relay.toml");
    std::fs::write(&file, &relay_toml)?;
    let (code, out) = outboxd_cli(&["check"], &file);
    assert_ne!(code, 0, "{out}");
    for grant in [
        "GRANT USAGE ON SCHEMA \"public\" TO \"outboxd_relay\"; GRANT SELECT ON \"public\".\"outbox\"",
        "GRANT SELECT ON \"public\".outbox_parked TO \"outboxd_relay\"",
        // Issue 53: parking inserts name their columns; `id` is the guard's, never the role's.
        "GRANT INSERT (slot, event_id,",
        "GRANT UPDATE (state, attempts, last_seen, resolved_at, error_class, error_message, retry_audit_id) ON \"public\".outbox_parked",
        "GRANT SELECT ON \"public\".outbox_parked_audit",
        "GRANT SELECT, INSERT, UPDATE ON \"public\".outboxd_slot_state",
        "GRANT USAGE ON SEQUENCE \"public\".outbox_parked_id_seq",
    ] {
        assert!(out.contains(grant), "{grant:?} not named:\n{out}");
    }
    let (code, out) = outboxd_cli(&["run"], &file);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("lacks a privilege") && out.contains("sql/roles.sql"),
        "{out}"
    );

    c.batch_execute(&format!("--{grants}")).await?;
    let (code, out) = outboxd_cli(&["check"], &file);
    assert_eq!(code, 0, "{out}");
    assert!(
        !out.lines()
            .any(|l| l.starts_with("WARN") && l.contains("privileges")),
        "{out}"
    );
    // init is idempotent without CREATE privileges once everything exists.
    let (code, out) = outboxd_cli(&["init"], &file);
    assert_eq!(code, 0, "{out}");
    // The superuser the other tests use is named as excess.
    let (_, out) = outboxd_cli(&["check"], &env.config_file()?);
    assert!(out.contains("WARN") && out.contains("superuser"), "{out}");

    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &relay_toml,
        Vec::<(String, String)>::new(),
    )?);
    let insert = "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                  event_type, payload, headers) VALUES ($1, 'acct', $2, 1, 'Deposited', '{}', $3::text::jsonb)";
    let (bad, good) = (Uuid::now_v7(), Uuid::now_v7());
    c.execute(insert, &[&bad, &"R-1", &r#"{"event_id": "x"}"#.to_string()])
        .await?;
    c.execute(insert, &[&good, &"R-2", &"{}".to_string()])
        .await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        1,
        Duration::from_secs(20),
    )?;
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].header("event_id"), good.to_string());
    // The repair role resolves the parked one; the audit names it.
    let repair = env.dir.path().join("repair.toml");
    std::fs::write(&repair, as_role("outboxd_repair", "change-me-repair"))?;
    let bad = bad.to_string();
    let (code, out) = outboxd_cli(&["parked", "discard", &bad, "--reason", "spoofed"], &repair);
    assert_eq!(code, 0, "{out}");
    let (_, out) = outboxd_cli(&["parked", "show", &bad], &repair);
    assert!(out.contains("(database role outboxd_repair)"), "{out}");
    // The cleanup role deletes (nothing is old enough here: 0 rows, but the DELETE runs).
    let cleanup = env.dir.path().join("cleanup.toml");
    std::fs::write(
        &cleanup,
        format!(
            "{}\n[cleanup]\nretention = \"1h\"\n",
            as_role("outboxd_cleanup", "change-me-cleanup")
        ),
    )?;
    eventually(Duration::from_secs(20), || async {
        let (code, out) = outboxd_cli(&["cleanup"], &cleanup);
        anyhow::ensure!(code == 0, "{out}");
        Ok(out.contains("deleted         0 row(s)"))
    })
    .await?;
    relay.shutdown().await?;
    Ok(())
}

/// Any role may write a logical message with the heartbeat prefix. A forgery used to set the
/// heartbeat delay (and `i64::MIN` overflowed it: a panic in debug builds); now only messages
/// carrying the session's token count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_heartbeats_are_ignored() -> anyhow::Result<()> {
    let mut env = Env::start("hostile_heartbeat").await?;
    env.extra_toml = "[heartbeat]\ninterval_ms = 300\nstall_timeout_ms = 5000\n".into();
    let relay = Relay::start(env.config()?);
    let c = env.sql().await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let prefix = format!("outboxd.heartbeat.{}", env.slot);
    let hour_ago = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?
        - Duration::from_secs(3600))
    .as_micros()
    .to_string();
    for _ in 0..20 {
        for forged in [
            "-9223372036854775808".to_string(),
            hour_ago.clone(),
            format!("0000000000000000:{hour_ago}"),
            "\u{1b}[2J".to_string(),
        ] {
            c.execute(
                "SELECT pg_logical_emit_message(false, $1, $2)::text",
                &[&prefix, &forged],
            )
            .await?;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The status row (written every 5 s) reports the real delay, not an hour.
    eventually(Duration::from_secs(15), || async {
        let row = c
            .query_opt(
                "SELECT heartbeat_delay_s FROM outboxd_status WHERE slot = $1",
                &[&env.slot],
            )
            .await?;
        Ok(row
            .and_then(|r| r.get::<_, Option<f64>>(0))
            .is_some_and(|d| d < 60.0))
    })
    .await?;
    // Still streaming: a real event goes through.
    let id = Uuid::now_v7();
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
         event_type, payload) VALUES ($1, 'acct', 'HB', 1, 'Deposited', '{}')",
        &[&id],
    )
    .await?;
    env.caught_up(Duration::from_secs(30)).await?;
    relay.shutdown().await?;
    Ok(())
}

/// Every new event type used to add Prometheus series (and topics add more): a writer of ever
/// new types grew the scrape without bound. Beyond the label budget they count as `other`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_labels_stay_bounded_under_a_flood_of_event_types() -> anyhow::Result<()> {
    let mut env = Env::start("hostile_labels").await?;
    let maddr = format!("127.0.0.1:{}", outboxd_tests::testkit::free_port());
    env.extra_toml = format!("[metrics]\nlisten = \"{maddr}\"\n");
    let cfg = env.config_file()?;
    let _relay = RelayProcess::spawn(&cfg, env.dir.path().join("relay.log"))?;
    let c = env.sql().await?;
    c.batch_execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
         SELECT gen_random_uuid(), 'acct', 'L' || i, 1, 'Type' || i, '{}' FROM generate_series(1, 260) i",
    )
    .await?;
    env.caught_up(Duration::from_secs(60)).await?;
    let mut text = String::new();
    eventually(Duration::from_secs(20), || {
        text = http_get(&maddr, "/metrics").1;
        let done = text.contains("event_type=\"other\"");
        async move { Ok(done) }
    })
    .await?;
    let published: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("outboxd_events_published_total{"))
        .collect();
    assert!(published.len() <= 201, "{} series", published.len());
    let total: f64 = published
        .iter()
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(total, 260.0, "every event counted once, folded or not");
    Ok(())
}

/// Terminal escape sequences written into a row reach an operator's terminal through `parked
/// list` and `show`: they are escaped. And `OUTBOXD_*` variables that are not ours (Kubernetes
/// injects `OUTBOXD_PORT=tcp://…` for a Service named outboxd) no longer abort the CLI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escape_sequences_and_stray_variables_do_no_harm() -> anyhow::Result<()> {
    let env = Env::start("hostile_escapes").await?;
    let cfg = env.config_file()?;
    let relay = Relay::start(env.config()?);
    let c = env.sql().await?;
    let id = Uuid::now_v7();
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, \
         payload, headers) VALUES ($1, 'acct', E'A\\x1b[2J\\x1b]0;pwned\\x07', 1, E'Dep\\x1b[31m', \
         '{\"note\": \"\\u001b[2J\"}', '{\"event_id\": \"x\"}')",
        &[&id],
    )
    .await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let run = |args: &[&str]| {
        let out = std::process::Command::new(relay_bin())
            .args(args)
            .arg("--config")
            .arg(&cfg)
            .env("OUTBOXD_PORT", "tcp://10.0.0.1:9187")
            .env("OUTBOXD_SERVICE_HOST", "10.0.0.1")
            .output()
            .expect("run outboxd");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code().unwrap_or(-1), text)
    };
    let id = id.to_string();
    for args in [vec!["parked", "list"], vec!["parked", "show", &id]] {
        let (code, out) = run(&args);
        assert_eq!(code, 0, "{args:?}: {out}");
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{7}'),
            "{args:?}: raw control characters in {out:?}"
        );
        assert!(out.contains("\\u{1b}[2J"), "{args:?}: {out}");
    }
    let (code, out) = run(&["check"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("OUTBOXD_PORT") && out.contains("ignored"),
        "{out}"
    );
    relay.shutdown().await?;
    Ok(())
}

/// The sum of `outboxd_events_published_total` over its series.
fn published(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("outboxd_events_published_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Every acknowledged event counts once in `outboxd_events_published_total`, whether live,
/// released or repaired (issue 17: a repaired event and the one released behind it used to
/// count nowhere): the counter equals what the topic holds after park → retry → release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_counts_every_acknowledged_event_once() -> anyhow::Result<()> {
    let mut env = Env::start("counts").await?;
    let maddr = format!("127.0.0.1:{}", outboxd_tests::testkit::free_port());
    env.extra_toml = format!("[metrics]\nlisten = \"{maddr}\"\n");
    let toml = env
        .toml()
        .replace("[relay]\n", "[relay]\nrepair_interval_ms = 200\n");
    let cfg = env.dir.path().join("counts.toml");
    std::fs::write(&cfg, &toml)?;
    let _relay = RelayProcess::spawn(&cfg, env.dir.path().join("relay.log"))?;
    let c = env.sql().await?;
    let insert = "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                  event_type, payload, headers) VALUES ($1, 'acct', $2, $3, 'Deposited', '{}', $4::text::jsonb)";
    let head = Uuid::now_v7();
    let spoof = r#"{"event_id": "x"}"#.to_string();
    c.execute(insert, &[&head, &"C-1", &1i64, &spoof]).await?;
    let none = "{}".to_string();
    c.execute(insert, &[&Uuid::now_v7(), &"C-1", &2i64, &none])
        .await?;
    c.execute(insert, &[&Uuid::now_v7(), &"C-2", &1i64, &none])
        .await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let head = head.to_string();
    let (code, out) = outboxd_cli(&["parked", "retry", &head, "--reason", "fixed"], &cfg);
    assert_eq!(code, 0, "{out}");
    let mut recs = Vec::new();
    for _ in 0..30 {
        recs = read_topic(
            &env.bootstrap(),
            "outbox.event.acct",
            3,
            Duration::from_secs(2),
        )?;
        if recs.len() >= 3 {
            break;
        }
    }
    assert_eq!(recs.len(), 3);
    eventually(Duration::from_secs(10), || {
        let n = published(&http_get(&maddr, "/metrics").1);
        async move { Ok(n == 3.0) }
    })
    .await?;
    Ok(())
}
