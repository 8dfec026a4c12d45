//! Who receives a replay: per target topic, the consumer groups that have committed offsets on
//! it, with their lag — asked of the broker with `[sink.kafka]`'s connection settings.
//!
//! The groups come from ListGroups (`consumer` groups and offset-only ones; `connect` and other
//! protocols are skipped), their committed offsets from an OffsetFetch per group (a client with
//! that `group.id` that never subscribes, so it does not join or disturb the group), and the lag
//! from the high watermarks of the partitions they committed on. The work is bounded ([`MAX_GROUPS`], [`BUDGET`],
//! [`REQUEST`]) and never fails a command: what the broker does not answer is reported as
//! [`Consumers::Unknown`] with the reason.
//!
//! Consumers that assign partitions themselves and keep their offsets elsewhere are not seen.

use crate::config::Config;
use crate::relay::kafka::consumer::{self as kafka_consumer, Ctx};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Groups checked at most (by name); the rest are counted as not checked.
pub const MAX_GROUPS: usize = 200;
/// The whole lookup: groups not checked by then are counted as not checked.
pub const BUDGET: Duration = Duration::from_secs(10);
/// One request to the broker.
pub const REQUEST: Duration = Duration::from_secs(3);
/// Groups whose offsets are fetched at once.
const WORKERS: usize = 4;

/// A group's lag on a topic: high watermark − committed offset, summed over the partitions it
/// committed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lag {
    Exact(i64),
    /// A partition's high watermark is below the group's committed offset (the broker's
    /// watermark lags): at least this much.
    AtLeast(i64),
    /// A high watermark could not be read.
    Unknown,
}

/// One group on one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub name: String,
    pub lag: Lag,
    /// Partitions of the topic the group has committed offsets on, of `partitions`.
    pub committed: usize,
    pub partitions: usize,
    /// Whether the group has members now (without, no consumer of it is running).
    pub active: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnTopic {
    /// The groups with committed offsets on it (none: empty).
    Groups(Vec<Group>),
    /// The broker does not have the topic.
    Missing,
    /// The broker did not describe it (e.g. no ACL for [sink.kafka]'s principal): its error.
    Unreadable(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Consumers {
    Known {
        /// Per target topic, by name.
        topics: Vec<(String, OnTopic)>,
        /// Consumer groups the broker listed (Kafka lists only those the principal may
        /// describe: none may mean no ACL).
        listed: usize,
        /// Groups listed but not checked: over [`MAX_GROUPS`] or past the [`BUDGET`].
        unchecked: usize,
        /// Groups whose committed offsets the broker did not return.
        failed: usize,
    },
    /// The broker could not say (why, secrets scrubbed).
    Unknown(String),
}

/// Whether `s` can be a Kafka topic name (the router may render names a broker refuses, and an
/// unroutable selection has none).
fn is_topic_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 249
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The consumers of `topics` (deduplicated; names no broker accepts are skipped). Runs the
/// blocking client calls off the async runtime; without topics it asks nothing.
pub async fn lookup<'a>(cfg: &Config, topics: impl IntoIterator<Item = &'a str>) -> Consumers {
    let mut topics: Vec<String> = topics
        .into_iter()
        .filter(|t| is_topic_name(t))
        .map(str::to_string)
        .collect();
    topics.sort();
    topics.dedup();
    if topics.is_empty() {
        return Consumers::Known {
            topics: Vec::new(),
            listed: 0,
            unchecked: 0,
            failed: 0,
        };
    }
    let cfg = cfg.clone();
    tokio::task::spawn_blocking(move || lookup_blocking(&cfg, &topics))
        .await
        .unwrap_or_else(|e| Consumers::Unknown(format!("the lookup failed: {e}")))
}

fn client(cfg: &Config, group: &str) -> Result<BaseConsumer<Ctx>, String> {
    kafka_consumer::config(cfg, group, "outboxd-replay")?
        // Quiet: what fails is reported in the command's output.
        .create_with_context(Ctx::quiet(cfg, "replay consumer lookup"))
        .map_err(|e| cfg.redactor.scrub(&e.to_string()))
}

/// Per topic, its partition count, or what to say instead of its groups.
type Partitions = Vec<(String, Result<usize, OnTopic>)>;
/// Per group (in order), its committed offsets as (topic, partition, offset): `None` not
/// fetched (budget), `Err` the broker did not answer.
type Committed = Vec<Option<Result<Vec<(String, i32, i64)>, ()>>>;

fn lookup_blocking(cfg: &Config, topics: &[String]) -> Consumers {
    let started = Instant::now();
    let scrub = |e: rdkafka::error::KafkaError| cfg.redactor.scrub(&e.to_string());
    let own = format!("outboxd-replay-{}", cfg.source.slot);
    let admin = match client(cfg, &own) {
        Ok(c) => c,
        Err(e) => return Consumers::Unknown(format!("no Kafka client from [sink.kafka]: {e}")),
    };
    // A failed request says "timed out"; librdkafka's own reports (connection refused, TLS,
    // SASL) wait in the client's queue: serve them, then name the newest.
    let why = |e: rdkafka::error::KafkaError| {
        for _ in 0..64 {
            if admin.poll(Duration::ZERO).is_none() {
                break;
            }
        }
        match admin.context().last_error() {
            Some(last) => format!("{}; {last}", scrub(e)),
            None => scrub(e),
        }
    };
    let list = match admin.fetch_group_list(None, REQUEST) {
        Ok(l) => l,
        Err(e) => {
            return Consumers::Unknown(format!(
                "the broker did not list its consumer groups: {}",
                why(e)
            ))
        }
    };
    let mut groups: Vec<(String, bool)> = list
        .groups()
        .iter()
        .filter(|g| matches!(g.protocol_type(), "consumer" | "") && g.name() != own)
        .map(|g| (g.name().to_string(), !g.members().is_empty()))
        .collect();
    groups.sort();
    groups.dedup_by(|a, b| a.0 == b.0);
    let listed = groups.len();
    let mut unchecked = groups.len().saturating_sub(MAX_GROUPS);
    groups.truncate(MAX_GROUPS);
    let mut parts: Partitions = Vec::new();
    for t in topics {
        let md = match admin.fetch_metadata(Some(t), REQUEST) {
            Ok(md) => md,
            Err(e) => {
                return Consumers::Unknown(format!(
                    "the broker did not describe topic {t}: {}",
                    why(e)
                ))
            }
        };
        use rdkafka::types::RDKafkaErrorCode as Code;
        let n = match md.topics().iter().find(|m| m.name() == t) {
            Some(m) => match m.error().map(Code::from) {
                None | Some(Code::UnknownTopicOrPartition) => Ok(m.partitions().len()),
                Some(e) => Err(OnTopic::Unreadable(e.to_string())),
            },
            None => Ok(0),
        };
        parts.push((
            t.clone(),
            n.and_then(|n| if n > 0 { Ok(n) } else { Err(OnTopic::Missing) }),
        ));
    }
    let committed = committed_offsets(cfg, &groups, &parts, started);
    // High watermarks of the partitions some group committed on (until the budget runs out).
    let mut hw: BTreeMap<(&str, i32), Option<i64>> = BTreeMap::new();
    for (t, p, _) in committed.iter().flatten().flatten().flatten() {
        hw.entry((t.as_str(), *p)).or_insert_with(|| {
            (started.elapsed() < BUDGET)
                .then(|| admin.fetch_watermarks(t, *p, REQUEST).ok().map(|w| w.1))
                .flatten()
        });
    }
    let mut failed = 0;
    let mut per_topic: Vec<(String, OnTopic)> = parts
        .iter()
        .map(|(t, n)| {
            let on = match n {
                Ok(_) => OnTopic::Groups(Vec::new()),
                Err(on) => on.clone(),
            };
            (t.clone(), on)
        })
        .collect();
    for ((name, active), offsets) in groups.iter().zip(&committed) {
        let offsets = match offsets {
            Some(Ok(o)) => o,
            Some(Err(())) => {
                failed += 1;
                continue;
            }
            None => {
                unchecked += 1;
                continue;
            }
        };
        for ((topic, n), (_, on)) in parts.iter().zip(per_topic.iter_mut()) {
            let (Ok(n), OnTopic::Groups(list)) = (n, on) else {
                continue;
            };
            let marks: Vec<Option<i64>> = (0..*n as i32)
                .map(|p| hw.get(&(topic.as_str(), p)).copied().flatten())
                .collect();
            if let Some(g) = on_topic(name, *active, topic, &marks, offsets) {
                list.push(g);
            }
        }
    }
    Consumers::Known {
        topics: per_topic,
        listed,
        unchecked,
        failed,
    }
}

/// Each group's committed offsets on the topics' partitions, fetched by [`WORKERS`] threads
/// until the [`BUDGET`] runs out.
fn committed_offsets(
    cfg: &Config,
    groups: &[(String, bool)],
    parts: &Partitions,
    started: Instant,
) -> Committed {
    let mut tpl = TopicPartitionList::new();
    for (t, n) in parts {
        for p in 0..*n.as_ref().unwrap_or(&0) {
            tpl.add_partition(t, p as i32);
        }
    }
    if tpl.count() == 0 {
        return vec![Some(Ok(Vec::new())); groups.len()];
    }
    let out: Mutex<Committed> = Mutex::new(vec![None; groups.len()]);
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..WORKERS.min(groups.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let left = BUDGET.saturating_sub(started.elapsed());
                if i >= groups.len() || left.is_zero() {
                    break;
                }
                let r = client(cfg, &groups[i].0)
                    .ok()
                    .and_then(|c| c.committed_offsets(tpl.clone(), left.min(REQUEST)).ok())
                    .map(|l| {
                        l.elements()
                            .iter()
                            .filter(|e| e.error().is_ok())
                            .filter_map(|e| match e.offset() {
                                Offset::Offset(o) if o >= 0 => {
                                    Some((e.topic().to_string(), e.partition(), o))
                                }
                                _ => None,
                            })
                            .collect()
                    })
                    .ok_or(());
                if let Ok(mut out) = out.lock() {
                    out[i] = Some(r);
                }
            });
        }
    });
    out.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// The group on `topic`, if it committed on any of its partitions.
fn on_topic(
    name: &str,
    active: bool,
    topic: &str,
    hw: &[Option<i64>],
    offsets: &[(String, i32, i64)],
) -> Option<Group> {
    let (mut sum, mut behind, mut unknown, mut committed) = (0i64, false, false, 0);
    for (_, p, o) in offsets.iter().filter(|(t, _, _)| t == topic) {
        committed += 1;
        match hw.get(*p as usize).copied().flatten() {
            Some(h) if h >= *o => sum = sum.saturating_add(h - o),
            Some(_) => behind = true,
            None => unknown = true,
        }
    }
    (committed > 0).then(|| Group {
        name: name.to_string(),
        lag: match (unknown, behind) {
            (true, _) => Lag::Unknown,
            (false, true) => Lag::AtLeast(sum),
            (false, false) => Lag::Exact(sum),
        },
        committed,
        partitions: hw.len(),
        active,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_sums_committed_partitions_and_says_when_it_is_a_bound() {
        let off = |v: &[(i32, i64)]| -> Vec<(String, i32, i64)> {
            v.iter().map(|(p, o)| ("t".to_string(), *p, *o)).collect()
        };
        let hw = [Some(10), Some(5), Some(7)];
        let g = on_topic("g", true, "t", &hw, &off(&[(0, 8), (1, 5), (2, 0)])).unwrap();
        assert_eq!((g.lag, g.committed, g.partitions), (Lag::Exact(9), 3, 3));
        let g = on_topic("g", false, "t", &hw, &off(&[(0, 12), (2, 3)])).unwrap();
        assert_eq!((g.lag, g.committed, g.active), (Lag::AtLeast(4), 2, false));
        let g = on_topic("g", true, "t", &[Some(1), None], &off(&[(1, 0)])).unwrap();
        assert_eq!(g.lag, Lag::Unknown);
        assert_eq!(on_topic("g", true, "t", &hw, &[]), None);
        let other = vec![("u".to_string(), 0, 1)];
        assert_eq!(on_topic("g", true, "t", &hw, &other), None);
    }

    #[test]
    fn only_names_a_broker_accepts_are_looked_up() {
        assert!(is_topic_name("outbox.event.order_v2-x"));
        for bad in [
            "",
            ".",
            "..",
            "(unroutable: no event or aggregate type)",
            "a\u{1b}[2J",
        ] {
            assert!(!is_topic_name(bad), "{bad:?}");
        }
        assert!(!is_topic_name(&"x".repeat(250)));
    }
}
