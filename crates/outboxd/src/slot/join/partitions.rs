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
//!
//! A partition that leaves (`DETACH PARTITION`, `DROP TABLE`) while rows it committed as a
//! partition are still ahead of the slot: through such a publication those rows come under its
//! own oid, and a later session, which no longer finds it under the root, would read them as
//! another table's and confirm past them. So every session records the partitions it maps in
//! the slot's state row ([`remember`]), and keeps mapping one that left until the slot confirmed
//! past the WAL position where it was first seen gone: its DETACH or DROP committed before that,
//! so every row it holds as a partition is before it too.

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::model::lsn::fmt_lsn;
use crate::relay::lsn::parse_lsn;
use crate::relay::source::quote_ident;
use crate::slot::state::{self as slot_state, SeenPartition};
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

/// Records the partitions `cfg` maps now (its `partitions`) in the slot's state row, and
/// returns those recorded before that left since and are still owed a read as their root's
/// (see the module's prose): they become `left_partitions`. Only through a publication without
/// `publish_via_partition_root` (with it, a partition's rows come as the root's whatever
/// happens to the partition). Nothing recorded yet (a first session: no row), or a state
/// table this role could not upgrade (warned): nothing to keep.
pub(crate) async fn remember(cfg: &Config, sql: &Client) -> Result<Vec<(u32, String)>, RelayError> {
    if via_root(cfg, sql).await? != Some(false) {
        return Ok(Vec::new());
    }
    let slot = &cfg.source.slot;
    let (before, acked) = match slot_state::partitions_seen(sql, slot).await {
        Ok(Some(found)) => found,
        Ok(None) => return Ok(Vec::new()),
        Err(e @ RelayError::Setup(_)) => return Err(e),
        Err(e) => {
            tracing::warn!(error = %e, "outboxd_slot_state.partitions_seen cannot be read: a partition detached while rows of it wait in the slot is read as another table's (run `outboxd init` as the admin role to add the column)");
            return Ok(Vec::new());
        }
    };
    let (now, left) = seen_after(&cfg.partitions, &before, acked, || async {
        let at: String = sql
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await?
            .get(0);
        parse_lsn(&at)
    })
    .await?;
    if now != before {
        slot_state::set_partitions_seen(sql, slot, &now).await?;
    }
    for (oid, root) in &left {
        tracing::info!(partition = oid, table = %root, "a partition left its outbox table while rows of it may be ahead of the slot: still read as the table's until the slot passes where it was seen gone");
    }
    Ok(left)
}

/// [`remember`]'s bookkeeping: the record to keep (`current` partitions, and those of `before`
/// that left, stamped with `here()` when first seen gone, until `acked` passed that), and the
/// ones that left and are still owed.
async fn seen_after<F, Fut>(
    current: &[(u32, String)],
    before: &[SeenPartition],
    acked: u64,
    here: F,
) -> Result<(Vec<SeenPartition>, Vec<(u32, String)>), RelayError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<u64, RelayError>>,
{
    let mut now: Vec<SeenPartition> = current
        .iter()
        .map(|(oid, root)| SeenPartition {
            oid: *oid,
            root: root.clone(),
            left_at: None,
        })
        .collect();
    let mut left = Vec::new();
    for p in before
        .iter()
        .filter(|p| !current.iter().any(|(o, _)| *o == p.oid))
    {
        let at = match &p.left_at {
            Some(at) => parse_lsn(at)?,
            None => here().await?,
        };
        if at <= acked {
            continue;
        }
        left.push((p.oid, p.root.clone()));
        now.push(SeenPartition {
            left_at: Some(fmt_lsn(at)),
            ..p.clone()
        });
    }
    Ok((now, left))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(oid: u32, left_at: Option<&str>) -> SeenPartition {
        SeenPartition {
            oid,
            root: "t.outbox".into(),
            left_at: left_at.map(String::from),
        }
    }

    /// A partition that left is stamped once, kept while the slot is before the stamp, and
    /// forgotten once it passed; current partitions are recorded as they are.
    #[tokio::test]
    async fn a_partition_that_left_is_kept_until_the_slot_passed_where_it_went() {
        let current = vec![(1, "t.outbox".to_string())];
        let here = || async { Ok(0x500) };
        let (now, left) = seen_after(&current, &[seen(1, None), seen(2, None)], 0x100, here)
            .await
            .unwrap();
        assert_eq!(now, [seen(1, None), seen(2, Some("0/500"))]);
        assert_eq!(left, [(2, "t.outbox".to_string())]);
        // Stamped already: the stamp stays (not the later position).
        let later = || async { Ok(0x900) };
        let (again, left) = seen_after(&current, &now, 0x400, later).await.unwrap();
        assert_eq!(again, now);
        assert_eq!(left.len(), 1);
        // The slot passed it: forgotten.
        let (pruned, left) = seen_after(&current, &now, 0x500, later).await.unwrap();
        assert_eq!(pruned, [seen(1, None)]);
        assert!(left.is_empty());
    }
}
