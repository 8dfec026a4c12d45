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
    pub code: String,
    pub message: String,
}

/// Routes librdkafka's callbacks: delivery reports to the ack channel, logs to `tracing`.
pub struct Ctx {
    acks: mpsc::UnboundedSender<Ack>,
}

impl ClientContext for Ctx {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
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
        tracing::warn!(target: "librdkafka", error = %error, "{reason}");
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
                        topic = m.topic(),
                        partition = m.partition(),
                        offset = m.offset(),
                        "delivered"
                    );
                }
                Ok(())
            }
            Err((e, m)) => {
                let code = e
                    .rdkafka_error_code()
                    .map(|c| format!("{c:?}"))
                    .unwrap_or_else(|| "Unknown".into());
                let f = DeliveryFailure {
                    event_id: header_str(m, "event_id").to_string(),
                    code,
                    message: e.to_string(),
                };
                tracing::warn!(
                    event_id = %f.event_id,
                    aggregate_id = header_str(m, "aggregate_id"),
                    aggregate_version = header_str(m, "aggregate_version"),
                    event_type = header_str(m, "event_type"),
                    topic = m.topic(),
                    code = %f.code,
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
        .set("client.id", "outboxd");
    for (k, v) in &cfg.sink.kafka {
        cc.set(k, v);
    }
    // Required for the delivery guarantee (config validation rejects contrary settings):
    cc.set("enable.idempotence", "true").set("acks", "all");
    cc.set_log_level(RDKafkaLogLevel::Warning);
    cc
}

pub struct Producer {
    inner: ThreadedProducer<Ctx>,
    headers_cap: usize,
}

impl Producer {
    pub fn new(cfg: &Config) -> Result<(Self, mpsc::UnboundedReceiver<Ack>), RelayError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let inner: ThreadedProducer<Ctx> = client_config(cfg)
            .create_with_context(Ctx { acks: tx })
            .map_err(|e| RelayError::Kafka(format!("cannot create producer: {e}")))?;
        Ok((
            Self {
                inner,
                headers_cap: 8,
            },
            rx,
        ))
    }

    /// Enqueues one record. Waits (asynchronously) while librdkafka's local queue is full;
    /// any other immediate error is returned (the event has no sequence number yet).
    pub async fn send(&self, topic: &str, e: &Event<'_>, seq: Seq) -> Result<(), RelayError> {
        let mut headers = OwnedHeaders::new_with_capacity(self.headers_cap);
        e.for_each_header(|k, v| {
            headers = std::mem::take(&mut headers).insert(Header {
                key: k,
                value: Some(v),
            });
        })?;
        let mut record = BaseRecord::with_opaque_to(topic, seq as usize)
            .key(e.aggregate_id)
            .payload(e.payload)
            .headers(headers);
        if let Some(ts) = e.created_at_ms {
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
                    return Err(RelayError::Delivery {
                        event_id: e.event_id.to_string(),
                        code: err
                            .rdkafka_error_code()
                            .map(|c| format!("{c:?}"))
                            .unwrap_or_default(),
                        message: err.to_string(),
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
            .map_err(|e| RelayError::Kafka(format!("broker unreachable: {e}")))
    }
}
