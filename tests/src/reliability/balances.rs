//! The consumer's business in the reliability tests: account balances kept by an
//! [`outboxd_inbox`] handler, in tables with no unique key of their own.

use anyhow::Result;
use outboxd_inbox::{Envelope, Gap, GapResolution, Handler, HandlerError};
use std::time::Duration;

/// The consumer's business: account balances. `movement` deliberately has no unique key,
/// so a second application of an event would show up as a second row.
pub const BUSINESS_SQL: &str = "
    CREATE TABLE account (id text PRIMARY KEY, balance bigint NOT NULL,
                          version bigint NOT NULL, applied int NOT NULL);
    CREATE TABLE movement (seq bigserial PRIMARY KEY, event_id uuid NOT NULL,
                           account text NOT NULL, version bigint NOT NULL,
                           amount bigint NOT NULL);";

/// The handler: adds `payload.amount` to the account's balance. Ordered per aggregate; it
/// also checks itself that it only ever sees the next version.
pub struct Balances;

impl Handler for Balances {
    fn name(&self) -> &str {
        "balances"
    }

    fn ordering(&self) -> outboxd_inbox::Ordering {
        outboxd_inbox::Ordering::PerAggregate {
            hold_for: Duration::from_secs(3600),
        }
    }

    async fn apply(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        e: &Envelope,
    ) -> std::result::Result<serde_json::Value, HandlerError> {
        let body: serde_json::Value = e.payload_as()?;
        let amount = body["amount"]
            .as_i64()
            .ok_or_else(|| HandlerError::permanent("payload without amount"))?;
        let prev: i64 = tx
            .query_opt(
                "SELECT version FROM account WHERE id = $1 FOR UPDATE",
                &[&e.aggregate_id],
            )
            .await?
            .map(|r| r.get(0))
            .unwrap_or(0);
        if e.aggregate_version != prev + 1 {
            return Err(HandlerError::permanent(format!(
                "{} version {} applied after {prev}",
                e.aggregate_id, e.aggregate_version
            )));
        }
        let row = tx
            .query_one(
                "INSERT INTO account (id, balance, version, applied) VALUES ($1, $2, $3, 1)
                 ON CONFLICT (id) DO UPDATE SET balance = account.balance + $2,
                    version = $3, applied = account.applied + 1
                 RETURNING balance",
                &[&e.aggregate_id, &amount, &e.aggregate_version],
            )
            .await?;
        tx.execute(
            "INSERT INTO movement (event_id, account, version, amount) VALUES ($1, $2, $3, $4)",
            &[&e.event_id, &e.aggregate_id, &e.aggregate_version, &amount],
        )
        .await?;
        Ok(serde_json::json!({"balance": row.get::<_, i64>(0)}))
    }

    async fn on_gap_timeout(
        &self,
        _tx: &tokio_postgres::Transaction<'_>,
        _gap: &Gap,
    ) -> std::result::Result<GapResolution, HandlerError> {
        Ok(GapResolution::KeepHolding)
    }
}

/// Creates the consumer database (inbox tables + business tables); returns its name.
pub async fn consumer_db(pg: &outboxd_testkit::Postgres, name: &str) -> Result<String> {
    let db = pg.create_database(name).await?;
    let c = pg.connect(&db).await?;
    outboxd_inbox::migrate(&c).await?;
    c.batch_execute(BUSINESS_SQL).await?;
    Ok(db)
}
