//! The CloudEvents router's unit tests.

use super::time::rfc3339;
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
    assert_eq!(
        t("2026-12-02 12:00:00+0530").as_deref(),
        Some("2026-12-02T12:00:00+05:30")
    );
    // Seconds in an offset (historic zones): no RFC 3339 form.
    assert_eq!(t("1850-01-01 12:00:00+00:53:28"), None);
    assert_eq!(t("2026-12-02 12:00:00.+00"), None);
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
/// The outbox table's relation; `payload_oid`: the payload column's type.
fn rel(payload_oid: u32) -> Relation {
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
    Relation {
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
    }
}

fn mapping_with(mode: Mode, payload_oid: u32, content_type: Option<&str>) -> RowMapping {
    let rel = rel(payload_oid);
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
    Value::Text(b"{\"traceparent\": \"00-ab-cd-01\", \"tenant_id\": \"t9\", \"region\": \"eu\"}"),
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
        assert_eq!(prepared, plain, "the check keeps nothing");
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

/// Issue 55: only the attributes outboxd sets are refused, each named in the reason.
#[test]
fn a_row_header_may_not_shadow_an_attribute() {
    for mode in [Mode::Binary, Mode::Structured] {
        let m = mapping(mode);
        for (h, attribute) in [
            (&b"{\"ce_id\": \"x\"}"[..], "id"),
            (b"{\"content-type\": \"x\"}", "datacontenttype"),
            (b"{\"subject\": \"x\"}", "subject"),
            (b"{\"ce_time\": \"x\"}", "time"),
            (b"{\"ce_partitionkey\": \"x\"}", "partitionkey"),
            (b"{\"ce_dataschema\": \"x\"}", "dataschema"),
            (b"{\"ce_traceparent\": \"x\"}", "traceparent"),
            (b"{\"ce_data\": \"x\"}", "data"),
            (b"{\"CE_Type\": \"x\"}", "type"),
        ] {
            let mut row = ROW;
            row[7] = Value::Text(h);
            let mut e = m.event(&row).unwrap();
            let err = e.prepare().unwrap_err();
            assert_eq!(
                err,
                RouteError::CloudEventAttribute {
                    header: serde_json::from_slice::<serde_json::Map<_, _>>(h)
                        .unwrap()
                        .keys()
                        .next()
                        .unwrap()
                        .clone(),
                    attribute
                },
                "{mode:?}"
            );
            assert_eq!(err.class(), "reserved_header");
            assert!(
                err.to_string()
                    .contains(&format!("attribute `{attribute}`")),
                "{err}"
            );
            assert!(e.for_each_header(|_, _| {}).is_err());
        }
    }
}

/// Issue 55: a `ce_<name>` row header is the extension `<name>`: the header itself in binary
/// mode, an envelope member (and no header) in structured mode.
#[test]
fn a_ce_row_header_is_an_extension_in_both_modes() {
    let mut row = ROW;
    row[7] = Value::Text(
        b"{\"ce_phase\": \"beta\", \"phase\": \"plain\", \"ce_averyveryverylongname1\": \"7\", \"ce_2fa\": \"on\"}",
    );
    let m = mapping(Mode::Binary);
    let mut e = m.event(&row).unwrap();
    e.prepare().unwrap();
    let hs = headers(&e);
    let get = |k: &str| {
        hs.iter()
            .filter(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(get("ce_phase"), ["beta"]);
    assert_eq!(get("phase"), ["plain"], "no ce_ prefix: a Kafka header");
    assert_eq!(
        get("ce_averyveryverylongname1"),
        ["7"],
        "over 20 characters: valid"
    );
    assert_eq!(get("ce_2fa"), ["on"]);

    let m = mapping(Mode::Structured);
    let mut e = m.event(&row).unwrap();
    e.prepare().unwrap();
    let hs = headers(&e);
    assert!(hs.iter().all(|(k, _)| !k.starts_with("ce_")), "{hs:?}");
    // `phase` would be promoted, but `ce_phase` names that extension: it stays a header.
    assert!(
        hs.contains(&("phase".to_string(), "plain".to_string())),
        "{hs:?}"
    );
    let bytes = e.value().into_owned();
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert_eq!(text.matches("\"phase\":").count(), 1, "{text}");
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["phase"], "beta");
    assert_eq!(v["averyveryverylongname1"], "7");
    assert_eq!(v["2fa"], "on");
    assert_eq!(v["region"], serde_json::Value::Null);
}

/// Issue 55: a `ce_` header whose name CloudEvents does not allow is parked, naming the rule.
#[test]
fn an_invalid_extension_name_is_refused_with_the_rule() {
    for mode in [Mode::Binary, Mode::Structured] {
        let m = mapping(mode);
        for h in [
            "ce_Phase",
            "CE_phase",
            "ce_my-ext",
            "ce_my_ext",
            "ce_",
            "ce_é",
        ] {
            let mut row = ROW;
            let json = serde_json::json!({ h: "x" }).to_string();
            row[7] = Value::Text(json.as_bytes());
            let mut e = m.event(&row).unwrap();
            let err = e.prepare().unwrap_err();
            assert_eq!(
                err,
                RouteError::CloudEventExtensionName(h.into()),
                "{mode:?}"
            );
            assert_eq!(err.class(), "invalid_event");
            assert!(err
                .to_string()
                .contains("lower-case ASCII letters a-z and digits 0-9"));
        }
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
            super::super::release::rebuild(&parked, &topic, &names, &mut String::new()).unwrap();
        assert_eq!(released.payload, wire.payload, "{mode:?}");
        assert_eq!(released.headers, wire.headers, "{mode:?}");
        assert_eq!(released.key, wire.key);
    }
}

/// The router's cost per event, plain against both CloudEvents modes (issue 55): a
/// criterion-free micro-benchmark of what the live path does per row (`prepare`, the
/// headers, the value), without the broker. Run in release:
/// `cargo test --release -p outboxd --lib cost_per_event -- --ignored --nocapture`.
#[test]
#[ignore]
fn cost_per_event() {
    let mut row = ROW;
    row[7] = Value::Null; // the bench's rows: no extra headers
    let plain = {
        let c = Columns::default();
        RowMapping::resolve(&c.resolve().unwrap(), &rel(3802), &mut vec![]).unwrap()
    };
    let n = 400_000u32;
    for (what, m) in [
        ("plain", plain),
        ("binary", mapping(Mode::Binary)),
        ("structured", mapping(Mode::Structured)),
    ] {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            let mut bytes = 0usize;
            for _ in 0..n {
                let mut e = m.event(std::hint::black_box(&row)).unwrap();
                e.prepare().unwrap();
                e.for_each_header(|k, v| bytes += k.len() + v.map_or(0, <[u8]>::len))
                    .unwrap();
                bytes += e.value().len();
            }
            std::hint::black_box(bytes);
            best = best.min(t.elapsed().as_secs_f64() * 1e9 / f64::from(n));
        }
        eprintln!("{what:<10} {best:>7.0} ns per event (best of 5)");
    }
}

#[test]
fn json_media_types() {
    assert!(is_json("application/json"));
    assert!(is_json("application/vnd.acme+json; charset=utf-8"));
    assert!(!is_json("application/octet-stream"));
}

/// Values that need JSON escaping (quotes, backslashes, control characters, non-ASCII) keep a
/// valid envelope and arrive as written; a non-string header value is its JSON text.
#[test]
fn the_envelope_escapes_what_needs_it() {
    let m = mapping(Mode::Structured);
    let mut row = ROW;
    row[1] = Value::Text("or\"d\\er\u{1}ü".as_bytes());
    row[7] =
        Value::Text(r#"{"ce_note": "a \"q\" \\ \n ü", "ce_count": 5, "ce_gone": null}"#.as_bytes());
    let e = m.event(&row).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&e.value()).expect("valid JSON");
    assert_eq!(v["aggregatetype"], "or\"d\\er\u{1}ü");
    assert_eq!(v["type"], "com.acme.or\"d\\er\u{1}ü.OrderPlaced");
    assert_eq!(v["note"], "a \"q\" \\ \n ü");
    assert_eq!(v["count"], "5");
    assert!(v.get("gone").is_none());
}
