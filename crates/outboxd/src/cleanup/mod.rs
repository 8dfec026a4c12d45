//! Outbox cleanup (R34): deletes delivered outbox rows older than the retention, in small
//! batches, from `outboxd cleanup` (cron) or as a loop inside `outboxd run` (`cleanup.every`).
//!
//! What may go. A row may be deleted only when nothing can need it again ([`bounds`]):
//! - it was delivered on every slot: its transaction is older than every relay's
//!   `delivered_xid` (in every `outboxd_slot_state` of the database, whatever its schema) — the
//!   exact bound a lost slot's recovery republishes from, so no created_at, clock or config of
//!   cleanup's own can make it take a row a recovery needs;
//! - no recovery and no replay is under way — re-checked by every batch's statement;
//! - it is older than `cleanup.retention` (the audit retention) and than the slowest slot's
//!   delivery mark minus `source.recovery_window`, by `created_at` on the database's clock: so
//!   the rows around the mark stay, which is how a recovery tells a table that vouches for its
//!   gap from one whose rows were deleted by their writers.
//!
//! So the cutoff is `least(now() - retention, min(delivery_mark) - recovery_window)`; rows with
//! `created_at` before it whose transaction is older than `min(delivered_xid)` go. A pgoutput
//! slot without delivery state blocks everything (`cleanup.ignore_slots` lists foreign ones).
//!
//! How. Never one long DELETE: batches of `batch_size` rows, each its own short transaction,
//! walking the `created_at` index with a cursor that only moves forward (dead index entries of
//! earlier batches are not rescanned), `lock_timeout` (a concurrent run waits at most that long), a pause between batches and a cap per run. Rows are addressed
//! by `ctid`, so any outbox table works whatever its key; a partitioned outbox is cleaned by
//! dropping whole partitions instead (`partitions`).

mod bounds;
mod partitions;

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::source::{self, quote_ident};
use chrono::{DateTime, Utc};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_postgres::Client;

/// What one run did (or, dry, would do).
#[derive(Debug, Default)]
pub struct Report {
    /// Rows created before this may go; `None`: nothing may (see `blocked`).
    pub cutoff: Option<DateTime<Utc>>,
    /// Why nothing or less than the retention allows may go (the slot whose mark decides).
    pub held_back: Option<String>,
    pub blocked: Option<String>,
    pub deleted: u64,
    /// Dry run: rows that would go (before the cap).
    pub eligible: Option<i64>,
    pub batches: u32,
    /// The cap stopped this run; more rows are eligible.
    pub capped: bool,
    /// Partitions dropped (dry run: that would be dropped).
    pub partitions: Vec<String>,
    pub dry_run: bool,
    pub seconds: f64,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(b) = &self.blocked {
            return writeln!(f, "nothing deleted: {b}");
        }
        if let Some(c) = self.cutoff {
            writeln!(f, "cutoff          rows created before {}", c.to_rfc3339())?;
        }
        if let Some(h) = &self.held_back {
            writeln!(f, "held back by    {h}")?;
        }
        let verb = if self.dry_run {
            "would drop"
        } else {
            "dropped"
        };
        for p in &self.partitions {
            writeln!(f, "{verb:<15} partition {p}")?;
        }
        if self.dry_run {
            if let Some(n) = self.eligible {
                writeln!(
                    f,
                    "dry run         {n} row(s) would be deleted; nothing changed"
                )?;
            } else {
                writeln!(f, "dry run         nothing changed")?;
            }
            return Ok(());
        }
        writeln!(
            f,
            "deleted         {} row(s) in {} batch(es), {:.1} s{}",
            self.deleted,
            self.batches,
            self.seconds,
            if self.capped {
                " (cap reached: run again or raise cleanup.max_rows_per_run)"
            } else {
                ""
            }
        )
    }
}

/// A missing privilege names the cleanup role's grants, not the relay's.
fn privilege(e: tokio_postgres::Error) -> RelayError {
    match e.as_db_error() {
        Some(db) if db.code() == &tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE => {
            RelayError::Setup(format!(
                "{}: {} — the cleanup role (cleanup.dsn, --dsn, else source.dsn) needs SELECT and \
                 DELETE on the outbox table and SELECT on outboxd_slot_state (sql/roles.sql, \
                 outboxd_cleanup); a partitioned outbox needs its owner",
                db.code().code(),
                db.message()
            ))
        }
        _ => e.into(),
    }
}

/// The connection cleanup uses: `cleanup.dsn` when set, else the relay's.
pub async fn connect(cfg: &Config, dsn: Option<&str>) -> Result<Client, RelayError> {
    let mut cfg = cfg.clone();
    if let Some(dsn) = dsn.or(cfg.cleanup.dsn.as_deref()) {
        cfg.source.dsn = dsn.to_string();
        cfg.source.password = None;
    }
    let sql = source::sql_connect(&cfg).await?;
    sql.batch_execute("SET lock_timeout = '2s'; SET statement_timeout = '60s'")
        .await?;
    Ok(sql)
}

/// One cleanup run. Stops early when `stop` turns true.
pub async fn run_once(
    cfg: &Config,
    sql: &Client,
    dry_run: bool,
    stop: Option<&watch::Receiver<bool>>,
) -> Result<Report, RelayError> {
    let started = Instant::now();
    let c = &cfg.cleanup;
    let Some(retention) = c.retention else {
        return Err(RelayError::Setup(
            "cleanup.retention is not set: set how long outbox rows are kept (e.g. \"7d\"), at \
             least source.recovery_window"
                .into(),
        ));
    };
    let mut report = Report {
        dry_run,
        ..Report::default()
    };
    let bound = bounds::bounds(sql, &c.ignore_slots).await?;
    let b = match bound {
        bounds::Bound::NoState => {
            report.blocked = Some(
                "no relay has recorded a delivery mark yet (outboxd_slot_state is empty): \
                 nothing is known to be delivered"
                    .into(),
            );
            return Ok(report);
        }
        bounds::Bound::Blocked(why) => {
            report.blocked = Some(why);
            return Ok(report);
        }
        bounds::Bound::Ok(b) => b,
    };
    let mark = (b.slot.clone(), b.mark);
    let window = cfg.source.recovery_window.as_secs_f64();
    let row = sql
        .query_one(
            "SELECT now() - make_interval(secs => $1), $2::timestamptz - make_interval(secs => $3)",
            &[&retention.as_secs_f64(), &mark.1, &window],
        )
        .await?;
    let (by_retention, by_mark): (DateTime<Utc>, DateTime<Utc>) = (row.get(0), row.get(1));
    let cutoff = by_retention.min(by_mark);
    if by_mark < by_retention {
        report.held_back = Some(format!(
            "slot {:?}: delivered up to {} (minus source.recovery_window {}s)",
            mark.0,
            mark.1.to_rfc3339(),
            window
        ));
    }
    report.cutoff = Some(cutoff);
    // Every listed table ages by its own created_at; one that cannot be cleaned stops the run
    // before anything is deleted, naming the table (never some tables silently skipped).
    let multi = cfg.is_multi_table();
    let mut tables = Vec::new();
    for t in cfg.tables() {
        match aged(sql, &t).await? {
            Ok(ts_col) => tables.push((t, ts_col)),
            Err(why) => {
                report.blocked = Some(if multi {
                    format!("outbox table {}: {why}", t.label())
                } else {
                    why
                });
                report.cutoff = None;
                return Ok(report);
            }
        }
    }
    let run = Run {
        cfg,
        sql,
        cutoff,
        bounds: &b,
        dry_run,
        stop,
    };
    for (t, ts_col) in &tables {
        run.table(t, ts_col, multi, &mut report).await?;
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// The `created_at` column `t` ages by, or why it cannot be cleaned (no such column; a
/// partitioned table whose key is not it).
async fn aged(sql: &Client, t: &OutboxTable) -> Result<Result<String, String>, RelayError> {
    let names = t.columns.resolve()?;
    let Some(ts_col) = names.created_at else {
        return Ok(Err(
            "the outbox mapping has no created_at column (source.columns.created_at): rows \
             cannot be aged"
                .into(),
        ));
    };
    if partitions::is_partitioned(sql, &t.schema, &t.name).await? {
        if let Err(why) = partitions::check_key(sql, &t.schema, &t.name, &ts_col).await? {
            return Ok(Err(why));
        }
    }
    Ok(Ok(ts_col))
}

/// One run's settings, shared by its tables.
struct Run<'a> {
    cfg: &'a Config,
    sql: &'a Client,
    cutoff: DateTime<Utc>,
    bounds: &'a bounds::Bounds,
    dry_run: bool,
    stop: Option<&'a watch::Receiver<bool>>,
}

impl Run<'_> {
    /// Cleans one table (the cap, `cleanup.max_rows_per_run`, is the run's: `report.deleted`
    /// counts every table's rows).
    async fn table(
        &self,
        t: &OutboxTable,
        ts_col: &str,
        multi: bool,
        report: &mut Report,
    ) -> Result<(), RelayError> {
        let (sql, cutoff, b, c) = (self.sql, self.cutoff, self.bounds, &self.cfg.cleanup);
        if !self.dry_run && report.deleted >= c.max_rows_per_run {
            report.capped = true; // a table the cap left for the next run
            return Ok(());
        }
        let (schema, table) = (&t.schema, &t.name);
        let qualified = format!("{}.{}", quote_ident(schema), quote_ident(table));
        let ts = quote_ident(ts_col);
        if partitions::is_partitioned(sql, schema, table).await? {
            let part = partitions::Partitioned {
                schema,
                table,
                cutoff,
                bounds: b,
            };
            let dropped = if self.dry_run {
                part.droppable(sql)
                    .await?
                    .into_iter()
                    .map(|(s, n)| format!("{s}.{n}"))
                    .collect()
            } else {
                part.drop_before(sql, privilege).await?
            };
            report.partitions.extend(dropped);
            return Ok(());
        }
        if self.dry_run {
            let n: i64 = sql
                .query_one(
                    &format!(
                        "SELECT count(*) FROM {qualified} AS o WHERE o.{ts} < $1 AND {}",
                        b.delivered
                    ),
                    &[&cutoff],
                )
                .await
                .map_err(privilege)?
                .get(0);
            report.eligible = Some(report.eligible.unwrap_or(0) + n);
            if multi {
                tracing::info!(table = %t.label(), rows = n, "cleanup dry run");
            }
            return Ok(());
        }
        // Cursor: the batches walk the index forward. No row lock beforehand (FOR UPDATE would
        // need UPDATE, which the cleanup role must not have): a concurrent run's DELETE waits at
        // most lock_timeout on the same rows and then skips them, already gone.
        // Every batch re-checks that no recovery or replay started meanwhile (`idle`), and takes
        // only rows older than every slot's delivered_xid, whatever their created_at says.
        let delete = format!(
            "DELETE FROM {qualified} WHERE ctid = ANY(ARRAY(\
               SELECT o.ctid FROM {qualified} AS o WHERE o.{ts} >= $1 AND o.{ts} < $2 AND {} \
                 AND {} \
               ORDER BY o.{ts} LIMIT $3)) \
             RETURNING {ts}",
            b.delivered, b.idle
        );
        // 0001-01-01: before any real row, and within Postgres's range (chrono's MIN is not).
        let mut cursor = DateTime::<Utc>::from_timestamp(-62_135_596_800, 0).unwrap_or_default();
        while report.deleted < c.max_rows_per_run {
            if self.stop.is_some_and(|s| *s.borrow()) {
                break;
            }
            let n = (c.max_rows_per_run - report.deleted).min(c.batch_size.max(1) as u64) as i64;
            let rows = sql
                .query(&delete, &[&cursor, &cutoff, &n])
                .await
                .map_err(privilege)?;
            report.batches += 1;
            report.deleted += rows.len() as u64;
            if let Some(max) = rows.iter().map(|r| r.get::<_, DateTime<Utc>>(0)).max() {
                cursor = cursor.max(max);
            }
            crate::fail::hit("cleanup_batch");
            if (rows.len() as i64) < n {
                break;
            }
            if report.deleted >= c.max_rows_per_run {
                // Capped only if something is left (one index probe).
                report.capped = sql
                    .query_one(
                        &format!(
                            "SELECT EXISTS (SELECT 1 FROM {qualified} AS o \
                             WHERE o.{ts} >= $1 AND o.{ts} < $2 AND {})",
                            b.delivered
                        ),
                        &[&cursor, &cutoff],
                    )
                    .await
                    .map_err(privilege)?
                    .get(0);
                break;
            }
            tokio::time::sleep(Duration::from_millis(c.pause_ms)).await;
        }
        Ok(())
    }
}

/// `cleanup.every`: the loop inside `outboxd run`. Failures are logged and retried at the next
/// tick; they never touch the relay.
pub fn spawn(
    cfg: &Config,
    mut shutdown: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let every = cfg.cleanup.every.filter(|d| !d.is_zero())?;
    cfg.cleanup.retention?;
    let cfg = cfg.clone();
    Some(tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = shutdown.changed() => return,
            }
            let result = async {
                // The tables the patterns match now (crate::slot::join), like `outboxd cleanup`.
                let cfg = crate::slot::join::view(&cfg).await;
                let sql = connect(&cfg, None).await?;
                run_once(&cfg, &sql, false, Some(&shutdown)).await
            }
            .await;
            match result {
                Ok(r) if r.blocked.is_some() => {
                    tracing::warn!(
                        reason = r.blocked.as_deref().unwrap_or(""),
                        "cleanup: nothing deleted"
                    )
                }
                Ok(r) => tracing::info!(
                    deleted = r.deleted,
                    batches = r.batches,
                    partitions_dropped = r.partitions.len(),
                    capped = r.capped,
                    cutoff = %r.cutoff.map(|c| c.to_rfc3339()).unwrap_or_default(),
                    seconds = r.seconds,
                    "cleanup"
                ),
                Err(e) => tracing::warn!(
                    error = %cfg.redactor.scrub(&e.to_string()),
                    "cleanup failed; retrying at the next tick"
                ),
            }
        }
    }))
}
