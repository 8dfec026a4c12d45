//! The audit table `outboxd_replay` (`sql/060_outboxd_replay.sql`): every executed replay, who
//! asked and why, what it selected, who approved it, its runs, its resume cursor and its
//! result. All SQL of that table lives here.
//!
//! The table's trigger records the roles itself (`current_user`, `session_user`), refuses an
//! approval by the requesting role, decides whether a replay needs an approval from the policy
//! table (`outboxd_replay_policy`, the admin's), and computes every column of a run from its
//! state transition: the two-person rule holds for anyone who writes the table, not only for
//! this program. `outboxd init` installs all of it ([`install`], in `replay::install`);
//! `outboxd replay` only checks that it is there ([`require_installed`]).

use super::ReplayError;
use crate::relay::table_reader::Position;
use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio_postgres::Client;

#[cfg(test)]
pub use super::install::REPLAY_SQL;
pub use super::install::{check_install, install, now, policy, require_installed, Policy};

/// One audit row.
#[derive(Debug, Clone)]
pub struct Replay {
    pub id: i64,
    pub state: String,
    pub selection: Value,
    pub events: i64,
    /// `[[event_type, topic, count], …]` when requested.
    pub summary: Value,
    pub side_effects: Vec<String>,
    pub needs_approval: bool,
    pub reason: String,
    pub operator: Option<String>,
    pub rate: i32,
    pub requested_by: String,
    pub requested_at: DateTime<Utc>,
    pub approved_by: Option<String>,
    pub approved_at: Option<DateTime<Utc>>,
    pub run_by: Option<String>,
    pub runs: i32,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub cursor: Option<Position>,
    pub sent: i64,
    pub error: Option<String>,
}

const COLUMNS: &str = "id, state, selection, events, summary, side_effects, needs_approval, \
    reason, operator, rate, requested_by, requested_at, approved_by, approved_at, run_by, runs, \
    started_at, finished_at, cursor_ts, cursor_id, sent, error";

fn row(r: &tokio_postgres::Row) -> Replay {
    // cursor_ts is a cursor of an older outboxd ((created_at, event_id) order): it cannot be
    // continued in the version order, so such a replay starts over (duplicates, never a gap).
    let cursor = r
        .get::<_, Option<String>>(19)
        .and_then(|t| Position::from_text(&t));
    Replay {
        id: r.get(0),
        state: r.get(1),
        selection: r.get(2),
        events: r.get(3),
        summary: r.get(4),
        side_effects: r.get(5),
        needs_approval: r.get(6),
        reason: r.get(7),
        operator: r.get(8),
        rate: r.get(9),
        requested_by: r.get(10),
        requested_at: r.get(11),
        approved_by: r.get(12),
        approved_at: r.get(13),
        run_by: r.get(14),
        runs: r.get(15),
        started_at: r.get(16),
        finished_at: r.get(17),
        cursor,
        sent: r.get(20),
        error: r.get(21),
    }
}

/// What a new row records.
pub struct NewReplay<'a> {
    pub slot: &'a str,
    pub selection: Value,
    pub events: i64,
    pub summary: Value,
    pub side_effects: &'a [String],
    /// `true`: inserted as `requested` (waits for an approval); `false`: as `approved`.
    pub needs_approval: bool,
    pub reason: &'a str,
    pub operator: &'a str,
    pub rate: u32,
}

/// Records a replay; returns its id.
pub async fn insert(sql: &Client, n: &NewReplay<'_>) -> Result<i64, ReplayError> {
    let state = if n.needs_approval {
        "requested"
    } else {
        "approved"
    };
    let rate = i32::try_from(n.rate).unwrap_or(i32::MAX);
    Ok(sql
        .query_one(
            "INSERT INTO outboxd_replay (slot, state, selection, events, summary, side_effects, \
               needs_approval, reason, operator, rate) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING id",
            &[
                &n.slot,
                &state,
                &n.selection,
                &n.events,
                &n.summary,
                &n.side_effects,
                &n.needs_approval,
                &n.reason,
                &n.operator,
                &rate,
            ],
        )
        .await?
        .get(0))
}

pub async fn load(sql: &Client, slot: &str, id: i64) -> Result<Replay, ReplayError> {
    sql.query_opt(
        &format!("SELECT {COLUMNS} FROM outboxd_replay WHERE id = $1 AND slot = $2"),
        &[&id, &slot],
    )
    .await?
    .map(|r| row(&r))
    .ok_or(ReplayError::NotFound(id))
}

/// Newest first; without `all` only those not finished.
pub async fn list(sql: &Client, slot: &str, all: bool) -> Result<Vec<Replay>, ReplayError> {
    Ok(sql
        .query(
            &format!(
                "SELECT {COLUMNS} FROM outboxd_replay WHERE slot = $1 AND ($2 OR state <> 'finished') \
                 ORDER BY id DESC"
            ),
            &[&slot, &all],
        )
        .await?
        .iter()
        .map(row)
        .collect())
}

/// The connection's roles: (`current_user`, `session_user`).
pub async fn whoami(sql: &Client) -> Result<(String, String), ReplayError> {
    let r = sql
        .query_one("SELECT current_user::text, session_user::text", &[])
        .await?;
    Ok((r.get(0), r.get(1)))
}

/// Approves a requested replay as the connection's role. Refuses the requesting role (checked
/// here for a clear message, and by the table's guard for anyone writing the table).
pub async fn approve(sql: &Client, slot: &str, id: i64) -> Result<Replay, ReplayError> {
    let r = load(sql, slot, id).await?;
    if r.state != "requested" {
        return Err(ReplayError::State {
            id,
            state: r.state,
            hint: "only a requested replay can be approved",
        });
    }
    let (user, login) = whoami(sql).await?;
    let requested_login: String = sql
        .query_one(
            "SELECT requested_login FROM outboxd_replay WHERE id = $1",
            &[&id],
        )
        .await?
        .get(0);
    if user == r.requested_by || login == requested_login {
        return Err(ReplayError::SameRole {
            id,
            requested_by: r.requested_by,
        });
    }
    let n = sql
        .execute(
            "UPDATE outboxd_replay SET state = 'approved', approved_by = current_user \
             WHERE id = $1 AND state = 'requested'",
            &[&id],
        )
        .await?;
    if n == 0 {
        return Err(ReplayError::State {
            id,
            state: "no longer requested".into(),
            hint: "someone else changed it meanwhile: see `outboxd replay show`",
        });
    }
    load(sql, slot, id).await
}

/// Holds the replay's lock for as long as `sql` is connected: one run at a time. A killed run's
/// connection ends, and its lock with it.
pub async fn lock(sql: &Client, id: i64) -> Result<bool, ReplayError> {
    Ok(sql
        .query_one(
            "SELECT pg_try_advisory_lock(hashtext('outboxd.replay'), hashtext($1::text))",
            &[&id.to_string()],
        )
        .await?
        .get(0))
}

/// A run starts (or continues at the cursor). The guard counts the run and records its role
/// and start itself; it refuses a replay that is finished or was never approved.
pub async fn start_run(sql: &Client, id: i64) -> Result<(), ReplayError> {
    sql.execute(
        "UPDATE outboxd_replay SET state = 'running', runs = runs + 1 WHERE id = $1",
        &[&id],
    )
    .await?;
    Ok(())
}

/// The broker acknowledged every selected event up to `through`, `sent` in all (the guard
/// refuses a cursor or count that goes back).
pub async fn save_cursor(
    sql: &Client,
    id: i64,
    through: &Position,
    sent: i64,
) -> Result<(), ReplayError> {
    sql.execute(
        "UPDATE outboxd_replay SET cursor_ts = NULL, cursor_id = $2, sent = $3 WHERE id = $1",
        &[&id, &through.to_text(), &sent],
    )
    .await?;
    Ok(())
}

/// A run ended: `finished`, `interrupted` or `failed` (with the error). The guard records
/// `finished_at`.
pub async fn end_run(
    sql: &Client,
    id: i64,
    state: &str,
    error: Option<&str>,
) -> Result<(), ReplayError> {
    sql.execute(
        "UPDATE outboxd_replay SET state = $2, error = $3 WHERE id = $1",
        &[&id, &state, &error],
    )
    .await?;
    Ok(())
}
