//! What a session watches and reports: per-event-type ages and counters, the commit→ack
//! histogram, heartbeats (emitted on the source, recognised in the stream, used to measure the
//! source→relay delay and to detect a stalled stream), slot health from SQL, and the status row.

use crate::config::Config;
use crate::error::RelayError;
use crate::obs;
use crate::obs::now_us;
use crate::obs::view::{Pending, SlotServer};
use metrics::{Counter, Gauge};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// A session that ran this long counts as healthy: the next failure starts a new streak
/// (attempt 1, shortest backoff) instead of continuing the old one.
pub const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// See the module docs. The session tells it what happened (events, acks, ignored changes) and
/// calls [`Watch::tick`]; it never reaches into the session's state.
pub struct Watch {
    hb_prefix: String,
    /// This session's heartbeat token: any role may write a logical message with our prefix
    /// (`pg_logical_emit_message`), so only messages carrying the token count as heartbeats.
    hb_token: String,
    hb_interval: Option<Duration>,
    stall_timeout: Duration,
    next_hb: Instant,
    /// When an event / a delivered ack was last seen, to the tick (stall and broker-down
    /// thresholds are seconds): the hot path only sets a flag, the tick reads the clock.
    last_event_at: Instant,
    last_ack_at: Instant,
    event_seen: bool,
    ack_seen: bool,
    last_hb: Option<(Instant, f64)>,
    last_hb_wall: Option<i64>,
    next_slot_poll: Instant,
    ignored: Counter,
    pending: Gauge,
    pending_bytes: Gauge,
    confirmed: Gauge,
    hb_age: Gauge,
    hb_delay: Gauge,
    /// Event types whose age gauge was set, so they return to 0 when nothing is pending.
    aged: HashSet<String>,
    parked_seen: HashSet<(String, String)>,
    oldest_age: f64,
    started: Instant,
    /// An acknowledgement moved the slot in this session (the broker path works end to end).
    delivered: bool,
    /// Deliveries not yet handed to the status page (at the next tick).
    relayed: u64,
}

impl Watch {
    pub fn new(cfg: &Config) -> Self {
        let now = Instant::now();
        let hb = cfg.heartbeat.interval_ms;
        Self {
            hb_prefix: format!("outboxd.heartbeat.{}", cfg.source.slot),
            hb_token: {
                use std::hash::BuildHasher;
                // Random per process (std seeds RandomState from the OS) and per session.
                let h = std::collections::hash_map::RandomState::new().hash_one(now_us());
                format!("{h:016x}")
            },
            hb_interval: (hb > 0).then(|| Duration::from_millis(hb)),
            stall_timeout: Duration::from_millis(cfg.heartbeat.stall_timeout_ms),
            next_hb: now,
            last_event_at: now,
            last_ack_at: now,
            event_seen: false,
            ack_seen: false,
            last_hb: None,
            last_hb_wall: None,
            next_slot_poll: now,
            ignored: metrics::counter!(obs::IGNORED_CHANGES),
            pending: metrics::gauge!(obs::PENDING_EVENTS),
            pending_bytes: metrics::gauge!(obs::PENDING_BYTES),
            confirmed: metrics::gauge!(obs::CONFIRMED_LSN),
            hb_age: metrics::gauge!(obs::HEARTBEAT_AGE),
            hb_delay: metrics::gauge!(obs::HEARTBEAT_DELAY),
            aged: HashSet::new(),
            parked_seen: HashSet::new(),
            oldest_age: 0.0,
            started: now,
            delivered: false,
            relayed: 0,
        }
    }

    /// A replication message arrived (the stream is alive).
    pub fn saw_event(&mut self) {
        self.event_seen = true;
    }

    /// Is this logical message one of our heartbeats?
    pub fn is_heartbeat(&self, prefix: &str) -> bool {
        prefix == self.hb_prefix
    }

    /// The broker acknowledged a streamed event (`delivered`: not refused); `advanced`: the
    /// confirmable LSN moved, so the broker path works end to end.
    pub fn on_stream_ack(&mut self, delivered: bool, advanced: bool) {
        self.ack_seen |= delivered;
        self.relayed += u64::from(delivered);
        self.delivered |= advanced;
    }

    /// A change of another published table (or an update/delete/truncate) was skipped.
    pub fn on_ignored(&mut self) {
        self.ignored.increment(1);
    }

    /// A message with the heartbeat prefix came back through the stream. Ours carry
    /// `<token>:<emit time, unix µs>`; anything else (another session's forgery, an earlier
    /// session's heartbeat) is ignored. Returns whether it was ours.
    pub fn on_heartbeat(&mut self, content: &[u8]) -> bool {
        let Some(sent) = std::str::from_utf8(content)
            .ok()
            .and_then(|s| s.split_once(':'))
            .filter(|(token, _)| *token == self.hb_token)
            .and_then(|(_, us)| us.parse::<i64>().ok())
        else {
            return false;
        };
        let delay = now_us().saturating_sub(sent).max(0) as f64 / 1e6;
        self.last_hb = Some((Instant::now(), delay));
        self.last_hb_wall = Some(now_us());
        self.hb_delay.set(delay);
        true
    }

    /// Parked-event gauges from `stats` (per event type and state, types beyond the label
    /// budget summed as `other`).
    pub fn parked_gauges(
        &mut self,
        stats: &[(String, String, i64, f64)],
        labels: &obs::labels::Labels,
    ) {
        let mut folded: HashMap<(String, String), (i64, f64)> = HashMap::new();
        for (event_type, state, count, age) in stats {
            let key = (labels.event_type(event_type).into_owned(), state.clone());
            let e = folded.entry(key).or_insert((0, 0.0));
            e.0 += count;
            e.1 = e.1.max(*age);
        }
        let mut now_seen = HashSet::new();
        let mut oldest: HashMap<&str, f64> = HashMap::new();
        for ((event_type, state), (count, age)) in &folded {
            metrics::gauge!(obs::PARKED, "event_type" => event_type.clone(), "state" => state.clone())
                .set(*count as f64);
            let o = oldest.entry(event_type).or_insert(0.0);
            *o = o.max(*age);
            now_seen.insert((event_type.clone(), state.clone()));
        }
        for (event_type, age) in oldest {
            metrics::gauge!(obs::PARKED_OLDEST_AGE, "event_type" => event_type.to_string())
                .set(age);
        }
        for (event_type, state) in self.parked_seen.difference(&now_seen) {
            metrics::gauge!(obs::PARKED, "event_type" => event_type.clone(), "state" => state.clone()).set(0.0);
            if !now_seen.iter().any(|(t, _)| t == event_type) {
                metrics::gauge!(obs::PARKED_OLDEST_AGE, "event_type" => event_type.clone())
                    .set(0.0);
            }
        }
        self.parked_seen = now_seen;
    }
}

/// What the watch reads of the session on each tick.
pub struct View<'a> {
    pub slot: &'a str,
    pub sql: &'a Client,
    /// The slot's server: `sql` itself, or the standby of `source.replication_dsn`.
    pub slot_sql: &'a Client,
    /// The slot lives on a standby (`slot_sql` is another server than `sql`).
    pub separate: bool,
    /// Where the slot lives: a standby that stops following the primary ends the session.
    pub host: &'a dyn SlotServer,
    pub in_flight: &'a dyn Pending,
    pub observed: &'a obs::Observed,
}

impl Watch {
    /// Every tick: in-process gauges, readiness, stall detection, heartbeat emission, and (every
    /// few seconds) slot health and the status row.
    pub async fn tick(&mut self, v: View<'_>, reading: bool) -> Result<(), RelayError> {
        let now = Instant::now();
        if std::mem::take(&mut self.event_seen) {
            self.last_event_at = now;
        }
        if std::mem::take(&mut self.ack_seen) {
            self.last_ack_at = now;
        }
        self.pending.set(v.in_flight.events() as f64);
        self.pending_bytes.set(v.in_flight.bytes() as f64);
        self.confirmed.set(v.in_flight.confirmed() as f64);
        let oldest = v.in_flight.oldest_pending();
        self.oldest_ages(&oldest);
        v.observed.status.relayed(std::mem::take(&mut self.relayed));
        if let Some((at, _)) = self.last_hb {
            self.hb_age.set(at.elapsed().as_secs_f64());
        }
        // The broker is unreachable when acks stopped while events wait.
        let stuck =
            v.in_flight.events() > 0 && self.last_ack_at.elapsed() > Duration::from_secs(15);
        v.observed.health.broker_ok.store(!stuck, Ordering::Relaxed);

        if let Some(every) = self.hb_interval {
            if !reading {
                // Backpressure: we are not reading, so silence proves nothing.
                self.last_event_at = now;
            } else if self.last_event_at.elapsed() > self.stall_timeout {
                // Silence alone is not proof: a server decoding a huge transaction sends nothing
                // for a long time. Our standby status updates must still be reaching it.
                let silent = self.last_event_at.elapsed();
                if self.replies_reach_server(&v).await? {
                    self.last_event_at = now;
                } else {
                    return Err(RelayError::Replication(format!(
                        "no replication message for {silent:?} and the server has not heard our status \
                         updates either (heartbeats every {every:?}): the stream is stalled"
                    )));
                }
            }
            if now >= self.next_hb {
                self.next_hb = now + every;
                self.emit_heartbeat(&v, every).await?;
            }
        }
        v.host.still_follows(v.sql).await?;
        if now >= self.next_slot_poll {
            self.next_slot_poll = now + Duration::from_secs(5);
            let lag_bytes = self.slot_health(&v).await?;
            self.write_status(&v).await?;
            self.status_page(&v, lag_bytes, &oldest);
        }
        Ok(())
    }

    /// Age of the oldest unacknowledged event per event type (0 for types with none pending).
    fn oldest_ages(&mut self, oldest: &HashMap<String, i64>) {
        let now = now_us();
        let mut max_age = 0.0f64;
        for t in &self.aged {
            if !oldest.contains_key(t.as_str()) {
                metrics::gauge!(obs::OLDEST_PENDING_AGE, "event_type" => t.clone()).set(0.0);
            }
        }
        for (t, c) in oldest {
            let age = (now - c).max(0) as f64 / 1e6;
            max_age = max_age.max(age);
            metrics::gauge!(obs::OLDEST_PENDING_AGE, "event_type" => t.to_string()).set(age);
            self.aged.insert(t.to_string());
        }
        self.oldest_age = max_age;
    }

    /// Does our walsender still receive our standby status updates (its `reply_time`)? Asked
    /// of the server that runs it: the slot's (`slot_sql`), a standby's own
    /// `pg_stat_replication` when the slot lives there. Asking the primary instead finds no
    /// walsender of ours, so any silence past the stall timeout on a standby (replay paused,
    /// `recovery_min_apply_delay`, a long filtered transaction) would end the session.
    async fn replies_reach_server(&self, v: &View<'_>) -> Result<bool, RelayError> {
        let app = format!("outboxd:{}:{}", v.slot, std::process::id());
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&app];
        let q = v.slot_sql.query_opt(
            "SELECT extract(epoch FROM now() - reply_time)::float8 FROM pg_stat_replication \
             WHERE application_name = $1",
            &params,
        );
        let row = match tokio::time::timeout(Duration::from_secs(5), q).await {
            Ok(r) => r?,
            Err(_) => return Ok(false),
        };
        let limit = self.stall_timeout.as_secs_f64() / 2.0;
        Ok(row
            .and_then(|r| r.get::<_, Option<f64>>(0))
            .is_some_and(|age| age < limit))
    }

    async fn emit_heartbeat(&mut self, v: &View<'_>, every: Duration) -> Result<(), RelayError> {
        let stamp = format!("{}:{}", self.hb_token, now_us());
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&self.hb_prefix, &stamp];
        let q = v.sql.query_one(
            "SELECT pg_logical_emit_message(false, $1, $2)::text",
            &params,
        );
        match tokio::time::timeout(every.max(Duration::from_secs(5)), q).await {
            Ok(r) => r.map(|_| ()).map_err(RelayError::from),
            Err(_) => Err(RelayError::Postgres(
                "heartbeat did not return: the SQL connection is stalled".into(),
            )),
        }
    }

    /// One sample for the status page: position, lag, per-type ages (and a point of its chart).
    fn status_page(&self, v: &View<'_>, lag_bytes: Option<f64>, oldest: &HashMap<String, i64>) {
        let now = now_us();
        let lag_seconds = if v.in_flight.events() > 0 {
            self.oldest_age
        } else {
            self.last_hb.map(|(_, d)| d).unwrap_or(0.0)
        };
        v.observed.status.sample(crate::obs::status::Sample {
            confirmed_lsn: crate::model::lsn::fmt_lsn(v.in_flight.confirmed()),
            lag_bytes,
            lag_seconds,
            pending_events: v.in_flight.events() as u64,
            pending_bytes: v.in_flight.bytes() as u64,
            oldest: oldest
                .iter()
                .map(|(t, c)| (t.clone(), (now - c).max(0) as f64 / 1e6))
                .collect(),
        });
    }

    /// Slot gauges from SQL; the lag in bytes (`None`: no such slot).
    async fn slot_health(&mut self, v: &View<'_>) -> Result<Option<f64>, RelayError> {
        // Lags count from the primary's WAL end; on a standby, the slot's retained WAL from its
        // own replay position (`pg_current_wal_lsn` fails during recovery).
        let row = if v.separate {
            let end: String = v
                .sql
                .query_one("SELECT pg_current_wal_lsn()::text", &[])
                .await?
                .get(0);
            let row = v
                .slot_sql
                .query_opt(
                    "SELECT ($2::text::pg_lsn - confirmed_flush_lsn)::float8, \
                            (coalesce(pg_last_wal_replay_lsn(), pg_current_wal_lsn()) \
                               - restart_lsn)::float8, \
                            wal_status, safe_wal_size::float8, \
                            ($2::text::pg_lsn - pg_last_wal_replay_lsn())::float8 \
                     FROM pg_replication_slots WHERE slot_name = $1",
                    &[&v.slot, &end],
                )
                .await?;
            if let Some(lag) = row.as_ref().and_then(|r| r.get::<_, Option<f64>>(4)) {
                metrics::gauge!(obs::STANDBY_REPLAY_LAG_BYTES).set(lag.max(0.0));
            }
            row
        } else {
            v.sql
                .query_opt(
                    "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::float8, \
                            (pg_current_wal_lsn() - restart_lsn)::float8, wal_status, safe_wal_size::float8 \
                     FROM pg_replication_slots WHERE slot_name = $1",
                    &[&v.slot],
                )
                .await?
        };
        let Some(row) = row else { return Ok(None) };
        let lag = row.get::<_, Option<f64>>(0).unwrap_or(0.0);
        metrics::gauge!(obs::SLOT_LAG_BYTES).set(lag);
        metrics::gauge!(obs::SLOT_RETAINED_WAL_BYTES)
            .set(row.get::<_, Option<f64>>(1).unwrap_or(0.0));
        if let Some(safe) = row.get::<_, Option<f64>>(3) {
            metrics::gauge!(obs::SLOT_SAFE_WAL_SIZE_BYTES).set(safe);
        }
        let status: Option<String> = row.get(2);
        for s in ["reserved", "extended", "unreserved", "lost"] {
            let v = if status.as_deref() == Some(s) {
                1.0
            } else {
                0.0
            };
            metrics::gauge!(obs::SLOT_WAL_STATUS, "status" => s).set(v);
        }
        Ok(Some(lag))
    }

    async fn write_status(&mut self, v: &View<'_>) -> Result<(), RelayError> {
        let instance = crate::obs::status_row::instance();
        let errors = serde_json::to_value(v.observed.errors.snapshot()).unwrap_or_default();
        let hb_delay = self.last_hb.map(|(_, d)| d);
        let hb_at = self.last_hb_wall.map(|us| us as f64 / 1e6);
        // The failure streak the supervisor recorded ends only when this session proves healthy
        // (an ack moved the slot, or it outlived the supervisor's reset window); until then a
        // retry that is about to fail again keeps showing the streak and the attempt in
        // progress. Keepalive confirms do not count: a halted relay may still confirm WAL that
        // lies before the event it halts at.
        let healthy = self.delivered || self.started.elapsed() > HEALTHY_SESSION;
        // The broker refusing us (authentication, TLS) is retried by librdkafka within the
        // session, so the supervisor never records it: the status row shows it from here.
        let issue = v.observed.health.broker_issue_now();
        let mut issue_class = issue.as_ref().map(|i| i.class);
        let mut issue_text = issue.as_ref().map(|i| {
            let since = chrono::DateTime::<chrono::Utc>::from(i.since);
            format!(
                "since {}: {}",
                since.format("%Y-%m-%dT%H:%M:%SZ"),
                i.message
            )
        });
        // What /readyz knows, `outboxd status` shows: no acknowledgement while events wait.
        if issue.is_none() && !v.observed.health.broker_ok.load(Ordering::Relaxed) {
            let silent = self.last_ack_at.elapsed();
            let since =
                chrono::DateTime::<chrono::Utc>::from(std::time::SystemTime::now() - silent);
            issue_class = Some("down");
            issue_text = Some(format!(
                "since {}: broker unreachable: no acknowledgement for {}s while {} event(s) wait, the oldest for {:.0}s",
                since.format("%Y-%m-%dT%H:%M:%SZ"),
                silent.as_secs(),
                v.in_flight.events(),
                self.oldest_age
            ));
        }
        crate::obs::status_row::report(
            v.sql,
            &crate::obs::status_row::Report {
                slot: v.slot,
                instance: &instance,
                confirmed_lsn: &crate::model::lsn::fmt_lsn(v.in_flight.confirmed()),
                pending_events: v.in_flight.events() as i64,
                pending_bytes: v.in_flight.bytes() as i64,
                oldest_pending_age_s: self.oldest_age,
                heartbeat_delay_s: hb_delay,
                last_heartbeat_at_s: hb_at,
                errors: &errors,
                halted: v.observed.health.halted.load(Ordering::Relaxed),
                healthy,
                issue_class,
                issue_text: issue_text.as_deref(),
            },
        )
        .await?;
        Ok(())
    }
}
