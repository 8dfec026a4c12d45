//! Releases in batches (issue 55): the rows that may be published now, read a batch at a time
//! in stream order — lengths first, values only for the rows within the bounds (issue 53) —
//! and their outcome written back in one transaction.
//!
//! A batch is the first rows (by `id`) that are `blocked`, or `retry` with their audit row, and
//! that no parked head (nor a retry without its audit row) holds. Each names `prev`: the open
//! row right ahead of it in its aggregate that holds it (as the one-at-a-time release read it:
//! for a retry, a parked or retrying row; for a held row, any open one). Because the batch is
//! a prefix in stream order, that row is in the same batch, earlier: the relay publishes a row
//! only after the one it follows was accepted for publication in that batch, so an aggregate's
//! run goes out in version order, pipelined (ordered per partition by the idempotent producer).
//!
//! Every probe is an index probe: the candidates come from `outbox_parked_release_idx` (open
//! releasable rows by id), the holding heads from `outbox_parked_heads_idx`, `prev` from the
//! open index. Delivered and discarded rows are in none, so the store's history costs nothing.

use super::{same_table, ParkedRecord, Release};
use crate::error::RelayError;
use tokio_postgres::Client;

/// Rows and bytes one batch reads at most (a row larger than the byte budget is a batch alone).
/// A batch is vetted, sent and settled within the session's 10 s bound on SQL work
/// (`relay::source::sql_bounded`), on a loaded machine too.
pub const BATCH_ROWS: i64 = 250;
pub const BATCH_BYTES: u64 = 32 << 20;
/// What a stored row may hold besides its record (ids, names, topic, tag): the relay writes a
/// few hundred bytes.
const MAX_META_BYTES: i64 = 64 << 10;

/// SQL: the candidates of a batch, with `prev` and their lengths ($1 slot, $2 rows).
/// `OFFSET 0` keeps the `NOT EXISTS` a correlated probe of `outbox_parked_heads_idx` by
/// aggregate: as an anti join, with the statistics stale after a bulk `retry --all`, the
/// planner scanned every open head per candidate (3,000 retried heads: 17 s per query, the
/// release rate 95 events/s and falling as the store grew).
pub fn candidates_sql() -> String {
    let t = same_table("h", "p");
    let x = same_table("x", "p");
    let len = |c: &str| format!("coalesce(octet_length({c}), 0)::int8");
    format!(
        "SELECT p.id, \
            (SELECT h.id FROM outbox_parked h \
              WHERE h.slot = p.slot AND h.aggregate_type = p.aggregate_type \
                AND h.aggregate_id = p.aggregate_id AND h.id < p.id AND h.blocks_aggregate \
                AND h.state IN ('parked', 'blocked', 'retry') \
                AND (h.state IN ('parked', 'retry') OR p.state = 'blocked') AND {t} \
              ORDER BY h.id DESC LIMIT 1), \
            {key} + {payload} + {headers}, {new}, \
            {eid} + {at} + {ai} + {et} + {topic} + {by} + {tag} \
         FROM outbox_parked p \
         LEFT JOIN outbox_parked_audit a ON p.state = 'retry' AND a.id = p.retry_audit_id \
              AND a.slot = p.slot AND a.event_id = p.event_id AND a.action = 'retry' \
         WHERE p.slot = $1 AND p.state IN ('blocked', 'retry') \
           AND (p.state = 'blocked' OR a.id IS NOT NULL) \
           AND NOT EXISTS (SELECT 1 FROM outbox_parked x \
               WHERE x.slot = p.slot AND x.aggregate_type = p.aggregate_type \
                 AND x.aggregate_id = p.aggregate_id AND x.id < p.id AND x.blocks_aggregate \
                 AND x.state IN ('parked', 'retry') \
                 AND (x.state = 'parked' OR NOT EXISTS (SELECT 1 FROM outbox_parked_audit xa \
                      WHERE xa.id = x.retry_audit_id AND xa.slot = x.slot \
                        AND xa.event_id = x.event_id AND xa.action = 'retry')) \
                 AND {x} OFFSET 0) \
         ORDER BY p.id LIMIT $2",
        key = len("p.record_key"),
        payload = len("p.payload"),
        headers = len("p.headers::text"),
        new = len("a.new_payload"),
        eid = len("p.event_id"),
        at = len("p.aggregate_type"),
        ai = len("p.aggregate_id"),
        et = len("p.event_type"),
        topic = len("p.topic"),
        by = len("p.blocked_by"),
        tag = len("p.integrity_tag"),
    )
}

/// A batch: the rows to vet and publish, each with the row it follows (`prev`), in stream
/// order; and the rows refused unread, over the bounds (`id`, the reason).
#[derive(Default)]
pub struct Batch {
    pub rows: Vec<(Release, Option<i64>)>,
    pub oversized: Vec<(i64, &'static str, String)>,
}

/// The next batch of `slot`: at most [`BATCH_ROWS`] rows and about [`BATCH_BYTES`] bytes, none
/// larger than `max_record_bytes` (record) read at all.
pub async fn next_batch(
    sql: &Client,
    slot: &str,
    max_record_bytes: u64,
) -> Result<Batch, RelayError> {
    let bytes = BATCH_BYTES;
    let found = sql.query(&candidates_sql(), &[&slot, &BATCH_ROWS]).await?;
    let mut batch = Batch::default();
    let (mut take, mut prevs, mut budget) = (Vec::new(), Vec::new(), 0u64);
    let max = i64::try_from(max_record_bytes).unwrap_or(i64::MAX);
    for r in &found {
        let (id, prev): (i64, Option<i64>) = (r.get(0), r.get(1));
        let (record, corrected, meta): (i64, i64, i64) = (r.get(2), r.get(3), r.get(4));
        if record > max || corrected > max || meta > MAX_META_BYTES {
            let message = oversized(record, corrected, meta, max);
            tracing::error!(id, "parked row not read: {message}");
            batch.oversized.push((id, "oversized", message));
            continue;
        }
        let size = (record + corrected + meta) as u64;
        if !take.is_empty() && budget + size > bytes {
            break;
        }
        budget += size;
        take.push(id);
        prevs.push(prev);
    }
    if take.is_empty() {
        return Ok(batch);
    }
    let loaded = load(sql, &take).await?;
    // A row resolved between the two reads (an operator's discard) is not in `loaded`: the rows
    // that follow it then find their `prev` missing and wait for the next batch.
    let mut loaded = loaded.into_iter().peekable();
    for (id, prev) in take.into_iter().zip(prevs) {
        if let Some(r) = loaded.next_if(|r| r.id == id) {
            batch.rows.push((r, prev));
        }
    }
    Ok(batch)
}

fn oversized(record: i64, corrected: i64, meta: i64, max: i64) -> String {
    format!(
        "the stored row holds more than the relay writes (record {record} bytes, corrected \
         payload {corrected}, ids and names {meta}; [parked] max_record_bytes = {max}, at most \
         {MAX_META_BYTES} for the rest): the relay never parks such a row, so it was written \
         outside the relay or under a larger bound. Not read, not published: `outboxd parked \
         discard` it, or raise parked.max_record_bytes if the relay parked it under that bound"
    )
}

/// The rows `ids` as they may be released, in stream order (states checked again).
async fn load(sql: &Client, ids: &[i64]) -> Result<Vec<Release>, RelayError> {
    let rows = sql
        .query(
            "SELECT p.id, p.event_id, p.aggregate_type, p.aggregate_id, p.aggregate_version, \
                    p.event_type, p.topic, p.record_key, coalesce(a.new_payload, p.payload), \
                    p.headers, p.record_ts_ms, p.state = 'retry', a.new_payload IS NOT NULL, \
                    p.payload, p.blocks_aggregate, p.blocked_by, p.integrity_tag, p.source_relid \
             FROM outbox_parked p \
             LEFT JOIN outbox_parked_audit a ON p.state = 'retry' AND a.id = p.retry_audit_id \
                  AND a.slot = p.slot AND a.event_id = p.event_id AND a.action = 'retry' \
             WHERE p.id = ANY($1) AND (p.state = 'blocked' OR (p.state = 'retry' AND a.id IS NOT NULL)) \
             ORDER BY p.id",
            &[&ids],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let headers: Option<serde_json::Value> = r.get(9);
            Release {
                id: r.get(0),
                record: ParkedRecord {
                    event_id: r.get(1),
                    aggregate_type: r.get(2),
                    aggregate_id: r.get(3),
                    aggregate_version: r.get(4),
                    event_type: r.get(5),
                    topic: r.get(6),
                    key: r.get(7),
                    payload: r.get(8),
                    headers: headers
                        .and_then(|h| serde_json::from_value(h).ok())
                        .unwrap_or_default(),
                    timestamp_ms: r.get(10),
                },
                retry: r.get(11),
                corrected: r.get(12),
                parked_payload: r.get(13),
                blocks_aggregate: r.get(14),
                blocked_by: r.get(15),
                tag: r.get(16),
                relid: r.get(17),
                renamed: false,
            }
        })
        .collect())
}

/// A batch's outcome in one transaction: the rows that failed again become parked heads (with
/// their reason), then the delivered ones are marked, in stream order (each after the row it
/// follows, which the table's guard checks), pipelined.
pub async fn finish(
    sql: &Client,
    failed: &[(i64, &str, String)],
    delivered: &[i64],
) -> Result<(), RelayError> {
    if failed.is_empty() && delivered.is_empty() {
        return Ok(());
    }
    sql.batch_execute("BEGIN").await?;
    let written = async {
        for (id, class, message) in failed {
            super::mark_failed(sql, *id, class, message).await?;
        }
        let mark = sql
            .prepare(
                "UPDATE outbox_parked SET state = 'delivered', resolved_at = now(), \
                   last_seen = now() WHERE id = $1",
            )
            .await?;
        // Sent in this order on the one connection, executed in it.
        let params: Vec<[&(dyn tokio_postgres::types::ToSql + Sync); 1]> =
            delivered.iter().map(|id| [id as _]).collect();
        let marks = params.iter().map(|p| sql.execute(&mark, p));
        futures_util::future::try_join_all(marks).await?;
        sql.batch_execute("COMMIT").await?;
        Ok::<_, RelayError>(())
    }
    .await;
    if written.is_err() {
        let _ = sql.batch_execute("ROLLBACK").await;
    }
    written
}

/// The open heads of each of `aggregates` (type, id), one per table (see [`super::Blocked`]).
pub async fn heads_of_many(
    sql: &Client,
    slot: &str,
    aggregates: &[(String, String)],
) -> Result<super::Blocked, RelayError> {
    let (types, ids): (Vec<&str>, Vec<&str>) = aggregates
        .iter()
        .map(|(t, i)| (t.as_str(), i.as_str()))
        .unzip();
    let from = "unnest($2::text[], $3::text[]) AS g(t, i) \
                JOIN outbox_parked p ON p.slot = $1 AND p.aggregate_type = g.t \
                 AND p.aggregate_id = g.i";
    let rows = sql
        .query(&super::heads_sql(from), &[&slot, &types, &ids])
        .await?;
    Ok(super::blocked_from(rows))
}
