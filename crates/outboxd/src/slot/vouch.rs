//! Can an outbox table vouch for a lost slot's gap? (R40, R53; docs/reliability.md, "What halts")
//!
//! A recovery republishes the gap from the table. That is only honest when the table still
//! holds the gap's rows: a writer that deletes its rows in the inserting transaction
//! (Debezium's insert-then-delete), or a cleanup that went past the delivery mark, leaves
//! nothing to read, and "recovered 0 events" would be a silent loss. Every automatic recovery
//! — a missing or invalidated slot, an interrupted recovery, a gap the publication left — asks
//! each table, before anything is republished, and halts with the gap when one cannot answer.
//!
//! Two proofs, either suffices:
//! - **a witness**: a row delivered before the gap is still in the table (written by a
//!   transaction older than `delivered_xid`, or, with `created_at` mapped, created at or
//!   before the delivery mark). The rows after it were not cleaned up and the writer does not
//!   delete what it inserts. This needs no `created_at`: `xmin` is stamped by Postgres.
//! - **the statistics**: the table never lost a row (`pg_stat_user_tables`: no delete, no more
//!   inserts than rows held) and is not an empty heap with pages (the dead tuples an
//!   insert-then-delete writer leaves, visible before its statistics are flushed). This covers
//!   a table whose every row is in the gap (a slot lost before its first delivery).
//!
//! Before this check ran only with `created_at` mapped and never for an interrupted (or
//! publication-owed) gap: a Debezium-preset table lost its whole gap silently.

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::model::sql::quote_ident;
use crate::slot::gap::{self, Gap};
use chrono::{DateTime, Utc};
use tokio_postgres::Client;

/// Every automatic recovery asks this before it touches the slot: a table that joined and
/// left during the gap ([`joined_and_left`]), then each table in turn ([`why_not`]; one
/// table's rows vouch for nothing in another). `Some` says why the gap cannot be re-read.
pub async fn all(
    cfg: &Config,
    sql: &Client,
    tables: &[OutboxTable],
    gap: &Gap,
    mark: Option<DateTime<Utc>>,
) -> Result<Option<String>, RelayError> {
    let oids: Vec<u32> = crate::slot::join::identities(sql, tables)
        .await?
        .into_iter()
        .flatten()
        .collect();
    let left = joined_and_left(sql, &cfg.source.publication, gap, &oids).await?;
    // A table a pattern matches now that the recovery's tables lack was created (or renamed
    // in) after they were resolved: a new session resolves it and recovers with it.
    let patterns = cfg.patterns();
    let (now_matching, left): (Vec<_>, Vec<_>) =
        left.into_iter().partition(|(schema, name, partition)| {
            !partition && patterns.iter().any(|(_, p)| p.matches(schema, name))
        });
    if let Some((schema, name, _)) = now_matching.into_iter().next() {
        return Err(RelayError::TablesChanged(format!("{schema}.{name}")));
    }
    if !left.is_empty() {
        let names: Vec<String> = left.iter().map(|(s, n, _)| format!("{s}.{n}")).collect();
        return Ok(Some(format!(
            "table(s) {} joined the publication during the gap (or, relayed before it, were \
             renamed or moved during it) and are not relayed now (renamed or moved out of the \
             pattern?): their rows of the gap were only in the \
             lost slot, under a mapping outboxd cannot know any more. Publish them from the \
             table yourself if they are outbox rows (outboxd replay with a configuration that \
             lists the table), or take the table out of the publication if it is none; then \
             outboxd recover --config FILE",
            names.join(", ")
        )));
    }
    for t in tables {
        let names = t.columns.resolve()?;
        let why = why_not(
            sql,
            &t.schema,
            &t.name,
            gap,
            mark,
            names.created_at.as_deref(),
        );
        if let Some(why) = why.await? {
            return Ok(Some(why));
        }
    }
    Ok(None)
}

/// Why `table` (schema, name) cannot vouch for `gap`, or `None` when it can.
/// `created_at`: the mapping's column, when it has one; `mark`: the delivery mark.
pub async fn why_not(
    sql: &Client,
    schema: &str,
    name: &str,
    gap: &Gap,
    mark: Option<DateTime<Utc>>,
    created_at: Option<&str>,
) -> Result<Option<String>, RelayError> {
    let qualified = format!("{}.{}", quote_ident(schema), quote_ident(name));
    let mut witnesses = Vec::new();
    if let Some(x) = gap.from_xid {
        let next = gap::next_xid(sql).await?;
        if let Some(older) = gap::older_than(x, next) {
            witnesses.push(older);
        }
    }
    if let (Some(m), Some(ts)) = (mark, created_at) {
        witnesses.push(format!(
            "o.{} <= '{}'::timestamptz",
            quote_ident(ts),
            m.to_rfc3339()
        ));
    }
    if !witnesses.is_empty() {
        let q = format!(
            "SELECT EXISTS (SELECT 1 FROM {qualified} o WHERE {})",
            witnesses.join(" OR ")
        );
        if sql.query_one(&q, &[]).await?.get::<_, bool>(0) {
            return Ok(None);
        }
    }
    // No witness: the table (with its partitions) must never have lost a row.
    let q = format!(
        "WITH r AS (SELECT {lit}::regclass::oid AS relid \
                    UNION SELECT relid FROM pg_partition_tree({lit}::regclass)) \
         SELECT COALESCE(sum(s.n_tup_ins), 0)::bigint, COALESCE(sum(s.n_tup_del), 0)::bigint, \
                (SELECT count(*) FROM {qualified}), \
                (SELECT COALESCE(sum(pg_relation_size(relid)), 0)::bigint FROM r) \
         FROM pg_stat_user_tables s WHERE s.relid IN (SELECT relid FROM r)",
        lit = literal(&qualified)
    );
    let row = sql.query_one(&q, &[]).await?;
    let (ins, del, held, heap): (i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if del == 0 && ins <= held && !(held == 0 && heap > 0) {
        return Ok(None);
    }
    Ok(Some(format!(
        "the outbox table {schema}.{name} cannot vouch for the gap: it no longer holds the rows \
         delivered before the gap (no row of a transaction older than the gap{ts}), and its statistics \
         show rows it no longer holds ({ins} inserted, {del} deleted, {held} held, {heap} heap \
         bytes) — its writer deletes rows in the inserting transaction (Debezium's \
         insert-then-delete) or cleanup went past the delivery mark. The gap's events exist \
         neither in the slot nor in the table and must be re-emitted by their writers; nothing \
         past the gap was published",
        ts = if created_at.is_some() && mark.is_some() {
            ", none created at or before the delivery mark"
        } else {
            ""
        }
    )))
}

/// `s` as an SQL string literal.
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// A table that joined the publication during the gap (its `pg_publication_rel` row written
/// by a transaction of the gap) and is not among the tables being recovered (`recovered`,
/// oids): a tenant created or renamed into a pattern while the slot was lost, then renamed out
/// (issue 56, found by the sequence test). Its rows of the gap were in the lost slot, and which
/// mapping they went by is not known any more: each is returned (schema, name, whether it is a
/// partition), and the relay stops rather than finish the recovery without them (or, when a
/// pattern matches it now, resolves it in a new session). The same for any other table of the
/// publication renamed or moved during the gap (its `pg_type` row written by a transaction of
/// the gap): a tenant relayed before the gap that left then had rows of the gap only in the
/// lost slot too (seed 7042: one such row lost silently). Not only the tables the state row
/// records as joined: a tenant's join is recorded once its catch-up is acknowledged, and a
/// slot lost before that (the full suite's load) named nothing and lost the row again. A
/// table of the publication that is no outbox and was renamed in the gap halts too: loud and
/// conservative, the message says how to go on.
/// outboxd's own tables are no outboxes. (A publication
/// `FOR ALL TABLES` has no such rows: nothing to see.)
pub async fn joined_and_left(
    sql: &Client,
    publication: &str,
    gap: &Gap,
    recovered: &[u32],
) -> Result<Vec<(String, String, bool)>, RelayError> {
    let Some(x) = gap.from_xid else {
        return Ok(Vec::new());
    };
    let next = gap::next_xid(sql).await?;
    let Some(older) = gap::older_than(x, next) else {
        return Ok(Vec::new());
    };
    let renamed = older.replace("o.xmin", "ty.xmin");
    let q = format!(
        "SELECT n.nspname::text, c.relname::text, c.relispartition FROM pg_publication_rel o \
         JOIN pg_publication p ON p.oid = o.prpubid JOIN pg_class c ON c.oid = o.prrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_type ty ON ty.oid = c.reltype \
         WHERE p.pubname = $1 AND NOT (c.oid = ANY($2)) \
           AND (NOT ({older}) OR (ty.xmin IS NOT NULL AND NOT ({renamed}))) \
           AND c.relname NOT LIKE 'outbox\\_parked%' AND c.relname NOT LIKE 'outboxd\\_%' \
         ORDER BY 1, 2"
    );
    let rows = sql.query(&q, &[&publication, &recovered]).await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}
