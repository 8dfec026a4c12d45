//! Commit→consumer latency: what an application reading the topic sees.
//!
//! Measured at one offered load only, in a point of its own, because a consumer on this 2-core
//! box competes with the relay for CPU (the timed throughput runs and the sweep run without
//! one). The consumer is assigned every partition at its current end and reads with a short
//! fetch wait, as a latency-sensitive application would. An event's latency is the time it was
//! read minus its record timestamp, which both relays set to the row's `created_at`
//! (`clock_timestamp()` at the INSERT, same host clock). Kafka timestamps are whole
//! milliseconds, so the figure is late by 0–1 ms.
//!
//! A relay that does not set the record timestamp (mq-bridge: the producer's own time) is read
//! as [`Stamp::RowJson`]: the record's value is the whole row as JSON, and its `created_at`,
//! cut to whole milliseconds like a record timestamp, is the start of the latency instead. So
//! every relay is timed from the same moment (the row's `created_at`) to the same moment (the
//! consumer's poll returning the record), with the same rounding.

use anyhow::{bail, Result};
use outboxd_testkit::kafka::{assign_all, StartAt};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::Message;
use rdkafka::ClientConfig;
use std::collections::hash_map::{Entry, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Commit→consumer latency of one point.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct ConsumerView {
    pub latency: crate::latency::Percentiles,
    /// Events of the point the consumer read.
    pub read: u64,
    /// Events of the point the consumer had not read 30 s after the writers stopped.
    pub missing: u64,
    /// Copies of the point's events read beyond the first (redeliveries), until the last
    /// first copy arrived.
    #[serde(default)]
    pub duplicates: u64,
}

/// Where a record carries its event's `aggregate_version` and the row's `created_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stamp {
    /// outboxd's records: the `aggregate_version` header and the record timestamp.
    Record,
    /// The row as a JSON object in the record's value (a generic CDC relay such as
    /// mq-bridge's `postgres_cdc`): its `aggregate_version` and `created_at` fields.
    RowJson,
}

impl Stamp {
    /// (aggregate_version, created_at in unix ms) of one record.
    fn read(self, m: &rdkafka::message::BorrowedMessage<'_>) -> Option<(i64, f64)> {
        match self {
            Self::Record => {
                let version = crate::ce::aggregate_version(m)?;
                Some((version, m.timestamp().to_millis()? as f64))
            }
            Self::RowJson => row_json_stamp(m.payload()?),
        }
    }
}

/// `aggregate_version` and `created_at` (unix ms, cut to whole ms as a Kafka record timestamp
/// is) of a row rendered as JSON; `created_at` in Postgres' text form
/// (`2026-12-05 02:30:00.123456+00`), as pgoutput sends it.
pub fn row_json_stamp(value: &[u8]) -> Option<(i64, f64)> {
    #[derive(serde::Deserialize)]
    struct Row<'a> {
        aggregate_version: i64,
        #[serde(borrow)]
        created_at: &'a str,
    }
    let row: Row = serde_json::from_slice(value).ok()?;
    let at = chrono::DateTime::parse_from_str(row.created_at, "%Y-%m-%d %H:%M:%S%.f%#z").ok()?;
    Some((row.aggregate_version, at.timestamp_millis() as f64))
}

/// A consumer reading `topic` on its own thread, reporting each version's latency (ms).
pub struct LiveConsumer {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<()>>,
    rx: mpsc::Receiver<(i64, f64)>,
}

impl LiveConsumer {
    /// Starts reading at the current end of every partition (nothing written before counts).
    pub fn start(bootstrap: &str, topic: &str) -> Result<Self> {
        Self::start_as(bootstrap, topic, Stamp::Record)
    }

    /// [`LiveConsumer::start`] for records that carry version and `created_at` as `stamp` says.
    pub fn start_as(bootstrap: &str, topic: &str, stamp: Stamp) -> Result<Self> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", format!("bench-live-{}", std::process::id()))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "10")
            .create()?;
        if assign_all(&consumer, topic, StartAt::End, Duration::from_secs(5))? == 0 {
            bail!("topic {topic} has no partitions");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let stop2 = stop.clone();
        let handle = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let Some(m) = consumer.poll(Duration::from_millis(50)) else {
                    continue;
                };
                let m = m?;
                let at = crate::latency::unix_secs() * 1e3;
                let Some((v, ts)) = stamp.read(&m) else {
                    bail!("record without aggregate_version or created_at ({stamp:?})");
                };
                if tx.send((v, at - ts)).is_err() {
                    break;
                }
            }
            Ok(())
        });
        Ok(Self { stop, handle, rx })
    }

    /// Latencies of the events `written`, waiting up to 30 s for all of them.
    pub fn finish(self, written: &crate::latency::Written) -> Result<ConsumerView> {
        let (first, n) = (written.first_version, written.events);
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut got: HashMap<i64, f64> = HashMap::new();
        let mut duplicates = 0;
        let range = first..first + n as i64;
        while (got.len() as u64) < n && Instant::now() < deadline {
            match self.rx.recv_timeout(Duration::from_millis(100)) {
                // The first copy counts; anything outside the point is ignored.
                Ok((v, ms)) if range.contains(&v) => match got.entry(v) {
                    Entry::Occupied(_) => duplicates += 1,
                    Entry::Vacant(e) => {
                        e.insert(ms);
                    }
                },
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        self.stop.store(true, Ordering::Relaxed);
        drop(self.rx);
        self.handle
            .join()
            .map_err(|_| anyhow::anyhow!("consumer thread panicked"))??;
        let lat: Vec<f64> = (first..first + n as i64)
            .filter_map(|v| got.get(&v).copied())
            .collect();
        Ok(ConsumerView {
            read: lat.len() as u64,
            missing: n - lat.len() as u64,
            duplicates,
            latency: crate::latency::percentiles(lat),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::row_json_stamp;

    #[test]
    fn row_json_stamp_reads_version_and_created_at_in_whole_ms() {
        let row = br#"{"event_id":"0b5e","aggregate_version":42,"payload":{"v":42},"headers":null,
            "created_at":"2026-12-05 02:30:00.123987+00"}"#;
        // 2026-12-05T02:30:00Z = 1796437800 s; .123987 s is cut to 123 ms.
        assert_eq!(row_json_stamp(row), Some((42, 1_796_437_800_123.0)));
        let offset = br#"{"aggregate_version":7,"created_at":"2026-12-05 03:30:00+01:00"}"#;
        assert_eq!(row_json_stamp(offset), Some((7, 1_796_437_800_000.0)));
        assert_eq!(row_json_stamp(br#"{"aggregate_version":7}"#), None);
        assert_eq!(row_json_stamp(b"not json"), None);
    }
}
