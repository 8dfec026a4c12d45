//! The relay's durable memory of its stream: one row per slot in `public.outboxd_slot_state`,
//! in the source database itself. All SQL of that table lives here.
//!
//! Postgres persists a logical slot's confirmed position only at checkpoints, and a slot can
//! vanish (failover to a replica without it, restore, an operator's DROP) or be invalidated
//! (`max_slot_wal_keep_size`). The row records what the slot cannot be trusted to remember:
//! - the server's system identifier and timeline, to tell a failover or restore;
//! - `acked_lsn`: everything that commits before it is on the broker. Written only after the
//!   acknowledgements, so after a Postgres crash the stream may start there instead of at the
//!   slot's older checkpointed position. Because the row is WAL-logged in the same database, a
//!   restored or promoted server can only show a value whose WAL it also holds;
//! - `delivery_mark`: the commit time of the newest fully acknowledged transaction with events.
//!   Time, unlike an LSN, means the same thing in every cluster, so it bounds the rows a
//!   recovery must republish from the outbox table;
//! - `recovering_since`: set before a recovery starts and cleared when it finished, so a relay
//!   killed mid-recovery recovers again.
//!
//! It is written every `source.state_interval_ms`, never per event.

use crate::error::RelayError;
use chrono::{DateTime, Utc};
use tokio_postgres::Client;

/// DDL of the state table (also `sql/050_outboxd_slot_state.sql`).
pub const STATE_SQL: &str = include_str!("../../../../sql/050_outboxd_slot_state.sql");

/// Which server (and which history of it) a position belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// `IDENTIFY_SYSTEM`'s systemid: a new cluster (initdb, logical restore) has a new one.
    pub system_id: String,
    /// Increases at every promotion and point-in-time restore.
    pub timeline: u32,
}

/// The state row of one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub identity: Identity,
    pub acked_lsn: u64,
    pub delivery_mark: Option<DateTime<Utc>>,
    pub recovering_since: Option<DateTime<Utc>>,
    pub recovery_reason: Option<String>,
    pub recoveries: i64,
    pub last_recovery_at: Option<DateTime<Utc>>,
    pub last_recovery_events: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Whether the table exists (read-only commands report "no state" instead of creating it).
pub async fn table_exists(sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one("SELECT to_regclass('outboxd_slot_state') IS NOT NULL", &[])
        .await?
        .get(0))
}

/// The slot's row when the table exists and holds one.
pub async fn load_if_present(sql: &Client, slot: &str) -> Result<Option<Recorded>, RelayError> {
    if table_exists(sql).await? {
        load(sql, slot).await
    } else {
        Ok(None)
    }
}

/// Creates the table when missing (`run` does this too, for users who never ran `init`).
pub async fn ensure_table(sql: &Client) -> Result<(), RelayError> {
    if table_exists(sql).await? {
        return Ok(());
    }
    sql.batch_execute(&crate::schema::unqualified(STATE_SQL))
        .await
        .map_err(|e| {
            RelayError::Setup(format!(
                "cannot create outboxd_slot_state ({}): run `outboxd init` as a role that may \
             create tables",
                RelayError::from(e)
            ))
        })
}

const COLUMNS: &str = "system_identifier, timeline, (acked_lsn - '0/0')::bigint, delivery_mark, \
     recovering_since, recovery_reason, recoveries, last_recovery_at, last_recovery_events, \
     created_at, updated_at";

/// The slot's row, if the relay ever wrote one (on this database's history).
pub async fn load(sql: &Client, slot: &str) -> Result<Option<Recorded>, RelayError> {
    let q = format!("SELECT {COLUMNS} FROM outboxd_slot_state WHERE slot_name = $1");
    let Some(r) = sql.query_opt(&q, &[&slot]).await? else {
        return Ok(None);
    };
    Ok(Some(Recorded {
        identity: Identity {
            system_id: r.get(0),
            timeline: r.get::<_, i64>(1) as u32,
        },
        acked_lsn: r.get::<_, i64>(2) as u64,
        delivery_mark: r.get(3),
        recovering_since: r.get(4),
        recovery_reason: r.get(5),
        recoveries: r.get(6),
        last_recovery_at: r.get(7),
        last_recovery_events: r.get(8),
        created_at: r.get(9),
        updated_at: r.get(10),
    }))
}

/// (Re)bases the row on `identity` at `lsn`: first start, adoption of an existing slot, or the
/// end of a recovery. Counters and the recovery history survive.
pub async fn reset(
    sql: &Client,
    slot: &str,
    identity: &Identity,
    lsn: u64,
    mark: Option<DateTime<Utc>>,
) -> Result<(), RelayError> {
    sql.execute(
        "INSERT INTO outboxd_slot_state AS s \
             (slot_name, system_identifier, timeline, acked_lsn, delivery_mark) \
         VALUES ($1, $2, $3, $4::text::pg_lsn, $5) \
         ON CONFLICT (slot_name) DO UPDATE SET system_identifier = EXCLUDED.system_identifier, \
             timeline = EXCLUDED.timeline, acked_lsn = EXCLUDED.acked_lsn, \
             delivery_mark = COALESCE(EXCLUDED.delivery_mark, s.delivery_mark), \
             updated_at = now()",
        &[
            &slot,
            &identity.system_id,
            &(identity.timeline as i64),
            &lsn_text(lsn),
            &mark,
        ],
    )
    .await?;
    Ok(())
}

/// Periodic progress: only ever forward, only on the history it was based on, and only by the
/// session whose walsender (`holder`, its PID) holds the slot at that moment. An instance that
/// was frozen and fenced (slot/fence.rs) may thaw with an old position: its write is dropped,
/// the row neither regresses nor names the wrong history. `false`: nothing was written.
pub async fn advance(
    sql: &Client,
    slot: &str,
    identity: &Identity,
    holder: i32,
    lsn: u64,
    mark: Option<DateTime<Utc>>,
) -> Result<bool, RelayError> {
    let n = sql
        .execute(
            "UPDATE outboxd_slot_state SET \
             acked_lsn = GREATEST(acked_lsn, $3::text::pg_lsn), \
             delivery_mark = GREATEST(delivery_mark, $4), timeline = $5, updated_at = now() \
         WHERE slot_name = $1 AND system_identifier = $2 \
           AND EXISTS (SELECT 1 FROM pg_replication_slots \
                       WHERE slot_name = $1 AND active_pid = $6)",
            &[
                &slot,
                &identity.system_id,
                &lsn_text(lsn),
                &mark,
                &(identity.timeline as i64),
                &holder,
            ],
        )
        .await?;
    Ok(n > 0)
}

/// What bounds outbox cleanup: the slowest slot's delivery mark (`crate::cleanup`).
#[derive(Debug)]
pub enum CleanupBound {
    /// No state table or no row: nothing is known to be delivered.
    NoState,
    /// Nothing may be deleted now, and why.
    Blocked(String),
    /// Rows committed before `mark` are delivered on every slot; `slot` has the oldest mark.
    Mark { slot: String, mark: DateTime<Utc> },
}

/// Every slot recorded in this database counts: several relays may read one outbox table, and
/// a decommissioned relay's row must be deleted on purpose before its mark stops holding back.
pub async fn cleanup_bound(sql: &Client) -> Result<CleanupBound, RelayError> {
    if !table_exists(sql).await? {
        return Ok(CleanupBound::NoState);
    }
    let rows = sql
        .query(
            "SELECT slot_name, delivery_mark, recovering_since FROM outboxd_slot_state \
             ORDER BY delivery_mark ASC NULLS FIRST, slot_name",
            &[],
        )
        .await?;
    if let Some(r) = rows
        .iter()
        .find(|r| r.get::<_, Option<DateTime<Utc>>>(2).is_some())
    {
        return Ok(CleanupBound::Blocked(format!(
            "slot {:?} is recovering a lost slot's gap from the outbox table; cleanup waits \
             until that recovery finished (outboxd status)",
            r.get::<_, String>(0)
        )));
    }
    let Some(first) = rows.first() else {
        return Ok(CleanupBound::NoState);
    };
    let slot: String = first.get(0);
    match first.get::<_, Option<DateTime<Utc>>>(1) {
        None => Ok(CleanupBound::Blocked(format!(
            "slot {slot:?} has not delivered anything yet (no delivery mark in \
             outboxd_slot_state); if that relay was decommissioned, delete its row there"
        ))),
        Some(mark) => Ok(CleanupBound::Mark { slot, mark }),
    }
}

/// Records the intent to recover from `since` before anything else happens, so a relay killed
/// in the middle recovers the same range again.
pub async fn begin_recovery(
    sql: &Client,
    slot: &str,
    identity: &Identity,
    since: DateTime<Utc>,
    reason: &str,
) -> Result<(), RelayError> {
    sql.execute(
        "INSERT INTO outboxd_slot_state AS s \
             (slot_name, system_identifier, timeline, acked_lsn, recovering_since, recovery_reason) \
         VALUES ($1, $2, $3, '0/0', $4, $5) \
         ON CONFLICT (slot_name) DO UPDATE SET \
             recovering_since = LEAST(COALESCE(s.recovering_since, EXCLUDED.recovering_since), \
                                      EXCLUDED.recovering_since), \
             recovery_reason = EXCLUDED.recovery_reason, updated_at = now()",
        &[
            &slot,
            &identity.system_id,
            &(identity.timeline as i64),
            &since,
            &reason,
        ],
    )
    .await?;
    Ok(())
}

/// The recovery's events are all acknowledged: rebase the row and clear the intent.
pub async fn finish_recovery(
    sql: &Client,
    slot: &str,
    identity: &Identity,
    lsn: Option<u64>,
    mark: DateTime<Utc>,
    events: i64,
) -> Result<(), RelayError> {
    sql.execute(
        "UPDATE outboxd_slot_state SET system_identifier = $2, timeline = $3, \
             acked_lsn = COALESCE($4::text::pg_lsn, acked_lsn), \
             delivery_mark = GREATEST(delivery_mark, $5), recovering_since = NULL, \
             recoveries = recoveries + 1, last_recovery_at = now(), last_recovery_events = $6, \
             updated_at = now() \
         WHERE slot_name = $1",
        &[
            &slot,
            &identity.system_id,
            &(identity.timeline as i64),
            &lsn.map(lsn_text),
            &mark,
            &events,
        ],
    )
    .await?;
    Ok(())
}

fn lsn_text(l: u64) -> String {
    crate::relay::lsn::fmt_lsn(l)
}

/// System identifier and current timeline of the server the SQL connection reached.
pub async fn identity(sql: &tokio_postgres::Client) -> Result<Identity, RelayError> {
    let row = sql
        .query_one(
            "SELECT system_identifier::text, \
                    ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint \
             FROM pg_control_system()",
            &[],
        )
        .await?;
    Ok(Identity {
        system_id: row.get(0),
        timeline: row.get::<_, i64>(1) as u32,
    })
}
