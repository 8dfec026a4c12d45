//! Consumer side of the outbox protocol: an idempotent inbox. Delivery is at-least-once (R2),
//! so every consumer records `processed_event(event_id)` in its own database, in the same
//! transaction as its business change; only the first inserter acts, and the Kafka offset is
//! committed only after that transaction (R18, R20).
//!
//! # Layout
//! - [`envelope`]: [`Envelope`] parsed from a relay record (headers `event_id`, `event_type`,
//!   `aggregate_type`, `aggregate_id`, `aggregate_version`, `schema_version`); a missing
//!   `event_id` is [`EnvelopeError::MissingHeader`], never skipped.
//! - [`handler`]: the [`Handler`] trait and its explicit version policy [`Ordering`]
//!   (duplicate / next version / gap, R22), [`Gap`], [`GapResolution`].
//! - [`inbox`]: [`Inbox::process`] — dedupe, conflict detection, hold on gaps, stale events,
//!   release of held events in order; [`Outcome`].
//! - [`gaps`]: [`Inbox::sweep`] / [`Inbox::sweep_at`] — gap timeouts (alert + source-of-truth
//!   hook) and repair of unreleased held events.
//! - [`consumer`]: [`InboxConsumer`], the rdkafka loop (process, then commit the offset).
//! - [`ledger`]: [`Ledger`], side effects keyed by `event_id` + effect, pending / done /
//!   unknown (R19).
//! - [`retention`]: [`RetentionPolicy::prune`], which refuses to prune below the broker
//!   redelivery and disaster-recovery windows (R21, R39).
//! - [`metrics`]: metric names (bounded labels only).
//! - [`error`]: [`InboxError`], [`HandlerError`], [`ConflictKind`].
//! - `db`: the SQL; [`SCHEMA_SQL`] / [`migrate`]: `sql/020_inbox.sql`.

mod cloudevent;
pub mod consumer;
mod db;
pub mod envelope;
pub mod error;
pub mod gaps;
pub mod handler;
pub mod inbox;
pub mod ledger;
pub mod metrics;
pub mod retention;
pub mod trace;

pub use consumer::{consumer_config, ConsumerSettings, InboxConsumer, OffsetCommit, RunStats};
pub use envelope::{Envelope, EnvelopeError, RecordSource};
pub use error::{ConflictKind, HandlerError, InboxError};
pub use gaps::SweepReport;
pub use handler::{Gap, GapResolution, Handler, Ordering};
pub use inbox::{Inbox, Outcome};
pub use ledger::{
    operation_key, Claim, EffectError, EffectOutcome, Ledger, PendingEffect, Resolution,
};
pub use retention::RetentionPolicy;
pub use trace::{trace_context, TraceContext};

/// `sql/020_inbox.sql`: the inbox tables for the consumer's database. Idempotent.
pub const SCHEMA_SQL: &str = include_str!("../../../sql/020_inbox.sql");

/// Creates the inbox tables in the consumer database (idempotent).
pub async fn migrate(client: &impl tokio_postgres::GenericClient) -> Result<(), InboxError> {
    client.batch_execute(SCHEMA_SQL).await?;
    Ok(())
}
