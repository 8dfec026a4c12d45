//! Outbox rows written the way an application writes them: in real transactions.

use anyhow::Result;

/// An event as the tests write it.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub event_id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub version: i64,
    pub event_type: String,
    pub payload: serde_json::Value,
}

impl NewEvent {
    /// An event with a fresh UUIDv7 `event_id`.
    pub fn new(
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
        event_type: &str,
        payload: serde_json::Value,
    ) -> Self {
        Self {
            event_id: uuid::Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            version,
            event_type: event_type.into(),
            payload,
        }
    }
}

/// Inserts `events` into the outbox in one transaction; commits unless `rollback`.
pub async fn write_events(
    c: &mut tokio_postgres::Client,
    events: &[NewEvent],
    rollback: bool,
) -> Result<()> {
    let tx = c.transaction().await?;
    insert_events(&tx, events).await?;
    if rollback {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(())
}

/// Writes `events` in one committed transaction and returns `pg_current_wal_insert_lsn()` read
/// inside it, after the inserts and before the commit. The commit record starts at or after
/// this position, so a slot confirmed at or below it has not passed the transaction (an idle
/// relay may confirm exactly this position: the walsender had read up to it when it reported).
pub async fn write_events_returning_lsn(
    c: &mut tokio_postgres::Client,
    events: &[NewEvent],
) -> Result<u64> {
    let tx = c.transaction().await?;
    insert_events(&tx, events).await?;
    let lsn: i64 = tx
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::int8", &[])
        .await?
        .get(0);
    tx.commit().await?;
    Ok(lsn as u64)
}

pub async fn insert_events(
    tx: &tokio_postgres::Transaction<'_>,
    events: &[NewEvent],
) -> Result<()> {
    let stmt = tx
        .prepare(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .await?;
    for e in events {
        tx.execute(
            &stmt,
            &[
                &e.event_id,
                &e.aggregate_type,
                &e.aggregate_id,
                &e.version,
                &e.event_type,
                &e.payload,
            ],
        )
        .await?;
    }
    Ok(())
}
