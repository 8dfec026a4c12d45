//! A time-partitioned outbox (`sql/optional/outbox_partitioned.sql`): cleanup detaches and
//! drops whole partitions whose range ends at or before the cutoff, instead of deleting rows.
//! Dropping a partition writes no per-row WAL and leaves no dead tuples to vacuum.
//!
//! Only range partitions with an upper bound count; the DEFAULT partition (which catches rows
//! no partition covers, so an insert never fails) is never dropped. Upcoming partitions are
//! created by the SQL function `outbox_create_partitions(days)` of that file, which cleanup
//! calls when it exists, so a cleanup loop also keeps the table ready for the next days.

use super::bounds::Bounds;
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

/// A partitioned outbox may be cleaned by partition only when its partitions are ranges of
/// the mapped `created_at`, a `timestamptz`: otherwise "a partition's range lies before the
/// cutoff" says nothing about its rows' age. `Ok(Err(why))`: not such a table.
pub async fn check_key(
    sql: &Client,
    schema: &str,
    table: &str,
    created_at: &str,
) -> Result<Result<(), String>, RelayError> {
    let row = sql
        .query_one(
            "SELECT pt.partstrat::text, pt.partnatts::int, \
                    (SELECT a.attname::text FROM pg_attribute a \
                     WHERE a.attrelid = c.oid AND a.attnum = pt.partattrs[0]), \
                    (SELECT format_type(a.atttypid, NULL) FROM pg_attribute a \
                     WHERE a.attrelid = c.oid AND a.attnum = pt.partattrs[0]) \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_partitioned_table pt ON pt.partrelid = c.oid \
             WHERE n.nspname = $1 AND c.relname = $2",
            &[&schema, &table],
        )
        .await?;
    let (strategy, n, col, ty): (String, i32, Option<String>, Option<String>) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if strategy == "r"
        && n == 1
        && col.as_deref() == Some(created_at)
        && ty.as_deref() == Some("timestamp with time zone")
    {
        return Ok(Ok(()));
    }
    Ok(Err(format!(
        "{schema}.{table} is partitioned, but not by RANGE ({created_at}) over a timestamptz \
         (strategy {strategy}, {n} key column(s), first {}: {}): cleanup drops whole \
         partitions only by the mapped created_at column; partition by it \
         (sql/optional/outbox_partitioned.sql) or clean the partitions yourself",
        col.unwrap_or_else(|| "an expression".into()),
        ty.unwrap_or_default()
    )))
}

/// One cleanup run over a partitioned outbox.
pub struct Partitioned<'a> {
    pub schema: &'a str,
    pub table: &'a str,
    pub cutoff: DateTime<Utc>,
    pub bounds: &'a Bounds,
}

impl Partitioned<'_> {
    /// Partitions (schema, name) whose whole range lies before the cutoff, oldest first.
    pub async fn droppable(&self, sql: &Client) -> Result<Vec<(String, String)>, RelayError> {
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
                &[&self.schema, &self.table, &self.cutoff],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Creates the next days' partitions (when the helper function exists), then detaches and
    /// drops every partition before the cutoff whose rows are all delivered on every slot
    /// (an application may have put an old `created_at` on a row that is not), while no
    /// recovery or replay runs. Each partition is its own short transaction under the
    /// connection's `lock_timeout`: a busy table makes this run stop, not queue writers for long.
    pub async fn drop_before(
        &self,
        sql: &Client,
        privilege: fn(tokio_postgres::Error) -> RelayError,
    ) -> Result<Vec<String>, RelayError> {
        let schema = self.schema;
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
        let parent = format!("{}.{}", quote_ident(schema), quote_ident(self.table));
        let mut dropped = Vec::new();
        for (s, name) in self.droppable(sql).await? {
            let child = format!("{}.{}", quote_ident(&s), quote_ident(&name));
            // Detached first (no new row can land in it), checked, then dropped; a partition
            // that still holds an undelivered row, or a recovery that started, rolls back.
            let check = format!(
                "DO $$ BEGIN IF NOT ({idle}) OR EXISTS (SELECT 1 FROM {child} AS o WHERE NOT \
                 ({delivered})) THEN RAISE EXCEPTION 'outboxd: partition still needed'; END IF; \
                 END $$",
                idle = self.bounds.idle,
                delivered = self.bounds.delivered
            );
            let r = sql
                .batch_execute(&format!(
                    "BEGIN; ALTER TABLE {parent} DETACH PARTITION {child}; {check}; \
                     DROP TABLE {child}; COMMIT"
                ))
                .await;
            if let Err(e) = r {
                let _ = sql.batch_execute("ROLLBACK").await;
                if e.as_db_error()
                    .is_some_and(|d| d.message().contains("partition still needed"))
                {
                    tracing::warn!(partition = %format!("{s}.{name}"), "cleanup: partition kept: it holds rows not yet delivered on every slot (or a recovery or replay started)");
                    break;
                }
                return Err(privilege(e));
            }
            tracing::info!(partition = %format!("{s}.{name}"), "cleanup: partition dropped");
            dropped.push(format!("{s}.{name}"));
        }
        Ok(dropped)
    }
}
