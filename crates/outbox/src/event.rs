//! What a command wants to emit: [`AggregateRef`] and [`NewEvent`], validated against the
//! record contract the relay and the consumers rely on.

use std::collections::BTreeMap;

use serde::Serialize;
use uuid::Uuid;

use crate::OutboxError;

/// Header names the relay sets itself from the outbox columns; a user header with one of these
/// names would be ambiguous on the wire, so it is rejected up front.
pub const RESERVED_HEADERS: [&str; 6] = [
    "event_id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "schema_version",
];

/// Kafka's limit on topic names; the relay routes to `outbox.event.{aggregate_type}`.
const MAX_TOPIC_LEN: usize = 249;
const TOPIC_PREFIX: &str = "outbox.event.";

/// A fresh event id: a UUIDv7, so ids sort roughly by creation time and index well.
///
/// Generate it when the command is *first* handled and keep it with the command (request log,
/// job row, idempotency key store): a retry of the same command must pass the same id to
/// [`NewEvent::with_event_id`], so that a retry after a lost commit acknowledgement hits the
/// primary key instead of emitting a second event (R4).
pub fn new_event_id() -> Uuid {
    Uuid::now_v7()
}

/// The aggregate a command changes: `(aggregate_type, aggregate_id)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AggregateRef {
    aggregate_type: String,
    aggregate_id: String,
}

impl AggregateRef {
    /// `aggregate_type` becomes part of a Kafka topic name, so it is limited to
    /// `[A-Za-z0-9._-]`; `aggregate_id` is the Kafka key and must not be empty.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
    ) -> Result<Self, OutboxError> {
        let aggregate_type = aggregate_type.into();
        let aggregate_id = aggregate_id.into();
        validate_aggregate_type(&aggregate_type)?;
        if aggregate_id.is_empty() {
            return Err(OutboxError::invalid("aggregate_id", "must not be empty"));
        }
        Ok(Self {
            aggregate_type,
            aggregate_id,
        })
    }

    pub fn aggregate_type(&self) -> &str {
        &self.aggregate_type
    }

    pub fn aggregate_id(&self) -> &str {
        &self.aggregate_id
    }
}

fn validate_aggregate_type(t: &str) -> Result<(), OutboxError> {
    if t.is_empty() {
        return Err(OutboxError::invalid("aggregate_type", "must not be empty"));
    }
    if let Some(c) = t
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(OutboxError::invalid(
            "aggregate_type",
            format!("{t:?} contains {c:?}; topic names allow only [A-Za-z0-9._-]"),
        ));
    }
    if TOPIC_PREFIX.len() + t.len() > MAX_TOPIC_LEN {
        return Err(OutboxError::invalid(
            "aggregate_type",
            format!("{t:?} makes a topic name longer than {MAX_TOPIC_LEN} characters"),
        ));
    }
    Ok(())
}

/// One event of a command, with its payload already serialised.
///
/// The payload is serialised in [`NewEvent::new`] from the in-memory value the command is about
/// to commit (R8): nothing is re-read from the database after the fact, so the event describes
/// exactly the state this transaction writes.
#[derive(Clone, Debug)]
pub struct NewEvent {
    pub(crate) event_id: Uuid,
    pub(crate) event_type: String,
    pub(crate) schema_version: i32,
    pub(crate) payload: String,
    pub(crate) headers: BTreeMap<String, String>,
}

impl NewEvent {
    /// Serialises `payload` now. `schema_version` is explicit on purpose (R7): a breaking change
    /// to a payload gets a new version (or a new `event_type`) so old consumers keep working.
    /// The event gets a fresh [`new_event_id`]; use [`NewEvent::with_event_id`] on retries.
    pub fn new<T: Serialize + ?Sized>(
        event_type: impl Into<String>,
        schema_version: i32,
        payload: &T,
    ) -> Result<Self, OutboxError> {
        let event_type = event_type.into();
        if event_type.is_empty() {
            return Err(OutboxError::invalid("event_type", "must not be empty"));
        }
        if schema_version < 1 {
            return Err(OutboxError::invalid(
                "schema_version",
                format!("{schema_version} for {event_type}; versions start at 1"),
            ));
        }
        let payload = serde_json::to_string(payload).map_err(|source| OutboxError::Serialize {
            event_type: event_type.clone(),
            source,
        })?;
        if payload == "null" {
            return Err(OutboxError::invalid(
                "payload",
                format!("{event_type} serialises to JSON null"),
            ));
        }
        Ok(Self {
            event_id: new_event_id(),
            event_type,
            schema_version,
            payload,
            headers: BTreeMap::new(),
        })
    }

    /// Reuses the id generated when the command was first handled (R4).
    pub fn with_event_id(mut self, event_id: Uuid) -> Self {
        self.event_id = event_id;
        self
    }

    /// Adds a string header the relay copies onto the Kafka record (e.g. `traceparent`).
    /// Never put credentials or personal data here: headers are as public as the payload.
    pub fn with_header(
        mut self,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<Self, OutboxError> {
        let key = key.into();
        if key.is_empty() {
            return Err(OutboxError::invalid("header", "empty header name"));
        }
        if RESERVED_HEADERS.contains(&key.as_str()) {
            return Err(OutboxError::invalid(
                "header",
                format!("{key:?} is set by the relay from the outbox columns"),
            ));
        }
        self.headers.insert(key, value.into());
        Ok(self)
    }

    pub fn event_id(&self) -> Uuid {
        self.event_id
    }

    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    pub fn schema_version(&self) -> i32 {
        self.schema_version
    }

    /// The payload JSON exactly as it will be inserted.
    pub fn payload_json(&self) -> &str {
        &self.payload
    }

    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The headers as the JSON text stored in the `headers` column (`None` when there are none).
    pub(crate) fn headers_json(&self) -> Option<String> {
        if self.headers.is_empty() {
            None
        } else {
            // A map of strings always serialises.
            Some(serde_json::to_string(&self.headers).expect("string map serialises"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregate_type_must_be_topic_safe() {
        assert!(AggregateRef::new("order", "1").is_ok());
        assert!(AggregateRef::new("billing.invoice-v2_x", "1").is_ok());
        assert!(AggregateRef::new("order/x", "1").is_err());
        assert!(AggregateRef::new("", "1").is_err());
        assert!(AggregateRef::new("order", "").is_err());
        assert!(AggregateRef::new("a".repeat(240), "1").is_err());
    }

    #[test]
    fn new_event_serialises_now_and_checks_versions() {
        let mut v = serde_json::json!({"total": 10});
        let e = NewEvent::new("OrderPaid", 2, &v).unwrap();
        v["total"] = 99.into(); // later mutation does not leak into the event
        assert_eq!(e.payload_json(), r#"{"total":10}"#);
        assert_eq!(e.schema_version(), 2);
        assert_eq!(e.event_id().get_version_num(), 7);
        assert!(NewEvent::new("OrderPaid", 0, &v).is_err());
        assert!(NewEvent::new("", 1, &v).is_err());
        assert!(NewEvent::new("X", 1, &serde_json::Value::Null).is_err());
    }

    #[test]
    fn reserved_headers_are_rejected() {
        let e = NewEvent::new("X", 1, &1).unwrap();
        assert!(e.clone().with_header("event_id", "x").is_err());
        let e = e.with_header("traceparent", "00-abc").unwrap();
        assert_eq!(e.headers_json().unwrap(), r#"{"traceparent":"00-abc"}"#);
    }

    #[test]
    fn caller_supplied_id_is_kept() {
        let id = new_event_id();
        let e = NewEvent::new("X", 1, &1).unwrap().with_event_id(id);
        assert_eq!(e.event_id(), id);
    }
}
