//! Shared harness of the end-to-end tests: a private Postgres + broker per test, the relay run
//! in-process (through `outboxd::run`) or as a real process that can be SIGKILLed, and a reader
//! that reads topics back from the beginning.
//!
//! # Layout
//! - [`Env`]: one test's world (cluster, database, broker, slot, config file).
//! - [`Relay`]: a relay running in this process; [`RelayProcess`]: a real `outboxd` process.
//! - [`read_topic`]: every record of a topic, by manual partition assignment (no group join).
//! - [`write_events`]: outbox rows written in real transactions.

use anyhow::{bail, Context, Result};
use outboxd_testkit::{Broker, Postgres, Proxy};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::sync::watch;

pub use outboxd;
pub use outboxd_testkit as testkit;

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
            dir: tempfile::tempdir()?,
            extra_toml: String::new(),
            kafka_toml: String::new(),
            pg_proxy: None,
            broker_proxy: None,
        };
        outboxd::admin::init(&env.config()?).await?;
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
        let row = c
            .query_one(
                "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await?;
        Ok(row.get::<_, Option<i64>>(0).unwrap_or(0) as u64)
    }

    /// Current WAL insert position.
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

/// Path of the relay binary built for the tests.
pub fn relay_bin() -> PathBuf {
    // target/<profile>/deps/<test-binary> → target/<profile>/outboxd-under-test
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    dir.join("outboxd-under-test")
}

/// A real relay process, killable with SIGKILL.
pub struct RelayProcess {
    pub child: Child,
    pub log: PathBuf,
}

impl RelayProcess {
    pub fn spawn(config: &std::path::Path, log: PathBuf) -> Result<Self> {
        Self::spawn_with_env(config, log, &[])
    }

    /// Spawns with extra environment, e.g. `OUTBOXD_FAILPOINTS=produced@50`.
    pub fn spawn_with_env(
        config: &std::path::Path,
        log: PathBuf,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let child = Command::new(relay_bin())
            .arg("run")
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .context("spawn relay")?;
        Ok(Self { child, log })
    }

    /// Waits for the process to exit by itself (e.g. at a failpoint), up to `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st);
            }
            if Instant::now() > deadline {
                bail!("relay still running after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn sigterm(&mut self) -> Result<std::process::ExitStatus> {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st);
            }
            if Instant::now() > deadline {
                self.sigkill();
                bail!("relay did not exit within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.sigkill();
    }
}

/// Creates topics with `partitions` partitions (idempotent enough for tests).
pub async fn create_topics(bootstrap: &str, names: &[&str], partitions: i32) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let topics: Vec<NewTopic> = names
        .iter()
        .map(|n| NewTopic::new(n, partitions, TopicReplication::Fixed(1)))
        .collect();
    let res = admin
        .create_topics(
            &topics,
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?;
    for r in res {
        if let Err((t, e)) = r {
            if e != rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists {
                bail!("create topic {t}: {e}");
            }
        }
    }
    Ok(())
}

/// One record read back from a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub headers: BTreeMap<String, String>,
    pub timestamp: Option<i64>,
}

impl Record {
    pub fn header(&self, k: &str) -> &str {
        self.headers.get(k).map(String::as_str).unwrap_or("")
    }
}

/// Reads every record of `topic` from the beginning until `min` records were seen and the topic
/// stayed quiet for a moment, or `timeout` passed. Manual assignment: no consumer-group join.
pub fn read_topic(
    bootstrap: &str,
    topic: &str,
    min: usize,
    timeout: Duration,
) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    scan_topic(bootstrap, topic, min, timeout, |m| {
        let mut headers = BTreeMap::new();
        if let Some(h) = m.headers() {
            for hd in h.iter() {
                headers.insert(
                    hd.key.to_string(),
                    String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                );
            }
        }
        out.push(Record {
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().unwrap_or_default().to_vec(),
            value: m.payload().unwrap_or_default().to_vec(),
            headers,
            timestamp: m.timestamp().to_millis(),
        });
    })?;
    Ok(out)
}

/// Like [`read_topic`] but hands each message to `f` instead of keeping it (for big topics);
/// returns how many were seen. (tansu's high watermarks lag, so tests count by reading.)
pub fn scan_topic(
    bootstrap: &str,
    topic: &str,
    min: usize,
    timeout: Duration,
    mut f: impl FnMut(&rdkafka::message::BorrowedMessage<'_>),
) -> Result<usize> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("reader-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?;
    let deadline = Instant::now() + timeout;
    let partitions = loop {
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(5))?;
        let n = md
            .topics()
            .first()
            .map(|t| t.partitions().len())
            .unwrap_or(0);
        if n > 0 {
            break n;
        }
        if Instant::now() > deadline {
            return Ok(0);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut seen = 0;
    let mut last = Instant::now();
    let settle = Duration::from_millis(700);
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                f(&m);
                seen += 1;
                last = Instant::now();
            }
            Some(Err(e)) => bail!("consume {topic}: {e}"),
            None => {
                if seen >= min && last.elapsed() > settle {
                    break;
                }
            }
        }
    }
    Ok(seen)
}

/// An event as the tests write it.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub event_id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub version: i64,
    pub event_type: String,
    pub payload: serde_json::Value,
}

/// Inserts `events` into the outbox in one transaction; commits unless `rollback`.
pub async fn write_events(
    c: &mut tokio_postgres::Client,
    events: &[NewEvent],
    rollback: bool,
) -> Result<()> {
    let tx = c.transaction().await?;
    let stmt = tx
        .prepare(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .await?;
    for e in events {
        tx.execute(
            &stmt,
            &[
                &e.event_id,
                &e.aggregate_type,
                &e.aggregate_id,
                &e.version,
                &e.event_type,
                &e.payload,
            ],
        )
        .await?;
    }
    if rollback {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(())
}

/// Runs `outboxd <args[0]> --config FILE <args[1..]>`; returns (exit code, stdout + stderr).
pub fn outboxd_cli(args: &[&str], config: &std::path::Path) -> (i32, String) {
    let out = Command::new(relay_bin())
        .arg(args[0])
        .arg("--config")
        .arg(config)
        .args(&args[1..])
        .output()
        .expect("run outboxd");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("condition not reached within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
