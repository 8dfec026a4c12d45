//! Producer: hands records to librdkafka (idempotent, `acks=all`) and reports each broker
//! verdict back as an [`Ack`] carrying the event's sequence number.
//!
//! librdkafka already retries retriable errors with bounded exponential backoff
//! (`retry.backoff.ms` .. `retry.backoff.max.ms`), keeping the same producer sequence number, so
//! the broker de-duplicates retries and per-partition order holds. outboxd sets
//! `message.timeout.ms = 0` (never give up locally) by default: a broker outage stalls delivery
//! and the slot, it never turns into a failed event. Anything that still fails ends the session,
//! which restarts from the slot's confirmed LSN and produces the same bytes again.

use crate::ack::Seq;
use crate::config::Config;
use crate::error::RelayError;
use crate::parking::ParkedRecord;
use crate::policy;
use crate::router::Event;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer as _, ProducerContext, ThreadedProducer,
};
use rdkafka::ClientContext;
use std::time::Duration;
use tokio::sync::mpsc;

/// The broker's verdict on one event.
#[derive(Debug)]
pub struct Ack {
    pub seq: Seq,
    pub result: Result<(), DeliveryFailure>,
}

#[derive(Debug, Clone)]
pub struct DeliveryFailure {
    pub event_id: String,
    pub code: Option<RDKafkaErrorCode>,
    pub message: String,
    /// The record as sent, captured only for deterministic failures (to park it).
    pub record: Option<ParkedRecord>,
}

impl DeliveryFailure {
    pub fn is_deterministic(&self) -> bool {
        self.code.is_some_and(policy::is_deterministic)
    }

    pub fn code_name(&self) -> String {
        self.code
            .map(|c| format!("{c:?}"))
            .unwrap_or_else(|| "Unknown".into())
    }
}

/// A record librdkafka refused to enqueue.
#[derive(Debug, Clone)]
pub struct SendError {
    pub code: Option<RDKafkaErrorCode>,
    pub message: String,
}

impl SendError {
    pub fn is_deterministic(&self) -> bool {
        self.code.is_some_and(policy::is_deterministic)
    }
}

/// Copies a failed record out of librdkafka so it can be parked byte for byte.
fn capture(m: &rdkafka::message::BorrowedMessage<'_>) -> ParkedRecord {
    let header = |n: &str| {
        let v = header_str(m, n);
        (v != "?").then(|| v.to_string())
    };
    ParkedRecord {
        event_id: header_str(m, "event_id").to_string(),
        aggregate_type: header("aggregate_type"),
        aggregate_id: header("aggregate_id"),
        aggregate_version: header("aggregate_version").and_then(|v| v.parse().ok()),
        event_type: header("event_type"),
        topic: Some(m.topic().to_string()),
        key: m.key().map(<[u8]>::to_vec),
        payload: m.payload().map(<[u8]>::to_vec),
        headers: m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        (
                            h.key.to_string(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default(),
        timestamp_ms: m.timestamp().to_millis(),
    }
}

/// Routes librdkafka's callbacks: delivery reports to the ack channel, logs to `tracing`.
pub struct Ctx {
    acks: mpsc::UnboundedSender<Ack>,
    /// Which session of this process produced the record: a delivery after a restart is a
    /// later attempt at the same event (R25).
    attempt: u64,
    /// librdkafka repeats configuration values (passwords too) in its errors and logs.
    redactor: crate::secrets::Redactor,
    /// The newest error librdkafka reported on its own (TLS handshake, authentication, broker
    /// down), so `check` can name the cause instead of a bare timeout.
    last_error: std::sync::Mutex<Option<String>>,
}

impl ClientContext for Ctx {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        let msg = self.redactor.scrub(msg);
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", fac, "{msg}"),
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", fac, "{msg}"),
            _ => tracing::debug!(target: "librdkafka", fac, "{msg}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        let reason = self.redactor.scrub(reason);
        let error = self.redactor.scrub(&error.to_string());
        tracing::warn!(target: "librdkafka", error = %error, "{reason}");
        // "All brokers are down" follows the error that says why: keep the why.
        if code != Some(RDKafkaErrorCode::AllBrokersDown) {
            if let Ok(mut last) = self.last_error.lock() {
                *last = Some(format!("{error}: {reason}"));
            }
        }
        if code == Some(RDKafkaErrorCode::AllBrokersDown) {
            crate::obs::health()
                .broker_ok
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn stats(&self, s: rdkafka::Statistics) {
        let retries: u64 = s.brokers.values().map(|b| b.txretries).sum();
        metrics::counter!(crate::obs::PRODUCE_RETRIES).absolute(retries);
    }
}

fn header_str<'a>(m: &'a rdkafka::message::BorrowedMessage<'a>, name: &str) -> &'a str {
    m.headers()
        .and_then(|h| h.iter().find(|h| h.key == name))
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
        .unwrap_or("?")
}

impl ProducerContext for Ctx {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, seq: usize) {
        let result = match result {
            Ok(m) => {
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
                Ok(())
            }
            Err((e, m)) => {
                let mut f = DeliveryFailure {
                    event_id: header_str(m, "event_id").to_string(),
                    code: e.rdkafka_error_code(),
                    message: self.redactor.scrub(&e.to_string()),
                    record: None,
                };
                if f.is_deterministic() {
                    f.record = Some(capture(m));
                }
                tracing::warn!(
                    event_id = %f.event_id,
                    aggregate_id = header_str(m, "aggregate_id"),
                    aggregate_version = header_str(m, "aggregate_version"),
                    event_type = header_str(m, "event_type"),
                    attempt = self.attempt,
                    topic = m.topic(),
                    code = %f.code_name(),
                    deterministic = f.is_deterministic(),
                    "delivery failed: {}", f.message
                );
                Err(f)
            }
        };
        let _ = self.acks.send(Ack {
            seq: seq as Seq,
            result,
        });
    }
}

/// The librdkafka properties outboxd insists on or defaults, merged with the user's.
pub fn client_config(cfg: &Config) -> ClientConfig {
    let mut cc = ClientConfig::new();
    // Defaults the user may override:
    cc.set("linger.ms", "5")
        .set("message.timeout.ms", "0")
        .set("retry.backoff.ms", "100")
        .set("retry.backoff.max.ms", "2000")
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .set("statistics.interval.ms", "5000")
        .set("client.id", "outboxd");
    // OpenSSL is built in (vendored): its compiled-in CA directory is not the system's, so
    // public CAs (Confluent Cloud, MSK) are found by librdkafka's probe of the usual bundle
    // paths unless the user names a CA.
    let kafka = &cfg.sink.kafka;
    let tls = kafka
        .get("security.protocol")
        .is_some_and(|p| p.to_ascii_lowercase().contains("ssl"));
    if tls
        && !["ssl.ca.location", "ssl.ca.pem", "ssl.ca.certificate.stores"]
            .iter()
            .any(|k| kafka.contains_key(*k))
    {
        cc.set("ssl.ca.location", "probe");
    }
    for (k, v) in kafka {
        cc.set(k, v);
    }
    // Required for the delivery guarantee (config validation rejects contrary settings):
    cc.set("enable.idempotence", "true").set("acks", "all");
    cc.set_log_level(RDKafkaLogLevel::Warning);
    cc
}

/// Sessions (producers) created by this process.
static SESSIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub struct Producer {
    inner: ThreadedProducer<Ctx>,
    headers_cap: usize,
}

impl Producer {
    pub fn new(cfg: &Config) -> Result<(Self, mpsc::UnboundedReceiver<Ack>), RelayError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let inner: ThreadedProducer<Ctx> = client_config(cfg)
            .create_with_context(Ctx {
                acks: tx,
                attempt: SESSIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
                redactor: cfg.redactor.clone(),
                last_error: std::sync::Mutex::new(None),
            })
            // librdkafka refuses the configuration itself: retrying cannot help.
            .map_err(|e| {
                RelayError::Setup(format!(
                    "[sink.kafka] is not a valid librdkafka configuration: {} — fix that \
                     property (docs/configuration.md, \"Connecting to production Kafka\")",
                    cfg.redactor.scrub(&e.to_string())
                ))
            })?;
        Ok((
            Self {
                inner,
                headers_cap: 8,
            },
            rx,
        ))
    }

    /// Enqueues one record. Waits (asynchronously) while librdkafka's local queue is full;
    /// any other immediate refusal is returned (e.g. larger than `message.max.bytes`).
    pub async fn send(&self, topic: &str, e: &Event<'_>, seq: Seq) -> Result<(), SendError> {
        let mut headers = Some(OwnedHeaders::new_with_capacity(self.headers_cap));
        // Header JSON was validated by the stage before this call. `Option::take` moves the
        // list through `insert` without allocating a replacement.
        let _ = e.for_each_header(|k, v| {
            headers = headers.take().map(|h| {
                h.insert(Header {
                    key: k,
                    value: Some(v),
                })
            });
        });
        let headers = headers.unwrap_or_default();
        let record = BaseRecord::<[u8], [u8], usize>::with_opaque_to(topic, seq as usize)
            .key(e.aggregate_id.as_bytes())
            .payload(e.payload)
            .headers(headers);
        self.enqueue(record, e.created_at_ms).await
    }

    /// Enqueues a record that was parked, exactly as it was captured.
    pub async fn send_parked(&self, r: &ParkedRecord, opaque: u64) -> Result<(), SendError> {
        let mut headers = OwnedHeaders::new_with_capacity(r.headers.len());
        for (k, v) in &r.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record = BaseRecord::<[u8], [u8], usize>::with_opaque_to(
            r.topic.as_deref().unwrap_or(""),
            opaque as usize,
        )
        .headers(headers);
        if let Some(k) = &r.key {
            record = record.key(k.as_slice());
        }
        if let Some(p) = &r.payload {
            record = record.payload(p.as_slice());
        }
        self.enqueue(record, r.timestamp_ms).await
    }

    async fn enqueue(
        &self,
        mut record: BaseRecord<'_, [u8], [u8], usize>,
        ts: Option<i64>,
    ) -> Result<(), SendError> {
        if let Some(ts) = ts {
            record = record.timestamp(ts);
        }
        loop {
            match self.inner.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((err, _)) => {
                    return Err(SendError {
                        code: err.rdkafka_error_code(),
                        message: self.inner.context().redactor.scrub(&err.to_string()),
                    })
                }
            }
        }
    }

    /// Waits up to `timeout` for outstanding deliveries (their acks arrive on the channel).
    pub fn flush(&self, timeout: Duration) {
        let _ = self.inner.flush(timeout);
    }

    /// Checks broker reachability by fetching metadata.
    pub fn ping(&self, timeout: Duration) -> Result<(), RelayError> {
        self.inner
            .client()
            .fetch_metadata(None, timeout)
            .map(|_| ())
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
