//! A time-partitioned outbox (`sql/optional/outbox_partitioned.sql`): cleanup detaches and
//! drops whole partitions whose range ends at or before the cutoff, instead of deleting rows.
//! Dropping a partition writes no per-row WAL and leaves no dead tuples to vacuum.
//!
//! Only range partitions with an upper bound count; the DEFAULT partition (which catches rows
//! no partition covers, so an insert never fails) is never dropped. Upcoming partitions are
//! created by the SQL function `outbox_create_partitions(days)` of that file, which cleanup
//! calls when it exists, so a cleanup loop also keeps the table ready for the next days.

use crate::error::RelayError;
use crate::relay::source::quote_ident;
use chrono::{DateTime, Utc};
use tokio_postgres::Client;

/// Days of partitions kept ready ahead of today.
const DAYS_AHEAD: i32 = 3;

pub async fn is_partitioned(sql: &Client, schema: &str, table: &str) -> Result<bool, RelayError> {
    let row = sql
        .query_opt(
            "SELECT c.relkind = 'p' FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&schema, &table],
        )
        .await?;
    Ok(row.is_some_and(|r| r.get(0)))
}

/// Partitions (schema, name) whose whole range lies before `cutoff`, oldest first.
pub async fn droppable(
    sql: &Client,
    schema: &str,
    table: &str,
    cutoff: DateTime<Utc>,
) -> Result<Vec<(String, String)>, RelayError> {
    let rows = sql
        .query(
            "SELECT cn.nspname::text, c.relname::text, upper_bound FROM ( \
               SELECT i.inhrelid, substring(pg_get_expr(ch.relpartbound, ch.oid) \
                        FROM 'TO \\(''([^'']+)''\\)') AS upper_text \
               FROM pg_inherits i \
               JOIN pg_class p ON p.oid = i.inhparent \
               JOIN pg_namespace pn ON pn.oid = p.relnamespace \
               JOIN pg_class ch ON ch.oid = i.inhrelid \
               WHERE pn.nspname = $1 AND p.relname = $2) b \
             CROSS JOIN LATERAL (SELECT b.upper_text::timestamptz AS upper_bound) u \
             JOIN pg_class c ON c.oid = b.inhrelid \
             JOIN pg_namespace cn ON cn.oid = c.relnamespace \
             WHERE b.upper_text IS NOT NULL AND upper_bound <= $3 \
             ORDER BY upper_bound",
            &[&schema, &table, &cutoff],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Creates the next days' partitions (when the helper function exists), then detaches and
/// drops every partition before `cutoff`. Each partition is its own short statement under the
/// connection's `lock_timeout`: a busy table makes this run stop, not queue writers for long.
pub async fn drop_before(
    sql: &Client,
    schema: &str,
    table: &str,
    cutoff: DateTime<Utc>,
    privilege: fn(tokio_postgres::Error) -> RelayError,
) -> Result<Vec<String>, RelayError> {
    let helper = format!("{}.outbox_create_partitions(integer)", quote_ident(schema));
    let exists: bool = sql
        .query_one("SELECT to_regprocedure($1) IS NOT NULL", &[&helper])
        .await?
        .get(0);
    if exists {
        sql.execute(
            &format!(
                "SELECT {}.outbox_create_partitions($1)",
                quote_ident(schema)
            ),
            &[&DAYS_AHEAD],
        )
        .await?;
    }
    let parent = format!("{}.{}", quote_ident(schema), quote_ident(table));
    let mut dropped = Vec::new();
    for (s, name) in droppable(sql, schema, table, cutoff).await? {
        let child = format!("{}.{}", quote_ident(&s), quote_ident(&name));
        sql.batch_execute(&format!(
            "ALTER TABLE {parent} DETACH PARTITION {child}; DROP TABLE {child}"
        ))
        .await
        .map_err(privilege)?;
        tracing::info!(partition = %format!("{s}.{name}"), "cleanup: partition dropped");
        dropped.push(format!("{s}.{name}"));
    }
    Ok(dropped)
}
