//! Several outbox tables through one slot (issue 30, R44): `[[source.tables]]`, each table with
//! its own mapping and topic, records tagged with `source_table`; a poison event of one table
//! holds nothing of the others; a slot loss is recovered from every listed table; a listed
//! table the publication lacks is refused until `init` adds it.
//!
//! Three tables in two shapes: `billing.outbox` and `shipping.outbox` (outboxd's), and
//! `legacy.outbox` (Debezium's, read with the Debezium preset).

use outboxd_tests::multi::*;
use outboxd_tests::reliability::read_log;
use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

/// The issue's first test: three tables of two shapes through one slot, each to its own topic,
/// every event once, per aggregate in order, each record naming its table; `init` extended
/// the publication and `check` reports what it covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_tables_through_one_slot_each_to_its_topic() -> anyhow::Result<()> {
    let (env, done) = three_tables("multi_three", "").await?;
    for t in TABLES {
        assert!(
            done.iter()
                .any(|l| l.contains(&format!("extended with {t}"))),
            "{done:?}"
        );
    }
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let written = write_rounds(&mut c, 1, 20).await?;
    let recs = delivered(&env, &written)?;
    for (table, ids) in &written {
        assert_eq!(
            recs[table].len(),
            ids.len(),
            "{table}: duplicates in a clean run"
        );
    }
    // The Debezium-shaped table's records are Debezium's: header `id`, no version header.
    let legacy = &recs["legacy.outbox"][0];
    assert_eq!(legacy.header("id"), legacy.header("event_id"));
    assert_eq!(legacy.header("aggregate_version"), "");
    assert_eq!(recs["billing.outbox"][0].header("aggregate_version"), "1");
    env.confirmed_past_now(Duration::from_secs(10)).await?;
    relay.shutdown().await?;

    // `check`: every listed table published; public.outbox (init's default) is published but
    // not listed: a warning naming it.
    let (code, out) = outboxd_cli(&["check"], &env.config_file()?);
    assert!(
        out.contains("covers the 3 listed table(s)") || out.contains("also includes public.outbox"),
        "{out}"
    );
    assert!(out.contains("also includes public.outbox"), "{out}");
    assert!(out.contains("columns of legacy.outbox"), "{out}");
    assert_eq!(code, 0, "{out}");
    Ok(())
}

/// A poison event (too large for the broker) in `billing.outbox` parks and holds the rest of
/// its aggregate in its table; the other aggregates of every table, and the same aggregate in
/// the other tables, flow on (holds are per table: docs/configuration.md, "Several outbox
/// tables"). An operator's retry releases the event through billing's route, tagged with its
/// table, and what waited behind it follows in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_in_one_table_does_not_hold_the_others() -> anyhow::Result<()> {
    let (mut env, _) = three_tables("multi_poison", "").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let tx = c.transaction().await?;
    let big = serde_json::json!({"v": 1, "blob": "x".repeat(30_000)});
    let poison = insert(&tx, "billing.outbox", "P", 1, big).await?;
    tx.commit().await?;
    // Parked before its followers are written (a follower in the poison event's own
    // transaction can be produced before the refusal is handled: a known gap, not this
    // issue's).
    eventually(Duration::from_secs(30), || async {
        let n: i64 = c
            .query_one("SELECT count(*) FROM outbox_parked", &[])
            .await?
            .get(0);
        Ok(n == 1)
    })
    .await?;
    let tx = c.transaction().await?;
    let follower = insert(&tx, "billing.outbox", "P", 2, serde_json::json!({"v": 2})).await?;
    let shared = insert(&tx, "shipping.outbox", "P", 1, serde_json::json!({"v": 1})).await?;
    tx.commit().await?;
    let mut written = write_rounds(&mut c, 1, 3).await?;
    // Everything of A and B, in every table, and shipping's P, arrive while billing's P waits.
    written.get_mut("shipping.outbox").unwrap().push(shared);
    delivered(&env, &written)?;
    let rows = c
        .query(
            "SELECT event_id, state, error_class FROM outbox_parked ORDER BY id",
            &[],
        )
        .await?;
    let states: Vec<(String, String, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        states,
        [
            (poison.to_string(), "parked".into(), "too_large".into()),
            (follower.to_string(), "blocked".into(), "blocked".into()),
        ]
    );

    // `status` per table: billing holds the head and its follower, shipping nothing.
    let (code, out) = outboxd_cli(&["status", "--json"], &env.config_file()?);
    assert_eq!(code, 0, "{out}");
    let status: serde_json::Value = serde_json::from_str(&out)?;
    let open: Vec<(String, i64)> = status["tables"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["table"].as_str().unwrap().to_string(),
                t["open_parked"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        open,
        [
            ("billing.outbox".into(), 2),
            ("shipping.outbox".into(), 0),
            ("legacy.outbox".into(), 0)
        ],
        "{status}"
    );
    let (_, human) = outboxd_cli(&["status"], &env.config_file()?);
    assert!(
        human.contains("billing.outbox: published yes, open parked 2"),
        "{human}"
    );

    // The retry goes out through billing's route and releases what waited, in order.
    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"v": 1}"#)?;
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "retry",
            &poison.to_string(),
            "--payload",
            fixed.to_str().unwrap(),
            "--operator",
            "alice",
            "--reason",
            "trim blob",
        ],
        &env.config_file()?,
    );
    assert_eq!(code, 0, "{out}");
    written
        .get_mut("billing.outbox")
        .unwrap()
        .extend([poison, follower]);
    let recs = delivered(&env, &written)?;
    assert_eq!(
        order(&recs["billing.outbox"])["P"],
        [1, 2],
        "released in order"
    );
    assert_eq!(order(&recs["shipping.outbox"])["P"], [1]);
    relay.shutdown().await?;
    Ok(())
}

/// The slot is dropped while the relay is down and every table receives events meanwhile: the
/// recovery republishes the gap of each listed table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_loss_is_recovered_from_every_table() -> anyhow::Result<()> {
    let maddr = format!("127.0.0.1:{}", outboxd_tests::testkit::free_port());
    let metrics = format!("[metrics]\nlisten = \"{maddr}\"\n");
    let (env, _) = three_tables("multi_loss", &metrics).await?;
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let mut c = env.sql().await?;
    let mut written = write_rounds(&mut c, 1, 5).await?;
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    env.caught_up(Duration::from_secs(30)).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the state row records the mark
    assert!(relay.sigterm()?.success());
    // `init` extended the publication after the slot existed: the first session already
    // recovered that change's gap (publication_changes.rs). Count from here.
    let before: i64 = c
        .query_one(
            "SELECT recoveries FROM outboxd_slot_state WHERE slot_name = $1",
            &[&env.slot],
        )
        .await?
        .get(0);
    env.drop_slot().await?;
    for (t, ids) in write_rounds(&mut c, 6, 5).await? {
        written.get_mut(t).unwrap().extend(ids);
    }
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    delivered(&env, &written)?;
    let recovered: i64 = c
        .query_one(
            "SELECT recoveries FROM outboxd_slot_state WHERE slot_name = $1",
            &[&env.slot],
        )
        .await?
        .get(0);
    assert_eq!(recovered, before + 1, "{}", read_log(&log));
    // Per-table counts, one series per listed table: this process republished the gap, at
    // least the 10 events each table received while the slot was gone.
    let scrape = http_get(&maddr, "/metrics").1;
    for t in TABLES {
        let series = format!("outboxd_table_events_published_total{{table=\"{t}\"}} ");
        let n: f64 = scrape
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .unwrap_or_else(|| panic!("{series} not exported: {scrape}"))
            .trim()
            .parse()?;
        assert!(n >= 10.0, "{t}: {n}");
    }
    assert!(relay.sigterm()?.success());
    Ok(())
}

/// A listed table the publication does not include is refused (never streamed without it);
/// `init` adds it, says whether it held rows that will not be streamed, and the relay then
/// relays it beside the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_table_outside_the_publication_is_refused_until_init_adds_it() -> anyhow::Result<()>
{
    let (env, _) = three_tables("multi_add", "").await?;
    let mut c = env.sql().await?;
    c.batch_execute("ALTER PUBLICATION outbox_pub DROP TABLE legacy.outbox")
        .await?;
    let err = Relay::start(env.config()?).join().await.unwrap_err();
    assert!(
        err.to_string().contains("does not include legacy.outbox"),
        "{err}"
    );
    let (code, out) = outboxd_cli(&["check"], &env.config_file()?);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("does not include listed table(s) legacy.outbox"),
        "{out}"
    );

    // A row written meanwhile: init says the table's earlier rows are not streamed.
    let tx = c.transaction().await?;
    insert(&tx, "legacy.outbox", "Z", 0, serde_json::json!({"v": 0})).await?;
    tx.commit().await?;
    let done = outboxd::init(&env.config()?).await?;
    assert!(
        done.iter()
            .any(|l| l.contains("extended with legacy.outbox") && l.contains("NOT streamed")),
        "{done:?}"
    );
    let relay = Relay::start(env.config()?);
    let written = write_rounds(&mut c, 1, 3).await?;
    delivered(&env, &written)?;
    relay.shutdown().await?;
    Ok(())
}

/// Inserts `n` rows of aggregate `agg` into the outboxd-shaped `table`, `created_at = now() - age`.
async fn insert_aged(
    c: &tokio_postgres::Client,
    table: &str,
    agg: &str,
    n: i64,
    age: &str,
) -> anyhow::Result<()> {
    c.execute(
        &format!(
            "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, aggregate_version, \
                                  event_type, payload, created_at) \
             SELECT gen_random_uuid(), 'acct', $1, v, 'Deposited', jsonb_build_object('v', v), \
                    now() - $3::text::interval \
             FROM generate_series(1, $2::bigint) v"
        ),
        &[&agg, &n, &age],
    )
    .await?;
    Ok(())
}

/// Cleanup cleans every listed table under one cutoff; a listed table that cannot be aged (the
/// Debezium shape has no created_at) stops the run before anything is deleted, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_cleans_every_table_or_names_the_one_it_cannot() -> anyhow::Result<()> {
    let env = Env::start("multi_cleanup").await?;
    env.sql().await?.batch_execute(TABLES_SQL).await?;
    create_topics(&env.bootstrap(), &TOPICS, 2).await?;
    let all = tables_toml("", "");
    let two = &all[..all.find("[[source.tables]]\nname = \"legacy").unwrap()];
    let config = |tables: &str| {
        let mut e = env.toml().replace(
            "[source]\n",
            "[source]\nrecovery_window = \"1h\"\nstate_interval_ms = 200\n",
        );
        e.push_str(&format!(
            "[cleanup]\nretention = \"1h\"\npause_ms = 0\n{tables}"
        ));
        e
    };
    let (cfg, cfg_all) = (
        env.dir.path().join("two.toml"),
        env.dir.path().join("all.toml"),
    );
    std::fs::write(&cfg, config(two))?;
    std::fs::write(&cfg_all, config(&all))?;
    outboxd::init(&outboxd::Config::load(&cfg)?).await?;
    let c = env.sql().await?;
    for t in ["billing.outbox", "shipping.outbox"] {
        insert_aged(&c, t, "old", 30, "3 hours").await?;
        insert_aged(&c, t, "new", 5, "0 seconds").await?;
    }
    let mut relay = RelayProcess::spawn(&cfg, env.dir.path().join("relay.log"))?;
    env.caught_up(Duration::from_secs(60)).await?;
    env.mark_recorded().await?;
    assert!(relay.sigterm()?.success());

    let (code, out) = outboxd_cli(&["cleanup", "--dry-run"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("60 row(s) would be deleted"), "{out}");
    // With the Debezium-shaped table listed too: nothing, and the reason names it.
    let (code, out) = outboxd_cli(&["cleanup"], &cfg_all);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("nothing deleted: outbox table legacy.outbox") && out.contains("created_at"),
        "{out}"
    );
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("deleted         60 row(s)"), "{out}");
    for t in ["billing.outbox", "shipping.outbox"] {
        let left: i64 = c
            .query_one(&format!("SELECT count(*) FROM {t}"), &[])
            .await?
            .get(0);
        assert_eq!(left, 5, "{t}");
    }
    Ok(())
}

/// Two tables carry one event_id and both events are poison: a parked event is one per (slot,
/// event_id), so the second would vanish into the first's row. The relay halts at it instead,
/// naming both tables, and confirms nothing past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_event_id_among_parked_events_halts_instead_of_merging() -> anyhow::Result<()> {
    let (mut env, _) = three_tables("multi_collide", "").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    // Past init's publication change (its gap recovered): what follows is the live stream.
    env.caught_up(Duration::from_secs(30)).await?;
    let c = env.sql().await?;
    let id = Uuid::now_v7();
    let big = serde_json::json!({"blob": "x".repeat(30_000)});
    for table in ["billing.outbox", "shipping.outbox"] {
        c.execute(
            &format!(
                "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, aggregate_version, \
                 event_type, payload) VALUES ($1, 'acct', 'C', 1, 'Deposited', $2)"
            ),
            &[&id, &big],
        )
        .await?;
    }
    let lsn = env.current_lsn().await?;
    eventually(Duration::from_secs(30), || async {
        Ok(read_log(&log).contains("event_id_collision"))
    })
    .await?;
    let text = read_log(&log);
    assert!(
        text.contains("two outbox tables carry the same event_id")
            && text.contains("shipping.outbox")
            && text.contains("billing.outbox"),
        "{text}"
    );
    let parked: i64 = c
        .query_one("SELECT count(*) FROM outbox_parked", &[])
        .await?
        .get(0);
    assert_eq!(parked, 1);
    let confirmed = env.confirmed_lsn().await?;
    assert!(
        confirmed < lsn,
        "confirmed past the halt: {confirmed} >= {lsn}\n{text}"
    );
    assert!(relay.sigterm()?.success());
    Ok(())
}

/// `outboxd replay` under a multi-table configuration names its table (`--table`): the
/// selection reads that table only, through its mapping and topic, its copies tagged like the
/// relay's records, and the audit row records the table the replay runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_names_its_table_and_records_it() -> anyhow::Result<()> {
    let (env, _) = three_tables("multi_replay", "").await?;
    let mut c = env.sql().await?;
    let written = write_rounds(&mut c, 1, 2).await?;
    let relay = Relay::start(env.config()?);
    delivered(&env, &written)?;
    relay.shutdown().await?;
    let cfg = env.config_file()?;
    let id = written["shipping.outbox"][0].to_string();

    let out = outboxd_tests::replay::replay(&cfg, &[&id], false);
    assert!(out.contains("--table SCHEMA.TABLE"), "{out}");
    let out = outboxd_tests::replay::replay(&cfg, &[&id, "--table", "nope.outbox"], false);
    assert!(out.contains("not a listed outbox table"), "{out}");
    let out = outboxd_tests::replay::replay(
        &cfg,
        &[
            &id,
            "--table",
            "shipping.outbox",
            "--execute",
            "--reason",
            "r",
        ],
        true,
    );
    assert!(out.contains("finished"), "{out}");
    let recs = delivered(&env, &written)?; // every record, the copy too, names its table
    let copies: Vec<&Record> = recs["shipping.outbox"]
        .iter()
        .filter(|r| r.header("event_id") == id)
        .collect();
    assert_eq!(copies.len(), 2, "the original and the copy");
    assert_eq!(
        copies[1].topic, "shipping.events",
        "through its table's topic"
    );
    let sel: serde_json::Value = c
        .query_one(
            "SELECT selection FROM outboxd_replay ORDER BY id DESC LIMIT 1",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(sel["table"], "shipping.outbox", "{sel}");
    Ok(())
}

/// Writes versions `from..from + n` of aggregates `agg` into `tables` only, one transaction
/// per version. Returns the event ids per table.
async fn write_into(
    c: &mut tokio_postgres::Client,
    tables: &[&'static str],
    agg: &str,
    from: i64,
    n: i64,
) -> anyhow::Result<std::collections::BTreeMap<&'static str, Vec<Uuid>>> {
    let mut ids: std::collections::BTreeMap<&str, Vec<Uuid>> = Default::default();
    for v in from..from + n {
        let tx = c.transaction().await?;
        for &table in tables {
            let id = insert(&tx, table, agg, v, serde_json::json!({ "v": v })).await?;
            ids.entry(table).or_default().push(id);
        }
        tx.commit().await?;
    }
    Ok(ids)
}

/// [`delivered`], or a panic with the relay's log.
fn arrived(
    env: &Env,
    written: &std::collections::BTreeMap<&'static str, Vec<Uuid>>,
    log: &std::path::Path,
) {
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| delivered(env, written)));
    if !matches!(got, Ok(Ok(_))) {
        panic!("not delivered; relay log:\n{}", read_log(log));
    }
}

/// Issue 56, "one table leaving or breaking does not stop the others": a listed table dropped
/// (a teardown, a botched migration) while the relay streams all three, its last rows written
/// just before the drop. Before: the session ended ("no longer exists (dropped)"), the next one
/// refused to start ("does not exist: run outboxd init"), and billing and legacy stopped with
/// it until someone created the table again. Now: shipping's rows written before the drop
/// arrive (they are in the slot), billing and legacy stream on, across a restart too, the
/// status names the missing table, and the table created again (by plain DDL: `init`'s join
/// trigger adds it to the publication) is taken in with every row it gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_listed_table_stops_nothing_else() -> anyhow::Result<()> {
    let (env, _) = three_tables("multi_dropped", "").await?;
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    let mut c = env.sql().await?;
    let before = write_rounds(&mut c, 1, 3).await?;
    c.batch_execute("DROP TABLE shipping.outbox").await?;
    let others = ["billing.outbox", "legacy.outbox"];
    let during = write_into(&mut c, &others, "C", 1, 3).await?;
    arrived(&env, &before, &log);
    arrived(&env, &during, &log);
    // A restart while it is missing: the relay starts and streams the others.
    assert!(relay.sigterm()?.success(), "{}", read_log(&log));
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    let after = write_into(&mut c, &others, "C", 4, 3).await?;
    arrived(&env, &after, &log);
    let text = read_log(&log);
    assert!(text.contains("shipping.outbox does not exist"), "{text}");
    let (_, out) = outboxd_cli(&["status"], &config);
    assert!(out.contains("shipping.outbox: DOES NOT EXIST"), "{out}");
    // Created again: its rows flow.
    c.batch_execute("CREATE TABLE shipping.outbox (LIKE public.outbox INCLUDING ALL)")
        .await?;
    let back = write_into(&mut c, &["shipping.outbox", "billing.outbox"], "D", 1, 3).await?;
    arrived(&env, &back, &log);
    let text = read_log(&log);
    assert!(!text.contains("recovery finished"), "{text}");
    assert!(!text.contains("publication_changed"), "{text}");
    assert!(relay.sigterm()?.success(), "{text}");
    Ok(())
}
