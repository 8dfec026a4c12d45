//! Slot loss (issue 12): the replication slot dropped while the relay is down or running,
//! invalidated by `max_slot_wal_keep_size`, a relay SIGKILLed in the middle of a recovery,
//! Postgres crashed twice (the state row bounds the replay), `on_slot_loss = "halt"` and
//! `outboxd recover`, and a gap whose rows are gone.
//!
//! Under load from a writer that commits random transactions, with an inbox-library consumer
//! applying every record: every committed event delivered, copies byte-identical, first
//! occurrences in per-aggregate order, each effect exactly once in the consumer's table.

use anyhow::Context;
use outboxd_tests::reliability::world::{finish, world, CAUGHT_UP, TOPIC};
use outboxd_tests::reliability::*;
use outboxd_tests::testkit::{Broker, PgOptions, Postgres};
use outboxd_tests::*;
use std::time::{Duration, Instant};

async fn state_row(env: &Env) -> anyhow::Result<(i64, Option<i64>, bool)> {
    let c = env.sql().await?;
    let r = c
        .query_one(
            "SELECT recoveries, last_recovery_events, \
                    recovering_since IS NOT NULL OR recovering_xid IS NOT NULL \
             FROM outboxd_slot_state WHERE slot_name = $1",
            &[&env.slot],
        )
        .await?;
    Ok((r.get(0), r.get(1), r.get(2)))
}

fn deposits(versions: std::ops::RangeInclusive<i64>) -> Vec<NewEvent> {
    versions
        .map(|v| NewEvent::new("acct", "a-1", v, "Deposited", serde_json::json!({"v": v})))
        .collect()
}

/// Distinct `aggregate_version`s on the topic, sorted.
fn versions_of(recs: &[Record]) -> Vec<i64> {
    let mut v: Vec<i64> = recs
        .iter()
        .map(|r| r.header("aggregate_version").parse().unwrap())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The world, its config file, the relay log and a SQL client.
type Dropped = (
    Env,
    std::path::PathBuf,
    std::path::PathBuf,
    tokio_postgres::Client,
);

/// A world whose relay delivered `first` (and recorded its delivery mark), stopped, and whose
/// slot was then dropped. Returns the config file, the relay log and a SQL client.
async fn delivered_then_dropped(name: &str, first: Vec<NewEvent>) -> anyhow::Result<Dropped> {
    delivered_then_dropped_in(Env::start(name).await?, first).await
}

/// [`delivered_then_dropped`] in a world the caller started.
async fn delivered_then_dropped_in(env: Env, first: Vec<NewEvent>) -> anyhow::Result<Dropped> {
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let mut c = env.sql().await?;
    write_events(&mut c, &first, false).await?;
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    env.caught_up(CAUGHT_UP).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the state row records the mark
    assert!(relay.sigterm()?.success());
    env.drop_slot().await?;
    Ok((env, config, log, c))
}

/// The first observation: relay stopped, slot dropped, events committed, relay started.
/// Before: the gap was silently skipped. Now: recovered from the outbox table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_dropped_while_the_relay_is_down() -> anyhow::Result<()> {
    let w = world(Env::start("sl_down").await?).await?;
    w.deliver_then_stop(300).await?;
    w.env.drop_slot().await?;
    w.commit_more(1000).await?;
    let mut relay = w.spawn()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (wlog, report) = finish(&w.env, w.writer, w.reader, &w.inbox_dsn, &mut relay).await?;
    let (recoveries, events, pending) = state_row(&w.env).await?;
    assert_eq!((recoveries, pending), (1, false));
    let log = read_log(&w.log);
    assert!(log.contains("replication slot lost"), "{log}");
    assert!(log.contains("recovery finished"), "{log}");
    eprintln!(
        "slot dropped while down: {} committed, {} records, {} duplicates, {events:?} republished",
        wlog.committed.len(),
        report.records,
        report.duplicates
    );
    Ok(())
}

/// The walsender is terminated and the slot dropped under a running relay, twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_dropped_while_the_relay_runs() -> anyhow::Result<()> {
    let w = world(Env::start("sl_run").await?).await?;
    let mut relay = RelayProcess::spawn(&w.config, w.log.clone())?;
    for round in 1..=2 {
        w.writer
            .wait_committed(400 * round, Duration::from_secs(60))
            .await?;
        w.env.drop_slot().await?;
        eventually(Duration::from_secs(60), || async {
            Ok(state_row(&w.env).await?.0 >= round as i64)
        })
        .await
        .with_context(|| read_log(&w.log))?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (wlog, report) = finish(&w.env, w.writer, w.reader, &w.inbox_dsn, &mut relay).await?;
    eprintln!(
        "slot dropped while running (2x): {} committed, {} records, {} duplicates",
        wlog.committed.len(),
        report.records,
        report.duplicates
    );
    Ok(())
}

/// `max_slot_wal_keep_size` invalidates the slot of a stopped relay while events wait: the
/// relay used to retry "cannot read from logical replication slot" forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_invalidated_by_max_slot_wal_keep_size() -> anyhow::Result<()> {
    let pg = Postgres::start_with(PgOptions {
        settings: vec![
            ("max_slot_wal_keep_size".into(), "32MB".into()),
            ("max_wal_size".into(), "64MB".into()),
        ],
        ..PgOptions::default()
    })?;
    let env = Env::with(pg, Broker::start()?, "sl_inval").await?;
    let w = world(env).await?;
    w.deliver_then_stop(300).await?;
    w.commit_more(500).await?;
    // Push the slot's WAL out of the window.
    let c = w.env.sql().await?;
    c.batch_execute("CREATE TABLE junk (b text)").await?;
    for _ in 0..6 {
        c.batch_execute(
            "INSERT INTO junk SELECT repeat(md5(g::text), 32) FROM generate_series(1, 20000) g; \
             SELECT pg_switch_wal(); CHECKPOINT;",
        )
        .await?;
    }
    let status: String = c
        .query_one(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
            &[&w.env.slot],
        )
        .await?
        .get(0);
    assert_eq!(status, "lost", "the slot was not invalidated");
    let mut relay = w.spawn()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (wlog, report) = finish(&w.env, w.writer, w.reader, &w.inbox_dsn, &mut relay).await?;
    let log = read_log(&w.log);
    assert!(log.contains("invalidated"), "{log}");
    assert_eq!(state_row(&w.env).await?.0, 1);
    eprintln!(
        "slot invalidated: {} committed, {} records, {} duplicates",
        wlog.committed.len(),
        report.records,
        report.duplicates
    );
    Ok(())
}

/// A relay SIGKILLed (abort at a failpoint) while it republishes the gap recovers again on
/// restart: the intent was recorded before anything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_in_the_middle_of_a_recovery() -> anyhow::Result<()> {
    let w = world(Env::start("sl_kill").await?).await?;
    w.deliver_then_stop(200).await?;
    w.env.drop_slot().await?;
    w.commit_more(1500).await?;
    let mut doomed = RelayProcess::spawn_with_env(
        &w.config,
        w.log.clone(),
        &[("OUTBOXD_FAILPOINTS", "recovery_produced@700")],
    )?;
    let st = wait_exit(&mut doomed, Duration::from_secs(60)).await?;
    assert!(!st.success(), "the failpoint did not fire");
    assert!(
        state_row(&w.env).await?.2,
        "the recovery intent is not recorded"
    );
    let mut relay = w.spawn()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (wlog, report) = finish(&w.env, w.writer, w.reader, &w.inbox_dsn, &mut relay).await?;
    let (recoveries, _, pending) = state_row(&w.env).await?;
    assert_eq!((recoveries, pending), (1, false));
    eprintln!(
        "killed mid-recovery: {} committed, {} records, {} duplicates",
        wlog.committed.len(),
        report.records,
        report.duplicates
    );
    Ok(())
}

/// Postgres crashed twice under a paced load: nothing lost, and what is replayed is bounded by
/// the state interval (1 s), not by the checkpoint interval (5 min by default: without the
/// state row everything since the start would come again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crashes_replay_seconds_not_checkpoints() -> anyhow::Result<()> {
    let mut w = world(Env::start("sl_pgcrash").await?).await?;
    let mut relay = RelayProcess::spawn(&w.config, w.log.clone())?;
    let t0 = Instant::now();
    w.writer
        .wait_committed(500, Duration::from_secs(60))
        .await?;
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_secs(4)).await;
        tokio::task::block_in_place(|| w.env.pg.restart())?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let secs = t0.elapsed().as_secs_f64();
    let (wlog, report) = finish(&w.env, w.writer, w.reader, &w.inbox_dsn, &mut relay).await?;
    let rate = wlog.committed.len() as f64 / secs;
    // Per crash: events of the last state interval, of the status interval before it and the
    // ones in flight — a few seconds of load at most.
    let bound = (2.0 * 3.0 * rate) as usize;
    eprintln!(
        "postgres crashed twice: {} committed in {secs:.1} s ({rate:.0}/s), {} duplicates (bound {bound})",
        wlog.committed.len(),
        report.duplicates
    );
    assert!(
        report.duplicates <= bound,
        "{} duplicates: the replay was not bounded by the state interval",
        report.duplicates
    );
    let log = read_log(&w.log);
    assert!(log.contains("are skipped"), "{log}");
    Ok(())
}

/// `on_slot_loss = "halt"`: exits non-zero naming the gap and the command; `recover --dry-run`
/// prints the plan and changes nothing; `recover` republishes; `run` streams on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn halt_mode_refuses_and_recover_command_recovers() -> anyhow::Result<()> {
    let (env, config, log, mut c) = delivered_then_dropped("sl_halt", deposits(1..=20)).await?;
    write_events(&mut c, &deposits(21..=70), false).await?;

    let halt = [("OUTBOXD_SOURCE_ON_SLOT_LOSS", "halt")];
    let mut halted = RelayProcess::spawn_with_env(&config, log.clone(), &halt)?;
    let st = wait_exit(&mut halted, Duration::from_secs(60)).await?;
    let text = read_log(&log);
    assert!(!st.success(), "halt mode must exit non-zero\n{text}");
    assert!(text.contains("outboxd recover --config"), "{text}");
    // Exactly the 50 undelivered rows: the gap is bounded by transaction id, not by a time
    // window that would take the 20 delivered ones too.
    assert!(text.contains("50 row(s)"), "the gap is counted: {text}");
    let exists: bool = c
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            &[&env.slot],
        )
        .await?
        .get(0);
    assert!(
        !exists,
        "halt mode created the slot (that would skip the gap)"
    );

    let (code, out) = outboxd_cli(&["recover", "--dry-run"], &config);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("dry run") && out.contains("Deposited: 50"),
        "{out}"
    );
    let (code, out) = outboxd_cli(&["recover"], &config);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("recovered: 50 event(s)"), "{out}");

    write_events(&mut c, &deposits(71..=71), false).await?;
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    env.caught_up(CAUGHT_UP).await?;
    assert!(relay.sigterm()?.success());
    let recs = read_topic(&env.bootstrap(), TOPIC, 71, Duration::from_secs(60))?;
    assert_eq!(versions_of(&recs), (1..=71).collect::<Vec<_>>());
    Ok(())
}

/// The gap's rows were deleted (cleanup, or a writer deleting in the inserting transaction):
/// the relay halts with the diagnosis instead of reporting a recovery that did not happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_rows_already_deleted_halts_with_the_diagnosis() -> anyhow::Result<()> {
    let (_env, config, log, mut c) = delivered_then_dropped("sl_gone", deposits(1..=10)).await?;
    write_events(&mut c, &deposits(11..=20), false).await?;
    c.batch_execute("DELETE FROM outbox").await?;
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    let st = wait_exit(&mut relay, Duration::from_secs(60)).await?;
    let text = read_log(&log);
    assert!(!st.success(), "{text}");
    assert!(text.contains("no longer holds the rows"), "{text}");
    assert!(!text.contains("recovery finished"), "{text}");
    Ok(())
}

/// A prepared transaction left behind (a two-phase coordinator that died) keeps a new slot from
/// reaching its consistent point forever. Before: the recovery waited without a word, the gap
/// undelivered. Now: the relay names the transaction and its fix while it waits, gives up after
/// `source.slot_create_timeout` and retries; once the operator commits it, the recovery
/// finishes by itself and every event arrives, the prepared one's too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_behind_a_prepared_transaction_names_it_and_finishes_once_resolved(
) -> anyhow::Result<()> {
    let pg = Postgres::start_with(PgOptions {
        settings: vec![("max_prepared_transactions".into(), "4".into())],
        ..PgOptions::default()
    })?;
    let env = Env::with(pg, Broker::start()?, "sl_2pc").await?;
    let (env, _, log, mut c) = delivered_then_dropped_in(env, deposits(1..=10)).await?;
    // (`extra_toml` lands after [relay]; the setting belongs to [source].)
    let config = env.dir.path().join("outboxd-2pc.toml");
    std::fs::write(
        &config,
        env.toml()
            .replace("[source]\n", "[source]\nslot_create_timeout = 4\n"),
    )?;
    write_events(&mut c, &deposits(11..=20), false).await?;
    // The abandoned two-phase transaction holds an outbox row of its own (version 21).
    let tpc = env.sql().await?;
    tpc.batch_execute("BEGIN").await?;
    tpc.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                             event_type, payload) \
         VALUES (gen_random_uuid(), 'acct', 'a-1', 21, 'Deposited', '{\"v\": 21}')",
        &[],
    )
    .await?;
    tpc.batch_execute("PREPARE TRANSACTION 'coordinator-42'")
        .await?;
    drop(tpc);

    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    eventually(Duration::from_secs(60), || async {
        let text = read_log(&log);
        Ok(text.contains("coordinator-42")
            && text.contains("COMMIT PREPARED 'coordinator-42'")
            && text.contains("slot_create_timeout"))
    })
    .await
    .with_context(|| read_log(&log))?;
    let (_, _, pending) = state_row(&env).await?;
    assert!(
        pending,
        "the recovery's intent stays recorded while it waits"
    );

    c.batch_execute("COMMIT PREPARED 'coordinator-42'").await?;
    env.caught_up(CAUGHT_UP).await?;
    let recs = read_topic(&env.bootstrap(), TOPIC, 21, Duration::from_secs(60))?;
    assert_eq!(versions_of(&recs), (1..=21).collect::<Vec<_>>());
    assert!(relay.sigterm()?.success());
    let text = read_log(&log);
    assert!(text.contains("recovery finished"), "{text}");
    let (recoveries, _, pending) = state_row(&env).await?;
    assert_eq!((recoveries, pending), (1, false));
    Ok(())
}

/// Benchmark (docs/benchmarks.md, "Slot-loss recovery"): 100,000 events in the gap of a
/// dropped slot; how fast the relay republishes them and how long from its start until it
/// streams again. Run: `cargo nextest run -p outboxd-tests --test slot_loss --run-ignored
/// only --no-capture recovery_rate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark, see docs/benchmarks.md"]
async fn recovery_rate_100k() -> anyhow::Result<()> {
    recovery_rate("sl_bench", 0).await
}

/// The same gap in a table that also holds 1,000,000 delivered rows: the gap is selected by
/// `xmin`, which has no index, so the recovery reads the whole table (docs/benchmarks.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark, see docs/benchmarks.md"]
async fn recovery_rate_100k_beside_1m_delivered_rows() -> anyhow::Result<()> {
    recovery_rate("sl_bench_h", 1_000_000).await
}

/// `history` delivered rows (streamed, acknowledged, below delivered_xid), then 100,000 in the gap.
async fn recovery_rate(name: &str, history: i64) -> anyhow::Result<()> {
    const N: i64 = 100_000;
    // 100 aggregates, ~250-byte payloads, 100 rows per transaction.
    let insert = "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                                      event_type, payload) \
                  SELECT gen_random_uuid(), 'acct', $2 || (g % 100), g / 100 + 1, 'Deposited', \
                         jsonb_build_object('n', g, 'pad', repeat('x', 200)) \
                  FROM generate_series($1::bigint * 100, $1::bigint * 100 + 99) g";
    let env = Env::start(name).await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let mut c = env.sql().await?;
    for chunk in 0..(history / 100) {
        c.execute(insert, &[&chunk, &"h-"]).await?;
    }
    write_events(&mut c, &deposits(1..=1), false).await?;
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    env.caught_up(Duration::from_secs(600)).await?;
    tokio::time::sleep(Duration::from_millis(2500)).await; // the state row records the marks
    assert!(relay.sigterm()?.success());
    env.drop_slot().await?;
    for chunk in 0..(N / 100) {
        c.execute(insert, &[&chunk, &"b-"]).await?;
    }
    c.batch_execute("VACUUM ANALYZE outbox").await?;
    let t0 = Instant::now();
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    eventually(Duration::from_secs(600), || async {
        Ok(read_log(&log).contains("recovery finished"))
    })
    .await?;
    let recovered_at = t0.elapsed();
    eventually(Duration::from_secs(60), || async {
        let l = read_log(&log);
        Ok(l[l.find("recovery finished").unwrap()..].contains("streaming"))
    })
    .await?;
    let streaming_at = t0.elapsed();
    let (_, events, _) = state_row(&env).await?;
    let events = events.unwrap_or(0);
    assert!(events >= N, "republished {events}");
    assert!(relay.sigterm()?.success());
    eprintln!(
        "recovery of {events} events beside {history} delivered rows: recovered in {:.2} s \
         ({:.0} events/s from relay start), streaming {:.2} s after the relay started",
        recovered_at.as_secs_f64(),
        events as f64 / recovered_at.as_secs_f64(),
        streaming_at.as_secs_f64()
    );
    Ok(())
}

/// The same slot loss on every server of the version matrix (14, 17, 18; the tests above run
/// on 15): dropped while the relay is down, recovered with `CREATE_REPLICATION_SLOT` in the
/// version's own syntax (17+: a failover slot), under load, with the inbox consumer.
async fn slot_dropped_on_version(major: u32) -> anyhow::Result<()> {
    let pg = Postgres::start_version(major)?;
    let env = Env::with(pg, Broker::start()?, &format!("sl_v{major}")).await?;
    let w = world(env).await?;
    w.deliver_then_stop(300).await?;
    w.env.drop_slot().await?;
    w.commit_more(500).await?;
    let mut relay = w.spawn()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c = w.env.sql().await?;
    if major >= 17 {
        let failover: bool = c
            .query_one(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
                &[&w.env.slot],
            )
            .await?
            .get(0);
        assert!(failover, "the recreated slot is not a failover slot");
    }
    let (wlog, report) = finish(&w.env, w.writer, w.reader, &w.inbox_dsn, &mut relay).await?;
    assert_eq!(state_row(&w.env).await?.0, 1);
    eprintln!(
        "postgres {major}, slot dropped while down: {} committed, {} records, {} duplicates",
        wlog.committed.len(),
        report.records,
        report.duplicates
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_dropped_on_postgres_14() -> anyhow::Result<()> {
    slot_dropped_on_version(14).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_dropped_on_postgres_17() -> anyhow::Result<()> {
    slot_dropped_on_version(17).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_dropped_on_postgres_18() -> anyhow::Result<()> {
    slot_dropped_on_version(18).await
}

/// Postgres 17 failover slots and a multi-host DSN: the relay streams from a primary whose
/// physical standby synchronizes the (failover) slot; the primary dies, the standby is
/// promoted; the relay finds the new primary through `host=a,b target_session_attrs=read-write`
/// and streams on from the synchronized slot — a new timeline, no recovery, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_slot_survives_a_promotion_on_postgres_17() -> anyhow::Result<()> {
    use outboxd_tests::testkit::{StandbyOptions, PG_PASSWORD};
    let env = Env::with(
        Postgres::start_version(17)?,
        Broker::start()?,
        "sl_failover",
    )
    .await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let standby = env
        .pg
        .start_standby(StandbyOptions {
            slot: Some("phys".into()),
            settings: vec![
                ("sync_replication_slots".into(), "on".into()),
                ("hot_standby_feedback".into(), "on".into()),
            ],
        })
        .await?;
    let mut c = env.sql().await?;
    // Logical walsenders wait for the standby: it never lacks what the relay was sent.
    c.batch_execute("ALTER SYSTEM SET synchronized_standby_slots = 'phys'")
        .await?;
    c.batch_execute("SELECT pg_reload_conf()").await?;
    let multi = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres password={PG_PASSWORD} dbname={} \
         target_session_attrs=read-write",
        env.pg.port, standby.port, env.db
    );
    let config = env.dir.path().join("multi.toml");
    std::fs::write(&config, env.toml().replace(&env.pg.dsn(&env.db), &multi))?;
    let log = env.dir.path().join("relay.log");
    let (code, out) = outboxd_cli(&["check"], &config);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("failover"),
        "check reports the failover slot: {out}"
    );
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    write_events(&mut c, &deposits(1..=50), false).await?;
    env.caught_up(CAUGHT_UP).await?;
    // The standby's copy of the slot catches up with what the relay confirmed.
    let confirmed = env.confirmed_lsn().await?;
    let s = standby.connect("postgres").await?;
    eventually(Duration::from_secs(60), || async {
        let r = s
            .query_opt(
                "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots \
                 WHERE slot_name = $1 AND synced",
                &[&env.slot],
            )
            .await?;
        Ok(r.and_then(|r| r.get::<_, Option<i64>>(0))
            .is_some_and(|l| l as u64 >= confirmed))
    })
    .await
    .with_context(|| standby.log_tail())?;
    drop(s);
    let mut env = env;
    env.pg.stop_immediate()?;
    standby.promote().await?;
    let (mut n, conn) =
        tokio_postgres::connect(&standby.dsn(&env.db), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    write_events(&mut n, &deposits(51..=100), false).await?;
    let recs = read_topic(&env.bootstrap(), TOPIC, 100, Duration::from_secs(120))
        .with_context(|| read_log(&log))?;
    assert_eq!(
        versions_of(&recs),
        (1..=100).collect::<Vec<_>>(),
        "{}",
        read_log(&log)
    );
    let text = read_log(&log);
    assert!(text.contains("timeline changed from 1 to 2"), "{text}");
    assert!(!text.contains("replication slot lost"), "{text}");
    relay.sigkill();
    Ok(())
}

/// R33: the source is restored from a file-level copy taken earlier while the broker (and the
/// consumer, in another cluster) already hold newer events. The copy brings its slot and its
/// state row back together with its WAL, so the relay streams on from that history: old rows are
/// replayed as duplicates (absorbed by the inbox, never applied twice), the events lost with the
/// restore stay applied once, and events written after the restore arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_from_an_older_file_copy_while_the_broker_holds_newer_events() -> anyhow::Result<()>
{
    let mut env = Env::start("sl_restore").await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    // The consumer keeps its own database elsewhere: the restore must not roll it back.
    let consumer_pg = Postgres::start()?;
    let inbox_dsn = consumer_pg.dsn(&consumer_db(&consumer_pg, "inbox").await?);
    let reader = InboxReader::start(&env.bootstrap(), TOPIC, &inbox_dsn);
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&config, log.clone())?;

    // Phase A, then the copy (crash-consistent, like a storage snapshot).
    writer.wait_committed(300, Duration::from_secs(60)).await?;
    writer.pause(true).await;
    env.caught_up(CAUGHT_UP).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await; // the state row records it
    let backup = env.dir.path().join("backup");
    env.pg.stop_immediate()?;
    copy_dir(&env.pg.data_dir(), &backup)?;
    tokio::task::block_in_place(|| env.pg.restart())?;

    // Phase B reaches the broker and the consumer, then is lost by the restore.
    let a = writer.committed_events();
    writer.pause(false).await;
    writer
        .wait_committed(a + 300, Duration::from_secs(60))
        .await?;
    writer.pause(true).await;
    env.caught_up(CAUGHT_UP).await?;
    let ids = writer.snapshot().committed.keys().copied().collect();
    reader.wait_applied(&ids, Duration::from_secs(120)).await?;
    assert!(relay.sigterm()?.success());
    env.pg.stop_immediate()?;
    std::fs::remove_dir_all(env.pg.data_dir())?;
    copy_dir(&backup, &env.pg.data_dir())?;
    tokio::task::block_in_place(|| env.pg.restart())?;
    let c = env.sql().await?;
    let rows: i64 = c
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0);
    assert!(
        rows < writer.committed_events() as i64,
        "the restore did not roll back"
    );

    // Phase C: the relay on the restored source, new events after it.
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    let b = writer.committed_events();
    writer.pause(false).await;
    writer
        .wait_committed(b + 300, Duration::from_secs(60))
        .await?;
    let wlog = writer.stop().await?;
    env.caught_up(CAUGHT_UP)
        .await
        .with_context(|| read_log(&log))?;
    assert!(relay.sigterm()?.success());
    let (stats, report) = drain_and_verify(reader, &wlog, "acct", &inbox_dsn).await?;
    let text = read_log(&log);
    assert!(!text.contains("replication slot lost"), "{text}");
    eprintln!(
        "restore: {} committed (B lost by the restore, already delivered), {} records, {} \
         duplicates, consumer duplicates absorbed {}",
        wlog.committed.len(),
        report.records,
        report.duplicates,
        stats.duplicates
    );
    Ok(())
}

/// `cp -a`: keeps the server's ownership and modes.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    let st = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()?;
    anyhow::ensure!(st.success(), "cp -a {} {}", from.display(), to.display());
    Ok(())
}

/// The skip after a Postgres crash must never pass an unacknowledged event. Here acks run ahead
/// of the state row (its writes are held behind a lock) when Postgres crashes: the row is older
/// than what the broker holds, so the relay replays more — and loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_between_the_acks_and_the_state_write() -> anyhow::Result<()> {
    let mut w = world(Env::start("sl_ackgap").await?).await?;
    let mut relay = w.spawn()?;
    w.writer
        .wait_committed(300, Duration::from_secs(60))
        .await?;
    w.env.caught_up(CAUGHT_UP).await?;
    let held_at = w.env.recorded_acked_lsn().await?;
    let mut locker = w.env.sql().await?;
    let tx = locker.transaction().await?;
    tx.batch_execute("LOCK TABLE outboxd_slot_state IN ACCESS EXCLUSIVE MODE")
        .await?;
    w.commit_more(300).await?;
    // The slot moved on (acks), the state row could not.
    let confirmed = w.env.confirmed_lsn().await?;
    assert!(confirmed > held_at, "no acks while the state row was held");
    tokio::task::block_in_place(|| w.env.pg.restart())?;
    drop(tx);
    let (wlog, report) = finish(&w.env, w.writer, w.reader, &w.inbox_dsn, &mut relay).await?;
    eprintln!(
        "crash between acks and state write: {} committed, {} records, {} duplicates",
        wlog.committed.len(),
        report.records,
        report.duplicates
    );
    Ok(())
}
