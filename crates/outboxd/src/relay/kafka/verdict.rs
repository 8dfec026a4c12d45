//! The one acknowledgement type of the relay: where a record came from ([`Origin`]) and what the
//! broker (or librdkafka, refusing it synchronously) said about it ([`Verdict`]), classified
//! once, here, where librdkafka's result is read. Everything downstream branches on the
//! verdict and never looks at an error code again.

use crate::poison::policy;
use crate::poison::record::ParkedRecord;
use crate::relay::ack::Seq;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Headers, Message};

/// Where an acknowledged record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// An event of the replication stream, by its sequence number in the ack tracker.
    Stream(Seq),
    /// A parked event republished after an operator's repair, by its `outbox_parked` id.
    Release(i64),
    /// No one record: the Kafka transaction (`relay.broker_fencing`) that did not commit. Its
    /// failure ends the session even when none of its records was reported on.
    Transaction,
}

/// librdkafka carries one integer per record; its top bit tells a release from a stream event.
const RELEASE_BIT: usize = 1 << (usize::BITS - 1);

impl Origin {
    pub(super) fn to_opaque(self) -> usize {
        match self {
            Self::Stream(seq) => seq as usize & !RELEASE_BIT,
            Self::Release(id) => RELEASE_BIT | id as usize,
            // Never handed to librdkafka (nothing is produced under it).
            Self::Transaction => usize::MAX,
        }
    }

    pub(super) fn from_opaque(o: usize) -> Self {
        if o & RELEASE_BIT != 0 {
            Self::Release((o & !RELEASE_BIT) as i64)
        } else {
            Self::Stream(o as Seq)
        }
    }
}

/// What became of one record.
#[derive(Debug)]
pub enum Verdict {
    /// The broker acknowledged it (`acks=all`).
    Delivered,
    /// Retrying can fix it: the session restarts from the slot and produces the same record.
    Retriable {
        event_id: String,
        /// librdkafka's error code name, for the message.
        code: String,
        /// Bounded label for metrics.
        class: &'static str,
        /// Redacted.
        message: String,
    },
    /// Retrying cannot fix it (too large, invalid, not authorised for the topic): park or halt,
    /// per the event type's policy.
    Rejected {
        class: &'static str,
        /// Redacted.
        message: String,
        /// The record as it was sent, to park it byte for byte.
        record: ParkedRecord,
    },
}

/// The broker's verdict on one record.
#[derive(Debug)]
pub struct Ack {
    pub origin: Origin,
    pub verdict: Verdict,
    /// When outboxd learned the verdict (unix µs): the commit→ack histogram is fed with this,
    /// not with the moment the session's thread gets to the acknowledgement (it may be in a
    /// pause of `relay::gulp` then).
    pub at_us: i64,
}

impl Ack {
    /// A verdict learned now.
    pub fn now(origin: Origin, verdict: Verdict) -> Self {
        Self {
            origin,
            verdict,
            at_us: crate::obs::now_us(),
        }
    }
}

/// Classifies a failure: deterministic codes ([`policy::is_deterministic`]) are rejected, with
/// the record captured (only then: it copies the payload); everything else may be retried.
pub(super) fn classify(
    code: Option<RDKafkaErrorCode>,
    event_id: String,
    message: String,
    record: impl FnOnce() -> ParkedRecord,
) -> Verdict {
    match code {
        Some(c) if policy::is_deterministic(c) => {
            let (class, record) = (policy::class_of(c), record());
            Verdict::Rejected {
                message: super::too_large::explain(class, message, &record),
                class,
                record,
            }
        }
        _ => Verdict::Retriable {
            event_id,
            code: code
                .map(|c| format!("{c:?}"))
                .unwrap_or_else(|| "Unknown".into()),
            class: code.map(policy::class_of).unwrap_or("delivery"),
            message,
        },
    }
}

/// Copies a failed record out of librdkafka so it can be parked byte for byte.
pub(super) fn capture(m: &rdkafka::message::BorrowedMessage<'_>) -> ParkedRecord {
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
                            h.value.map(|v| String::from_utf8_lossy(v).into_owned()),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default(),
        timestamp_ms: m.timestamp().to_millis(),
    }
}

/// A header of a record librdkafka hands back, as text (`?` when absent or not UTF-8).
pub(super) fn header_str<'a>(m: &'a rdkafka::message::BorrowedMessage<'a>, name: &str) -> &'a str {
    m.headers()
        .and_then(|h| h.iter().find(|h| h.key == name))
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
        .unwrap_or("?")
}

/// The class of an error librdkafka reports about its broker connections (bounded metric label):
/// `auth` (SASL refused: credentials, mechanism), `tls` (handshake, certificate), `down` (all
/// brokers unreachable), `transport` (one connection failed), `other`.
///
/// Each is transient for a running relay: librdkafka keeps reconnecting with backoff and the
/// events wait (credentials get rotated, certificates renewed).
pub fn broker_error_class(code: Option<RDKafkaErrorCode>) -> &'static str {
    use RDKafkaErrorCode as C;
    match code {
        Some(C::Authentication | C::SaslAuthenticationFailed | C::UnsupportedSASLMechanism) => {
            "auth"
        }
        Some(C::SSL) => "tls",
        Some(C::AllBrokersDown) => "down",
        Some(C::BrokerTransportFailure | C::Resolve | C::OperationTimedOut) => "transport",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_survive_librdkafkas_opaque() {
        for o in [
            Origin::Stream(0),
            Origin::Stream(123_456_789),
            Origin::Release(1),
            Origin::Release(i64::from(u32::MAX) * 7),
        ] {
            assert_eq!(Origin::from_opaque(o.to_opaque()), o);
        }
    }

    #[test]
    fn failures_are_classified_once() {
        let rec = || ParkedRecord {
            event_id: "e".into(),
            ..Default::default()
        };
        match classify(
            Some(RDKafkaErrorCode::MessageSizeTooLarge),
            "e".into(),
            "too big".into(),
            rec,
        ) {
            Verdict::Rejected { class, record, .. } => {
                assert_eq!(class, "too_large");
                assert_eq!(record.event_id, "e");
            }
            v => panic!("{v:?}"),
        }
        let v = classify(
            Some(RDKafkaErrorCode::RequestTimedOut),
            "e".into(),
            "slow".into(),
            || unreachable!("a retriable failure captures nothing"),
        );
        assert!(matches!(v, Verdict::Retriable { .. }), "{v:?}");
    }
}
