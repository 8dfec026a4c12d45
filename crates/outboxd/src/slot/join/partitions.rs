//! Partitioned outbox tables (issue 39): which partitions each of a session's tables has, and
//! how the publication streams their rows.
//!
//! A publication with `publish_via_partition_root` (every one `outboxd init` creates) streams
//! a partition's rows as its root's: one Relation message, the root's name and oid. Without it
//! (a publication that is not outboxd's to change) the rows come under each partition's name
//! and oid, and `pg_publication_tables` lists the partitions, not the root; the session maps
//! every partition to its root's mapping and topic ([`crate::config::Config::partitions`],
//! read by [`crate::relay::outboxes::Outboxes`]). A partition attached while a session
//! streams is noticed with the next state write ([`attached`]); the next session republishes
//! what it held before ([`super::owed::partition`]).

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::source::quote_ident;
use tokio_postgres::Client;

/// `schema.table`, quoted.
pub(crate) fn qualified(t: &OutboxTable) -> String {
    format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name))
}

/// Every member below the root (partitions and sub-partitioned ones, by oid) of each of
/// `tables` that is partitioned, with the root's label.
pub(crate) async fn members(
    sql: &Client,
    tables: &[OutboxTable],
) -> Result<Vec<(u32, String)>, RelayError> {
    let names: Vec<String> = tables.iter().map(qualified).collect();
    let labels: Vec<String> = tables.iter().map(OutboxTable::label).collect();
    let rows = sql
        .query(
            "SELECT pt.relid::oid, r.label FROM unnest($1::text[], $2::text[]) r(name, label) \
             CROSS JOIN LATERAL pg_partition_tree(to_regclass(r.name)) pt \
             WHERE pt.level > 0 ORDER BY 1",
            &[&names, &labels],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The leaves (tables that hold rows) under `oid`, itself when it is one.
pub(super) async fn leaves(sql: &Client, oid: u32) -> Result<Vec<u32>, RelayError> {
    let rows = sql
        .query(
            "SELECT relid::oid FROM pg_partition_tree($1::oid::regclass) WHERE isleaf",
            &[&oid],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// While a session streams: a partition that joined one of its tables since it started
/// (`ATTACH PARTITION`, or `CREATE TABLE … PARTITION OF`). Says which. A partition that left
/// (detached, dropped) does not end the session: rows it committed before may still be ahead
/// in the stream, and without `publish_via_partition_root` only this session's mapping (by
/// oid, from when it was a partition) reads them; a detached table's later rows are then read
/// as the outbox's until the session ends (spurious events, never a loss).
pub(super) async fn attached(cfg: &Config, sql: &Client) -> Result<Option<String>, RelayError> {
    let now = members(sql, &cfg.tables()).await?;
    Ok(now
        .into_iter()
        .find(|(oid, _)| !cfg.partitions.iter().any(|(o, _)| o == oid))
        .map(|(oid, root)| format!("a partition (oid {oid}) joined outbox table {root}")))
}

/// How the publication streams partitioned tables (`check`): `Some(true)` as their root
/// (`publish_via_partition_root`), `Some(false)` under each partition's name; `None` without
/// the publication.
pub async fn via_root(cfg: &Config, sql: &Client) -> Result<Option<bool>, RelayError> {
    Ok(sql
        .query_opt(
            "SELECT pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&cfg.source.publication],
        )
        .await?
        .map(|r| r.get(0)))
}
