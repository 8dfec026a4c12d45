//! Decoding on a standby (R45) at its edges (issue 39), on the version matrix's Postgres 17:
//! - **divergence**: the standby holding the slot is promoted while the primary runs on (a DR
//!   drill): the relay refuses to stream the diverged server, naming both servers and the fix,
//!   and `outboxd check` says why; so does a cascading standby that follows its promoted
//!   upstream (still in recovery, on another timeline than the primary's);
//! - **stall check**: replay paused on the standby for longer than the stall timeout (the
//!   walsender there sends nothing meanwhile) does not end the session: the check asks the
//!   server that runs our walsender whether our status updates reach it;
//! - **parked events**: an event parked on the primary is not confirmed past on the standby's
//!   slot until the standby replayed the parked row (else a promotion before that replay would
//!   leave the event neither on the topic nor in `outbox_parked`); and that promotion itself,
//!   the standby's WAL feed cut before the parked row: the event is parked on the promoted server.
//!
//! The setup is `standby_decoding.rs`'s: a primary with a physical standby
//! (`hot_standby_feedback = on`), the slot and the stream on the standby, outboxd's tables and
//! the heartbeats on the primary.

use anyhow::{ensure, Context, Result};
use outboxd_tests::reliability::read_log;
use outboxd_tests::testkit::{
    Broker, Mode, PgOptions, Postgres, Proxy, StandbyOptions, PG_PASSWORD,
};
use outboxd_tests::*;
use std::path::PathBuf;
use std::time::Duration;

const TOPIC: &str = "outbox.event.acct";

fn deposits(agg: &str, versions: std::ops::RangeInclusive<i64>) -> Vec<NewEvent> {
    versions
        .map(|v| {
            NewEvent::new(
                "acct",
                agg,
                v,
                "Deposited",
                serde_json::json!({"amount": v}),
            )
        })
        .collect()
}

/// A Postgres 17 primary with a standby, an `Env` on the primary whose own slot is dropped,
/// and a config file whose stream and slot live on the standby; `init` has run.
struct World {
    env: Env,
    /// The slot's server: the primary's standby, or with [`cascaded`] that standby's standby.
    standby: Postgres,
    /// With [`cascaded`]: the standby between the primary and the slot's server.
    upstream: Option<Postgres>,
    /// With [`fed_through_a_proxy`]: what carries the primary's WAL to the standby.
    feed: Option<Proxy>,
    config: PathBuf,
    log: PathBuf,
}

/// How the slot's standby gets the primary's WAL.
#[derive(Clone, Copy, PartialEq)]
enum Feed {
    Direct,
    /// primary → upstream standby → the slot's standby.
    Cascade,
    /// Through a TCP proxy the test can cut.
    Proxied,
}

/// `extra` lands in `[relay]` unless it opens its own section; `heartbeat` in `[heartbeat]`.
async fn world(name: &str, extra: &str, heartbeat: &str) -> Result<World> {
    world_with(name, extra, heartbeat, Feed::Direct).await
}

/// The slot on a cascading standby: primary → upstream standby → the slot's standby.
async fn cascaded(name: &str) -> Result<World> {
    world_with(name, "", "", Feed::Cascade).await
}

/// The standby streams the primary's WAL through a proxy ([`World::feed`]).
async fn fed_through_a_proxy(name: &str, extra: &str) -> Result<World> {
    world_with(name, extra, "", Feed::Proxied).await
}

async fn world_with(name: &str, extra: &str, heartbeat: &str, feed: Feed) -> Result<World> {
    let cascade = feed == Feed::Cascade;
    // A base backup taken on a standby needs full-page writes since its last restartpoint
    // (the testkit turns them off for speed).
    let pg = Postgres::start_with(PgOptions {
        version: Some(17),
        settings: match cascade {
            true => vec![("full_page_writes".into(), "on".into())],
            false => vec![],
        },
        ..Default::default()
    })?;
    let mut env = Env::with(pg, Broker::start()?, name).await?;
    env.drop_slot().await?;
    env.sql()
        .await?
        .execute(
            "DELETE FROM outboxd_slot_state WHERE slot_name = $1",
            &[&env.slot],
        )
        .await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let mut settings = vec![("hot_standby_feedback".into(), "on".into())];
    let proxy = match feed {
        Feed::Proxied => {
            let p = Proxy::start(0, format!("127.0.0.1:{}", env.pg.port).parse()?)?;
            settings.push((
                "primary_conninfo".into(),
                format!(
                    "host=127.0.0.1 port={} user=postgres password={PG_PASSWORD} \
                     dbname=postgres application_name=testkit_standby",
                    p.port
                ),
            ));
            Some(p)
        }
        _ => None,
    };
    let standby = env
        .pg
        .start_standby(StandbyOptions {
            slot: Some(format!("phys_{name}")),
            settings,
        })
        .await?;
    let (standby, upstream) = match cascade {
        false => (standby, None),
        true => {
            env.sql().await?.batch_execute("CHECKPOINT").await?;
            let a = standby.connect("postgres").await?;
            replayed_to(&a, env.current_lsn().await?).await?;
            a.batch_execute("CHECKPOINT").await?;
            let next = standby
                .start_standby(StandbyOptions {
                    slot: Some(format!("casc_{name}")),
                    settings: vec![("hot_standby_feedback".into(), "on".into())],
                })
                .await?;
            (next, Some(standby))
        }
    };
    env.slot = format!("sb_{name}");
    let standby_dsn = format!(
        "host=127.0.0.1 port={} user=postgres password={PG_PASSWORD} dbname={}",
        standby.port, env.db
    );
    env.extra_toml = format!("{extra}\n[heartbeat]\ninterval_ms = 300\n{heartbeat}\n");
    let toml = env.toml().replacen(
        "[source]\n",
        &format!("[source]\nreplication_dsn = \"{standby_dsn}\"\n"),
        1,
    );
    let config = env.dir.path().join("standby.toml");
    std::fs::write(&config, toml)?;
    let (code, out) = outboxd_cli(&["init"], &config);
    ensure!(code == 0, "init failed: {out}");
    let log = env.dir.path().join("relay.log");
    Ok(World {
        env,
        standby,
        upstream,
        feed: proxy,
        config,
        log,
    })
}

/// Waits until the standby of `s` replayed up to `target`.
async fn replayed_to(s: &tokio_postgres::Client, target: u64) -> Result<()> {
    eventually(Duration::from_secs(30), || async {
        let r: i64 = s
            .query_one("SELECT (pg_last_wal_replay_lsn() - '0/0')::bigint", &[])
            .await?
            .get(0);
        Ok(r as u64 >= target)
    })
    .await
}

/// Whether the server of `c` holds a parked row of event `id`.
async fn parked(c: &tokio_postgres::Client, id: &str) -> Result<bool> {
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox_parked WHERE event_id::text = $1",
            &[&id],
        )
        .await?
        .get(0);
    Ok(n == 1)
}

impl World {
    async fn standby_sql(&self) -> Result<tokio_postgres::Client> {
        self.standby.connect(&self.env.db).await
    }

    /// The standby slot's confirmed position (0 while it does not exist).
    async fn standby_confirmed(&self) -> Result<u64> {
        let r = self
            .standby_sql()
            .await?
            .query_opt(
                "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots \
                 WHERE slot_name = $1",
                &[&self.env.slot],
            )
            .await?;
        Ok(r.and_then(|r| r.get::<_, Option<i64>>(0)).unwrap_or(0) as u64)
    }

    /// Waits until the standby's slot confirmed everything the primary wrote before the call.
    async fn caught_up(&self) -> Result<()> {
        let target = self.env.current_lsn().await?;
        eventually(Duration::from_secs(60), || async {
            Ok(self.standby_confirmed().await? >= target)
        })
        .await
        .with_context(|| read_log(&self.log))
    }

    /// Waits until the standby replayed everything the primary wrote before the call.
    async fn replayed(&self) -> Result<()> {
        replayed_to(&self.standby_sql().await?, self.env.current_lsn().await?).await
    }

    /// Pauses (or resumes) replay on the standby; a pause is in effect when this returns.
    async fn replay_paused(&self, paused: bool) -> Result<()> {
        let s = self.standby_sql().await?;
        let f = if paused {
            "pg_wal_replay_pause"
        } else {
            "pg_wal_replay_resume"
        };
        s.batch_execute(&format!("SELECT {f}()")).await?;
        if paused {
            eventually(Duration::from_secs(10), || async {
                let st: String = s
                    .query_one("SELECT pg_get_wal_replay_pause_state()", &[])
                    .await?
                    .get(0);
                Ok(st == "paused")
            })
            .await?;
        }
        Ok(())
    }

    /// A relay process delivers `a-1` 1..=n; returns it once the standby's slot caught up.
    async fn relay_delivering(&self, n: i64) -> Result<RelayProcess> {
        let relay = RelayProcess::spawn(&self.config, self.log.clone())?;
        let mut c = self.env.sql().await?;
        write_events(&mut c, &deposits("a-1", 1..=n), false).await?;
        read_topic(
            &self.env.bootstrap(),
            TOPIC,
            n as usize,
            Duration::from_secs(60),
        )
        .with_context(|| read_log(&self.log))?;
        self.caught_up().await?;
        Ok(relay)
    }
}

/// A DR drill: the standby holding the slot is promoted while the primary runs on. Both take
/// writes now, with the same system identifier. The relay must not stream the promoted server
/// (its events are not the primary's, and the primary's would never arrive): it stops, naming
/// both servers and the fix, and `outboxd check` refuses the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_promoted_while_the_primary_runs_is_refused() -> Result<()> {
    let w = world("sbdiv", "", "").await?;
    let mut relay = w.relay_delivering(20).await?;
    w.standby.promote().await?;
    // Both servers take writes: the primary's are the application's, the promoted one's are
    // a diverged history that must never reach the topic. The relay notices the promotion
    // within a tick (250 ms); the drill's first writes on the promoted server come later.
    let mut c = w.env.sql().await?;
    write_events(&mut c, &deposits("a-1", 21..=30), false).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (mut d, conn) =
        tokio_postgres::connect(&w.standby.dsn(&w.env.db), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    write_events(&mut d, &deposits("diverged", 1..=10), false).await?;
    let status = relay
        .wait_exit(Duration::from_secs(60))
        .with_context(|| read_log(&w.log))?;
    let log = read_log(&w.log);
    assert!(!status.success(), "{log}");
    let primary = format!("127.0.0.1:{}", w.env.pg.port);
    let standby = format!("127.0.0.1:{}", w.standby.port);
    assert!(log.contains("no longer follows source.dsn"), "{log}");
    assert!(log.contains(&primary) && log.contains(&standby), "{log}");
    assert!(log.contains("point source.dsn at it"), "{log}");
    assert!(!log.contains(PG_PASSWORD), "{log}");
    let recs = read_topic(&w.env.bootstrap(), TOPIC, 20, Duration::from_secs(10))?;
    assert!(
        recs.iter().all(|r| r.header("aggregate_id") != "diverged"),
        "the diverged server was streamed: {log}"
    );
    let out = check_fails_naming(&w.config, "no longer follows source.dsn");
    assert!(out.contains(&primary) && out.contains(&standby), "{out}");
    assert!(!out.contains(PG_PASSWORD), "{out}");
    Ok(())
}

/// Replay paused on the standby (a query conflict, `recovery_min_apply_delay`, an operator)
/// for four times the stall timeout: the walsender there decodes and sends nothing meanwhile,
/// but it hears our status updates, so the session goes on; once replay resumes, what was
/// written meanwhile arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_paused_on_the_standby_is_no_stall() -> Result<()> {
    let w = world("sbstall", "", "stall_timeout_ms = 2000").await?;
    let mut relay = w.relay_delivering(10).await?;
    w.replay_paused(true).await?;
    let mut c = w.env.sql().await?;
    write_events(&mut c, &deposits("a-1", 11..=20), false).await?;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let log = read_log(&w.log);
    assert!(!log.contains("stalled"), "{log}");
    assert!(!log.contains("session failed"), "{log}");
    w.replay_paused(false).await?;
    let recs = read_topic(&w.env.bootstrap(), TOPIC, 20, Duration::from_secs(60))
        .with_context(|| read_log(&w.log))?;
    assert_eq!(recs.len(), 20, "{}", read_log(&w.log));
    w.caught_up().await?;
    let log = read_log(&w.log);
    assert_eq!(log.matches("session: streaming").count(), 1, "{log}");
    relay.sigterm()?;
    Ok(())
}

/// Writes an event `amounts_must_be_positive` refuses (a negative amount) on the primary and
/// waits until the standby replayed it; returns it and the WAL position before its commit.
async fn poison_replayed(w: &World, c: &mut tokio_postgres::Client) -> Result<(NewEvent, u64)> {
    let poison = NewEvent::new(
        "acct",
        "a-2",
        1,
        "Deposited",
        serde_json::json!({"amount": -5}),
    );
    let before = write_events_returning_lsn(c, std::slice::from_ref(&poison)).await?;
    w.replayed().await?;
    Ok((poison, before))
}

/// A schema directory where `Deposited` needs a positive amount, and its `[validation]`.
fn amounts_must_be_positive() -> Result<(tempfile::TempDir, String)> {
    let schemas = outboxd_tests::testkit::tempdir("sb-schemas")?;
    std::fs::create_dir_all(schemas.path().join("Deposited"))?;
    std::fs::write(
        schemas.path().join("Deposited/1.json"),
        r#"{"type": "object", "required": ["amount"], "properties": {"amount": {"type": "integer", "minimum": 1}}}"#,
    )?;
    let validation = format!(
        "[validation]\nschema_dir = \"{}\"\n",
        schemas.path().display()
    );
    Ok((schemas, validation))
}

/// An event parked on the primary while the standby has not replayed the parked row (replay
/// paused after it decoded the event): the standby's slot stays before the event until replay
/// resumes. Otherwise a promotion of the standby in that window would leave the event neither
/// on the topic nor in `outbox_parked`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_event_is_not_confirmed_before_the_standby_replayed_its_row() -> Result<()> {
    let (_schemas, validation) = amounts_must_be_positive()?;
    let w = world("sbpark", &validation, "").await?;
    let mut relay = w.relay_delivering(5).await?;
    relay.sigterm()?;
    // The poison event is on the standby (decodable there) before replay stops; the row that
    // parks it, written on the primary once a relay reads the event, is not.
    let mut c = w.env.sql().await?;
    let (poison, before) = poison_replayed(&w, &mut c).await?;
    w.replay_paused(true).await?;
    let mut relay = RelayProcess::spawn(&w.config, w.log.clone())?;
    let id = poison.event_id.to_string();
    eventually(Duration::from_secs(30), || parked(&c, &id))
        .await
        .with_context(|| read_log(&w.log))?;
    // Several status intervals (200 ms) and ticks later: still before the event.
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let confirmed = w.standby_confirmed().await?;
        ensure!(
            confirmed <= before,
            "the standby's slot confirmed {confirmed:X}, past the parked event (before it: \
             {before:X}), while the standby has not replayed its parked row: {}",
            read_log(&w.log)
        );
    }
    // The fence outlives the session (issue 56): the state row's acknowledged position, where
    // the next session starts, stays below the event too, and a restarted relay still holds.
    let recorded = w.env.recorded_acked_lsn().await?;
    ensure!(
        recorded <= before,
        "outboxd_slot_state.acked_lsn {recorded:X} is past the parked event ({before:X}) while \
         the standby has not replayed its row: {}",
        read_log(&w.log)
    );
    relay.sigterm()?;
    let mut relay = RelayProcess::spawn(&w.config, w.log.clone())?;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let confirmed = w.standby_confirmed().await?;
        ensure!(
            confirmed <= before && w.env.recorded_acked_lsn().await? <= before,
            "after a restart the slot confirmed {confirmed:X}, past the parked event \
             ({before:X}): {}",
            read_log(&w.log)
        );
    }
    w.replay_paused(false).await?;
    eventually(Duration::from_secs(30), || async {
        Ok(w.standby_confirmed().await? > before)
    })
    .await
    .with_context(|| read_log(&w.log))?;
    let log = read_log(&w.log);
    assert!(log.contains("event parked"), "{log}");
    assert!(!log.contains("session failed"), "{log}");
    relay.sigterm()?;
    Ok(())
}

/// The slot on a cascading standby (primary → A → B); A is promoted while the primary runs on.
/// B stays in recovery but follows A's new timeline: its slot would decode A's diverged
/// history. The relay stops, naming both servers and the timelines, and `check` refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_following_a_promoted_server_is_refused() -> Result<()> {
    let w = cascaded("sbcas").await?;
    let mut relay = w.relay_delivering(20).await?;
    let upstream = w.upstream.as_ref().context("no upstream")?;
    upstream.promote().await?;
    let mut c = w.env.sql().await?;
    write_events(&mut c, &deposits("a-1", 21..=30), false).await?;
    // B follows A onto its new timeline (its WAL receiver reconnects within seconds); the
    // drill's writes on A come after.
    let s = w.standby_sql().await?;
    eventually(Duration::from_secs(60), || async {
        let r = s
            .query_opt("SELECT received_tli FROM pg_stat_wal_receiver", &[])
            .await?;
        Ok(r.and_then(|r| r.get::<_, Option<i32>>(0)) == Some(2))
    })
    .await
    .context("the cascading standby did not follow its promoted upstream")?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (mut d, conn) =
        tokio_postgres::connect(&upstream.dsn(&w.env.db), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    write_events(&mut d, &deposits("diverged", 1..=10), false).await?;
    let status = relay
        .wait_exit(Duration::from_secs(60))
        .with_context(|| read_log(&w.log))?;
    let log = read_log(&w.log);
    assert!(!status.success(), "{log}");
    let primary = format!("127.0.0.1:{}", w.env.pg.port);
    let standby = format!("127.0.0.1:{}", w.standby.port);
    assert!(log.contains("does not follow source.dsn"), "{log}");
    assert!(log.contains("streams timeline 2"), "{log}");
    assert!(log.contains(&primary) && log.contains(&standby), "{log}");
    assert!(!log.contains(PG_PASSWORD), "{log}");
    let recs = read_topic(&w.env.bootstrap(), TOPIC, 20, Duration::from_secs(10))?;
    assert!(
        recs.iter().all(|r| r.header("aggregate_id") != "diverged"),
        "the diverged history was streamed: {log}"
    );
    let out = check_fails_naming(&w.config, "does not follow source.dsn");
    assert!(out.contains("primary_conninfo"), "{out}");
    Ok(())
}

/// The loss itself: the primary parks an event the standby already decoded, the standby never
/// receives the parked row (its WAL feed cut), the primary dies and the standby is promoted
/// (`dsn` lists both hosts). The slot was kept before the event, so the relay on the promoted
/// server reads the event again and parks it there: it is in `outbox_parked`, not gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_event_survives_a_promotion_before_the_standby_had_its_row() -> Result<()> {
    let (_schemas, validation) = amounts_must_be_positive()?;
    let mut w = fed_through_a_proxy("sbpfo", &validation).await?;
    let multi = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres password={PG_PASSWORD} dbname={} \
         target_session_attrs=read-write",
        w.env.pg.port, w.standby.port, w.env.db
    );
    let text = std::fs::read_to_string(&w.config)?.replace(&w.env.pg.dsn(&w.env.db), &multi);
    std::fs::write(&w.config, text)?;
    let mut relay = w.relay_delivering(5).await?;
    relay.sigterm()?;
    let mut c = w.env.sql().await?;
    let (poison, before) = poison_replayed(&w, &mut c).await?;
    // From now on the standby receives nothing of the primary's WAL.
    let feed = w.feed.as_ref().context("no feed")?;
    feed.set_mode(Mode::Down);
    let mut relay = RelayProcess::spawn(&w.config, w.log.clone())?;
    let id = poison.event_id.to_string();
    eventually(Duration::from_secs(30), || async {
        parked(&w.env.sql().await?, &id).await
    })
    .await
    .with_context(|| read_log(&w.log))?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let confirmed = w.standby_confirmed().await?;
    w.env.pg.stop_immediate()?;
    w.standby.promote().await?;
    eventually(Duration::from_secs(60), || async {
        parked(&w.standby_sql().await?, &id).await
    })
    .await
    .with_context(|| {
        format!(
            "the event is neither on the topic nor parked on the promoted server (the slot \
             was confirmed at {confirmed:X}, the event before {before:X}): {}",
            read_log(&w.log)
        )
    })?;
    ensure!(
        confirmed <= before,
        "the standby's slot confirmed {confirmed:X}, past the parked event ({before:X}), \
         before the standby had its parked row: {}",
        read_log(&w.log)
    );
    relay.sigkill();
    Ok(())
}
