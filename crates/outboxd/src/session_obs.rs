//! What a session watches and reports: per-event-type ages and counters, the commit→ack
//! histogram, heartbeats (emitted on the source, recognised in the stream, used to measure the
//! source→relay delay and to detect a stalled stream), slot health from SQL, and the status row.

use crate::config::Config;
use crate::error::RelayError;
use crate::obs::{self, health};
use crate::stages::Stages;
use metrics::{Counter, Gauge, Histogram};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Postgres timestamps count from 2000-01-01; this many µs after the unix epoch.
pub const PG_EPOCH_US: i64 = 946_684_800_000_000;

pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// One (event_type, topic) pair and its counter handle (resolved once, incremented per ack).
pub struct Label {
    pub event_type: String,
    pub published: Counter,
}

impl Label {
    pub fn new(event_type: &str, topic: &str) -> Self {
        Self {
            event_type: event_type.to_string(),
            published: metrics::counter!(obs::PUBLISHED, "event_type" => event_type.to_string(), "topic" => topic.to_string()),
        }
    }
}

pub struct Watch {
    pub hb_prefix: String,
    hb_interval: Option<Duration>,
    stall_timeout: Duration,
    next_hb: Instant,
    pub last_event_at: Instant,
    pub last_ack_at: Instant,
    last_hb: Option<(Instant, f64)>,
    last_hb_wall: Option<i64>,
    next_slot_poll: Instant,
    pub commit_to_ack: Histogram,
    pub ignored: Counter,
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
    pub delivered: bool,
}

impl Watch {
    pub fn new(cfg: &Config) -> Self {
        let now = Instant::now();
        let hb = cfg.heartbeat.interval_ms;
        Self {
            hb_prefix: format!("outboxd.heartbeat.{}", cfg.source.slot),
            hb_interval: (hb > 0).then(|| Duration::from_millis(hb)),
            stall_timeout: Duration::from_millis(cfg.heartbeat.stall_timeout_ms),
            next_hb: now,
            last_event_at: now,
            last_ack_at: now,
            last_hb: None,
            last_hb_wall: None,
            next_slot_poll: now,
            commit_to_ack: metrics::histogram!(obs::COMMIT_TO_ACK),
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
        }
    }

    /// A heartbeat came back through the stream: its content is the emit time (unix µs).
    pub fn on_heartbeat(&mut self, content: &[u8]) {
        let sent: Option<i64> = std::str::from_utf8(content)
            .ok()
            .and_then(|s| s.parse().ok());
        let delay = sent
            .map(|s| (now_us() - s).max(0) as f64 / 1e6)
            .unwrap_or(0.0);
        self.last_hb = Some((Instant::now(), delay));
        self.last_hb_wall = Some(now_us());
        self.hb_delay.set(delay);
    }

    pub fn parked_gauges(&mut self, stats: &[(String, String, i64, f64)]) {
        let mut now_seen = HashSet::new();
        let mut oldest: HashMap<&str, f64> = HashMap::new();
        for (event_type, state, count, age) in stats {
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

impl Stages {
    /// Every tick: in-process gauges, readiness, stall detection, heartbeat emission, and (every
    /// few seconds) slot health and the status row.
    pub async fn obs_tick(&mut self, reading: bool) -> Result<(), RelayError> {
        let now = Instant::now();
        self.watch.pending.set(self.tracker.in_flight() as f64);
        self.watch.pending_bytes.set(self.in_flight_bytes as f64);
        self.watch.confirmed.set(self.tracker.confirmed() as f64);
        self.oldest_ages();
        if let Some((at, _)) = self.watch.last_hb {
            self.watch.hb_age.set(at.elapsed().as_secs_f64());
        }
        // The broker is unreachable when acks stopped while events wait.
        let stuck = self.tracker.in_flight() > 0
            && self.watch.last_ack_at.elapsed() > Duration::from_secs(15);
        health().broker_ok.store(!stuck, Ordering::Relaxed);

        if let Some(every) = self.watch.hb_interval {
            if !reading {
                // Backpressure: we are not reading, so silence proves nothing.
                self.watch.last_event_at = now;
            } else if self.watch.last_event_at.elapsed() > self.watch.stall_timeout {
                // Silence alone is not proof: a server decoding a huge transaction sends nothing
                // for a long time. Our standby status updates must still be reaching it.
                let silent = self.watch.last_event_at.elapsed();
                if self.replies_reach_server().await? {
                    self.watch.last_event_at = now;
                } else {
                    return Err(RelayError::Replication(format!(
                        "no replication message for {silent:?} and the server has not heard our status                          updates either (heartbeats every {every:?}): the stream is stalled"
                    )));
                }
            }
            if now >= self.watch.next_hb {
                self.watch.next_hb = now + every;
                self.emit_heartbeat(every).await?;
            }
        }
        if now >= self.watch.next_slot_poll {
            self.watch.next_slot_poll = now + Duration::from_secs(5);
            self.slot_health().await?;
            self.write_status().await?;
        }
        Ok(())
    }

    /// Age of the oldest unacknowledged event per event type (0 for types with none pending).
    fn oldest_ages(&mut self) {
        let now = now_us();
        let mut oldest: HashMap<&str, i64> = HashMap::new();
        for (i, &label) in self.meta.iter().enumerate() {
            let seq = self.meta_base + i as u64;
            if !self.tracker.is_pending(seq) {
                continue;
            }
            let Some(l) = self.labels.get(label as usize) else {
                continue;
            };
            if oldest.contains_key(l.event_type.as_str()) {
                continue;
            }
            if let Some(c) = self.tracker.commit_us_of(seq) {
                oldest.insert(l.event_type.as_str(), c);
            }
        }
        let mut max_age = 0.0f64;
        for t in &self.watch.aged {
            if !oldest.contains_key(t.as_str()) {
                metrics::gauge!(obs::OLDEST_PENDING_AGE, "event_type" => t.clone()).set(0.0);
            }
        }
        for (t, c) in &oldest {
            let age = (now - c).max(0) as f64 / 1e6;
            max_age = max_age.max(age);
            metrics::gauge!(obs::OLDEST_PENDING_AGE, "event_type" => t.to_string()).set(age);
            self.watch.aged.insert(t.to_string());
        }
        self.watch.oldest_age = max_age;
    }

    /// Does the walsender still receive our standby status updates (its `reply_time`)?
    async fn replies_reach_server(&self) -> Result<bool, RelayError> {
        let app = format!("outboxd:{}:{}", self.slot, std::process::id());
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&app];
        let q = self.sql.query_opt(
            "SELECT extract(epoch FROM now() - reply_time)::float8 FROM pg_stat_replication \
             WHERE application_name = $1",
            &params,
        );
        let row = match tokio::time::timeout(Duration::from_secs(5), q).await {
            Ok(r) => r?,
            Err(_) => return Ok(false),
        };
        let limit = self.watch.stall_timeout.as_secs_f64() / 2.0;
        Ok(row
            .and_then(|r| r.get::<_, Option<f64>>(0))
            .is_some_and(|age| age < limit))
    }

    async fn emit_heartbeat(&mut self, every: Duration) -> Result<(), RelayError> {
        let stamp = now_us().to_string();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
            [&self.watch.hb_prefix, &stamp];
        let q = self.sql.query_one(
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

    async fn slot_health(&mut self) -> Result<(), RelayError> {
        let row = self
            .sql
            .query_opt(
                "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::float8, \
                        (pg_current_wal_lsn() - restart_lsn)::float8, wal_status, safe_wal_size::float8 \
                 FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await?;
        let Some(row) = row else { return Ok(()) };
        metrics::gauge!(obs::SLOT_LAG_BYTES).set(row.get::<_, Option<f64>>(0).unwrap_or(0.0));
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
        Ok(())
    }

    async fn write_status(&mut self) -> Result<(), RelayError> {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let instance = format!("{host}:{}", std::process::id());
        let errors = serde_json::to_value(crate::obs_errors::snapshot()).unwrap_or_default();
        let hb_delay = self.watch.last_hb.map(|(_, d)| d);
        let hb_at = self.watch.last_hb_wall.map(|us| us as f64 / 1e6);
        // The failure streak the supervisor recorded ends only when this session proves healthy
        // (an ack moved the slot, or it outlived the supervisor's reset window); until then a
        // retry that is about to fail again keeps showing the streak and the attempt in
        // progress. Keepalive confirms do not count: a halted relay may still confirm WAL that
        // lies before the event it halts at.
        let healthy = self.watch.delivered || self.watch.started.elapsed() > crate::HEALTHY_SESSION;
        self.sql
            .execute(
                "INSERT INTO outboxd_status (slot, instance, updated_at, confirmed_lsn, pending_events, \
                   pending_bytes, oldest_pending_age_s, heartbeat_delay_s, last_heartbeat_at, errors, halted) \
                 VALUES ($1, $2, now(), $3, $4, $5, $6, $7, to_timestamp($8), $9, $10) \
                 ON CONFLICT (slot) DO UPDATE SET instance = EXCLUDED.instance, updated_at = now(), \
                   confirmed_lsn = EXCLUDED.confirmed_lsn, pending_events = EXCLUDED.pending_events, \
                   pending_bytes = EXCLUDED.pending_bytes, oldest_pending_age_s = EXCLUDED.oldest_pending_age_s, \
                   heartbeat_delay_s = EXCLUDED.heartbeat_delay_s, last_heartbeat_at = EXCLUDED.last_heartbeat_at, \
                   errors = EXCLUDED.errors, halted = EXCLUDED.halted, \
                   attempt = CASE WHEN $11 THEN 0 ELSE outboxd_status.attempt END, \
                   next_attempt_at = CASE WHEN $11 THEN NULL ELSE outboxd_status.next_attempt_at END",
                &[
                    &self.slot,
                    &instance,
                    &crate::source::fmt_lsn(self.tracker.confirmed()),
                    &(self.tracker.in_flight() as i64),
                    &(self.in_flight_bytes as i64),
                    &self.watch.oldest_age,
                    &hb_delay,
                    &hb_at,
                    &errors,
                    &health().halted.load(Ordering::Relaxed),
                    &healthy,
                ],
            )
            .await?;
        Ok(())
    }
}
