//! The operator's side of `outbox_parked` (`outboxd parked …`): list and show parked events
//! with their audit trail, and request a retry or a discard — each change in one transaction
//! with its audit row. The running relay picks the requests up (see the parent module).

use crate::error::RelayError;
use tokio_postgres::Client;

/// What is read of an `error_message` (issue 53): the relay writes a line; a row written
/// through SQL may hold hundreds of MB, which the status page must not load every few seconds.
pub const MESSAGE_CHARS: i32 = 4096;

/// One row of `outboxd parked list`.
pub struct Listed {
    pub event_id: String,
    pub state: String,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_version: Option<i64>,
    pub error_class: String,
    pub attempts: i32,
    pub first_seen: String,
    pub error_message: String,
    /// The outbox table its record names (`source_table`; none from a one-table relay), under
    /// its current name when its oid says it was renamed or moved since.
    pub table: Option<String>,
}

/// Open parked events (`all`: resolved ones too), oldest first.
pub async fn list(sql: &Client, slot: &str, all: bool) -> Result<Vec<Listed>, RelayError> {
    list_at_most(sql, slot, all, None).await
}

/// [`list`], at most `limit` rows (`None`: all): the status page reads the oldest few every
/// few seconds inside a session, so a large parked store must not make that a long query.
pub async fn list_at_most(
    sql: &Client,
    slot: &str,
    all: bool,
    limit: Option<i64>,
) -> Result<Vec<Listed>, RelayError> {
    let rows = sql
        .query(
            &format!(
                "SELECT event_id, state, coalesce(event_type, ''), coalesce(aggregate_type, ''), \
                        coalesce(aggregate_id, ''), aggregate_version, error_class, attempts, \
                        to_char(first_seen, 'YYYY-MM-DD\"T\"HH24:MI:SSOF'), left(error_message, $4), {} \
                 FROM outbox_parked p WHERE slot = $1 \
                   AND ($2 OR state IN ('parked', 'blocked', 'retry')) ORDER BY id LIMIT $3",
                super::current_table_of("p")
            ),
            &[&slot, &all, &limit, &MESSAGE_CHARS],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Listed {
            event_id: r.get(0),
            state: r.get(1),
            event_type: r.get(2),
            aggregate_type: r.get(3),
            aggregate_id: r.get(4),
            aggregate_version: r.get(5),
            error_class: r.get(6),
            attempts: r.get(7),
            first_seen: r.get(8),
            error_message: r.get(9),
            table: r.get(10),
        })
        .collect())
}

/// One parked event in full, for `outboxd parked show`.
pub struct Detail {
    pub state: String,
    pub event_type: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<i64>,
    pub topic: Option<String>,
    pub error_class: String,
    pub error_message: String,
    pub attempts: i32,
    pub first_seen: String,
    pub last_seen: String,
    pub blocked_by: Option<String>,
    pub payload: Option<String>,
    pub headers: Option<String>,
    /// (when, action, operator, reason), oldest first.
    pub audit: Vec<(String, String, String, String)>,
    /// The outbox table its record names (`source_table`; none from a one-table relay), under
    /// its current name when its oid says it was renamed or moved since.
    pub table: Option<String>,
    /// The whole payload's length in bytes and the headers' in characters: `payload` and
    /// `headers` hold at most the `limit` [`show`] was given (issue 53: a row written with the
    /// relay's credential can hold hundreds of megabytes; `show` no longer loads them whole).
    pub payload_bytes: Option<i64>,
    pub headers_chars: Option<i64>,
}

/// A payload as text for people: UTF-8 as it is; anything else (a bytea table's Avro or
/// Protobuf bytes) in Postgres's `\x` hex notation, never lossy.
/// `cut`: `b` is the start of a longer payload.
fn readable(b: Vec<u8>, cut: bool) -> String {
    String::from_utf8(b).unwrap_or_else(|e| {
        // Cut inside a character by `show`'s limit: the text before it, not hex of it all.
        if cut && e.utf8_error().error_len().is_none() {
            let valid = e.utf8_error().valid_up_to();
            let mut b = e.into_bytes();
            b.truncate(valid);
            return String::from_utf8(b).unwrap_or_default();
        }
        let hex: String = e.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        format!("\\x{hex}")
    })
}

pub async fn show(
    sql: &Client,
    slot: &str,
    event_id: &str,
    limit: i32,
) -> Result<Option<Detail>, RelayError> {
    let Some(r) = sql
        .query_opt(
            &format!(
                "SELECT state, event_type, aggregate_type, aggregate_id, aggregate_version, topic, \
                        error_class, left(error_message, $3), attempts, first_seen::text, last_seen::text, \
                        blocked_by, substring(v.payload FROM 1 FOR $4), left(headers::text, $4), {}, \
                        octet_length(v.payload)::int8, length(headers::text)::int8 \
                 FROM outbox_parked p, LATERAL (SELECT coalesce((SELECT a.new_payload \
                      FROM outbox_parked_audit a WHERE p.state = 'retry' \
                      AND a.id = p.retry_audit_id), p.payload) AS payload) v \
                 WHERE slot = $1 AND event_id = $2",
                super::current_table_of("p")
            ),
            &[&slot, &event_id, &MESSAGE_CHARS, &limit],
        )
        .await?
    else {
        return Ok(None);
    };
    let audit = sql
        .query(
            "SELECT at::text, action, operator || ' (database role ' || db_user || ')', reason FROM outbox_parked_audit \
             WHERE slot = $1 AND event_id = $2 ORDER BY id",
            &[&slot, &event_id],
        )
        .await?
        .iter()
        .map(|a| (a.get(0), a.get(1), a.get(2), a.get(3)))
        .collect();
    Ok(Some(Detail {
        state: r.get(0),
        event_type: r.get(1),
        aggregate_type: r.get(2),
        aggregate_id: r.get(3),
        aggregate_version: r.get(4),
        topic: r.get(5),
        error_class: r.get(6),
        error_message: r.get(7),
        attempts: r.get(8),
        first_seen: r.get(9),
        last_seen: r.get(10),
        blocked_by: r.get(11),
        payload: r
            .get::<_, Option<Vec<u8>>>(12)
            .map(|b| readable(b, r.get::<_, Option<i64>>(15) > Some(i64::from(limit)))),
        headers: r.get(13),
        audit,
        table: r.get(14),
        payload_bytes: r.get(15),
        headers_chars: r.get(16),
    }))
}

/// Who asks for a change, and why (the audit row).
pub struct Request<'a> {
    pub slot: &'a str,
    pub event_id: &'a str,
    pub operator: &'a str,
    pub reason: &'a str,
}

/// What became of a retry request.
#[derive(Debug, PartialEq, Eq)]
pub enum RetryOutcome {
    /// Marked for the running relay, with its audit row.
    Requested,
    /// No parked event with that id for this slot.
    NotParked,
    /// The row lacks a field the router needs (it was parked because it could not be routed):
    /// republishing it cannot work; discard it instead.
    Unroutable(&'static str),
}

/// An operator's corrected payload: JSON (stored as jsonb writes it, like the outbox's), or
/// a bytea table's raw bytes (stored as they are).
pub enum Corrected<'a> {
    Json(&'a serde_json::Value),
    Bytes(&'a [u8]),
}

/// Marks a parked event for republishing (optionally with a corrected payload, stored as
/// Postgres renders jsonb, or as the bytes), in one transaction with its audit row, which the row then names
/// (`retry_audit_id`): the relay releases nothing without it. `debezium_nulls`: a NULL
/// aggregate id or event type is routable (the Debezium preset sends such events).
pub async fn request_retry(
    sql: &mut Client,
    r: &Request<'_>,
    payload: Option<&Corrected<'_>>,
    debezium_nulls: bool,
) -> Result<RetryOutcome, RelayError> {
    let new_payload: Option<Vec<u8>> = match payload {
        None => None,
        Some(Corrected::Bytes(b)) => Some(b.to_vec()),
        Some(Corrected::Json(v)) => {
            let row = sql.query_one("SELECT $1::jsonb::text", &[v]).await?;
            Some(row.get::<_, String>(0).into_bytes())
        }
    };
    let tx = sql.transaction().await?;
    let Some(row) = tx
        .query_opt(
            "SELECT payload, aggregate_type IS NULL, aggregate_id IS NULL, event_type IS NULL \
             FROM outbox_parked WHERE slot = $1 AND event_id = $2 AND state = 'parked' FOR UPDATE",
            &[&r.slot, &r.event_id],
        )
        .await?
    else {
        return Ok(RetryOutcome::NotParked);
    };
    let old: Option<Vec<u8>> = row.get(0);
    for (i, field, nullable) in [
        (1, "aggregate_type", false),
        (2, "aggregate_id", debezium_nulls),
        (3, "event_type", debezium_nulls),
    ] {
        if row.get::<_, bool>(i) && !nullable {
            return Ok(RetryOutcome::Unroutable(field));
        }
    }
    if old.is_none() && new_payload.is_none() {
        return Ok(RetryOutcome::Unroutable("payload"));
    }
    let audit: i64 = tx
        .query_one(
            "INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason, old_payload, new_payload) \
             VALUES ($1, $2, 'retry', $3, $4, $5, $6) RETURNING id",
            &[&r.slot, &r.event_id, &r.operator, &r.reason, &new_payload.as_ref().map(|_| old), &new_payload],
        )
        .await?
        .get(0);
    audit_followers(&tx, r, "retry").await?;
    // The parked copy stays as it was: a corrected payload is released from the audit row,
    // which the row names and only this transaction may name (sql/030's guard).
    tx.execute(
        "UPDATE outbox_parked SET state = 'retry', last_seen = now(), retry_audit_id = $3 \
         WHERE slot = $1 AND event_id = $2",
        &[&r.slot, &r.event_id, &audit],
    )
    .await?;
    tx.commit().await?;
    Ok(RetryOutcome::Requested)
}

/// Gives up on an open event (parked, waiting for its retry, or held behind another): every
/// open state can be resolved. Events held behind it are then released. `false`: no such open
/// event.
pub async fn discard(sql: &mut Client, r: &Request<'_>) -> Result<bool, RelayError> {
    let tx = sql.transaction().await?;
    // The audit row first: the table's guard lets only a transaction that wrote one discard.
    let open = tx
        .query_opt(
            "SELECT 1 FROM outbox_parked WHERE slot = $1 AND event_id = $2 \
               AND state IN ('parked', 'retry', 'blocked') FOR UPDATE",
            &[&r.slot, &r.event_id],
        )
        .await?;
    if open.is_none() {
        return Ok(false);
    }
    tx.execute(
        "INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason) \
         VALUES ($1, $2, 'discard', $3, $4)",
        &[&r.slot, &r.event_id, &r.operator, &r.reason],
    )
    .await?;
    audit_followers(&tx, r, "discard").await?;
    tx.execute(
        "UPDATE outbox_parked SET state = 'discarded', resolved_at = now(), retry_audit_id = NULL \
         WHERE slot = $1 AND event_id = $2",
        &[&r.slot, &r.event_id],
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// One decision releases the events held behind the head `r` names (the relay then checks each
/// and publishes them in version order): each gets its own audit row in the operator's
/// transaction, as a bulk decision writes them ([`super::bulk::audit_followers`]).
async fn audit_followers(
    tx: &tokio_postgres::Transaction<'_>,
    r: &Request<'_>,
    decision: &str,
) -> Result<u64, RelayError> {
    let d = super::bulk::Decision {
        slot: r.slot,
        operator: r.operator,
        reason: r.reason,
    };
    super::bulk::audit_followers(tx, &d, decision, &[r.event_id.to_string()]).await
}

#[cfg(test)]
mod tests {
    use super::readable;

    #[test]
    fn a_payload_cut_inside_a_character_shows_the_text_before_it() {
        let mut b = "prix: 5 €".as_bytes().to_vec();
        b.truncate(b.len() - 1); // the limit fell inside '€'
        assert_eq!(readable(b.clone(), true), "prix: 5 ");
        // Whole, the same bytes are not text: hex, never lossy.
        assert!(readable(b, false).starts_with("\\x7072"));
        assert_eq!(readable(vec![0xff, 0x00], true), "\\xff00");
    }
}
