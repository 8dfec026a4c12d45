//! outboxd: the transactional outbox relay. Committed outbox rows are read from the WAL through
//! a logical replication slot (pgoutput) and produced to Kafka keyed by `aggregate_id`; the slot's
//! confirmed LSN advances only after the broker acknowledged everything before it, so a crash
//! replays identical `event_id`s and never loses one.
//!
//! # Layout
//! - [`config`]: TOML + `OUTBOXD_*` env configuration, validated up front.
//! - [`source`]: SQL preflight checks, slot handling, and the replication stream.
//! - [`slot_state`]: the durable memory of the stream (`outboxd_slot_state`);
//!   [`slot_guard`]: slot-loss detection at session start; [`recovery`]: republishing a lost
//!   slot's gap from the outbox table.
//! - [`tls`]: TLS to Postgres (`sslmode` …) for the SQL connection and the stream alike.
//! - [`pgoutput`]: our decoder for the Relation/Insert messages of the stream.
//! - [`router`]: outbox row → Kafka record (topic template, key, value, headers, timestamp).
//! - [`producer`]: librdkafka (idempotent, `acks=all`); delivery reports become [`producer::Ack`]s.
//! - [`ack`]: the tracker turning out-of-order acks into the one LSN safe to confirm.
//! - [`policy`], [`validate`], [`parking`]: poison events — classification, per-type policy,
//!   JSON Schema checks, the durable `outbox_parked` table and the in-order release after repair.
//! - [`stages`]: what each stage does with one replication event; [`pipeline`]: one session.
//! - [`parked_cmd`]: `outboxd parked list|show|retry|discard`.
//! - [`fail`]: crash hooks for the crash-window tests (feature `failpoints`).
//! - [`admin`]: `outboxd init` and `outboxd check`; [`status`]: `outboxd status`;
//!   [`alerts`]: `outboxd alerts` (Prometheus rules from per-event-type delay budgets).
//! - [`obs`], [`session_obs`], [`obs_errors`]: metric names, `/metrics` `/healthz` `/readyz`,
//!   heartbeats, slot health and the status row.
//! - [`cli`]: the command line.
//! - [`run`]: the supervisor: sessions restart after transient errors, stop on definite ones.

pub mod ack;
pub mod admin;
pub mod alerts;
pub mod cli;
pub mod config;
pub mod error;
pub mod fail;
pub mod kafka_hint;
pub mod obs;
pub mod obs_errors;
pub mod parked_cmd;
pub mod parking;
pub mod pgoutput;
pub mod pipeline;
pub mod policy;
pub mod producer;
pub mod recover_cmd;
pub mod recovery;
pub mod router;
pub mod secrets;
pub mod session_obs;
pub mod slot_guard;
pub mod slot_state;
pub mod source;
pub mod stages;
pub mod status;
pub mod tls;
pub mod validate;

pub use config::Config;
pub use error::RelayError;

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Runs the relay until `shutdown` turns true (Ok) or a definite error occurs (Err).
///
/// Transient errors — Postgres or broker unreachable, the slot held by another instance — end
/// the session; a new one starts from the slot's confirmed LSN after a bounded, jittered
/// exponential backoff. Tests run the whole service through this entry point.
pub async fn run(cfg: Config, mut shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
    let max = Duration::from_millis(cfg.relay.max_backoff_ms);
    let mut backoff = Duration::from_millis(100).min(max);
    let mut attempt: u64 = 0;
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        let started = Instant::now();
        let err = match pipeline::run_session(&cfg, &mut shutdown).await {
            Ok(pipeline::SessionEnd::Shutdown) => return Ok(()),
            Err(e) if e.is_transient() => e,
            Err(e) => return Err(e),
        };
        obs_errors::restart(err.class());
        metrics::gauge!(obs::ROLE_ACTIVE).set(0.0);
        let health = obs::health();
        health
            .standby
            .store(matches!(err, RelayError::SlotBusy { .. }), Relaxed);
        health.streaming.store(false, Relaxed);
        if started.elapsed() > HEALTHY_SESSION {
            backoff = Duration::from_millis(100).min(max);
            attempt = 0;
        }
        attempt += 1;
        let wait = match &err {
            // A standby polls at a steady pace so it can take over quickly.
            RelayError::SlotBusy { .. } => Duration::from_millis(cfg.relay.standby_poll_ms),
            RelayError::Halted { .. } => max,
            _ => jitter(backoff),
        };
        match &err {
            RelayError::SlotBusy { .. } => {
                tracing::info!(role = "standby", error = %err, retry_in_ms = wait.as_millis() as u64, "slot busy")
            }
            RelayError::Halted { .. } => {
                health.halted.store(true, Relaxed);
                metrics::gauge!(obs::HALTED).set(1.0);
                tracing::error!(error = %err, retry_in_ms = wait.as_millis() as u64, "HALTED")
            }
            _ => tracing::warn!(
                error = %cfg.redactor.scrub(&err.to_string()),
                class = err.class(),
                attempt,
                retry_in_ms = wait.as_millis() as u64,
                "session failed; restarting from the slot's confirmed LSN"
            ),
        }
        metrics::gauge!(obs::RETRY_BACKOFF).set(wait.as_secs_f64());
        if !matches!(err, RelayError::SlotBusy { .. }) {
            status::record_failure(&cfg, &err, attempt, wait).await;
        }
        backoff = (backoff * 2).min(max);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => return Ok(()),
        }
    }
}

/// A session that ran this long counts as healthy: the next failure starts a new streak
/// (attempt 1, shortest backoff) instead of continuing the old one.
pub(crate) const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// 50–100 % of `d`, so restarting instances do not retry in lockstep.
fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    d.mul_f64(0.5 + f64::from(nanos % 1000) / 2000.0)
}
