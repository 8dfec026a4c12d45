//! Topics: creating them, and reading them back from the beginning (every partition by manual
//! assignment, [`outboxd_testkit::kafka::assign_all`]: no consumer-group join).

use anyhow::{bail, Result};
pub use outboxd_testkit::kafka::create_topics;
use outboxd_testkit::kafka::{assign_all, StartAt};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

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

/// A client configuration for the tests' readers. `bootstrap` is `host:port`, optionally followed
/// by space-separated librdkafka `key=value` properties, so a reader can reach a broker that
/// demands TLS or SASL: `"127.0.0.1:9093 security.protocol=SASL_SSL sasl.mechanism=PLAIN …"`.
pub fn reader_config(bootstrap: &str) -> ClientConfig {
    let mut parts = bootstrap.split_whitespace();
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", parts.next().unwrap_or_default());
    for kv in parts {
        if let Some((k, v)) = kv.split_once('=') {
            cc.set(k, v);
        }
    }
    cc
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
    let consumer: BaseConsumer = reader_config(bootstrap)
        .set("group.id", format!("reader-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?;
    let deadline = Instant::now() + timeout;
    if assign_all(&consumer, topic, StartAt::Beginning, timeout)? == 0 {
        return Ok(0);
    }
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
