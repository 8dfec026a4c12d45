//! Observability: the metric names outboxd exports (one list, used by the exporter, the alert
//! rules, the Grafana dashboard and their tests), process health for `/healthz` and `/readyz`,
//! and the HTTP listener serving them with `/metrics`.
//!
//! Labels stay bounded: `event_type`, `topic`, `class`, `state`, `status` — never `event_id` or
//! `aggregate_id`.

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

pub const UP: &str = "outboxd_up";
pub const ROLE_ACTIVE: &str = "outboxd_role_active";
pub const HALTED: &str = "outboxd_halted";
pub const SLOT_LAG_BYTES: &str = "outboxd_slot_lag_bytes";
pub const SLOT_RETAINED_WAL_BYTES: &str = "outboxd_slot_retained_wal_bytes";
pub const SLOT_SAFE_WAL_SIZE_BYTES: &str = "outboxd_slot_safe_wal_size_bytes";
pub const SLOT_WAL_STATUS: &str = "outboxd_slot_wal_status";
pub const CONFIRMED_LSN: &str = "outboxd_confirmed_lsn";
pub const PENDING_EVENTS: &str = "outboxd_pending_events";
pub const PENDING_BYTES: &str = "outboxd_pending_bytes";
pub const OLDEST_PENDING_AGE: &str = "outboxd_oldest_pending_age_seconds";
pub const PUBLISHED: &str = "outboxd_events_published_total";
pub const PUBLISH_ERRORS: &str = "outboxd_publish_errors_total";
pub const PRODUCE_RETRIES: &str = "outboxd_produce_retries_total";
pub const SESSION_RESTARTS: &str = "outboxd_session_restarts_total";
pub const COMMIT_TO_ACK: &str = "outboxd_commit_to_ack_seconds";
pub const HEARTBEAT_AGE: &str = "outboxd_heartbeat_age_seconds";
pub const HEARTBEAT_DELAY: &str = "outboxd_heartbeat_delay_seconds";
pub const IGNORED_CHANGES: &str = "outboxd_ignored_changes_total";
pub const RETRY_BACKOFF: &str = "outboxd_retry_backoff_seconds";
pub const PARKED: &str = "outboxd_parked_events";
pub const PARKED_OLDEST_AGE: &str = "outboxd_parked_oldest_age_seconds";
pub const POISON: &str = "outboxd_poison_events_total";
pub const BLOCKED: &str = "outboxd_blocked_events_total";
pub const SLOT_LOSSES: &str = "outboxd_slot_losses_total";
pub const RECOVERIES: &str = "outboxd_recoveries_total";
pub const RECOVERED_EVENTS: &str = "outboxd_recovered_events_total";

/// Every metric outboxd exports, with its help text.
pub const METRICS: &[(&str, &str)] = &[
    (
        SLOT_LOSSES,
        "replication slot losses detected, per reason (missing, invalidated, new_system, interrupted, manual)",
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
];

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
    metrics::counter!(PRODUCE_RETRIES).absolute(0);
}

/// What `/readyz` reports. Process-wide: one relay per process.
#[derive(Debug, Default)]
pub struct Health {
    /// Another instance holds the slot (set when the slot was found busy).
    pub standby: AtomicBool,
    pub streaming: AtomicBool,
    pub broker_ok: AtomicBool,
    pub halted: AtomicBool,
}

pub fn health() -> &'static Health {
    static H: OnceLock<Health> = OnceLock::new();
    H.get_or_init(Health::default)
}

impl Health {
    /// `None` when ready, else the reason.
    pub fn not_ready(&self) -> Option<&'static str> {
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

/// Serves `/metrics`, `/healthz` and `/readyz` until the process ends.
pub async fn serve(addr: std::net::SocketAddr, prom: PrometheusHandle) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let prom = prom.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let prom = prom.clone();
                    async move { Ok::<_, std::convert::Infallible>(route(&req, &prom)) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, svc)
                    .await;
            });
        }
    });
    Ok(())
}

fn route(req: &Request<hyper::body::Incoming>, prom: &PrometheusHandle) -> Response<Full<Bytes>> {
    let (status, body) = match req.uri().path() {
        "/metrics" => (StatusCode::OK, prom.render()),
        "/healthz" => (StatusCode::OK, "ok\n".to_string()),
        "/readyz" => match health().not_ready() {
            None => (StatusCode::OK, "ready\n".to_string()),
            Some(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        _ => (StatusCode::NOT_FOUND, "not found\n".to_string()),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}
