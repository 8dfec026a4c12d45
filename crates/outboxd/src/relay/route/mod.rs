//! Router: one decoded outbox row → one Kafka record (topic, key, value, headers, timestamp).
//!
//! The mapping from the table's columns to event fields is resolved once per Relation message,
//! so a schema change mid-stream is picked up, and a required column that disappears is a
//! definite error raised before anything past it is produced or confirmed.

mod additional;
pub(crate) mod cloudevents;
pub(crate) mod release;
mod time;

use crate::model::columns::ColumnNames;
use crate::model::route::{is_reserved_header, RouteError};
use crate::relay::pgoutput::{Relation, Value};
use additional::Render;
use std::borrow::Cow;
use std::sync::Arc;
pub use time::parse_timestamptz_ms;

pub use crate::model::route::CONTENT_TYPE_HEADER;

/// Where each event field sits in the tuple of the current Relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowMapping {
    event_id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: usize,
    payload: usize,
    aggregate_version: Option<usize>,
    schema_version: Option<usize>,
    headers: Option<usize>,
    created_at: Option<usize>,
    /// What the payload column holds, from its type in the Relation (decided once here).
    payload_kind: PayloadKind,
    /// `content-type` header of every record (see [`ColumnNames::content_type`]).
    content_type: Option<Arc<str>>,
    /// Send header `id` too (see [`ColumnNames::id_header`]).
    id_header: bool,
    /// A NULL aggregate id or event type is allowed (see [`ColumnNames::debezium_nulls`]).
    debezium_nulls: bool,
    /// Columns placed into headers, in the configured order.
    additional: Vec<Placed>,
    /// Records are CloudEvents (`[sink] format = "cloudevents"`).
    cloudevents: Option<Arc<crate::model::cloudevents::CloudEvents>>,
}

/// One column of `[source.columns] additional`, resolved against the Relation.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Placed {
    index: usize,
    column: String,
    header: Arc<str>,
    render: Render,
}

/// What the payload column holds, decided once per Relation from the column's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadKind {
    /// json or jsonb: Postgres guarantees JSON; published as its text.
    Json,
    /// text-like: each value is checked to be JSON (the inbox parses it).
    Text,
    /// bytea: published as exactly its bytes (Avro, Protobuf, any registry framing), decoded
    /// from pgoutput's text output by [`crate::model::bytea::decode`].
    Bytes,
}

/// Postgres type OIDs of the payload column that matter here.
const JSON_OID: u32 = 114;
const JSONB_OID: u32 = 3802;
const BYTEA_OID: u32 = 17;

/// Hyphenated (Postgres's uuid output, any case) or 32 hex digits: what the inbox parses.
pub fn is_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    match b.len() {
        32 => b.iter().all(u8::is_ascii_hexdigit),
        36 => b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        }),
        _ => false,
    }
}

impl RowMapping {
    /// Resolves configured column names against a Relation. Required columns must exist;
    /// optional ones that are absent are simply not emitted (reported in `missing_optional`).
    pub fn resolve(
        names: &ColumnNames,
        rel: &Relation,
        missing_optional: &mut Vec<String>,
    ) -> Result<Self, RouteError> {
        let find = |n: &str| rel.columns.iter().position(|c| c.name == n);
        let req = |n: &String, key: &'static str| {
            find(n).ok_or_else(|| RouteError::MissingColumn {
                table: format!("{}.{}", rel.namespace, rel.name),
                column: n.clone(),
                key,
            })
        };
        let mut opt = |n: &Option<String>| match n {
            None => None,
            Some(n) => {
                let p = find(n);
                if p.is_none() {
                    missing_optional.push(n.clone());
                }
                p
            }
        };
        let table = || format!("{}.{}", rel.namespace, rel.name);
        let additional = names
            .additional
            .iter()
            .map(|p| {
                let index = req(&p.column, "additional")?;
                let col = &rel.columns[index];
                let render =
                    Render::for_type(col.type_oid, col.type_modifier).ok_or_else(|| {
                        RouteError::UnsupportedHeaderColumn {
                            table: table(),
                            column: p.column.clone(),
                            type_name: additional::type_name(col.type_oid).into_owned(),
                        }
                    })?;
                Ok(Placed {
                    index,
                    column: p.column.clone(),
                    header: p.header.clone(),
                    render,
                })
            })
            .collect::<Result<Vec<_>, RouteError>>()?;
        let payload = req(&names.payload, "payload")?;
        let payload_type = rel.columns[payload].type_oid;
        let payload_kind = match payload_type {
            JSON_OID | JSONB_OID => PayloadKind::Json,
            BYTEA_OID => PayloadKind::Bytes,
            _ => PayloadKind::Text,
        };
        Ok(Self {
            payload_kind,
            content_type: names.content_type.clone(),
            id_header: names.id_header,
            debezium_nulls: names.debezium_nulls,
            additional,
            cloudevents: names.cloudevents.clone(),
            event_id: req(&names.event_id, "event_id")?,
            aggregate_type: req(&names.aggregate_type, "aggregate_type")?,
            aggregate_id: req(&names.aggregate_id, "aggregate_id")?,
            event_type: req(&names.event_type, "event_type")?,
            payload,
            aggregate_version: opt(&names.aggregate_version),
            schema_version: opt(&names.schema_version),
            headers: opt(&names.headers),
            created_at: opt(&names.created_at),
        })
    }

    /// What the payload column holds (bytea tables publish bytes, not JSON).
    pub fn payload_kind(&self) -> PayloadKind {
        self.payload_kind
    }

    /// The table's `content_type` (the `content-type` header; CloudEvents' `datacontenttype`).
    #[allow(dead_code)] // for the CloudEvents format (issue 42)
    pub fn content_type(&self) -> Option<&Arc<str>> {
        self.content_type.as_ref()
    }

    /// The payload's bytes: borrowed for text and JSON, decoded for bytea.
    fn payload_bytes<'a>(&self, text: &'a [u8]) -> Result<Cow<'a, [u8]>, RouteError> {
        match self.payload_kind {
            PayloadKind::Bytes => crate::model::bytea::decode(text)
                .map(Cow::Owned)
                .map_err(|e| RouteError::BadBytea(e.to_string())),
            PayloadKind::Text => {
                serde_json::from_slice::<serde::de::IgnoredAny>(text)
                    .map_err(|e| RouteError::PayloadNotJson(e.to_string()))?;
                Ok(Cow::Borrowed(text))
            }
            PayloadKind::Json => Ok(Cow::Borrowed(text)),
        }
    }

    /// Extracts the event fields from a decoded tuple, borrowing the bytes.
    pub fn event<'a>(&self, vals: &[Value<'a>]) -> Result<Event<'a>, RouteError> {
        let bytes = |i: usize, f: &'static str| match vals.get(i) {
            Some(Value::Text(t)) => Ok(*t),
            _ => Err(RouteError::NullField(f)),
        };
        let text = |i: usize, f: &'static str| {
            std::str::from_utf8(bytes(i, f)?).map_err(|_| RouteError::NotUtf8(f))
        };
        let opt_text = |i: Option<usize>, f: &'static str| match i {
            Some(i) if matches!(vals.get(i), Some(Value::Text(_))) => text(i, f).map(Some),
            _ => Ok(None),
        };
        // NULL where Debezium's EventRouter needs no value (the key, the unused type).
        let nullable = |i: usize, f: &'static str| match vals.get(i) {
            Some(Value::Null) if self.debezium_nulls => Ok(None),
            _ => text(i, f).map(Some),
        };
        let event_id = text(self.event_id, "event_id")?;
        if !is_uuid(event_id) {
            return Err(RouteError::EventIdNotUuid);
        }
        // NULL: a tombstone candidate; the stage decides by policy (`on_null_payload`).
        let payload = match vals.get(self.payload) {
            Some(Value::Null) => None,
            _ => Some(self.payload_bytes(bytes(self.payload, "payload")?)?),
        };
        let additional = self
            .additional
            .iter()
            .map(|p| {
                let value = match vals.get(p.index) {
                    Some(Value::Text(t)) => {
                        let bad = || RouteError::BadHeaderValue {
                            column: p.column.clone(),
                            header: p.header.to_string(),
                        };
                        let t = std::str::from_utf8(t).map_err(|_| bad())?;
                        Some(p.render.apply(t).ok_or_else(bad)?)
                    }
                    _ => None,
                };
                Ok((p.header.clone(), value))
            })
            .collect::<Result<_, RouteError>>()?;
        Ok(Event {
            event_id,
            aggregate_type: text(self.aggregate_type, "aggregate_type")?,
            aggregate_id: nullable(self.aggregate_id, "aggregate_id")?,
            event_type: nullable(self.event_type, "event_type")?,
            tombstone: payload.is_none(),
            payload: payload.unwrap_or_default(),
            content_type: self.content_type.clone(),
            binary: self.payload_kind == PayloadKind::Bytes,
            aggregate_version: opt_text(self.aggregate_version, "aggregate_version")?,
            schema_version: opt_text(self.schema_version, "schema_version")?,
            headers: opt_text(self.headers, "headers")?,
            created_at_ms: opt_text(self.created_at, "created_at")?.and_then(parse_timestamptz_ms),
            id_header: self.id_header,
            additional,
            ce: match &self.cloudevents {
                Some(spec) => Some(cloudevents::Ce {
                    spec: spec.clone(),
                    created_at: opt_text(self.created_at, "created_at")?,
                }),
                None => None,
            },
        })
    }
}

impl RowMapping {
    /// Whatever can be read from a row that failed to route, for parking it. `None` when even
    /// the `event_id` is unreadable (then nothing can identify the event: the relay stops).
    pub fn partial(&self, vals: &[Value<'_>]) -> Option<crate::poison::record::ParkedRecord> {
        let text = |i: Option<usize>| match i.and_then(|i| vals.get(i)) {
            Some(Value::Text(t)) => std::str::from_utf8(t).ok().map(str::to_string),
            _ => None,
        };
        let event_id = text(Some(self.event_id)).filter(|s| !s.is_empty())?;
        Some(crate::poison::record::ParkedRecord {
            event_id,
            aggregate_type: text(Some(self.aggregate_type)),
            aggregate_id: text(Some(self.aggregate_id)),
            aggregate_version: text(self.aggregate_version).and_then(|v| v.parse().ok()),
            event_type: text(Some(self.event_type)),
            topic: None,
            key: text(Some(self.aggregate_id)).map(String::into_bytes),
            // A bytea payload parks as its bytes; text that is not bytea output as it came.
            payload: match vals.get(self.payload) {
                Some(Value::Text(t)) if self.payload_kind == PayloadKind::Bytes => {
                    Some(crate::model::bytea::decode(t).unwrap_or_else(|_| t.to_vec()))
                }
                Some(Value::Text(t)) => Some(t.to_vec()),
                _ => None,
            },
            headers: vec![],
            timestamp_ms: text(self.created_at).and_then(|t| parse_timestamptz_ms(&t)),
        })
    }
}

/// The fields of one outbox row, borrowed from the WAL message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event<'a> {
    pub event_id: &'a str,
    pub aggregate_type: &'a str,
    /// `None`: NULL, allowed with the Debezium preset only (a record with a null key).
    pub aggregate_id: Option<&'a str>,
    /// `None`: NULL, allowed with the Debezium preset only (no `event_type` header).
    pub event_type: Option<&'a str>,
    /// Empty for a tombstone. Borrowed from the message, owned when decoded (bytea).
    pub payload: Cow<'a, [u8]>,
    /// The payload is NULL: the record carries no value (a tombstone).
    pub tombstone: bool,
    pub aggregate_version: Option<&'a str>,
    pub schema_version: Option<&'a str>,
    /// The `headers` jsonb column as text (a JSON object).
    pub headers: Option<&'a str>,
    pub created_at_ms: Option<i64>,
    /// Also send the event id in header `id` (Debezium's consumers deduplicate on it).
    pub id_header: bool,
    /// The table's `content_type`, sent as header `content-type` after the placed columns.
    pub content_type: Option<Arc<str>>,
    /// The payload is bytes (a bytea column), not JSON: a CloudEvent without a table
    /// `content_type` says `application/octet-stream` and carries it as `data_base64`.
    pub binary: bool,
    /// Headers from `[source.columns] additional`, in order: name and text (`None`: NULL, a
    /// header without a value).
    pub additional: Vec<(Arc<str>, Option<Cow<'a, str>>)>,
    /// `Some`: the record is a CloudEvent (`relay/route/cloudevents`).
    pub ce: Option<cloudevents::Ce<'a>>,
}

impl Event<'_> {
    /// The event type, `""` for a NULL one: the key of policies, metrics and schemas.
    pub fn type_or_empty(&self) -> &str {
        self.event_type.unwrap_or("")
    }

    /// Checks, once and before it is routed, what the record is built from: the row's extra
    /// headers, and for a CloudEvent its attributes (a `type` template needing a NULL
    /// `event_type` included; nothing is built here: the headers and the envelope write the
    /// attributes once each, see `cloudevents`). The stage parks the event when this fails;
    /// what it checked cannot fail later.
    pub fn prepare(&mut self) -> Result<(), RouteError> {
        if let Some(ce) = &self.ce {
            cloudevents::check(self, ce)?;
        } else if self.headers.is_some() {
            self.for_each_header(|_, _| {})?;
        }
        Ok(())
    }

    /// The record to park: as it is produced to `topic` (`None`: it cannot be routed). A
    /// CloudEvent is parked in outboxd's own form plus its raw `created_at`
    /// ([`cloudevents::CREATED_AT_HEADER`]), so a release rebuilds the identical CloudEvent
    /// through the router (`release::rebuild`) instead of wrapping an envelope twice.
    pub fn parked_record(&self, topic: Option<&str>) -> crate::poison::record::ParkedRecord {
        match &self.ce {
            None => self.wire_record(topic),
            Some(ce) => {
                let plain = Event {
                    ce: None,
                    ..self.clone()
                };
                let mut r = plain.wire_record(topic);
                if let Some(t) = ce.created_at {
                    r.headers
                        .push((cloudevents::CREATED_AT_HEADER.into(), Some(t.to_string())));
                }
                r
            }
        }
    }

    /// The record exactly as it is produced to `topic`.
    pub fn wire_record(&self, topic: Option<&str>) -> crate::poison::record::ParkedRecord {
        let mut headers = Vec::new();
        let _ = self.for_each_header(|k, v| {
            headers.push((
                k.to_string(),
                v.map(|v| String::from_utf8_lossy(v).into_owned()),
            ))
        });
        crate::poison::record::ParkedRecord {
            event_id: self.event_id.to_string(),
            aggregate_type: Some(self.aggregate_type.to_string()),
            aggregate_id: self.aggregate_id.map(str::to_string),
            aggregate_version: self.aggregate_version.and_then(|v| v.parse().ok()),
            event_type: self.event_type.map(str::to_string),
            topic: topic.map(str::to_string),
            key: self.aggregate_id.map(|a| a.as_bytes().to_vec()),
            payload: (!self.tombstone).then(|| self.value().into_owned()),
            headers,
            timestamp_ms: self.created_at_ms,
        }
    }

    /// Kafka headers in a fixed order: the event's identity first (`event_type` and
    /// `aggregate_id` only when not NULL), `id` with the Debezium preset, the placed columns
    /// (as Debezium orders them: after `id`), then the row's extra headers. Calls
    /// `f(name, value)` for each (`None`: a header without a value, a NULL placed column); the
    /// extra headers are parsed only when present.
    pub fn for_each_header(
        &self,
        mut f: impl FnMut(&str, Option<&[u8]>),
    ) -> Result<(), RouteError> {
        if let Some(ce) = &self.ce {
            return cloudevents::for_each_header(self, ce, f);
        }
        f("event_id", Some(self.event_id.as_bytes()));
        if let Some(t) = self.event_type {
            f("event_type", Some(t.as_bytes()));
        }
        f("aggregate_type", Some(self.aggregate_type.as_bytes()));
        if let Some(a) = self.aggregate_id {
            f("aggregate_id", Some(a.as_bytes()));
        }
        if let Some(v) = self.aggregate_version {
            f("aggregate_version", Some(v.as_bytes()));
        }
        if let Some(v) = self.schema_version {
            f("schema_version", Some(v.as_bytes()));
        }
        if self.id_header {
            f("id", Some(self.event_id.as_bytes()));
        }
        for (k, v) in &self.additional {
            f(k, v.as_deref().map(str::as_bytes));
        }
        if let Some(c) = &self.content_type {
            f(CONTENT_TYPE_HEADER, Some(c.as_bytes()));
        }
        if let Some(h) = self.headers {
            let map: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(h).map_err(|e| RouteError::BadHeaders(e.to_string()))?;
            let taken = |k: &String| {
                is_reserved_header(k)
                    || (self.id_header && k.eq_ignore_ascii_case("id"))
                    || (self.content_type.is_some() && k.eq_ignore_ascii_case(CONTENT_TYPE_HEADER))
                    || self
                        .additional
                        .iter()
                        .any(|(a, _)| a.eq_ignore_ascii_case(k))
            };
            if let Some(k) = map.keys().find(|k| taken(k)) {
                return Err(RouteError::ReservedHeader(k.clone()));
            }
            for (k, v) in &map {
                match v {
                    serde_json::Value::String(s) => f(k, Some(s.as_bytes())),
                    serde_json::Value::Null => {}
                    other => f(k, Some(other.to_string().as_bytes())),
                }
            }
        }
        Ok(())
    }

    /// The record's value: the payload, or the CloudEvents envelope in structured mode. The
    /// stage checked the row with [`Event::for_each_header`] first (same checks), so a failed
    /// envelope cannot occur here; the payload stands in should it ever.
    pub fn value(&self) -> Cow<'_, [u8]> {
        match self.ce.as_ref().map(|ce| cloudevents::envelope(self, ce)) {
            Some(Ok(Some(v))) => Cow::Owned(v),
            _ => Cow::Borrowed(&*self.payload),
        }
    }

    /// Approximate bytes this record holds in the producer (for the in-flight byte bound).
    pub fn size(&self) -> usize {
        let additional: usize = self
            .additional
            .iter()
            .map(|(k, v)| k.len() + v.as_ref().map_or(0, |v| v.len()) + 8)
            .sum();
        self.payload.len()
            + self.aggregate_id.map_or(0, str::len) * 2
            + self.event_id.len()
            + self.event_type.map_or(0, str::len)
            + self.aggregate_type.len()
            + self.headers.map_or(0, str::len)
            + self.content_type.as_ref().map_or(0, |c| c.len() + 20)
            + additional
            + 64
            // The CloudEvents attributes (headers or envelope), roughly.
            + if self.ce.is_some() { 320 } else { 0 }
    }
}

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::columns::{Columns, Preset};
    use crate::model::topic::TopicTemplate;
    use crate::relay::pgoutput::Column;

    fn rel(cols: &[&str]) -> Relation {
        Relation {
            id: 1,
            namespace: "public".into(),
            name: "outbox".into(),
            columns: cols
                .iter()
                .map(|c| Column {
                    name: c.to_string(),
                    type_oid: 25,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    const ALL: &[&str] = &[
        "event_id",
        "aggregate_type",
        "aggregate_id",
        "aggregate_version",
        "event_type",
        "schema_version",
        "payload",
        "headers",
        "created_at",
    ];

    #[test]
    fn maps_a_full_row() {
        let names = Columns::default().resolve().unwrap();
        let m = RowMapping::resolve(&names, &rel(ALL), &mut vec![]).unwrap();
        let vals = [
            Value::Text(b"0193a5e2-7c1d-7000-8000-000000000001"),
            Value::Text(b"order"),
            Value::Text(b"o-1"),
            Value::Text(b"3"),
            Value::Text(b"OrderPlaced"),
            Value::Text(b"2"),
            Value::Text(b"{\"a\": 1}"),
            Value::Text(b"{\"traceparent\": \"00-ab\", \"n\": 5, \"z\": null}"),
            Value::Text(b"2026-12-02 12:00:00.123456+00"),
        ];
        let e = m.event(&vals).unwrap();
        assert_eq!(e.aggregate_version, Some("3"));
        assert_eq!(e.created_at_ms, Some(1_796_212_800_123));
        let mut hs = Vec::new();
        e.for_each_header(|k, v| {
            hs.push((
                k.to_string(),
                String::from_utf8(v.unwrap().to_vec()).unwrap(),
            ))
        })
        .unwrap();
        let names: Vec<&str> = hs.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "event_id",
                "event_type",
                "aggregate_type",
                "aggregate_id",
                "aggregate_version",
                "schema_version",
                "n",
                "traceparent"
            ]
        );
        assert_eq!(hs[6].1, "5");
        let t = TopicTemplate::parse("outbox.event.{aggregate_type}").unwrap();
        let mut s = String::new();
        t.render(e.aggregate_type, e.event_type, &mut s).unwrap();
        assert_eq!(s, "outbox.event.order");
    }

    #[test]
    fn missing_required_column_is_named() {
        let names = Columns::default().resolve().unwrap();
        let cols: Vec<&str> = ALL
            .iter()
            .copied()
            .filter(|c| *c != "aggregate_id")
            .collect();
        let err = RowMapping::resolve(&names, &rel(&cols), &mut vec![]).unwrap_err();
        assert!(err.to_string().contains("`aggregate_id`"), "{err}");
    }

    #[test]
    fn missing_optional_column_is_reported_not_fatal() {
        let names = Columns::default().resolve().unwrap();
        let cols: Vec<&str> = ALL.iter().copied().filter(|c| *c != "headers").collect();
        let mut missing = vec![];
        RowMapping::resolve(&names, &rel(&cols), &mut missing).unwrap();
        assert_eq!(missing, ["headers"]);
    }

    #[test]
    fn null_required_field_is_an_error() {
        let names = Columns::default().resolve().unwrap();
        let m = RowMapping::resolve(&names, &rel(ALL), &mut vec![]).unwrap();
        let mut vals = vec![Value::Text(b"x"); 9];
        vals[0] = Value::Text(b"0193A5E27C1D70008000000000000001");
        vals[6] = Value::Text(b"{}");
        vals[2] = Value::Null;
        assert_eq!(
            m.event(&vals).unwrap_err(),
            RouteError::NullField("aggregate_id")
        );
    }

    #[test]
    fn debezium_preset_sends_null_keys_and_types_outboxd_parks_them() {
        let dbz = Columns {
            preset: Preset::Debezium,
            ..Columns::default()
        }
        .resolve()
        .unwrap();
        let r = rel(&["id", "aggregatetype", "aggregateid", "type", "payload"]);
        let m = RowMapping::resolve(&dbz, &r, &mut vec![]).unwrap();
        let vals = [
            Value::Text(b"0193a5e2-7c1d-7000-8000-000000000001"),
            Value::Text(b"order"),
            Value::Null,
            Value::Null,
            Value::Text(b"{}"),
        ];
        let e = m.event(&vals).unwrap();
        assert_eq!((e.aggregate_id, e.event_type), (None, None));
        let mut names = Vec::new();
        e.for_each_header(|k, _| names.push(k.to_string())).unwrap();
        assert_eq!(names, ["event_id", "aggregate_type", "id"]);
        assert_eq!(
            e.parked_record(None).key,
            None,
            "a null key, not an empty one"
        );
        // A NULL aggregate type is never routed (Debezium stops on it).
        let mut no_type = vals;
        no_type[1] = Value::Null;
        assert_eq!(
            m.event(&no_type).unwrap_err(),
            RouteError::NullField("aggregate_type")
        );
        // `{event_type}` in the topic template needs the type.
        let mut topic = String::new();
        let t = TopicTemplate::parse("events.{event_type}").unwrap();
        assert_eq!(
            t.render(e.aggregate_type, e.event_type, &mut topic)
                .unwrap_err(),
            RouteError::NullField("event_type")
        );
        // The outboxd preset requires both (the inbox reads them).
        let ours = Columns::default().resolve().unwrap();
        let m = RowMapping::resolve(&ours, &rel(ALL), &mut vec![]).unwrap();
        let mut vals = vec![Value::Text(b"x"); 9];
        vals[0] = Value::Text(b"0193a5e2-7c1d-7000-8000-000000000001");
        vals[6] = Value::Text(b"{}");
        vals[4] = Value::Null;
        assert_eq!(
            m.event(&vals).unwrap_err(),
            RouteError::NullField("event_type")
        );
    }

    #[test]
    fn placed_columns_become_headers_as_debezium_writes_them() {
        let names = Columns {
            preset: Preset::Debezium,
            additional: vec![
                "tenant:header".into(),
                "type:header:eventType".into(),
                "urgent:header".into(),
                "at:header:occurredAt".into(),
                "note:header".into(),
            ],
            ..Columns::default()
        }
        .resolve()
        .unwrap();
        let mut r = rel(&[
            "id",
            "aggregatetype",
            "aggregateid",
            "type",
            "payload",
            "tenant",
            "urgent",
            "at",
            "note",
        ]);
        r.columns[6].type_oid = 16; // boolean
        r.columns[7].type_oid = 1184; // timestamptz(3)
        r.columns[7].type_modifier = 3;
        let m = RowMapping::resolve(&names, &r, &mut vec![]).unwrap();
        let vals = [
            Value::Text(b"0193a5e2-7c1d-7000-8000-000000000001"),
            Value::Text(b"order"),
            Value::Text(b"o-1"),
            Value::Text(b"OrderPlaced"),
            Value::Text(b"{}"),
            Value::Text(b"acme"),
            Value::Text(b"t"),
            Value::Text(b"2024-01-02 03:04:05.12+00"),
            Value::Null,
        ];
        let e = m.event(&vals).unwrap();
        let mut hs = Vec::new();
        e.for_each_header(|k, v| hs.push((k.to_string(), v.map(|v| v.to_vec()))))
            .unwrap();
        let placed: Vec<(&str, Option<&[u8]>)> = hs[5..]
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect();
        assert_eq!(
            hs[4].0, "id",
            "placed headers follow id, as Debezium orders them"
        );
        assert_eq!(
            placed,
            [
                ("tenant", Some(&b"acme"[..])),
                ("eventType", Some(&b"OrderPlaced"[..])),
                ("urgent", Some(&b"true"[..])),
                ("occurredAt", Some(&b"2024-01-02T03:04:05.120Z"[..])),
                ("note", None),
            ]
        );
        // Parked as sent, the NULL one included.
        let rec = e.parked_record(Some("t"));
        assert_eq!(rec.headers.last(), Some(&("note".to_string(), None)));
        // A value that is not what Postgres writes for the type: named, never quoted.
        let mut bad = vals;
        bad[7] = Value::Text(b"secret-ish 2024");
        let err = m.event(&bad).unwrap_err();
        assert_eq!(err.class(), "invalid_event");
        assert!(
            err.to_string().contains("`at` (header `occurredAt`)"),
            "{err}"
        );
        assert!(!err.to_string().contains("secret"), "{err}");
        // A type Debezium renders otherwise is refused with the schema, naming the column.
        r.columns[8].type_oid = 1700;
        let err = RowMapping::resolve(&names, &r, &mut vec![]).unwrap_err();
        assert!(
            err.to_string()
                .contains("`note` of public.outbox is numeric"),
            "{err}"
        );
        // So is a placed column the table lacks (Debezium's error.on.missing default).
        let r = rel(&["id", "aggregatetype", "aggregateid", "type", "payload"]);
        let err = RowMapping::resolve(&names, &r, &mut vec![]).unwrap_err();
        assert!(
            err.to_string().contains("source.columns.additional"),
            "{err}"
        );
    }

    #[test]
    fn a_row_header_may_not_shadow_a_placed_one() {
        let names = Columns {
            additional: vec!["tenant:header".into()],
            ..Columns::default()
        }
        .resolve()
        .unwrap();
        let mut cols = ALL.to_vec();
        cols.push("tenant");
        let m = RowMapping::resolve(&names, &rel(&cols), &mut vec![]).unwrap();
        let mut vals = vec![Value::Text(b"1"); 10];
        vals[0] = Value::Text(b"0193a5e2-7c1d-7000-8000-000000000001");
        vals[6] = Value::Text(b"{}");
        vals[7] = Value::Text(b"{\"Tenant\": \"spoofed\"}");
        let e = m.event(&vals).unwrap();
        let err = e.for_each_header(|_, _| {}).unwrap_err();
        assert_eq!(err, RouteError::ReservedHeader("Tenant".into()));
        assert_eq!(err.class(), "reserved_header");
    }

    #[test]
    fn what_the_stream_may_carry() {
        let names = Columns::default().resolve().unwrap();
        let m = RowMapping::resolve(&names, &rel(ALL), &mut vec![]).unwrap();
        let mut vals = vec![Value::Text(b"x"); 9];
        vals[6] = Value::Text(b"{}");
        // Not a UUID (consumers deduplicate by it): a class of its own, parked.
        assert_eq!(m.event(&vals).unwrap_err(), RouteError::EventIdNotUuid);
        vals[0] = Value::Text(b"0193a5e2-7c1d-7000-8000-000000000001");
        // A text payload column must hold JSON (json/jsonb columns always do).
        vals[6] = Value::Text(b"not json");
        assert!(matches!(m.event(&vals), Err(RouteError::PayloadNotJson(_))));
        let mut r = rel(ALL);
        r.columns[6].type_oid = JSONB_OID;
        let m = RowMapping::resolve(&names, &r, &mut vec![]).unwrap();
        assert_eq!(m.payload_kind(), PayloadKind::Json);
        assert!(!is_uuid("") && !is_uuid("0193a5e2+7c1d-7000-8000-000000000001"));
    }

    #[test]
    fn a_bytea_payload_goes_out_as_its_bytes_with_the_tables_content_type() {
        let names = Columns {
            content_type: Some("application/vnd.apache.avro+binary".into()),
            ..Columns::default()
        }
        .resolve()
        .unwrap();
        let mut r = rel(ALL);
        r.columns[6].type_oid = BYTEA_OID;
        let m = RowMapping::resolve(&names, &r, &mut vec![]).unwrap();
        assert_eq!(m.payload_kind(), PayloadKind::Bytes);
        assert_eq!(
            m.content_type().map(|c| &**c),
            Some("application/vnd.apache.avro+binary")
        );
        let mut vals = vec![Value::Text(b"x"); 9];
        vals[0] = Value::Text(b"0193a5e2-7c1d-7000-8000-000000000001");
        vals[7] = Value::Text(b"{\"trace\": \"t\"}");
        vals[8] = Value::Null;
        // Confluent framing: magic 0, schema id, then a body with NUL and 0xff.
        vals[6] = Value::Text(b"\\x000000000100ff");
        let e = m.event(&vals).unwrap();
        assert_eq!(&*e.payload, [0, 0, 0, 0, 1, 0, 0xff]);
        assert!(!e.tombstone);
        let mut hs = Vec::new();
        e.for_each_header(|k, v| hs.push((k.to_string(), v.map(<[u8]>::to_vec))))
            .unwrap();
        let ct = hs.iter().position(|(k, _)| k == "content-type").unwrap();
        assert_eq!(
            hs[ct].1.as_deref(),
            Some(&b"application/vnd.apache.avro+binary"[..])
        );
        // After the relay's own headers, before the row's.
        assert_eq!(hs[ct + 1].0, "trace");
        // Parked, it keeps the bytes (not the hex text).
        assert_eq!(
            e.parked_record(None).payload.unwrap(),
            [0, 0, 0, 0, 1, 0, 0xff]
        );
        assert_eq!(
            m.partial(&vals).unwrap().payload.unwrap(),
            [0, 0, 0, 0, 1, 0, 0xff]
        );
        // The row may not set the content type the table declares.
        vals[7] = Value::Text(b"{\"Content-Type\": \"text/plain\"}");
        let e = m.event(&vals).unwrap();
        assert!(matches!(
            e.for_each_header(|_, _| {}),
            Err(RouteError::ReservedHeader(_))
        ));
        // Text that is not bytea output: parked, naming where.
        vals[6] = Value::Text(b"\\x0");
        assert!(matches!(m.event(&vals), Err(RouteError::BadBytea(_))));
        // NULL: a tombstone candidate as for JSON.
        vals[6] = Value::Null;
        assert!(m.event(&vals).unwrap().tombstone);
    }
}
