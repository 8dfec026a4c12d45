//! Read-back after the clock stopped: every loaded event must be on the topic, and each
//! aggregate's events must appear in version (= commit) order within its partition.

use anyhow::{bail, Result};
use outboxd_testkit::kafka::{assign_all, StartAt};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Verified {
    pub expected: u64,
    /// Distinct events seen.
    pub distinct: u64,
    /// Records beyond the first copy of an event (at-least-once allows them; none expected).
    pub duplicates: u64,
    /// Records whose version is lower than an earlier one of the same aggregate.
    pub out_of_order: u64,
}

impl Verified {
    pub fn ok(&self) -> bool {
        self.distinct == self.expected && self.out_of_order == 0
    }
}

/// Reads `topic` from the beginning until versions `first..first+n` were all seen (or
/// `timeout`), without keeping the records.
pub fn verify_topic(
    bootstrap: &str,
    topic: &str,
    first: i64,
    n: u64,
    timeout: Duration,
) -> Result<Verified> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("bench-verify-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?;
    let deadline = Instant::now() + timeout;
    if assign_all(&consumer, topic, StartAt::Beginning, timeout)? == 0 {
        bail!("topic {topic} has no partitions");
    }
    let mut seen = vec![false; n as usize];
    let mut last: HashMap<Vec<u8>, i64> = HashMap::new();
    let mut v = Verified {
        expected: n,
        ..Default::default()
    };
    while v.distinct < n && Instant::now() < deadline {
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m?;
        let version = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "aggregate_version"))
            .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse::<i64>().ok());
        let Some(version) = version else {
            bail!("record without aggregate_version on {topic}");
        };
        let Some(slot) = seen.get_mut((version - first) as usize) else {
            bail!("unexpected version {version} on {topic}");
        };
        if std::mem::replace(slot, true) {
            v.duplicates += 1;
        } else {
            v.distinct += 1;
        }
        let key = m.key().unwrap_or_default().to_vec();
        let prev = last.entry(key).or_insert(i64::MIN);
        if version < *prev {
            v.out_of_order += 1;
        }
        *prev = version.max(*prev);
    }
    Ok(v)
}
