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
//! - `delivered_xid`: every transaction whose id is below it finished before `acked_lsn`, so
//!   whatever it wrote to the outbox is on the broker. This is the exact bound of a lost slot's
//!   gap ([`crate::slot::gap`]): unlike a time, it does not depend on what a row's `created_at`
//!   holds, how long a transaction ran or whose clock was right. It moves in two steps (see
//!   [`XidProbe`]): sample the oldest running transaction id and the WAL position, and adopt the
//!   id once the acknowledged position passed that WAL position;
//! - `delivery_mark`: the commit time of the newest fully acknowledged transaction with events,
//!   for people (status) and for cleanup's time bound;
//! - `recovering_since`: set before a recovery starts and cleared when it finished, so a relay
//!   killed mid-recovery recovers again.
//!
//! It is written every `source.state_interval_ms`, never per event.

use crate::error::RelayError;
use crate::relay::slot_host::SlotHost;
use crate::slot::gap::Gap;
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
    /// See the module docs; `None` on rows written before outboxd recorded it, or adopted
    /// slots before their first probe was acknowledged.
    pub delivered_xid: Option<u64>,
    pub recovering_since: Option<DateTime<Utc>>,
    /// The gap of the recovery under way, as a transaction id (`None`: a time range was asked).
    pub recovering_xid: Option<u64>,
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

/// Creates the table when missing, or adds the columns and the guard of a newer outboxd (`run`
/// does this too, for users who never ran `init`). A role that may not upgrade an existing
/// table (a least-privilege relay) goes on with a warning: `outboxd init` as the admin role
/// installs the guard, and `outboxd check` says it is missing.
pub async fn ensure_table(sql: &Client) -> Result<(), RelayError> {
    let present = table_exists(sql).await?;
    if present
        && has_xid_columns(sql).await?
        && has_joined_column(sql).await?
        && guard_installed(sql).await?
    {
        return Ok(());
    }
    // Without the xid columns the relay cannot run: only the guard may be left for init.
    let upgradable = present && has_xid_columns(sql).await?;
    crate::schema::install(sql, STATE_SQL, "outboxd_slot_state", upgradable).await
}

/// Is the bounds guard (sql/050) on the table and enabled?
pub async fn guard_installed(sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid \
             WHERE t.tgrelid = to_regclass('outboxd_slot_state') \
               AND t.tgname = 'outboxd_slot_state_guard' AND t.tgenabled <> 'D' \
               AND p.proconfig IS NOT NULL)",
            &[],
        )
        .await?
        .get(0))
}

/// `joined_tables` and `partitions_seen` (crate::slot::join): optional for a relay without
/// patterns or partitioned tables, so a role that cannot add them goes on (late joins and left
/// partitions are then not tracked; `outboxd init` adds them).
async fn has_joined_column(sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one(
            "SELECT count(*) = 2 FROM pg_attribute \
             WHERE attrelid = to_regclass('outboxd_slot_state') \
               AND attname IN ('joined_tables', 'partitions_seen') AND NOT attisdropped",
            &[],
        )
        .await?
        .get(0))
}

async fn has_xid_columns(sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one(
            "SELECT count(*) = 2 FROM pg_attribute \
             WHERE attrelid = to_regclass('outboxd_slot_state') \
               AND attname IN ('delivered_xid', 'recovering_xid') AND NOT attisdropped",
            &[],
        )
        .await?
        .get(0))
}

const COLUMNS: &str = "system_identifier, timeline, (acked_lsn - '0/0')::bigint, delivery_mark, \
     recovering_since, recovery_reason, recoveries, last_recovery_at, last_recovery_events, \
     created_at, updated_at, delivered_xid::text, recovering_xid::text";

/// An `xid8` read as text (tokio-postgres has no type for it).
fn xid(r: &tokio_postgres::Row, i: usize) -> Option<u64> {
    r.get::<_, Option<String>>(i).and_then(|t| t.parse().ok())
}

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
        delivered_xid: xid(&r, 11),
        recovering_xid: xid(&r, 12),
    }))
}

/// (Re)bases the row on `identity` at `lsn`: first start or adoption of an existing slot.
/// `xid`: the oldest transaction still running before the slot was created (everything older
/// committed before the slot's start, so it is not this relay's to publish); `None` when the
/// slot already existed and its backlog is unknown (the first acknowledged probe sets it).
pub async fn reset(
    sql: &Client,
    slot: &str,
    identity: &Identity,
    lsn: u64,
    xid: Option<u64>,
) -> Result<(), RelayError> {
    sql.execute(
        "INSERT INTO outboxd_slot_state AS s \
             (slot_name, system_identifier, timeline, acked_lsn, delivered_xid) \
         VALUES ($1, $2, $3, $4::text::pg_lsn, $5::text::xid8) \
         ON CONFLICT (slot_name) DO UPDATE SET system_identifier = EXCLUDED.system_identifier, \
             timeline = EXCLUDED.timeline, acked_lsn = EXCLUDED.acked_lsn, \
             delivered_xid = EXCLUDED.delivered_xid, updated_at = now()",
        &[
            &slot,
            &identity.system_id,
            &(identity.timeline as i64),
            &lsn_text(lsn),
            &xid.map(|x| x.to_string()),
        ],
    )
    .await?;
    Ok(())
}

/// The oldest transaction id still running and the WAL insert position, read in one statement
/// (the statement's snapshot is taken before the position): every transaction with a smaller
/// id wrote its commit record before that position. Once the acknowledged position passes it,
/// the id is the new `delivered_xid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidProbe {
    pub xmin: u64,
    pub lsn: u64,
}

impl XidProbe {
    pub async fn take(sql: &Client) -> Result<Self, RelayError> {
        let r = sql
            .query_one(
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text, \
                        (pg_current_wal_insert_lsn() - '0/0')::bigint",
                &[],
            )
            .await?;
        let xmin: String = r.get(0);
        Ok(Self {
            xmin: xmin
                .parse()
                .map_err(|_| RelayError::Postgres(format!("unreadable xid8 {xmin:?}")))?,
            lsn: r.get::<_, i64>(1) as u64,
        })
    }
}

/// What a session acknowledged so far: the position, the delivery mark, the delivered
/// transaction id ([`advance`]).
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub lsn: u64,
    pub mark: Option<DateTime<Utc>>,
    pub xid: Option<u64>,
}

/// Periodic progress: only ever forward, only on the history it was based on, and only by the
/// session whose walsender (`holder`, its PID) holds the slot at that moment. An instance that
/// was frozen and fenced (slot/fence.rs) may thaw with an old position: its write is dropped,
/// the row neither regresses nor names the wrong history. `false`: nothing was written.
pub async fn advance(
    sql: &Client,
    host: &SlotHost,
    slot: &str,
    identity: &Identity,
    holder: i32,
    p: Progress,
) -> Result<bool, RelayError> {
    let Progress { lsn, mark, xid } = p;
    // The slot on a standby: the holder check there first (the module relay::slot_host says
    // what the window between the two statements allows).
    if host.is_separate() && !host.holds(sql, slot, holder).await? {
        return Ok(false);
    }
    let held = host.holder_clause(
        "EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active_pid = $6)",
    );
    let n = sql
        .execute(
            &format!(
                "UPDATE outboxd_slot_state SET \
                 acked_lsn = GREATEST(acked_lsn, $3::text::pg_lsn), \
                 delivery_mark = GREATEST(delivery_mark, $4), timeline = $5, \
                 delivered_xid = GREATEST(delivered_xid, $7::text::xid8), updated_at = now() \
             WHERE slot_name = $1 AND system_identifier = $2 AND $6::int4 = $6 AND {held}"
            ),
            &[
                &slot,
                &identity.system_id,
                &lsn_text(lsn),
                &mark,
                &(identity.timeline as i64),
                &holder,
                &xid.map(|x| x.to_string()),
            ],
        )
        .await?;
    Ok(n > 0)
}

/// Records the intent to recover `gap` before anything else happens, so a relay killed in the
/// middle recovers the same rows again: a second intent never narrows the first (each bound
/// only moves back). Either column set tells cleanup that a recovery is under way.
pub async fn begin_recovery(
    sql: &Client,
    slot: &str,
    identity: &Identity,
    gap: &Gap,
    reason: &str,
) -> Result<(), RelayError> {
    sql.execute(
        "INSERT INTO outboxd_slot_state AS s \
             (slot_name, system_identifier, timeline, acked_lsn, recovering_since, recovering_xid, \
              recovery_reason) \
         VALUES ($1, $2, $3, '0/0', $4, $6::text::xid8, $5) \
         ON CONFLICT (slot_name) DO UPDATE SET \
             recovering_since = LEAST(s.recovering_since, EXCLUDED.recovering_since), \
             recovering_xid = LEAST(s.recovering_xid, EXCLUDED.recovering_xid), \
             recovery_reason = EXCLUDED.recovery_reason, updated_at = now()",
        &[
            &slot,
            &identity.system_id,
            &(identity.timeline as i64),
            &gap.since,
            &reason,
            &gap.from_xid.map(|x| x.to_string()),
        ],
    )
    .await?;
    Ok(())
}

/// The stream may have skipped rows (the publication changed under it): record the gap —
/// every transaction from `delivered_xid` on — and why, so the next session recovers it.
/// `false`: the row has no `delivered_xid`, so nothing proves a gap.
pub async fn owe_gap(sql: &Client, slot: &str, reason: &str) -> Result<bool, RelayError> {
    let n = sql
        .execute(
            "UPDATE outboxd_slot_state SET \
                 recovering_xid = LEAST(recovering_xid, delivered_xid), recovery_reason = $2, \
                 updated_at = now() \
             WHERE slot_name = $1 AND delivered_xid IS NOT NULL",
            &[&slot, &reason],
        )
        .await?;
    Ok(n > 0)
}

/// The recovery's events are all acknowledged: rebase the row and clear the intent. `xid`: the
/// recovery proved every transaction below it delivered (an exact gap, read under a snapshot
/// whose oldest running transaction it is); `None` (an operator's time range) leaves the mark
/// alone, except on another cluster's row, whose ids mean nothing here (cleared).
pub async fn finish_recovery(
    sql: &Client,
    slot: &str,
    identity: &Identity,
    lsn: Option<u64>,
    mark: DateTime<Utc>,
    xid: Option<u64>,
    events: i64,
) -> Result<(), RelayError> {
    sql.execute(
        "UPDATE outboxd_slot_state SET \
             delivered_xid = CASE WHEN system_identifier IS DISTINCT FROM $2 THEN $7::text::xid8 \
                                  ELSE GREATEST(delivered_xid, $7::text::xid8) END, \
             system_identifier = $2, timeline = $3, \
             acked_lsn = COALESCE($4::text::pg_lsn, acked_lsn), \
             delivery_mark = GREATEST(delivery_mark, $5), recovering_since = NULL, \
             recovering_xid = NULL, \
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
            &xid.map(|x| x.to_string()),
        ],
    )
    .await?;
    Ok(())
}

/// The tables (oids) whose rows from before they joined the publication are taken care of
/// ([`crate::slot::join`]). `Ok(None)`: not recorded yet (a NULL column, or no row). Err when
/// the column is missing (a table this role could not upgrade: `outboxd init` adds it).
pub async fn joined(sql: &Client, slot: &str) -> Result<Option<Vec<u32>>, RelayError> {
    let r = sql
        .query_opt(
            "SELECT joined_tables FROM outboxd_slot_state WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(r.and_then(|r| r.get::<_, Option<Vec<u32>>>(0)))
}

/// Adds `oids` to [`joined`] (the first call records the tables published then).
pub async fn add_joined(sql: &Client, slot: &str, oids: &[u32]) -> Result<(), RelayError> {
    sql.execute(
        "UPDATE outboxd_slot_state SET joined_tables = ARRAY(SELECT DISTINCT unnest( \
             COALESCE(joined_tables, '{}'::oid[]) || $2::oid[]) ORDER BY 1), updated_at = now() \
         WHERE slot_name = $1",
        &[&slot, &oids],
    )
    .await?;
    Ok(())
}

/// Takes `oids` out of [`joined`]: tables that left the publication, owed again what they
/// hold when they are back (issue 56, F5).
pub async fn remove_joined(sql: &Client, slot: &str, oids: &[u32]) -> Result<(), RelayError> {
    sql.execute(
        "UPDATE outboxd_slot_state SET joined_tables = ARRAY(SELECT o FROM unnest(joined_tables) o \
             WHERE o <> ALL($2::oid[]) ORDER BY 1), updated_at = now() \
         WHERE slot_name = $1 AND joined_tables IS NOT NULL",
        &[&slot, &oids],
    )
    .await?;
    Ok(())
}

/// A partition a session read as its root's ([`crate::slot::join::partitions::remember`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SeenPartition {
    pub oid: u32,
    /// The root's `schema.table`.
    pub root: String,
    /// Where the WAL was when the partition was first seen gone (`None`: a partition still).
    pub left_at: Option<String>,
}

/// The partitions recorded for `slot`, and its `acked_lsn`. `Ok(None)`: no row yet. Err when
/// the column is missing (a table this role could not upgrade).
pub async fn partitions_seen(
    sql: &Client,
    slot: &str,
) -> Result<Option<(Vec<SeenPartition>, u64)>, RelayError> {
    let Some(r) = sql
        .query_opt(
            "SELECT partitions_seen::text, (acked_lsn - '0/0')::bigint FROM outboxd_slot_state \
             WHERE slot_name = $1",
            &[&slot],
        )
        .await?
    else {
        return Ok(None);
    };
    let seen = match r.get::<_, Option<String>>(0) {
        Some(j) => serde_json::from_str(&j).map_err(|e| {
            RelayError::Setup(format!(
                "outboxd_slot_state.partitions_seen of slot {slot} is not what outboxd writes \
                 ({e}): set it to NULL to forget it (partitions left since are then read as \
                 other tables)"
            ))
        })?,
        None => Vec::new(),
    };
    Ok(Some((seen, r.get::<_, i64>(1) as u64)))
}

/// Replaces the partitions recorded for `slot`.
pub async fn set_partitions_seen(
    sql: &Client,
    slot: &str,
    seen: &[SeenPartition],
) -> Result<(), RelayError> {
    let json = serde_json::to_string(seen).map_err(|e| RelayError::Setup(e.to_string()))?;
    sql.execute(
        "UPDATE outboxd_slot_state SET partitions_seen = $2::text::jsonb, updated_at = now() \
         WHERE slot_name = $1",
        &[&slot, &json],
    )
    .await?;
    Ok(())
}

fn lsn_text(l: u64) -> String {
    crate::model::lsn::fmt_lsn(l)
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
