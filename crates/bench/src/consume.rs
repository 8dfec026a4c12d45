//! Commit→consumer latency: what an application reading the topic sees.
//!
//! Measured at one offered load only, in a point of its own, because a consumer on this 2-core
//! box competes with the relay for CPU (the timed throughput runs and the sweep run without
//! one). The consumer is assigned every partition at its current end and reads with a short
//! fetch wait, as a latency-sensitive application would. An event's latency is the time it was
//! read minus its record timestamp, which both relays set to the row's `created_at`
//! (`clock_timestamp()` at the INSERT, same host clock). Kafka timestamps are whole
//! milliseconds, so the figure is late by 0–1 ms.

use anyhow::{bail, Result};
use outboxd_testkit::kafka::{assign_all, StartAt};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use std::collections::HashMap;
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
                let version = m
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == "aggregate_version"))
                    .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse::<i64>().ok());
                let (Some(v), Some(ts)) = (version, m.timestamp().to_millis()) else {
                    bail!("record without aggregate_version or timestamp");
                };
                if tx.send((v, at - ts as f64)).is_err() {
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
        let range = first..first + n as i64;
        while (got.len() as u64) < n && Instant::now() < deadline {
            match self.rx.recv_timeout(Duration::from_millis(100)) {
                // The first copy counts; anything outside the point is ignored.
                Ok((v, ms)) if range.contains(&v) => {
                    got.entry(v).or_insert(ms);
                }
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
            latency: crate::latency::percentiles(lat),
        })
    }
}
