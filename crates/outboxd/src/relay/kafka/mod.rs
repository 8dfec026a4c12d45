//! Producer: hands records to librdkafka (idempotent, `acks=all`) and reports each broker
//! verdict back as an [`Ack`] carrying the event's sequence number.
//!
//! librdkafka already retries retriable errors with bounded exponential backoff
//! (`retry.backoff.ms` .. `retry.backoff.max.ms`), keeping the same producer sequence number, so
//! the broker de-duplicates retries and per-partition order holds. outboxd sets
//! `message.timeout.ms = 0` (never give up locally) by default: a broker outage stalls delivery
//! and the slot, it never turns into a failed event. Anything that still fails ends the session,
//! which restarts from the slot's confirmed LSN and produces the same bytes again.

mod client;
pub(crate) mod consumer;
pub(crate) mod hint;
mod log;
pub(crate) mod oidc;
pub(crate) mod outstanding;
mod too_large;
mod trace;
pub(crate) mod txn;
pub(crate) mod verdict;

pub use client::client_config;
pub use verdict::{broker_error_class, Ack, Origin, Verdict};
use verdict::{capture, header_str};

use crate::config::Config;
use crate::error::RelayError;
use crate::obs::telemetry::span::Publisher;
use crate::poison::record::ParkedRecord;
use crate::relay::ack::Seq;
use crate::relay::route::Event;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer as _, ProducerContext, ThreadedProducer,
};
use rdkafka::ClientContext;
use std::time::Duration;
use tokio::sync::mpsc;

/// Routes librdkafka's callbacks: delivery reports to the ack channel, logs to `tracing`.
pub struct Ctx {
    acks: mpsc::UnboundedSender<Ack>,
    /// Which session of this process produced the record: a delivery after a restart is a
    /// later attempt at the same event (R25).
    attempt: u64,
    /// librdkafka repeats configuration values (passwords too) in its errors and logs.
    redactor: crate::config::secrets::Redactor,
    /// The newest error librdkafka reported on its own (TLS handshake, authentication, broker
    /// down), so `check` can name the cause instead of a bare timeout.
    last_error: std::sync::Mutex<Option<String>>,
    /// When librdkafka last reported an authentication or TLS refusal (ms since the epoch).
    refused_at_ms: std::sync::atomic::AtomicU64,
    /// The relay's health (broker refusals) and error counts.
    observed: std::sync::Arc<crate::obs::Observed>,
    /// De-duplicates and rate-limits librdkafka's reports (see `log`).
    gate: log::Gate,
    /// With `relay.broker_fencing`: the open Kafka transaction (delivered acks wait for it).
    txn: Option<std::sync::Arc<txn::Txn>>,
    /// Records accepted and not yet reported on (the adaptive pace sleeps on it).
    outstanding: outstanding::Outstanding,
    /// With `[telemetry]`: the publish spans of records not yet acknowledged (`trace`).
    telemetry: Option<crate::obs::telemetry::Telemetry>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

impl ClientContext for Ctx {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        let msg = self.redactor.scrub(msg);
        let loud = matches!(
            level,
            RDKafkaLogLevel::Emerg
                | RDKafkaLogLevel::Alert
                | RDKafkaLogLevel::Critical
                | RDKafkaLogLevel::Error
                | RDKafkaLogLevel::Warning
        );
        if !loud {
            tracing::debug!(target: "librdkafka", fac, "{msg}");
            return;
        }
        // The error callback reports the same failures: it logs them (once per kind per
        // window); here they go to debug unless the gate has not seen them.
        match self.gate.pass(&msg) {
            Some(held_back) => {
                tracing::warn!(target: "librdkafka", fac, held_back, "{msg}")
            }
            None => tracing::debug!(target: "librdkafka", fac, "{msg}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        let reason = self.redactor.scrub(reason);
        let error = self.redactor.scrub(&error.to_string());
        let class = broker_error_class(code);
        if let Some(held_back) = self.gate.pass(&reason) {
            tracing::warn!(target: "librdkafka", error = %error, class, held_back, "{reason}");
        }
        metrics::counter!(crate::obs::BROKER_ERRORS, "class" => class).increment(1);
        self.observed.errors.broker(class);
        if matches!(class, "auth" | "tls") {
            self.refused_at_ms
                .store(now_ms(), std::sync::atomic::Ordering::Relaxed);
            // Shown by /readyz and `outboxd status` until a delivery succeeds again.
            self.observed
                .health
                .broker_issue(class, crate::relay::kafka::hint::with_hint(&reason));
        }
        // "All brokers are down" follows the error that says why: keep the why.
        if code != Some(RDKafkaErrorCode::AllBrokersDown) {
            if let Ok(mut last) = self.last_error.lock() {
                *last = Some(format!("{error}: {reason}"));
            }
        }
        if code == Some(RDKafkaErrorCode::AllBrokersDown) {
            self.observed
                .health
                .broker_ok
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn stats(&self, s: rdkafka::Statistics) {
        let retries: u64 = s.brokers.values().map(|b| b.txretries).sum();
        metrics::counter!(crate::obs::PRODUCE_RETRIES).absolute(retries);
        // An idle relay delivers nothing that would clear a healed refusal: a broker connection
        // up with no refusal for two statistics intervals (10 s) clears it too.
        let quiet = now_ms().saturating_sub(
            self.refused_at_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        ) > 10_000;
        if quiet && s.brokers.values().any(|b| b.state == "UP") {
            self.observed.health.broker_ok_again();
        }
    }
}

impl ProducerContext for Ctx {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, opaque: usize) {
        let origin = Origin::from_opaque(opaque);
        let verdict = match result {
            Ok(m) => {
                self.observed.health.broker_ok_again();
                if tracing::enabled!(tracing::Level::DEBUG) {
                    tracing::debug!(
                        event_id = header_str(m, "event_id"),
                        aggregate_id = header_str(m, "aggregate_id"),
                        aggregate_version = header_str(m, "aggregate_version"),
                        event_type = header_str(m, "event_type"),
                        attempt = self.attempt,
                        topic = m.topic(),
                        partition = m.partition(),
                        offset = m.offset(),
                        "delivered"
                    );
                }
                Verdict::Delivered
            }
            Err((e, m)) => {
                let message = self.redactor.scrub(&e.to_string());
                let verdict = verdict::classify(
                    e.rdkafka_error_code(),
                    header_str(m, "event_id").to_string(),
                    message.clone(),
                    || capture(m),
                );
                tracing::warn!(
                    event_id = header_str(m, "event_id"),
                    aggregate_id = header_str(m, "aggregate_id"),
                    aggregate_version = header_str(m, "aggregate_version"),
                    event_type = header_str(m, "event_type"),
                    attempt = self.attempt,
                    topic = m.topic(),
                    code = ?e.rdkafka_error_code(),
                    deterministic = matches!(verdict, Verdict::Rejected { .. }),
                    "delivery failed: {message}"
                );
                verdict
            }
        };
        trace::delivered(self, opaque, result, &verdict);
        match &self.txn {
            Some(t) => {
                let ack = Ack::now(origin, verdict);
                txn::remember_refusal(&self.observed, &ack);
                t.hold(ack, &self.acks)
            }
            None => drop(self.acks.send(Ack::now(origin, verdict))),
        }
        if self.outstanding.reported() {
            self.txn.as_deref().inspect(|t| t.all_reported());
        }
    }
}

pub struct Producer {
    /// Declared first so it is dropped (stopped and joined) before the client it feeds.
    _oidc: Option<crate::relay::kafka::oidc::Refresher>,
    inner: std::sync::Arc<ThreadedProducer<Ctx>>,
    /// Initial room of a record's header list: 12 holds a binary-mode CloudEvent's (10–12)
    /// without growing the list (outboxd's own format has 5–8).
    headers_cap: usize,
    _committer: Option<txn::Committer>,
}

impl Producer {
    pub fn new(
        cfg: &Config,
        observed: std::sync::Arc<crate::obs::Observed>,
    ) -> Result<(Self, mpsc::UnboundedReceiver<Ack>), RelayError> {
        Self::create(cfg, observed, None, Publisher::Stream)
    }

    /// The producer of `outboxd replay`: its publish spans link to each event's first one.
    pub fn replaying(
        cfg: &Config,
        observed: std::sync::Arc<crate::obs::Observed>,
    ) -> Result<(Self, mpsc::UnboundedReceiver<Ack>), RelayError> {
        Self::create(cfg, observed, None, Publisher::Replay)
    }

    /// With a `transactional.id`, transactions are initialised by [`txn`], not here.
    fn create(
        cfg: &Config,
        observed: std::sync::Arc<crate::obs::Observed>,
        transactional_id: Option<&str>,
        publisher: Publisher,
    ) -> Result<(Self, mpsc::UnboundedReceiver<Ack>), RelayError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let telemetry = trace::telemetry(cfg, &observed, publisher)?;
        let outstanding = outstanding::Outstanding::default();
        let mut cc = client_config(cfg);
        if let Some(id) = transactional_id {
            cc.set("transactional.id", id);
        }
        let inner: ThreadedProducer<Ctx> = cc
            .create_with_context(Ctx {
                acks: tx,
                attempt: observed
                    .sessions
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    + 1,
                observed: observed.clone(),
                redactor: cfg.redactor.clone(),
                last_error: std::sync::Mutex::new(None),
                refused_at_ms: std::sync::atomic::AtomicU64::new(0),
                gate: log::Gate::default(),
                txn: transactional_id
                    .map(|_| std::sync::Arc::new(txn::Txn::new(outstanding.clone()))),
                outstanding,
                telemetry,
            })
            // librdkafka refuses the configuration itself: retrying cannot help.
            .map_err(|e| {
                RelayError::Setup(format!(
                    "[sink.kafka] is not a valid librdkafka configuration: {} — fix that \
                     property (docs/configuration.md, \"Connecting to production Kafka\")",
                    cfg.redactor.scrub(&e.to_string())
                ))
            })?;
        let oidc = crate::config::oidc::OidcConfig::from_kafka(&cfg.sink.kafka)
            .map_err(RelayError::Setup)?
            .map(|o| {
                // SAFETY: the refresher is a field of the Producer that owns `inner` and is
                // dropped before it.
                unsafe {
                    crate::relay::kafka::oidc::Refresher::start(
                        o,
                        inner.client().native_ptr(),
                        cfg.redactor.clone(),
                        {
                            let observed = observed.clone();
                            move |r| match r {
                                Ok(()) => observed.health.clear_broker_issue("auth"),
                                Err(e) => observed.health.broker_issue("auth", e),
                            }
                        },
                    )
                }
                .map_err(|e| RelayError::Setup(format!("cannot start the OIDC thread: {e}")))
            })
            .transpose()?;
        Ok((
            Self {
                _oidc: oidc,
                inner: std::sync::Arc::new(inner),
                headers_cap: 12,
                _committer: None,
            },
            rx,
        ))
    }

    /// Enqueues one stream event. Waits (asynchronously) while librdkafka's local queue is
    /// full; any other immediate refusal (e.g. larger than `message.max.bytes`) becomes an
    /// [`Ack`] on the same channel as the broker's verdicts, before this returns.
    pub async fn send(&self, topic: &str, e: &Event<'_>, seq: Seq) {
        let ctx = self.inner.context();
        let span = trace::start_event(ctx, topic, e);
        let mut headers = Some(OwnedHeaders::new_with_capacity(self.headers_cap));
        // Header JSON was validated by the stage before this call. `Option::take` moves the
        // list through `insert` without allocating a replacement.
        let _ = e.for_each_header(|k, v| {
            let v = trace::rewrite(&span, k, v);
            headers = headers
                .take()
                .map(|h| h.insert(Header { key: k, value: v }));
        });
        let headers = trace::add_missing(&span, headers.unwrap_or_default());
        let origin = Origin::Stream(seq);
        trace::hold(ctx, origin.to_opaque(), e.event_id, span);
        if ctx.txn.is_some() {
            let parked = || e.parked_record(Some(topic));
            if let Some(v) = txn::refused_before(&ctx.observed, e.event_id, parked) {
                let _ = ctx.acks.send(Ack::now(origin, v));
                return;
            }
        }
        let mut record = BaseRecord::<[u8], [u8], usize>::with_opaque_to(topic, origin.to_opaque())
            .headers(headers);
        // A NULL aggregate id (Debezium preset) is a record without a key, not an empty one.
        if let Some(k) = e.aggregate_id {
            record = record.key(k.as_bytes());
        }
        // A tombstone has no value at all (null), not an empty one.
        // The payload, or the CloudEvents envelope (structured mode).
        let value = e.value();
        let record = if e.tombstone {
            record
        } else {
            record.payload(&*value)
        };
        self.enqueue(record, e.created_at_ms, origin, e.event_id, || {
            e.parked_record(Some(topic))
        })
        .await;
    }

    /// Enqueues a parked record (parking row `id`) exactly as it was captured; refusals as in
    /// [`Producer::send`].
    pub async fn send_parked(&self, r: &ParkedRecord, id: i64) {
        self.send_captured(r, Origin::Release(id)).await
    }

    /// Enqueues a streamed event that was held (captured) while its table caught up, under its
    /// stream position `seq` ([`crate::relay::held`]).
    pub async fn send_held(&self, r: &ParkedRecord, seq: Seq) {
        self.send_captured(r, Origin::Stream(seq)).await
    }

    async fn send_captured(&self, r: &ParkedRecord, origin: Origin) {
        let span = trace::start_release(self.inner.context(), r);
        let mut headers = OwnedHeaders::new_with_capacity(r.headers.len());
        for (k, v) in &r.headers {
            headers = headers.insert(Header {
                key: k,
                value: trace::rewrite(&span, k, v.as_deref().map(str::as_bytes)),
            });
        }
        let headers = trace::add_missing(&span, headers);
        trace::hold(self.inner.context(), origin.to_opaque(), &r.event_id, span);
        let mut record = BaseRecord::<[u8], [u8], usize>::with_opaque_to(
            r.topic.as_deref().unwrap_or(""),
            origin.to_opaque(),
        )
        .headers(headers);
        if let Some(k) = &r.key {
            record = record.key(k.as_slice());
        }
        if let Some(p) = &r.payload {
            record = record.payload(p.as_slice());
        }
        self.enqueue(record, r.timestamp_ms, origin, &r.event_id, || r.clone())
            .await;
    }

    async fn enqueue(
        &self,
        mut record: BaseRecord<'_, [u8], [u8], usize>,
        ts: Option<i64>,
        origin: Origin,
        event_id: &str,
        parked: impl FnOnce() -> ParkedRecord,
    ) {
        if let Some(ts) = ts {
            record = record.timestamp(ts);
        }
        let txn = self.inner.context().txn.as_deref();
        loop {
            let _open = match txn {
                Some(t) => Some(t.enter().await),
                None => None,
            };
            // Counted before the hand-over: its report may come before `send` returns.
            let outstanding = &self.inner.context().outstanding;
            outstanding.handing();
            let sent = self.inner.send(record);
            if sent.is_err() {
                outstanding.refused();
            }
            match sent {
                Ok(()) => return,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    drop(_open);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((err, _)) => {
                    let ctx = self.inner.context();
                    let verdict = verdict::classify(
                        err.rdkafka_error_code(),
                        event_id.to_string(),
                        ctx.redactor.scrub(&err.to_string()),
                        parked,
                    );
                    trace::finish(ctx, origin.to_opaque(), -1, None, &verdict);
                    let _ = ctx.acks.send(Ack::now(origin, verdict));
                    return;
                }
            }
        }
    }

    /// The records handed over and not yet reported on (the adaptive pace waits for them).
    pub fn outstanding(&self) -> outstanding::Outstanding {
        self.inner.context().outstanding.clone()
    }

    /// Waits up to `timeout` for outstanding deliveries (their acks arrive on the channel).
    pub fn flush(&self, timeout: Duration) {
        let _ = self.inner.flush(timeout);
        if let Some(t) = &self.inner.context().txn {
            t.flush(&self.inner, &self.inner.context().acks);
        }
    }

    /// Fetches the cluster's metadata; returns the names of its topics.
    pub fn ping(&self, timeout: Duration) -> Result<Vec<String>, RelayError> {
        self.inner
            .client()
            .fetch_metadata(None, timeout)
            .map(|m| m.topics().iter().map(|t| t.name().to_string()).collect())
            .map_err(|e| {
                let ctx = self.inner.context();
                let cause = ctx.last_error.lock().ok().and_then(|l| l.clone());
                let msg = match cause {
                    Some(c) => format!("broker unreachable: {e} ({c})"),
                    None => format!("broker unreachable: {e}"),
                };
                RelayError::Kafka(ctx.redactor.scrub(&msg))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_errors_are_classed() {
        use RDKafkaErrorCode as C;
        for (code, class) in [
            (C::Authentication, "auth"),
            (C::SaslAuthenticationFailed, "auth"),
            (C::UnsupportedSASLMechanism, "auth"),
            (C::SSL, "tls"),
            (C::AllBrokersDown, "down"),
            (C::BrokerTransportFailure, "transport"),
            (C::MessageSizeTooLarge, "other"),
        ] {
            assert_eq!(broker_error_class(Some(code)), class, "{code:?}");
        }
        assert_eq!(broker_error_class(None), "other");
    }
}
