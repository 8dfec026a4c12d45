//! One replication session: source → decoder → router → producer → ack tracker → confirmer.
//!
//! The stages run in one task, in stream order, so per-aggregate order on the topic equals
//! commit order (one producer, idempotent, keyed by `aggregate_id`). Only acknowledgements flow
//! back, from librdkafka's delivery thread over a channel, and the only thing the session ever
//! tells Postgres is "acknowledged up to commit LSN X".

use crate::ack::AckTracker;
use crate::config::{ColumnNames, Config};
use crate::error::RelayError;
use crate::pgoutput::{self, Message, Value};
use crate::producer::{Ack, Producer};
use crate::router::{RowMapping, TopicTemplate};
use crate::source::{self, fmt_lsn};
use pgwire_replication::{Lsn, ReplicationEvent};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How a session ended without error.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// Shutdown was requested; in-flight events were drained and the last LSN confirmed.
    Shutdown,
}

/// Per-session state of the stages.
struct Stages {
    names: ColumnNames,
    table: (String, String),
    topic: TopicTemplate,
    /// Relation id of the outbox table and its column mapping, once a Relation was seen.
    outbox: Option<(u32, RowMapping)>,
    /// Relations of other published tables: their changes are counted and ignored.
    others: std::collections::HashSet<u32>,
    tracker: AckTracker,
    /// Bytes of events since the oldest unacknowledged one (approximate, for backpressure).
    in_flight_bytes: usize,
    sizes: std::collections::VecDeque<(u64, usize)>,
    values: Vec<Value<'static>>,
    topic_buf: String,
    ignored: u64,
}

/// Runs one session until shutdown (Ok) or an error (transient or definite).
pub async fn run_session(
    cfg: &Config,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<SessionEnd, RelayError> {
    let sql = source::sql_connect(cfg).await?;
    let (slot, sender_timeout) = source::preflight(cfg, &sql, cfg.source.create_slot).await?;
    if let Some(pid) = slot.active_pid {
        return Err(RelayError::SlotBusy {
            slot: cfg.source.slot.clone(),
            pid: pid.to_string(),
        });
    }
    let mut status_interval = Duration::from_millis(cfg.source.status_interval_ms);
    if !sender_timeout.is_zero() {
        status_interval = status_interval.min(sender_timeout / 2);
    }
    let (producer, mut acks) = Producer::new(cfg)?;
    let mut repl = source::start_stream(cfg, slot.confirmed_flush, status_interval).await?;
    tracing::info!(
        slot = %cfg.source.slot,
        publication = %cfg.source.publication,
        resume_lsn = %fmt_lsn(slot.confirmed_flush),
        role = "active",
        "streaming"
    );
    let mut st = Stages {
        names: cfg.source.columns.resolve()?,
        table: cfg.table_name(),
        topic: TopicTemplate::parse(&cfg.sink.topic)?,
        outbox: None,
        others: Default::default(),
        tracker: AckTracker::new(slot.confirmed_flush),
        in_flight_bytes: 0,
        sizes: Default::default(),
        values: Vec::new(),
        topic_buf: String::new(),
        ignored: 0,
    };
    metrics::gauge!("outboxd_role_active").set(1.0);
    let published = metrics::counter!("outboxd_events_published_total");
    let confirmed_gauge = metrics::gauge!("outboxd_confirmed_lsn");
    let in_flight_gauge = metrics::gauge!("outboxd_in_flight_events");
    let mut reported = slot.confirmed_flush;
    let max_events = cfg.relay.max_in_flight_events;
    let max_bytes = cfg.relay.max_in_flight_bytes;

    let result: Result<(), RelayError> = async {
        loop {
            let room = st.tracker.in_flight() < max_events && st.in_flight_bytes < max_bytes;
            tokio::select! {
                biased;
                _ = shutdown.changed() => return Ok(()),
                Some(ack) = acks.recv() => {
                    st.on_ack(ack)?;
                    published.increment(1);
                }
                ev = repl.recv(), if room => match ev? {
                    Some(ev) => st.on_event(ev, &producer).await?,
                    None => return Err(RelayError::Replication("stream ended".into())),
                },
            }
            // Drain whatever acks are already waiting before the next event.
            while let Ok(ack) = acks.try_recv() {
                st.on_ack(ack)?;
                published.increment(1);
            }
            let c = st.tracker.confirmed();
            if c > reported {
                repl.update_applied_lsn(Lsn(c));
                reported = c;
                confirmed_gauge.set(c as f64);
                in_flight_gauge.set(st.tracker.in_flight() as f64);
            }
        }
    }
    .await;

    // Whatever ended the session, confirm exactly what the broker acknowledged.
    let deadline = Instant::now() + cfg.shutdown_timeout();
    if result.is_ok() {
        // Graceful: stop reading, let in-flight events land.
        while st.tracker.in_flight() > 0 && Instant::now() < deadline {
            producer.flush(Duration::from_millis(100));
            while let Ok(ack) = acks.try_recv() {
                if st.on_ack(ack).is_err() {
                    break;
                }
            }
        }
    }
    let c = st.tracker.confirmed();
    if c > reported {
        repl.update_applied_lsn(Lsn(c));
    }
    if c > slot.confirmed_flush {
        // stop() sends no final status: wait until the server has taken our position.
        let wait_until = Instant::now() + status_interval * 2 + Duration::from_secs(1);
        while Instant::now() < wait_until {
            match source::confirmed_flush(cfg, &sql).await {
                Ok(s) if s >= c => break,
                Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(_) => break,
            }
        }
    }
    repl.stop();
    drop(repl);
    tracing::info!(
        confirmed_lsn = %fmt_lsn(c),
        in_flight = st.tracker.in_flight(),
        ignored_changes = st.ignored,
        "session ended"
    );
    result.map(|()| SessionEnd::Shutdown)
}

impl Stages {
    fn on_ack(&mut self, ack: Ack) -> Result<(), RelayError> {
        match ack.result {
            Ok(()) => {
                self.tracker.ack(ack.seq, true);
                self.release_bytes();
                Ok(())
            }
            Err(f) => {
                self.tracker.ack(ack.seq, false);
                Err(RelayError::Delivery {
                    event_id: f.event_id,
                    code: f.code,
                    message: f.message,
                })
            }
        }
    }

    /// Bytes are released in sequence order as the acknowledged prefix grows.
    fn release_bytes(&mut self) {
        let oldest_unacked = self.tracker.oldest_unacked();
        while let Some(&(seq, n)) = self.sizes.front() {
            if seq >= oldest_unacked {
                break;
            }
            self.in_flight_bytes -= n;
            self.sizes.pop_front();
        }
    }

    async fn on_event(
        &mut self,
        ev: ReplicationEvent,
        producer: &Producer,
    ) -> Result<(), RelayError> {
        match ev {
            ReplicationEvent::Begin { .. } => self.tracker.begin(),
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.tracker.commit(end_lsn.0);
                self.release_bytes();
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => self.tracker.keepalive(wal_end.0),
            ReplicationEvent::XLogData { data, .. } => self.on_data(&data, producer).await?,
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    async fn on_data(&mut self, data: &[u8], producer: &Producer) -> Result<(), RelayError> {
        match pgoutput::decode(data)? {
            Message::Relation(rel) => {
                if (rel.namespace.as_str(), rel.name.as_str())
                    == (self.table.0.as_str(), self.table.1.as_str())
                {
                    let mut missing = Vec::new();
                    let mapping = RowMapping::resolve(&self.names, &rel, &mut missing)?;
                    if !missing.is_empty() {
                        tracing::warn!(?missing, "optional outbox columns absent; not emitted");
                    }
                    self.outbox = Some((rel.id, mapping));
                    self.others.remove(&rel.id);
                } else {
                    if self.outbox.as_ref().is_some_and(|(id, _)| *id == rel.id) {
                        // The outbox table was renamed away mid-stream.
                        self.outbox = None;
                    }
                    self.others.insert(rel.id);
                }
            }
            Message::Insert { rel, tuple } => match &self.outbox {
                Some((id, mapping)) if *id == rel => {
                    // Reuse the value buffer across rows: its borrow ends with this call.
                    let mut values: Vec<Value<'_>> = std::mem::take(&mut self.values)
                        .into_iter()
                        .map(|_| Value::Null)
                        .collect();
                    pgoutput::decode_tuple(tuple, &mut values)?;
                    let event = mapping.event(&values)?;
                    self.topic.render(&event, &mut self.topic_buf);
                    let seq = self.tracker.add_event();
                    let size = event.size();
                    self.in_flight_bytes += size;
                    self.sizes.push_back((seq, size));
                    producer.send(&self.topic_buf, &event, seq).await?;
                    values.clear();
                    self.values = values.into_iter().map(|_| Value::Null).collect();
                }
                _ if self.others.contains(&rel) => self.ignored += 1,
                // pgoutput always sends a Relation before a table's first change; an Insert
                // for an unknown relation could be an outbox row we cannot read: stop.
                _ => {
                    return Err(RelayError::Replication(format!(
                        "insert for relation {rel} arrived before its Relation message"
                    )))
                }
            },
            Message::Update | Message::Delete | Message::Truncate => self.ignored += 1,
            Message::Other(_) => {}
        }
        Ok(())
    }
}
