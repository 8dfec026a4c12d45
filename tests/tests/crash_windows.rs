//! R30, issue 4: crash the relay at each window of its pipeline, start a successor, and check
//! what an inbox-library consumer (its own database, its own business table) ends up with.
//!
//! Windows (failpoints in the real binary; the process aborts on the spot, like SIGKILL):
//! 1. `decoded`   — a row decoded, before it is handed to the producer;
//! 2. `produced`  — enqueued in librdkafka, before the broker's acknowledgement;
//! 3. `acked`     — acknowledged by the broker, before the LSN is handed to the replication client;
//! 4. `confirmed` — right after a status update that advanced the confirmed LSN reached Postgres.
//!
//! Each test: a writer commits random transactions (15 % rolled back) the whole time; a relay
//! process starts with a failpoint set to fire mid-stream and dies there; right then, before a
//! successor exists, the slot's confirmed LSN is checked against what the broker holds (every
//! transaction surely at or before it must be on the topic); a successor process streams the rest
//! and is stopped gracefully. Then:
//! - every committed event is on the topic, no rolled-back one is;
//! - every copy of an event is byte-identical (key, payload, headers incl. `event_id` and
//!   `aggregate_version`, timestamp) and first occurrences are in per-aggregate version order;
//! - the consumer's business table holds each committed event's effect exactly once (balances,
//!   versions and counts match; the table itself has no unique key, only the inbox dedupes), and
//!   the inbox reported exactly as many duplicates as the topic holds.
//!
//! The successor resumes at the slot's confirmed LSN or, when further, at the acknowledged
//! position the relay recorded in `outboxd_slot_state` (written between status updates); both
//! are checked against the broker.
//!
//! Window 3 must produce duplicates (the acknowledged transaction was never confirmed); the test
//! asserts that too, so a failpoint that fires in the wrong place cannot pass unnoticed.

use outboxd_tests::reliability::*;
use outboxd_tests::*;
use std::time::{Duration, Instant};

const TOPIC: &str = "outbox.event.acct";

async fn crash_window(
    name: &str,
    failpoint: &str,
    at: u32,
    must_redeliver: bool,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let env = Env::start(&format!("cw_{name}")).await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let reader = InboxReader::start(&env.bootstrap(), TOPIC, &inbox_dsn);
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    // A small backlog, then the crash lands while the relay streams live traffic.
    writer.wait_committed(40, Duration::from_secs(60)).await?;

    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let fp = format!("{failpoint}@{at}");
    // Window 3 must leave acknowledged but unconfirmed events behind. The `acked` failpoint also
    // counts advances of the confirmable LSN that no ack caused (keepalives, heartbeats with
    // nothing in flight), so a crash there may leave nothing to redeliver: crash again (each
    // successor with the same failpoint) until one demonstrably did, at most 6 times.
    let attempts = if must_redeliver { 6 } else { 1 };
    let mut confirmed = 0;
    let mut recorded = 0;
    let mut redeliverable = 0;
    for attempt in 1..=attempts {
        let mut relay =
            RelayProcess::spawn_with_env(&config, log.clone(), &[("OUTBOXD_FAILPOINTS", &fp)])?;
        let status = wait_exit(&mut relay, Duration::from_secs(120)).await?;
        let text = read_log(&log);
        assert_eq!(
            exit_signal(&status),
            Some(libc::SIGABRT),
            "the relay must die by abort at {fp}, got {status}; log:\n{text}"
        );
        assert_eq!(
            text.matches(&format!("failpoint {fp}: aborting")).count(),
            attempt,
            "log:\n{text}"
        );

        // The world between the crash and the successor: no relay runs.
        confirmed = env.confirmed_lsn().await?;
        let before = writer.snapshot();
        let (covered, delivered) =
            check_slot_against_broker(&env.bootstrap(), TOPIC, &before, confirmed)?;
        // The acknowledged position in outboxd_slot_state may be ahead of the slot (written
        // between status updates): it must never claim what the broker lacks either.
        recorded = env.recorded_acked_lsn().await?;
        if recorded > confirmed {
            check_slot_against_broker(&env.bootstrap(), TOPIC, &before, recorded)?;
        }
        assert!(
            covered > 0,
            "the crash must land mid-stream, after the slot had moved (confirmed {confirmed:X}); log:\n{}",
            read_log(&log)
        );
        redeliverable = delivered_beyond_slot(&before, confirmed, &delivered);
        eprintln!(
            "{fp} (crash {attempt}): after {:?}; {} events committed, {} on the broker, slot covers {covered} transactions, {redeliverable} delivered transactions beyond it",
            t0.elapsed(),
            before.committed.len(),
            delivered.len()
        );
        if redeliverable > 0 {
            break;
        }
    }
    if must_redeliver {
        assert!(
            redeliverable > 0,
            "{fp}: {attempts} crashes and none left an acknowledged but unconfirmed transaction"
        );
    }

    let mut successor = RelayProcess::spawn(&config, log.clone())?;
    // Keep writing under the successor for a while.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let wlog = writer.stop().await?;
    eventually(Duration::from_secs(90), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await?;
    let st = successor.sigterm()?;
    assert!(st.success(), "successor exit status {st}");
    let text = read_log(&log);
    let at = confirmed.max(recorded);
    let resume = format!("resume_lsn={:X}/{:X}", at >> 32, at & 0xffff_ffff);
    assert!(
        text.contains(&resume),
        "the successor must resume from the slot's confirmed LSN or the further acknowledged \
         position recorded in outboxd_slot_state ({resume}); log:\n{text}"
    );

    let (stats, report) = drain_and_verify(reader, &wlog, "acct", &inbox_dsn).await?;
    assert_eq!(stats.records as usize, report.records, "{stats:?}");
    assert_eq!(
        stats.duplicates as usize, report.duplicates,
        "every redelivered copy must be recognised by the inbox: {stats:?}"
    );
    assert_eq!(
        (stats.held, stats.stale),
        (0, 0),
        "in-order delivery: nothing held or stale"
    );
    if must_redeliver {
        assert!(
            report.duplicates >= redeliverable,
            "{fp}: each acknowledged but unconfirmed transaction must be delivered again"
        );
    }
    eprintln!(
        "{fp}: {} committed ({} rolled back), {} records, {} duplicates (max {} copies), {} transactions; {:?}",
        wlog.committed.len(),
        wlog.rolled_back.len(),
        report.records,
        report.duplicates,
        report.max_copies,
        wlog.txs.len(),
        t0.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_decode_before_produce() -> anyhow::Result<()> {
    crash_window("decoded", "decoded", 300, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_produce_before_broker_ack() -> anyhow::Result<()> {
    crash_window("produced", "produced", 300, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_broker_ack_before_confirm() -> anyhow::Result<()> {
    crash_window("acked", "acked", 150, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_right_after_confirm() -> anyhow::Result<()> {
    crash_window("confirmed", "confirmed", 10, false).await
}
