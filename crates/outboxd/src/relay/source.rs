//! Replication source: the SQL-side checks and slot handling, and the replication stream.
//!
//! Every precondition is checked over an ordinary SQL connection before streaming starts, so a
//! misconfigured server fails with a message naming the fix instead of a protocol error.

use crate::config::Config;
use crate::error::RelayError;
pub use crate::relay::lsn::{fmt_lsn, parse_lsn};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig};
use std::str::FromStr;
use std::time::Duration;
use tokio_postgres::config::Host;

/// What the slot looked like when the session started.
#[derive(Debug, Clone)]
pub struct SlotState {
    pub confirmed_flush: u64,
    pub active_pid: Option<i32>,
    /// Why the slot can no longer stream (`wal_status = 'lost'`, PG17+ `invalidation_reason`,
    /// PG16 `conflicting`), or `None` while it is usable.
    pub invalidation: Option<String>,
}

/// Opens an ordinary SQL connection to the source (the connection task runs in the background).
pub async fn sql_connect(cfg: &Config) -> Result<tokio_postgres::Client, RelayError> {
    let mut pg = pg_config(cfg)?;
    let tls = crate::relay::tls::sql_connector(cfg.source.tls(), &mut pg)?;
    let (client, conn) = pg.connect(tls).await.map_err(|e| {
        RelayError::Postgres(with_hint(format!(
            "cannot connect to {}: {}",
            describe(&pg),
            crate::error::RelayError::from(e)
        )))
    })?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "sql connection ended");
        }
    });
    Ok(client)
}

fn pg_config(cfg: &Config) -> Result<tokio_postgres::Config, RelayError> {
    let mut pg = tokio_postgres::Config::from_str(&cfg.source.dsn)
        .map_err(|e| RelayError::Setup(format!("source.dsn: {e}")))?;
    if let Some(pw) = &cfg.source.password {
        pg.password(pw);
    }
    pg.application_name("outboxd");
    // Unqualified names of outboxd's own tables resolve to source.relay_schema only:
    // pg_catalog is searched first implicitly (no function can be shadowed), and no schema of
    // the role's default path (a writable `public` on PG <= 14, "$user") can pre-empt them.
    // New relay tables are created there too (the first schema of the path).
    let path = format!("-c search_path={}", quote_ident(&cfg.source.relay_schema));
    let options = match pg.get_options() {
        Some(o) if !o.trim().is_empty() => format!("{o} {path}"),
        _ => path,
    };
    pg.options(&options);
    Ok(pg)
}

/// The first host of the DSN (a Unix socket directory as a path), or `default`.
fn host_of(pg: &tokio_postgres::Config, default: &str) -> String {
    nth_host(pg, 0, default)
}

fn nth_host(pg: &tokio_postgres::Config, i: usize, default: &str) -> String {
    match pg.get_hosts().get(i) {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => default.into(),
    }
}

/// host:port/db, never the password.
fn describe(pg: &tokio_postgres::Config) -> String {
    let host = host_of(pg, "localhost");
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{host}:{port}/{}",
        pg.get_dbname().unwrap_or(pg.get_user().unwrap_or("?"))
    )
}

/// Checks wal_level, the table, the publication and the slot; creates the slot when allowed.
/// Returns the slot state and the server's `wal_sender_timeout`.
pub async fn preflight(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    create_slot: bool,
) -> Result<(SlotState, Duration), RelayError> {
    let (slot, timeout) = preflight_opt(cfg, sql).await?;
    let slot = match slot {
        Some(s) => s,
        None if create_slot => create_slot_sql(cfg, sql).await?,
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

/// [`preflight`] without creating anything: `None` when the slot does not exist.
pub async fn preflight_opt(
    cfg: &Config,
    sql: &tokio_postgres::Client,
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
    for t in cfg.tables() {
        let row = sql
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = $2), \
                        EXISTS (SELECT 1 FROM pg_publication_tables \
                                WHERE pubname = $3 AND schemaname = $1 AND tablename = $2)",
                &[&t.schema, &t.name, publication],
            )
            .await?;
        let (schema, table) = (&t.schema, &t.name);
        if !row.get::<_, bool>(0) {
            return Err(RelayError::Setup(format!(
                "outbox table {schema}.{table} does not exist: run `outboxd init --config FILE` \
                 (or apply sql/001_outbox.sql)"
            )));
        }
        uncovered = uncovered.or((!row.get::<_, bool>(1)).then(|| t.pair()));
    }
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
    if let Some((schema, table)) = uncovered {
        return Err(RelayError::Setup(format!(
            "publication {publication:?} does not include {schema}.{table}: \
             ALTER PUBLICATION {publication} ADD TABLE {schema}.{table}; (or run `outboxd \
             init --config FILE`)"
        )));
    }
    let slot = slot_state(cfg, sql).await?;
    let timeout_ms: i64 = sql
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

/// Creates the slot over SQL (first start, `init`). On Postgres 17+ it is a failover slot, so
/// standbys with `sync_replication_slots = on` keep a copy that survives a promotion.
pub async fn create_slot_sql(
    cfg: &Config,
    sql: &tokio_postgres::Client,
) -> Result<SlotState, RelayError> {
    let slot = &cfg.source.slot;
    let q = if server_major(sql).await? >= 17 {
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    // Two instances may race to create it; the loser sees duplicate_object, which is fine.
    if let Err(e) = sql.execute(q, &[slot]).await {
        if e.code() != Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) {
            return Err(RelayError::from(e));
        }
    }
    tracing::info!(slot = %slot, "created replication slot");
    slot_state(cfg, sql)
        .await?
        .ok_or_else(|| RelayError::Postgres(format!("slot {slot:?} vanished")))
}

/// A SQL identifier, quoted.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
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
    let rc = replication_config(cfg, primary_index(cfg).await?, start, status_interval)?;
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
    let rc = replication_config(cfg, primary_index(cfg).await?, 0, status_interval)?;
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
    major: u32,
) -> Result<(u64, String), RelayError> {
    let slot = &cfg.source.slot;
    let cmd = if major >= 17 {
        format!(
            "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"
        )
    } else {
        // The legacy spelling is understood by every supported server (14+).
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

fn hinted(e: pgwire_replication::PgWireError) -> RelayError {
    match e.into() {
        RelayError::Replication(m) => RelayError::Replication(with_hint(m)),
        other => other,
    }
}

/// Which host of a multi-host DSN (`host=a,b target_session_attrs=read-write`) the stream
/// opens on: the one that is a writable primary now, so after a promotion the relay follows
/// the new primary (where a PG17 failover slot waits). The SQL connection finds it by itself
/// (tokio-postgres honours target_session_attrs); the replication client takes one host.
async fn primary_index(cfg: &Config) -> Result<usize, RelayError> {
    let pg = pg_config(cfg)?;
    let n = pg.get_hosts().len();
    if n <= 1 {
        return Ok(0);
    }
    let mut tried = Vec::new();
    for i in 0..n {
        let mut one = single_host(&pg, i);
        let tls = crate::relay::tls::sql_connector(cfg.source.tls(), &mut one)?;
        let probe = async {
            let (client, conn) = one.connect(tls).await?;
            tokio::spawn(conn);
            client.query_one("SELECT pg_is_in_recovery()", &[]).await
        };
        match tokio::time::timeout(Duration::from_secs(5), probe).await {
            Ok(Ok(row)) if !row.get::<_, bool>(0) => return Ok(i),
            Ok(Ok(_)) => tried.push(format!("{}: in recovery", describe(&one))),
            Ok(Err(e)) => tried.push(format!("{}: {}", describe(&one), RelayError::from(e))),
            Err(_) => tried.push(format!("{}: no answer within 5 s", describe(&one))),
        }
    }
    Err(RelayError::Postgres(format!(
        "no host of source.dsn is a writable primary ({})",
        tried.join("; ")
    )))
}

/// Host `i` of a multi-host config, with its port and hostaddr, everything else the same.
fn single_host(pg: &tokio_postgres::Config, i: usize) -> tokio_postgres::Config {
    let mut one = tokio_postgres::Config::new();
    match pg.get_hosts().get(i) {
        Some(Host::Tcp(h)) => one.host(h),
        Some(Host::Unix(p)) => one.host_path(p),
        None => one.host("localhost"),
    };
    let ports = pg.get_ports();
    one.port(ports.get(i).or(ports.first()).copied().unwrap_or(5432));
    if let Some(a) = pg.get_hostaddrs().get(i) {
        one.hostaddr(*a);
    }
    if let Some(u) = pg.get_user() {
        one.user(u);
    }
    if let Some(pw) = pg.get_password() {
        one.password(pw);
    }
    if let Some(d) = pg.get_dbname() {
        one.dbname(d);
    }
    if let Some(t) = pg.get_connect_timeout() {
        one.connect_timeout(*t);
    }
    one.ssl_mode(pg.get_ssl_mode());
    one.application_name("outboxd");
    one
}

fn replication_config(
    cfg: &Config,
    host_index: usize,
    start: u64,
    status_interval: Duration,
) -> Result<ReplicationConfig, RelayError> {
    let pg = pg_config(cfg)?;
    let name = nth_host(&pg, host_index, "127.0.0.1");
    // `hostaddr` says where to connect; the host name stays what TLS verifies.
    let host = match pg.get_hostaddrs().get(host_index) {
        Some(addr) => addr.to_string(),
        None => name.clone(),
    };
    let ports = pg.get_ports();
    let port = ports
        .get(host_index)
        .or(ports.first())
        .copied()
        .unwrap_or(5432);
    let password = pg
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let user = pg.get_user().unwrap_or("postgres").to_string();
    let db = pg.get_dbname().unwrap_or(&user).to_string();
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        db,
        cfg.source.slot.clone(),
        cfg.source.publication.as_str(),
    )
    .with_port(port)
    .with_start_lsn(Lsn(start))
    .with_ack_lsn(Lsn(start))
    .with_status_interval(status_interval)
    .with_wakeup_interval(status_interval)
    .with_tls(crate::relay::tls::replication(cfg.source.tls(), &pg, &name))
    .with_buffer_size(1024)
    // Pin how the walsender renders values: created_at is parsed from this text.
    .with_options(SESSION_OPTIONS)
    // The PID lets operators (and the HA tests) tell which instance holds the slot.
    .with_application_name(format!(
        "outboxd:{}:{}",
        cfg.source.slot,
        std::process::id()
    ))
    // Called after a status update that advanced the confirmed position was written.
    .with_feedback_observer(pgwire_replication::FeedbackObserver::new(|_| {
        crate::fail::hit("confirmed")
    })))
}

/// How the walsender renders values; recovery reads the outbox with the same settings so its
/// records are byte-identical to the stream's.
pub const SESSION_OPTIONS: &str = "-c datestyle=ISO,YMD -c timezone=UTC -c extra_float_digits=3";

/// Appends what to change when a connection was refused for a reason we can name: TLS
/// ([`crate::relay::tls::hint`]), or no walsender left for the stream (the SQL connection works, so
/// only the replication connection shows it).
pub fn with_hint(msg: String) -> String {
    let hint = if msg.contains("exceeds max_wal_senders") {
        Some(
            "every walsender is taken: raise max_wal_senders (needs a restart) or stop an \
             unused replication client (pg_stat_replication lists them)",
        )
    } else {
        crate::relay::tls::hint(&msg)
    };
    match hint {
        Some(h) => format!("{msg} — {h}"),
        None => msg,
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
