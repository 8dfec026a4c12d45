//! Decoding on a standby (R45, issue 31): `source.replication_dsn` names a physical standby
//! (Postgres 16+) where the slot and the stream live; `source.dsn` stays the primary, where the
//! application writes and outboxd keeps its tables. On the version matrix's Postgres 17 and 18
//! (npm builds; the standby is the testkit's low-level base backup):
//! - `init` creates the slot on the standby, `check` and `status` say where it lives; every
//!   event written on the primary arrives once, in order; heartbeats written on the primary keep
//!   an idle standby slot moving;
//! - the primary dies and the standby is promoted while a writer commits: the relay streams on
//!   from the same slot (a new timeline, no recovery), and every row the promoted server holds is
//!   on the topic, in per-aggregate order;
//! - the standby's slot is dropped (a standby rebuilt, or its slot invalidated): the slot-loss
//!   recovery republishes the gap, read on the standby under the new slot's snapshot.

use anyhow::{ensure, Context, Result};
use outboxd_tests::reliability::{read_log, streaming_pids, wait_for_active};
use outboxd_tests::testkit::{Broker, Postgres, StandbyOptions, PG_PASSWORD};
use outboxd_tests::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const TOPIC: &str = "outbox.event.acct";

fn deposits(agg: &str, versions: std::ops::RangeInclusive<i64>) -> Vec<NewEvent> {
    versions
        .map(|v| NewEvent::new("acct", agg, v, "Deposited", serde_json::json!({"v": v})))
        .collect()
}

/// Versions per aggregate in topic order, first occurrences only (duplicates allowed).
fn order(recs: &[Record]) -> BTreeMap<String, Vec<i64>> {
    let mut seen = std::collections::HashSet::new();
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in recs {
        if seen.insert(r.header("event_id").to_string()) {
            out.entry(r.header("aggregate_id").to_string())
                .or_default()
                .push(r.header("aggregate_version").parse().unwrap());
        }
    }
    out
}

/// A primary of Postgres `major` with a standby (hot_standby_feedback on), an `Env` on the
/// primary whose own slot (made by `Env::with`) is dropped, and a config file whose stream and
/// slot live on the standby. `init` has not run for it yet.
struct World {
    env: Env,
    standby: Postgres,
    config: PathBuf,
}

async fn world(major: u32, name: &str, extra: &str) -> Result<World> {
    world_with(major, name, extra, true).await
}

async fn world_with(major: u32, name: &str, extra: &str, feedback: bool) -> Result<World> {
    let mut env = Env::with(Postgres::start_version(major)?, Broker::start()?, name).await?;
    env.drop_slot().await?;
    env.sql()
        .await?
        .execute(
            "DELETE FROM outboxd_slot_state WHERE slot_name = $1",
            &[&env.slot],
        )
        .await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let standby = env
        .pg
        .start_standby(StandbyOptions {
            slot: Some(format!("phys_{name}")),
            settings: vec![(
                "hot_standby_feedback".into(),
                if feedback { "on" } else { "off" }.into(),
            )],
        })
        .await?;
    env.slot = format!("sb_{name}");
    let standby_dsn = format!(
        "host=127.0.0.1 port={} user=postgres password={PG_PASSWORD} dbname={}",
        standby.port, env.db
    );
    // `extra` lands in [relay] unless it opens its own section.
    env.extra_toml = format!("{extra}\n[heartbeat]\ninterval_ms = 300\n");
    let toml = env.toml().replacen(
        "[source]\n",
        &format!("[source]\nreplication_dsn = \"{standby_dsn}\"\n"),
        1,
    );
    let config = env.dir.path().join("standby.toml");
    std::fs::write(&config, toml)?;
    Ok(World {
        env,
        standby,
        config,
    })
}

impl World {
    /// The standby slot's confirmed position (0 while it does not exist).
    async fn standby_confirmed(&self, db: &str) -> Result<u64> {
        let c = self.standby.connect(db).await?;
        let r = c
            .query_opt(
                "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots \
                 WHERE slot_name = $1",
                &[&self.env.slot],
            )
            .await?;
        Ok(r.and_then(|r| r.get::<_, Option<i64>>(0)).unwrap_or(0) as u64)
    }

    /// A relay delivers versions 1–30 of `a-1` (its delivery mark recorded) and stops; 31–60
    /// are written while it is down. Returns its log and a client of the primary.
    async fn delivered_then_stopped(&self) -> Result<(PathBuf, tokio_postgres::Client)> {
        let log = self.env.dir.path().join("relay.log");
        let mut relay = RelayProcess::spawn(&self.config, log.clone())?;
        let mut c = self.env.sql().await?;
        write_events(&mut c, &deposits("a-1", 1..=30), false).await?;
        self.caught_up(&log).await?;
        self.env.mark_recorded().await?;
        relay.sigterm()?;
        write_events(&mut c, &deposits("a-1", 31..=60), false).await?;
        Ok((log, c))
    }

    /// After the slot was lost: a relay starts, 61–90 follow, and 1–90 are all on the topic in
    /// order — the gap recovered, not skipped.
    async fn recovers_the_gap(&self, log: &Path, c: &mut tokio_postgres::Client) -> Result<()> {
        let mut relay = RelayProcess::spawn(&self.config, log.to_path_buf())?;
        write_events(c, &deposits("a-1", 61..=90), false).await?;
        let recs = read_topic(&self.env.bootstrap(), TOPIC, 90, Duration::from_secs(90))
            .with_context(|| read_log(log))?;
        assert_eq!(
            order(&recs).get("a-1"),
            Some(&(1..=90).collect::<Vec<i64>>()),
            "{}",
            read_log(log)
        );
        let text = read_log(log);
        assert!(text.contains("replication slot lost"), "{text}");
        relay.sigkill();
        Ok(())
    }

    /// Waits until the standby's slot confirmed everything the primary wrote before the call.
    async fn caught_up(&self, log: &std::path::Path) -> Result<()> {
        let target = self.env.current_lsn().await?;
        eventually(Duration::from_secs(60), || async {
            Ok(self.standby_confirmed(&self.env.db).await? >= target)
        })
        .await
        .with_context(|| read_log(log))
    }
}

macro_rules! per_version {
    ($f:ident: $($name:ident => $major:expr),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() -> Result<()> {
            $f($major).await
        }
    )*};
}

per_version! { streams_from_the_standby:
    standby_streams_on_postgres_16 => 16,
    standby_streams_on_postgres_17 => 17,
    standby_streams_on_postgres_18 => 18,
}

async fn streams_from_the_standby(major: u32) -> Result<()> {
    let maddr = format!("127.0.0.1:{}", outboxd_tests::testkit::free_port());
    let w = world(
        major,
        &format!("sbs{major}"),
        &format!("[metrics]\nlisten = \"{maddr}\"\n"),
    )
    .await?;
    let (code, out) = outboxd_cli(&["init"], &w.config);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("on the server of source.replication_dsn"),
        "{out}"
    );
    // init waited until the primary held the new slot's catalog_xmin (hot-standby feedback).
    assert!(!out.contains("feedback for the new slot"), "{out}");
    // The slot is on the standby, not on the primary.
    let p = w.env.sql().await?;
    let on_primary: i64 = p
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&w.env.slot],
        )
        .await?
        .get(0);
    assert_eq!(on_primary, 0);
    ensure!(
        w.standby_confirmed(&w.env.db).await? > 0,
        "no slot on the standby"
    );
    let (code, out) = outboxd_cli(&["check"], &w.config);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("source.replication_dsn is a standby"), "{out}");

    let log = w.env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&w.config, log.clone())?;
    let mut c = w.env.sql().await?;
    for round in 0..5 {
        let from = round * 20 + 1;
        write_events(&mut c, &deposits("a-1", from..=from + 19), false).await?;
        write_events(&mut c, &deposits("a-2", from..=from + 19), false).await?;
    }
    let recs = read_topic(&w.env.bootstrap(), TOPIC, 200, Duration::from_secs(60))
        .with_context(|| read_log(&log))?;
    let got = order(&recs);
    let want: Vec<i64> = (1..=100).collect();
    assert_eq!(got.get("a-1"), Some(&want), "{}", read_log(&log));
    assert_eq!(got.get("a-2"), Some(&want), "{}", read_log(&log));
    w.caught_up(&log).await?;

    // Idle: the primary writes WAL that is no outbox event; the heartbeats (written on the
    // primary, decoded on the standby) move the standby's slot past it.
    p.batch_execute(
        "CREATE TABLE noise (x int); INSERT INTO noise SELECT generate_series(1, 1000)",
    )
    .await?;
    w.caught_up(&log).await?;

    // status says where the slot lives and how far the standby is behind.
    let (code, out) = outboxd_cli(&["status", "--json"], &w.config);
    assert_eq!(code, 0, "{out}");
    let doc: serde_json::Value = serde_json::from_str(out.trim()).with_context(|| out.clone())?;
    assert_eq!(doc["slot"]["server"], "standby", "{doc}");
    assert!(doc["slot"]["standby_replay_lag_bytes"].is_i64(), "{doc}");
    assert!(doc["slot"]["active_pid"].is_i64(), "{doc}");
    // The metrics count lags from the primary's WAL end, and say how far the standby replays.
    eventually(Duration::from_secs(30), || async {
        let m = http_get(&maddr, "/metrics").1;
        Ok(
            m.contains("outboxd_standby_replay_lag_bytes ")
                && m.contains("outboxd_slot_lag_bytes "),
        )
    })
    .await
    .with_context(|| read_log(&log))?;
    // The delivery state on the primary follows the standby's slot.
    eventually(Duration::from_secs(30), || async {
        Ok(w.env.recorded_acked_lsn().await? > 0)
    })
    .await
    .with_context(|| read_log(&log))?;
    relay.sigterm()?;
    let text = read_log(&log);
    assert!(!text.contains("replication slot lost"), "{text}");
    Ok(())
}

per_version! { promotion_mid_load:
    standby_promoted_mid_load_on_postgres_16 => 16,
    standby_promoted_mid_load_on_postgres_17 => 17,
}

/// The primary dies mid-load and the standby holding the slot is promoted: `source.dsn` lists
/// both hosts (`target_session_attrs=read-write`), so the relay's SQL follows the promotion;
/// the stream stays on the same slot.
async fn promotion_mid_load(major: u32) -> Result<()> {
    let mut w = world(major, &format!("sbp{major}"), "").await?;
    let multi = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres password={PG_PASSWORD} dbname={} \
         target_session_attrs=read-write",
        w.env.pg.port, w.standby.port, w.env.db
    );
    let text = std::fs::read_to_string(&w.config)?.replace(&w.env.pg.dsn(&w.env.db), &multi);
    std::fs::write(&w.config, text)?;
    let (code, out) = outboxd_cli(&["init"], &w.config);
    assert_eq!(code, 0, "{out}");
    let log = w.env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&w.config, log.clone())?;
    let mut c = w.env.sql().await?;
    write_events(&mut c, &deposits("a-1", 1..=50), false).await?;
    w.caught_up(&log).await?;
    // A writer commits one event per transaction until the primary is gone.
    let dsn = w.env.pg.dsn(&w.env.db);
    let writer = tokio::spawn(async move {
        let (mut c, conn) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        let mut v = 51;
        loop {
            if write_events(&mut c, &deposits("a-1", v..=v), false)
                .await
                .is_err()
            {
                return Ok::<i64, anyhow::Error>(v);
            }
            v += 1;
        }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    w.env.pg.stop_immediate()?;
    let stopped_at = writer.await??;
    w.standby.promote().await?;
    // Writes go on on the promoted server, from the version after the last one it holds.
    let (mut n, conn) =
        tokio_postgres::connect(&w.standby.dsn(&w.env.db), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let last: i64 = n
        .query_one(
            "SELECT coalesce(max(aggregate_version), 0) FROM outbox WHERE aggregate_id = 'a-1'",
            &[],
        )
        .await?
        .get(0);
    // The writer's last commit may have reached the standby even though its reply was lost.
    ensure!(
        last >= 50 && last <= stopped_at,
        "the promoted server holds up to {last}, the writer stopped at {stopped_at}"
    );
    write_events(&mut n, &deposits("a-1", last + 1..=last + 50), false).await?;
    let total = (last + 50) as usize;
    let recs = read_topic(&w.env.bootstrap(), TOPIC, total, Duration::from_secs(120))
        .with_context(|| read_log(&log))?;
    let got = order(&recs);
    // Every row of the promoted server, in order; a version the dead primary committed but the
    // standby never replayed may have been delivered before the promotion (the relay was sent
    // only what the standby replayed, so it cannot be).
    let want: Vec<i64> = (1..=last + 50).collect();
    assert_eq!(got.get("a-1"), Some(&want), "{}", read_log(&log));
    let text = read_log(&log);
    assert!(!text.contains("replication slot lost"), "{text}");
    relay.sigkill();
    Ok(())
}

per_version! { standby_slot_lost:
    standby_slot_lost_is_recovered_on_postgres_16 => 16,
    standby_slot_lost_is_recovered_on_postgres_17 => 17,
}

/// The standby's slot vanishes while the relay is down (the standby rebuilt, or its slot
/// invalidated and dropped): the relay republishes the gap, read on the standby.
async fn standby_slot_lost(major: u32) -> Result<()> {
    let w = world(major, &format!("sbl{major}"), "").await?;
    let (code, out) = outboxd_cli(&["init"], &w.config);
    assert_eq!(code, 0, "{out}");
    let (log, mut c) = w.delivered_then_stopped().await?;
    let s = w.standby.connect(&w.env.db).await?;
    eventually(Duration::from_secs(30), || async {
        Ok(
            s.execute("SELECT pg_drop_replication_slot($1)", &[&w.env.slot])
                .await
                .is_ok(),
        )
    })
    .await?;
    w.recovers_the_gap(&log, &mut c).await?;
    ensure!(
        w.standby_confirmed(&w.env.db).await? > 0,
        "no new slot on the standby"
    );
    Ok(())
}

per_version! { standby_without_feedback:
    standby_slot_invalidated_by_the_primarys_vacuum_on_postgres_17 => 17,
}

/// A standby without `hot_standby_feedback`: `check` warns; the primary's vacuum then removes
/// catalog rows the standby's slot still needs, the standby invalidates the slot
/// (`rows_removed`), and the relay recovers the gap from the table instead of losing it.
async fn standby_without_feedback(major: u32) -> Result<()> {
    let w = world_with(major, &format!("sbf{major}"), "", false).await?;
    let (code, out) = outboxd_cli(&["init"], &w.config);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("WARNING: hot_standby_feedback is off"),
        "{out}"
    );
    assert!(out.contains("feedback for the new slot"), "{out}");
    let (code, out) = outboxd_cli(&["check"], &w.config);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("hot_standby_feedback is off"), "{out}");
    let (log, mut c) = w.delivered_then_stopped().await?;
    // Catalog rows die on the primary and its vacuum removes them: nothing tells it the
    // standby's slot still needs them.
    let s = w.standby.connect(&w.env.db).await?;
    eventually(Duration::from_secs(60), || async {
        c.batch_execute("CREATE TABLE churn (x int)").await?;
        c.batch_execute("DROP TABLE churn").await?;
        c.batch_execute("VACUUM pg_class, pg_attribute, pg_type, pg_depend")
            .await?;
        let r = s
            .query_opt(
                "SELECT to_jsonb(s) ->> 'invalidation_reason' FROM pg_replication_slots s \
                 WHERE slot_name = $1",
                &[&w.env.slot],
            )
            .await?;
        Ok(r.and_then(|r| r.get::<_, Option<String>>(0)).is_some())
    })
    .await
    .context("the standby's slot was never invalidated")?;
    w.recovers_the_gap(&log, &mut c).await?;
    Ok(())
}

/// `source.replication_dsn` pointing at another cluster is refused, naming the fix. (The
/// testkit copies one template cluster per version, so every Postgres 17 cluster here has the
/// same system identifier: the other cluster is a Postgres 15 one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_dsn_of_another_cluster_is_refused() -> Result<()> {
    let w = world(17, "sbo17", "").await?;
    let other = Postgres::start()?;
    other.create_database(&w.env.db).await?;
    let text = std::fs::read_to_string(&w.config)?.replace(
        &format!("port={} ", w.standby.port),
        &format!("port={} ", other.port),
    );
    std::fs::write(&w.config, text)?;
    let out = check_fails_naming(&w.config, "different clusters");
    assert!(out.contains("physical standby"), "{out}");
    Ok(())
}

/// Two instances share the standby's slot: the holder is frozen (SIGSTOP), the other reads
/// its silence from the beats on the primary, terminates its walsender on the standby and
/// streams on; thawed, the old holder stands by. Nothing lost, per-aggregate order kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_holder_of_a_standby_slot_is_fenced() -> Result<()> {
    let w = world(
        17,
        "sbh17",
        "takeover_after_ms = 2000\nstandby_poll_ms = 500\n",
    )
    .await?;
    let (code, out) = outboxd_cli(&["init"], &w.config);
    assert_eq!(code, 0, "{out}");
    let relays = vec![
        RelayProcess::spawn(&w.config, w.env.dir.path().join("r0.log"))?,
        RelayProcess::spawn(&w.config, w.env.dir.path().join("r1.log"))?,
    ];
    // The walsenders live on the standby.
    let s = w.standby.connect(&w.env.db).await?;
    let active = wait_for_active(&s, &w.env.slot, &relays, None, Duration::from_secs(30)).await?;
    let other = 1 - active;
    let mut c = w.env.sql().await?;
    write_events(&mut c, &deposits("a-1", 1..=20), false).await?;
    w.caught_up(&relays[active].log).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(relays[active].child.id() as i32, libc::SIGSTOP) };
    let frozen = relays[active].child.id();
    let next = wait_for_active(
        &s,
        &w.env.slot,
        &relays,
        Some(frozen),
        Duration::from_secs(30),
    )
    .await?;
    assert_eq!(next, other);
    let log = read_log(&relays[other].log);
    assert!(log.contains("FENCED"), "{log}");
    write_events(&mut c, &deposits("a-1", 21..=40), false).await?;
    w.caught_up(&relays[other].log).await?;
    // SAFETY: as above.
    unsafe { libc::kill(frozen as i32, libc::SIGCONT) };
    let thawed = relays[active].log.clone();
    eventually(Duration::from_secs(20), || async {
        Ok(read_log(&thawed).contains("role=\"standby\""))
    })
    .await?;
    write_events(&mut c, &deposits("a-1", 41..=60), false).await?;
    let recs = read_topic(&w.env.bootstrap(), TOPIC, 60, Duration::from_secs(60))
        .with_context(|| read_log(&relays[other].log))?;
    assert_eq!(
        order(&recs).get("a-1"),
        Some(&(1..=60).collect::<Vec<i64>>()),
        "{}",
        read_log(&relays[other].log)
    );
    let pids = streaming_pids(&s, &w.env.slot).await?;
    assert_eq!(pids, vec![relays[other].child.id()]);
    Ok(())
}
