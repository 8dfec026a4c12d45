//! outboxd's CloudEvents records (`[sink] format = "cloudevents"`, issue 42) read back into an
//! [`Envelope`], so one inbox consumes either format and deduplicates on the CloudEvent `id`
//! (= the outbox `event_id`).
//!
//! Binary mode: `ce_*` headers, the payload as the value. Structured mode: the value is the
//! `application/cloudevents+json` envelope. The mapping is outboxd's: `id` → event_id, `type`
//! → event_type (the inbox dispatches on the CloudEvent's type, template applied), `subject` →
//! aggregate_id (and the key), extensions `aggregatetype`, `aggregateversion`,
//! `schemaversion`; `time` → committed_at; other headers and extensions → `headers`.

use crate::envelope::{Envelope, EnvelopeError, RecordSource};
use base64::Engine as _;
use chrono::{DateTime, Utc};
use rdkafka::message::{Headers, Message};
use std::collections::BTreeMap;
use uuid::Uuid;

/// The attributes consumed into the envelope's own fields (not kept in `headers`).
const OWN: [&str; 12] = [
    "specversion",
    "id",
    "type",
    "source",
    "subject",
    "time",
    "datacontenttype",
    "partitionkey",
    "aggregatetype",
    "aggregateversion",
    "schemaversion",
    "dataschema",
];

/// `Some` when the record is a CloudEvent (a `ce_specversion` header, or a structured
/// `content-type`), parsed; `None`: an outbox-format record.
pub fn parse<M: Message>(msg: &M) -> Option<Result<Envelope, EnvelopeError>> {
    let mut headers: Vec<(String, String)> = Vec::new();
    if let Some(hs) = msg.headers() {
        for h in hs.iter() {
            let v = match h.value.map(std::str::from_utf8) {
                Some(Err(_)) => {
                    return Some(Err(EnvelopeError::InvalidHeader {
                        name: h.key.to_string(),
                        reason: "not UTF-8".into(),
                    }))
                }
                Some(Ok(v)) => v.to_string(),
                None => String::new(),
            };
            headers.push((h.key.to_string(), v));
        }
    }
    let binary = headers.iter().any(|(k, _)| k == "ce_specversion");
    let structured = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("content-type") && v.starts_with("application/cloudevents+json")
    });
    if !binary && !structured {
        return None;
    }
    Some(if binary {
        from_binary(msg, headers)
    } else {
        from_structured(msg, headers)
    })
}

fn invalid(name: &str, reason: impl Into<String>) -> EnvelopeError {
    EnvelopeError::InvalidHeader {
        name: name.into(),
        reason: reason.into(),
    }
}

fn from_binary<M: Message>(
    msg: &M,
    headers: Vec<(String, String)>,
) -> Result<Envelope, EnvelopeError> {
    let mut attrs = BTreeMap::new();
    let mut rest = BTreeMap::new();
    for (k, v) in headers {
        match k.strip_prefix("ce_") {
            Some(a) => {
                if attrs.insert(a.to_string(), v).is_some() && a == "id" {
                    return Err(EnvelopeError::DuplicateHeader("ce_id"));
                }
            }
            None if k.eq_ignore_ascii_case("content-type") => {}
            None => {
                rest.insert(k, v);
            }
        }
    }
    let payload = msg.payload().map(<[u8]>::to_vec).unwrap_or_default();
    build(msg, attrs, rest, payload)
}

fn from_structured<M: Message>(
    msg: &M,
    headers: Vec<(String, String)>,
) -> Result<Envelope, EnvelopeError> {
    let value: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(msg.payload().ok_or(EnvelopeError::MissingPayload)?)
            .map_err(|e| invalid("value", format!("not a CloudEvents JSON envelope: {e}")))?;
    let mut attrs = BTreeMap::new();
    let mut payload = Vec::new();
    for (k, v) in value {
        match (k.as_str(), v) {
            ("data", v) => payload = serde_json::to_vec(&v).unwrap_or_default(),
            ("data_base64", serde_json::Value::String(b)) => {
                payload = base64::engine::general_purpose::STANDARD
                    .decode(b)
                    .map_err(|e| invalid("data_base64", e.to_string()))?
            }
            (_, serde_json::Value::String(s)) => {
                attrs.insert(k, s);
            }
            (_, other) => {
                attrs.insert(k, other.to_string());
            }
        }
    }
    let rest = headers
        .into_iter()
        .filter(|(k, _)| !k.eq_ignore_ascii_case("content-type"))
        .collect();
    build(msg, attrs, rest, payload)
}

fn build<M: Message>(
    msg: &M,
    mut attrs: BTreeMap<String, String>,
    mut rest: BTreeMap<String, String>,
    payload: Vec<u8>,
) -> Result<Envelope, EnvelopeError> {
    let need = |attrs: &BTreeMap<String, String>, name: &'static str| {
        attrs
            .get(name)
            .filter(|s| !s.is_empty())
            .cloned()
            .ok_or(EnvelopeError::MissingHeader(name))
    };
    let event_id =
        Uuid::parse_str(&need(&attrs, "id")?).map_err(|e| invalid("id", e.to_string()))?;
    let aggregate_id = need(&attrs, "subject")?;
    let num = |name: &'static str| -> Result<i64, EnvelopeError> {
        need(&attrs, name)?
            .parse::<i64>()
            .map_err(|e| invalid(name, e.to_string()))
    };
    let aggregate_version = num("aggregateversion")?;
    let schema_version = match attrs.get("schemaversion") {
        Some(_) => i32::try_from(num("schemaversion")?)
            .map_err(|e| invalid("schemaversion", e.to_string()))?,
        None => 1,
    };
    if let Some(key) = msg.key() {
        if key != aggregate_id.as_bytes() {
            return Err(EnvelopeError::KeyMismatch {
                key: String::from_utf8_lossy(key).into_owned(),
                aggregate_id,
            });
        }
    }
    let committed_at = attrs
        .get("time")
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc))
        .or_else(|| {
            msg.timestamp()
                .to_millis()
                .and_then(DateTime::<Utc>::from_timestamp_millis)
        });
    let event_type = need(&attrs, "type")?;
    let aggregate_type = need(&attrs, "aggregatetype")?;
    for own in OWN {
        attrs.remove(own);
    }
    // Extensions outboxd carried (trace context, placed columns) are the row's headers.
    for (k, v) in attrs {
        rest.entry(k).or_insert(v);
    }
    Ok(Envelope {
        event_id,
        event_type,
        aggregate_type,
        aggregate_id,
        aggregate_version,
        schema_version,
        payload,
        headers: rest,
        committed_at,
        source: Some(RecordSource {
            topic: msg.topic().to_string(),
            partition: msg.partition(),
            offset: msg.offset(),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};

    const ID: &str = "0190f1c2-7a3b-7cde-8f00-0123456789ab";

    fn msg(headers: &[(&str, &str)], value: &[u8]) -> OwnedMessage {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(*v),
            });
        }
        OwnedMessage::new(
            Some(value.to_vec()),
            Some(b"o-1".to_vec()),
            "outbox.event.order".into(),
            Timestamp::CreateTime(1_700_000_000_000),
            0,
            7,
            Some(h),
        )
    }

    #[test]
    fn binary_and_structured_read_alike() {
        let b = msg(
            &[
                ("ce_specversion", "1.0"),
                ("ce_id", ID),
                ("ce_source", "/outboxd/app/public/outbox"),
                ("ce_type", "OrderPaid"),
                ("ce_subject", "o-1"),
                ("ce_time", "2026-12-02T12:00:00.123456Z"),
                ("content-type", "application/json"),
                ("ce_partitionkey", "o-1"),
                ("ce_aggregatetype", "order"),
                ("ce_aggregateversion", "4"),
                ("ce_schemaversion", "2"),
                ("ce_traceparent", "00-ab"),
                ("tenant_id", "t1"),
            ],
            br#"{"total":5}"#,
        );
        let s = msg(
            &[
                ("content-type", "application/cloudevents+json; charset=UTF-8"),
                ("tenant_id", "t1"),
            ],
            format!(
                r#"{{"specversion":"1.0","id":"{ID}","source":"/x","type":"OrderPaid","subject":"o-1","time":"2026-12-02T12:00:00.123456Z","datacontenttype":"application/json","partitionkey":"o-1","aggregatetype":"order","aggregateversion":"4","schemaversion":"2","traceparent":"00-ab","data":{{"total":5}}}}"#
            )
            .as_bytes(),
        );
        let (b, s) = (
            Envelope::from_message(&b).unwrap(),
            Envelope::from_message(&s).unwrap(),
        );
        for e in [&b, &s] {
            assert_eq!(e.event_id.to_string(), ID);
            assert_eq!(e.event_type, "OrderPaid");
            assert_eq!(e.aggregate_type, "order");
            assert_eq!(e.aggregate_id, "o-1");
            assert_eq!(e.aggregate_version, 4);
            assert_eq!(e.schema_version, 2);
            assert_eq!(e.payload, br#"{"total":5}"#);
            assert_eq!(
                e.headers.get("traceparent").map(String::as_str),
                Some("00-ab")
            );
            assert_eq!(e.headers.get("tenant_id").map(String::as_str), Some("t1"));
            assert_eq!(
                e.committed_at.unwrap().timestamp_micros(),
                1_796_212_800_123_456
            );
        }
    }

    #[test]
    fn a_cloudevent_without_an_id_is_refused() {
        let b = msg(&[("ce_specversion", "1.0"), ("ce_subject", "o-1")], b"{}");
        assert_eq!(
            Envelope::from_message(&b).unwrap_err(),
            EnvelopeError::MissingHeader("id")
        );
    }
}
