//! The `outbox_parked` table: durable parking of poison events, the release of parked and
//! blocked events after an operator's repair, and the operator commands behind
//! `outboxd parked list|show|retry|discard` (R16, R28).
//!
//! Every write here commits before the relay treats the event as resolved, so the slot's
//! confirmed LSN never passes an event that is neither acknowledged by the broker nor parked.
//! Parking is idempotent per (slot, event_id): a replay after a crash bumps `attempts` and
//! `last_seen` and never creates a second row or reopens a resolved one.

pub(crate) mod bulk;
pub(crate) mod operator;
pub(crate) mod release;

use crate::config::tables::SOURCE_TABLE_HEADER;
use crate::error::RelayError;
use std::collections::HashMap;
use tokio_postgres::Client;

pub const PARKED_SQL: &str = include_str!("../../../../../sql/030_outbox_parked.sql");

pub use super::record::ParkedRecord;

/// SQL: the table of parked row `alias`, the `source_table` header of its stored record (NULL
/// without one: a one-table relay's rows, and rows parked before a relay listed several tables).
/// Strict and silent: in lax mode the filter would unwrap each `[name, value]` pair, and
/// headers of another shape name no table rather than fail the query.
pub(crate) fn table_of(alias: &str) -> String {
    format!(
        "(jsonb_path_query_first({alias}.headers, \
           'strict $[*] ? (@[0] == \"{SOURCE_TABLE_HEADER}\")', '{{}}', true) ->> 1)"
    )
}

/// SQL: the table of parked row `alias` as people name it now: with a `source_table` header
/// and an oid whose table still exists, that table's current `schema.table` (renamed or moved
/// since it was parked, issue 56); otherwise the header ([`table_of`]).
pub(crate) fn current_table_of(alias: &str) -> String {
    let t = table_of(alias);
    format!(
        "(CASE WHEN {t} IS NOT NULL THEN coalesce((SELECT n.nspname::text || '.' || c.relname::text \
           FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
           WHERE c.oid = {alias}.source_relid), {t}) END)"
    )
}

/// SQL: the oid of parked row `alias`'s table when that table still exists (NULL: parked by
/// an earlier version without one, or its table is gone).
pub(crate) fn live_relid_of(alias: &str) -> String {
    format!(
        "(CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = {alias}.source_relid) \
           THEN {alias}.source_relid END)"
    )
}

/// SQL: parked rows `a` and `b` hold each other's aggregate: the same table by oid (issue 56),
/// or by name when either has no oid or one of their tables is gone (sql/030's guard says why).
fn same_table(a: &str, b: &str) -> String {
    let (ta, tb) = (table_of(a), table_of(b));
    let names = format!("({ta} IS NULL OR {tb} IS NULL OR {ta} = {tb})");
    let (ra, rb) = (format!("{a}.source_relid"), format!("{b}.source_relid"));
    format!(
        "(CASE WHEN {ra} IS NULL OR {rb} IS NULL THEN {names} \
           ELSE {ra} = {rb} OR (({} IS NULL OR {} IS NULL) AND {names}) END)",
        live_relid_of(a),
        live_relid_of(b)
    )
}

/// Which outbox table a parked row (or a live event) is of: its oid when known (a live table's,
/// or a parked row's whose table still exists) and its `schema.table` (the `source_table`
/// header; `None` without one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TableKey {
    pub relid: Option<u32>,
    pub name: Option<String>,
}

/// Do parked events of tables `a` and `b` hold each other's aggregate? The same oid; without
/// one on either side, the same name or either of none: [`same_table`] in Rust (a parked row's
/// oid whose table is gone is loaded as none).
pub fn hold_each_other(a: &TableKey, b: &TableKey) -> bool {
    match (a.relid, b.relid) {
        (Some(x), Some(y)) => x == y,
        _ => a.name.is_none() || b.name.is_none() || a.name == b.name,
    }
}

/// May this role write `outbox_parked.source_relid`? Not when the column is missing (tables
/// this role could not upgrade) or the role's INSERT grant predates it (sql/roles.sql).
pub async fn may_write_relid(sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one(
            "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_attribute \
               WHERE attrelid = to_regclass('outbox_parked') AND attname = 'source_relid' \
                 AND NOT attisdropped) \
             THEN has_column_privilege('outbox_parked', 'source_relid', 'INSERT') ELSE false END",
            &[],
        )
        .await?
        .get(0))
}

/// The current `schema.table` of relation `relid` (`None`: it is gone).
pub async fn name_of(sql: &Client, relid: u32) -> Result<Option<String>, RelayError> {
    Ok(sql
        .query_opt(
            "SELECT n.nspname::text || '.' || c.relname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
            &[&relid],
        )
        .await?
        .map(|r| r.get(0)))
}

/// How the event is parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParkState {
    /// It failed deterministically itself.
    Parked,
    /// It waits behind a parked event of the same aggregate.
    Blocked,
}

/// Creates the parking tables (and the audit's) when missing, and adds the columns and guards
/// later versions need (idempotent; a no-op query when everything is there). A role that may
/// not upgrade existing tables (a least-privilege relay) goes on with a warning: `outboxd init`
/// as the admin role installs the guards, and `outboxd check` says they are missing.
pub async fn ensure_tables(sql: &Client) -> Result<(), RelayError> {
    let (present, current): (bool, bool) = {
        let r = sql
            .query_one(
                // pg_attribute, not information_schema: a role without privileges on the
                // tables (the repair role, a least-privilege relay) must still see them.
                "SELECT to_regclass('outbox_parked') IS NOT NULL \
                          AND to_regclass('outbox_parked_audit') IS NOT NULL, \
                        count(*) = 5 AND to_regclass('outbox_parked_release_idx') IS NOT NULL \
                          AND to_regclass('outbox_parked_heads_idx') IS NOT NULL \
                   FROM pg_attribute WHERE NOT attisdropped \
                   AND ((attrelid = to_regclass('outbox_parked') AND attname IN ('retry_audit_id', 'integrity_tag', 'source_relid')) \
                     OR (attrelid = to_regclass('outbox_parked_audit') AND attname IN ('db_user', 'txid')))",
                &[],
            )
            .await?;
        (r.get(0), r.get(1))
    };
    if current && guards_installed(sql).await? {
        return Ok(());
    }
    crate::schema::install(sql, PARKED_SQL, "outbox_parked", present).await?;
    // Every query of parked rows reads it: without it nothing here works (issue 56).
    let relid: bool = sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('outbox_parked') \
               AND attname = 'source_relid' AND NOT attisdropped)",
            &[],
        )
        .await?
        .get(0);
    match relid {
        true => Ok(()),
        false => Err(RelayError::Setup(
            "outbox_parked lacks the column source_relid of this version (the oid of a parked \
             event's table) and this role cannot add it: run `outboxd init` as the admin role, \
             then the grants of sql/roles.sql again"
                .into(),
        )),
    }
}

/// [`ensure_tables`] for a relay with several outbox tables, which holds aggregates per table:
/// an enabled guard of an earlier version (it holds them across tables) would refuse the
/// release of an event held behind its own table's head while another table's head of that
/// aggregate is open, and the relay would fail at it over and over. Refused at start instead,
/// with the fix, when this role cannot replace it.
pub async fn ensure_tables_per_table(sql: &Client) -> Result<(), RelayError> {
    ensure_tables(sql).await?;
    let outdated: bool = sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid \
             WHERE t.tgrelid = to_regclass('outbox_parked') AND t.tgname = 'outbox_parked_guard' \
               AND t.tgenabled <> 'D' AND p.prosrc NOT LIKE '%source_table%')",
            &[],
        )
        .await?
        .get(0);
    if outdated {
        return Err(RelayError::Setup(
            "outbox_parked's guard is of an earlier version: it holds an aggregate's events \
             across outbox tables, and this relay (several tables) holds them per table, so it \
             would refuse releases that are in order. Run `outboxd init` as the admin role \
             (sql/roles.sql) to install this version's guard"
                .into(),
        ));
    }
    Ok(())
}

/// Are both guard triggers (sql/030) on the tables, enabled and of this version? The parked
/// table's guard holds aggregates per outbox table since issue 30 (its body reads the
/// `source_table` header); an older one holds them across tables and would refuse releases
/// that are in order, so it counts as missing and the relay replaces it. Since issue 53 it
/// also assigns `id` and keeps the ledger of parked events (as the owner: SECURITY DEFINER);
/// one without would let a supplied id or a re-inserted event through. Since issue 56 it holds
/// by the table's oid (`source_relid`); an older one would refuse holds across a rename.
pub async fn guards_installed(sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one(
            "SELECT count(*) = 2 FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid \
             WHERE t.tgenabled <> 'D' AND p.proconfig IS NOT NULL \
               AND (t.tgname <> 'outbox_parked_guard' \
                    OR (p.prosrc LIKE '%source_table%' AND p.prosrc LIKE '%outbox_parked_ledger%' \
                        AND p.prosrc LIKE '%source_relid%' AND p.prosecdef)) \
               AND ((t.tgrelid = to_regclass('outbox_parked') AND t.tgname = 'outbox_parked_guard') \
                 OR (t.tgrelid = to_regclass('outbox_parked_audit') AND t.tgname = 'outbox_parked_audit_guard'))",
            &[],
        )
        .await?
        .get(0))
}

/// Parks one event and commits. Returns the row's state afterwards (a replayed event that an
/// operator already resolved stays resolved).
///
/// A row is one per (slot, event_id): the same event parked again (a replayed stream) only
/// counts an attempt. With several outbox tables two tables may carry the same event_id; the
/// second would then vanish into the first's row, so a conflict whose stored `source_table`
/// header differs is refused ([`RelayError::Halted`], class `event_id_collision`).
///
/// `tag`: the relay's integrity tag of the row (`poison::integrity`), when it has a key.
/// `relid`: the oid of its table (its root's, for a partition's row), when the session knows it.
#[allow(clippy::too_many_arguments)]
pub async fn park(
    sql: &Client,
    slot: &str,
    rec: &ParkedRecord,
    relid: Option<u32>,
    state: ParkState,
    blocks_aggregate: bool,
    blocked_by: Option<&str>,
    class: &str,
    message: &str,
    tag: Option<&[u8]>,
) -> Result<String, RelayError> {
    let headers = serde_json::to_value(&rec.headers).unwrap_or(serde_json::Value::Null);
    let state = match state {
        ParkState::Parked => "parked",
        ParkState::Blocked => "blocked",
    };
    // Without an oid the column is left out: a relay role not granted INSERT on it (an
    // upgrade whose sql/roles.sql grants were not run again) parks by name, as before.
    let (col, val) = match relid {
        Some(_) => (", source_relid", ", $18"),
        None => ("", ""),
    };
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![
        &slot,
        &rec.event_id,
        &rec.aggregate_type,
        &rec.aggregate_id,
        &rec.aggregate_version,
        &rec.event_type,
        &rec.topic,
        &rec.key,
        &rec.payload,
        &headers,
        &rec.timestamp_ms,
        &state,
        &blocks_aggregate,
        &blocked_by,
        &class,
        &message,
        &tag,
    ];
    if let Some(r) = &relid {
        params.push(r);
    }
    let row = sql
        .query_one(
            &format!("INSERT INTO outbox_parked (slot, event_id, aggregate_type, aggregate_id, aggregate_version, \
               event_type, topic, record_key, payload, headers, record_ts_ms, state, blocks_aggregate, \
               blocked_by, error_class, error_message, integrity_tag{col}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17{val}) \
             ON CONFLICT (slot, event_id) DO UPDATE SET attempts = outbox_parked.attempts + 1, \
               last_seen = now() \
             RETURNING state, {}, source_relid", table_of("outbox_parked")),
            &params,
        )
        .await?;
    let stored: Option<String> = row.get(1);
    let ours = crate::config::tables::stored_table(&rec.headers);
    let stored_relid: Option<u32> = row.get(2);
    let other = match (stored_relid, relid) {
        (Some(a), Some(b)) => a != b,
        _ => stored.as_deref() != ours,
    };
    if other {
        return Err(RelayError::Halted {
            event_id: rec.event_id.clone(),
            class: "event_id_collision".into(),
            message: format!(
                "event_id {} of {} is already parked for slot {slot:?} from {}: two outbox tables \
                 carry the same event_id, and a parked event is one per (slot, event_id). Make \
                 event_ids unique across the tables of one relay (UUIDs are), or relay the \
                 tables with separate slots",
                rec.event_id,
                ours.unwrap_or("the outbox table"),
                stored.as_deref().unwrap_or("another table"),
            ),
        });
    }
    Ok(row.get(0))
}

/// Aggregates that hold their later events: aggregate_type → aggregate_id → the open heads,
/// one per table ([`TableKey`]; one of no oid and no name: a row of no table), each with its
/// event_id.
pub type Blocked = HashMap<String, HashMap<String, Vec<(TableKey, String)>>>;

/// SQL: the open heads of `slot`'s aggregates among parked rows `p` filtered by `filter`: one
/// per (aggregate, table), the table by live oid (`r`) or, without one, by name (`t`).
pub(crate) fn heads_sql(from: &str) -> String {
    format!(
        "SELECT DISTINCT ON (aggregate_type, aggregate_id, r, n) aggregate_type, aggregate_id, \
                t, event_id, r \
         FROM (SELECT p.aggregate_type, p.aggregate_id, p.id, p.event_id, {t} AS t, {r} AS r, \
                      CASE WHEN {r} IS NULL THEN {t} END AS n \
               FROM {from} AND p.blocks_aggregate AND p.state IN ('parked', 'blocked', 'retry') \
                 AND p.aggregate_type IS NOT NULL AND p.aggregate_id IS NOT NULL) open \
         ORDER BY aggregate_type, aggregate_id, r, n, id",
        t = table_of("p"),
        r = live_relid_of("p"),
    )
}

pub async fn blocked_aggregates(sql: &Client, slot: &str) -> Result<Blocked, RelayError> {
    let rows = sql
        .query(&heads_sql("outbox_parked p WHERE p.slot = $1"), &[&slot])
        .await?;
    Ok(blocked_from(rows))
}

/// [`Blocked`] from rows of (aggregate_type, aggregate_id, table name, head event_id, oid).
pub(crate) fn blocked_from(rows: Vec<tokio_postgres::Row>) -> Blocked {
    let mut b = Blocked::new();
    for r in rows {
        let key = TableKey {
            relid: r.get(4),
            name: r.get(2),
        };
        b.entry(r.get(0))
            .or_default()
            .entry(r.get(1))
            .or_default()
            .push((key, r.get(3)));
    }
    b
}

/// A parked row ready to be published.
#[derive(Debug, Clone)]
pub struct Release {
    pub id: i64,
    pub record: ParkedRecord,
    /// `retry`: an operator asked for it (audit row); `blocked`: its head was resolved.
    pub retry: bool,
    /// The payload is the operator's correction from the retry's audit row.
    pub corrected: bool,
    /// What the integrity tag covers besides `record` (whose payload may be the correction):
    /// the payload as parked, `blocks_aggregate`, `blocked_by`; and the stored tag.
    pub parked_payload: Option<Vec<u8>>,
    pub blocks_aggregate: bool,
    pub blocked_by: Option<String>,
    pub tag: Option<Vec<u8>>,
    /// The oid of its table, when the relay that parked it knew it (issue 56).
    pub relid: Option<u32>,
    /// Its table was found by that oid under another name than its `source_table` header
    /// (renamed or moved since): the header is the name it had, not the one its route has.
    pub renamed: bool,
}

impl Release {
    /// The row as parked (the payload before any correction), which its tag covers.
    pub fn as_parked(&self) -> ParkedRecord {
        ParkedRecord {
            payload: self.parked_payload.clone(),
            ..self.record.clone()
        }
    }
}

/// A released row failed deterministically again: it becomes (or stays) a parked head.
pub async fn mark_failed(
    sql: &Client,
    id: i64,
    class: &str,
    message: &str,
) -> Result<(), RelayError> {
    sql.execute(
        "UPDATE outbox_parked SET state = 'parked', attempts = attempts + 1, last_seen = now(), \
           error_class = $2, error_message = $3, retry_audit_id = NULL WHERE id = $1",
        &[&id, &class, &message],
    )
    .await?;
    Ok(())
}

/// Open parked events per outbox table (as named now, [`current_table_of`]; `None` for records
/// without a `source_table` header), for `status` with several tables.
pub async fn open_per_table(
    sql: &Client,
    slot: &str,
) -> Result<Vec<(Option<String>, i64)>, RelayError> {
    let rows = sql
        .query(
            &format!(
                "SELECT {}, count(*) \
                 FROM outbox_parked p WHERE p.slot = $1 AND p.state IN ('parked', 'blocked', 'retry') \
                 GROUP BY 1",
                current_table_of("p")
            ),
            &[&slot],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// SQL: the bytes a parked row `alias` holds (key, value, headers), what `[parked]
/// max_record_bytes` and `max_open_bytes` bound.
pub(crate) fn bytes_of(alias: &str) -> String {
    format!(
        "(coalesce(octet_length({alias}.record_key), 0) + coalesce(octet_length({alias}.payload), 0) \
          + coalesce(octet_length({alias}.headers::text), 0))"
    )
}

/// The bytes the open rows of `slot` hold ([`bytes_of`]) — of the rows the relay could have
/// written (issue 53): a record within `max_record_bytes` (the relay parks no larger one)
/// and, with a key (`keyed`), a tag of its length. Lengths only: no value is read.
pub async fn open_bytes(
    sql: &Client,
    slot: &str,
    max_record_bytes: u64,
    keyed: bool,
) -> Result<u64, RelayError> {
    let max = i64::try_from(max_record_bytes).unwrap_or(i64::MAX);
    let n: i64 = sql
        .query_one(
            &format!(
                "SELECT coalesce(sum(b), 0)::int8 FROM (SELECT {} AS b, p.integrity_tag \
                   FROM outbox_parked p \
                   WHERE p.slot = $1 AND p.state IN ('parked', 'blocked', 'retry')) open \
                 WHERE b <= $2::int8 AND (NOT $3 OR octet_length(integrity_tag) = 32)",
                bytes_of("p")
            ),
            &[&slot, &max, &keyed],
        )
        .await?
        .get(0);
    Ok(n.max(0) as u64)
}

/// An aggregate stuck behind a parked head: (aggregate_type, aggregate_id, head event_id, the
/// head's error class, events held behind it, seconds since the head was parked).
pub type Stuck = (String, String, String, String, i64, f64);

/// How many aggregates a parked head holds, and the `limit` oldest, for `outboxd status`
/// (issue 40: one number that says the stream of an aggregate stopped, and where).
pub async fn stuck_aggregates(
    sql: &Client,
    slot: &str,
    limit: i64,
) -> Result<(i64, Vec<Stuck>), RelayError> {
    let rows = sql
        .query(
            "SELECT h.aggregate_type, h.aggregate_id, h.event_id, h.error_class, \
                    (SELECT count(*) FROM outbox_parked b WHERE b.slot = h.slot AND b.state = 'blocked' \
                       AND b.aggregate_type = h.aggregate_type AND b.aggregate_id = h.aggregate_id), \
                    extract(epoch FROM now() - h.first_seen)::float8, count(*) OVER () \
             FROM outbox_parked h WHERE h.slot = $1 AND h.blocks_aggregate \
               AND h.state IN ('parked', 'retry') \
               AND h.aggregate_type IS NOT NULL AND h.aggregate_id IS NOT NULL \
             ORDER BY h.first_seen, h.id LIMIT $2",
            &[&slot, &limit],
        )
        .await?;
    let total = rows.first().map_or(0, |r| r.get(6));
    Ok((
        total,
        rows.iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
            .collect(),
    ))
}

/// How many aggregates a parked head holds (for the `outboxd_stuck_aggregates` gauge).
pub async fn stuck_count(sql: &Client, slot: &str) -> Result<i64, RelayError> {
    Ok(sql
        .query_one(
            "SELECT count(DISTINCT (aggregate_type, aggregate_id)) FROM outbox_parked \
             WHERE slot = $1 AND blocks_aggregate AND state IN ('parked', 'retry') \
               AND aggregate_type IS NOT NULL AND aggregate_id IS NOT NULL",
            &[&slot],
        )
        .await?
        .get(0))
}

/// Open parked events: `(event_type, state, count, age of the oldest in seconds)`.
pub type OpenStats = Vec<(String, String, i64, f64)>;

/// Open parked events per (event_type, state): count and age of the oldest, for metrics/status.
pub async fn open_stats(sql: &Client, slot: &str) -> Result<OpenStats, RelayError> {
    let rows = sql
        .query(
            "SELECT coalesce(event_type, '?'), state, count(*), \
                    extract(epoch FROM now() - min(first_seen))::float8 \
             FROM outbox_parked WHERE slot = $1 AND state IN ('parked', 'blocked', 'retry') \
             GROUP BY 1, 2",
            &[&slot],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn aggregates_hold_within_a_table_and_rows_of_no_table_everywhere() {
        use super::TableKey;
        let k = |relid: Option<u32>, name: Option<&str>| TableKey {
            relid,
            name: name.map(str::to_string),
        };
        let h = |a: Option<&str>, b: Option<&str>| super::hold_each_other(&k(None, a), &k(None, b));
        assert!(h(Some("a.outbox"), Some("a.outbox")));
        assert!(!h(Some("a.outbox"), Some("b.outbox")));
        assert!(h(None, Some("b.outbox")) && h(Some("a.outbox"), None) && h(None, None));
        // By oid when both have one: a rename keeps the holds, a swap does not swap them.
        let h = super::hold_each_other;
        assert!(h(
            &k(Some(7), Some("a.outbox")),
            &k(Some(7), Some("c.outbox"))
        ));
        assert!(!h(
            &k(Some(7), Some("a.outbox")),
            &k(Some(8), Some("a.outbox"))
        ));
        // One without (parked by an earlier version, or its table gone): by name.
        assert!(h(&k(None, Some("a.outbox")), &k(Some(8), Some("a.outbox"))));
        assert!(!h(
            &k(None, Some("a.outbox")),
            &k(Some(8), Some("b.outbox"))
        ));
        assert!(super::table_of("p").contains("p.headers"));
    }
}
