//! The SQL the inbox runs, in one place. Every statement is scoped by `consumer`.

use serde_json::Value;
use tokio_postgres::Transaction;
use uuid::Uuid;

use crate::envelope::{Envelope, RecordSource};

/// Locks (creating at version 0 if needed) the aggregate's version row and returns the version.
/// Serialises all consumers of one aggregate for this handler.
pub(crate) async fn lock_version(
    tx: &Transaction<'_>,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<i64, tokio_postgres::Error> {
    let row = tx
        .query_one(
            "INSERT INTO inbox_aggregate_version (consumer, aggregate_type, aggregate_id, version)
             VALUES ($1, $2, $3, 0)
             ON CONFLICT (consumer, aggregate_type, aggregate_id)
             DO UPDATE SET version = inbox_aggregate_version.version
             RETURNING version",
            &[&consumer, &aggregate_type, &aggregate_id],
        )
        .await?;
    Ok(row.get(0))
}

pub(crate) async fn set_version(
    tx: &Transaction<'_>,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    version: i64,
) -> Result<(), tokio_postgres::Error> {
    tx.execute(
        "UPDATE inbox_aggregate_version SET version = $4, updated_at = now()
          WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3",
        &[&consumer, &aggregate_type, &aggregate_id, &version],
    )
    .await?;
    Ok(())
}

/// A processed or held row that matches an event by id or by `(aggregate, version)`.
pub(crate) struct Existing {
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub version: i64,
    pub outcome: String,
    pub result: Option<Value>,
}

impl Existing {
    pub(crate) fn same_identity(&self, env: &Envelope) -> bool {
        self.aggregate_type == env.aggregate_type
            && self.aggregate_id == env.aggregate_id
            && self.version == env.aggregate_version
    }
}

/// Rows of `table` (processed_event or inbox_held_event) matching the event's id or its
/// `(aggregate, version)`; at most two.
pub(crate) async fn find_existing(
    tx: &Transaction<'_>,
    table: &'static str,
    consumer: &str,
    env: &Envelope,
) -> Result<Vec<Existing>, tokio_postgres::Error> {
    let (outcome, result) = if table == "processed_event" {
        ("outcome", "result")
    } else {
        ("'held'::text", "NULL::jsonb")
    };
    let sql = format!(
        "SELECT event_id, aggregate_type, aggregate_id, aggregate_version, {outcome}, {result}
           FROM {table}
          WHERE consumer = $1
            AND (event_id = $2
                 OR (aggregate_type = $3 AND aggregate_id = $4 AND aggregate_version = $5))"
    );
    let rows = tx
        .query(
            &sql,
            &[
                &consumer,
                &env.event_id,
                &env.aggregate_type,
                &env.aggregate_id,
                &env.aggregate_version,
            ],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Existing {
            event_id: r.get(0),
            aggregate_type: r.get(1),
            aggregate_id: r.get(2),
            version: r.get(3),
            outcome: r.get(4),
            result: r.get(5),
        })
        .collect())
}

/// Inserts the dedupe record; `false` when another transaction got there first (the insert
/// waited for it to commit). This insert is the arbiter: only the first inserter acts.
pub(crate) async fn insert_processed(
    tx: &Transaction<'_>,
    consumer: &str,
    env: &Envelope,
    outcome: &str,
) -> Result<bool, tokio_postgres::Error> {
    let (topic, partition, offset) = source_parts(env.source.as_ref());
    let n = tx
        .execute(
            "INSERT INTO processed_event (consumer, event_id, aggregate_type, aggregate_id,
                 aggregate_version, event_type, outcome, source_topic, source_partition,
                 source_offset)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
             ON CONFLICT DO NOTHING",
            &[
                &consumer,
                &env.event_id,
                &env.aggregate_type,
                &env.aggregate_id,
                &env.aggregate_version,
                &env.event_type,
                &outcome,
                &topic,
                &partition,
                &offset,
            ],
        )
        .await?;
    Ok(n == 1)
}

pub(crate) async fn store_result(
    tx: &Transaction<'_>,
    consumer: &str,
    event_id: Uuid,
    result: &Value,
) -> Result<(), tokio_postgres::Error> {
    tx.execute(
        "UPDATE processed_event SET result = $3 WHERE consumer = $1 AND event_id = $2",
        &[&consumer, &event_id, result],
    )
    .await?;
    Ok(())
}

pub(crate) async fn hold(
    tx: &Transaction<'_>,
    consumer: &str,
    env: &Envelope,
) -> Result<(), tokio_postgres::Error> {
    let (topic, partition, offset) = source_parts(env.source.as_ref());
    let headers = serde_json::to_value(&env.headers).expect("string map serialises");
    tx.execute(
        "INSERT INTO inbox_held_event (consumer, event_id, aggregate_type, aggregate_id,
             aggregate_version, event_type, schema_version, payload, headers, committed_at,
             source_topic, source_partition, source_offset)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        &[
            &consumer,
            &env.event_id,
            &env.aggregate_type,
            &env.aggregate_id,
            &env.aggregate_version,
            &env.event_type,
            &env.schema_version,
            &env.payload,
            &headers,
            &env.committed_at,
            &topic,
            &partition,
            &offset,
        ],
    )
    .await?;
    Ok(())
}

const HELD_COLUMNS: &str = "event_id, aggregate_type, aggregate_id, aggregate_version, \
    event_type, schema_version, payload, headers, committed_at, source_topic, \
    source_partition, source_offset";

fn held_row(r: &tokio_postgres::Row) -> Envelope {
    let headers: Value = r.get(7);
    let topic: Option<String> = r.get(9);
    Envelope {
        event_id: r.get(0),
        aggregate_type: r.get(1),
        aggregate_id: r.get(2),
        aggregate_version: r.get(3),
        event_type: r.get(4),
        schema_version: r.get(5),
        payload: r.get(6),
        headers: serde_json::from_value(headers).unwrap_or_default(),
        committed_at: r.get(8),
        source: topic.map(|topic| RecordSource {
            topic,
            partition: r.get::<_, Option<i32>>(10).unwrap_or(-1),
            offset: r.get::<_, Option<i64>>(11).unwrap_or(-1),
        }),
    }
}

/// Removes and returns the held event with exactly `version`, if any.
pub(crate) async fn take_held(
    tx: &Transaction<'_>,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    version: i64,
) -> Result<Option<Envelope>, tokio_postgres::Error> {
    let sql = format!(
        "DELETE FROM inbox_held_event
          WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3
            AND aggregate_version = $4
         RETURNING {HELD_COLUMNS}"
    );
    let row = tx
        .query_opt(&sql, &[&consumer, &aggregate_type, &aggregate_id, &version])
        .await?;
    Ok(row.as_ref().map(held_row))
}

/// Removes held events at or below `version` (covered by a resync) and records them as
/// superseded, so redeliveries of them are duplicates. Returns how many.
pub(crate) async fn supersede_held(
    tx: &Transaction<'_>,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    version: i64,
) -> Result<u64, tokio_postgres::Error> {
    let sql = format!(
        "DELETE FROM inbox_held_event
          WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3
            AND aggregate_version <= $4
         RETURNING {HELD_COLUMNS}"
    );
    let rows = tx
        .query(&sql, &[&consumer, &aggregate_type, &aggregate_id, &version])
        .await?;
    for r in &rows {
        insert_processed(tx, consumer, &held_row(r), "superseded").await?;
    }
    Ok(rows.len() as u64)
}

fn source_parts(s: Option<&RecordSource>) -> (Option<&str>, Option<i32>, Option<i64>) {
    match s {
        Some(s) => (Some(s.topic.as_str()), Some(s.partition), Some(s.offset)),
        None => (None, None, None),
    }
}
