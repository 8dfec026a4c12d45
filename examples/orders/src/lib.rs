//! The orders service of the example pair: every command changes the `orders` row and appends
//! its event to the outbox in ONE transaction (R1), with an optimistic version check (R10) —
//! no broker call anywhere in here.

use outboxd_outbox::{AggregateRef, NewEvent, Outbox, OutboxError, VersionGuard};
use serde_json::json;
use tokio_postgres::Client;
use uuid::Uuid;

pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS orders (
    id text PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL,
    status text NOT NULL, version bigint NOT NULL)";

/// PlaceOrder: creates the order at version 1 and emits `OrderPlaced`. `event_id` is fixed when
/// the command is first handled, so a retried command reuses it (R4); a retry of a command that
/// already committed changes nothing and returns the same `event_id`.
pub async fn place_order(
    db: &mut Client,
    event_id: Uuid,
    id: &str,
    customer: &str,
    total_cents: i64,
) -> Result<Uuid, OutboxError> {
    let tx = db.transaction().await?;
    let inserted = tx
        .execute(
            "INSERT INTO orders (id, customer, total_cents, status, version) \
             VALUES ($1, $2, $3, 'placed', 1) ON CONFLICT (id) DO NOTHING",
            &[&id, &customer, &total_cents],
        )
        .await?;
    if inserted == 0 {
        // Already placed: a retry. The outbox tells whether it was this very command.
        let same: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE event_id = $1)",
                &[&event_id],
            )
            .await?
            .get(0);
        return if same {
            Ok(event_id)
        } else {
            Err(OutboxError::Invalid {
                what: "id",
                reason: format!("order {id} already exists"),
            })
        };
    }
    // The payload is built from the values being committed (R8), not re-read afterwards.
    let event = NewEvent::new(
        "OrderPlaced",
        1,
        &json!({"order_id": id, "customer": customer, "total_cents": total_cents}),
    )?
    .with_event_id(event_id);
    let agg = AggregateRef::new("order", id)?;
    let appended = Outbox::new().append(&tx, &agg, 0, &[event]).await?;
    tx.commit().await?;
    Ok(appended[0].event_id)
}

/// PayOrder: moves the order from `expected_version` to the next and emits `OrderPaid`; a stale
/// `expected_version` is a typed conflict and nothing is committed.
pub async fn pay_order(
    db: &mut Client,
    id: &str,
    expected_version: i64,
) -> Result<Uuid, OutboxError> {
    let tx = db.transaction().await?;
    let agg = AggregateRef::new("order", id)?;
    VersionGuard::new("orders", "id", "version")?
        .advance(&tx, &agg, &id, expected_version, expected_version + 1)
        .await?;
    tx.execute("UPDATE orders SET status = 'paid' WHERE id = $1", &[&id])
        .await?;
    let event = NewEvent::new("OrderPaid", 1, &json!({"order_id": id}))?;
    let appended = Outbox::new()
        .append(&tx, &agg, expected_version, &[event])
        .await?;
    tx.commit().await?;
    Ok(appended[0].event_id)
}
