//! The `outboxd_status` table, one row per slot: what the active relay reports every few
//! seconds (position, pending events, heartbeats, error counts), what the supervisor records
//! about a failing session (class, message, attempt, next attempt), and what `outboxd status`
//! reads back. All of its SQL lives here.

use crate::error::RelayError;
use crate::obs::view::SlotServer;
use serde_json::{json, Value};
use tokio_postgres::Client;

pub const STATUS_SQL: &str = include_str!("../../../../sql/040_outboxd_status.sql");

/// Creates the table when missing and adds the columns later versions need (idempotent; a
/// no-op query when everything is there).
pub async fn ensure_table(sql: &Client) -> Result<(), RelayError> {
    let current: bool = sql
        .query_one(
            // pg_attribute, not information_schema: a least-privilege role must see them too.
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE NOT attisdropped \
               AND attrelid = to_regclass('outboxd_status') AND attname = 'holder_since')",
            &[],
        )
        .await?
        .get(0);
    if current {
        return Ok(());
    }
    sql.batch_execute(&crate::schema::unqualified(STATUS_SQL))
        .await
        .map_err(|e| {
            RelayError::Setup(format!(
            "cannot create or upgrade outboxd_status ({}): run `outboxd init` as a role that may \
             create and alter tables",
            RelayError::from(e)
        ))
        })
}

/// One liveness beat of the instance holding the slot: written only while `walsender` (this
/// session's walsender PID) still holds it, so a fenced or thawed instance cannot make itself
/// look alive. `false`: the slot is no longer ours.
pub async fn beat(
    sql: &Client,
    host: &dyn SlotServer,
    slot: &str,
    instance: &str,
    walsender: i32,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<bool, RelayError> {
    // The slot on a standby: the holder check there, then the beat (relay::slot_host).
    if host.is_separate() && !host.holds(sql, slot, walsender).await? {
        return Ok(false);
    }
    let held = host.holder_clause(
        "EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active_pid = $3)",
    );
    let n = sql
        .execute(
            &format!(
                "INSERT INTO outboxd_status AS st (slot, instance, alive_at, holder_pid, \
                 holder_instance, holder_since) \
             SELECT $1::text, $2::text, now(), $3::int4, $2::text, $4::timestamptz WHERE {held} \
             ON CONFLICT (slot) DO UPDATE SET alive_at = now(), holder_pid = EXCLUDED.holder_pid, \
                 holder_instance = EXCLUDED.holder_instance, holder_since = EXCLUDED.holder_since"
            ),
            &[&slot, &instance, &walsender, &since],
        )
        .await?;
    Ok(n > 0)
}

/// What a standby sees of the slot's holder, in one statement (one snapshot, server clock).
#[derive(Debug, Clone, PartialEq)]
pub struct Liveness {
    /// `pg_replication_slots.active_pid`: the walsender holding the slot now.
    pub active_pid: Option<i32>,
    /// The slot's confirmed position (text): a holder whose position moves is working.
    pub confirmed: Option<String>,
    /// The walsender the last beat came from, and how long ago (seconds, server clock).
    pub beat_pid: Option<i32>,
    pub silent_s: Option<f64>,
    pub instance: Option<String>,
}

/// The slot's holder and its last beat (`None`: no such slot). With the slot on a standby,
/// two reads: the slot there, the beat on the primary (its clock, as the beats').
pub async fn liveness(
    sql: &Client,
    host: &dyn SlotServer,
    slot: &str,
) -> Result<Option<Liveness>, RelayError> {
    if host.is_separate() {
        let Some(s) = host
            .sql(sql)
            .query_opt(
                "SELECT active_pid, confirmed_flush_lsn::text FROM pg_replication_slots \
                 WHERE slot_name = $1",
                &[&slot],
            )
            .await?
        else {
            return Ok(None);
        };
        let st = sql
            .query_opt(
                "SELECT holder_pid, extract(epoch FROM now() - alive_at)::float8, holder_instance \
                 FROM outboxd_status WHERE slot = $1",
                &[&slot],
            )
            .await?;
        return Ok(Some(Liveness {
            active_pid: s.get(0),
            confirmed: s.get(1),
            beat_pid: st.as_ref().and_then(|r| r.get(0)),
            silent_s: st.as_ref().and_then(|r| r.get(1)),
            instance: st.as_ref().and_then(|r| r.get(2)),
        }));
    }
    let row = sql
        .query_opt(
            "SELECT s.active_pid, s.confirmed_flush_lsn::text, st.holder_pid, \
                    extract(epoch FROM now() - st.alive_at)::float8, st.holder_instance \
             FROM pg_replication_slots s LEFT JOIN outboxd_status st ON st.slot = s.slot_name \
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| Liveness {
        active_pid: r.get(0),
        confirmed: r.get(1),
        beat_pid: r.get(2),
        silent_s: r.get(3),
        instance: r.get(4),
    }))
}

/// Terminates the walsender `pid` holding `slot`, but only if, at this instant, it still holds
/// it, its last beat is older than `silent_s` and the slot's position is still `confirmed`: the
/// checks and the kill are one statement, so a holder that beat or confirmed since the
/// standby's last look is left alone. `true`: the signal was sent.
///
/// With the slot on a standby the beat is checked on the primary first, then the holder and
/// its position are checked and the walsender killed in one statement on the standby.
pub async fn terminate_silent_holder(
    sql: &Client,
    host: &dyn SlotServer,
    slot: &str,
    pid: i32,
    silent_s: f64,
    confirmed: &str,
) -> Result<bool, RelayError> {
    if host.is_separate() {
        let stale: bool = sql
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM outboxd_status WHERE slot = $1 AND holder_pid = $2 \
                   AND alive_at < now() - make_interval(secs => $3))",
                &[&slot, &pid, &silent_s],
            )
            .await?
            .get(0);
        if !stale {
            return Ok(false);
        }
        let row = host
            .sql(sql)
            .query_opt(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid = $2 AND confirmed_flush_lsn::text = $3",
                &[&slot, &pid, &confirmed],
            )
            .await?;
        return Ok(row.is_some_and(|r| r.get::<_, bool>(0)));
    }
    let row = sql
        .query_opt(
            "SELECT pg_terminate_backend(s.active_pid) \
             FROM pg_replication_slots s JOIN outboxd_status st ON st.slot = s.slot_name \
             WHERE s.slot_name = $1 AND s.active_pid = $2 AND st.holder_pid = $2 \
               AND st.alive_at < now() - make_interval(secs => $3) \
               AND s.confirmed_flush_lsn::text = $4",
            &[&slot, &pid, &silent_s, &confirmed],
        )
        .await?;
    Ok(row.is_some_and(|r| r.get::<_, bool>(0)))
}

/// What the active relay reports (every few seconds).
pub struct Report<'a> {
    pub slot: &'a str,
    pub instance: &'a str,
    pub confirmed_lsn: &'a str,
    pub pending_events: i64,
    pub pending_bytes: i64,
    pub oldest_pending_age_s: f64,
    pub heartbeat_delay_s: Option<f64>,
    /// Unix seconds.
    pub last_heartbeat_at_s: Option<f64>,
    pub errors: &'a Value,
    pub halted: bool,
    /// The session proved healthy: the supervisor's failure streak ends.
    pub healthy: bool,
    /// The broker refuses us (class, text with its start), retried inside the session.
    pub issue_class: Option<&'a str>,
    pub issue_text: Option<&'a str>,
}

/// Upserts the active relay's report.
pub async fn report(sql: &Client, r: &Report<'_>) -> Result<(), RelayError> {
    sql.execute(
        "INSERT INTO outboxd_status (slot, instance, updated_at, confirmed_lsn, pending_events, \
                   pending_bytes, oldest_pending_age_s, heartbeat_delay_s, last_heartbeat_at, errors, halted, \
                   last_error_class, last_error) \
                 VALUES ($1, $2, now(), $3, $4, $5, $6, $7, to_timestamp($8), $9, $10, $12, $13) \
                 ON CONFLICT (slot) DO UPDATE SET instance = EXCLUDED.instance, updated_at = now(), \
                   confirmed_lsn = EXCLUDED.confirmed_lsn, pending_events = EXCLUDED.pending_events, \
                   pending_bytes = EXCLUDED.pending_bytes, oldest_pending_age_s = EXCLUDED.oldest_pending_age_s, \
                   heartbeat_delay_s = EXCLUDED.heartbeat_delay_s, last_heartbeat_at = EXCLUDED.last_heartbeat_at, \
                   errors = EXCLUDED.errors, halted = EXCLUDED.halted, \
                   last_error_class = COALESCE($12, outboxd_status.last_error_class), \
                   last_error = COALESCE($13, outboxd_status.last_error), \
                   attempt = CASE WHEN $11 THEN 0 ELSE outboxd_status.attempt END, \
                   next_attempt_at = CASE WHEN $11 THEN NULL ELSE outboxd_status.next_attempt_at END",
        &[
            &r.slot,
            &r.instance,
            &r.confirmed_lsn,
            &r.pending_events,
            &r.pending_bytes,
            &r.oldest_pending_age_s,
            &r.heartbeat_delay_s,
            &r.last_heartbeat_at_s,
            r.errors,
            &r.halted,
            &r.healthy,
            &r.issue_class,
            &r.issue_text,
        ],
    )
    .await?;
    Ok(())
}

/// A failed session as the supervisor records it, so `outboxd status` shows a relay that is
/// retrying: its class, the (redacted) message, the attempt number and the next attempt.
pub struct Failure<'a> {
    pub slot: &'a str,
    pub class: &'a str,
    /// Redacted.
    pub message: &'a str,
    pub attempt: u64,
    pub retry_in: std::time::Duration,
    pub halted: bool,
}

/// Upserts a failed session's record.
pub async fn record_failure(sql: &Client, f: &Failure<'_>) -> Result<(), RelayError> {
    sql.execute(
        "INSERT INTO outboxd_status (slot, instance, attempt, last_error_class, last_error, next_attempt_at) \
         VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6)) \
         ON CONFLICT (slot) DO UPDATE SET attempt = EXCLUDED.attempt, \
           last_error_class = EXCLUDED.last_error_class, last_error = EXCLUDED.last_error, \
           next_attempt_at = EXCLUDED.next_attempt_at, \
           halted = outboxd_status.halted OR $7",
        &[
            &f.slot,
            &instance(),
            &(f.attempt as i64),
            &f.class,
            &f.message,
            &f.retry_in.as_secs_f64(),
            &f.halted,
        ],
    )
    .await?;
    Ok(())
}

/// `host:pid`, how the row names the process that wrote it.
pub fn instance() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// The reported row of `slot` as `outboxd status --json` shows it (`None`: no relay reported).
pub async fn read(sql: &Client, slot: &str) -> Result<Option<Value>, RelayError> {
    let rep = sql
        .query_opt(
            "SELECT instance, extract(epoch FROM now() - updated_at)::float8, confirmed_lsn, \
                        pending_events, oldest_pending_age_s, heartbeat_delay_s, \
                        extract(epoch FROM now() - last_heartbeat_at)::float8, errors, halted, \
                        attempt, last_error_class, last_error, \
                        greatest(extract(epoch FROM next_attempt_at - now())::float8, 0), \
                        -- to_jsonb: a table no relay upgraded yet reads as NULL here.
                        extract(epoch FROM now() - (to_jsonb(t) ->> 'alive_at')::timestamptz)::float8, \
                        to_jsonb(t) ->> 'holder_instance', (to_jsonb(t) ->> 'holder_pid')::int \
                 FROM outboxd_status t WHERE slot = $1",
            &[&slot],
        )
        .await?
        .map(|r| {
            json!({
                "instance": r.get::<_, String>(0),
                "reported_seconds_ago": r.get::<_, Option<f64>>(1),
                "confirmed_lsn": r.get::<_, Option<String>>(2),
                "pending_events": r.get::<_, Option<i64>>(3),
                "oldest_pending_age_seconds": r.get::<_, Option<f64>>(4),
                "heartbeat_delay_seconds": r.get::<_, Option<f64>>(5),
                "heartbeat_age_seconds": r.get::<_, Option<f64>>(6),
                "errors": r.get::<_, Option<Value>>(7),
                "halted": r.get::<_, bool>(8),
                "attempt": r.get::<_, Option<i64>>(9),
                "last_error_class": r.get::<_, Option<String>>(10),
                "last_error": r.get::<_, Option<String>>(11),
                "next_attempt_in_seconds": r.get::<_, Option<f64>>(12),
                "holder_alive_seconds_ago": r.get::<_, Option<f64>>(13),
                "holder_instance": r.get::<_, Option<String>>(14),
                "holder_walsender_pid": r.get::<_, Option<i32>>(15),
            })
        });
    Ok(rep)
}
