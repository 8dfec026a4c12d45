//! [`Env`]: one test's world; [`Relay`]: a relay running in the test process.

use crate::outbox::{write_events_returning_lsn, NewEvent};
use crate::relay::read_log;
use crate::wait::eventually;
use anyhow::{Context, Result};
use outboxd_testkit::{Broker, Postgres, Proxy};
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::watch;

/// One test's world. Fields are public so tests can crash and restart the servers.
pub struct Env {
    pub pg: Postgres,
    pub broker: Broker,
    pub db: String,
    pub slot: String,
    pub dir: tempfile::TempDir,
    pub extra_toml: String,
    /// Extra `"key" = "value"` lines for `[sink.kafka]`.
    pub kafka_toml: String,
    /// When set, the relay reaches Postgres through this proxy (tests talk to Postgres directly).
    pub pg_proxy: Option<Proxy>,
    /// When set, everyone reaches the broker through this proxy.
    pub broker_proxy: Option<Proxy>,
}

impl Env {
    /// Starts Postgres and the broker, creates a database, applies `sql/` via `outboxd init`.
    pub async fn start(name: &str) -> Result<Self> {
        let pg = Postgres::start()?;
        let broker = Broker::start()?;
        Self::with(pg, broker, name).await
    }

    /// Like [`Env::start`], with fault proxies in front of Postgres and the broker.
    pub async fn start_with_proxies(name: &str) -> Result<Self> {
        let pg = Postgres::start()?;
        let pg_proxy = Proxy::start(0, ([127, 0, 0, 1], pg.port).into())?;
        let (broker, broker_proxy) = Broker::start_behind_proxy()?;
        let mut env = Self::with(pg, broker, name).await?;
        env.pg_proxy = Some(pg_proxy);
        env.broker_proxy = Some(broker_proxy);
        Ok(env)
    }

    pub async fn with(pg: Postgres, broker: Broker, name: &str) -> Result<Self> {
        let db = pg.create_database(name).await?;
        let env = Self {
            pg,
            broker,
            db,
            slot: format!("slot_{name}"),
            dir: outboxd_testkit::tempdir("env-")?,
            extra_toml: String::new(),
            kafka_toml: String::new(),
            pg_proxy: None,
            broker_proxy: None,
        };
        outboxd::init(&env.config()?).await?;
        Ok(env)
    }

    pub fn toml(&self) -> String {
        format!(
            r#"
[source]
dsn = "{dsn}"
slot = "{slot}"
status_interval_ms = 200
[sink.kafka]
"bootstrap.servers" = "{bootstrap}"
"linger.ms" = "2"
{kafka}
[relay]
shutdown_timeout_ms = 5000
max_backoff_ms = 1000
{extra}
"#,
            dsn = match &self.pg_proxy {
                Some(p) => self
                    .pg
                    .dsn(&self.db)
                    .replace(&format!(":{}/", self.pg.port), &format!(":{}/", p.port)),
                None => self.pg.dsn(&self.db),
            },
            slot = self.slot,
            bootstrap = self.broker.bootstrap(),
            extra = self.extra_toml,
            kafka = self.kafka_toml,
        )
    }

    pub fn config(&self) -> Result<outboxd::Config> {
        Ok(outboxd::Config::from_toml_and_env(
            &self.toml(),
            Vec::<(String, String)>::new(),
        )?)
    }

    /// Writes the config to a file (for relay processes and the CLI).
    pub fn config_file(&self) -> Result<PathBuf> {
        let p = self.dir.path().join("outboxd.toml");
        std::fs::write(&p, self.toml())?;
        Ok(p)
    }

    pub async fn sql(&self) -> Result<tokio_postgres::Client> {
        self.pg.connect(&self.db).await
    }

    pub fn bootstrap(&self) -> String {
        self.broker.bootstrap()
    }

    /// The slot's confirmed_flush_lsn.
    pub async fn confirmed_lsn(&self) -> Result<u64> {
        let c = self.sql().await?;
        // A missing slot (a recovery replacing it) has confirmed nothing yet.
        let row = c
            .query_opt(
                "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await?;
        Ok(row.and_then(|r| r.get::<_, Option<i64>>(0)).unwrap_or(0) as u64)
    }

    /// Drops the slot (as an operator, a failover or a restore without it would), once no
    /// walsender holds it any more.
    pub async fn drop_slot(&self) -> Result<()> {
        let c = self.sql().await?;
        // A walsender may still hold it for a moment after its relay went away.
        eventually(Duration::from_secs(30), || async {
            c.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
                &[&self.slot],
            )
            .await?;
            Ok(
                c.execute("SELECT pg_drop_replication_slot($1)", &[&self.slot])
                    .await
                    .is_ok(),
            )
        })
        .await
    }

    /// Waits until the slot confirmed everything written before this call (writes may go on).
    pub async fn caught_up(&self, timeout: Duration) -> Result<()> {
        let target = self.current_lsn().await?;
        eventually(timeout, || async {
            Ok(self.confirmed_lsn().await? >= target)
        })
        .await
        .with_context(|| format!("the slot did not reach {target:X}"))
    }

    /// Writes `n` events of one aggregate and waits until the slot confirms past them (the
    /// broker acknowledged all); on timeout the error carries the relay's `log`.
    pub async fn deliver(&self, aggregate_id: &str, n: i64, log: &std::path::Path) -> Result<()> {
        let mut c = self.sql().await?;
        let events: Vec<NewEvent> = (1..=n)
            .map(|v| {
                NewEvent::new(
                    "acct",
                    aggregate_id,
                    v,
                    "Deposited",
                    serde_json::json!({"v": v}),
                )
            })
            .collect();
        let lsn = write_events_returning_lsn(&mut c, &events).await?;
        eventually(Duration::from_secs(60), || async {
            Ok(self.confirmed_lsn().await? > lsn)
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e}: {}", read_log(log)))
    }

    /// `acked_lsn` of the relay's `outboxd_slot_state` row (0 before the first write).
    pub async fn recorded_acked_lsn(&self) -> Result<u64> {
        let c = self.sql().await?;
        let r = c
            .query_opt(
                "SELECT (acked_lsn - '0/0')::bigint FROM outboxd_slot_state WHERE slot_name = $1",
                &[&self.slot],
            )
            .await?;
        Ok(r.map_or(0, |r| r.get::<_, i64>(0) as u64))
    }

    /// Current WAL insert position.
    /// Waits (up to `timeout`) until the slot is confirmed past the server's current WAL
    /// position: everything committed so far was acknowledged and confirmed.
    pub async fn confirmed_past_now(&self, timeout: std::time::Duration) -> Result<()> {
        let target = self.current_lsn().await?;
        crate::eventually(timeout, || async {
            Ok(self.confirmed_lsn().await? >= target)
        })
        .await
    }

    /// Waits until the relay recorded a delivery mark, and a delivered_xid past every
    /// transaction that started before the call (what cleanup may then delete).
    pub async fn mark_recorded(&self) -> Result<()> {
        let c = self.sql().await?;
        let next: String = c
            .query_one("SELECT pg_snapshot_xmax(pg_current_snapshot())::text", &[])
            .await?
            .get(0);
        eventually(Duration::from_secs(30), || async {
            let r = c
                .query_opt(
                    "SELECT delivery_mark IS NOT NULL AND delivered_xid >= $2::text::xid8 \
                     FROM outboxd_slot_state WHERE slot_name = $1",
                    &[&self.slot, &next],
                )
                .await?;
            Ok(r.is_some_and(|r| r.get::<_, bool>(0)))
        })
        .await
    }

    pub async fn current_lsn(&self) -> Result<u64> {
        let c = self.sql().await?;
        let row = c
            .query_one("SELECT (pg_current_wal_lsn() - '0/0')::bigint", &[])
            .await?;
        Ok(row.get::<_, i64>(0) as u64)
    }
}

/// A relay running inside the test process.
pub struct Relay {
    stop: watch::Sender<bool>,
    handle: tokio::task::JoinHandle<Result<(), outboxd::RelayError>>,
}

impl Relay {
    pub fn start(cfg: outboxd::Config) -> Self {
        let (stop, rx) = watch::channel(false);
        let handle = tokio::spawn(outboxd::run(cfg, rx));
        Self { stop, handle }
    }

    /// Graceful shutdown (like SIGTERM); returns the relay's result.
    pub async fn shutdown(self) -> Result<()> {
        let _ = self.stop.send(true);
        self.handle.await?.map_err(anyhow::Error::from)
    }

    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    pub async fn join(self) -> Result<(), outboxd::RelayError> {
        self.handle.await.expect("relay task panicked")
    }
}
