//! Read-back after the clock stopped: every loaded event must be on the topic, and each
//! aggregate's events must appear in version (= commit) order within its partition.

use anyhow::{bail, Result};
use outboxd_testkit::kafka::{assign_all_of, StartAt};
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
    verify_topics(bootstrap, &[topic], first, n, timeout)
}

/// [`verify_topic`] over several topics that together hold versions `first..first+n` (each
/// table's own topics); a failure names the missing versions.
pub fn verify_topics(
    bootstrap: &str,
    topics: &[&str],
    first: i64,
    n: u64,
    timeout: Duration,
) -> Result<Verified> {
    let topic = topics.join(", ");
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("bench-verify-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?;
    let deadline = Instant::now() + timeout;
    if assign_all_of(&consumer, topics, StartAt::Beginning, timeout)? == 0 {
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
    if v.distinct < n {
        eprintln!(
            "{topic}: {} of {n} versions missing, first ranges {:?}",
            n - v.distinct,
            missing_ranges(&seen, first)
        );
    }
    Ok(v)
}

/// Up to 10 ranges `a..=b` of versions never seen (what a failed verification reports).
fn missing_ranges(seen: &[bool], first: i64) -> Vec<(i64, i64)> {
    let mut out: Vec<(i64, i64)> = vec![];
    for (i, _) in seen.iter().enumerate().filter(|(_, s)| !**s) {
        let v = first + i as i64;
        let full = out.len() == 10;
        match out.last_mut() {
            Some(r) if r.1 + 1 == v => r.1 = v,
            _ if full => break,
            _ => out.push((v, v)),
        }
    }
    out
}
