//! What cleanup may delete, from the delivery state of every relay in the database — not from
//! cleanup's own config, which may be a cron job's with another `relay_schema` or window.
//!
//! - Every `outboxd_slot_state` table in the database counts, whatever schema it is in (each
//!   relay's `source.relay_schema`); a state table cleanup may not read blocks it.
//! - A row may go only when its transaction is older than every slot's `delivered_xid` (the
//!   exact bound a lost slot's recovery reads from: [`crate::slot::gap`]), so no cleanup can
//!   take a row a recovery needs, whatever its `created_at` says.
//! - A pgoutput slot of this database without a state row anywhere is a relay cleanup knows
//!   nothing about (or a consumer that is not outboxd's): it blocks cleanup until it records
//!   its state or is listed in `cleanup.ignore_slots`.
//! - While a recovery (`recovering_since`/`recovering_xid`) or a replay (`running`,
//!   `interrupted`) is under way in any of those schemas, nothing is deleted: [`Bounds::idle`]
//!   is part of every batch's statement, not checked once per run.

use crate::error::RelayError;
use crate::relay::source::quote_ident;
use crate::slot::gap;
use chrono::{DateTime, Utc};
use tokio_postgres::Client;

/// The bounds every batch obeys.
#[derive(Debug)]
pub struct Bounds {
    /// The slot with the oldest delivery mark, and that mark.
    pub slot: String,
    pub mark: DateTime<Utc>,
    /// SQL over alias `o`: the row's transaction is older than every slot's `delivered_xid`.
    pub delivered: String,
    /// SQL: no recovery and no replay is under way.
    pub idle: String,
}

/// What [`bounds`] found.
#[derive(Debug)]
pub enum Bound {
    /// No state table or no row: nothing is known to be delivered.
    NoState,
    /// Nothing may be deleted now, and why.
    Blocked(String),
    Ok(Bounds),
}

/// A state row of some relay.
struct Row {
    schema: String,
    slot: String,
    mark: Option<DateTime<Utc>>,
    xid: Option<u64>,
}

/// See the module docs. `ignore`: `cleanup.ignore_slots`.
pub async fn bounds(sql: &Client, ignore: &[String]) -> Result<Bound, RelayError> {
    let schemas = tables(sql, "outboxd_slot_state").await?;
    if schemas.is_empty() {
        return Ok(Bound::NoState);
    }
    let mut rows = Vec::new();
    for s in &schemas {
        let q = format!(
            "SELECT slot_name, delivery_mark, delivered_xid::text FROM {}.outboxd_slot_state",
            quote_ident(s)
        );
        let found = match sql.query(&q, &[]).await {
            Ok(r) => r,
            Err(e) => {
                return Ok(Bound::Blocked(format!(
                    "cannot read {s}.outboxd_slot_state ({}): every relay's delivery state \
                     bounds cleanup; GRANT USAGE ON SCHEMA {s} and SELECT ON \
                     {s}.outboxd_slot_state to the cleanup role",
                    db_text(&e)
                )))
            }
        };
        rows.extend(found.iter().map(|r| Row {
            schema: s.clone(),
            slot: r.get(0),
            mark: r.get(1),
            xid: r.get::<_, Option<String>>(2).and_then(|t| t.parse().ok()),
        }));
    }
    let idle = idle_sql(sql, &schemas).await?;
    let busy: bool = match sql.query_one(&format!("SELECT NOT ({idle})"), &[]).await {
        Ok(r) => r.get(0),
        Err(e) => {
            return Ok(Bound::Blocked(format!(
                "cannot read the relays' recovery and replay state ({}): GRANT SELECT ON \
                 outboxd_slot_state and outboxd_replay (in each relay schema) to the cleanup role",
                db_text(&e)
            )))
        }
    };
    if busy {
        return Ok(Bound::Blocked(
            "a relay is recovering a lost slot's gap, or a replay is running or interrupted \
             (outboxd status, outboxd replay list); cleanup waits until it finished"
                .into(),
        ));
    }
    let slots: Vec<String> = sql
        .query(
            "SELECT slot_name::text FROM pg_replication_slots \
             WHERE plugin = 'pgoutput' AND database = current_database() ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if let Some(unknown) = slots
        .iter()
        .find(|s| !ignore.contains(s) && !rows.iter().any(|r| &&r.slot == s))
    {
        return Ok(Bound::Blocked(format!(
            "replication slot {unknown:?} (pgoutput, this database) has no delivery state in any \
             outboxd_slot_state: if an outboxd relay streams from it, start that relay once (it \
             records its state); if it is not outboxd's (a subscription, Debezium), list it in \
             cleanup.ignore_slots"
        )));
    }
    rows.sort_by_key(|r| r.mark);
    let Some(first) = rows.first() else {
        return Ok(Bound::NoState);
    };
    let Some(mark) = first.mark else {
        return Ok(Bound::Blocked(format!(
            "slot {:?} has not delivered anything yet (no delivery mark in \
             {}.outboxd_slot_state); if that relay was decommissioned, delete its row there",
            first.slot, first.schema
        )));
    };
    if let Some(r) = rows.iter().find(|r| r.xid.is_none()) {
        return Ok(Bound::Blocked(format!(
            "slot {:?} ({}.outboxd_slot_state) has no delivered_xid yet: a relay of this version \
             records it within seconds of running",
            r.slot, r.schema
        )));
    }
    let oldest = rows.iter().filter_map(|r| r.xid).min().unwrap_or_default();
    let next = gap::next_xid(sql).await?;
    let Some(delivered) = gap::older_than(oldest, next) else {
        return Ok(Bound::Blocked(format!(
            "the oldest delivered_xid ({oldest}) is too far behind this server's transaction \
             counter ({next}) to compare rows with it"
        )));
    };
    Ok(Bound::Ok(Bounds {
        slot: first.slot.clone(),
        mark,
        delivered,
        idle,
    }))
}

/// Schemas holding a table named `name`.
async fn tables(sql: &Client, name: &str) -> Result<Vec<String>, RelayError> {
    Ok(sql
        .query(
            "SELECT n.nspname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.relname = $1 AND c.relkind IN ('r', 'p') ORDER BY 1",
            &[&name],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// "No recovery and no replay under way", over every relay schema.
async fn idle_sql(sql: &Client, state_schemas: &[String]) -> Result<String, RelayError> {
    let mut parts: Vec<String> = state_schemas
        .iter()
        .map(|s| {
            format!(
                "NOT EXISTS (SELECT 1 FROM {}.outboxd_slot_state \
                 WHERE recovering_since IS NOT NULL OR recovering_xid IS NOT NULL)",
                quote_ident(s)
            )
        })
        .collect();
    for s in tables(sql, "outboxd_replay").await? {
        parts.push(format!(
            "NOT EXISTS (SELECT 1 FROM {}.outboxd_replay WHERE state IN ('running', 'interrupted'))",
            quote_ident(&s)
        ));
    }
    Ok(parts.join(" AND "))
}

/// A database error as "code: message", without the relay role's advice the general
/// conversion adds (this is the cleanup role's connection).
fn db_text(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{}: {}", d.code().code(), d.message()),
        None => e.to_string(),
    }
}
