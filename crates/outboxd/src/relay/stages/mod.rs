//! The per-session state of the stages and what each does with one replication event:
//! decode → route → (hold | validate | produce) → acknowledge → confirm, plus parking of poison
//! events and the in-order release of parked ones after an operator's repair.

use crate::error::RelayError;
use crate::fail;
use crate::poison::policy::{Ordering, PolicyConfig};
use crate::poison::store::{self as parking, Blocked, ParkedRecord};
use crate::poison::validate::Validator;
use crate::relay::ack::AckTracker;
use crate::relay::kafka::{Ack, Origin, Producer, Verdict};
use crate::relay::pgoutput::{self, Message, Value};
use crate::relay::route::ColumnNames;
use crate::relay::route::{Event, RowMapping, TopicTemplate};
use crate::relay::source::sql_bounded;
use pgwire_replication::ReplicationEvent;
use std::collections::{HashSet, VecDeque};
use tokio_postgres::Client;

mod repair;

use repair::Releasing;

pub struct Stages {
    pub slot: String,
    pub sql: Client,
    names: ColumnNames,
    table: (String, String),
    topic: TopicTemplate,
    /// Relation id of the outbox table and its column mapping, once a Relation was seen.
    outbox: Option<(u32, RowMapping)>,
    /// Relations of other published tables: their changes are counted and ignored.
    others: HashSet<u32>,
    pub tracker: AckTracker,
    /// Bytes of events since the oldest unacknowledged one (approximate, for backpressure).
    pub in_flight_bytes: usize,
    sizes: VecDeque<(u64, usize)>,
    values: Vec<Value<'static>>,
    topic_buf: String,
    pub ignored: u64,
    policy: PolicyConfig,
    validator: Option<Validator>,
    blocked: Blocked,
    releasing: Option<Releasing>,
    /// Label index (into `labels`) of each event from the oldest unacknowledged one on.
    pub(crate) meta: VecDeque<u32>,
    pub(crate) meta_base: u64,
    pub(crate) labels: Vec<crate::obs::watch::Label>,
    label_idx: std::collections::HashMap<String, std::collections::HashMap<String, u32>>,
    pub(crate) watch: crate::obs::watch::Watch,
    /// An acknowledgement (not a keepalive) advanced the confirmable LSN since the last report:
    /// where the `acked` crash window is.
    pub advanced_by_ack: bool,
    /// This relay's health and error counts.
    pub(crate) observed: std::sync::Arc<crate::obs::Observed>,
}

impl Stages {
    pub async fn new(
        cfg: &crate::Config,
        sql: Client,
        confirmed: u64,
        observed: std::sync::Arc<crate::obs::Observed>,
    ) -> Result<Self, RelayError> {
        parking::ensure_tables(&sql).await?;
        crate::obs::status_row::ensure_table(&sql).await?;
        let blocked = parking::blocked_aggregates(&sql, &cfg.source.slot).await?;
        Ok(Self {
            slot: cfg.source.slot.clone(),
            sql,
            names: cfg.source.columns.resolve()?,
            table: cfg.table_name(),
            topic: TopicTemplate::parse(&cfg.sink.topic)?,
            outbox: None,
            others: HashSet::new(),
            tracker: AckTracker::new(confirmed),
            in_flight_bytes: 0,
            sizes: VecDeque::new(),
            values: Vec::new(),
            topic_buf: String::new(),
            ignored: 0,
            policy: cfg.policy.clone(),
            validator: cfg.validation.schema_dir.as_ref().map(Validator::new),
            blocked,
            releasing: None,
            meta: VecDeque::new(),
            meta_base: 0,
            labels: Vec::new(),
            label_idx: Default::default(),
            watch: crate::obs::watch::Watch::new(cfg),
            advanced_by_ack: false,
            observed,
        })
    }

    /// Every tick: what the watch reports (gauges, readiness, stalls, heartbeats, slot health,
    /// the status row).
    pub async fn obs_tick(&mut self, reading: bool) -> Result<(), RelayError> {
        let view = crate::obs::watch::View {
            slot: &self.slot,
            sql: &self.sql,
            tracker: &self.tracker,
            in_flight_bytes: self.in_flight_bytes,
            oldest: self.oldest_pending(),
            observed: &self.observed,
        };
        self.watch.tick(view, reading).await
    }

    /// Commit time (unix µs) of the oldest unacknowledged event, per event type.
    fn oldest_pending(&self) -> std::collections::HashMap<String, i64> {
        let mut oldest = std::collections::HashMap::new();
        for (i, &label) in self.meta.iter().enumerate() {
            let seq = self.meta_base + i as u64;
            if !self.tracker.is_pending(seq) {
                continue;
            }
            let Some(l) = self.labels.get(label as usize) else {
                continue;
            };
            if oldest.contains_key(l.event_type.as_str()) {
                continue;
            }
            if let Some(c) = self.tracker.commit_us_of(seq) {
                oldest.insert(l.event_type.clone(), c);
            }
        }
        oldest
    }

    pub async fn on_ack(&mut self, ack: Ack, producer: &Producer) -> Result<(), RelayError> {
        match ack.origin {
            Origin::Release(id) => {
                sql_bounded(self.on_release_ack(id, ack.verdict, producer)).await
            }
            Origin::Stream(seq) => {
                let before = self.tracker.confirmed();
                let r = self.on_stream_ack(seq, ack.verdict).await;
                let advanced = self.tracker.confirmed() > before;
                self.advanced_by_ack |= advanced;
                self.watch.delivered |= advanced;
                r
            }
        }
    }

    async fn on_stream_ack(&mut self, seq: u64, verdict: Verdict) -> Result<(), RelayError> {
        let label = seq
            .checked_sub(self.meta_base)
            .and_then(|i| self.meta.get(i as usize))
            .map(|&l| l as usize);
        match verdict {
            Verdict::Delivered => {
                self.tracker.ack(seq, true);
                self.watch.last_ack_at = std::time::Instant::now();
                if let Some(l) = label.and_then(|l| self.labels.get(l)) {
                    l.published.increment(1);
                }
            }
            Verdict::Rejected {
                class,
                message,
                record,
            } => {
                self.poison(record, class, &message).await?;
                self.tracker.ack(seq, true);
            }
            Verdict::Retriable {
                event_id,
                code,
                class,
                message,
            } => {
                self.tracker.ack(seq, false);
                let event_type = label
                    .and_then(|l| self.labels.get(l))
                    .map(|l| l.event_type.as_str());
                self.observed.errors.record(class, event_type.unwrap_or(""));
                return Err(RelayError::Delivery {
                    code,
                    event_id,
                    message,
                });
            }
        }
        self.release_bytes();
        Ok(())
    }

    /// Bytes (and per-event labels) are released in sequence order as the acknowledged prefix
    /// grows; completed transactions feed the commit→ack histogram.
    fn release_bytes(&mut self) {
        let oldest_unacked = self.tracker.oldest_unacked();
        while self.meta_base < oldest_unacked && self.meta.pop_front().is_some() {
            self.meta_base += 1;
        }
        let hist = &self.watch.commit_to_ack;
        let now_us = crate::obs::watch::now_us();
        self.tracker
            .drain_completed(|c| hist.record((now_us - c).max(0) as f64 / 1e6));
        while let Some(&(seq, n)) = self.sizes.front() {
            if seq >= oldest_unacked {
                break;
            }
            self.in_flight_bytes -= n;
            self.sizes.pop_front();
        }
    }

    pub async fn on_event(
        &mut self,
        ev: ReplicationEvent,
        producer: &Producer,
    ) -> Result<(), RelayError> {
        self.watch.last_event_at = std::time::Instant::now();
        match ev {
            ReplicationEvent::Begin {
                commit_time_micros, ..
            } => self
                .tracker
                .begin_at(commit_time_micros + crate::obs::watch::PG_EPOCH_US),
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.tracker.commit(end_lsn.0);
                self.release_bytes();
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => self.tracker.keepalive(wal_end.0),
            ReplicationEvent::XLogData { data, .. } => self.on_data(&data, producer).await?,
            ReplicationEvent::Message {
                transactional: false,
                lsn,
                prefix,
                content,
            } if prefix == self.watch.hb_prefix => {
                self.watch.on_heartbeat(&content);
                // Like a keepalive: with nothing in flight its position is safe to confirm.
                self.tracker.keepalive(lsn.0);
            }
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
                        self.outbox = None; // the outbox table was renamed away
                    }
                    self.others.insert(rel.id);
                }
            }
            Message::Insert { rel, tuple } => match &self.outbox {
                Some((id, _)) if *id == rel => self.on_outbox_row(tuple, producer).await?,
                _ if self.others.contains(&rel) => self.ignore(),
                // pgoutput sends a Relation before a table's first change; an Insert for an
                // unknown relation could be an outbox row we cannot read: restart the session.
                _ => {
                    return Err(RelayError::Replication(format!(
                        "insert for relation {rel} arrived before its Relation message"
                    )))
                }
            },
            Message::Update | Message::Delete | Message::Truncate => self.ignore(),
            Message::Other(_) => {}
        }
        Ok(())
    }

    async fn on_outbox_row(&mut self, tuple: &[u8], producer: &Producer) -> Result<(), RelayError> {
        // Reuse one value buffer across rows; its borrow of `tuple` ends with this call.
        let mut values: Vec<Value<'_>> = std::mem::take(&mut self.values)
            .into_iter()
            .map(|_| Value::Null)
            .collect();
        let result = self.route_and_send(tuple, &mut values, producer).await;
        values.clear();
        self.values = values.into_iter().map(|_| Value::Null).collect();
        result
    }

    async fn route_and_send<'a>(
        &mut self,
        tuple: &'a [u8],
        values: &mut Vec<Value<'a>>,
        producer: &Producer,
    ) -> Result<(), RelayError> {
        pgoutput::decode_tuple(tuple, values)?;
        fail::hit("decoded");
        let (_, mapping) = self.outbox.as_ref().expect("checked by caller");
        let event = match mapping.event(values) {
            Ok(e) => e,
            Err(e) => {
                // Unroutable row (a required field NULL, not UTF-8): deterministic.
                let rec = mapping
                    .partial(values)
                    .ok_or(RelayError::Route(e.clone()))?;
                return self.poison(rec, "invalid_event", &e.to_string()).await;
            }
        };
        let pol = self.policy.for_type(event.event_type);
        if pol.ordering == Ordering::Aggregate {
            if let Some(head) = self
                .blocked
                .get(event.aggregate_type)
                .and_then(|m| m.get(event.aggregate_id))
                .cloned()
            {
                return self.hold(&event, &head).await;
            }
        }
        if event.headers.is_some() {
            if let Err(e) = event.for_each_header(|_, _| {}) {
                let rec = self.record_of(&event);
                return self.poison(rec, "invalid_event", &e.to_string()).await;
            }
        }
        if let Some(v) = self.validator.as_mut() {
            if let Err(msg) = v.check(
                event.event_type,
                event.schema_version.unwrap_or("1"),
                event.payload,
            ) {
                let rec = self.record_of(&event);
                return self.poison(rec, "schema_invalid", &msg).await;
            }
        }
        self.topic.render(&event, &mut self.topic_buf);
        let label = self.label(event.event_type);
        let seq = self.tracker.add_event();
        self.meta.push_back(label);
        let size = event.size();
        self.in_flight_bytes += size;
        self.sizes.push_back((seq, size));
        // A synchronous refusal arrives as an Ack before the session reads the next event.
        producer.send(&self.topic_buf, &event, seq).await;
        fail::hit("produced");
        Ok(())
    }

    fn ignore(&mut self) {
        self.ignored += 1;
        self.watch.ignored.increment(1);
    }

    /// Interned (event_type, topic) label of the published-events counter.
    fn label(&mut self, event_type: &str) -> u32 {
        if let Some(&i) = self
            .label_idx
            .get(event_type)
            .and_then(|m| m.get(self.topic_buf.as_str()))
        {
            return i;
        }
        let i = self.labels.len() as u32;
        self.labels
            .push(crate::obs::watch::Label::new(event_type, &self.topic_buf));
        self.label_idx
            .entry(event_type.to_string())
            .or_default()
            .insert(self.topic_buf.clone(), i);
        i
    }

    /// The record exactly as it would have been produced.
    fn record_of(&mut self, e: &Event<'_>) -> ParkedRecord {
        self.topic.render(e, &mut self.topic_buf);
        e.parked_record(&self.topic_buf)
    }
}
