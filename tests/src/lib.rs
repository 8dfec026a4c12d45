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

    /// Waits until the slot confirmed everything written before this call (writes may go on).
    pub async fn caught_up(&self, timeout: Duration) -> Result<()> {
        let target = self.current_lsn().await?;
        eventually(timeout, || async {
            Ok(self.confirmed_lsn().await? >= target)
        })
        .await
        .with_context(|| format!("the slot did not reach {target:X}"))
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
        let mut cmd = Command::new(relay_bin());
        cmd.arg("run")
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f);
        outboxd_testkit::die_with_parent(&mut cmd);
        let child = cmd.spawn().context("spawn relay")?;
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

/// Creates a 3-partition topic with tansu's own CLI on the broker's plain port (for brokers
/// whose advertised address a Kafka admin client cannot use: behind a blackholed or TLS proxy).
pub fn create_topic_on_port(broker_port: u16, topic: &str) -> Result<()> {
    let out = Command::new(outboxd_testkit::tansu_bin())
        .args(["topic", "create", "--partitions", "3", "--broker"])
        .arg(format!("tcp://127.0.0.1:{broker_port}"))
        .arg(topic)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "tansu topic create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A private certificate authority for TLS tests (rcgen).
pub mod certs {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

    pub struct Ca {
        pub cert: rcgen::Certificate,
        key: KeyPair,
    }

    impl Ca {
        pub fn new(name: &str) -> anyhow::Result<Self> {
            let mut p = CertificateParams::new(Vec::<String>::new())?;
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.distinguished_name.push(DnType::CommonName, name);
            let key = KeyPair::generate()?;
            Ok(Self {
                cert: p.self_signed(&key)?,
                key,
            })
        }

        /// Signs `p` with a fresh key: (certificate, key) PEM.
        pub fn sign(&self, p: CertificateParams) -> anyhow::Result<(String, String)> {
            let key = KeyPair::generate()?;
            let cert = p.signed_by(&key, &self.cert, &self.key)?;
            Ok((cert.pem(), key.serialize_pem()))
        }

        /// A server certificate for `names` (DNS names or IP addresses).
        pub fn server(&self, names: &[&str]) -> anyhow::Result<(String, String)> {
            self.sign(CertificateParams::new(
                names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            )?)
        }
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

impl NewEvent {
    /// An event with a fresh UUIDv7 `event_id`.
    pub fn new(
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
        event_type: &str,
        payload: serde_json::Value,
    ) -> Self {
        Self {
            event_id: uuid::Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            version,
            event_type: event_type.into(),
            payload,
        }
    }
}

/// Inserts `events` into the outbox in one transaction; commits unless `rollback`.
pub async fn write_events(
    c: &mut tokio_postgres::Client,
    events: &[NewEvent],
    rollback: bool,
) -> Result<()> {
    let tx = c.transaction().await?;
    insert_events(&tx, events).await?;
    if rollback {
        tx.rollback().await?;
    } else {
        tx.commit().await?;
    }
    Ok(())
}

/// Writes `events` in one committed transaction and returns `pg_current_wal_insert_lsn()` read
/// inside it, after the inserts and before the commit. The commit record starts at or after
/// this position, so a slot confirmed at or below it has not passed the transaction (an idle
/// relay may confirm exactly this position: the walsender had read up to it when it reported).
pub async fn write_events_returning_lsn(
    c: &mut tokio_postgres::Client,
    events: &[NewEvent],
) -> Result<u64> {
    let tx = c.transaction().await?;
    insert_events(&tx, events).await?;
    let lsn: i64 = tx
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::int8", &[])
        .await?
        .get(0);
    tx.commit().await?;
    Ok(lsn as u64)
}

async fn insert_events(tx: &tokio_postgres::Transaction<'_>, events: &[NewEvent]) -> Result<()> {
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

/// Shared machinery of the reliability tests (crash windows, faults, high availability, soak):
/// a writer that knows exactly what committed, an inbox-library consumer with its own business
/// table, and the delivery checks every one of those tests makes.
///
/// - [`reliability::Writer`]: random transactions (some rolled back) on its own connection;
///   survives a crashing Postgres and records, per committed transaction, an upper bound of
///   its commit LSN (for "the slot never passed an undelivered event" checks).
/// - [`reliability::InboxReader`]: reads a topic from the beginning (manual assignment) on a
///   thread, keeps every record's bytes, and applies each record through
///   [`outboxd_inbox::Inbox::process`] to a business table (`account`, `movement`) in its own
///   database. The table has no unique constraint of its own: only the inbox can dedupe.
/// - [`reliability::verify_delivery`], [`reliability::verify_effects`],
///   [`reliability::check_slot_invariant`]: the assertions.
pub mod reliability {
    use super::*;
    use outboxd_inbox::{Envelope, Gap, GapResolution, Handler, HandlerError, Inbox, Outcome};
    use rand::{Rng, SeedableRng};
    use std::collections::{HashMap, HashSet};
    use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
    use std::sync::{Arc, Mutex};
    use uuid::Uuid;

    /// One event as written by [`Writer`].
    #[derive(Debug, Clone)]
    pub struct Written {
        pub aggregate_id: String,
        pub version: i64,
        pub amount: i64,
        pub payload: serde_json::Value,
    }

    /// A committed transaction: its events and LSNs bracketing its commit record's end
    /// (`pg_current_wal_insert_lsn()` read before COMMIT and after it returned; `u64::MAX`
    /// if the latter is unknown).
    #[derive(Debug, Clone)]
    pub struct CommittedTx {
        pub ids: Vec<Uuid>,
        /// Read inside the transaction just before COMMIT: strictly below its commit LSN
        /// (0 if unknown).
        pub lsn_before: u64,
        pub lsn_after: u64,
    }

    /// Everything the writer knows: the truth the delivery is checked against.
    #[derive(Debug, Clone, Default)]
    pub struct WriteLog {
        pub committed: HashMap<Uuid, Written>,
        pub rolled_back: HashSet<Uuid>,
        pub txs: Vec<CommittedTx>,
        /// Transactions whose COMMIT failed and whose outcome was then read from the outbox.
        pub resolved_unknown: usize,
        /// Connection errors the writer survived.
        pub errors: usize,
    }

    /// Shape of the write load.
    #[derive(Debug, Clone)]
    pub struct Load {
        pub aggregate_type: String,
        pub aggregates: usize,
        pub max_tx_events: usize,
        pub rollback_ratio: f64,
        /// Pause between transactions, in milliseconds (uniform in the range).
        pub pause_ms: std::ops::Range<u64>,
        pub max_pad: usize,
    }

    impl Default for Load {
        fn default() -> Self {
            Self {
                aggregate_type: "acct".into(),
                aggregates: 40,
                max_tx_events: 10,
                rollback_ratio: 0.15,
                pause_ms: 20..60,
                max_pad: 300,
            }
        }
    }

    /// Writes random transactions until stopped. See the module docs.
    pub struct Writer {
        log: Arc<Mutex<WriteLog>>,
        stop: watch::Sender<bool>,
        paused: watch::Sender<bool>,
        /// Set by the loop while it is parked on `paused` (no transaction open).
        idle: Arc<AtomicBool>,
        handle: tokio::task::JoinHandle<Result<()>>,
    }

    impl Writer {
        pub fn start(dsn: String, load: Load) -> Self {
            let log = Arc::new(Mutex::new(WriteLog::default()));
            let (stop, stop_rx) = watch::channel(false);
            let (paused, paused_rx) = watch::channel(false);
            let idle = Arc::new(AtomicBool::new(false));
            let handle = tokio::spawn(write_loop(
                dsn,
                load,
                log.clone(),
                stop_rx,
                paused_rx,
                idle.clone(),
            ));
            Self {
                log,
                stop,
                paused,
                idle,
                handle,
            }
        }

        /// A copy of what is known so far.
        pub fn snapshot(&self) -> WriteLog {
            self.log.lock().unwrap().clone()
        }

        pub fn committed_events(&self) -> usize {
            self.log.lock().unwrap().committed.len()
        }

        /// Waits until at least `n` events committed.
        pub async fn wait_committed(&self, n: usize, timeout: Duration) -> Result<()> {
            eventually(timeout, || async { Ok(self.committed_events() >= n) }).await
        }

        /// Pauses (true) or resumes (false) writing; returns once no transaction is open.
        pub async fn pause(&self, on: bool) {
            let _ = self.paused.send(on);
            if on {
                let deadline = Instant::now() + Duration::from_secs(120);
                while !self.idle.load(AtomicOrdering::SeqCst) && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }

        /// Stops the writer and returns the final log (every outcome resolved).
        pub async fn stop(self) -> Result<WriteLog> {
            let _ = self.stop.send(true);
            self.handle.await??;
            let log = self.log.lock().unwrap().clone();
            Ok(log)
        }
    }

    async fn connect(dsn: &str) -> Result<tokio_postgres::Client> {
        let (client, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(client)
    }

    /// Connects, retrying for up to a minute (the server may be restarting).
    pub async fn connect_retry(dsn: &str) -> Result<tokio_postgres::Client> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match connect(dsn).await {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e.context("reconnect for 60 s")),
            }
        }
    }

    enum TxEnd {
        /// (lsn_before, lsn_after)
        Committed(u64, u64),
        RolledBack,
        /// COMMIT was sent and no answer came back.
        Unknown,
    }

    async fn write_tx(
        c: &mut tokio_postgres::Client,
        agg_type: &str,
        batch: &[(Uuid, Written)],
        rollback: bool,
    ) -> std::result::Result<TxEnd, (bool, tokio_postgres::Error)> {
        // Err((commit_sent, e))
        let tx = c.transaction().await.map_err(|e| (false, e))?;
        let stmt = tx
            .prepare(
                "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
                 VALUES ($1, $2, $3, $4, 'Deposited', $5)",
            )
            .await
            .map_err(|e| (false, e))?;
        for (id, w) in batch {
            tx.execute(
                &stmt,
                &[id, &agg_type, &w.aggregate_id, &w.version, &w.payload],
            )
            .await
            .map_err(|e| (false, e))?;
        }
        if rollback {
            tx.rollback().await.map_err(|e| (false, e))?;
            return Ok(TxEnd::RolledBack);
        }
        let before = tx
            .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[])
            .await
            .map_err(|e| (false, e))?
            .get::<_, i64>(0) as u64;
        if let Err(e) = tx.commit().await {
            return if e.as_db_error().is_some() {
                Err((false, e)) // the server refused the commit: rolled back
            } else {
                let _ = e;
                Ok(TxEnd::Unknown)
            };
        }
        let lsn = match c
            .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[])
            .await
        {
            Ok(r) => r.get::<_, i64>(0) as u64,
            Err(_) => u64::MAX,
        };
        Ok(TxEnd::Committed(before, lsn))
    }

    async fn write_loop(
        dsn: String,
        load: Load,
        log: Arc<Mutex<WriteLog>>,
        mut stop: watch::Receiver<bool>,
        mut paused: watch::Receiver<bool>,
        idle: Arc<AtomicBool>,
    ) -> Result<()> {
        let mut rng = rand::rngs::StdRng::from_entropy();
        let mut versions: HashMap<String, i64> = HashMap::new();
        let mut c = connect_retry(&dsn).await?;
        loop {
            if *stop.borrow_and_update() {
                return Ok(());
            }
            if *paused.borrow_and_update() {
                idle.store(true, AtomicOrdering::SeqCst);
                tokio::select! {
                    _ = paused.changed() => {}
                    _ = stop.changed() => {}
                }
                idle.store(false, AtomicOrdering::SeqCst);
                continue;
            }
            let rollback = rng.gen_bool(load.rollback_ratio);
            let mut next = versions.clone();
            let batch: Vec<(Uuid, Written)> = (0..rng.gen_range(1..=load.max_tx_events))
                .map(|_| {
                    let agg = format!(
                        "{}-{}",
                        load.aggregate_type,
                        rng.gen_range(0..load.aggregates)
                    );
                    let v = next.entry(agg.clone()).or_insert(0);
                    *v += 1;
                    let amount = rng.gen_range(1..1000i64);
                    let pad = "p".repeat(rng.gen_range(0..=load.max_pad));
                    (
                        Uuid::now_v7(),
                        Written {
                            aggregate_id: agg,
                            version: *v,
                            amount,
                            payload: serde_json::json!({"amount": amount, "pad": pad}),
                        },
                    )
                })
                .collect();
            let end = match write_tx(&mut c, &load.aggregate_type, &batch, rollback).await {
                Ok(end) => end,
                Err((_, e)) => {
                    // Failed before COMMIT (or the server refused it): nothing committed.
                    log.lock().unwrap().errors += 1;
                    let _ = e;
                    TxEnd::RolledBack
                }
            };
            let end = match end {
                TxEnd::Unknown => {
                    log.lock().unwrap().errors += 1;
                    c = connect_retry(&dsn).await?;
                    let n: i64 = c
                        .query_one(
                            "SELECT count(*) FROM outbox WHERE event_id = $1",
                            &[&batch[0].0],
                        )
                        .await?
                        .get(0);
                    log.lock().unwrap().resolved_unknown += 1;
                    if n > 0 {
                        TxEnd::Committed(0, u64::MAX)
                    } else {
                        TxEnd::RolledBack
                    }
                }
                e => e,
            };
            {
                let mut l = log.lock().unwrap();
                match end {
                    TxEnd::Committed(before, after) => {
                        versions = next;
                        l.txs.push(CommittedTx {
                            ids: batch.iter().map(|(id, _)| *id).collect(),
                            lsn_before: before,
                            lsn_after: after,
                        });
                        l.committed.extend(batch);
                    }
                    _ => l.rolled_back.extend(batch.into_iter().map(|(id, _)| id)),
                }
            }
            if c.is_closed() {
                c = connect_retry(&dsn).await?;
            }
            let pause = rng.gen_range(load.pause_ms.clone());
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(pause)) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// Key, value, headers and timestamp of a [`Raw`] record.
    pub type RawContent<'a> = (
        &'a Option<Vec<u8>>,
        &'a Option<Vec<u8>>,
        &'a [(String, Option<Vec<u8>>)],
        Option<i64>,
    );

    /// A record exactly as read from the broker (headers in order, with their bytes).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Raw {
        pub topic: String,
        pub partition: i32,
        pub offset: i64,
        pub key: Option<Vec<u8>>,
        pub value: Option<Vec<u8>>,
        pub headers: Vec<(String, Option<Vec<u8>>)>,
        pub timestamp: Option<i64>,
        /// Which reader (a new one starts after a broker restart) saw it.
        pub reader: u32,
        /// When the reader received it (Unix milliseconds).
        pub received_ms: i64,
    }

    impl Raw {
        pub fn header(&self, k: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n == k)
                .and_then(|(_, v)| v.as_deref())
                .and_then(|v| std::str::from_utf8(v).ok())
        }

        /// Everything a consumer can see of the record except where it landed.
        pub fn content(&self) -> RawContent<'_> {
            (&self.key, &self.value, &self.headers, self.timestamp)
        }
    }

    /// The consumer's business: account balances. `movement` deliberately has no unique key,
    /// so a second application of an event would show up as a second row.
    pub const BUSINESS_SQL: &str = "
        CREATE TABLE account (id text PRIMARY KEY, balance bigint NOT NULL,
                              version bigint NOT NULL, applied int NOT NULL);
        CREATE TABLE movement (seq bigserial PRIMARY KEY, event_id uuid NOT NULL,
                               account text NOT NULL, version bigint NOT NULL,
                               amount bigint NOT NULL);";

    /// The handler: adds `payload.amount` to the account's balance. Ordered per aggregate; it
    /// also checks itself that it only ever sees the next version.
    pub struct Balances;

    impl Handler for Balances {
        fn name(&self) -> &str {
            "balances"
        }

        fn ordering(&self) -> outboxd_inbox::Ordering {
            outboxd_inbox::Ordering::PerAggregate {
                hold_for: Duration::from_secs(3600),
            }
        }

        async fn apply(
            &self,
            tx: &tokio_postgres::Transaction<'_>,
            e: &Envelope,
        ) -> std::result::Result<serde_json::Value, HandlerError> {
            let body: serde_json::Value = e.payload_as()?;
            let amount = body["amount"]
                .as_i64()
                .ok_or_else(|| HandlerError::permanent("payload without amount"))?;
            let prev: i64 = tx
                .query_opt(
                    "SELECT version FROM account WHERE id = $1 FOR UPDATE",
                    &[&e.aggregate_id],
                )
                .await?
                .map(|r| r.get(0))
                .unwrap_or(0);
            if e.aggregate_version != prev + 1 {
                return Err(HandlerError::permanent(format!(
                    "{} version {} applied after {prev}",
                    e.aggregate_id, e.aggregate_version
                )));
            }
            let row = tx
                .query_one(
                    "INSERT INTO account (id, balance, version, applied) VALUES ($1, $2, $3, 1)
                     ON CONFLICT (id) DO UPDATE SET balance = account.balance + $2,
                        version = $3, applied = account.applied + 1
                     RETURNING balance",
                    &[&e.aggregate_id, &amount, &e.aggregate_version],
                )
                .await?;
            tx.execute(
                "INSERT INTO movement (event_id, account, version, amount) VALUES ($1, $2, $3, $4)",
                &[&e.event_id, &e.aggregate_id, &e.aggregate_version, &amount],
            )
            .await?;
            Ok(serde_json::json!({"balance": row.get::<_, i64>(0)}))
        }

        async fn on_gap_timeout(
            &self,
            _tx: &tokio_postgres::Transaction<'_>,
            _gap: &Gap,
        ) -> std::result::Result<GapResolution, HandlerError> {
            Ok(GapResolution::KeepHolding)
        }
    }

    /// Creates the consumer database (inbox tables + business tables); returns its name.
    pub async fn consumer_db(pg: &outboxd_testkit::Postgres, name: &str) -> Result<String> {
        let db = pg.create_database(name).await?;
        let c = pg.connect(&db).await?;
        outboxd_inbox::migrate(&c).await?;
        c.batch_execute(BUSINESS_SQL).await?;
        Ok(db)
    }

    /// Counters of an [`InboxReader`].
    #[derive(Debug, Clone, Default)]
    pub struct InboxStats {
        pub records: u64,
        pub applied: u64,
        pub released: u64,
        pub duplicates: u64,
        pub held: u64,
        pub stale: u64,
        /// Kafka errors the reader survived (e.g. the broker went away).
        pub kafka_errors: u64,
        /// Consumer-database errors retried (e.g. its Postgres restarted).
        pub db_retries: u64,
        /// Largest delay between an event's commit (record timestamp) and its first arrival.
        pub max_delay_ms: i64,
        /// A record the inbox could not process: the reader stopped there.
        pub fatal: Option<String>,
    }

    struct Shared {
        records: Mutex<Vec<Raw>>,
        stats: Mutex<InboxStats>,
        last_record: Mutex<Instant>,
        first_seen: Mutex<HashSet<Uuid>>,
    }

    /// An inbox-library consumer; see the module docs.
    pub struct InboxReader {
        shared: Arc<Shared>,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
        task: Option<tokio::task::JoinHandle<()>>,
        generation: u32,
        bootstrap: String,
        topic: String,
        dsn: String,
    }

    impl InboxReader {
        /// Starts reading `topic` from the beginning and applying it to the database at `dsn`.
        pub fn start(bootstrap: &str, topic: &str, dsn: &str) -> Self {
            let shared = Arc::new(Shared {
                records: Mutex::new(Vec::new()),
                stats: Mutex::new(InboxStats::default()),
                last_record: Mutex::new(Instant::now()),
                first_seen: Mutex::new(HashSet::new()),
            });
            let mut r = Self {
                shared,
                stop: Arc::new(AtomicBool::new(false)),
                thread: None,
                task: None,
                generation: 0,
                bootstrap: bootstrap.into(),
                topic: topic.into(),
                dsn: dsn.into(),
            };
            r.spawn();
            r
        }

        fn spawn(&mut self) {
            let (tx, mut rx) =
                tokio::sync::mpsc::unbounded_channel::<rdkafka::message::OwnedMessage>();
            let stop = Arc::new(AtomicBool::new(false));
            self.stop = stop.clone();
            let (bootstrap, topic, shared, generation) = (
                self.bootstrap.clone(),
                self.topic.clone(),
                self.shared.clone(),
                self.generation,
            );
            self.thread = Some(std::thread::spawn(move || {
                if let Err(e) = kafka_loop(&bootstrap, &topic, &shared, &stop, generation, tx) {
                    shared.stats.lock().unwrap().fatal = Some(format!("reader: {e:#}"));
                }
            }));
            let (shared, dsn) = (self.shared.clone(), self.dsn.clone());
            self.task = Some(tokio::spawn(async move {
                let inbox = Inbox::new(Balances);
                let mut db = match connect_retry(&dsn).await {
                    Ok(c) => c,
                    Err(e) => {
                        shared.stats.lock().unwrap().fatal = Some(format!("{e:#}"));
                        return;
                    }
                };
                while let Some(m) = rx.recv().await {
                    if let Err(e) = apply_one(&inbox, &mut db, &dsn, &shared, &m).await {
                        shared.stats.lock().unwrap().fatal = Some(e);
                        return;
                    }
                }
            }));
        }

        /// Stops this reader and starts a fresh one from the beginning of the topic (after a
        /// broker restart: the new broker's offsets start again at 0). Records and the inbox
        /// database are kept.
        pub async fn restart(&mut self) -> Result<()> {
            self.stop_reading().await?;
            self.start_reading();
            Ok(())
        }

        /// Stops reading (the Kafka client is destroyed); what was read stays applied.
        pub async fn stop_reading(&mut self) -> Result<()> {
            self.halt().await
        }

        /// Starts a fresh Kafka client reading the topic from its beginning (see
        /// [`Self::restart`]). Use `stop_reading` before a broker is replaced and this after:
        /// librdkafka 2.12.1 has been seen to segfault (`rd_kafka_metadata_cache_find` in
        /// `rd_kafka_metadata_update_op`) in a client that lives through a broker restart with
        /// re-created topics.
        pub fn start_reading(&mut self) {
            self.generation += 1;
            self.spawn();
        }

        async fn halt(&mut self) -> Result<()> {
            self.stop.store(true, AtomicOrdering::SeqCst);
            if let Some(t) = self.thread.take() {
                tokio::task::spawn_blocking(move || t.join())
                    .await?
                    .map_err(|_| anyhow::anyhow!("reader thread panicked"))?;
            }
            if let Some(t) = self.task.take() {
                t.await?;
            }
            Ok(())
        }

        pub fn stats(&self) -> InboxStats {
            self.shared.stats.lock().unwrap().clone()
        }

        pub fn records(&self) -> Vec<Raw> {
            self.shared.records.lock().unwrap().clone()
        }

        /// Distinct event ids read so far.
        pub fn seen_ids(&self) -> HashSet<Uuid> {
            self.shared.first_seen.lock().unwrap().clone()
        }

        /// Waits until no record arrived for `quiet`.
        pub async fn wait_quiet(&self, quiet: Duration, timeout: Duration) -> Result<()> {
            eventually(timeout, || async {
                Ok(self.shared.last_record.lock().unwrap().elapsed() >= quiet)
            })
            .await
        }

        /// Waits until `ids` were all read and applied, or fails with the reader's error.
        pub async fn wait_applied(&self, ids: &HashSet<Uuid>, timeout: Duration) -> Result<()> {
            let c = connect_retry(&self.dsn).await?;
            let want = ids.len() as i64;
            let r = eventually(timeout, || async {
                if let Some(f) = &self.stats().fatal {
                    bail!("inbox reader stopped: {f}");
                }
                let n: i64 = c
                    .query_one("SELECT count(DISTINCT event_id) FROM movement", &[])
                    .await?
                    .get(0);
                Ok(n >= want)
            })
            .await;
            if r.is_err() {
                let seen = self.seen_ids();
                let missing: Vec<_> = ids.iter().filter(|i| !seen.contains(i)).take(5).collect();
                return r.with_context(|| {
                    format!(
                        "{} of {} events never read, e.g. {missing:?}; stats {:?}",
                        ids.iter().filter(|i| !seen.contains(i)).count(),
                        ids.len(),
                        self.stats()
                    )
                });
            }
            Ok(())
        }

        /// Stops reading; returns the counters and every record read.
        pub async fn stop(mut self) -> Result<(InboxStats, Vec<Raw>)> {
            self.halt().await?;
            Ok((self.stats(), self.records()))
        }
    }

    impl Drop for InboxReader {
        fn drop(&mut self) {
            self.stop.store(true, AtomicOrdering::SeqCst);
        }
    }

    fn kafka_loop(
        bootstrap: &str,
        topic: &str,
        shared: &Shared,
        stop: &AtomicBool,
        generation: u32,
        tx: tokio::sync::mpsc::UnboundedSender<rdkafka::message::OwnedMessage>,
    ) -> Result<()> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", format!("inbox-reader-{}", Uuid::new_v4()))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", "100")
            .create()?;
        let partitions = loop {
            if stop.load(AtomicOrdering::SeqCst) {
                return Ok(());
            }
            let n = consumer
                .fetch_metadata(Some(topic), Duration::from_secs(2))
                .ok()
                .and_then(|md| md.topics().first().map(|t| t.partitions().len()))
                .unwrap_or(0);
            if n > 0 {
                break n;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions as i32 {
            tpl.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        while !stop.load(AtomicOrdering::SeqCst) {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    let raw = Raw {
                        topic: m.topic().to_string(),
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        value: m.payload().map(<[u8]>::to_vec),
                        headers: m
                            .headers()
                            .map(|h| {
                                h.iter()
                                    .map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec)))
                                    .collect()
                            })
                            .unwrap_or_default(),
                        timestamp: m.timestamp().to_millis(),
                        reader: generation,
                        received_ms: chrono_now_ms(),
                    };
                    if let Some(id) = raw.header("event_id").and_then(|s| Uuid::parse_str(s).ok()) {
                        if shared.first_seen.lock().unwrap().insert(id) {
                            if let Some(ts) = raw.timestamp {
                                let d = chrono_now_ms() - ts;
                                let mut s = shared.stats.lock().unwrap();
                                s.max_delay_ms = s.max_delay_ms.max(d);
                            }
                        }
                    }
                    shared.records.lock().unwrap().push(raw);
                    *shared.last_record.lock().unwrap() = Instant::now();
                    if tx.send(m.detach()).is_err() {
                        return Ok(());
                    }
                }
                Some(Err(_)) => shared.stats.lock().unwrap().kafka_errors += 1,
                None => {}
            }
        }
        Ok(())
    }

    fn chrono_now_ms() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }

    async fn apply_one(
        inbox: &Inbox<Balances>,
        db: &mut tokio_postgres::Client,
        dsn: &str,
        shared: &Shared,
        m: &rdkafka::message::OwnedMessage,
    ) -> std::result::Result<(), String> {
        let env = Envelope::from_message(m).map_err(|e| format!("malformed record: {e}"))?;
        let mut attempts = 0;
        let outcome = loop {
            match inbox.process(db, &env).await {
                Ok(o) => break o,
                Err(e)
                    if attempts < 600
                        && (e.is_transient()
                            || db.is_closed()
                            || matches!(e, outboxd_inbox::InboxError::Db(_))) =>
                {
                    attempts += 1;
                    shared.stats.lock().unwrap().db_retries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if db.is_closed() {
                        if let Ok(c) = connect(dsn).await {
                            *db = c;
                        }
                    }
                }
                Err(e) => {
                    return Err(format!(
                        "event {} ({} v{}): {e:?}",
                        env.event_id, env.aggregate_id, env.aggregate_version
                    ))
                }
            }
        };
        let mut s = shared.stats.lock().unwrap();
        s.records += 1;
        match outcome {
            Outcome::Applied { released, .. } => {
                s.applied += 1;
                s.released += released.len() as u64;
            }
            Outcome::Duplicate { .. } | Outcome::AlreadyHeld => s.duplicates += 1,
            Outcome::Held { .. } => s.held += 1,
            Outcome::Stale { .. } => s.stale += 1,
        }
        Ok(())
    }

    /// What [`verify_delivery`] found.
    #[derive(Debug, Clone, Default)]
    pub struct DeliveryReport {
        pub records: usize,
        pub distinct: usize,
        pub duplicates: usize,
        /// Largest number of copies of one event.
        pub max_copies: usize,
    }

    /// Checks every record read against what committed:
    /// - every record is a committed event (never a rolled-back or unknown one) and carries
    ///   exactly what was written: key = aggregate_id, value = payload, `aggregate_version`,
    ///   `aggregate_id`, `aggregate_type`, `event_type` headers;
    /// - every copy of an event is byte-identical to the first (key, value, headers in order,
    ///   timestamp) and landed on the same partition;
    /// - nothing committed is missing;
    /// - per aggregate, first occurrences arrive in version order with no gap (a replay may
    ///   repeat earlier versions).
    pub fn verify_delivery(
        records: &[Raw],
        log: &WriteLog,
        agg_type: &str,
    ) -> Result<DeliveryReport> {
        let mut first: HashMap<Uuid, &Raw> = HashMap::new();
        let mut copies: HashMap<Uuid, usize> = HashMap::new();
        // (reader, aggregate) → highest version seen so far; aggregate → partition
        let mut max_seen: HashMap<&str, i64> = HashMap::new();
        let mut partition_of: HashMap<(u32, &str), i32> = HashMap::new();
        for r in records {
            let id = r
                .header("event_id")
                .and_then(|s| Uuid::parse_str(s).ok())
                .with_context(|| format!("record without a valid event_id: {r:?}"))?;
            if log.rolled_back.contains(&id) {
                bail!(
                    "rolled-back event {id} was delivered ({}:{}@{})",
                    r.topic,
                    r.partition,
                    r.offset
                );
            }
            let Some(w) = log.committed.get(&id) else {
                bail!("unknown event {id} on the topic");
            };
            if r.key.as_deref() != Some(w.aggregate_id.as_bytes()) {
                bail!(
                    "{id}: key {:?} is not the aggregate_id {}",
                    r.key,
                    w.aggregate_id
                );
            }
            let value: serde_json::Value =
                serde_json::from_slice(r.value.as_deref().unwrap_or_default())
                    .with_context(|| format!("{id}: value is not JSON"))?;
            if value != w.payload {
                bail!("{id}: payload differs from the committed one");
            }
            let ver = w.version.to_string();
            for (h, want) in [
                ("aggregate_version", ver.as_str()),
                ("aggregate_id", w.aggregate_id.as_str()),
                ("aggregate_type", agg_type),
                ("event_type", "Deposited"),
            ] {
                if r.header(h) != Some(want) {
                    bail!("{id}: header {h} = {:?}, written {want:?}", r.header(h));
                }
            }
            match partition_of.get(&(r.reader, w.aggregate_id.as_str())) {
                Some(p) if *p != r.partition => {
                    bail!(
                        "aggregate {} on partitions {p} and {}",
                        w.aggregate_id,
                        r.partition
                    )
                }
                _ => {
                    partition_of.insert((r.reader, &w.aggregate_id), r.partition);
                }
            }
            *copies.entry(id).or_default() += 1;
            match first.get(&id) {
                Some(f) => {
                    if f.content() != r.content()
                        || f.partition != r.partition
                        || f.topic != r.topic
                    {
                        bail!("a copy of {id} differs from the first copy:\n first {f:?}\n later {r:?}");
                    }
                }
                None => {
                    first.insert(id, r);
                    let m = max_seen.entry(&w.aggregate_id).or_insert(0);
                    if w.version != *m + 1 {
                        bail!(
                            "order: {} version {} first arrived after version {} ({}:{}@{})",
                            w.aggregate_id,
                            w.version,
                            m,
                            r.topic,
                            r.partition,
                            r.offset
                        );
                    }
                    *m = w.version;
                }
            }
        }
        let missing: Vec<&Uuid> = log
            .committed
            .keys()
            .filter(|k| !first.contains_key(k))
            .collect();
        if !missing.is_empty() {
            bail!(
                "{} of {} committed events never delivered, e.g. {:?}",
                missing.len(),
                log.committed.len(),
                &missing[..missing.len().min(3)]
            );
        }
        Ok(DeliveryReport {
            records: records.len(),
            distinct: first.len(),
            duplicates: records.len() - first.len(),
            max_copies: copies.values().copied().max().unwrap_or(0),
        })
    }

    /// The consumer's business table shows each committed event's effect exactly once:
    /// one `movement` row per committed event and none for anything else, and every account's
    /// balance, version and application count equal what the committed events imply.
    /// Waits until `reader` applied every committed event and went quiet, stops it, and checks
    /// the records (`verify_delivery`) and the consumer's effects (`verify_effects`).
    pub async fn drain_and_verify(
        reader: InboxReader,
        wlog: &WriteLog,
        agg_type: &str,
        inbox_dsn: &str,
    ) -> Result<(InboxStats, DeliveryReport)> {
        let ids = wlog.committed.keys().copied().collect();
        reader.wait_applied(&ids, Duration::from_secs(120)).await?;
        reader
            .wait_quiet(Duration::from_secs(1), Duration::from_secs(30))
            .await?;
        let (stats, records) = reader.stop().await?;
        let report = verify_delivery(&records, wlog, agg_type)?;
        verify_effects(inbox_dsn, wlog).await?;
        assert!(stats.fatal.is_none(), "{stats:?}");
        Ok((stats, report))
    }

    pub async fn verify_effects(dsn: &str, log: &WriteLog) -> Result<()> {
        let c = connect_retry(dsn).await?;
        let twice: Vec<(Uuid, i64)> = c
            .query(
                "SELECT event_id, count(*) FROM movement GROUP BY event_id HAVING count(*) > 1 LIMIT 5",
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        if !twice.is_empty() {
            bail!("events applied more than once: {twice:?}");
        }
        let applied: HashSet<Uuid> = c
            .query("SELECT event_id FROM movement", &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let committed: HashSet<Uuid> = log.committed.keys().copied().collect();
        if let Some(x) = applied.difference(&committed).next() {
            bail!("event {x} applied but never committed");
        }
        if applied.len() != committed.len() {
            bail!(
                "{} events applied, {} committed",
                applied.len(),
                committed.len()
            );
        }
        let mut want: HashMap<&str, (i64, i64, i32)> = HashMap::new();
        for w in log.committed.values() {
            let e = want.entry(&w.aggregate_id).or_default();
            e.0 += w.amount;
            e.1 = e.1.max(w.version);
            e.2 += 1;
        }
        let rows = c
            .query("SELECT id, balance, version, applied FROM account", &[])
            .await?;
        if rows.len() != want.len() {
            bail!("{} accounts, {} expected", rows.len(), want.len());
        }
        for r in rows {
            let id: String = r.get(0);
            let got = (r.get::<_, i64>(1), r.get::<_, i64>(2), r.get::<_, i32>(3));
            let exp = want.get(id.as_str()).copied().unwrap_or_default();
            if got != exp {
                bail!("account {id}: (balance, version, applied) = {got:?}, expected {exp:?}");
            }
        }
        let processed: i64 = c
            .query_one(
                "SELECT count(*) FROM processed_event WHERE consumer = 'balances' AND outcome = 'applied'",
                &[],
            )
            .await?
            .get(0);
        if processed as usize != committed.len() {
            bail!(
                "{processed} processed_event rows, {} committed",
                committed.len()
            );
        }
        Ok(())
    }

    /// "The slot never passed an undelivered event": every transaction whose commit is surely
    /// at or before `confirmed` (the slot's confirmed_flush_lsn) must have all its events in
    /// `delivered`. Returns how many transactions the check covered.
    pub fn check_slot_invariant(
        log: &WriteLog,
        confirmed: u64,
        delivered: &HashSet<Uuid>,
    ) -> Result<usize> {
        let mut covered = 0;
        for tx in &log.txs {
            if tx.lsn_after <= confirmed {
                covered += 1;
                if let Some(id) = tx.ids.iter().find(|i| !delivered.contains(i)) {
                    bail!(
                        "the slot's confirmed LSN {} passed event {id} (committed by {}) that the broker never got",
                        source_lsn(confirmed),
                        source_lsn(tx.lsn_after)
                    );
                }
            }
        }
        Ok(covered)
    }

    /// [`check_slot_invariant`] against a fresh read of `topic` from the beginning (use it while
    /// no relay runs, so the broker's content cannot change under the check). Returns how many
    /// transactions the check covered and the event ids on the topic.
    pub fn check_slot_against_broker(
        bootstrap: &str,
        topic: &str,
        log: &WriteLog,
        confirmed: u64,
    ) -> Result<(usize, HashSet<Uuid>)> {
        let expected: usize = log
            .txs
            .iter()
            .filter(|t| t.lsn_after <= confirmed)
            .map(|t| t.ids.len())
            .sum();
        let mut delivered = HashSet::new();
        scan_topic(bootstrap, topic, expected, Duration::from_secs(60), |m| {
            if let Some(id) = m
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "event_id"))
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|s| Uuid::parse_str(s).ok())
            {
                delivered.insert(id);
            }
        })?;
        let covered = check_slot_invariant(log, confirmed, &delivered)?;
        Ok((covered, delivered))
    }

    /// Transactions on the broker that the slot has surely not confirmed (their commit LSN is
    /// above `confirmed`): a successor must deliver them again.
    pub fn delivered_beyond_slot(
        log: &WriteLog,
        confirmed: u64,
        delivered: &HashSet<Uuid>,
    ) -> usize {
        log.txs
            .iter()
            .filter(|t| t.lsn_before >= confirmed && t.ids.iter().any(|i| delivered.contains(i)))
            .count()
    }

    fn source_lsn(l: u64) -> String {
        format!("{:X}/{:X}", l >> 32, l & 0xffff_ffff)
    }

    /// PIDs of the relay processes streaming from `slot` (from `application_name`
    /// `outboxd:<slot>:<pid>` in pg_stat_replication, state catchup or streaming: a standby that
    /// lost the race for the slot shows up briefly in state `startup`, without the slot).
    pub async fn streaming_pids(c: &tokio_postgres::Client, slot: &str) -> Result<Vec<u32>> {
        let prefix = format!("outboxd:{slot}:");
        Ok(c.query(
            "SELECT application_name FROM pg_stat_replication \
                 WHERE application_name LIKE $1 || '%' AND state IN ('catchup', 'streaming')",
            &[&prefix],
        )
        .await?
        .iter()
        .filter_map(|r| {
            r.get::<_, String>(0)
                .strip_prefix(&prefix)
                .and_then(|p| p.parse().ok())
        })
        .collect())
    }

    /// Resident set size of a process in KiB.
    pub fn rss_kib(pid: u32) -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }

    /// The signal that ended a process, if any.
    pub fn exit_signal(st: &std::process::ExitStatus) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        st.signal()
    }

    /// A relay log without its colour escapes.
    pub fn strip_ansi(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }

    /// A relay process's log, colour escapes removed.
    pub fn read_log(p: &std::path::Path) -> String {
        strip_ansi(&std::fs::read_to_string(p).unwrap_or_default())
    }

    /// Waits for a relay process to exit by itself, without blocking the runtime.
    pub async fn wait_exit(
        p: &mut RelayProcess,
        timeout: Duration,
    ) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = p.child.try_wait()? {
                return Ok(st);
            }
            if Instant::now() > deadline {
                bail!("the relay still runs after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
