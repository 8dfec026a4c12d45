//! Fencing a silent slot holder (docs/reliability.md, "Fencing").
//!
//! Postgres notices a frozen or partitioned replication client only through
//! `wal_sender_timeout` (60 s by default); until then the slot stays "active for PID n" and no
//! standby can take it. So the holder proves it is alive and a standby acts on its silence:
//! - [`Holder`] (the active session): a task beats every second into `outboxd_status`
//!   ([`status_row::beat`]), only while its own walsender still holds the slot. A frozen
//!   process beats nothing. It also tells the session when the slot was taken from it, and
//!   after any pause of the session loop checks that the slot is still its own before the
//!   session produces or writes anything more.
//! - [`Fence`] (a standby, between polls): when the beat of the walsender holding the slot is
//!   older than `relay.takeover_after_ms` on the server's clock, on two consecutive looks, and
//!   the slot's confirmed position did not move in between, it terminates that walsender
//!   (`pg_terminate_backend`, checks and kill in one statement) and takes the slot at once.
//!
//! Safety does not rest on the timing: Postgres lets one walsender hold the slot, and only the
//! holder's confirms move it. A fenced instance that thaws finds its stream gone, cannot
//! confirm, cannot beat, and cannot write the state row (its writes name its walsender). It can
//! still send what librdkafka had queued when it froze: librdkafka's threads resume before any
//! check here runs, so those older records may land after the new holder's. Only the broker can
//! refuse them: `relay.broker_fencing` ([`crate::relay::kafka::txn`]).

use crate::config::Config;
use crate::error::RelayError;
use crate::obs::{self, status_row};
use crate::relay::slot_host::SlotHost;
use crate::relay::source::{self, sql_bounded};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_postgres::Client;

/// How often the holder beats.
pub const BEAT_EVERY: Duration = Duration::from_secs(1);
/// A session loop that did not turn for this long may have been frozen: it checks that the slot
/// is still its own before acting (the loop turns at least every 250 ms).
const GAP: Duration = Duration::from_secs(1);
/// The second look at a stale holder comes this soon (not a whole standby poll later).
const RECHECK: Duration = Duration::from_millis(500);
/// Bound on the fence's and the beat's statements and connects.
const SQL_BOUND: Duration = Duration::from_secs(2);

/// The active session's side. Dropping it stops the beats.
pub struct Holder {
    slot: String,
    walsender: i32,
    last_turn: Instant,
    lost: watch::Receiver<bool>,
    beats: tokio::task::JoinHandle<()>,
}

impl Holder {
    /// Right after the stream started: the walsender now holding the slot is ours. Starts the
    /// beats (their own connection, so a busy session loop does not silence them).
    pub async fn start(cfg: &Config, sql: &Client) -> Result<Self, RelayError> {
        let slot = cfg.source.slot.clone();
        let pid = sql_bounded(async {
            let st = source::slot_state(cfg, sql).await?;
            Ok(st.and_then(|s| s.active_pid))
        })
        .await?;
        let Some(walsender) = pid else {
            return Err(RelayError::Replication(format!(
                "replication slot {slot:?} is not active right after the stream started"
            )));
        };
        let (tx, lost) = watch::channel(false);
        let beats = tokio::spawn(beat_loop(cfg.clone(), walsender, tx));
        Ok(Self {
            slot,
            walsender,
            last_turn: Instant::now(),
            lost,
            beats,
        })
    }

    /// This session's walsender PID: its state-row writes name it.
    pub fn walsender(&self) -> i32 {
        self.walsender
    }

    /// Resolves when a beat found the slot held by another walsender.
    pub async fn lost(&mut self) -> RelayError {
        if self.lost.wait_for(|l| *l).await.is_err() {
            // The beat task ended without a verdict: no news, never resolve.
            std::future::pending::<()>().await;
        }
        self.fenced(0)
    }

    /// The session loop turned: it was not frozen.
    pub fn turned(&mut self) {
        self.last_turn = Instant::now();
    }

    /// Before acting on an event or a tick: if the loop stood still (the process was stopped,
    /// or something blocked it) long enough for a standby to fence it, check that the slot is
    /// still ours. Events buffered before a freeze must not be produced by a fenced instance.
    pub async fn check_after_gap(&mut self, cfg: &Config, sql: &Client) -> Result<(), RelayError> {
        let now = Instant::now();
        let gap = now.saturating_duration_since(self.last_turn);
        self.last_turn = now;
        if gap < GAP {
            return Ok(());
        }
        let pid = sql_bounded(async {
            let st = source::slot_state(cfg, sql).await?;
            Ok(st.and_then(|s| s.active_pid))
        })
        .await?;
        if pid == Some(self.walsender) {
            return Ok(());
        }
        Err(self.fenced(gap.as_millis() as u64))
    }

    fn fenced(&self, silent_ms: u64) -> RelayError {
        RelayError::Fenced {
            slot: self.slot.clone(),
            walsender: self.walsender,
            silent_ms,
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.beats.abort();
    }
}

/// Beats every second until the slot is no longer held by `walsender` (then says so) or the
/// session drops the task. Failures only cost beats: a standby fences a silent holder only if
/// its slot position stands still too.
async fn beat_loop(cfg: Config, walsender: i32, lost: watch::Sender<bool>) {
    let instance = status_row::instance();
    let since = chrono::Utc::now();
    let mut sql: Option<(Client, SlotHost)> = None;
    let mut tick = tokio::time::interval(BEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        if sql.as_ref().is_none_or(|(c, _)| c.is_closed()) {
            sql = tokio::time::timeout(SQL_BOUND, connect(&cfg))
                .await
                .ok()
                .and_then(Result::ok);
        }
        let Some((c, host)) = &sql else { continue };
        let beat = status_row::beat(c, host, &cfg.source.slot, &instance, walsender, since);
        match tokio::time::timeout(SQL_BOUND, beat).await {
            Ok(Ok(true)) => failing = false,
            Ok(Ok(false)) => {
                let _ = lost.send(true);
                return;
            }
            Ok(Err(e)) => {
                if !failing {
                    tracing::warn!(error = %cfg.redactor.scrub(&e.to_string()), "liveness beat failed: standbys may fence this instance if its slot position stands still too");
                }
                failing = true;
                sql = None;
            }
            Err(_) => sql = None,
        }
    }
}

/// A stale holder seen once: fenced only if the next look finds the same.
#[derive(Debug, Clone, PartialEq)]
struct Suspect {
    pid: i32,
    confirmed: String,
    at: Instant,
}

/// What one look at the holder concluded.
#[derive(Debug, PartialEq)]
enum Look {
    /// The slot is free: try to take it now.
    Free,
    /// The holder beats (or does not beat at all, e.g. still starting or recovering, an older
    /// outboxd, another client): leave it to `wal_sender_timeout`.
    Leave,
    /// Stale for the first time (or its position moved): look again soon.
    Suspect(Suspect),
    /// Stale twice, position unmoved: fence.
    Fence { pid: i32, silent_s: f64 },
}

/// Pure, so every rule is a unit test.
fn look(l: &status_row::Liveness, prev: Option<&Suspect>, after: Duration, now: Instant) -> Look {
    let Some(pid) = l.active_pid else {
        return Look::Free;
    };
    let (Some(silent_s), Some(confirmed)) = (l.silent_s, l.confirmed.as_ref()) else {
        return Look::Leave;
    };
    if l.beat_pid != Some(pid) || silent_s <= after.as_secs_f64() {
        return Look::Leave;
    }
    // A second look confirms only within a few polls of the first, at the same position.
    let confirms = prev.is_some_and(|p| {
        p.pid == pid
            && &p.confirmed == confirmed
            && now.duration_since(p.at) >= RECHECK / 2
            && now.duration_since(p.at) <= after * 2 + RECHECK
    });
    if confirms {
        return Look::Fence { pid, silent_s };
    }
    let keep = prev.filter(|p| {
        p.pid == pid && &p.confirmed == confirmed && now.duration_since(p.at) < RECHECK / 2
    });
    Look::Suspect(keep.cloned().unwrap_or(Suspect {
        pid,
        confirmed: confirmed.clone(),
        at: now,
    }))
}

/// The standby's side, kept by the supervisor across polls.
pub struct Fence {
    after: Duration,
    poll: Duration,
    sql: Option<(Client, SlotHost)>,
    suspect: Option<Suspect>,
    /// The holder's instance as its last beat names it (for the status page).
    holder: Option<String>,
}

impl Fence {
    pub fn new(cfg: &Config) -> Self {
        Self {
            after: Duration::from_millis(cfg.relay.takeover_after_ms),
            poll: Duration::from_millis(cfg.relay.standby_poll_ms),
            sql: None,
            suspect: None,
            holder: None,
        }
    }

    /// The instance holding the slot, as its beats name it (`None`: not looked at yet).
    pub fn holder(&self) -> Option<String> {
        self.holder.clone()
    }

    /// The session found the slot busy: look at the holder, fence it if it went silent, and
    /// say how long to wait before the next attempt to take the slot.
    pub async fn standby_wait(&mut self, cfg: &Config) -> Duration {
        if self.after.is_zero() {
            return self.poll;
        }
        match self.step(cfg).await {
            Ok(Some(wait)) => wait,
            Ok(None) => self.poll,
            Err(e) => {
                tracing::debug!(error = %cfg.redactor.scrub(&e.to_string()), "cannot look at the slot holder");
                self.sql = None;
                self.suspect = None;
                self.poll
            }
        }
    }

    /// Not standing by any more (active, or failing otherwise): forget what was seen.
    pub fn reset(&mut self) {
        self.suspect = None;
        self.sql = None;
    }

    async fn step(&mut self, cfg: &Config) -> Result<Option<Duration>, RelayError> {
        if self.sql.as_ref().is_none_or(|(c, _)| c.is_closed()) {
            let connect = tokio::time::timeout(SQL_BOUND, connect(cfg));
            self.sql = Some(connect.await.map_err(|_| {
                RelayError::Postgres("connect for the liveness check timed out".into())
            })??);
        }
        let (sql, host) = self.sql.as_ref().expect("connected above");
        let slot = &cfg.source.slot;
        let Some(l) = bounded(status_row::liveness(sql, host, slot)).await? else {
            return Ok(None);
        };
        self.holder = l.instance.clone();
        match look(&l, self.suspect.as_ref(), self.after, Instant::now()) {
            Look::Free => {
                self.suspect = None;
                Ok(Some(Duration::ZERO))
            }
            Look::Leave => {
                self.suspect = None;
                Ok(None)
            }
            Look::Suspect(s) => {
                self.suspect = Some(s);
                Ok(Some(self.poll.min(RECHECK)))
            }
            Look::Fence { pid, silent_s } => {
                let confirmed = self.suspect.take().map(|s| s.confirmed).unwrap_or_default();
                let kill = status_row::terminate_silent_holder(
                    sql,
                    host,
                    slot,
                    pid,
                    self.after.as_secs_f64(),
                    &confirmed,
                );
                if !bounded(kill).await? {
                    return Ok(Some(Duration::ZERO));
                }
                metrics::counter!(obs::FENCINGS).increment(1);
                tracing::warn!(
                    slot = %slot,
                    fenced_instance = l.instance.as_deref().unwrap_or("?"),
                    fenced_walsender = pid,
                    silent_s = format!("{silent_s:.1}"),
                    confirmed_lsn = %confirmed,
                    "FENCED: the slot holder was silent longer than relay.takeover_after_ms; terminated its walsender to take the slot over"
                );
                // Until the walsender has exited the slot still names it: wait, bounded.
                let deadline = Instant::now() + SQL_BOUND;
                while Instant::now() < deadline {
                    let st = bounded(status_row::liveness(sql, host, slot)).await?;
                    if st.and_then(|s| s.active_pid) != Some(pid) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(Some(Duration::ZERO))
            }
        }
    }
}

/// The primary and the slot's server (`source.replication_dsn`, else the primary itself).
async fn connect(cfg: &Config) -> Result<(Client, SlotHost), RelayError> {
    Ok((
        source::sql_connect(cfg).await?,
        SlotHost::connect(cfg).await?,
    ))
}

async fn bounded<T>(
    work: impl std::future::Future<Output = Result<T, RelayError>>,
) -> Result<T, RelayError> {
    tokio::time::timeout(SQL_BOUND, work)
        .await
        .unwrap_or_else(|_| Err(RelayError::Postgres("liveness check timed out".into())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use status_row::Liveness;

    const AFTER: Duration = Duration::from_secs(3);

    fn holder(active: Option<i32>, beat: Option<i32>, silent: f64, lsn: &str) -> Liveness {
        Liveness {
            active_pid: active,
            confirmed: Some(lsn.into()),
            beat_pid: beat,
            silent_s: Some(silent),
            instance: Some("h:1".into()),
        }
    }

    #[test]
    fn a_fresh_or_unknown_holder_is_left_alone() {
        let now = Instant::now();
        assert_eq!(
            look(&holder(Some(7), Some(7), 1.0, "0/1"), None, AFTER, now),
            Look::Leave
        );
        // The beats name another walsender: the holder is new (or does not beat at all).
        assert_eq!(
            look(&holder(Some(8), Some(7), 9.0, "0/1"), None, AFTER, now),
            Look::Leave
        );
        let mut never = holder(Some(8), None, 0.0, "0/1");
        never.silent_s = None;
        assert_eq!(look(&never, None, AFTER, now), Look::Leave);
        assert_eq!(
            look(&holder(None, Some(7), 9.0, "0/1"), None, AFTER, now),
            Look::Free
        );
    }

    #[test]
    fn a_stale_holder_is_fenced_on_the_second_look_only_if_its_position_stood_still() {
        let t0 = Instant::now();
        let stale = holder(Some(7), Some(7), 3.5, "0/1");
        let Look::Suspect(s) = look(&stale, None, AFTER, t0) else {
            panic!()
        };
        // Too soon for a second look: still a suspect, first seen at t0.
        assert_eq!(
            look(&stale, Some(&s), AFTER, t0 + Duration::from_millis(100)),
            Look::Suspect(s.clone())
        );
        let t1 = t0 + RECHECK;
        assert_eq!(
            look(&stale, Some(&s), AFTER, t1),
            Look::Fence {
                pid: 7,
                silent_s: 3.5
            }
        );
        // Its position moved: it works, only its beats are late. Start over.
        let moved = holder(Some(7), Some(7), 4.0, "0/2");
        let Look::Suspect(s2) = look(&moved, Some(&s), AFTER, t1) else {
            panic!()
        };
        assert_eq!((s2.at, s2.confirmed.as_str()), (t1, "0/2"));
        // Another walsender, or a first look long ago: start over.
        let other = holder(Some(9), Some(9), 4.0, "0/1");
        assert!(matches!(look(&other, Some(&s), AFTER, t1), Look::Suspect(x) if x.pid == 9));
        let late = t0 + AFTER * 3;
        assert!(matches!(look(&stale, Some(&s), AFTER, late), Look::Suspect(x) if x.at == late));
    }
}
