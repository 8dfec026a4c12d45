//! Observability: the metric names outboxd exports (one list, used by the exporter, the alert
//! rules, the Grafana dashboard and their tests), process health for `/healthz` and `/readyz`,
//! and the HTTP listener serving them with `/metrics` (`http`: bounded, on its own thread, see
//! there; `admit`: its connection budgets).
//!
//! Labels stay bounded: `event_type`, `topic`, `class`, `state`, `status` — never `event_id` or
//! `aggregate_id`.

mod admit;
pub(crate) mod errors;
mod http;
pub(crate) mod labels;
pub(crate) mod status;
pub(crate) mod status_row;
pub(crate) mod telemetry;
pub(crate) mod view;
pub(crate) mod watch;

pub use http::serve;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub const UP: &str = "outboxd_up";
pub const ROLE_ACTIVE: &str = "outboxd_role_active";
pub const HALTED: &str = "outboxd_halted";
pub const SLOT_LAG_BYTES: &str = "outboxd_slot_lag_bytes";
pub const STANDBY_REPLAY_LAG_BYTES: &str = "outboxd_standby_replay_lag_bytes";
pub const SLOT_RETAINED_WAL_BYTES: &str = "outboxd_slot_retained_wal_bytes";
pub const SLOT_SAFE_WAL_SIZE_BYTES: &str = "outboxd_slot_safe_wal_size_bytes";
pub const SLOT_WAL_STATUS: &str = "outboxd_slot_wal_status";
pub const CONFIRMED_LSN: &str = "outboxd_confirmed_lsn";
pub const PENDING_EVENTS: &str = "outboxd_pending_events";
pub const PENDING_BYTES: &str = "outboxd_pending_bytes";
pub const OLDEST_PENDING_AGE: &str = "outboxd_oldest_pending_age_seconds";
pub const PUBLISHED: &str = "outboxd_events_published_total";
pub const TABLE_PUBLISHED: &str = "outboxd_table_events_published_total";
pub const TABLE_POISON: &str = "outboxd_table_poison_events_total";
pub const PUBLISH_ERRORS: &str = "outboxd_publish_errors_total";
pub const PRODUCE_RETRIES: &str = "outboxd_produce_retries_total";
pub const SESSION_RESTARTS: &str = "outboxd_session_restarts_total";
pub const COMMIT_TO_ACK: &str = "outboxd_commit_to_ack_seconds";
pub const HEARTBEAT_AGE: &str = "outboxd_heartbeat_age_seconds";
pub const HEARTBEAT_DELAY: &str = "outboxd_heartbeat_delay_seconds";
pub const IGNORED_CHANGES: &str = "outboxd_ignored_changes_total";
pub const TRACE_SPANS_DROPPED: &str = "outboxd_trace_spans_dropped_total";
pub const RETRY_BACKOFF: &str = "outboxd_retry_backoff_seconds";
pub const PARKED: &str = "outboxd_parked_events";
pub const PARKED_OLDEST_AGE: &str = "outboxd_parked_oldest_age_seconds";
pub const POISON: &str = "outboxd_poison_events_total";
pub const BLOCKED: &str = "outboxd_blocked_events_total";
pub const STUCK_AGGREGATES: &str = "outboxd_stuck_aggregates";
pub const SLOT_LOSSES: &str = "outboxd_slot_losses_total";
pub const RECOVERIES: &str = "outboxd_recoveries_total";
pub const RECOVERED_EVENTS: &str = "outboxd_recovered_events_total";
pub const BROKER_ERRORS: &str = "outboxd_broker_errors_total";
pub const FENCINGS: &str = "outboxd_fencings_total";
pub const SHADOW_EVENTS: &str = "outboxd_shadow_events_total";
pub const SHADOW_PENDING: &str = "outboxd_shadow_pending";
pub const SLOT_LAST_LOSS: &str = "outboxd_slot_last_loss_timestamp_seconds";

/// Every metric outboxd exports, with its help text.
pub const METRICS: &[(&str, &str)] = &[
    (
        STUCK_AGGREGATES,
        "aggregates whose events are held behind an open parked head (one operator decision each: \
         outboxd parked retry|discard; `outboxd status` names the oldest)",
    ),
    (
        SLOT_LOSSES,
        "replication slot losses detected, per reason (missing, invalidated, new_system, interrupted, manual)",
    ),
    (
        SLOT_LAST_LOSS,
        "unix time of the last slot loss this process detected (0: none); the alert keys on it, \
         because a counter that is already 1 at the first scrape shows no increase",
    ),
    (
        RECOVERIES,
        "recoveries that republished a lost slot's gap from the outbox table and finished, per reason",
    ),
    (
        RECOVERED_EVENTS,
        "events republished from the outbox table by recoveries",
    ),
    (UP, "1 while the process runs"),
    (
        TABLE_PUBLISHED,
        "acknowledged events per outbox table (only with several [[source.tables]])",
    ),
    (
        TABLE_POISON,
        "parked (poison) events per outbox table (only with several [[source.tables]])",
    ),
    (
        ROLE_ACTIVE,
        "1 when this instance holds the slot and streams, 0 when standing by",
    ),
    (
        HALTED,
        "1 while halted at an event under on_poison = \"halt\"",
    ),
    (
        SLOT_LAG_BYTES,
        "pg_current_wal_lsn() - confirmed_flush_lsn of the slot",
    ),
    (
        STANDBY_REPLAY_LAG_BYTES,
        "with the slot on a standby (source.replication_dsn): the primary's WAL end - the standby's replay position",
    ),
    (
        SLOT_RETAINED_WAL_BYTES,
        "pg_current_wal_lsn() - restart_lsn: WAL the slot keeps on disk",
    ),
    (
        SLOT_SAFE_WAL_SIZE_BYTES,
        "bytes that can still be written before the slot is in danger (max_slot_wal_keep_size)",
    ),
    (
        SLOT_WAL_STATUS,
        "1 for the slot's current wal_status (reserved, extended, unreserved, lost)",
    ),
    (CONFIRMED_LSN, "the LSN last confirmed to Postgres"),
    (PENDING_EVENTS, "events produced and not yet acknowledged"),
    (
        PENDING_BYTES,
        "bytes of events produced and not yet acknowledged",
    ),
    (
        OLDEST_PENDING_AGE,
        "seconds since the commit of the oldest unacknowledged event, per event_type (0 when none)",
    ),
    (
        PUBLISHED,
        "events acknowledged by the broker, per event_type and topic",
    ),
    (
        PUBLISH_ERRORS,
        "failed deliveries and rejected events, per class and event_type",
    ),
    (PRODUCE_RETRIES, "produce requests retried by librdkafka"),
    (
        BROKER_ERRORS,
        "errors on broker connections reported by librdkafka, per class (auth, tls, down, transport, other)",
    ),
    (
        SESSION_RESTARTS,
        "replication sessions restarted after a transient error, per class",
    ),
    (
        RETRY_BACKOFF,
        "seconds until the next session attempt after the last failure (0 while streaming)",
    ),
    (
        COMMIT_TO_ACK,
        "seconds from a transaction's commit to the broker's acknowledgement of all its events",
    ),
    (
        HEARTBEAT_AGE,
        "seconds since the last heartbeat came back through the replication stream",
    ),
    (
        HEARTBEAT_DELAY,
        "seconds from emitting the last heartbeat on the source to receiving it",
    ),
    (
        TRACE_SPANS_DROPPED,
        "finished trace spans that never reached the OTLP receiver (queue full, receiver down or \
         slow); delivery is never held for them",
    ),
    (
        IGNORED_CHANGES,
        "changes of other tables or kinds (update/delete/truncate) ignored",
    ),
    (
        PARKED,
        "open parked events, per event_type and state (parked, blocked, retry)",
    ),
    (
        PARKED_OLDEST_AGE,
        "seconds since the oldest open parked event was first seen, per event_type",
    ),
    (
        POISON,
        "events that failed deterministically, per event_type and class",
    ),
    (
        BLOCKED,
        "events held behind a parked event of the same aggregate, per event_type",
    ),
    (
        SHADOW_EVENTS,
        "shadow mode: events per event_type and result (matched, mismatched, missing_legacy, missing_outbox; dropped, unreadable)",
    ),
    (
        SHADOW_PENDING,
        "shadow mode: events waiting for their counterpart (at most shadow.match_window)",
    ),
    (
        FENCINGS,
        "silent slot holders this instance fenced (terminated their walsender to take the slot over)",
    ),
];

/// Wall-clock time, unix µs (0 before 1970).
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// Registers help texts and the unlabelled series, so a scrape shows them from the start.
pub fn describe() {
    for (name, help) in METRICS {
        if name.ends_with("_total") {
            metrics::describe_counter!(*name, *help);
        } else if *name == COMMIT_TO_ACK {
            metrics::describe_histogram!(*name, metrics::Unit::Seconds, *help);
        } else {
            metrics::describe_gauge!(*name, *help);
        }
    }
    metrics::gauge!(UP).set(1.0);
    metrics::gauge!(ROLE_ACTIVE).set(0.0);
    metrics::gauge!(HALTED).set(0.0);
    metrics::gauge!(SLOT_LAST_LOSS).set(0.0);
    metrics::counter!(PRODUCE_RETRIES).absolute(0);
    metrics::counter!(FENCINGS).absolute(0);
    metrics::counter!(TRACE_SPANS_DROPPED).increment(0);
    // Present from the start, so the first refusal is an increase the alert sees.
    for class in ["auth", "tls"] {
        metrics::counter!(BROKER_ERRORS, "class" => class).absolute(0);
    }
}

/// What `/readyz` reports.
#[derive(Debug, Default)]
pub struct Health {
    /// Another instance holds the slot (set when the slot was found busy).
    pub standby: AtomicBool,
    pub streaming: AtomicBool,
    pub broker_ok: AtomicBool,
    pub halted: AtomicBool,
    /// Set while the broker refuses us (authentication, TLS): what `/readyz` and the status
    /// row name, until a delivery or token succeeds.
    issue: Mutex<Option<BrokerIssue>>,
    has_issue: AtomicBool,
}

/// Why the broker refuses this relay, and since when.
#[derive(Debug, Clone)]
pub struct BrokerIssue {
    pub class: &'static str,
    /// Redacted.
    pub message: String,
    pub since: std::time::SystemTime,
}

/// What one relay knows about itself: readiness, error counts, its session count. Whoever runs
/// the relay creates it and hands it to [`crate::run_observed`] and the HTTP listener
/// ([`serve`]), so two relays in one process (tests run several) each keep their own.
#[derive(Debug, Default)]
pub struct Observed {
    pub health: Health,
    pub errors: errors::Counts,
    /// Bounded `event_type` and `topic` label values.
    pub labels: labels::Labels,
    /// Producer sessions started: a delivery after a restart is a later attempt (R25).
    pub sessions: std::sync::atomic::AtomicU64,
    /// With `relay.broker_fencing`: events the broker refused inside a Kafka transaction, by
    /// event_id (class, redacted message). A refusal aborts the whole transaction, so this
    /// relay's later sessions park them again without sending them (`relay/kafka/txn.rs`)
    /// instead of aborting their neighbours' transaction in every session.
    pub refused_in_txn: std::sync::Mutex<std::collections::HashMap<String, (&'static str, String)>>,
    /// What the status page (`GET /`, `/status.json`) shows of this relay.
    pub status: status::Board,
    /// With `[telemetry]`: this relay's trace pipeline, started by its first producer and
    /// shared by its sessions (`telemetry`).
    traces: Mutex<Option<Result<Option<Arc<telemetry::Traces>>, String>>>,
}

impl Observed {
    /// This relay's trace pipeline (`None`: `[telemetry]` is off), started on first use. A
    /// setting the exporter refuses is the same error on every call.
    pub fn traces(
        &self,
        cfg: &crate::config::Config,
    ) -> Result<Option<Arc<telemetry::Traces>>, String> {
        let mut t = self.traces.lock().unwrap_or_else(|p| p.into_inner());
        t.get_or_insert_with(|| {
            telemetry::Traces::start(&cfg.telemetry, &cfg.redactor).map(|t| t.map(Arc::new))
        })
        .clone()
    }

    /// The trace pipeline if one was started (the relay's own spans, `telemetry::ops`).
    pub fn started_traces(&self) -> Option<Arc<telemetry::Traces>> {
        let t = self.traces.lock().unwrap_or_else(|p| p.into_inner());
        t.as_ref().and_then(|t| t.as_ref().ok()).cloned().flatten()
    }
}

impl Health {
    /// Records that the broker refuses us for `class` (redacted `message`). Keeps the first
    /// `since` of an ongoing issue of the same class.
    pub fn broker_issue(&self, class: &'static str, message: String) {
        if let Ok(mut i) = self.issue.lock() {
            let since = match &*i {
                Some(old) if old.class == class => old.since,
                _ => std::time::SystemTime::now(),
            };
            *i = Some(BrokerIssue {
                class,
                message,
                since,
            });
            self.has_issue.store(true, Ordering::Relaxed);
        }
    }

    /// Ends an issue of `class` (e.g. a token was obtained again).
    pub fn clear_broker_issue(&self, class: &str) {
        if let Ok(mut i) = self.issue.lock() {
            if i.as_ref().is_some_and(|x| x.class == class) {
                *i = None;
                self.has_issue.store(false, Ordering::Relaxed);
            }
        }
    }

    /// A delivery succeeded: whatever refused us before has healed. Cheap on the hot path.
    pub fn broker_ok_again(&self) {
        if self.has_issue.load(Ordering::Relaxed) {
            if let Ok(mut i) = self.issue.lock() {
                *i = None;
                self.has_issue.store(false, Ordering::Relaxed);
            }
        }
    }

    pub fn broker_issue_now(&self) -> Option<BrokerIssue> {
        if !self.has_issue.load(Ordering::Relaxed) {
            return None;
        }
        self.issue.lock().ok().and_then(|i| i.clone())
    }

    /// `None` when ready, else the reason.
    pub fn not_ready(&self) -> Option<String> {
        if let Some(i) = self.broker_issue_now() {
            if !self.standby.load(Ordering::Relaxed) {
                let secs = i.since.elapsed().map(|d| d.as_secs()).unwrap_or(0);
                return Some(format!(
                    "the broker refuses this relay ({}) for {secs} s: {}",
                    i.class, i.message
                ));
            }
        }
        self.not_ready_plain().map(str::to_string)
    }

    fn not_ready_plain(&self) -> Option<&'static str> {
        if self.halted.load(Ordering::Relaxed) {
            Some("halted at a poison event")
        } else if self.standby.load(Ordering::Relaxed) {
            Some("standby: another instance holds the slot")
        } else if !self.streaming.load(Ordering::Relaxed) {
            Some("replication not streaming (starting or reconnecting)")
        } else if !self.broker_ok.load(Ordering::Relaxed) {
            Some("broker unreachable")
        } else {
            None
        }
    }
}

/// Zero series, so rates and alerts on them work before the first loss.
pub fn touch_recovery_metrics() {
    for reason in [
        "missing",
        "invalidated",
        "new_system",
        "interrupted",
        "manual",
    ] {
        metrics::counter!(SLOT_LOSSES, "reason" => reason).increment(0);
        metrics::counter!(RECOVERIES, "reason" => reason).increment(0);
    }
    metrics::counter!(RECOVERED_EVENTS).increment(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_refusal_is_named_until_it_heals() {
        let h = Health::default();
        h.streaming.store(true, Ordering::Relaxed);
        h.broker_ok.store(true, Ordering::Relaxed);
        assert_eq!(h.not_ready(), None);
        h.broker_issue("auth", "SASL authentication error".into());
        let first = h.broker_issue_now().unwrap().since;
        h.broker_issue("auth", "again".into());
        assert_eq!(
            h.broker_issue_now().unwrap().since,
            first,
            "keeps when it began"
        );
        let why = h.not_ready().unwrap();
        assert!(
            why.contains("refuses this relay (auth)") && why.contains("again"),
            "{why}"
        );
        // A standby holds no producer session worth naming.
        h.standby.store(true, Ordering::Relaxed);
        assert!(h.not_ready().unwrap().contains("standby"));
        h.standby.store(false, Ordering::Relaxed);
        h.clear_broker_issue("tls");
        assert!(h.broker_issue_now().is_some(), "another class stays");
        h.broker_ok_again();
        assert_eq!(h.not_ready(), None);
    }
}
