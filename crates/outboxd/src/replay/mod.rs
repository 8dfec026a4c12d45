//! Replay (R38): republish chosen outbox rows — exact `event_id`s, or a time range narrowed by
//! event type, aggregate type and aggregate id — with their original `event_id`s and the same
//! record bytes as the live stream, after a consumer lost or mishandled them.
//!
//! - `select`: what a replay selects (stored as JSON in the audit row), its SQL filter, and the
//!   dry run's summary (counts per event type and topic, time span, ids not found);
//! - `consumers`: who receives a replay — per target topic, the consumer groups with committed
//!   offsets on it and their lag, asked of the broker (bounded; never fails a command);
//! - `install`: the audit table, the approval policy (`outboxd_replay_policy`, the admin's) and
//!   the guard that enforces both, installed by `outboxd init` and only checked by `replay`;
//! - `store`: the audit table `outboxd_replay` (its rows' SQL): request, approval by another
//!   database role, runs, the resume cursor, the result;
//! - `run`: one run of an approved replay through [`crate::relay::table_reader`] and the live
//!   path's stages, rate-capped (`pace`), with progress (`progress`), resumable at its cursor.
//!
//! Consumers see duplicates of events they already have; their inbox absorbs them by
//! `event_id` (docs/inbox.md).

pub(crate) mod consumers;
pub(crate) mod install;
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
    /// The audit table, the policy table or this version's guard is missing: `outboxd replay`
    /// never creates them (their creator would own them, and an owner can disable the guard).
    #[error(
        "outboxd_replay is missing (or predates the approval policy): run `outboxd init` as the \
         admin role (see sql/roles.sql)"
    )]
    NotInstalled,
    /// The guard trigger is disabled (only the table's owner or a superuser can do that).
    #[error(
        "the trigger outboxd_replay_guard on outboxd_replay is disabled, so nothing enforces the \
         two-person rule: ask the admin to enable it (ALTER TABLE outboxd_replay ENABLE TRIGGER \
         outboxd_replay_guard) and to review the rows changed meanwhile"
    )]
    GuardDisabled,
    /// No approval policy for this relay's slot in `outboxd_replay_policy`.
    #[error(
        "no replay policy for slot {0} (outboxd_replay_policy): run `outboxd init` as the admin \
         role with this relay's config"
    )]
    NoPolicy(String),
    /// The stored selection holds more events than were requested (rows written or back-dated
    /// into it since): what was approved is not what would run.
    #[error(
        "replay {id}: the selection holds {now} events now, {requested} were requested: request \
         a new replay"
    )]
    Grown { id: i64, now: i64, requested: i64 },
    /// More events acknowledged over all runs than were requested: the cursor was moved back
    /// by hand, or rows were written into the selection while it ran.
    #[error(
        "replay {id}: {sent} events acknowledged over its runs, more than the {events} \
         requested (its cursor was moved back, or rows were written into its selection): \
         request a new replay"
    )]
    Overrun { id: i64, sent: i64, events: i64 },
    /// Counted again, the selection needs an approval (by the database's policy) that the
    /// replay does not have.
    #[error(
        "replay {id} needs an approval ({why}) by the database's replay policy and has none: \
         request a new replay (`outboxd replay request`) and have another role approve it"
    )]
    Unapproved { id: i64, why: String },
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
