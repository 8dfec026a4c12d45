//! The one acknowledgement type of the relay: where a record came from ([`Origin`]) and what the
//! broker (or librdkafka, refusing it synchronously) said about it ([`Verdict`]), classified
//! once, here, where librdkafka's result is read. Everything downstream branches on the
//! verdict and never looks at an error code again.

use crate::poison::policy;
use crate::poison::record::ParkedRecord;
use crate::relay::ack::Seq;
use rdkafka::error::RDKafkaErrorCode;

/// Where an acknowledged record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// An event of the replication stream, by its sequence number in the ack tracker.
    Stream(Seq),
    /// A parked event republished after an operator's repair, by its `outbox_parked` id.
    Release(i64),
}

/// librdkafka carries one integer per record; its top bit tells a release from a stream event.
const RELEASE_BIT: usize = 1 << (usize::BITS - 1);

impl Origin {
    pub(super) fn to_opaque(self) -> usize {
        match self {
            Self::Stream(seq) => seq as usize & !RELEASE_BIT,
            Self::Release(id) => RELEASE_BIT | id as usize,
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
        Some(c) if policy::is_deterministic(c) => Verdict::Rejected {
            class: policy::class_of(c),
            message,
            record: record(),
        },
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
