//! Replication source: the SQL-side checks and slot handling, and the replication stream.
//!
//! Every precondition is checked over an ordinary SQL connection before streaming starts, so a
//! misconfigured server fails with a message naming the fix instead of a protocol error.

use crate::config::Config;
use crate::error::RelayError;
pub use crate::relay::address::{quote_ident, sql_connect, sql_connect_to, with_hint};
use crate::relay::address::{replication_config, stream_index};
pub use crate::relay::lsn::parse_lsn;
use pgwire_replication::ReplicationClient;
use std::time::Duration;

pub use crate::relay::slot_host::SlotHost;

/// What the slot looked like when the session started.
#[derive(Debug, Clone)]
pub struct SlotState {
    pub confirmed_flush: u64,
    pub active_pid: Option<i32>,
    /// Why the slot can no longer stream (`wal_status = 'lost'`, PG17+ `invalidation_reason`,
    /// PG16 `conflicting`), or `None` while it is usable.
    pub invalidation: Option<String>,
}

/// Checks wal_level, the table, the publication and the slot; creates the slot when allowed.
/// Returns the slot state and the server's `wal_sender_timeout`.
pub async fn preflight(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    host: &SlotHost,
    create_slot: bool,
) -> Result<(SlotState, Duration), RelayError> {
    let (slot, timeout) = preflight_opt(cfg, sql, host).await?;
    let slot = match slot {
        Some(s) => s,
        None if create_slot => create_slot_sql(cfg, sql, host).await?,
        None => {
            return Err(RelayError::Setup(format!(
                "replication slot {:?} does not exist: run `outboxd init --config FILE` or set \
                 source.create_slot = true",
                cfg.source.slot
            )))
        }
    };
    Ok((slot, timeout))
}

/// [`preflight`] without creating anything: `None` when the slot does not exist. `sql` is the
/// primary (tables, publication); the slot is looked up on `host`'s server.
pub async fn preflight_opt(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    host: &SlotHost,
) -> Result<(Option<SlotState>, Duration), RelayError> {
    let wal_level: String = sql.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal_level != "logical" {
        return Err(RelayError::Setup(format!(
            "wal_level is {wal_level:?} but logical replication needs \"logical\": run \
             ALTER SYSTEM SET wal_level = logical; then restart Postgres"
        )));
    }
    let publication = &cfg.source.publication;
    // Every listed table exists and is published, or nothing streams (never skip one).
    let mut uncovered = None;
    let mut missing = Vec::new();
    for t in cfg.tables() {
        let row = sql
            .query_one(
                // A partitioned table is published by its root or its partitions.
                &format!(
                    "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $1 \
                         AND tablename = $2), COALESCE({}, false)",
                    crate::model::publication::member_sql("$3", "to_regclass($4)::oid")
                ),
                &[
                    &t.schema,
                    &t.name,
                    publication,
                    &format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name)),
                ],
            )
            .await?;
        let (schema, table) = (&t.schema, &t.name);
        if !row.get::<_, bool>(0) && t.discovered.is_some() {
            // A pattern's table renamed or dropped since this session resolved the patterns:
            // the next session resolves them again (issue 56: this stopped the relay).
            return Err(RelayError::TablesChanged(format!(
                "outbox table {schema}.{table} no longer exists"
            )));
        }
        if !row.get::<_, bool>(0) {
            missing.push(t.label());
            continue;
        }
        uncovered =
            uncovered.or((!row.get::<_, bool>(1)).then(|| (t.pair(), t.discovered.is_some())));
    }
    absent(cfg, sql, &missing).await?;
    let (schema, table) = cfg.table_name();
    let pubrow = sql
        .query_opt(
            "SELECT pubinsert FROM pg_publication WHERE pubname = $1",
            &[publication],
        )
        .await?;
    let Some(pubrow) = pubrow else {
        return Err(RelayError::Setup(format!(
            "publication {publication:?} does not exist: run `outboxd init --config FILE` or \
             CREATE PUBLICATION {publication} FOR TABLE {schema}.{table} WITH (publish = 'insert');"
        )));
    };
    if !pubrow.get::<_, bool>(0) {
        return Err(RelayError::Setup(format!(
            "publication {publication:?} does not publish inserts: \
             ALTER PUBLICATION {publication} SET (publish = 'insert');"
        )));
    }
    if let Some(((schema, table), true)) = uncovered {
        // A pattern's table taken out of the publication since this session resolved the
        // patterns (F8, seed 10227: the relay stopped): the next session resolves them again,
        // adds it back when it may, and catches it up as a table that joins.
        return Err(RelayError::TablesChanged(format!(
            "outbox table {schema}.{table} left publication {publication:?}"
        )));
    }
    if let Some(((schema, table), _)) = uncovered {
        return Err(RelayError::Setup(format!(
            "publication {publication:?} does not include {schema}.{table}: \
             ALTER PUBLICATION {publication} ADD TABLE {schema}.{table}; (or run `outboxd \
             init --config FILE`)"
        )));
    }
    for w in host.check(sql).await? {
        tracing::warn!(slot = %cfg.source.slot, "{w}");
    }
    let slot_sql = host.sql(sql);
    let slot = slot_state(cfg, slot_sql).await?;
    let timeout_ms: i64 = slot_sql
        .query_one(
            "SELECT setting::bigint FROM pg_settings WHERE name = 'wal_sender_timeout'",
            &[],
        )
        .await?
        .get(0);
    Ok((slot, Duration::from_millis(timeout_ms.max(0) as u64)))
}

/// The slot as `pg_replication_slots` shows it, `None` when it does not exist.
pub async fn slot_state(
    cfg: &Config,
    sql: &tokio_postgres::Client,
) -> Result<Option<SlotState>, RelayError> {
    let slot = &cfg.source.slot;
    // to_jsonb reads columns that only newer servers have without failing on older ones.
    let q = "SELECT plugin, database = current_database(), confirmed_flush_lsn::text, active_pid, \
                    wal_status, to_jsonb(s) ->> 'invalidation_reason', to_jsonb(s) ->> 'conflicting' \
             FROM pg_replication_slots s WHERE slot_name = $1";
    let Some(row) = sql.query_opt(q, &[slot]).await? else {
        return Ok(None);
    };
    let plugin: Option<String> = row.get(0);
    if plugin.as_deref() != Some("pgoutput") {
        return Err(RelayError::Setup(format!(
            "replication slot {slot:?} uses plugin {plugin:?}, outboxd needs pgoutput: drop it or \
             choose another source.slot"
        )));
    }
    if !row.get::<_, bool>(1) {
        return Err(RelayError::Setup(format!(
            "replication slot {slot:?} belongs to another database: choose another source.slot"
        )));
    }
    let lsn: Option<String> = row.get(2);
    let confirmed_flush = lsn.as_deref().map(parse_lsn).transpose()?.unwrap_or(0);
    let wal_status: Option<String> = row.get(4);
    let reason: Option<String> = row.get(5);
    let conflicting: Option<String> = row.get(6);
    let invalidation = match (wal_status.as_deref(), reason, conflicting.as_deref()) {
        (_, Some(r), _) => Some(r),
        (Some("lost"), None, _) => Some("wal_status = lost".to_string()),
        (_, None, Some("true")) => Some("conflict with recovery".to_string()),
        _ => None,
    };
    Ok(Some(SlotState {
        confirmed_flush,
        active_pid: row.get(3),
        invalidation,
    }))
}

/// The server's major version (14, 15, ...).
pub async fn server_major(sql: &tokio_postgres::Client) -> Result<u32, RelayError> {
    let v: String = sql.query_one("SHOW server_version_num", &[]).await?.get(0);
    Ok(v.parse::<u32>().unwrap_or(0) / 10_000)
}

/// Creates the slot over SQL (first start, `init`) on `host`'s server. On a Postgres 17+
/// primary it is a failover slot, so standbys with `sync_replication_slots = on` keep a copy
/// that survives a promotion (a slot created on a standby cannot be one: it survives that
/// standby's own promotion as it is).
pub async fn create_slot_sql(
    cfg: &Config,
    primary: &tokio_postgres::Client,
    host: &SlotHost,
) -> Result<SlotState, RelayError> {
    let slot = &cfg.source.slot;
    let sql = host.sql(primary);
    let q = if server_major(sql).await? >= 17 && !host.in_recovery() {
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    // The creation occupies `sql`: what it waits for is asked on another connection.
    // On a standby the creation's connection is the only one to its server: not cancelled.
    let watcher;
    let (look, cancel_on) = if host.is_separate() {
        (primary, None)
    } else {
        watcher = sql_connect(cfg).await?;
        (&watcher, Some(&watcher))
    };
    let created = crate::relay::blockers::bounded(
        look,
        cancel_on,
        slot,
        "the replication slot's creation",
        cfg.source.slot_create_timeout,
        async { Ok(host.creating(primary, sql.execute(q, &[slot])).await) },
    )
    .await?;
    // Two instances may race to create it; the loser sees duplicate_object, which is fine.
    if let Err(e) = created {
        if e.code() != Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) {
            return Err(RelayError::from(e));
        }
    }
    tracing::info!(slot = %slot, "created replication slot");
    if !host
        .wait_feedback(primary, slot, Duration::from_secs(15))
        .await?
    {
        tracing::warn!(slot = %slot, "the primary has not received the standby's feedback for the new slot within 15 s (hot_standby_feedback off, or no physical slot?): a catalog change on the primary now can invalidate it (rows_removed), which costs a recovery");
    }
    slot_state(cfg, sql)
        .await?
        .ok_or_else(|| RelayError::Postgres(format!("slot {slot:?} vanished")))
}

/// The slot's confirmed_flush_lsn right now (used to verify the final confirm at shutdown).
pub async fn confirmed_flush(
    cfg: &Config,
    sql: &tokio_postgres::Client,
) -> Result<u64, RelayError> {
    let row = sql
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&cfg.source.slot],
        )
        .await?;
    let s: Option<String> = row.get(0);
    s.as_deref()
        .map(parse_lsn)
        .transpose()
        .map(|l| l.unwrap_or(0))
}

/// Starts streaming at `start` (the slot's confirmed position, or the further acknowledged
/// position from `outboxd_slot_state`: the server then skips transactions that commit before
/// it); returns once the server accepted START_REPLICATION (so "slot active for PID n"
/// surfaces here).
pub async fn start_stream(
    cfg: &Config,
    start: u64,
    status_interval: Duration,
) -> Result<ReplicationClient, RelayError> {
    let rc = replication_config(cfg, stream_index(cfg).await?, start, status_interval)?;
    let mut client = ReplicationClient::connect(rc).await.map_err(hinted)?;
    client.wait_started().await.map_err(hinted)?;
    Ok(client)
}

/// An authenticated replication session that has not started streaming: recovery creates the
/// slot on it (exporting the snapshot it reads the outbox under), then [`begin_stream`]s.
pub async fn open_gated(
    cfg: &Config,
    status_interval: Duration,
) -> Result<ReplicationClient, RelayError> {
    let rc = replication_config(cfg, stream_index(cfg).await?, 0, status_interval)?;
    ReplicationClient::connect_gated(rc).await.map_err(hinted)
}

/// START_REPLICATION on a gated session, from the slot's own confirmed position.
pub async fn begin_stream(client: &mut ReplicationClient) -> Result<(), RelayError> {
    client.start().await.map_err(hinted)?;
    client.wait_started().await.map_err(hinted)
}

/// `CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT` on a gated session: returns the slot's
/// consistent point and the snapshot that sees exactly what committed before it. The snapshot
/// stays importable until the session runs its next command.
pub async fn create_slot_exported(
    cfg: &Config,
    client: &mut ReplicationClient,
    failover: bool,
) -> Result<(u64, String), RelayError> {
    let slot = &cfg.source.slot;
    let cmd = if failover {
        format!(
            "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"
        )
    } else {
        // The legacy spelling is understood by every supported server (14+); a standby (16+)
        // cannot create a failover slot.
        format!("CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput EXPORT_SNAPSHOT")
    };
    let rows = client.simple_query(&cmd).await.map_err(hinted)?;
    let row = rows
        .first()
        .ok_or_else(|| RelayError::Replication("CREATE_REPLICATION_SLOT returned no row".into()))?;
    let text = |i: usize| {
        row.get(i)
            .and_then(|v| v.as_ref())
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .ok_or_else(|| {
                RelayError::Replication(format!("CREATE_REPLICATION_SLOT: column {i} is NULL"))
            })
    };
    Ok((parse_lsn(&text(1)?)?, text(2)?))
}

/// Listed tables that do not exist (`missing`). A relay that streamed before (its state row
/// exists) starts without them: a dropped table has no rows left to skip, its rows
/// already in the slot are decoded under its name, and one table breaking must not stop the
/// others (issue 56; before, every table stopped until it was created again). Created again,
/// it is another relation and the session takes it in (`slot::join::changed`). A first start,
/// or every table missing, is a setup error (a mistyped name is not a dropped table).
async fn absent(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    missing: &[String],
) -> Result<(), RelayError> {
    let Some(first) = missing.first() else {
        return Ok(());
    };
    let streamed = missing.len() < cfg.tables().len()
        && sql
            .query_one(
                "SELECT to_regclass('outboxd_slot_state') IS NOT NULL AND EXISTS (SELECT 1 \
                 FROM outboxd_slot_state WHERE slot_name = $1)",
                &[&cfg.source.slot],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false);
    if !streamed {
        return Err(RelayError::Setup(format!(
            "outbox table {first} does not exist: run `outboxd init --config FILE` (or apply \
             sql/001_outbox.sql)"
        )));
    }
    for t in missing {
        tracing::warn!(table = %t, slot = %cfg.source.slot, "outbox table {t} does not exist (dropped?): the relay streams the other tables; its rows still in the slot are delivered, and created again (outboxd init) it is taken in");
    }
    Ok(())
}

fn hinted(e: pgwire_replication::PgWireError) -> RelayError {
    match e.into() {
        RelayError::Replication(m) => RelayError::Replication(with_hint(m)),
        other => other,
    }
}

/// SQL work inside a session (status, slot health, repairs, parking) must not hang it on a
/// connection that went silent without a reset (blackholed) or a statement stuck behind a lock:
/// past 10 s it is a transient error and the session restarts with fresh connections.
pub async fn sql_bounded<T>(
    work: impl std::future::Future<Output = Result<T, RelayError>>,
) -> Result<T, RelayError> {
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .unwrap_or_else(|_| {
            Err(RelayError::Postgres(
                "a SQL statement got no answer within 10 s (connection silent, or waiting on a lock: \
                 see pg_stat_activity / pg_locks for outboxd): reconnecting"
                    .into(),
            ))
        })
}

/// Is `rel` (by name) in `publication` now? A table that joined is; one dropped or removed
/// since is not ([`crate::relay::outboxes::Outboxes::adopt`]).
pub async fn in_publication(
    sql: &tokio_postgres::Client,
    publication: &str,
    rel: &crate::relay::pgoutput::Relation,
) -> Result<bool, RelayError> {
    let q = async {
        let row = sql
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 \
                     AND schemaname = $2 AND tablename = $3)",
                &[&publication, &rel.namespace.as_str(), &rel.name.as_str()],
            )
            .await?;
        Ok(row.get(0))
    };
    sql_bounded(q).await
}

/// Is relation `oid` a plain table (not partitioned, nor gone)? Tables that join a running
/// session must be: a partitioned one's partitions are resolved at a session's start.
pub async fn plain_table(sql: &tokio_postgres::Client, oid: u32) -> Result<bool, RelayError> {
    let q = async {
        let r = sql
            .query_opt("SELECT relkind = 'r' FROM pg_class WHERE oid = $1", &[&oid])
            .await?;
        Ok(r.is_some_and(|r| r.get::<_, bool>(0)))
    };
    sql_bounded(q).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhausted_walsenders_are_named() {
        let m = with_hint(
            "FATAL: number of requested standby connections exceeds max_wal_senders (currently 0)"
                .into(),
        );
        assert!(m.contains("raise max_wal_senders"), "{m}");
        assert_eq!(with_hint("timeout".into()), "timeout");
    }
}
