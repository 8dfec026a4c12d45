//! Paying what late-joining tables are owed: wait for the writers that straddled the join,
//! prove (once, for all of them) that the statistics show nothing gone, then republish each
//! table's rows through the session's stages and record it as joined.

use super::{owed, partitions, Out};
use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::source;
use crate::relay::table_reader::{self, Flow, NoHooks, TableReader};
use crate::slot::state as slot_state;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_postgres::Client;

/// A table (or partition) that joined after it held rows: the rows of `rels` matching
/// `filter`, read through `table`; `done` is recorded as joined once they are acknowledged.
pub(super) struct Debt {
    pub(super) table: OutboxTable,
    pub(super) rels: Vec<u32>,
    pub(super) filter: String,
    pub(super) done: Vec<u32>,
}

/// Republishes every debt, after the writers that straddled the joins ended and the
/// statistics prove nothing is gone — one statistics settle for all of them (issue 56: twenty
/// tenants joining waited 11 s each, one after another, while nothing else was delivered).
/// `Ok(false)`: shutdown first.
pub(super) async fn pay(
    cfg: &Config,
    out: &mut Out<'_>,
    lsn: u64,
    debts: &[Debt],
) -> Result<bool, RelayError> {
    if debts.is_empty() {
        return Ok(true);
    }
    for d in debts {
        wait_for_writers(out.st.sql(), &d.rels, &d.table, out.shutdown).await?;
    }
    let checks: Vec<owed::WholeCheck> = debts
        .iter()
        .map(|d| owed::WholeCheck {
            label: d.table.label(),
            qualified: partitions::qualified(&d.table),
            relids: d.rels.clone(),
            filter: d.filter.clone(),
        })
        .collect();
    if !owed::proven_whole(cfg, out.st.sql(), &checks, out.shutdown).await? {
        return Ok(false);
    }
    for d in debts {
        if !republish(cfg, &d.table, out, lsn, &d.filter).await? {
            return Ok(false);
        }
        slot_state::add_joined(out.st.sql(), &cfg.source.slot, &d.done).await?;
    }
    Ok(true)
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

/// Every row of `t` matching `filter`, under one snapshot, through the stages (the recovery
/// path).
async fn republish(
    cfg: &Config,
    t: &OutboxTable,
    out: &mut Out<'_>,
    lsn: u64,
    filter: &str,
) -> Result<bool, RelayError> {
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
    let mut r = TableReader::cursor(t, reader, filter, &order, lsn, mark, "join_produced").await?;
    let flow = r
        .publish(
            cfg,
            out.st,
            out.producer,
            out.acks,
            out.shutdown,
            &mut NoHooks,
        )
        .await?;
    if flow == Flow::Shutdown {
        return Ok(false);
    }
    r.client().batch_execute("COMMIT").await?;
    tracing::warn!(table = %t.label(), events = r.sent(), "republished the rows the table held when it joined the publication: every one is acknowledged by the broker");
    Ok(true)
}
