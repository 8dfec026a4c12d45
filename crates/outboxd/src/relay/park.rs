//! What a session does with poison events: park a deterministic failure (or halt), hold later
//! events of a blocked aggregate behind it, and release repaired ones one at a time, in order.
//! All SQL is in [`crate::poison::store`]; the session's SQL connection is lent per call.
//!
//! With several outbox tables each table has its own policy and schemas, and an aggregate is
//! held per table: a parked event of table T holds later events of its aggregate in T only
//! (ordering is per aggregate within a table). A parked event that names no table (parked by
//! a one-table relay) holds its aggregate in every table, since nothing says which it was.
//! A table is its oid (issue 56): renamed or moved within the relayed set it keeps its holds,
//! and its parked events are released through its route under its current name
//! ([`crate::relay::park_routes`]); rows parked without an oid hold and release by name.

use crate::config::policy::{NullPayload, OnPoison, Ordering, PolicyConfig};
use crate::config::tables::{stored_table, SOURCE_TABLE_HEADER};
use crate::config::Config;
use crate::error::RelayError;
use crate::fail;
use crate::obs::Observed;
use crate::poison::bounds::Bounds;
use crate::poison::integrity::Placement;
use crate::poison::store::{
    self as parking, Blocked, OpenStats, ParkState, ParkedRecord, TableKey,
};
use crate::poison::vet::Vetting;
use crate::relay::kafka::{Producer, Verdict};
use crate::relay::park_routes::{ReleaseRoute, Routes};
use crate::relay::releasing::{InFlight, Sent};
use crate::relay::route::release;
use crate::relay::source::sql_bounded;
use std::sync::Arc;
use tokio_postgres::Client;

/// See the module docs. One per session.
pub struct PoisonHandler {
    slot: String,
    /// `[policy]`, for a poison event of no listed table (none reach the live path: every
    /// record of a relay with several tables names its table).
    policy: PolicyConfig,
    /// Aggregates with a parked event at their head: type → id → (table, head event_id).
    blocked: Blocked,
    /// The batch of released events out for their verdicts.
    releasing: InFlight,
    observed: Arc<Observed>,
    /// Per listed outbox table (configuration order): the live path's routing and checks,
    /// applied again to released events; and those of tables found by oid for a release.
    routes: Routes,
    /// Records carry the `source_table` header ([`Config::tags_records`]).
    tagged: bool,
    topic_buf: String,
    /// Outside the stream (replay): park nothing, hold nothing; every poison event is an error.
    refuse_all: bool,
    /// The integrity key: seals what is parked and held, vets what is released.
    vetting: Vetting,
    /// `[parked]` bounds, and the bytes the open rows hold (refreshed every repair tick).
    bounds: Bounds,
    /// Rows of the batch in flight refused before sending: written with its outcome.
    refused: Vec<(i64, &'static str, String)>,
    /// This role may write a parked row's oid ([`parking::may_write_relid`]); if not, rows are
    /// parked, held and released by name, as before issue 56.
    relids: bool,
}

impl PoisonHandler {
    /// Creates the parking table if needed and loads the aggregates blocked by earlier sessions.
    pub async fn new(
        cfg: &Config,
        sql: &Client,
        observed: Arc<Observed>,
    ) -> Result<Self, RelayError> {
        match cfg.is_multi_table() {
            true => parking::ensure_tables_per_table(sql).await?,
            false => parking::ensure_tables(sql).await?,
        }
        let blocked = parking::blocked_aggregates(sql, &cfg.source.slot).await?;
        let mut h = Self::with(cfg, blocked, observed, false)?;
        h.bounds.open_bytes = h.open_bytes(sql).await?;
        h.relids = parking::may_write_relid(sql).await?;
        if !h.relids && h.tagged {
            tracing::warn!("this role may not write outbox_parked.source_relid (run `outboxd init` and the grants of sql/roles.sql again): parked events hold and release by their table's name, so a table renamed while a head is parked loses its holds");
        }
        Ok(h)
    }

    /// For events republished outside the stream (replay): the parking table belongs to the
    /// relay's stream, so nothing is parked or held there; a poison event is an error
    /// ([`RelayError::Halted`]) that ends the replay before anything past it is recorded.
    pub fn refusing(cfg: &Config, observed: Arc<Observed>) -> Result<Self, RelayError> {
        Self::with(cfg, Blocked::default(), observed, true)
    }

    fn with(
        cfg: &Config,
        blocked: Blocked,
        observed: Arc<Observed>,
        refuse_all: bool,
    ) -> Result<Self, RelayError> {
        Ok(Self {
            slot: cfg.source.slot.clone(),
            policy: cfg.policy.clone(),
            blocked,
            releasing: InFlight::default(),
            observed,
            routes: Routes {
                listed: cfg
                    .tables()
                    .iter()
                    .map(|t| ReleaseRoute::of(t, cfg.tags_records()))
                    .collect::<Result<_, RelayError>>()?,
                found: Vec::new(),
                cfg: cfg.has_patterns().then(|| Box::new(cfg.clone())),
                tagged: cfg.tags_records(),
                names: Default::default(),
            },
            tagged: cfg.tags_records(),
            topic_buf: String::new(),
            refuse_all,
            vetting: Vetting::of(&cfg.parked),
            bounds: Bounds::of(&cfg.parked),
            refused: Vec::new(),
            relids: true,
        })
    }

    /// A table the session reads from now on, at the next index (a table a pattern matched
    /// that left the publication while the stream still holds its rows,
    /// [`crate::relay::outboxes::Outboxes::adopt`]).
    pub fn add_table(&mut self, t: &crate::config::tables::OutboxTable) -> Result<(), RelayError> {
        self.routes.listed.push(ReleaseRoute::of(t, self.tagged)?);
        Ok(())
    }

    /// Is a NULL payload of this type, from the listed table at index `table`, poison
    /// (`park`) rather than a tombstone?
    pub fn parks_null_payload(&self, event_type: &str, table: usize) -> bool {
        let route = &self.routes.listed[table];
        route.policy.null_payload(event_type, route.null_default) == NullPayload::Park
    }

    /// Checks a live event's payload against its table's schema, if that table validates.
    pub fn check_schema(
        &mut self,
        table: usize,
        event_type: &str,
        schema_version: &str,
        payload: &[u8],
    ) -> Result<(), String> {
        match self.routes.listed[table].validator.as_mut() {
            Some(v) => v.check(event_type, schema_version, payload),
            None => Ok(()),
        }
    }

    /// Which listed table a parked event came from, by the name its record carries (for its
    /// policy when it is parked: the session's table it was read from).
    fn route_of(&self, rec: &parking::ParkedRecord) -> Option<usize> {
        let labels: Vec<String> = self.routes.listed.iter().map(|r| r.label.clone()).collect();
        match crate::config::tables::ParkedTable::of(&labels, stored_table(&rec.headers)) {
            crate::config::tables::ParkedTable::Listed(i) => Some(i),
            _ => None,
        }
    }

    /// The parked event this event of the listed table at index `table` must wait behind, when
    /// its type orders by aggregate (in its table's policy) and the aggregate is blocked in
    /// its table (`relid`: its oid, when the session knows it).
    pub fn blocked_by(
        &self,
        event_type: &str,
        table: usize,
        relid: Option<u32>,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Option<String> {
        let route = &self.routes.listed[table];
        if route.policy.for_type(event_type).ordering != Ordering::Aggregate {
            return None;
        }
        let heads = self.blocked.get(aggregate_type)?.get(aggregate_id)?;
        // Its oid, and what its record's `source_table` header says (none with one table).
        let ours = TableKey {
            relid,
            name: self.tagged.then(|| route.label.clone()),
        };
        heads
            .iter()
            .find(|(t, _)| parking::hold_each_other(t, &ours))
            .map(|(_, head)| head.clone())
    }

    /// A deterministic failure: park (and block the aggregate if its policy says so) or halt.
    pub async fn park(
        &mut self,
        sql: &Client,
        rec: ParkedRecord,
        relid: Option<u32>,
        class: &str,
        message: &str,
    ) -> Result<(), RelayError> {
        let relid = relid.filter(|_| self.relids);
        let event_type = rec.event_type.clone().unwrap_or_default();
        let pol = match self.route_of(&rec) {
            Some(i) => self.routes.listed[i].policy.for_type(&event_type),
            None => self.policy.for_type(&event_type),
        };
        let label = self.observed.labels.event_type(&event_type).into_owned();
        metrics::counter!(crate::obs::POISON, "event_type" => label.clone(), "class" => class.to_string())
            .increment(1);
        if let (true, Some(i)) = (self.tagged, self.route_of(&rec)) {
            let table = self.routes.listed[i].label.clone();
            metrics::counter!(crate::obs::TABLE_POISON, "table" => table).increment(1);
        }
        self.observed.errors.record(class, &label);
        if pol.on_poison == OnPoison::Halt || self.refuse_all {
            return Err(RelayError::Halted {
                event_id: rec.event_id,
                class: class.to_string(),
                message: message.to_string(),
            });
        }
        let blocks = pol.ordering == Ordering::Aggregate
            && rec.aggregate_type.is_some()
            && rec.aggregate_id.is_some();
        self.bounds.admit(&rec)?;
        let tag = self.seal(&rec, blocks, None);
        let state = sql_bounded(parking::park(
            sql,
            &self.slot,
            &rec,
            relid,
            ParkState::Parked,
            blocks,
            None,
            class,
            message,
            tag.as_deref(),
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
            let table = TableKey {
                relid,
                name: stored_table(&rec.headers).map(str::to_string),
            };
            if let (Some(t), Some(a)) = (rec.aggregate_type, rec.aggregate_id) {
                let heads = self.blocked.entry(t).or_default().entry(a).or_default();
                if !heads.iter().any(|(h, _)| *h == table) {
                    heads.push((table, rec.event_id));
                }
            }
        }
        Ok(())
    }

    /// A later event of a blocked aggregate waits, durably, behind the parked one.
    pub async fn hold(
        &mut self,
        sql: &Client,
        rec: &ParkedRecord,
        relid: Option<u32>,
        head: &str,
    ) -> Result<(), RelayError> {
        let relid = relid.filter(|_| self.relids);
        self.bounds.admit(rec)?;
        let tag = self.seal(rec, true, Some(head));
        sql_bounded(parking::park(
            sql,
            &self.slot,
            rec,
            relid,
            ParkState::Blocked,
            true,
            Some(head),
            "blocked",
            &format!(
                "held behind parked event {head} of the same aggregate (ordering = \"aggregate\")"
            ),
            tag.as_deref(),
        ))
        .await?;
        let event_type = rec.event_type.as_deref().unwrap_or("");
        let label = self.observed.labels.event_type(event_type).into_owned();
        metrics::counter!(crate::obs::BLOCKED, "event_type" => label).increment(1);
        tracing::warn!(
            event_id = %rec.event_id,
            aggregate_id = rec.aggregate_id.as_deref().unwrap_or(""),
            aggregate_version = rec.aggregate_version,
            event_type,
            blocked_by = head,
            "event held behind a parked event"
        );
        Ok(())
    }

    /// What counts towards `[parked] max_open_bytes` (see [`parking::open_bytes`]).
    async fn open_bytes(&self, sql: &Client) -> Result<u64, RelayError> {
        let (max, keyed) = (
            self.bounds.max_record_bytes(),
            self.vetting.sealer.is_some(),
        );
        parking::open_bytes(sql, &self.slot, max, keyed).await
    }

    /// Is a batch of released events waiting for its acknowledgements?
    pub fn releasing(&self) -> bool {
        !self.releasing.is_empty()
    }

    /// The relay's integrity tag of a row it parks (see `poison::integrity`), with a key.
    fn seal(&self, rec: &ParkedRecord, blocks: bool, head: Option<&str>) -> Option<Vec<u8>> {
        let at = Placement {
            slot: &self.slot,
            blocks_aggregate: blocks,
            blocked_by: head,
        };
        self.vetting.sealer.as_ref().map(|s| s.seal(&at, rec))
    }

    /// Periodic: pick up operator repairs (retry/discard). Returns the open parked events per
    /// type and state, for the gauges.
    pub async fn repair_tick(
        &mut self,
        sql: &Client,
        producer: &Producer,
    ) -> Result<OpenStats, RelayError> {
        let stats = parking::open_stats(sql, &self.slot).await?;
        self.bounds.open_bytes = self.open_bytes(sql).await?;
        let stuck = parking::stuck_count(sql, &self.slot).await?;
        metrics::gauge!(crate::obs::STUCK_AGGREGATES).set(stuck as f64);
        if self.releasing.is_empty() {
            self.blocked = parking::blocked_aggregates(sql, &self.slot).await?;
            self.release_batch(sql, producer).await?;
        }
        Ok(stats)
    }

    /// Sends the next batch of releasable rows (see `poison::store::release`), each after the
    /// row it follows; a batch of which nothing could be sent is settled at once and the next
    /// one tried (a few times a call: the rest waits for the next tick).
    async fn release_batch(&mut self, sql: &Client, producer: &Producer) -> Result<(), RelayError> {
        for _ in 0..8 {
            self.routes.names.clear();
            let max = self.bounds.max_record_bytes();
            let batch = parking::release::next_batch(sql, &self.slot, max).await?;
            if batch.rows.is_empty() && batch.oversized.is_empty() {
                return Ok(());
            }
            let mut failed = batch.oversized;
            let mut accepted: Vec<i64> = Vec::new();
            for (r, prev) in batch.rows {
                if prev.is_some_and(|p| !accepted.contains(&p)) {
                    continue; // It follows a row that is not going out: it stays held.
                }
                let record = match self.prepare(sql, &r).await? {
                    Ok(record) => record,
                    Err((class, message)) => {
                        tracing::error!(event_id = %r.record.event_id, class, "parked event not released: {message}");
                        failed.push((r.id, class, message));
                        continue;
                    }
                };
                accepted.push(r.id);
                let labels = &self.observed.labels;
                let event_type = labels.event_type(record.event_type.as_deref().unwrap_or(""));
                let topic = labels.topic(record.topic.as_deref().unwrap_or(""));
                let rec = &r.record;
                let aggregate = rec.aggregate_type.clone().zip(rec.aggregate_id.clone());
                self.releasing.push(Sent::new(
                    r.id,
                    prev,
                    r.record.event_id.clone(),
                    aggregate,
                    metrics::counter!(crate::obs::PUBLISHED, "event_type" => event_type.into_owned(), "topic" => topic.into_owned()),
                ));
                // Its verdict, a synchronous refusal included, arrives as an Ack.
                producer.send_parked(&record, r.id).await;
            }
            if !self.releasing.is_empty() {
                // Refusals are written with the batch's outcome.
                self.refused = failed;
                return Ok(());
            }
            parking::release::finish(sql, &failed, &[]).await?;
            if failed.is_empty() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// The record to publish for a stored row, or why it stays parked (class, reason).
    async fn prepare(
        &mut self,
        sql: &Client,
        r: &parking::Release,
    ) -> Result<Result<ParkedRecord, (&'static str, String)>, RelayError> {
        // Its table by oid wherever it is now (by name without one): never through another
        // table's mapping, topic or row.
        let (which, renamed) = match self.routes.resolve(sql, r).await? {
            Ok(found) => found,
            Err(why) => return Ok(Err(("unknown_table", why))),
        };
        let renamed_copy;
        let r = if renamed {
            renamed_copy = parking::Release {
                renamed: true,
                ..r.clone()
            };
            &renamed_copy
        } else {
            r
        };
        // Never what the relay did not write, unchanged (see poison::vet).
        let refused = self
            .vetting
            .vet(&self.slot, &mut self.routes.get(which).provenance, sql, r)
            .await?;
        if let Some((class, message)) = refused {
            let event_type = r.record.event_type.as_deref().unwrap_or("");
            let label = self.observed.labels.event_type(event_type).into_owned();
            metrics::counter!(crate::obs::POISON, "event_type" => label.clone(), "class" => class)
                .increment(1);
            self.observed.errors.record(class, &label);
            return Ok(Err((class, message)));
        }
        // Never as stored: through the live router and the schema checks (see route::release).
        // The table's header is the relay's, recomputed from the table that vouched, never
        // the stored copy's.
        let tagged = self.tagged;
        let route = self.routes.get(which);
        let mut stored = r.record.clone();
        stored.headers.retain(|(k, _)| k != SOURCE_TABLE_HEADER);
        let rebuilt = release::rebuild(&stored, &route.topic, &route.names, &mut self.topic_buf)
            .map(|(mut record, v)| {
                if tagged {
                    record
                        .headers
                        .push((SOURCE_TABLE_HEADER.into(), Some(route.label.clone())));
                }
                (record, v)
            });
        // It stays parked (and holds its aggregate) with the reason.
        Ok(match rebuilt {
            Err(e) => Err((e.class(), e.to_string())),
            Ok((record, schema_version)) => {
                // A NULL event type (Debezium preset) is checked as "", like the live path.
                let t = record.event_type.as_deref().unwrap_or("");
                let checked = match (&mut route.validator, &record.payload) {
                    (Some(v), Some(p)) => v.check(t, &schema_version, p),
                    _ => Ok(()),
                };
                checked.map(|()| record).map_err(|m| ("schema_invalid", m))
            }
        })
    }

    /// The broker's verdict on a released event. The batch's last settles it in one
    /// transaction (see `relay::releasing`), reads its aggregates' holds again and sends the
    /// next batch.
    pub async fn on_release_ack(
        &mut self,
        sql: &Client,
        id: i64,
        verdict: Verdict,
        producer: &Producer,
    ) -> Result<(), RelayError> {
        if !self.releasing.on_ack(id, verdict) {
            return Ok(());
        }
        let mut settled = self.releasing.settle();
        let mut failed = std::mem::take(&mut self.refused);
        failed.extend(std::mem::take(&mut settled.failed));
        parking::release::finish(sql, &failed, &settled.delivered).await?;
        crate::relay::releasing::refresh_heads(sql, &self.slot, &mut self.blocked, &settled)
            .await?;
        self.release_batch(sql, producer).await
    }
}
