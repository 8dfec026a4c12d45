//! The per-session state of the stages and what each does with one replication event:
//! decode → route → (hold | validate | produce) → acknowledge → confirm, plus parking of poison
//! events and the in-order release of parked ones after an operator's repair.

use crate::ack::AckTracker;
use crate::config::ColumnNames;
use crate::error::RelayError;
use crate::fail;
use crate::parking::{self, Blocked, ParkState, ParkedRecord};
use crate::pgoutput::{self, Message, Value};
use crate::policy::{self, OnPoison, Ordering, PolicyConfig};
use crate::producer::{Ack, Producer};
use crate::router::{Event, RowMapping, TopicTemplate};
use crate::source::sql_bounded;
use crate::validate::Validator;
use pgwire_replication::ReplicationEvent;
use std::collections::{HashSet, VecDeque};
use tokio_postgres::Client;

/// Acks of released parked events carry this bit, so they never touch the stream's tracker.
const RELEASE_BIT: u64 = 1 << 63;

/// A parked event being republished (one at a time, in stream order).
struct Releasing {
    id: i64,
    event_id: String,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
}

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
    pub(crate) labels: Vec<crate::session_obs::Label>,
    label_idx: std::collections::HashMap<String, std::collections::HashMap<String, u32>>,
    pub(crate) watch: crate::session_obs::Watch,
    /// An acknowledgement (not a keepalive) advanced the confirmable LSN since the last report:
    /// where the `acked` crash window is.
    pub advanced_by_ack: bool,
}

impl Stages {
    pub async fn new(cfg: &crate::Config, sql: Client, confirmed: u64) -> Result<Self, RelayError> {
        parking::ensure_tables(&sql).await?;
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
            watch: crate::session_obs::Watch::new(cfg),
            advanced_by_ack: false,
        })
    }

    pub async fn on_ack(&mut self, ack: Ack, producer: &Producer) -> Result<(), RelayError> {
        if ack.seq & RELEASE_BIT != 0 {
            return sql_bounded(self.on_release_ack(ack, producer)).await;
        }
        let before = self.tracker.confirmed();
        let r = self.on_stream_ack(ack).await;
        let advanced = self.tracker.confirmed() > before;
        self.advanced_by_ack |= advanced;
        self.watch.delivered |= advanced;
        r
    }

    async fn on_stream_ack(&mut self, ack: Ack) -> Result<(), RelayError> {
        let label = ack
            .seq
            .checked_sub(self.meta_base)
            .and_then(|i| self.meta.get(i as usize))
            .map(|&l| l as usize);
        match ack.result {
            Ok(()) => {
                self.tracker.ack(ack.seq, true);
                self.watch.last_ack_at = std::time::Instant::now();
                if let Some(l) = label.and_then(|l| self.labels.get(l)) {
                    l.published.increment(1);
                }
            }
            Err(f) if f.is_deterministic() => {
                let rec = f.record.clone().unwrap_or_else(|| ParkedRecord {
                    event_id: f.event_id.clone(),
                    ..Default::default()
                });
                let class = f.code.map(policy::class_of).unwrap_or("rejected");
                self.poison(rec, class, &f.message).await?;
                self.tracker.ack(ack.seq, true);
            }
            Err(f) => {
                self.tracker.ack(ack.seq, false);
                let event_type = label
                    .and_then(|l| self.labels.get(l))
                    .map(|l| l.event_type.as_str());
                crate::obs_errors::record(
                    f.code.map(policy::class_of).unwrap_or("delivery"),
                    event_type.unwrap_or(""),
                );
                return Err(RelayError::Delivery {
                    code: f.code_name(),
                    event_id: f.event_id,
                    message: f.message,
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
        let now_us = crate::session_obs::now_us();
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
                .begin_at(commit_time_micros + crate::session_obs::PG_EPOCH_US),
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
        match producer.send(&self.topic_buf, &event, seq).await {
            Ok(()) => {
                fail::hit("produced");
                Ok(())
            }
            Err(e) if e.is_deterministic() => {
                let rec = self.record_of(&event);
                let class = e.code.map(policy::class_of).unwrap_or("rejected");
                self.poison(rec, class, &e.message).await?;
                self.tracker.ack(seq, true);
                self.release_bytes();
                Ok(())
            }
            Err(e) => Err(RelayError::Delivery {
                event_id: event.event_id.to_string(),
                code: e.code.map(|c| format!("{c:?}")).unwrap_or_default(),
                message: e.message,
            }),
        }
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
            .push(crate::session_obs::Label::new(event_type, &self.topic_buf));
        self.label_idx
            .entry(event_type.to_string())
            .or_default()
            .insert(self.topic_buf.clone(), i);
        i
    }

    /// The record exactly as it would have been produced.
    fn record_of(&mut self, e: &Event<'_>) -> ParkedRecord {
        self.topic.render(e, &mut self.topic_buf);
        let mut headers = Vec::new();
        let _ = e.for_each_header(|k, v| {
            headers.push((k.to_string(), String::from_utf8_lossy(v).into_owned()))
        });
        ParkedRecord {
            event_id: e.event_id.to_string(),
            aggregate_type: Some(e.aggregate_type.to_string()),
            aggregate_id: Some(e.aggregate_id.to_string()),
            aggregate_version: e.aggregate_version.and_then(|v| v.parse().ok()),
            event_type: Some(e.event_type.to_string()),
            topic: Some(self.topic_buf.clone()),
            key: Some(e.aggregate_id.as_bytes().to_vec()),
            payload: Some(e.payload.to_vec()),
            headers,
            timestamp_ms: e.created_at_ms,
        }
    }

    /// A deterministic failure: park (and block the aggregate if its policy says so) or halt.
    async fn poison(
        &mut self,
        rec: ParkedRecord,
        class: &str,
        message: &str,
    ) -> Result<(), RelayError> {
        let event_type = rec.event_type.clone().unwrap_or_default();
        let pol = self.policy.for_type(&event_type);
        metrics::counter!(crate::obs::POISON, "event_type" => event_type.clone(), "class" => class.to_string())
            .increment(1);
        crate::obs_errors::record(class, &event_type);
        if pol.on_poison == OnPoison::Halt {
            return Err(RelayError::Halted {
                event_id: rec.event_id,
                class: class.to_string(),
                message: message.to_string(),
            });
        }
        let blocks = pol.ordering == Ordering::Aggregate
            && rec.aggregate_type.is_some()
            && rec.aggregate_id.is_some();
        let state = sql_bounded(parking::park(
            &self.sql,
            &self.slot,
            &rec,
            ParkState::Parked,
            blocks,
            None,
            class,
            message,
        ))
        .await?;
        fail::hit("parked");
        tracing::error!(
            event_id = %rec.event_id,
            aggregate_id = rec.aggregate_id.as_deref().unwrap_or(""),
            aggregate_version = rec.aggregate_version,
            event_type = %event_type,
            class,
            state = %state,
            blocks_aggregate = blocks,
            "event parked: {message}"
        );
        if blocks && matches!(state.as_str(), "parked" | "blocked" | "retry") {
            if let (Some(t), Some(a)) = (rec.aggregate_type, rec.aggregate_id) {
                self.blocked.entry(t).or_default().insert(a, rec.event_id);
            }
        }
        Ok(())
    }

    /// A later event of a blocked aggregate waits, durably, behind the parked one.
    async fn hold(&mut self, e: &Event<'_>, head: &str) -> Result<(), RelayError> {
        let rec = self.record_of(e);
        sql_bounded(parking::park(
            &self.sql,
            &self.slot,
            &rec,
            ParkState::Blocked,
            true,
            Some(head),
            "blocked",
            &format!(
                "held behind parked event {head} of the same aggregate (ordering = \"aggregate\")"
            ),
        ))
        .await?;
        metrics::counter!(crate::obs::BLOCKED, "event_type" => e.event_type.to_string())
            .increment(1);
        tracing::warn!(
            event_id = e.event_id,
            aggregate_id = e.aggregate_id,
            aggregate_version = e.aggregate_version.unwrap_or(""),
            event_type = e.event_type,
            blocked_by = head,
            "event held behind a parked event"
        );
        Ok(())
    }

    /// Periodic: pick up operator repairs (retry/discard) and refresh parked-event metrics.
    pub async fn repair_tick(&mut self, producer: &Producer) -> Result<(), RelayError> {
        let stats = parking::open_stats(&self.sql, &self.slot).await?;
        self.watch.parked_gauges(&stats);
        if self.releasing.is_none() {
            self.blocked = parking::blocked_aggregates(&self.sql, &self.slot).await?;
            self.release_next(producer).await?;
        }
        Ok(())
    }

    async fn release_next(&mut self, producer: &Producer) -> Result<(), RelayError> {
        let Some(r) = parking::next_release(&self.sql, &self.slot).await? else {
            return Ok(());
        };
        match producer
            .send_parked(&r.record, RELEASE_BIT | r.id as u64)
            .await
        {
            Ok(()) => {
                self.releasing = Some(Releasing {
                    id: r.id,
                    event_id: r.record.event_id,
                    aggregate_type: r.record.aggregate_type,
                    aggregate_id: r.record.aggregate_id,
                });
                Ok(())
            }
            Err(e) if e.is_deterministic() => {
                let class = e.code.map(policy::class_of).unwrap_or("rejected");
                parking::mark_failed(&self.sql, r.id, class, &e.message).await
            }
            Err(e) => Err(RelayError::Kafka(e.message)),
        }
    }

    async fn on_release_ack(&mut self, ack: Ack, producer: &Producer) -> Result<(), RelayError> {
        let Some(rel) = self.releasing.take() else {
            return Ok(());
        };
        match &ack.result {
            Ok(()) => {
                parking::mark_delivered(&self.sql, rel.id).await?;
                tracing::info!(event_id = %rel.event_id, aggregate_id = rel.aggregate_id.as_deref().unwrap_or(""), "parked event delivered");
            }
            Err(f) if f.is_deterministic() => {
                let class = f.code.map(policy::class_of).unwrap_or("rejected");
                parking::mark_failed(&self.sql, rel.id, class, &f.message).await?;
            }
            Err(f) => {
                // Transient: the row keeps its state and is tried again on the next tick.
                tracing::warn!(event_id = %rel.event_id, "release failed transiently: {}", f.message);
                return Ok(());
            }
        }
        if let (Some(t), Some(a)) = (&rel.aggregate_type, &rel.aggregate_id) {
            if !parking::still_blocked(&self.sql, &self.slot, t, a).await? {
                if let Some(m) = self.blocked.get_mut(t) {
                    m.remove(a);
                }
            }
        }
        self.release_next(producer).await
    }
}
