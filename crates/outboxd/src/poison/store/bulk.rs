//! Bulk repairs (`outboxd parked retry|discard --aggregate|--type|--table|--all`, issue 40):
//! one operator decision for many parked events. Each event still gets its own audit row
//! (the table's guard lets a transaction change only the rows it audited), and the whole set
//! is one transaction, so the running relay sees all of it or none of it: a bulk discard of an
//! aggregate never releases a follower of a head it discarded a moment before the follower.

use crate::error::RelayError;
use tokio_postgres::Client;

/// Which open events a bulk command takes (all given filters apply).
#[derive(Debug, Default, Clone)]
pub struct Selection {
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    /// `schema.table`: the `source_table` header of the record; `table_untagged`: rows of no
    /// header match too (a one-table relay's rows, when the table is that relay's).
    pub table: Option<String>,
    pub table_untagged: bool,
}

/// One selected event, in stream order.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub event_id: String,
    pub state: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<i64>,
    pub event_type: Option<String>,
    pub error_class: String,
    /// The row carries an integrity tag (whether it is valid only the relay can tell).
    pub tagged: bool,
    pub has_payload: bool,
    /// Events held (`blocked`) behind it: released after it, in order, by the relay.
    pub held: i64,
    pub table: Option<String>,
}

/// The open events of `slot` in `states` that `sel` selects, in stream order.
pub async fn select(
    sql: &Client,
    slot: &str,
    sel: &Selection,
    states: &[&str],
) -> Result<Vec<Candidate>, RelayError> {
    let t = super::current_table_of("p");
    let states: Vec<String> = states.iter().map(|s| s.to_string()).collect();
    let rows = sql
        .query(
            &format!(
                "SELECT p.event_id, p.state, p.aggregate_type, p.aggregate_id, p.aggregate_version, \
                        p.event_type, p.error_class, p.integrity_tag IS NOT NULL, \
                        p.payload IS NOT NULL, coalesce(b.n, 0), {t} \
                 FROM outbox_parked p \
                 LEFT JOIN (SELECT blocked_by, count(*) AS n FROM outbox_parked \
                            WHERE slot = $1 AND state = 'blocked' GROUP BY 1) b \
                        ON b.blocked_by = p.event_id \
                 WHERE p.slot = $1 AND p.state = ANY($2) \
                   AND ($3::text IS NULL OR p.aggregate_id = $3) \
                   AND ($4::text IS NULL OR p.event_type = $4) \
                   AND ($5::text IS NULL OR {t} = $5 OR ($6 AND {t} IS NULL)) \
                 ORDER BY p.id"
            ),
            &[
                &slot,
                &states,
                &sel.aggregate_id,
                &sel.event_type,
                &sel.table,
                &sel.table_untagged,
            ],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Candidate {
            event_id: r.get(0),
            state: r.get(1),
            aggregate_type: r.get(2),
            aggregate_id: r.get(3),
            aggregate_version: r.get(4),
            event_type: r.get(5),
            error_class: r.get(6),
            tagged: r.get(7),
            has_payload: r.get(8),
            held: r.get(9),
            table: r.get(10),
        })
        .collect())
}

/// Who decides, and why: one audit row per event, all with this operator and reason.
pub struct Decision<'a> {
    pub slot: &'a str,
    pub operator: &'a str,
    pub reason: &'a str,
}

/// Writes one audit row of `action` per event and returns (audit id, event_id) pairs.
async fn audit(
    tx: &tokio_postgres::Transaction<'_>,
    d: &Decision<'_>,
    action: &str,
    ids: &[String],
) -> Result<(Vec<i64>, Vec<String>), RelayError> {
    let rows = tx
        .query(
            "INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason) \
             SELECT $1, e, $2, $3, $4 FROM unnest($5::text[]) AS e RETURNING id, event_id",
            &[&d.slot, &action, &d.operator, &d.reason, &ids],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1)))
        .unzip())
}

/// The events held behind the heads `ids` that the decision releases (those not decided
/// themselves): an audit row each, as `parked retry|discard` of one head writes them
/// (`operator::audit_followers`), so every released event names who released it and why.
pub(super) async fn audit_followers(
    tx: &tokio_postgres::Transaction<'_>,
    d: &Decision<'_>,
    decision: &str,
    ids: &[String],
) -> Result<u64, RelayError> {
    Ok(tx
        .execute(
            "INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason) \
             SELECT slot, event_id, 'retry', $3, \
                    'held behind ' || blocked_by || ', released by its ' || $4 || ': ' || $5 \
             FROM outbox_parked WHERE slot = $1 AND blocked_by = ANY($2) \
               AND state = 'blocked' AND NOT event_id = ANY($2) ORDER BY id",
            &[&d.slot, &ids, &d.operator, &decision, &d.reason],
        )
        .await?)
}

/// Those of `ids` still in one of `states`, locked, in stream order (one resolved meanwhile
/// is left out).
async fn lock_open(
    tx: &tokio_postgres::Transaction<'_>,
    slot: &str,
    ids: &[String],
    states: &[&str],
) -> Result<Vec<String>, RelayError> {
    Ok(tx
        .query(
            "SELECT event_id FROM outbox_parked WHERE slot = $1 AND event_id = ANY($2) \
               AND state = ANY($3) ORDER BY id FOR UPDATE",
            &[&slot, &ids, &states],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Marks the parked events `ids` for retry (as parked: unchanged payloads), each with its own
/// audit row, in one transaction. Returns how many were marked (one gone meanwhile is not).
pub async fn request_retries(
    sql: &mut Client,
    d: &Decision<'_>,
    ids: &[String],
) -> Result<u64, RelayError> {
    let tx = sql.transaction().await?;
    let open = lock_open(&tx, d.slot, ids, &["parked"]).await?;
    let (audit_ids, events) = audit(&tx, d, "retry", &open).await?;
    audit_followers(&tx, d, "retry", &open).await?;
    let n = tx
        .execute(
            "UPDATE outbox_parked p SET state = 'retry', last_seen = now(), retry_audit_id = a.id \
             FROM unnest($2::int8[], $3::text[]) AS a(id, event_id) \
             WHERE p.slot = $1 AND p.event_id = a.event_id",
            &[&d.slot, &audit_ids, &events],
        )
        .await?;
    tx.commit().await?;
    Ok(n)
}

/// Discards the open events `ids` (parked, retrying or held), each with its own audit row, in
/// one transaction. Returns how many were discarded.
pub async fn discard_all(
    sql: &mut Client,
    d: &Decision<'_>,
    ids: &[String],
) -> Result<u64, RelayError> {
    let tx = sql.transaction().await?;
    let open = lock_open(&tx, d.slot, ids, &["parked", "retry", "blocked"]).await?;
    audit(&tx, d, "discard", &open).await?;
    audit_followers(&tx, d, "discard", &open).await?;
    let n = tx
        .execute(
            "UPDATE outbox_parked SET state = 'discarded', resolved_at = now(), retry_audit_id = NULL \
             WHERE slot = $1 AND event_id = ANY($2)",
            &[&d.slot, &open],
        )
        .await?;
    tx.commit().await?;
    Ok(n)
}

/// Of the open events of `aggregates` (type, id): how many the relay may still release
/// (`retry` or `blocked`), and how many are parked heads waiting for an operator.
pub async fn pending_in(
    sql: &Client,
    slot: &str,
    aggregates: &[(String, String)],
) -> Result<(i64, i64), RelayError> {
    let (types, ids): (Vec<&str>, Vec<&str>) = aggregates
        .iter()
        .map(|(t, i)| (t.as_str(), i.as_str()))
        .unzip();
    let r = sql
        .query_one(
            "SELECT count(*) FILTER (WHERE p.state IN ('retry', 'blocked')), \
                    count(*) FILTER (WHERE p.state = 'parked') \
             FROM outbox_parked p JOIN unnest($2::text[], $3::text[]) AS a(t, i) \
               ON p.aggregate_type = a.t AND p.aggregate_id = a.i \
             WHERE p.slot = $1 AND p.state IN ('parked', 'retry', 'blocked')",
            &[&slot, &types, &ids],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}
