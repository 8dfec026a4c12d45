//! Shadow mode (R35): for teams moving off "publish inside the transaction". outboxd streams
//! and builds every record exactly as it would deliver it, but does not deliver it (or sends it
//! to `<shadow_topic_prefix><topic>`); a comparator reads what the legacy path published on
//! `shadow.legacy_topics` and pairs the two by `event_id`:
//! - **matched**: the compared fields (`shadow.compare`) are equal;
//! - **mismatched**: which fields differ;
//! - **missing_legacy**: outboxd built it, the legacy path never sent it within
//!   `match_window` (the legacy send failed after the commit: the dual-write bug's lost event);
//! - **missing_outbox**: the legacy path sent it, no committed outbox row carried it (the
//!   business transaction rolled back after the send: the dual-write bug's phantom event).
//!
//! Outcomes go to metrics (`outboxd_shadow_events_total{event_type,result}`) and to
//! `outboxd_shadow_counts` / `outboxd_shadow_diffs`, which `outboxd shadow report` reads.
//!
//! Canary: event types in `shadow.deliver_types` are delivered for real and not compared; the
//! cut-over moves types there one at a time (docs/operations.md, "Shadow mode").
//!
//! What is compared starts when the comparator is ready (legacy partitions assigned at their
//! end) plus a grace second: older outbox commits and older legacy records are skipped, so a
//! relay replaying its slot after a restart does not report events whose legacy record was
//! published before the comparator listened. Pending events live in memory: a restart forgets
//! them (they are neither matched nor reported).

pub(crate) mod compare;
mod legacy;
pub(crate) mod store;

use crate::config::shadow::{Field, Locator};
use crate::config::Config;
use crate::error::RelayError;
use crate::model::record::Rec;
use crate::obs::Observed;
use crate::relay::tap::Tap;
use compare::{Decided, Matcher, Side};
use rdkafka::consumer::StreamConsumer;
use rdkafka::Message;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// Records waiting for the comparator; when it falls behind, further ones are dropped (and
/// counted) rather than slowing the relay.
const QUEUE: usize = 50_000;

/// Starts the comparator when `shadow.enabled`: the legacy consumer and the task that pairs,
/// reports and stores. Runs until `shutdown`.
pub async fn start(
    cfg: &Config,
    shutdown: watch::Receiver<bool>,
    observed: Arc<Observed>,
) -> Result<Option<(Tap, tokio::task::JoinHandle<()>)>, RelayError> {
    let s = &cfg.shadow;
    if !s.enabled {
        return Ok(None);
    }
    let consumer = legacy::consumer(cfg)?;
    let mut sql = crate::relay::source::sql_connect(cfg).await?;
    store::ensure_tables(&sql).await?;
    let since_ms = crate::obs::now_us() / 1000 + 1000;
    let (tx, rx) = mpsc::channel(QUEUE);
    let tap = Tap {
        tx,
        deliver: Arc::new(s.deliver_types.iter().cloned().collect()),
        prefix: s.shadow_topic_prefix.as_deref().map(Arc::from),
        since_ms,
        warned: Arc::new(AtomicBool::new(false)),
    };
    let fields: Vec<Field> = s
        .compare
        .iter()
        .map(|f| Field::parse(f))
        .collect::<Result<_, _>>()
        .map_err(RelayError::Setup)?;
    let matcher = Matcher::new(fields, s.value_compare == "json", s.match_window);
    let id =
        Locator::parse("shadow.legacy_event_id", &s.legacy_event_id).map_err(RelayError::Setup)?;
    let ty = s
        .legacy_event_type
        .as_deref()
        .map(|t| Locator::parse("shadow.legacy_event_type", t))
        .transpose()
        .map_err(RelayError::Setup)?;
    metrics::gauge!(crate::obs::SHADOW_PENDING).set(0.0);
    tracing::info!(
        legacy_topics = ?s.legacy_topics,
        deliver_types = ?s.deliver_types,
        shadow_topic_prefix = ?s.shadow_topic_prefix,
        "shadow mode: records are compared with the legacy path, not delivered"
    );
    let slot = cfg.source.slot.clone();
    let redactor = cfg.redactor.clone();
    let cfg = cfg.clone();
    let task = tokio::spawn(async move {
        let mut c = Comparator {
            matcher,
            id,
            ty,
            since_ms,
            observed,
            unreadable: 0,
            diffs_left: store::MAX_DIFFS,
            decided: Vec::new(),
            cfg,
        };
        c.run(rx, consumer, &mut sql, &slot, shutdown, &redactor)
            .await;
    });
    Ok(Some((tap, task)))
}

struct Comparator {
    matcher: Matcher,
    id: Locator,
    ty: Option<Locator>,
    since_ms: i64,
    observed: Arc<Observed>,
    /// Legacy records without a findable event id.
    unreadable: u64,
    diffs_left: u64,
    decided: Vec<Decided>,
    /// To reconnect when the database connection is gone.
    cfg: Config,
}

impl Comparator {
    async fn run(
        &mut self,
        mut rx: mpsc::Receiver<Rec>,
        consumer: StreamConsumer<crate::relay::kafka::consumer::Ctx>,
        sql: &mut tokio_postgres::Client,
        slot: &str,
        mut shutdown: watch::Receiver<bool>,
        redactor: &crate::config::secrets::Redactor,
    ) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                Some(rec) = rx.recv() => {
                    if let Some(d) = self.matcher.offer(Side::Outbox, rec, Instant::now()) {
                        self.decide(d);
                    }
                }
                m = consumer.recv() => match m {
                    Ok(m) => self.on_legacy(&m),
                    Err(e) => {
                        tracing::debug!(error = %redactor.scrub(&e.to_string()), "shadow consumer");
                    }
                },
                _ = tick.tick() => {
                    for d in self.matcher.expire(Instant::now()) {
                        self.decide(d);
                    }
                    self.flush(sql, slot).await;
                }
                _ = shutdown.changed() => return,
            }
        }
    }

    fn on_legacy(&mut self, m: &rdkafka::message::BorrowedMessage<'_>) {
        if m.timestamp().to_millis().unwrap_or(i64::MAX) < self.since_ms {
            return;
        }
        match legacy::to_rec(m, &self.id, self.ty.as_ref()) {
            Some(rec) => {
                if let Some(d) = self.matcher.offer(Side::Legacy, rec, Instant::now()) {
                    self.decide(d);
                }
            }
            None => {
                self.unreadable += 1;
                if self.unreadable == 1 {
                    tracing::warn!(
                        topic = m.topic(),
                        partition = m.partition(),
                        offset = m.offset(),
                        "shadow: a legacy record has no event id where shadow.legacy_event_id says; such records are not compared"
                    );
                }
                metrics::counter!(crate::obs::SHADOW_EVENTS, "event_type" => "unknown", "result" => "unreadable")
                    .increment(1);
            }
        }
    }

    /// Counts and logs an outcome once; it is stored at the next tick.
    fn decide(&mut self, d: Decided) {
        let t = self.observed.labels.event_type(&d.event_type).into_owned();
        metrics::counter!(crate::obs::SHADOW_EVENTS, "event_type" => t, "result" => d.outcome.label())
            .increment(1);
        if let compare::Outcome::Mismatched(fields) = &d.outcome {
            tracing::info!(event_id = %d.event_id, event_type = %d.event_type, ?fields, "shadow: mismatched");
        } else if d.outcome != compare::Outcome::Matched {
            tracing::info!(event_id = %d.event_id, event_type = %d.event_type, result = d.outcome.label(), "shadow");
        }
        self.decided.push(d);
    }

    async fn flush(&mut self, sql: &mut tokio_postgres::Client, slot: &str) {
        metrics::gauge!(crate::obs::SHADOW_PENDING).set(self.matcher.pending() as f64);
        if self.decided.is_empty() {
            return;
        }
        match store::record(sql, slot, &self.decided, &mut self.diffs_left).await {
            Ok(()) => self.decided.clear(),
            // Kept for the next tick (bounded: the oldest go if the database stays away).
            Err(e) => {
                tracing::warn!(error = %e, "shadow: cannot record outcomes; retrying");
                if sql.is_closed() {
                    if let Ok(c) = crate::relay::source::sql_connect(&self.cfg).await {
                        *sql = c;
                    }
                }
                let excess = self.decided.len().saturating_sub(100_000);
                self.decided.drain(..excess);
            }
        }
    }
}
