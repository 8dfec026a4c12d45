//! The shipping service of the example pair: consumes `outbox.event.order` through the inbox
//! library, so each event's effect happens exactly once in its own database, in version order.

use outboxd_inbox::{Envelope, Gap, GapResolution, Handler, HandlerError, Ordering};
use std::time::Duration;
use tokio_postgres::Transaction;

pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS shipments (
    order_id text PRIMARY KEY, customer text, status text NOT NULL, updates int NOT NULL DEFAULT 1)";

pub struct Shipping;

impl Handler for Shipping {
    fn name(&self) -> &str {
        "shipping"
    }

    fn ordering(&self) -> Ordering {
        Ordering::PerAggregate {
            hold_for: Duration::from_secs(30),
        }
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        e: &Envelope,
    ) -> Result<serde_json::Value, HandlerError> {
        let p: serde_json::Value =
            serde_json::from_slice(&e.payload).map_err(HandlerError::permanent)?;
        match (e.event_type.as_str(), e.schema_version) {
            ("OrderPlaced", 1) => {
                tx.execute(
                    "INSERT INTO shipments (order_id, customer, status) VALUES ($1, $2, 'awaiting payment')",
                    &[&e.aggregate_id, &p["customer"].as_str()],
                )
                .await
                .map_err(HandlerError::transient)?;
            }
            ("OrderPaid", 1) => {
                tx.execute(
                    "UPDATE shipments SET status = 'ready to ship', updates = updates + 1 WHERE order_id = $1",
                    &[&e.aggregate_id],
                )
                .await
                .map_err(HandlerError::transient)?;
            }
            (t, v) => return Err(HandlerError::permanent(format!("unknown event {t} v{v}"))),
        }
        Ok(serde_json::json!({"order_id": e.aggregate_id, "applied": e.event_type}))
    }

    async fn on_gap_timeout(
        &self,
        _tx: &Transaction<'_>,
        gap: &Gap,
    ) -> Result<GapResolution, HandlerError> {
        // A real service would fetch the order from the orders API here (R22).
        eprintln!(
            "shipping: order {} misses versions after {} (held {:?}); keep holding",
            gap.aggregate_id, gap.current_version, gap.held_versions
        );
        Ok(GapResolution::KeepHolding)
    }
}
