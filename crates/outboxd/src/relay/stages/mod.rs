//! The stages of one session and what each does with one replication event:
//! decode → route → (hold | validate | produce) → acknowledge → confirm.
//!
//! The stages own their parts; this file only dispatches between them:
//! - [`InFlight`]: events handed to the producer and not yet acknowledged (what may be confirmed);
//! - [`PoisonHandler`]: parking, holding behind a parked event, releasing repaired ones;
//! - [`Watch`]: what is observed and reported (gauges, heartbeats, stalls, the status row).

use crate::config::tables::OutboxTable;
use crate::error::RelayError;
use crate::fail;
use crate::model::publication;
use crate::obs::watch::{View, Watch};
use crate::obs::Observed;
use crate::poison::store::ParkedRecord;
use crate::relay::held::Held;
use crate::relay::in_flight::InFlight;
use crate::relay::kafka::{Ack, Origin, Producer, Verdict};
use crate::relay::lsn::PG_EPOCH_US;
use crate::relay::outboxes::{Lookup, Outboxes};
use crate::relay::park::PoisonHandler;
use crate::relay::pgoutput::{self, Message, Value};
use crate::relay::route::Event;
use crate::relay::slot_host::{ReplayFence, SlotHost};
use crate::relay::source::sql_bounded;
use pgwire_replication::ReplicationEvent;
use std::sync::Arc;
use tokio_postgres::Client;

/// See the module docs. One per session; the session calls its methods, never its fields.
mod relations;

pub struct Stages {
    slot: String,
    /// Its changes end the session ([`publication::concerns`]).
    publication: String,
    sql: Client,
    /// Where the slot lives (the primary, or the standby of `source.replication_dsn`).
    host: SlotHost,
    /// Parked and held rows that standby has not replayed yet: nothing is confirmed past them.
    fence: ReplayFence,
    /// The listed outbox tables, and which Relation id is which.
    outboxes: Outboxes,
    values: Vec<Value<'static>>,
    topic_buf: String,
    ignored: u64,
    in_flight: InFlight,
    poison: PoisonHandler,
    watch: Watch,
    /// An acknowledgement (not a keepalive) advanced the confirmable LSN since the last report:
    /// where the `acked` crash window is.
    advanced_by_ack: bool,
    /// This relay's health and error counts.
    observed: Arc<Observed>,
    /// Shadow mode: records of compared types go to the comparator, not (or not only) out.
    shadow: Option<crate::relay::tap::Tap>,
    shadow_topic: String,
    /// Events of tables catching up, kept in stream order ([`crate::relay::held`]).
    held: Held,
    /// Tables that joined while the session streamed, for the session to assess
    /// (`relations`), with their oid when the stream named it.
    arrived: Vec<(OutboxTable, Option<u32>)>,
    /// Pattern tables the guard says left the publication, for the supervisor to put back
    /// ([`Stages::take_left`]); their oids until their join message takes them in again.
    left: Vec<(OutboxTable, u32)>,
    rejoin: Vec<u32>,
    /// `ALTER PUBLICATION` end messages still due in this transaction for its tables that left.
    left_ends: usize,
    /// Positions of joins the stream announced, unacknowledged until the table's rows were
    /// handed over: nothing past a join is confirmed before (`relations`).
    marks: Vec<(String, crate::relay::ack::Seq)>,
}

impl Stages {
    pub async fn new(
        cfg: &crate::Config,
        sql: Client,
        host: SlotHost,
        confirmed: u64,
        observed: Arc<Observed>,
        shadow: Option<crate::relay::tap::Tap>,
    ) -> Result<Self, RelayError> {
        let poison = PoisonHandler::new(cfg, &sql, observed.clone()).await?;
        crate::obs::status_row::ensure_table(&sql).await?;
        let mut st = Self::with(cfg, sql, confirmed, observed, poison, shadow)?;
        st.host = host;
        Ok(st)
    }

    /// Stages for rows republished outside the stream ([`crate::relay::table_reader`] for a
    /// replay): the same routing, validation and producer, but nothing is parked or held — a
    /// poison event is an error ([`PoisonHandler::refusing`]). No shadow tap: every record is
    /// produced. Acknowledgements are tracked from LSN 0.
    pub fn refusing_poison(
        cfg: &crate::Config,
        sql: Client,
        observed: Arc<Observed>,
    ) -> Result<Self, RelayError> {
        let poison = PoisonHandler::refusing(cfg, observed.clone())?;
        Self::with(cfg, sql, 0, observed, poison, None)
    }

    fn with(
        cfg: &crate::Config,
        sql: Client,
        confirmed: u64,
        observed: Arc<Observed>,
        poison: PoisonHandler,
        shadow: Option<crate::relay::tap::Tap>,
    ) -> Result<Self, RelayError> {
        let outboxes = Outboxes::new(cfg)?;
        let mut in_flight = InFlight::new(confirmed);
        if cfg.is_multi_table() {
            in_flight.count_tables(&outboxes.labels());
        }
        Ok(Self {
            slot: cfg.source.slot.clone(),
            publication: cfg.source.publication.clone(),
            sql,
            host: SlotHost::primary(),
            fence: ReplayFence::default(),
            outboxes,
            values: Vec::new(),
            topic_buf: String::new(),
            ignored: 0,
            in_flight,
            poison,
            watch: Watch::new(cfg),
            advanced_by_ack: false,
            observed,
            shadow,
            shadow_topic: String::new(),
            held: Held::default(),
            arrived: Vec::new(),
            left: Vec::new(),
            rejoin: Vec::new(),
            left_ends: 0,
            marks: Vec::new(),
        })
    }

    /// This relay's health, error counts and trace pipeline.
    pub fn observed(&self) -> &Arc<Observed> {
        &self.observed
    }

    pub fn in_flight(&self) -> &InFlight {
        &self.in_flight
    }

    /// The position to confirm to the slot: what the broker acknowledged, held back before an
    /// event whose park or hold row the slot's standby has not replayed yet ([`ReplayFence`]).
    pub fn confirmable(&self) -> u64 {
        self.fence.cap(self.in_flight.confirmed())
    }

    /// The session's SQL connection (state rows, confirm polls).
    pub fn sql(&self) -> &Client {
        &self.sql
    }

    /// Where the slot lives.
    pub fn host(&self) -> &SlotHost {
        &self.host
    }

    /// The connection to the slot's server (the session's own when it is the primary).
    pub fn slot_sql(&self) -> &Client {
        self.host.sql(&self.sql)
    }

    /// The slot this session streams from.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// Changes of other tables (and updates, deletes, truncates) skipped in this session.
    pub fn ignored(&self) -> u64 {
        self.ignored
    }

    /// Did an acknowledgement (not a keepalive) advance the confirmable LSN since the last call?
    pub fn take_advanced_by_ack(&mut self) -> bool {
        std::mem::take(&mut self.advanced_by_ack)
    }

    /// Every tick: what the watch reports (gauges, readiness, stalls, heartbeats, slot health,
    /// the status row).
    pub async fn obs_tick(&mut self, reading: bool) -> Result<(), RelayError> {
        self.fence.refresh(&self.sql, &self.host).await?;
        let view = View {
            slot: &self.slot,
            sql: &self.sql,
            slot_sql: self.host.sql(&self.sql),
            separate: self.host.is_separate(),
            host: &self.host,
            in_flight: &self.in_flight,
            observed: &self.observed,
        };
        self.watch.tick(view, reading).await
    }

    /// A parked event is out for its acknowledgement: it counts in no in-flight window, so
    /// without this the session would take its ack only at the next tick, and each event of a
    /// released aggregate would wait a tick (250 ms) for the one before it (issue 40).
    pub fn releasing(&self) -> bool {
        self.poison.releasing()
    }

    /// Periodic: pick up operator repairs and refresh the parked-event gauges.
    pub async fn repair_tick(&mut self, producer: &Producer) -> Result<(), RelayError> {
        let stats = self.poison.repair_tick(&self.sql, producer).await?;
        self.watch.parked_gauges(&stats, &self.observed.labels);
        let count = stats.iter().map(|s| s.2).sum();
        crate::relay::status_feed::refresh(&self.sql, &self.slot, &self.observed, count).await
    }

    pub async fn on_ack(&mut self, ack: Ack, producer: &Producer) -> Result<(), RelayError> {
        match ack.origin {
            Origin::Release(id) => {
                let release = self
                    .poison
                    .on_release_ack(&self.sql, id, ack.verdict, producer);
                sql_bounded(release).await
            }
            // A Kafka transaction that did not commit (`relay.broker_fencing`): restart from
            // the slot; its records' own acknowledgements are failures too.
            Origin::Transaction => match ack.verdict {
                Verdict::Retriable { class, message, .. } => {
                    self.observed.errors.record(class, "");
                    Err(RelayError::Kafka(message))
                }
                _ => Ok(()),
            },
            Origin::Stream(seq) => {
                let before = self.in_flight.confirmed();
                let delivered = matches!(ack.verdict, Verdict::Delivered);
                let r = self.on_stream_ack(seq, ack.verdict, ack.at_us).await;
                let advanced = self.in_flight.confirmed() > before;
                self.advanced_by_ack |= advanced;
                self.watch.on_stream_ack(delivered, advanced);
                r
            }
        }
    }

    async fn on_stream_ack(
        &mut self,
        seq: u64,
        verdict: Verdict,
        at_us: i64,
    ) -> Result<(), RelayError> {
        match verdict {
            Verdict::Delivered => self.in_flight.delivered(seq, at_us),
            Verdict::Rejected {
                class,
                message,
                record,
            } => {
                let relid = self.in_flight.relid_of(seq);
                self.park(record, relid, class, &message).await?;
                self.in_flight.parked(seq);
            }
            Verdict::Retriable {
                event_id,
                code,
                class,
                message,
            } => {
                let event_type = self.in_flight.failed(seq).unwrap_or("");
                self.observed.errors.record(class, event_type);
                return Err(RelayError::Delivery {
                    code,
                    event_id,
                    message,
                });
            }
        }
        Ok(())
    }

    pub async fn on_event(
        &mut self,
        ev: ReplicationEvent,
        producer: &Producer,
    ) -> Result<(), RelayError> {
        self.watch.saw_event();
        match ev {
            ReplicationEvent::Begin {
                commit_time_micros, ..
            } => self
                .in_flight
                // Saturating: the server's clock is input like any other.
                .begin_at(commit_time_micros.saturating_add(PG_EPOCH_US))?,
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.left_ends = 0;
                self.in_flight.commit(end_lsn.0)?
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => self.in_flight.keepalive(wal_end.0),
            ReplicationEvent::XLogData { data, .. } => self.on_data(&data, producer).await?,
            ReplicationEvent::Message {
                transactional: false,
                lsn,
                prefix,
                content,
            } if self.watch.is_heartbeat(&prefix) => {
                if !self.watch.on_heartbeat(&content) {
                    tracing::debug!("ignored a heartbeat message that is not this session's");
                }
                // Like a keepalive: with nothing in flight its position is safe to confirm.
                self.in_flight.keepalive(lsn.0);
            }
            ReplicationEvent::Message {
                transactional: true,
                prefix,
                content,
                ..
            } if prefix == publication::PREFIX => self.on_guard(&content).await?,
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    async fn on_data(&mut self, data: &[u8], producer: &Producer) -> Result<(), RelayError> {
        match pgoutput::decode(data)? {
            Message::Relation(rel) => self.on_relation(&rel).await?,
            Message::Insert { rel, tuple } => match self.outboxes.lookup(rel) {
                Lookup::Outbox(..) => self.on_outbox_row(rel, tuple, producer).await?,
                Lookup::Other => self.ignore(),
                // pgoutput sends a Relation before a table's first change; an Insert for an
                // unknown relation could be an outbox row we cannot read: restart the session.
                Lookup::Unknown => {
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

    async fn on_outbox_row(
        &mut self,
        rel: u32,
        tuple: &[u8],
        producer: &Producer,
    ) -> Result<(), RelayError> {
        // Reuse one value buffer across rows; its borrow of `tuple` ends with this call.
        let mut values: Vec<Value<'_>> = std::mem::take(&mut self.values)
            .into_iter()
            .map(|_| Value::Null)
            .collect();
        let result = self.route_and_send(rel, tuple, &mut values, producer).await;
        values.clear();
        self.values = values.into_iter().map(|_| Value::Null).collect();
        result
    }

    async fn route_and_send<'a>(
        &mut self,
        rel: u32,
        tuple: &'a [u8],
        values: &mut Vec<Value<'a>>,
        producer: &Producer,
    ) -> Result<(), RelayError> {
        // Before parking or holding too: a row outside a transaction has no position.
        self.in_flight.check_open()?;
        pgoutput::decode_tuple(tuple, values)?;
        fail::hit("decoded");
        let Lookup::Outbox(table, mapping) = self.outboxes.lookup(rel) else {
            unreachable!("checked by the caller");
        };
        // What its parked copy, holds and heads key on (issue 56).
        let relid = self.outboxes.oid(table);
        let mut event = match mapping.event(values) {
            Ok(e) => e,
            Err(e) => {
                // Unroutable row (a required field NULL, not UTF-8): deterministic.
                let mut rec = mapping
                    .partial(values)
                    .ok_or(RelayError::Route(e.clone()))?;
                self.outboxes.get(table).tag_record(&mut rec);
                return self.park(rec, relid, e.class(), &e.to_string()).await;
            }
        };
        self.outboxes.get(table).tag(&mut event);
        // The row's own text (not a borrow of `event`, which `prepare` fills in below).
        let event_type = event.event_type.unwrap_or("");
        if event.tombstone && self.poison.parks_null_payload(event_type, table) {
            let rec = self.record_of(table, &event);
            let msg = "payload is NULL; policy.on_null_payload = \"park\" (set \"tombstone\" to \
                       send a record with a null value, as Debezium does)";
            return self.park(rec, relid, "invalid_event", msg).await;
        }
        // No aggregate (a NULL aggregate id, Debezium preset): nothing to wait behind.
        let blocked_by = event.aggregate_id.and_then(|id| {
            self.poison
                .blocked_by(event_type, table, relid, event.aggregate_type, id)
        });
        if let Some(head) = blocked_by {
            let rec = self.record_of(table, &event);
            self.poison.hold(&self.sql, &rec, relid, &head).await?;
            let confirmable = self.in_flight.confirmed();
            return self.fence.written(&self.sql, &self.host, confirmable).await;
        }
        if let Err(e) = event.prepare() {
            let rec = self.record_of(table, &event);
            return self.park(rec, relid, e.class(), &e.to_string()).await;
        }
        if !event.tombstone {
            let version = event.schema_version.unwrap_or("1");
            let checked = self
                .poison
                .check_schema(table, event_type, version, &event.payload);
            if let Err(msg) = checked {
                let rec = self.record_of(table, &event);
                return self.park(rec, relid, "schema_invalid", &msg).await;
            }
        }
        let route = self.outboxes.get(table);
        if let Err(e) =
            route
                .topic
                .render(event.aggregate_type, event.event_type, &mut self.topic_buf)
        {
            // `{event_type}` in sink.topic and a NULL event type: no topic to send it to.
            let rec = self.record_of(table, &event);
            return self.park(rec, relid, e.class(), &e.to_string()).await;
        }
        let mut topic = self.topic_buf.as_str();
        if let Some(tap) = self.shadow.as_ref().filter(|t| !t.delivers(event_type)) {
            let commit_ms = self.in_flight.open_commit_ms().unwrap_or(i64::MAX);
            tap.offer(commit_ms, || crate::relay::tap::record_of(&event, topic));
            match tap.prefix() {
                // Nothing in flight: the transaction confirms like one without events.
                None => return Ok(()),
                Some(prefix) => {
                    self.shadow_topic.clear();
                    self.shadow_topic.push_str(prefix);
                    self.shadow_topic.push_str(topic);
                    topic = self.shadow_topic.as_str();
                }
            }
        }
        let seq = self.in_flight.add(
            table,
            relid,
            event_type,
            topic,
            event.size(),
            &self.observed.labels,
        )?;
        if self.held.holds(table) {
            self.held.push(table, seq, event.parked_record(Some(topic)));
            return Ok(());
        }
        // A synchronous refusal arrives as an Ack before the session reads the next event.
        producer.send(topic, &event, seq).await;
        fail::hit("produced");
        Ok(())
    }

    fn ignore(&mut self) {
        self.ignored += 1;
        self.watch.on_ignored();
    }

    /// A deterministic failure of a streamed row (before the producer, or refused by the
    /// broker): parked before its position is acknowledged, fenced until the slot's standby
    /// replayed the row.
    async fn park(
        &mut self,
        rec: ParkedRecord,
        relid: Option<u32>,
        class: &str,
        msg: &str,
    ) -> Result<(), RelayError> {
        self.poison.park(&self.sql, rec, relid, class, msg).await?;
        let confirmable = self.in_flight.confirmed();
        self.fence.written(&self.sql, &self.host, confirmable).await
    }

    /// The record exactly as it would have been produced (without a topic when it has none).
    fn record_of(&mut self, table: usize, e: &Event<'_>) -> ParkedRecord {
        let routed = self
            .outboxes
            .get(table)
            .topic
            .render(e.aggregate_type, e.event_type, &mut self.topic_buf)
            .is_ok();
        e.parked_record(routed.then_some(self.topic_buf.as_str()))
    }
}
