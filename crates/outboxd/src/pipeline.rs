//! One replication session: source → decoder → router → producer → ack tracker → confirmer.
//!
//! The stages ([`crate::stages`]) run in one task, in stream order, so per-aggregate order on the
//! topic equals commit order (one producer, idempotent, keyed by `aggregate_id`). Only
//! acknowledgements flow back, from librdkafka's delivery thread over a channel, and the only
//! thing the session ever tells Postgres is "acknowledged up to commit LSN X".

use crate::config::Config;
use crate::error::RelayError;
use crate::fail;
use crate::producer::Producer;
use crate::source::{self, fmt_lsn, sql_bounded};
use crate::stages::Stages;
use pgwire_replication::Lsn;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How a session ended without error.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// Shutdown was requested; in-flight events were drained and the last LSN confirmed.
    Shutdown,
}

/// Runs one session until shutdown (Ok) or an error (transient or definite).
pub async fn run_session(
    cfg: &Config,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<SessionEnd, RelayError> {
    let sql = source::sql_connect(cfg).await?;
    let (slot, sender_timeout) = source::preflight(cfg, &sql, cfg.source.create_slot).await?;
    if let Some(pid) = slot.active_pid {
        return Err(RelayError::SlotBusy {
            slot: cfg.source.slot.clone(),
            pid: pid.to_string(),
        });
    }
    let mut status_interval = Duration::from_millis(cfg.source.status_interval_ms);
    if !sender_timeout.is_zero() {
        status_interval = status_interval.min(sender_timeout / 2);
    }
    let mut st = sql_bounded(Stages::new(cfg, sql, slot.confirmed_flush)).await?;
    let (producer, mut acks) = Producer::new(cfg)?;
    let mut repl = source::start_stream(cfg, slot.confirmed_flush, status_interval).await?;
    tracing::info!(
        slot = %cfg.source.slot,
        publication = %cfg.source.publication,
        resume_lsn = %fmt_lsn(slot.confirmed_flush),
        role = "active",
        "streaming"
    );
    metrics::gauge!(crate::obs::ROLE_ACTIVE).set(1.0);
    metrics::gauge!(crate::obs::RETRY_BACKOFF).set(0.0);
    let health = crate::obs::health();
    health.standby.store(false, Relaxed);
    health.streaming.store(true, Relaxed);
    health.broker_ok.store(true, Relaxed);
    let mut reported = slot.confirmed_flush;
    let max_events = cfg.relay.max_in_flight_events;
    let max_bytes = cfg.relay.max_in_flight_bytes;
    let repair_every = Duration::from_millis(cfg.relay.repair_interval_ms);
    let mut next_repair = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    let result: Result<(), RelayError> = async {
        // Backpressure with hysteresis: once the in-flight window is full, reading resumes only
        // when it has drained to half. Resuming at the first free slot would wake the task for
        // every single ack and read one event at a time (measured: twice the CPU per event).
        let mut paused = false;
        loop {
            let (n, bytes) = (st.tracker.in_flight(), st.in_flight_bytes);
            if n >= max_events || bytes >= max_bytes {
                paused = true;
            } else if paused && n <= max_events / 2 && bytes <= max_bytes / 2 {
                paused = false;
            }
            let room = !paused;
            tokio::select! {
                biased;
                _ = shutdown.changed() => return Ok(()),
                Some(ack) = acks.recv() => st.on_ack(ack, &producer).await?,
                ev = repl.recv(), if room => match ev? {
                    Some(ev) => st.on_event(ev, &producer).await?,
                    None => return Err(RelayError::Replication("stream ended".into())),
                },
                _ = tick.tick() => {
                    sql_bounded(st.obs_tick(room)).await?;
                    if Instant::now() >= next_repair {
                        next_repair = Instant::now() + repair_every;
                        sql_bounded(st.repair_tick(&producer)).await?;
                    }
                }
            }
            // Drain whatever acks are already waiting before the next event.
            while let Ok(ack) = acks.try_recv() {
                st.on_ack(ack, &producer).await?;
            }
            let c = st.tracker.confirmed();
            if c > reported {
                if std::mem::take(&mut st.advanced_by_ack) {
                    fail::hit("acked");
                }
                repl.update_applied_lsn(Lsn(c));
                reported = c;
                if health.halted.swap(false, Relaxed) {
                    metrics::gauge!(crate::obs::HALTED).set(0.0);
                }
            }
        }
    }
    .await;

    // Whatever ended the session, confirm exactly what the broker acknowledged.
    let deadline = Instant::now() + cfg.shutdown_timeout();
    if result.is_ok() {
        // Graceful: stop reading, let in-flight events land.
        'drain: while st.tracker.in_flight() > 0 && Instant::now() < deadline {
            producer.flush(Duration::from_millis(100));
            while let Ok(ack) = acks.try_recv() {
                if st.on_ack(ack, &producer).await.is_err() {
                    break 'drain;
                }
            }
        }
    }
    let c = st.tracker.confirmed();
    if c > reported {
        repl.update_applied_lsn(Lsn(c));
    }
    if c > slot.confirmed_flush {
        // stop() sends no final status: wait until the server has taken our position.
        let wait_until = Instant::now() + status_interval * 2 + Duration::from_secs(1);
        while Instant::now() < wait_until {
            // Bounded: the session may be ending because this very connection went silent.
            let poll = tokio::time::timeout(
                Duration::from_secs(1),
                source::confirmed_flush(cfg, &st.sql),
            );
            match poll.await {
                Ok(Ok(s)) if s >= c => break,
                Ok(Ok(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                Ok(Err(_)) | Err(_) => break,
            }
        }
    }
    repl.stop();
    drop(repl);
    health.streaming.store(false, Relaxed);
    tracing::info!(
        confirmed_lsn = %fmt_lsn(c),
        in_flight = st.tracker.in_flight(),
        ignored_changes = st.ignored,
        "session ended"
    );
    result.map(|()| SessionEnd::Shutdown)
}
