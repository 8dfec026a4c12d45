//! The supervisor: runs one replication session after another. Transient errors end a session
//! and a new one starts from the slot's confirmed LSN after a bounded, jittered exponential
//! backoff; definite errors stop the relay; a standby polls at a steady pace. One session's loop is
//! [`session`]: it sits above the relay's stages and the slot's recovery, which it drives.

pub(crate) mod joining;
pub(crate) mod session;

use crate::config::Config;
use crate::error::{RelayError, Retry};
use crate::obs;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Runs the relay until `shutdown` turns true (Ok) or a definite error occurs (Err).
///
/// Transient errors — Postgres or broker unreachable, the slot held by another instance — end
/// the session; a new one starts from the slot's confirmed LSN after a bounded, jittered
/// exponential backoff. Tests run the whole service through this entry point.
pub async fn run(cfg: Config, shutdown: watch::Receiver<bool>) -> Result<(), RelayError> {
    run_observed(cfg, shutdown, Arc::new(obs::Observed::default())).await
}

/// [`run`], reporting into `observed` (which the HTTP listener serves).
pub async fn run_observed(
    cfg: Config,
    mut shutdown: watch::Receiver<bool>,
    observed: Arc<obs::Observed>,
) -> Result<(), RelayError> {
    let max = Duration::from_millis(cfg.relay.max_backoff_ms);
    let mut backoff = Duration::from_millis(100).min(max);
    let mut attempt: u64 = 0;
    // A standby's view of the holder, kept across polls (two looks before it fences).
    let mut fence = crate::slot::fence::Fence::new(&cfg);
    // `cleanup.every`: beside the sessions, ended with them (aborted on drop).
    let _cleanup = crate::cleanup::spawn(&cfg, shutdown.clone()).map(AbortOnDrop);
    let mut shadow: Option<(crate::relay::tap::Tap, AbortOnDrop)> = None;
    observed.status.configure(&cfg);
    loop {
        if *shutdown.borrow() {
            return Ok(());
        }
        let started = Instant::now();
        // Shadow mode's comparator lives across sessions (its pending events too); started
        // like a session, so a broker away at start-up is retried, not fatal.
        if cfg.shadow.enabled && shadow.is_none() {
            match crate::shadow::start(&cfg, shutdown.clone(), observed.clone()).await {
                Ok(s) => shadow = s.map(|(tap, task)| (tap, AbortOnDrop(task))),
                Err(e) => {
                    if e.policy().retry == Retry::Stop {
                        return Err(e);
                    }
                    tracing::warn!(error = %cfg.redactor.scrub(&e.to_string()), "shadow comparator not started; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(jitter(backoff)) => {}
                        _ = shutdown.changed() => {}
                    }
                    backoff = (backoff * 2).min(max);
                    continue;
                }
            }
        }
        let tap = shadow.as_ref().map(|(t, _)| t);
        let err = match session::run_session(&cfg, &mut shutdown, &observed, tap).await {
            Ok(session::SessionEnd::Shutdown) => return Ok(()),
            Err(e) => e,
        };
        let policy = err.policy();
        session_ended(&observed, &cfg, &policy);
        if policy.retry == Retry::Stop {
            return Err(err);
        }
        if policy.retry != Retry::StandBy {
            fence.reset();
        }
        observed.errors.restart(policy.class);
        if policy.retry != Retry::StandBy {
            let message = cfg.redactor.scrub(&err.to_string());
            observed.status.error(policy.class, &message, policy.fix);
        }
        metrics::gauge!(obs::ROLE_ACTIVE).set(0.0);
        let health = &observed.health;
        health
            .standby
            .store(policy.retry == Retry::StandBy, Relaxed);
        health.streaming.store(false, Relaxed);
        if started.elapsed() > obs::watch::HEALTHY_SESSION {
            backoff = Duration::from_millis(100).min(max);
            attempt = 0;
        }
        attempt += 1;
        let wait = match policy.retry {
            // A standby polls at a steady pace so it can take over quickly.
            // Sooner when the holder went silent: a second look, or the slot right after a fence.
            Retry::StandBy => {
                // The status page names the holder: its instance once the fence looked at its
                // beats, until then its walsender.
                let walsender = match &err {
                    RelayError::SlotBusy { pid, .. } => Some(format!("walsender PID {pid}")),
                    _ => None,
                };
                observed.status.holder(fence.holder().or(walsender.clone()));
                let wait = fence.standby_wait(&cfg).await;
                observed.status.holder(fence.holder().or(walsender));
                wait
            }
            Retry::Halt => max,
            Retry::Backoff | Retry::Stop => jitter(backoff),
        };
        match policy.retry {
            Retry::StandBy => {
                tracing::info!(role = "standby", error = %err, retry_in_ms = wait.as_millis() as u64, "slot busy")
            }
            Retry::Halt => {
                health.halted.store(true, Relaxed);
                metrics::gauge!(obs::HALTED).set(1.0);
                tracing::error!(error = %err, fix = policy.fix, retry_in_ms = wait.as_millis() as u64, "HALTED")
            }
            Retry::Backoff | Retry::Stop => tracing::warn!(
                error = %cfg.redactor.scrub(&err.to_string()),
                class = policy.class,
                fix = policy.fix,
                attempt,
                retry_in_ms = wait.as_millis() as u64,
                "session failed; restarting from the slot's confirmed LSN"
            ),
        }
        metrics::gauge!(obs::RETRY_BACKOFF).set(wait.as_secs_f64());
        if policy.retry != Retry::StandBy {
            // Best effort, bounded: silently nothing when the source itself is unreachable.
            let failure = obs::status_row::Failure {
                slot: &cfg.source.slot,
                class: policy.class,
                message: &cfg.redactor.scrub(&err.to_string()),
                attempt,
                retry_in: wait,
                halted: policy.retry == Retry::Halt,
            };
            let record = async {
                let sql = crate::relay::source::sql_connect(&cfg).await?;
                obs::status_row::record_failure(&sql, &failure).await
            };
            let _ = tokio::time::timeout(Duration::from_secs(3), record).await;
        }
        backoff = (backoff * 2).min(max);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => return Ok(()),
        }
    }
}

/// 50–100 % of `d`, so restarting instances do not retry in lockstep.
fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    d.mul_f64(0.5 + f64::from(nanos % 1000) / 2000.0)
}

/// Aborts a background task when the supervisor returns, however it returns.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The `outboxd session ended` span of a session that ended with an error: its class, whether
/// the relay retries, stands by or halts, and the fix (fixed strings: never the error's text).
fn session_ended(observed: &obs::Observed, cfg: &Config, policy: &crate::error::Policy) {
    // A standby polling for the slot is the relay working as designed: no span per poll.
    let Some(t) = observed
        .started_traces()
        .filter(|_| policy.retry != Retry::StandBy)
    else {
        return;
    };
    let mut op = obs::telemetry::ops::Op::start(
        Some(&t),
        "outboxd session ended",
        vec![
            opentelemetry::KeyValue::new("outboxd.slot", cfg.source.slot.clone()),
            opentelemetry::KeyValue::new(
                "outboxd.retry",
                format!("{:?}", policy.retry).to_ascii_lowercase(),
            ),
        ],
    );
    op.set("outboxd.fix", policy.fix);
    op.fail(
        policy.class,
        "the session ended with an error; see error.type and outboxd.fix",
    );
}
