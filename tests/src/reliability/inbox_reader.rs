//! [`InboxReader`]: reads a topic from the beginning on a thread, keeps every record's bytes
//! ([`Raw`]), and applies each record through [`outboxd_inbox::Inbox::process`] to the
//! [`Balances`] business in its own database.

use super::balances::Balances;
use super::writer::{connect, connect_retry};
use crate::kafka::reader_config;
use crate::wait::eventually;
use anyhow::{bail, Context, Result};
use outboxd_inbox::{Envelope, Inbox, Outcome};
use outboxd_testkit::kafka::{assign_all, StartAt};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::{Headers, Message};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

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
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<rdkafka::message::OwnedMessage>();
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
    let consumer: BaseConsumer = reader_config(bootstrap)
        .set("group.id", format!("inbox-reader-{}", Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "100")
        .create()?;
    // The broker may be down or restarting: keep trying, in short waits so a stop is seen.
    loop {
        if stop.load(AtomicOrdering::SeqCst) {
            return Ok(());
        }
        let assigned = assign_all(&consumer, topic, StartAt::Beginning, Duration::from_secs(2));
        if matches!(assigned, Ok(n) if n > 0) {
            break;
        }
    }
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
