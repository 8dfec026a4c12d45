//! Where a connection to the source goes: the DSN (`source.dsn`, or `source.replication_dsn`
//! for the stream), with the source's password, TLS and session settings, and which host of a
//! multi-host DSN the replication stream opens on.

use crate::config::Config;
use crate::error::RelayError;
use pgwire_replication::{Lsn, ReplicationConfig};
use std::str::FromStr;
use std::time::Duration;
use tokio_postgres::config::Host;

/// Opens an ordinary SQL connection to the source (the connection task runs in the background).
pub async fn sql_connect(cfg: &Config) -> Result<tokio_postgres::Client, RelayError> {
    sql_connect_to(cfg, &cfg.source.dsn).await
}

/// [`sql_connect`] to another server of the same cluster (`source.replication_dsn`), with the
/// source's password and TLS settings.
pub async fn sql_connect_to(cfg: &Config, dsn: &str) -> Result<tokio_postgres::Client, RelayError> {
    let mut pg = pg_config_of(cfg, dsn)?;
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
    pg_config_of(cfg, &cfg.source.dsn)
}

pub(super) fn pg_config_of(cfg: &Config, dsn: &str) -> Result<tokio_postgres::Config, RelayError> {
    let mut pg = tokio_postgres::Config::from_str(dsn)
        .map_err(|e| RelayError::Setup(format!("source DSN: {e}")))?;
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
pub(super) fn describe(pg: &tokio_postgres::Config) -> String {
    let host = host_of(pg, "localhost");
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{host}:{port}/{}",
        pg.get_dbname().unwrap_or(pg.get_user().unwrap_or("?"))
    )
}

/// The DSN the stream opens on: `source.replication_dsn` (a standby holding the slot), else
/// `source.dsn`.
fn stream_dsn(cfg: &Config) -> &str {
    cfg.source
        .replication_dsn
        .as_deref()
        .unwrap_or(&cfg.source.dsn)
}

/// Which host of a multi-host DSN (`host=a,b target_session_attrs=read-write`) the stream
/// opens on: with the slot on the primary, the one that is a writable primary now, so after a
/// promotion the relay follows the new primary (where a PG17 failover slot waits). The SQL
/// connection finds it by itself (tokio-postgres honours target_session_attrs); the replication
/// client takes one host. With `source.replication_dsn` the slot lives on one server: its first
/// host.
pub(super) async fn stream_index(cfg: &Config) -> Result<usize, RelayError> {
    let pg = pg_config(cfg)?;
    let n = pg.get_hosts().len();
    if n <= 1 || cfg.source.replication_dsn.is_some() {
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

pub(super) fn replication_config(
    cfg: &Config,
    host_index: usize,
    start: u64,
    status_interval: Duration,
) -> Result<ReplicationConfig, RelayError> {
    let pg = pg_config_of(cfg, stream_dsn(cfg))?;
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

pub use crate::model::sql::quote_ident;

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
