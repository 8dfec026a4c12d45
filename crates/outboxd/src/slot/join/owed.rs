//! What a table (or a partition) that joins late is owed, from the catalog alone, and whether
//! what it still holds is everything it was owed (the parent module's "Exactness").
//!
//! # Catalog facts (measured on 15.18)
//! - The table's system-column rows in `pg_attribute` (`attnum = -1`, `ctid`) are written by
//!   the command that creates the table and never rewritten: their `xmin` is the creating
//!   transaction, whatever happened since.
//! - `ALTER TABLE … RENAME` and `… SET SCHEMA` rewrite the table's `pg_class` and `pg_type`
//!   rows in their own transaction. With the event trigger, that transaction also writes the
//!   `pg_publication_rel` row, so "the type row and the publication row were written together"
//!   (the test before issue 39) holds for a table whose rows predate the rename: it is not
//!   evidence of a table born in the publication. The creation's `xmin` above is.
//! - `ATTACH PARTITION` writes the partition's `pg_inherits` row; `CREATE TABLE … PARTITION OF`
//!   writes it in the creating command. A partition created as one is streamed from its first
//!   row once its root is; one attached later held rows that were never streamed.
//! - `pg_stat_user_tables` counts inserts and deletes (of committed and rolled-back
//!   transactions alike); a backend flushes its counts within about a second when it keeps
//!   working and within `PGSTAT_IDLE_INTERVAL` (10 s) when it goes idle (Postgres 15+). On
//!   Postgres 14 (the statistics collector) a backend that goes idle less than 500 ms after its
//!   previous report keeps its counts until its next transaction (measured: 11 s later, still
//!   nothing). So the heap speaks too: a table that holds no row but whose heap has pages had
//!   rows (deleted, or rolled back) — until a vacuum truncates them, by which time the counts
//!   have long been reported.

use crate::config::Config;
use crate::error::RelayError;
use crate::relay::source::quote_ident;
use std::time::Duration;
use tokio::sync::watch;
use tokio_postgres::Client;

/// How long a backend may keep its statistics unflushed (Postgres 15+: PGSTAT_IDLE_INTERVAL,
/// 10 s, plus a margin): what [`proven_whole`] waits before it trusts a clean count.
const STATS_SETTLE: Duration = Duration::from_secs(11);

/// One table's (or partition's) verdict.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Owed {
    Nothing,
    EarlierRows,
}

/// Is anything of table `oid` (`qualified`, a quoted `schema.table`) missing from the stream?
/// `discovered`: matched by a pattern (not listed by name).
///
/// Born in the publication, owed nothing: the name and schema are the creation's (the type
/// row is the creation's, so it matched the pattern from its first row) and either the
/// publication is `FOR ALL TABLES` (a pattern's table only: a listed table's rows were decoded
/// and ignored before it was listed) or the publication row was written by the creating
/// transaction after every row that transaction wrote. Anything else is owed its rows.
/// `via_root`: the publication streams partitions as their root; without it, a partitioned
/// table's rows came under partition names the session may not have known yet (read as
/// another table's and confirmed past), so a partitioned table that joins is owed its rows.
pub(super) async fn table(
    cfg: &Config,
    sql: &Client,
    oid: u32,
    qualified: &str,
    discovered: bool,
    via_root: bool,
) -> Result<Owed, RelayError> {
    let row = sql
        .query_opt(
            "SELECT p.puballtables, COALESCE(ty.xmin, c.xmin)::text = b.born \
                    AND (c.relkind <> 'p' OR $3), \
                    pr.xmin::text = b.born, b.born, pr.cmin::text::bigint \
             FROM pg_publication p JOIN pg_class c ON c.oid = $2 \
             CROSS JOIN LATERAL (SELECT a.xmin::text AS born FROM pg_attribute a \
                 WHERE a.attrelid = c.oid AND a.attnum = -1) b \
             LEFT JOIN pg_type ty ON ty.oid = c.reltype \
             LEFT JOIN pg_publication_rel pr ON pr.prpubid = p.oid AND pr.prrelid = c.oid \
             WHERE p.pubname = $1",
            &[&cfg.source.publication, &oid, &via_root],
        )
        .await?;
    let Some(row) = row else {
        return Ok(Owed::EarlierRows);
    };
    let (all_tables, unchanged) = (row.get::<_, bool>(0), row.get::<_, bool>(1));
    if !unchanged {
        // Renamed or moved since it was created: its rows before that were not the pattern's
        // (or partitioned, published under its partitions' names).
        return Ok(Owed::EarlierRows);
    }
    if all_tables {
        return Ok(if discovered {
            Owed::Nothing
        } else {
            Owed::EarlierRows
        });
    }
    let (Some(true), xid, Some(cmin)) = (
        row.get::<_, Option<bool>>(2),
        row.get::<_, String>(3),
        row.get::<_, Option<i64>>(4),
    ) else {
        return Ok(Owed::EarlierRows);
    };
    rows_before(sql, qualified, &xid, cmin).await
}

/// Is anything of partition `oid` (a member of a partitioned outbox `root`, quoted) missing
/// from the stream, its root being streamed? Nothing when it was created as a partition (its
/// `pg_inherits` row is its creation's) and its creating transaction wrote none of its rows
/// before that, and the publication streams it as its root (`via_root`; see [`table`]).
pub(super) async fn partition(
    sql: &Client,
    oid: u32,
    root: &str,
    via_root: bool,
) -> Result<Owed, RelayError> {
    if !via_root {
        return Ok(Owed::EarlierRows);
    }
    let row = sql
        .query_opt(
            "SELECT i.xmin::text = (SELECT a.xmin::text FROM pg_attribute a \
                 WHERE a.attrelid = i.inhrelid AND a.attnum = -1), \
                    i.xmin::text, i.cmin::text::bigint \
             FROM pg_inherits i WHERE i.inhrelid = $1",
            &[&oid],
        )
        .await?;
    match row {
        Some(r) if r.get::<_, bool>(0) => {
            let filter = format!("o.tableoid = {oid}::oid AND ");
            rows_before_where(sql, root, &filter, &r.get::<_, String>(1), r.get(2)).await
        }
        _ => Ok(Owed::EarlierRows),
    }
}

async fn rows_before(
    sql: &Client,
    qualified: &str,
    xid: &str,
    cmin: i64,
) -> Result<Owed, RelayError> {
    rows_before_where(sql, qualified, "", xid, cmin).await
}

/// Did transaction `xid` write a row (matching `filter`, over `o`) before command `cmin`?
async fn rows_before_where(
    sql: &Client,
    qualified: &str,
    filter: &str,
    xid: &str,
    cmin: i64,
) -> Result<Owed, RelayError> {
    let q = format!(
        "SELECT EXISTS (SELECT 1 FROM {qualified} o WHERE {filter}o.xmin = '{}'::xid \
             AND o.cmin::text::bigint < {cmin})",
        xid.replace('\'', "")
    );
    let before: bool = sql.query_one(&q, &[]).await?.get(0);
    Ok(if before {
        Owed::EarlierRows
    } else {
        Owed::Nothing
    })
}

/// Before republishing what late-joining tables hold (each [`WholeCheck`], all read twice
/// around one settle): Err naming the table, the reason and the fix when
/// the statistics show rows deleted from it (an application that deletes its outbox rows,
/// Debezium's pattern), or it holds none in a heap that has pages, since those cannot be
/// republished and may never have been streamed; rolled-back inserts beside held rows are no
/// debt. A clean count is trusted only once every backend flushed what it wrote before ([`STATS_SETTLE`]; `Ok(false)`: shutdown first).
pub(super) async fn proven_whole(
    cfg: &Config,
    sql: &Client,
    checks: &[WholeCheck],
    shutdown: &mut watch::Receiver<bool>,
) -> Result<bool, RelayError> {
    for settled in [false, true] {
        if settled {
            let tables: Vec<&str> = checks.iter().map(|c| c.label.as_str()).collect();
            tracing::info!(tables = %tables.join(", "), wait_s = STATS_SETTLE.as_secs(), "waiting for the statistics of writes before the join to be flushed (pg_stat_user_tables) before republishing");
            tokio::select! {
                _ = tokio::time::sleep(STATS_SETTLE) => {}
                _ = shutdown.changed() => return Ok(false),
            }
        }
        for c in checks {
            let seen = read_seen(sql, c).await?;
            // Fewer rows than inserts alone is what a rolled-back insert leaves (issue 56: one
            // rolled-back row in a late tenant stopped every tenant): no debt, since deletes
            // are counted too. An empty heap with pages stays suspect: on Postgres 14 an idle
            // insert-then-delete writer may never flush its counts (module docs).
            if seen.del > 0 || (seen.held == 0 && seen.heap > 0) {
                return Err(RelayError::Setup(unprovable(cfg, &c.label, &seen)));
            }
        }
    }
    Ok(true)
}

/// One late-joining table's (or partition's) rows for [`proven_whole`]: the rows of `relids`
/// (leaves included), read through `qualified` (quoted) where `filter`.
pub(super) struct WholeCheck {
    pub label: String,
    pub qualified: String,
    pub relids: Vec<u32>,
    pub filter: String,
}

/// The count and the statistics of one moment (one statement).
async fn read_seen(sql: &Client, c: &WholeCheck) -> Result<Seen, RelayError> {
    let q = format!(
        "SELECT COALESCE(sum(s.n_tup_ins), 0)::bigint, COALESCE(sum(s.n_tup_del), 0)::bigint, \
                (SELECT count(*) FROM {} o WHERE {}), \
                (SELECT COALESCE(sum(pg_relation_size(r::regclass)), 0)::bigint \
                 FROM unnest($1::oid[]) r) \
         FROM pg_stat_user_tables s WHERE s.relid = ANY($1::oid[])",
        c.qualified, c.filter
    );
    let r = sql.query_one(&q, &[&c.relids]).await?;
    Ok(Seen {
        ins: r.get(0),
        del: r.get(1),
        held: r.get(2),
        heap: r.get(3),
    })
}

/// What [`proven_whole`] read: inserts and deletes counted, rows held, heap bytes.
struct Seen {
    ins: i64,
    del: i64,
    held: i64,
    heap: i64,
}

/// The halt's message: what the statistics show, why the relay stops, what the operator does.
fn unprovable(cfg: &Config, label: &str, seen: &Seen) -> String {
    let Seen {
        ins,
        del,
        held,
        heap,
    } = seen;
    let state = format!(
        "{}.outboxd_slot_state",
        quote_ident(&cfg.source.relay_schema)
    );
    format!(
        "outbox table {label} joined publication {publication} after rows were written to it, \
         and it no longer holds every row written (pg_stat_user_tables: {ins} inserted, {del} \
         deleted; {held} rows held now, in {heap} bytes of heap): the rows it held before the join were never streamed, and \
         those deleted (or truncated, or rolled back) cannot be republished from the table, so \
         events may be lost. The relay stops rather than record the table as joined. Fix: \
         tables whose application deletes its outbox rows must join in the transaction that \
         creates them — run `outboxd init --config FILE` as a superuser (the event trigger \
         outboxd_join_{publication}) before creating such tenants. For this table: re-emit \
         what was lost from the application if anything was; record it as joined (UPDATE \
         {state} SET joined_tables = array_append(joined_tables, '{label}'::regclass::oid) \
         WHERE slot_name = '{slot}') and start the relay again; then republish the {held} \
         row(s) it still holds, which recording it does not do: outboxd replay --config FILE \
         --table {label} --since <its oldest row's created_at> --until <now> --reason \
         \"held when {label} joined late\" --execute (or the event ids instead of the range). \
         Or take it out of the publication",
        publication = cfg.source.publication,
        slot = cfg.source.slot.replace('\'', "''"),
    )
}
