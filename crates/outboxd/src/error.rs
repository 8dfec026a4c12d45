//! The relay's error type, split the way Materialize splits source errors: *transient* errors
//! (network, server restarts, slot held by another instance, broker outages) end the current
//! session, which restarts from the slot's confirmed LSN after a bounded backoff; *definite*
//! errors (bad config, wrong server setup, a malformed or unroutable row) cannot be fixed by
//! retrying and stop the process with a message that names the fix.

use crate::config::ConfigError;
use crate::pgoutput::DecodeError;
use crate::router::RouteError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RelayError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The database is not set up for outboxd; the message says how to fix it.
    #[error("{0}")]
    Setup(String),
    #[error("postgres: {0}")]
    Postgres(String),
    #[error("replication stream: {0}")]
    Replication(String),
    /// Another process streams from the slot; this instance stands by.
    #[error("replication slot {slot:?} is active for PID {pid}: standing by")]
    SlotBusy { slot: String, pid: String },
    #[error("kafka producer: {0}")]
    Kafka(String),
    /// The server refused to stream from an invalidated slot. Transient: the next session
    /// sees the invalidation in `pg_replication_slots` and applies `source.on_slot_loss`.
    #[error("replication slot invalidated: {0}")]
    SlotInvalidated(String),
    /// The slot lost events and outboxd may not, or cannot, recover them by itself
    /// (`on_slot_loss = "halt"`, rows already gone, nothing bounds the gap). The message names
    /// the gap and the command that recovers it.
    #[error("{0}")]
    SlotLost(String),
    /// The broker did not acknowledge an event. Never skipped: the session restarts from the
    /// last confirmed LSN and produces the same record again.
    #[error("delivery of event {event_id} failed ({code}): {message}")]
    Delivery {
        event_id: String,
        code: String,
        message: String,
    },
    /// A poison event under `on_poison = "halt"`: nothing past it is confirmed; the relay keeps
    /// retrying it (maximum backoff) and reports not-ready until an operator fixes the cause.
    #[error("halted at event {event_id} ({class}): {message} — fix the cause (see docs/operations.md); nothing past it is confirmed")]
    Halted {
        event_id: String,
        class: String,
        message: String,
    },
    #[error("malformed replication message: {0}")]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Route(#[from] RouteError),
}

impl RelayError {
    /// Transient errors restart the session; definite ones stop the relay.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::Postgres(_)
                | Self::Replication(_)
                | Self::SlotBusy { .. }
                | Self::Kafka(_)
                | Self::SlotInvalidated(_)
                | Self::Delivery { .. }
                | Self::Halted { .. }
        )
    }

    /// A bounded label for metrics and logs.
    pub fn class(&self) -> &'static str {
        match self {
            Self::Config(_) => "config",
            Self::Setup(_) => "setup",
            Self::Postgres(_) => "postgres",
            Self::Replication(_) => "replication",
            Self::SlotBusy { .. } => "slot_busy",
            Self::Kafka(_) => "kafka",
            Self::SlotInvalidated(_) => "slot_invalidated",
            Self::SlotLost(_) => "slot_lost",
            Self::Delivery { .. } => "delivery",
            Self::Halted { .. } => "halted",
            Self::Decode(_) => "decode",
            Self::Route(_) => "route",
        }
    }
}

impl From<tokio_postgres::Error> for RelayError {
    fn from(e: tokio_postgres::Error) -> Self {
        // The Display of a tokio-postgres error omits the server message; include it.
        match e.as_db_error() {
            Some(db) => Self::Postgres(format!("{}: {}", db.code().code(), db.message())),
            // Nor the cause of a client-side failure (e.g. which certificate check failed).
            None => {
                let mut msg = e.to_string();
                let mut cause = std::error::Error::source(&e);
                while let Some(c) = cause {
                    msg = format!("{msg}: {c}");
                    cause = c.source();
                }
                Self::Postgres(msg)
            }
        }
    }
}

impl From<pgwire_replication::PgWireError> for RelayError {
    fn from(e: pgwire_replication::PgWireError) -> Self {
        let msg = e.to_string();
        // "replication slot \"x\" is active for PID 123"
        if let Some(i) = msg.find("is active for PID ") {
            let pid: String = msg[i + 18..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            let slot = msg[..i]
                .rsplit_once("replication slot ")
                .map(|(_, s)| s.trim().trim_matches('"').to_string())
                .unwrap_or_default();
            return Self::SlotBusy { slot, pid };
        }
        // 55000 at START_REPLICATION: "can no longer get changes from replication slot",
        // "This slot has been invalidated because ...".
        if msg.contains("can no longer get changes from replication slot")
            || msg.contains("has been invalidated")
        {
            return Self::SlotInvalidated(msg);
        }
        Self::Replication(msg)
    }
}

impl From<rdkafka::error::KafkaError> for RelayError {
    fn from(e: rdkafka::error::KafkaError) -> Self {
        Self::Kafka(e.to_string())
    }
}
