//! [`Envelope`]: a Kafka record produced by outboxd, parsed back into the outbox row it came
//! from. The wire contract: key = `aggregate_id`, value = payload JSON, timestamp = the outbox
//! row's `created_at`, string headers `event_id`, `event_type`, `aggregate_type`,
//! `aggregate_id`, `aggregate_version`, `schema_version` plus the row's extra headers. Records
//! in outboxd's CloudEvents format are read too (`cloudevent`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use rdkafka::message::{Headers, Message};
use serde::de::DeserializeOwned;
use uuid::Uuid;

/// Where a record was read from, for logs and diagnosis only (R37: never a version).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordSource {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

/// One integration event as the consumer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_version: i64,
    pub schema_version: i32,
    /// The payload JSON text as committed by the producer.
    pub payload: Vec<u8>,
    /// Headers beyond the six protocol ones (e.g. `traceparent`).
    pub headers: BTreeMap<String, String>,
    /// Producer commit time (record timestamp = outbox `created_at`), if the record has one.
    pub committed_at: Option<DateTime<Utc>>,
    pub source: Option<RecordSource>,
}

/// A record that does not follow the protocol. Deterministic: retrying cannot help, and the
/// record must never be committed past silently (the consumer stops on it).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("record has no `{0}` header")]
    MissingHeader(&'static str),
    #[error("header `{name}` is invalid: {reason}")]
    InvalidHeader { name: String, reason: String },
    #[error("record has no payload")]
    MissingPayload,
    #[error("record key {key:?} differs from the aggregate_id header {aggregate_id:?}")]
    KeyMismatch { key: String, aggregate_id: String },
    /// A protocol header appears twice: which one is the event's identity is ambiguous (a
    /// producer appending a spoofed `event_id` after the real one), so the record is refused.
    #[error("record carries the `{0}` header more than once")]
    DuplicateHeader(&'static str),
}

const PROTOCOL_HEADERS: [&str; 6] = [
    "event_id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "schema_version",
];

impl Envelope {
    /// Parses a record. A missing `event_id` (or any protocol header) is an error, never a
    /// record to skip: without it the consumer cannot deduplicate (R2, R18).
    pub fn from_message<M: Message>(msg: &M) -> Result<Self, EnvelopeError> {
        // outboxd's CloudEvents format (either content mode): deduplicated on the `id`.
        if let Some(ce) = crate::cloudevent::parse(msg) {
            return ce;
        }
        let mut protocol: [Option<String>; 6] = Default::default();
        let mut headers = BTreeMap::new();
        if let Some(hs) = msg.headers() {
            for h in hs.iter() {
                let value = match h.value {
                    Some(v) => std::str::from_utf8(v)
                        .map_err(|_| EnvelopeError::InvalidHeader {
                            name: h.key.to_string(),
                            reason: "not UTF-8".into(),
                        })?
                        .to_string(),
                    None => String::new(),
                };
                match PROTOCOL_HEADERS.iter().position(|p| *p == h.key) {
                    Some(i) if protocol[i].is_some() => {
                        return Err(EnvelopeError::DuplicateHeader(PROTOCOL_HEADERS[i]))
                    }
                    Some(i) => protocol[i] = Some(value),
                    None => {
                        headers.insert(h.key.to_string(), value);
                    }
                }
            }
        }
        let [event_id, event_type, aggregate_type, aggregate_id, aggregate_version, schema_version] =
            protocol;
        let need = |v: Option<String>, name: &'static str| {
            v.filter(|s| !s.is_empty())
                .ok_or(EnvelopeError::MissingHeader(name))
        };
        let event_id = need(event_id, "event_id")?;
        let event_id = Uuid::parse_str(&event_id).map_err(|e| EnvelopeError::InvalidHeader {
            name: "event_id".into(),
            reason: e.to_string(),
        })?;
        let aggregate_id = need(aggregate_id, "aggregate_id")?;
        let aggregate_version = parse_num::<i64>(need(aggregate_version, "aggregate_version")?)
            .map_err(|reason| EnvelopeError::InvalidHeader {
                name: "aggregate_version".into(),
                reason,
            })?;
        let schema_version =
            parse_num::<i32>(need(schema_version, "schema_version")?).map_err(|reason| {
                EnvelopeError::InvalidHeader {
                    name: "schema_version".into(),
                    reason,
                }
            })?;
        if let Some(key) = msg.key() {
            if key != aggregate_id.as_bytes() {
                return Err(EnvelopeError::KeyMismatch {
                    key: String::from_utf8_lossy(key).into_owned(),
                    aggregate_id,
                });
            }
        }
        // No value: a tombstone (a NULL payload under `on_null_payload = "tombstone"`, what
        // Debezium sends to delete an aggregate's state). An event like the others for
        // deduplication and ordering, never poison; its payload is empty.
        let payload = msg.payload().map(<[u8]>::to_vec).unwrap_or_default();
        let committed_at = msg
            .timestamp()
            .to_millis()
            .and_then(DateTime::<Utc>::from_timestamp_millis);
        Ok(Self {
            event_id,
            event_type: need(event_type, "event_type")?,
            aggregate_type: need(aggregate_type, "aggregate_type")?,
            aggregate_id,
            aggregate_version,
            schema_version,
            payload,
            headers,
            committed_at,
            source: Some(RecordSource {
                topic: msg.topic().to_string(),
                partition: msg.partition(),
                offset: msg.offset(),
            }),
        })
    }

    /// A record with no value (see [`Envelope::from_message`]): the relay sends a NULL payload
    /// that way under `policy.on_null_payload = "tombstone"`. Its payload is empty, never JSON.
    pub fn is_tombstone(&self) -> bool {
        self.payload.is_empty()
    }

    /// Deserialises the payload. Handlers should branch on `schema_version` first (R7).
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    /// Delay between the producer's commit and now, if the record carried a timestamp.
    pub fn commit_to_consume_delay(&self, now: DateTime<Utc>) -> Option<std::time::Duration> {
        self.committed_at.and_then(|c| (now - c).to_std().ok())
    }
}

fn parse_num<T: std::str::FromStr>(s: String) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    s.parse::<T>().map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};

    fn record(headers: &[(&str, &str)], key: Option<&str>) -> OwnedMessage {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(*v),
            });
        }
        OwnedMessage::new(
            Some(br#"{"total":5}"#.to_vec()),
            key.map(|k| k.as_bytes().to_vec()),
            "outbox.event.order".into(),
            Timestamp::CreateTime(1_700_000_000_000),
            3,
            42,
            Some(h),
        )
    }

    const ID: &str = "0190f1c2-7a3b-7cde-8f00-0123456789ab";

    fn full() -> Vec<(&'static str, &'static str)> {
        vec![
            ("event_id", ID),
            ("event_type", "OrderPaid"),
            ("aggregate_type", "order"),
            ("aggregate_id", "o-1"),
            ("aggregate_version", "7"),
            ("schema_version", "2"),
            ("traceparent", "00-abc"),
        ]
    }

    #[test]
    fn parses_a_relay_record() {
        let env = Envelope::from_message(&record(&full(), Some("o-1"))).unwrap();
        assert_eq!(env.event_id.to_string(), ID);
        assert_eq!(env.aggregate_version, 7);
        assert_eq!(env.schema_version, 2);
        assert_eq!(env.headers.get("traceparent").unwrap(), "00-abc");
        assert_eq!(env.headers.len(), 1);
        assert_eq!(
            env.committed_at.unwrap().timestamp_millis(),
            1_700_000_000_000
        );
        assert_eq!(env.source.as_ref().unwrap().offset, 42);
        let v: serde_json::Value = env.payload_as().unwrap();
        assert_eq!(v["total"], 5);
    }

    #[test]
    fn a_binary_payload_is_handed_through_as_its_bytes() {
        // A bytea outbox (issue 46): registry-framed Avro, NUL and 0xff included.
        let bytes = vec![0, 0, 0, 0, 1, 0xff, 0, 0x80];
        let mut m = record(&full(), Some("o-1"));
        m = OwnedMessage::new(
            Some(bytes.clone()),
            m.key().map(<[u8]>::to_vec),
            m.topic().into(),
            m.timestamp(),
            m.partition(),
            m.offset(),
            m.headers().cloned(),
        );
        let env = Envelope::from_message(&m).unwrap();
        assert_eq!(env.payload, bytes);
        assert!(!env.is_tombstone());
        assert!(env.payload_as::<serde_json::Value>().is_err());
    }

    #[test]
    fn missing_event_id_is_a_typed_error() {
        let hs: Vec<_> = full().into_iter().filter(|h| h.0 != "event_id").collect();
        assert_eq!(
            Envelope::from_message(&record(&hs, Some("o-1"))),
            Err(EnvelopeError::MissingHeader("event_id"))
        );
        let mut hs = full();
        hs[0].1 = "not-a-uuid";
        assert!(matches!(
            Envelope::from_message(&record(&hs, Some("o-1"))),
            Err(EnvelopeError::InvalidHeader { name, .. }) if name == "event_id"
        ));
    }

    #[test]
    fn bad_version_and_key_mismatch_are_rejected() {
        let mut hs = full();
        hs[4].1 = "seven";
        assert!(Envelope::from_message(&record(&hs, Some("o-1"))).is_err());
        assert!(matches!(
            Envelope::from_message(&record(&full(), Some("o-2"))),
            Err(EnvelopeError::KeyMismatch { .. })
        ));
    }

    #[test]
    fn a_protocol_header_twice_is_refused() {
        // A row's headers appended after the relay's: the inbox must not take the last one.
        for name in PROTOCOL_HEADERS {
            let mut hs = full();
            hs.push((name, "00000000-0000-0000-0000-000000000000"));
            assert_eq!(
                Envelope::from_message(&record(&hs, Some("o-1"))),
                Err(EnvelopeError::DuplicateHeader(name)),
                "{name}"
            );
        }
    }

    #[test]
    fn a_record_without_value_is_a_tombstone_not_poison() {
        let m = OwnedMessage::new(
            None,
            Some(b"o-1".to_vec()),
            "t".into(),
            Timestamp::CreateTime(1_700_000_000_000),
            0,
            42,
            Some(full().iter().fold(OwnedHeaders::new(), |h, (k, v)| {
                h.insert(Header {
                    key: k,
                    value: Some(*v),
                })
            })),
        );
        let env = Envelope::from_message(&m).unwrap();
        assert!(env.is_tombstone());
    }
}
