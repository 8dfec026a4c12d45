//! Paying what late-joining tables are owed, while the session streams on: off its path, wait
//! for the writers that straddled the join and prove (once, for all of them) that the
//! statistics show nothing gone ([`settle`]); then, in the session, hand each table's rows to
//! the stages ([`feed`]) before the events it held of the table, and record the table as
//! joined once they are acknowledged ([`record`]).

use super::{owed, partitions, Out};
use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::ack::Seq;
use crate::relay::source;
use crate::relay::table_reader::{self, Flow, NoHooks, TableReader};
use crate::slot::state as slot_state;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_postgres::Client;

/// A table (or partition) that joined after it held rows: the rows of `rels` matching
/// `filter`, read through `table`; `done` is recorded as joined once they are acknowledged.
#[derive(Clone)]
pub struct Debt {
    pub(super) table: OutboxTable,
    pub(super) rels: Vec<u32>,
    pub(super) filter: String,
    pub(super) done: Vec<u32>,
}

impl Debt {
    /// The table's `schema.table`: the session holds its streamed events by it.
    pub fn label(&self) -> String {
        self.table.label()
    }
}

/// Off the session's path, on a connection of its own: waits until the writers that straddled
/// the joins ended, then proves that the statistics show nothing gone — one statistics settle
/// for every debt (issue 56: twenty tenants joining waited 11 s each, one after another, while
/// nothing else was delivered). `Ok(false)`: shutdown first.
pub async fn settle(
    cfg: Config,
    debts: Vec<Debt>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<bool, RelayError> {
    let cfg = &cfg;
    let sql = source::sql_connect(cfg).await?;
    for d in &debts {
        wait_for_writers(&sql, &d.rels, &d.table, &mut shutdown).await?;
    }
    let mut checks = Vec::with_capacity(debts.len());
    for d in &debts {
        // Read where the table is now (renamed out since it joined: issue 56, F1).
        let now = wherever(&sql, d).await?;
        checks.push(owed::WholeCheck {
            label: d.table.label(),
            qualified: partitions::qualified(&now),
            relids: d.rels.clone(),
            filter: d.filter.clone(),
        });
    }
    owed::proven_whole(cfg, &sql, &checks, &mut shutdown).await
}

/// Once every event before the debt's rows' end is acknowledged: the table is joined.
pub async fn record(cfg: &Config, sql: &Client, d: &Debt) -> Result<(), RelayError> {
    slot_state::add_joined(sql, &cfg.source.slot, &d.done).await?;
    tracing::info!(table = %d.table.label(), "the rows the table held when it joined the publication are acknowledged by the broker: joined");
    Ok(())
}

/// Waits until every transaction holding more than a read lock on one of `oids` now has ended.
async fn wait_for_writers(
    sql: &Client,
    oids: &[u32],
    t: &OutboxTable,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let writers: Vec<String> = sql
        .query(
            "SELECT DISTINCT virtualtransaction FROM pg_locks WHERE locktype = 'relation' \
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               AND relation = ANY($1) AND mode <> 'AccessShareLock' \
               AND pid IS DISTINCT FROM pg_backend_pid()",
            &[&oids],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let started = Instant::now();
    let mut said = Instant::now();
    loop {
        let left: i64 = sql
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' \
                   AND relation = ANY($1) AND virtualtransaction = ANY($2)",
                &[&oids, &writers],
            )
            .await?
            .get(0);
        if left == 0 {
            return Ok(());
        }
        if said.elapsed() > Duration::from_secs(10) {
            said = Instant::now();
            tracing::warn!(table = %t.label(), waiting_s = started.elapsed().as_secs(), "waiting for transactions that wrote the joining table before it joined (pg_locks) to end");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            _ = shutdown.changed() => return Ok(()),
        }
    }
}

/// In the session, between transactions: every row of the debt, under one snapshot, handed
/// to the stages in per-aggregate version order (the recovery path: same router, parking,
/// records), at `lsn` (at or below anything still in flight). Returns the sequence number past
/// the last one: once every event before it is acknowledged, [`record`] it. `None`: shutdown
/// first.
pub async fn feed(
    cfg: &Config,
    out: &mut Out<'_>,
    lsn: u64,
    d: &Debt,
) -> Result<Option<Seq>, RelayError> {
    // By identity: the table may have been renamed since it joined (even out of the pattern):
    // its rows are read where it is now and relayed as the table that joined (issue 56).
    let current = wherever(out.st.sql(), d).await?;
    if current.label() != d.table.label() {
        out.st.alias(d.rels[0], &d.table.label());
    }
    let t = &current;
    // The synthetic transactions' commit time: the delivery mark as it is (the stream may
    // be behind the join, so nothing newer is proven delivered by this).
    let mark = slot_state::load(out.st.sql(), &cfg.source.slot)
        .await?
        .and_then(|s| s.delivery_mark)
        .unwrap_or_else(chrono::Utc::now);
    let reader = source::sql_connect(cfg).await?;
    TableReader::prepare_session(&reader).await?;
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await?;
    let names = t.columns.resolve()?;
    let (relation, _) = table_reader::relation_of(t, &reader).await?;
    let order = crate::slot::recovery::version_order(&names, &reader, &relation).await?;
    let mut r =
        TableReader::cursor(t, reader, &d.filter, &order, lsn, mark, "join_produced").await?;
    let flow = r
        .feed(
            cfg,
            out.st,
            out.producer,
            out.acks,
            out.shutdown,
            &mut NoHooks,
        )
        .await?;
    if flow == Flow::Shutdown {
        return Ok(None);
    }
    r.client().batch_execute("COMMIT").await?;
    tracing::warn!(table = %d.table.label(), events = r.sent(), "republished the rows the table held when it joined the publication (its streamed events follow them)");
    Ok(Some(out.st.in_flight().next_seq()))
}

/// The debt's table where it is now: renamed or moved since it joined, its current name, and
/// the stages map that relation (by oid) to the table that joined. Dropped: its rows exist
/// nowhere the relay can read, and the relay stops naming it rather than run past them.
async fn wherever(sql: &Client, d: &Debt) -> Result<OutboxTable, RelayError> {
    if d.filter != "TRUE" {
        return Ok(d.table.clone()); // a partition's debt, read through its root
    }
    let oid = d.rels[0];
    let row = sql
        .query_opt(
            "SELECT n.nspname::text, c.relname::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
            &[&oid],
        )
        .await?;
    let Some(row) = row else {
        return Err(RelayError::Setup(format!(
            "outbox table {} joined the relayed set holding rows that were never streamed, \
             and was dropped before they were republished: they exist nowhere the relay can \
             read. Re-emit them from the application if they matter, then start the relay \
             again",
            d.table.label()
        )));
    };
    let (schema, name): (String, String) = (row.get(0), row.get(1));
    if (schema.as_str(), name.as_str()) == (d.table.schema.as_str(), d.table.name.as_str()) {
        return Ok(d.table.clone());
    }
    tracing::warn!(table = %d.table.label(), now = %format!("{schema}.{name}"), "the table that joined owing rows was renamed since: reading them where it is now");
    Ok(OutboxTable {
        schema,
        name,
        ..d.table.clone()
    })
}
