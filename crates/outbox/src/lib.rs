//! Producer side of the outbox protocol: append integration events to the outbox table inside
//! the caller's own Postgres transaction, so the business change and its event commit together
//! or not at all (R1, R10). outboxd then streams committed rows from the WAL to Kafka.
//!
//! # Layout
//! - [`event`]: [`AggregateRef`], [`NewEvent`] (payload serialised from in-memory values, R8;
//!   explicit `schema_version`, R7; client-side UUIDv7 [`new_event_id`], R4).
//! - [`writer`]: [`Outbox`] — `append(&tx, aggregate, expected_version, &events)` inserts rows
//!   with consecutive versions in one statement; configurable table and payload limit.
//! - [`guard`]: [`VersionGuard`] / [`expect_one_row`] — optimistic concurrency on the business
//!   row (conditional update on the expected version).
//! - [`error`]: [`OutboxError`], what callers branch on (version conflict, already recorded,
//!   payload too large, invalid, database).
//! - [`EMIT_FUNCTION_SQL`]: `sql/010_outbox_emit.sql`, the `outbox_emit(...)` SQL function for
//!   other languages and ORMs.
//!
//! # A command
//! ```no_run
//! # async fn demo(client: &mut tokio_postgres::Client) -> Result<(), outboxd_outbox::OutboxError> {
//! use outboxd_outbox::{AggregateRef, NewEvent, Outbox, VersionGuard};
//! let outbox = Outbox::new();
//! let orders = VersionGuard::new("public.orders", "id", "version")?;
//! let (order_id, read_version) = ("o-1".to_string(), 3_i64); // loaded and validated before
//! let stored_event_id = outboxd_outbox::new_event_id(); // kept with the command for retries
//!
//! let tx = client.transaction().await?;
//! let agg = AggregateRef::new("order", &order_id)?;
//! orders.advance(&tx, &agg, &order_id, read_version, read_version + 1).await?;
//! tx.execute("UPDATE orders SET status = 'paid' WHERE id = $1", &[&order_id]).await?;
//! let paid = serde_json::json!({ "order_id": order_id, "status": "paid" });
//! let event = NewEvent::new("OrderPaid", 1, &paid)?.with_event_id(stored_event_id);
//! outbox.append(&tx, &agg, read_version, &[event]).await?;
//! tx.commit().await?; // never call the broker here: outboxd does that from the WAL
//! # Ok(()) }
//! ```

pub mod error;
pub mod event;
pub mod guard;
mod ident;
pub mod writer;

pub use error::{ConflictSource, OutboxError};
pub use event::{new_event_id, AggregateRef, NewEvent, RESERVED_HEADERS};
pub use guard::{expect_one_row, VersionGuard};
pub use writer::{AppendedEvent, Outbox, DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_TABLE};

/// `sql/010_outbox_emit.sql`: defines `public.outbox_emit(...)` and `public.outbox_uuid_v7()`
/// on the default `public.outbox` table. Idempotent.
pub const EMIT_FUNCTION_SQL: &str = include_str!("../../../sql/010_outbox_emit.sql");

/// Installs [`EMIT_FUNCTION_SQL`] (for migrations run from Rust and for tests).
pub async fn install_emit_function(
    client: &impl tokio_postgres::GenericClient,
) -> Result<(), OutboxError> {
    client.batch_execute(EMIT_FUNCTION_SQL).await?;
    Ok(())
}
