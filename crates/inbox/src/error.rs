//! Errors of the consumer library, and the error a handler returns.

use std::time::Duration;

use tokio_postgres::error::SqlState;
use uuid::Uuid;

use crate::envelope::{EnvelopeError, RecordSource};

/// Why two events are in conflict (as opposed to one being a duplicate of the other).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConflictKind {
    /// Another event id already holds this `(aggregate, version)`: the producer emitted two
    /// different events for one version, or two producers share an aggregate id.
    VersionTaken { existing_event_id: Uuid },
    /// This event id was already recorded for a *different* aggregate or version: an event id
    /// was reused for different content (R28: repairs must keep ids, copies must not reuse them).
    EventIdReused {
        recorded_aggregate_id: String,
        recorded_version: i64,
    },
}

/// What a handler returns when it cannot apply an event.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Worth retrying the same event (a lock timeout, an unavailable dependency).
    #[error("transient handler failure: {0}")]
    Transient(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Retrying cannot help (a payload this handler cannot understand): the consumer stops and
    /// an operator repairs (R16, R28).
    #[error("permanent handler failure: {0}")]
    Permanent(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl HandlerError {
    pub fn transient(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Transient(e.into())
    }

    pub fn permanent(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Permanent(e.into())
    }
}

impl From<tokio_postgres::Error> for HandlerError {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::Transient(Box::new(e))
    }
}

impl From<serde_json::Error> for HandlerError {
    fn from(e: serde_json::Error) -> Self {
        Self::Permanent(Box::new(e))
    }
}

/// Errors of the consumer library.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    /// A real conflict: never absorbed, always alerted (`inbox_conflicts_total`). Nothing was
    /// committed for the event and its offset is not committed.
    #[error(
        "conflict on {aggregate_type}/{aggregate_id} version {version} (event {event_id}): \
         {kind:?}"
    )]
    Conflict {
        event_id: Uuid,
        aggregate_type: String,
        aggregate_id: String,
        version: i64,
        kind: ConflictKind,
    },

    /// A record that breaks the wire contract; the consumer stops rather than skip it.
    #[error("malformed record at {source_at:?}")]
    Malformed {
        source_at: Option<RecordSource>,
        #[source]
        source: EnvelopeError,
    },

    /// The handler failed; its transaction (and the `processed_event` row) rolled back.
    #[error("handler {consumer} failed on event {event_id}")]
    Handler {
        consumer: String,
        event_id: Uuid,
        #[source]
        source: HandlerError,
    },

    /// A gap hook claimed a resync to a version older than the state already applied.
    #[error(
        "resync of {aggregate_type}/{aggregate_id} to version {to} would go back from {current}"
    )]
    ResyncBackwards {
        aggregate_type: String,
        aggregate_id: String,
        current: i64,
        to: i64,
    },

    /// Pruning would drop dedupe records that a redelivery or a disaster recovery may still need.
    #[error("retention {requested:?} is below the configured minimum {minimum:?} (R21, R39)")]
    RetentionTooShort {
        requested: Duration,
        minimum: Duration,
    },

    /// The side-effect ledger has no row for this operation key.
    #[error("no side-effect ledger entry for operation key {0}")]
    UnknownOperation(String),

    #[error("database error")]
    Db(#[from] tokio_postgres::Error),

    #[error("kafka error")]
    Kafka(#[from] rdkafka::error::KafkaError),
}

impl InboxError {
    /// Errors a consumer loop may retry in place with backoff (same record, nothing committed).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Db(e) => is_transient_db(e),
            Self::Handler {
                source: HandlerError::Transient(_),
                ..
            } => true,
            _ => false,
        }
    }
}

pub(crate) fn is_transient_db(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        Some(c) => {
            c == &SqlState::T_R_SERIALIZATION_FAILURE
                || c == &SqlState::T_R_DEADLOCK_DETECTED
                || c == &SqlState::LOCK_NOT_AVAILABLE
                || c == &SqlState::QUERY_CANCELED
        }
        // No SQLSTATE: I/O or protocol trouble; a closed connection stays closed, though, and
        // the loop's retry budget ends that.
        None => !e.is_closed(),
    }
}
