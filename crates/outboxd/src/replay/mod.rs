//! Replay (R38): republish chosen outbox rows — exact `event_id`s, or a time range narrowed by
//! event type, aggregate type and aggregate id — with their original `event_id`s and the same
//! record bytes as the live stream, after a consumer lost or mishandled them.
//!
//! - `select`: what a replay selects (stored as JSON in the audit row), its SQL filter, and the
//!   dry run's summary (counts per event type and topic, time span, ids not found);
//! - `consumers`: who receives a replay — per target topic, the consumer groups with committed
//!   offsets on it and their lag, asked of the broker (bounded; never fails a command);
//! - `store`: the audit table `outboxd_replay` (all its SQL): request, approval by another
//!   database role, runs, the resume cursor, the result;
//! - `run`: one run of an approved replay through [`crate::relay::table_reader`] and the live
//!   path's stages, rate-capped (`pace`), with progress (`progress`), resumable at its cursor.
//!
//! Consumers see duplicates of events they already have; their inbox absorbs them by
//! `event_id` (docs/inbox.md).

pub(crate) mod consumers;
pub(crate) mod pace;
pub(crate) mod progress;
pub(crate) mod run;
pub(crate) mod select;
pub(crate) mod store;

use crate::error::RelayError;
use thiserror::Error;

/// What a replay command can fail with; callers (and tests) branch on the variant.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// The selection on the command line is incomplete or contradictory.
    #[error("{0}")]
    Selection(String),
    /// Too large or side-effecting to run without a second person.
    #[error(
        "this replay needs an approval ({why}): request it with `outboxd replay request … \
         --reason R` (same selection), have another database role run `outboxd replay approve \
         ID`, then run it with `outboxd replay run ID`"
    )]
    NeedsApproval { why: String },
    /// The role that requested a replay tried to approve it.
    #[error(
        "replay {id} was requested by database role {requested_by}: another role must approve \
         it (connect as that role: --dsn or OUTBOXD_REPLAY_DSN)"
    )]
    SameRole { id: i64, requested_by: String },
    #[error("no replay {0} for this slot (see `outboxd replay list`)")]
    NotFound(i64),
    /// The replay is not in a state that allows the command.
    #[error("replay {id} is {state}: {hint}")]
    State {
        id: i64,
        state: String,
        hint: &'static str,
    },
    /// Another process runs it (holds its lock).
    #[error("replay {0} is being run by another process: wait for it to end (or stop it), then run it again to continue")]
    Busy(i64),
    /// An event the live path would park (too large, schema-invalid, unroutable): replay parks
    /// nothing, so it stops before it.
    #[error(
        "event {event_id} cannot be republished ({class}): {message}. Nothing was parked; the \
         replay stopped before it (its cursor is before it): fix the cause or narrow the selection"
    )]
    Refused {
        event_id: String,
        class: String,
        message: String,
    },
    /// The audit table's guard refused a change (e.g. an approval by the requesting role).
    #[error("{0}")]
    Denied(String),
    #[error(transparent)]
    Relay(RelayError),
}

impl From<RelayError> for ReplayError {
    fn from(e: RelayError) -> Self {
        match e {
            RelayError::Halted {
                event_id,
                class,
                message,
            } => Self::Refused {
                event_id,
                class,
                message,
            },
            e => Self::Relay(e),
        }
    }
}

impl From<tokio_postgres::Error> for ReplayError {
    fn from(e: tokio_postgres::Error) -> Self {
        use tokio_postgres::error::SqlState;
        match e.as_db_error() {
            Some(db) if db.code() == &SqlState::RAISE_EXCEPTION => {
                Self::Denied(db.message().to_string())
            }
            Some(db) if db.code() == &SqlState::INSUFFICIENT_PRIVILEGE => {
                Self::Relay(RelayError::Setup(format!(
                    "{}: {} — a replay's role needs what sql/roles.sql grants outboxd_replay \
                     (SELECT on the outbox table; SELECT, INSERT, UPDATE on outboxd_replay)",
                    db.code().code(),
                    db.message()
                )))
            }
            _ => Self::Relay(e.into()),
        }
    }
}
