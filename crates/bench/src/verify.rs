//! Read-back after the clock stopped: every loaded event must be on the topic, and each
//! aggregate's events must appear in version (= commit) order within its partition.

use anyhow::{bail, Result};
use outboxd_testkit::kafka::{assign_all_of, StartAt};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::ClientConfig;
use std::collections::{BTreeMap, HashMap};
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

/// How long a read-back waits with nothing arriving before it takes the topics as read. It
/// reads until every version was seen or the topics went quiet, never "up to the high
/// watermark": tansu reports a partition's watermark as the base offset of its last batch, so
/// a read that stops there misses that batch.
const QUIET: Duration = Duration::from_secs(10);

/// [`verify_topic`] over several topics that together hold versions `first..first+n` (each
/// table's own topics). When versions are missing after the topics went quiet, it says where
/// they went: per partition what was read against the reported watermarks, and whether a
/// second reader from the beginning finds them (a miss of the first read) or not (the broker
/// does not hold them).
pub fn verify_topics(
    bootstrap: &str,
    topics: &[&str],
    first: i64,
    n: u64,
    timeout: Duration,
) -> Result<Verified> {
    let mut v = Verified {
        expected: n,
        ..Default::default()
    };
    let mut seen = vec![false; n as usize];
    let pass = Pass::read(bootstrap, topics, first, &mut seen, timeout, Some(&mut v))?;
    if v.distinct < n {
        let topic = topics.join(", ");
        let missing = missing_ranges(&seen, first);
        let partitions = pass.partitions()?;
        let mut again = vec![false; n as usize];
        Pass::read(bootstrap, topics, first, &mut again, timeout, None)?;
        let found = seen
            .iter()
            .zip(&again)
            .filter(|(first_read, second)| !**first_read && **second)
            .count();
        eprintln!(
            "{topic}: {} of {n} versions missing after the topics went quiet, first ranges \
             {missing:?}; per partition (records read, highest offset read + 1, reported high \
             watermark): {partitions}; a second reader from the beginning found {found} of them \
             ({})",
            n - v.distinct,
            if found == 0 {
                "the broker does not return them"
            } else {
                "the first read missed them"
            }
        );
    }
    Ok(v)
}

/// One reader over `topics` from the beginning, until every version was seen, the topics went
/// quiet ([`QUIET`]) or `timeout` passed.
struct Pass {
    consumer: BaseConsumer,
    /// Per (topic, partition): records read and the highest offset read.
    read: BTreeMap<(String, i32), (u64, i64)>,
}

impl Pass {
    /// Reads into `seen` (index: version − `first`); with `count`, also tallies distinct
    /// versions, copies and per-aggregate order into it.
    fn read(
        bootstrap: &str,
        topics: &[&str],
        first: i64,
        seen: &mut [bool],
        timeout: Duration,
        mut count: Option<&mut Verified>,
    ) -> Result<Pass> {
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
        let mut read = BTreeMap::new();
        let mut last: HashMap<Vec<u8>, i64> = HashMap::new();
        let mut distinct = 0;
        let mut heard = Instant::now();
        while distinct < seen.len() && heard.elapsed() < QUIET && Instant::now() < deadline {
            let Some(m) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let m = m?;
            heard = Instant::now();
            let at = read
                .entry((m.topic().to_string(), m.partition()))
                .or_insert((0, -1));
            *at = (at.0 + 1, at.1.max(m.offset()));
            let version = crate::ce::aggregate_version(&m);
            let Some(version) = version else {
                bail!("record without aggregate_version on {topic}");
            };
            let Some(slot) = seen.get_mut((version - first) as usize) else {
                bail!("unexpected version {version} on {topic}");
            };
            let copy = std::mem::replace(slot, true);
            if !copy {
                distinct += 1;
            }
            let Some(v) = count.as_deref_mut() else {
                continue;
            };
            match copy {
                true => v.duplicates += 1,
                false => v.distinct += 1,
            }
            let key = m.key().unwrap_or_default().to_vec();
            let prev = last.entry(key).or_insert(i64::MIN);
            if version < *prev {
                v.out_of_order += 1;
            }
            *prev = version.max(*prev);
        }
        Ok(Pass { consumer, read })
    }

    /// "topic/p: read, max + 1, watermark" for every assigned partition.
    fn partitions(&self) -> Result<String> {
        let mut out = vec![];
        for tp in self.consumer.assignment()?.elements() {
            let (topic, p) = (tp.topic(), tp.partition());
            let (records, max) = self
                .read
                .get(&(topic.to_string(), p))
                .copied()
                .unwrap_or((0, -1));
            let (_, high) = self
                .consumer
                .fetch_watermarks(topic, p, Duration::from_secs(5))?;
            out.push(format!("{topic}/{p}: {records}, {}, {high}", max + 1));
        }
        Ok(out.join("; "))
    }
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
