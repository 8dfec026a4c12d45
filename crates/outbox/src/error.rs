//! The one error type of the producer crate.
//!
//! Callers branch on it: a [`OutboxError::VersionConflict`] means "reload the aggregate and
//! re-run the command", an [`OutboxError::EventAlreadyRecorded`] means "this command was
//! committed before (a retry after a lost commit acknowledgement)", everything else is a bug or
//! an infrastructure fault. In every case the caller's transaction must not be committed; with
//! the usual `?` the [`tokio_postgres::Transaction`] is dropped and rolls back.

use tokio_postgres::error::SqlState;
use uuid::Uuid;

/// Why a version conflict was detected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConflictSource {
    /// The conditional update of the aggregate row matched no row (its version moved on, or the
    /// row does not exist).
    ExpectedVersion,
    /// The outbox's `UNIQUE (aggregate_type, aggregate_id, aggregate_version)` rejected the
    /// insert: another command already emitted that version.
    UniqueVersion,
}

/// Errors of the producer library.
#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    /// Optimistic concurrency failed; nothing of this command may be committed (R10, R11).
    #[error(
        "version conflict on {aggregate_type}/{aggregate_id}: expected version {expected} \
         ({source_kind:?})"
    )]
    VersionConflict {
        aggregate_type: String,
        aggregate_id: String,
        /// The version the command was validated against.
        expected: i64,
        source_kind: ConflictSource,
    },

    /// An `event_id` of this command is already in the outbox: the same command was committed
    /// before, so its result exists and the retry must not produce a second one (R4).
    #[error("event id already recorded (the command was committed before): {event_ids:?}")]
    EventAlreadyRecorded { event_ids: Vec<Uuid> },

    /// The serialised payload exceeds the configured limit; large bodies belong in an
    /// immutable reference or a bounded snapshot (R12), not in a Kafka record.
    #[error("payload of {event_type} is {size} bytes, over the limit of {limit} bytes")]
    PayloadTooLarge {
        event_type: String,
        size: usize,
        limit: usize,
    },

    /// The payload value could not be serialised to JSON.
    #[error("payload of {event_type} could not be serialised")]
    Serialize {
        event_type: String,
        #[source]
        source: serde_json::Error,
    },

    /// An argument breaks the record contract (empty type, reserved header, bad identifier...).
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },

    /// Any other database error (connection loss, permissions, ...).
    #[error("database error: {}", .0.as_db_error().map(|d| d.message().to_string()).unwrap_or_else(|| .0.to_string()))]
    Db(#[from] tokio_postgres::Error),
}

impl OutboxError {
    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            what,
            reason: reason.into(),
        }
    }

    /// True for errors where re-running the whole command (reload, validate, write) may succeed.
    pub fn is_retryable_conflict(&self) -> bool {
        matches!(self, Self::VersionConflict { .. })
            || matches!(self, Self::Db(e) if e.code() == Some(&SqlState::T_R_SERIALIZATION_FAILURE)
                || e.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED))
    }
}
