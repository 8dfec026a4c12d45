//! An outbox row as a CloudEvent 1.0 on Kafka (issue 42), per the CloudEvents Kafka protocol
//! binding 1.0: binary mode (attributes as `ce_*` headers, the payload as the value) or
//! structured mode (the value is the `application/cloudevents+json` envelope).
//!
//! Everything that produces a record (the live path, replay and recovery through the table
//! reader, parking, the shadow tap) asks [`super::Event::for_each_header`] and
//! [`super::Event::value`], which come here when the table's format is `cloudevents`: a
//! replayed, recovered or released event is the identical CloudEvent.
//!
//! Attributes: `id` = event_id, `source` (per table), `type` (template), `subject` =
//! aggregate_id, `time` = created_at (RFC 3339, microseconds kept), `datacontenttype`,
//! `dataschema` (registered schemas only); extensions `partitionkey` (= the Kafka key),
//! `aggregatetype`, `aggregateversion`, `schemaversion`, `traceparent`/`tracestate` (from the
//! row's headers; they also stay Kafka headers, for Kafka tracing instrumentation). Other
//! headers: Kafka headers in binary mode; in structured mode extensions when their name is a
//! valid extension name, Kafka headers otherwise (nothing is dropped).

use super::Event;
use crate::model::cloudevents::{is_extension_name, CloudEvents, Mode, Var, OWN};
use crate::model::route::{is_reserved_header, RouteError};
use base64::Engine as _;
use std::sync::Arc;

/// The CloudEvents side of one event: the table's settings and the raw `created_at` text
/// (kept to the microsecond, unlike the record timestamp).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ce<'a> {
    pub spec: Arc<CloudEvents>,
    pub created_at: Option<&'a str>,
    /// Built once by [`super::Event::prepare`] (the stage's check), then read by the headers
    /// and the envelope instead of building them again for each (`None`: built on demand).
    pub attrs: Option<Arc<Attrs>>,
}

pub use crate::model::cloudevents::CREATED_AT_HEADER;

/// The structured mode's `content-type` (the binding's).
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";

/// The payload's media type, the `datacontenttype` attribute: the table's `content_type` when
/// set, else `application/octet-stream` for bytes (a bytea column) and `application/json` for
/// JSON; [`is_json`] then decides `data` vs `data_base64` in structured mode.
fn content_type<'e>(e: &'e Event<'_>) -> &'e str {
    match &e.content_type {
        Some(ct) => ct,
        None if e.binary => "application/octet-stream",
        None => "application/json",
    }
}

/// A JSON media type (`application/json`, `…+json`): structured mode embeds it as `data`.
fn is_json(ct: &str) -> bool {
    let base = ct.split(';').next().unwrap_or("").trim();
    base == "application/json" || base.ends_with("+json") || base == "text/json"
}

/// Whether structured mode puts the payload in `data` as is: a JSON media type, and, for
/// bytes (a bytea column), bytes that are exactly one JSON value. A declared type is not proof:
/// registry-framed JSON Schema bodies are not JSON, and crafted bytes such as
/// `{"a":1},"id":"x","type":"Refund"` would add keys to the envelope (duplicate `id`/`type`
/// that last-key-wins parsers accept). Anything else goes as `data_base64`.
fn embeds_as_json(e: &Event<'_>) -> bool {
    is_json(content_type(e))
        && (!e.binary || serde_json::from_slice::<serde::de::IgnoredAny>(&e.payload).is_ok())
}

/// Postgres `timestamptz`/`timestamp` text (ISO DateStyle) as RFC 3339: `T` between date and
/// time, `Z` for UTC, `+hh:mm` offsets, the fraction kept as written. `None` for `infinity`,
/// BC dates and anything else not RFC 3339-representable (then no `time` attribute).
pub fn rfc3339(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let digits =
        |r: std::ops::Range<usize>| b.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
    if b.len() < 19
        || !digits(0..4)
        || b[4] != b'-'
        || !digits(5..7)
        || b[7] != b'-'
        || !digits(8..10)
        || b[10] != b' '
        || !digits(11..13)
        || b[13] != b':'
        || !digits(14..16)
        || b[16] != b':'
        || !digits(17..19)
    {
        return None;
    }
    let mut out = String::with_capacity(32);
    out.push_str(&s[..10]);
    out.push('T');
    out.push_str(&s[11..19]);
    let mut rest = &s[19..];
    if let Some(frac) = rest.strip_prefix('.') {
        let n = frac.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return None;
        }
        out.push('.');
        out.push_str(&frac[..n]);
        rest = &frac[n..];
    }
    match rest {
        // `timestamp` without time zone: taken as UTC, as the record timestamp is.
        "" | "+00" | "+00:00" | "-00" => out.push('Z'),
        o if (o.starts_with('+') || o.starts_with('-')) && digits_only(&o[1..]) => {
            let d = o[1..].replace(':', "");
            match d.len() {
                2 => out.push_str(&format!("{}{}:00", &o[..1], d)),
                4 => out.push_str(&format!("{}{}:{}", &o[..1], &d[..2], &d[2..])),
                // Seconds in an offset (historic zones) have no RFC 3339 form.
                _ => return None,
            }
        }
        _ => return None,
    }
    Some(out)
}

fn digits_only(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit() || c == b':')
}

/// The attributes of one event, in a fixed order (name, value).
#[derive(Debug, PartialEq, Eq)]
pub struct Attrs {
    core: Vec<(&'static str, String)>,
    /// Row headers, placed columns: (name, value), in the router's order.
    others: Vec<(String, Option<String>)>,
}

/// The event's attributes: the ones [`super::Event::prepare`] kept, else built now.
pub fn attributes(e: &Event<'_>, ce: &Ce<'_>) -> Result<Arc<Attrs>, RouteError> {
    match &ce.attrs {
        Some(a) => Ok(a.clone()),
        None => attrs(e, ce).map(Arc::new),
    }
}

fn attrs(e: &Event<'_>, ce: &Ce<'_>) -> Result<Attrs, RouteError> {
    let spec = &ce.spec;
    let var = |v: Var| match v {
        Var::AggregateType => Some(e.aggregate_type.to_string()),
        Var::EventType => e.event_type.map(str::to_string),
        Var::SchemaVersion => e.schema_version.map(str::to_string),
    };
    let type_ = spec.type_.render(var).ok_or_else(|| {
        RouteError::CloudEvent(
            "the type template needs event_type, which is NULL: CloudEvents requires `type`".into(),
        )
    })?;
    let mut core = vec![
        ("specversion", "1.0".to_string()),
        ("id", e.event_id.to_string()),
        ("source", spec.source.clone()),
        ("type", type_),
    ];
    if let Some(a) = e.aggregate_id {
        core.push(("subject", a.to_string()));
    }
    if let Some(t) = ce.created_at.and_then(rfc3339) {
        core.push(("time", t));
    }
    core.push(("datacontenttype", content_type(e).to_string()));
    if let (Some(t), Some(ty), Some(v)) = (&spec.dataschema, e.event_type, e.schema_version) {
        if spec.registered.contains(&(ty.to_string(), v.to_string())) {
            if let Some(uri) = t.render(var) {
                core.push(("dataschema", uri));
            }
        }
    }
    if let Some(a) = e.aggregate_id {
        core.push(("partitionkey", a.to_string()));
    }
    core.push(("aggregatetype", e.aggregate_type.to_string()));
    if let Some(v) = e.aggregate_version {
        core.push(("aggregateversion", v.to_string()));
    }
    if let Some(v) = e.schema_version {
        core.push(("schemaversion", v.to_string()));
    }
    let mut others: Vec<(String, Option<String>)> = e
        .additional
        .iter()
        .map(|(k, v)| (k.to_string(), v.as_ref().map(|v| v.to_string())))
        .collect();
    if let Some(h) = e.headers {
        let map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(h).map_err(|e| RouteError::BadHeaders(e.to_string()))?;
        let taken = |k: &str| {
            let l = k.to_ascii_lowercase();
            is_reserved_header(k)
                || l.starts_with("ce_")
                || l == "content-type"
                || OWN.contains(&l.as_str())
                || e.additional.iter().any(|(a, _)| a.eq_ignore_ascii_case(k))
        };
        if let Some(k) = map.keys().find(|k| taken(k)) {
            return Err(if is_reserved_header(k) {
                RouteError::ReservedHeader(k.clone())
            } else {
                RouteError::CloudEventHeader(k.clone())
            });
        }
        for (k, v) in map {
            let v = match v {
                serde_json::Value::String(s) => s,
                serde_json::Value::Null => continue,
                other => other.to_string(),
            };
            // Distributed Tracing extension: the row's trace context as attributes.
            match k.as_str() {
                "traceparent" => core.push(("traceparent", v.clone())),
                "tracestate" => core.push(("tracestate", v.clone())),
                _ => {}
            }
            others.push((k, Some(v)));
        }
    }
    Ok(Attrs { core, others })
}

/// Binary mode: `ce_<attr>` headers (`content-type` for `datacontenttype`), then the other
/// headers as they are. Structured mode: `content-type` and the headers that are no valid
/// extension (the others are in the envelope).
pub fn for_each_header(
    e: &Event<'_>,
    ce: &Ce<'_>,
    mut f: impl FnMut(&str, Option<&[u8]>),
) -> Result<(), RouteError> {
    let a = attributes(e, ce)?;
    match ce.spec.mode {
        Mode::Binary => {
            let mut name = String::with_capacity(24);
            for (k, v) in &a.core {
                if *k == "datacontenttype" {
                    f("content-type", Some(v.as_bytes()));
                    continue;
                }
                name.clear();
                name.push_str("ce_");
                name.push_str(k);
                f(&name, Some(v.as_bytes()));
            }
            for (k, v) in &a.others {
                f(k, v.as_deref().map(str::as_bytes));
            }
        }
        Mode::Structured => {
            f("content-type", Some(STRUCTURED_CONTENT_TYPE.as_bytes()));
            for (k, v) in &a.others {
                if !as_extension(&a, k, v) {
                    f(k, v.as_deref().map(str::as_bytes));
                }
            }
        }
    }
    Ok(())
}

/// A header that travels as an extension attribute in structured mode: a valid name, a value,
/// not already an attribute.
fn as_extension(a: &Attrs, k: &str, v: &Option<String>) -> bool {
    v.is_some() && is_extension_name(k) && !a.core.iter().any(|(c, _)| *c == k)
}

/// Structured mode's value: the JSON envelope (`data` for a JSON payload, `data_base64`
/// otherwise). `Ok(None)`: binary mode or a tombstone (the payload is the value as it is).
pub fn envelope(e: &Event<'_>, ce: &Ce<'_>) -> Result<Option<Vec<u8>>, RouteError> {
    if ce.spec.mode != Mode::Structured || e.tombstone {
        return Ok(None);
    }
    let a = attributes(e, ce)?;
    let mut out = Vec::with_capacity(e.payload.len() + 512);
    out.push(b'{');
    let mut first = true;
    let mut put = |out: &mut Vec<u8>, k: &str, v: &str| {
        if !first {
            out.push(b',');
        }
        first = false;
        // Strings serialize infallibly.
        let _ = serde_json::to_writer(&mut *out, k);
        out.push(b':');
        let _ = serde_json::to_writer(&mut *out, v);
    };
    for (k, v) in &a.core {
        put(&mut out, k, v);
    }
    for (k, v) in &a.others {
        if as_extension(&a, k, v) {
            put(&mut out, k, v.as_deref().unwrap_or_default());
        }
    }
    if embeds_as_json(e) {
        // The payload is one JSON value (json/jsonb, text checked by the router, or bytes just
        // parsed): embedded as is.
        out.extend_from_slice(b",\"data\":");
        out.extend_from_slice(&e.payload);
    } else {
        out.extend_from_slice(b",\"data_base64\":\"");
        out.extend_from_slice(
            base64::engine::general_purpose::STANDARD
                .encode(&*e.payload)
                .as_bytes(),
        );
        out.push(b'"');
    }
    out.push(b'}');
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_keeps_microseconds_and_offsets() {
        let t = |s| rfc3339(s);
        assert_eq!(
            t("2026-12-02 12:00:00.123456+00").as_deref(),
            Some("2026-12-02T12:00:00.123456Z")
        );
        assert_eq!(
            t("2026-12-02 12:00:00+05:30").as_deref(),
            Some("2026-12-02T12:00:00+05:30")
        );
        assert_eq!(
            t("2026-12-02 12:00:00.5-03").as_deref(),
            Some("2026-12-02T12:00:00.5-03:00")
        );
        assert_eq!(
            t("2026-12-02 12:00:00").as_deref(),
            Some("2026-12-02T12:00:00Z")
        );
        assert_eq!(t("infinity"), None);
        assert_eq!(t("0044-03-15 12:00:00+00 BC"), None);
    }

    use crate::config::cloudevents::CloudEventsConfig;
    use crate::model::columns::Columns;
    use crate::relay::pgoutput::{Column, Relation, Value};
    use crate::relay::route::RowMapping;

    fn mapping(mode: Mode) -> RowMapping {
        mapping_with(mode, 3802, None)
    }

    /// `payload_oid`: the payload column's type (3802 jsonb, 17 bytea).
    fn mapping_with(mode: Mode, payload_oid: u32, content_type: Option<&str>) -> RowMapping {
        let cols = [
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
        let rel = Relation {
            id: 1,
            namespace: "public".into(),
            name: "outbox".into(),
            columns: cols
                .iter()
                .map(|c| Column {
                    name: c.to_string(),
                    type_oid: if *c == "payload" { payload_oid } else { 25 },
                    type_modifier: -1,
                })
                .collect(),
        };
        let ce = CloudEventsConfig {
            mode,
            type_: "com.acme.{aggregate_type}.{event_type}".into(),
            ..Default::default()
        }
        .resolve("app", "public", "outbox", None)
        .unwrap();
        let c = Columns {
            cloudevents: Some(Arc::new(ce)),
            content_type: content_type.map(String::from),
            ..Default::default()
        };
        RowMapping::resolve(&c.resolve().unwrap(), &rel, &mut vec![]).unwrap()
    }

    const ROW: [Value<'static>; 9] = [
        Value::Text(b"0193a5e2-7c1d-7000-8000-000000000001"),
        Value::Text(b"order"),
        Value::Text(b"o-1"),
        Value::Text(b"3"),
        Value::Text(b"OrderPlaced"),
        Value::Text(b"2"),
        Value::Text(b"{\"a\": 1}"),
        Value::Text(
            b"{\"traceparent\": \"00-ab-cd-01\", \"tenant_id\": \"t9\", \"region\": \"eu\"}",
        ),
        Value::Text(b"2026-12-02 12:00:00.123456+00"),
    ];

    fn headers(e: &Event<'_>) -> Vec<(String, String)> {
        let mut hs = Vec::new();
        e.for_each_header(|k, v| {
            hs.push((
                k.to_string(),
                String::from_utf8_lossy(v.unwrap()).into_owned(),
            ))
        })
        .unwrap();
        hs
    }

    #[test]
    fn a_bytea_payload_is_octet_stream_or_the_tables_content_type_and_base64_when_structured() {
        let mut row = ROW;
        row[6] = Value::Text(b"\\x00ff41");
        let value = |e: &Event<'_>| -> serde_json::Value {
            serde_json::from_slice(&e.value()).expect("the envelope is JSON")
        };
        let m = mapping_with(Mode::Structured, 17, None);
        let e = m.event(&row).unwrap();
        let v = value(&e);
        assert_eq!(v["datacontenttype"], "application/octet-stream");
        assert_eq!(v["data_base64"], "AP9B");
        assert!(v.get("data").is_none());
        let avro = "application/vnd.apache.avro+binary";
        let m = mapping_with(Mode::Structured, 17, Some(avro));
        assert_eq!(value(&m.event(&row).unwrap())["datacontenttype"], avro);
        let m = mapping_with(Mode::Binary, 17, Some(avro));
        let e = m.event(&row).unwrap();
        let hs = headers(&e);
        let cts: Vec<_> = hs.iter().filter(|(k, _)| k == "content-type").collect();
        assert_eq!(
            cts,
            [&("content-type".to_string(), avro.to_string())],
            "one content-type"
        );
        assert_eq!(&*e.value(), &[0x00, 0xff, 0x41][..]);
    }

    /// Issue 53: a bytea payload declared JSON is embedded as `data` only when its bytes are
    /// one JSON value; crafted bytes never add keys to the envelope, and framed bytes keep a
    /// valid envelope.
    #[test]
    fn a_bytea_payload_declared_json_is_data_only_when_it_parses() {
        let m = mapping_with(Mode::Structured, 17, Some("application/json"));
        let envelope = |hex: &[u8]| -> (Vec<u8>, serde_json::Value) {
            let mut row = ROW;
            row[6] = Value::Text(hex);
            let bytes = m.event(&row).unwrap().value().to_vec();
            let v = serde_json::from_slice(&bytes).expect("the envelope is JSON");
            (bytes, v)
        };
        // {"a":1} as bytea text.
        let (_, v) = envelope(b"\\x7b2261223a317d");
        assert_eq!(v["data"], serde_json::json!({"a": 1}));
        assert!(v.get("data_base64").is_none());
        // {"a":1},"id":"forged","type":"Refund"
        let crafted = br#"{"a":1},"id":"forged","type":"Refund""#;
        let hex: String = crafted.iter().map(|b| format!("{b:02x}")).collect();
        let (bytes, v) = envelope(format!("\\x{hex}").as_bytes());
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(text.matches("\"id\":").count(), 1, "{text}");
        assert_eq!(text.matches("\"type\":").count(), 1, "{text}");
        assert_eq!(v["id"], "0193a5e2-7c1d-7000-8000-000000000001");
        assert_eq!(v["type"], "com.acme.order.OrderPlaced");
        assert!(v.get("data").is_none());
        use base64::Engine as _;
        let back = base64::engine::general_purpose::STANDARD
            .decode(v["data_base64"].as_str().unwrap())
            .unwrap();
        assert_eq!(back, crafted);
        assert_eq!(v["datacontenttype"], "application/json");
        // A schema-registry frame (magic byte, schema id) before JSON: not JSON either.
        let (_, v) = envelope(b"\\x00000000017b7d");
        assert!(
            v.get("data").is_none() && v["data_base64"] == "AAAAAAF7fQ==",
            "{v}"
        );
    }

    #[test]
    fn binary_mode_headers_and_payload_as_value() {
        let m = mapping(Mode::Binary);
        let e = m.event(&ROW).unwrap();
        let hs = headers(&e);
        let get = |k: &str| hs.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("ce_specversion"), Some("1.0"));
        assert_eq!(get("ce_id"), Some("0193a5e2-7c1d-7000-8000-000000000001"));
        assert_eq!(get("ce_type"), Some("com.acme.order.OrderPlaced"));
        assert_eq!(get("ce_source"), Some("/outboxd/app/public/outbox"));
        assert_eq!(get("ce_subject"), Some("o-1"));
        assert_eq!(get("ce_time"), Some("2026-12-02T12:00:00.123456Z"));
        assert_eq!(get("content-type"), Some("application/json"));
        assert_eq!(get("ce_partitionkey"), Some("o-1"));
        assert_eq!(get("ce_aggregateversion"), Some("3"));
        assert_eq!(get("ce_schemaversion"), Some("2"));
        assert_eq!(get("ce_traceparent"), Some("00-ab-cd-01"));
        assert_eq!(get("traceparent"), Some("00-ab-cd-01"));
        assert_eq!(get("tenant_id"), Some("t9"));
        assert_eq!(get("event_id"), None);
        assert_eq!(&*e.value(), b"{\"a\": 1}");
    }

    #[test]
    fn structured_mode_envelope() {
        let m = mapping(Mode::Structured);
        let e = m.event(&ROW).unwrap();
        let hs = headers(&e);
        assert_eq!(
            hs,
            vec![
                (
                    "content-type".to_string(),
                    STRUCTURED_CONTENT_TYPE.to_string()
                ),
                // Not a valid extension name: stays a Kafka header.
                ("tenant_id".to_string(), "t9".to_string()),
                // Also an attribute; kept for Kafka tracing instrumentation (W3C header).
                ("traceparent".to_string(), "00-ab-cd-01".to_string()),
            ]
        );
        let v: serde_json::Value = serde_json::from_slice(&e.value()).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["id"], "0193a5e2-7c1d-7000-8000-000000000001");
        assert_eq!(v["time"], "2026-12-02T12:00:00.123456Z");
        assert_eq!(v["traceparent"], "00-ab-cd-01");
        assert_eq!(v["region"], "eu");
        assert_eq!(v["partitionkey"], "o-1");
        assert_eq!(v["data"], serde_json::json!({"a": 1}));
        assert!(v.get("tenant_id").is_none());
    }

    #[test]
    fn prepared_attributes_build_the_same_record_and_a_bad_one_is_refused_up_front() {
        for mode in [Mode::Binary, Mode::Structured] {
            let m = mapping(mode);
            let plain = m.event(&ROW).unwrap();
            let mut prepared = plain.clone();
            prepared.prepare().unwrap();
            assert!(prepared.ce.as_ref().unwrap().attrs.is_some());
            assert_eq!(headers(&prepared), headers(&plain), "{mode:?}");
            assert_eq!(prepared.value(), plain.value(), "{mode:?}");
            // No `type` without an event type: refused by the stage's check, even for a row
            // without extra headers (it would otherwise leave without its attributes).
            let mut row = ROW;
            row[4] = Value::Null;
            row[7] = Value::Null;
            if let Ok(mut e) = m.event(&row) {
                let err = e.prepare().unwrap_err();
                assert!(matches!(err, RouteError::CloudEvent(_)), "{err}");
            }
        }
    }

    #[test]
    fn a_row_header_may_not_shadow_an_attribute() {
        let m = mapping(Mode::Binary);
        for h in [
            &b"{\"ce_id\": \"x\"}"[..],
            b"{\"content-type\": \"x\"}",
            b"{\"subject\": \"x\"}",
        ] {
            let mut row = ROW;
            row[7] = Value::Text(h);
            let e = m.event(&row).unwrap();
            let err = e.for_each_header(|_, _| {}).unwrap_err();
            assert!(matches!(err, RouteError::CloudEventHeader(_)), "{err}");
        }
    }

    #[test]
    fn a_parked_cloudevent_is_released_identical() {
        for mode in [Mode::Binary, Mode::Structured] {
            let m = mapping(mode);
            let e = m.event(&ROW).unwrap();
            let wire = e.wire_record(Some("t"));
            let parked = e.parked_record(Some("t"));
            // Parked in outboxd's own form, with the raw created_at.
            assert_eq!(parked.payload.as_deref(), Some(&b"{\"a\": 1}"[..]));
            let c = Columns {
                cloudevents: Some(e.ce.as_ref().unwrap().spec.clone()),
                ..Default::default()
            };
            let names = c.resolve().unwrap();
            let topic = crate::model::topic::TopicTemplate::parse("t").unwrap();
            let (released, _) =
                super::super::release::rebuild(&parked, &topic, &names, &mut String::new())
                    .unwrap();
            assert_eq!(released.payload, wire.payload, "{mode:?}");
            assert_eq!(released.headers, wire.headers, "{mode:?}");
            assert_eq!(released.key, wire.key);
        }
    }

    #[test]
    fn json_media_types() {
        assert!(is_json("application/json"));
        assert!(is_json("application/vnd.acme+json; charset=utf-8"));
        assert!(!is_json("application/octet-stream"));
    }
}
