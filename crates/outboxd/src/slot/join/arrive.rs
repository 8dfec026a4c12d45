//! Tables that join while a session streams (issue 56): found by a state write
//! ([`newcomers`]) or by their Relation message, taken into the running session, and assessed
//! ([`assess`]): owed nothing (born in the publication) or a debt the session pays while it
//! streams (`crate::supervisor::joining`).

use super::owed::{self, Owed};
use super::{discover, oid_of, partitions, unreadable, Debt};
use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::slot::state as slot_state;
use tokio_postgres::Client;

/// While a session streams: the plain tables a pattern matches that joined the publication
/// and are not the session's yet (nor among `known`, those it took in already), to take into
/// the running session ([`assess`]). Partitioned ones are left to [`changed`] (a new session
/// resolves their partitions).
pub async fn newcomers(
    cfg: &Config,
    sql: &Client,
    known: &[String],
) -> Result<Vec<OutboxTable>, RelayError> {
    if !cfg.has_patterns() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for f in discover(cfg, sql).await? {
        let label = format!("{}.{}", f.schema, f.table);
        if !f.published || known.contains(&label) {
            continue;
        }
        let found = [(f.schema, f.table, f.entry)];
        let Some(t) = cfg.with_discovered(&found).tables().pop() else {
            continue;
        };
        // Renamed away since `discover` found it: nothing (no error, no restart).
        let oid = super::identities(sql, std::slice::from_ref(&t)).await?[0];
        if let Some(oid) = oid {
            if crate::relay::source::plain_table(sql, oid).await? {
                out.push(t);
            }
        }
    }
    Ok(out)
}

/// A pattern's table that left the publication (`Stages::on_left`): no longer recorded as
/// joined, so what it holds is owed when it is back, and added back to the publication, whose
/// guard message takes it into the session again. `Ok(false)`: the relay's role may not add
/// it (the whole publication's change then, as before). A table dropped or renamed since is
/// left alone: the state writes see to it.
pub async fn put_back(
    cfg: &Config,
    sql: &Client,
    t: &OutboxTable,
    oid: u32,
) -> Result<bool, RelayError> {
    slot_state::remove_joined(sql, &cfg.source.slot, &[oid]).await?;
    let now: Option<String> = sql
        .query_opt(
            "SELECT n.nspname::text || '.' || c.relname::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
            &[&oid],
        )
        .await?
        .map(|r| r.get(0));
    if now.as_deref() != Some(t.label().as_str()) {
        return Ok(true);
    }
    match crate::slot::publication::add_table(cfg, sql, &t.schema, &t.name).await {
        Ok(()) => Ok(true),
        // Someone put it back first: its join message takes it in all the same.
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => Ok(true),
        Err(e) => {
            tracing::warn!(table = %t.label(), error = %e, "a table that left the publication could not be put back by the relay");
            Ok(false)
        }
    }
}

/// What a table that joined the running session is owed: `None` when it was born in the
/// publication (recorded as joined now), or was recorded before; otherwise its debt. `oid`:
/// the relation the stream named (it may be called otherwise by now); `None`, by its name.
pub async fn assess(
    cfg: &Config,
    sql: &Client,
    t: &OutboxTable,
    oid: Option<u32>,
) -> Result<Option<Debt>, RelayError> {
    let oid = match oid {
        Some(oid) => oid,
        None => oid_of(sql, t).await?.ok_or_else(|| {
            RelayError::TablesChanged(format!("outbox table {} no longer exists", t.label()))
        })?,
    };
    let joined = slot_state::joined(sql, &cfg.source.slot).await?;
    if joined.as_ref().is_some_and(|j| j.contains(&oid)) {
        return Ok(None);
    }
    let via_root = partitions::via_root(cfg, sql).await?.unwrap_or(true);
    let qualified = partitions::qualified(t);
    let owed = owed::table(cfg, sql, oid, &qualified, t.discovered.is_some(), via_root)
        .await
        .map_err(|e| unreadable(t, e))?;
    if owed == Owed::Nothing {
        tracing::info!(table = %t.label(), "a table joined the publication when it was created: streamed from its first row, taken into the running session");
        slot_state::add_joined(sql, &cfg.source.slot, &[oid]).await?;
        return Ok(None);
    }
    tracing::warn!(table = %t.label(), "the table joined the publication after it held rows: republishing every row it holds (duplicates of rows the stream also delivers carry the same event_id)");
    Ok(Some(Debt {
        table: t.clone(),
        rels: vec![oid],
        filter: "TRUE".into(),
        done: vec![oid],
    }))
}
