//! What keeps a new slot from being created, said while it waits (issue 39).
//!
//! A logical slot becomes usable only at a consistent point: Postgres waits until every
//! transaction that held a transaction id when the creation began has ended, in every database
//! of the cluster. An ordinary long transaction delays that by its length; a prepared
//! transaction (`PREPARE TRANSACTION`, two-phase commit) that its coordinator abandoned delays
//! it forever, and before this module the relay waited without a word: a slot-loss recovery
//! (or the first start) simply never finished, and the gap's events stayed undelivered.
//!
//! [`bounded`] runs the creation and, while it is pending, asks the primary every
//! [`CHECK_EVERY`] which transactions older than the creation are still open
//! (`pg_prepared_xacts`, then `pg_stat_activity` rows with a transaction id), and says so once
//! per change (with the statement that resolves a prepared one). Past `source.slot_create_timeout`
//! it gives up with a transient error naming them: the creation is abandoned (the replication
//! session closes, Postgres drops the half-made slot), the session restarts and tries again,
//! so once the operator resolves the blocker the recovery finishes on its own; nothing of the
//! gap is confirmed meanwhile (the recovery's intent is durable, `slot::state`).
//!
//! Only names and times are reported: never a query text (it may hold payloads).

use crate::error::RelayError;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// How often a pending creation looks for its blockers.
const CHECK_EVERY: Duration = Duration::from_secs(2);

/// Runs `create` (a slot's creation on any server of this cluster) and reports what it waits
/// for; `what` names the creation in the messages ("the recovery's new slot"). `primary` is
/// the SQL connection to the primary (where prepared transactions are resolved). `slot_server`,
/// when given, is a free SQL connection to the server the slot is created on: past the bound
/// the creation's backend is cancelled there, because dropping our side does not stop it (a
/// backend waiting for a snapshot does not notice its client left), and each retry would
/// otherwise leave one more backend waiting, until `max_connections` runs out.
pub async fn bounded<T>(
    primary: &Client,
    slot_server: Option<&Client>,
    slot: &str,
    what: &str,
    within: Duration,
    create: impl Future<Output = Result<T, RelayError>>,
) -> Result<T, RelayError> {
    let started = Instant::now();
    let since: String = primary.query_one("SELECT now()::text", &[]).await?.get(0);
    tokio::pin!(create);
    let mut said = String::new();
    loop {
        let wait = CHECK_EVERY.min(within.saturating_sub(started.elapsed()));
        tokio::select! {
            out = &mut create => return out,
            _ = tokio::time::sleep(wait) => {}
        }
        // A failing look-up must not end a creation that may still finish.
        let blockers = match open_before(primary, &since).await {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(error = %e, "the slot creation's blockers could not be read");
                Vec::new()
            }
        };
        let named = describe(&blockers);
        if started.elapsed() >= within {
            if let Some(server) = slot_server {
                cancel_creation(server, slot).await;
            }
            return Err(RelayError::Postgres(format!(
                "{what} (slot {slot:?}) was not created within {within:?} \
                 (source.slot_create_timeout): Postgres waits until every transaction open when \
                 the creation began has ended, in every database. {} Retrying.",
                if named.is_empty() {
                    "No open transaction was found that explains it (a role without \
                     pg_read_all_stats sees only its own sessions in pg_stat_activity)."
                        .to_string()
                } else {
                    named
                }
            )));
        }
        if !named.is_empty() && named != said {
            tracing::warn!(slot = %slot, waiting_s = started.elapsed().as_secs(), "{what} waits for transactions older than its creation: {named}");
            said = named;
        }
    }
}

/// Cancels the backend that is creating `slot` (our own role's: no extra right needed).
async fn cancel_creation(server: &Client, slot: &str) {
    let q = "SELECT pg_cancel_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = $1 AND active_pid IS NOT NULL AND active_pid <> pg_backend_pid()";
    if let Err(e) = server.query(q, &[&slot]).await {
        tracing::debug!(error = %e, slot = %slot, "the slot creation could not be cancelled");
    }
}

/// One transaction the creation waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocker {
    /// `Some(gid)`: a prepared transaction; `None`: a session's open transaction.
    pub gid: Option<String>,
    pub database: String,
    pub owner: String,
    /// When it was prepared, or when the session's transaction began.
    pub since: String,
    /// The session's pid (not for a prepared transaction, which has none).
    pub pid: Option<i32>,
    pub application: String,
}

/// Transactions with a transaction id that began (or were prepared) before `since`.
async fn open_before(sql: &Client, since: &str) -> Result<Vec<Blocker>, RelayError> {
    let mut out: Vec<Blocker> = sql
        .query(
            "SELECT gid, database::text, owner::text, prepared::text FROM pg_prepared_xacts \
             WHERE prepared < $1::text::timestamptz ORDER BY prepared",
            &[&since],
        )
        .await?
        .iter()
        .map(|r| Blocker {
            gid: Some(r.get(0)),
            database: r.get(1),
            owner: r.get(2),
            since: r.get(3),
            pid: None,
            application: String::new(),
        })
        .collect();
    let sessions = sql
        .query(
            "SELECT pid, coalesce(datname::text, ''), coalesce(usename::text, ''), \
                    xact_start::text, coalesce(application_name, '') \
             FROM pg_stat_activity WHERE backend_xid IS NOT NULL \
               AND xact_start < $1::text::timestamptz AND pid <> pg_backend_pid() \
             ORDER BY xact_start LIMIT 10",
            &[&since],
        )
        .await?;
    out.extend(sessions.iter().map(|r| Blocker {
        gid: None,
        pid: Some(r.get(0)),
        database: r.get(1),
        owner: r.get(2),
        since: r.get(3),
        application: r.get(4),
    }));
    Ok(out)
}

/// The blockers and their fix, in one sentence each (names quoted: they come from users).
pub fn describe(blockers: &[Blocker]) -> String {
    blockers
        .iter()
        .map(|b| match (&b.gid, b.pid) {
            (Some(gid), _) => format!(
                "prepared transaction {gid:?} (database {:?}, owner {:?}, prepared {}) — an \
                 abandoned two-phase commit blocks it forever: resolve it with COMMIT PREPARED \
                 {lit} or ROLLBACK PREPARED {lit} (as its owner or a superuser, in that \
                 database; ask its coordinator which) — see pg_prepared_xacts.",
                b.database,
                b.owner,
                b.since,
                lit = literal(gid),
            ),
            (None, pid) => format!(
                "open transaction of pid {} (database {:?}, user {:?}, application {:?}, \
                 begun {}): it ends by itself, or pg_terminate_backend({}) ends it.",
                pid.unwrap_or_default(),
                b.database,
                b.owner,
                b.application,
                b.since,
                pid.unwrap_or_default(),
            ),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prepared_transaction_is_named_with_its_fix_quoted() {
        let b = Blocker {
            gid: Some("tx'1".into()),
            database: "app".into(),
            owner: "svc".into(),
            since: "2026-12-06 04:00:00+00".into(),
            pid: None,
            application: String::new(),
        };
        let s = describe(&[b]);
        assert!(s.contains("COMMIT PREPARED 'tx''1'"), "{s}");
        assert!(s.contains("ROLLBACK PREPARED 'tx''1'"), "{s}");
        assert!(s.contains("\"app\""), "{s}");
    }

    #[test]
    fn a_session_is_named_by_pid() {
        let b = Blocker {
            gid: None,
            database: "app".into(),
            owner: "svc".into(),
            since: "t".into(),
            pid: Some(42),
            application: "batch".into(),
        };
        let s = describe(&[b]);
        assert!(s.contains("pid 42"), "{s}");
        assert!(s.contains("pg_terminate_backend(42)"), "{s}");
    }
}
