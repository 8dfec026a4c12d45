//! Fuzz harness of the router (issue 15): any row a server could send (NULLs where values
//! belong, bytes that are not UTF-8, huge values, odd or deeply nested JSON in the headers
//! column, timestamps of any shape) and any Relation (columns missing, repeated, reordered, of
//! any of the types a header may come from), with any columns placed in headers, is routed or
//! refused — never a panic. Proptest's default of 256 cases per property suits CI;
//! `PROPTEST_CASES=100000` runs long (docs/development.md, "Fuzzing").

use super::{parse_timestamptz_ms, RowMapping};
use crate::model::columns::{Columns, Preset};
use crate::model::topic::TopicTemplate;
use crate::relay::pgoutput::{Column, Relation, Value};
use proptest::prelude::*;

const NAMES: [&str; 14] = [
    "event_id",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "event_type",
    "schema_version",
    "payload",
    "headers",
    "created_at",
    // Debezium's preset, and strangers.
    "id",
    "aggregatetype",
    "aggregateid",
    "type",
    "",
];

/// A column value as the decoder yields it, owned.
#[derive(Debug, Clone)]
enum V {
    Null,
    Unchanged,
    Text(Vec<u8>),
}

/// JSON of any shape, as the `headers` jsonb column could hold it (and some that it could not).
fn json() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        ".{0,12}".prop_map(serde_json::Value::from),
    ];
    let tree = leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
            proptest::collection::btree_map(
                prop_oneof![
                    ".{0,8}",
                    Just("event_id".to_string()),
                    Just("EVENT_TYPE".to_string()),
                    Just("Aggregate_Version".to_string()),
                    Just("traceparent".to_string()),
                ],
                inner,
                0..6
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    prop_oneof![
        4 => tree.prop_map(|v| v.to_string()),
        // Truncated or with a byte replaced: not JSON any more.
        1 => (tree_text(), any::<usize>(), any::<u8>()).prop_map(|(t, i, b)| {
            let mut bytes = t.into_bytes();
            let n = bytes.len();
            bytes.truncate(i % (n + 1));
            bytes.push(b);
            String::from_utf8_lossy(&bytes).into_owned()
        }),
        // Nesting far past serde_json's recursion limit: an error, not a stack overflow.
        1 => (1usize..20_000, prop_oneof![Just("["), Just("{\"a\":")]).prop_map(|(n, open)| {
            format!("{{\"h\":{}", open.repeat(n))
        }),
        // Many headers.
        1 => (1usize..5_000).prop_map(|n| {
            let pairs: Vec<String> = (0..n).map(|i| format!("\"k{i}\":\"v\"")).collect();
            format!("{{{}}}", pairs.join(","))
        }),
    ]
}

fn tree_text() -> impl Strategy<Value = String> {
    proptest::collection::btree_map(".{0,8}", ".{0,8}", 0..4)
        .prop_map(|m| serde_json::to_string(&m).unwrap())
}

/// Timestamps near the shape the pinned session renders, and far from it.
fn timestamp() -> impl Strategy<Value = String> {
    prop_oneof![
        concat!(
            "[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}",
            "(\\.[0-9]{0,12})?(\\+00|[+-][0-9]{2}(:[0-9]{2})?)"
        ),
        "[0-9+-]{1,8}-[0-9]{1,3}-[0-9]{1,3} [0-9:]{1,9}(\\.[0-9]{0,3})?[+-]?[0-9:]{0,6}",
        Just("infinity".to_string()),
        Just("-infinity".to_string()),
        Just("9999-12-31 23:59:60.999999+00".to_string()),
        Just("0000-01-01 00:00:00+00".to_string()),
        Just("262143-12-31 23:59:59+14:59".to_string()),
        Just("0044-03-15 12:00:00+00 BC".to_string()),
        Just("10000-01-01 00:00:00.5+00 BC".to_string()),
        "[0-9]{4,6}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,12})?\\+00( BC)?",
        ".{0,32}",
    ]
}

fn value() -> impl Strategy<Value = V> {
    prop_oneof![
        1 => prop_oneof![Just("t"), Just("f"), Just("true"), Just("yes")]
            .prop_map(|s| V::Text(s.as_bytes().to_vec())),
        1 => Just(V::Null),
        1 => Just(V::Unchanged),
        6 => ".{0,24}".prop_map(|s| V::Text(s.into_bytes())),
        1 => proptest::collection::vec(any::<u8>(), 0..32).prop_map(V::Text),
        3 => json().prop_map(|s| V::Text(s.into_bytes())),
        2 => timestamp().prop_map(|s| V::Text(s.into_bytes())),
        // Huge values (a 1 GB jsonb is legal in Postgres; a few MB suffice here).
        1 => (0usize..4 << 20, any::<u8>()).prop_map(|(n, b)| V::Text(vec![b; n])),
    ]
}

/// Every known column in any order (so both presets resolve), or any columns at all.
fn relation() -> impl Strategy<Value = Relation> {
    let names = prop_oneof![
        3 => Just(NAMES[..13].to_vec()).prop_shuffle(),
        1 => proptest::collection::vec(proptest::sample::select(&NAMES[..]), 0..16),
    ];
    // text, boolean, timestamptz(p), jsonb, numeric (refused in headers).
    let ty = prop_oneof![
        4 => Just((25u32, -1i32)),
        1 => Just((16, -1)),
        1 => (-1i32..8).prop_map(|p| (1184, p)),
        1 => Just((3802, -1)),
        1 => Just((1700, -1)),
    ];
    (names, proptest::collection::vec(ty, 16)).prop_map(|(names, types)| Relation {
        id: 1,
        namespace: "public".into(),
        name: "outbox".into(),
        columns: names
            .into_iter()
            .zip(types)
            .map(|(n, (type_oid, type_modifier))| Column {
                name: n.to_string(),
                type_oid,
                type_modifier,
            })
            .collect(),
    })
}

fn template() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("outbox.event.{aggregate_type}".to_string()),
        Just("{event_type}".to_string()),
        Just("{aggregate_type}.{event_type}".to_string()),
        "[a-z.{}_]{0,40}",
        ".{0,20}",
    ]
}

proptest! {
    #[test]
    fn any_row_is_routed_or_refused(
        preset in prop_oneof![Just(Preset::Outboxd), Just(Preset::Debezium)],
        (rel, row) in relation().prop_flat_map(|rel| {
            // About one value per column; a tuple may also be short or long.
            let n = rel.columns.len();
            (Just(rel), proptest::collection::vec(value(), n.saturating_sub(1)..=n + 1))
        }),
        template in template(),
        placed in proptest::collection::vec(proptest::sample::select(&NAMES[..13]), 0..4),
    ) {
        let additional = placed
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c}:header:h{i}"))
            .collect();
        let names = Columns { preset, additional, ..Columns::default() }.resolve().unwrap();
        let mut missing = Vec::new();
        let Ok(mapping) = RowMapping::resolve(&names, &rel, &mut missing) else {
            return Ok(());
        };
        let values: Vec<Value<'_>> = row
            .iter()
            .map(|v| match v {
                V::Null => Value::Null,
                V::Unchanged => Value::Unchanged,
                V::Text(t) => Value::Text(t),
            })
            .collect();
        let event = match mapping.event(&values) {
            Ok(e) => e,
            Err(e) => {
                let _ = (e.to_string(), e.class());
                let _ = mapping.partial(&values);
                return Ok(());
            }
        };
        let mut headers = 0usize;
        let sent = event.for_each_header(|_, _| headers += 1);
        match &sent {
            // event_id and aggregate_type always; event_type and aggregate_id unless NULL.
            Ok(()) => prop_assert!(headers >= 2 + placed.len()),
            Err(e) => { let _ = (e.to_string(), e.class()); }
        }
        let mut topic = String::new();
        let routed = TopicTemplate::parse(&template)
            .is_ok_and(|t| t.render(event.aggregate_type, event.event_type, &mut topic).is_ok());
        let rec = event.parked_record(routed.then_some(topic.as_str()));
        if sent.is_ok() {
            prop_assert_eq!(rec.headers.len(), headers, "parked as it would be sent");
        }
        prop_assert_eq!(rec.event_id.as_str(), event.event_id);
        prop_assert!(event.size() >= event.payload.len());
    }

    #[test]
    fn any_header_json_is_read_or_refused(headers in json()) {
        let e = super::Event {
            event_id: "e",
            aggregate_type: "a",
            aggregate_id: Some("1"),
            event_type: Some("T"),
            payload: std::borrow::Cow::Borrowed(b"{}"),
            tombstone: false,
            aggregate_version: None,
            schema_version: None,
            headers: Some(&headers),
            created_at_ms: None,
            id_header: true,
            additional: vec![("tenant".into(), None), ("Traceparent".into(), Some("x".into()))],
            ce: None,
            content_type: Some("application/x-protobuf".into()),
            binary: true,
        };
        let _ = e.for_each_header(|_, _| {});
        let _ = e.parked_record(Some("t"));
    }

    #[test]
    fn any_timestamp_is_read_or_none(t in timestamp()) {
        let _ = parse_timestamptz_ms(&t);
    }

    #[test]
    fn any_topic_template_is_parsed_or_refused(t in ".{0,40}") {
        let _ = TopicTemplate::parse(&t);
    }
}
