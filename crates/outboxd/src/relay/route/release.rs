//! A parked event rebuilt for release through the live router.
//!
//! `outbox_parked` is a table anyone with write access can change, and an operator's repair
//! edits its payload. So a released event is never published as stored: its topic comes from
//! the topic template, its key from `aggregate_id`, and the relay's own headers (`event_id`,
//! `event_type`, `aggregate_*`, `schema_version`) from the row's columns, exactly as the live
//! path would produce them. Of the stored headers only the row's extra ones and those of
//! `[source.columns] additional` are kept (the latter in their configured place and order, a
//! NULL one as a header without value); stored copies of reserved names are the relay's own
//! from when it parked the event and are recomputed, never trusted.

use super::Event;
use crate::model::columns::ColumnNames;
use crate::model::route::{is_reserved_header, RouteError};
use crate::model::topic::TopicTemplate;
use crate::poison::record::ParkedRecord;

/// The record to publish for a stored parked row, and the schema version it carries (for
/// validation). Err when the row cannot be routed (a field the router needs is missing).
pub fn rebuild(
    stored: &ParkedRecord,
    topic: &TopicTemplate,
    names: &ColumnNames,
    buf: &mut String,
) -> Result<(ParkedRecord, String), RouteError> {
    fn need<'a>(v: &'a Option<String>, name: &'static str) -> Result<&'a str, RouteError> {
        v.as_deref()
            .filter(|s| !s.is_empty())
            .ok_or(RouteError::NullField(name))
    }
    /// NULL where the live path allows it (Debezium preset).
    fn nullable<'a>(
        v: &'a Option<String>,
        name: &'static str,
        allowed: bool,
    ) -> Result<Option<&'a str>, RouteError> {
        match v {
            None if allowed => Ok(None),
            v => need(v, name).map(Some),
        }
    }
    let id_header = names.id_header;
    let aggregate_type = need(&stored.aggregate_type, "aggregate_type")?;
    let aggregate_id = nullable(&stored.aggregate_id, "aggregate_id", names.debezium_nulls)?;
    let event_type = nullable(&stored.event_type, "event_type", names.debezium_nulls)?;
    let payload = stored
        .payload
        .as_deref()
        .ok_or(RouteError::NullField("payload"))?;
    // As the live path: a header only when the event had one (a table without the column,
    // like Debezium's, sends none); "1" for validation either way.
    let stored_version = stored.headers.iter().find(|(k, _)| k == "schema_version");
    let schema_version = stored_version
        .and_then(|(_, v)| v.as_deref())
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .unwrap_or("1")
        .to_string();
    // The table's content type is recomputed from the configuration, like the relay's headers.
    let content_type = names.content_type.is_some();
    let placed = |k: &str| names.additional.iter().any(|p| &*p.header == k);
    let additional = names
        .additional
        .iter()
        .filter_map(|p| {
            let (_, v) = stored.headers.iter().find(|(k, _)| *k == *p.header)?;
            Some((
                p.header.clone(),
                v.as_deref().map(std::borrow::Cow::Borrowed),
            ))
        })
        .collect();
    let extra: serde_json::Map<String, serde_json::Value> = stored
        .headers
        .iter()
        .filter(|(k, _)| {
            !(is_reserved_header(k)
                || id_header && k.eq_ignore_ascii_case("id")
                || placed(k)
                || k == super::cloudevents::CREATED_AT_HEADER
                || content_type && k.eq_ignore_ascii_case(super::CONTENT_TYPE_HEADER))
        })
        .filter_map(|(k, v)| Some((k.clone(), serde_json::Value::String(v.clone()?))))
        .collect();
    let extra = (!extra.is_empty()).then(|| serde_json::Value::Object(extra).to_string());
    let version = stored.aggregate_version.map(|v| v.to_string());
    let event = Event {
        event_id: &stored.event_id,
        aggregate_type,
        aggregate_id,
        event_type,
        payload: std::borrow::Cow::Borrowed(payload),
        tombstone: false,
        aggregate_version: version.as_deref(),
        schema_version: stored_version.map(|_| schema_version.as_str()),
        headers: extra.as_deref(),
        created_at_ms: stored.timestamp_ms,
        id_header,
        additional,
        // A CloudEvent again, its `time` from the raw `created_at` parked with it.
        ce: names
            .cloudevents
            .clone()
            .map(|spec| super::cloudevents::Ce {
                spec,
                created_at: stored
                    .headers
                    .iter()
                    .find(|(k, _)| k == super::cloudevents::CREATED_AT_HEADER)
                    .and_then(|(_, v)| v.as_deref()),
            }),
        content_type: names.content_type.clone(),
        // The parked record keeps bytes, not the column's type: a payload that is no JSON came
        // from a bytea column (the router checks text payloads are JSON). A bytea payload that
        // happens to be JSON is released as a JSON CloudEvent: say so with `content_type`.
        binary: serde_json::from_slice::<serde::de::IgnoredAny>(payload).is_err(),
    };
    topic.render(event.aggregate_type, event.event_type, buf)?;
    let mut event = event;
    event.prepare()?;
    Ok((event.wire_record(Some(buf)), schema_version))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::columns::{Columns, Preset};

    fn stored() -> ParkedRecord {
        let h = |k: &str, v: &str| (k.to_string(), Some(v.to_string()));
        ParkedRecord {
            event_id: "e-1".into(),
            aggregate_type: Some("acct".into()),
            aggregate_id: Some("A-1".into()),
            aggregate_version: Some(3),
            event_type: Some("Deposited".into()),
            topic: Some("anything.the.attacker.wants".into()),
            key: Some(b"other-key".to_vec()),
            payload: Some(b"{}".to_vec()),
            headers: vec![
                h("event_id", "spoofed"),
                h("schema_version", "2"),
                h("AGGREGATE_VERSION", "99"),
                h("traceparent", "00-1"),
            ],
            timestamp_ms: Some(5),
        }
    }

    fn names(c: Columns) -> ColumnNames {
        c.resolve().unwrap()
    }

    fn headers(r: &ParkedRecord) -> Vec<(&str, Option<&str>)> {
        r.headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect()
    }

    #[test]
    fn topic_key_and_identity_come_from_the_columns() {
        let t = TopicTemplate::parse("outbox.event.{aggregate_type}").unwrap();
        let mut buf = String::new();
        let (r, sv) = rebuild(&stored(), &t, &names(Columns::default()), &mut buf).unwrap();
        assert_eq!(r.topic.as_deref(), Some("outbox.event.acct"));
        assert_eq!(r.key.as_deref(), Some(&b"A-1"[..]));
        assert_eq!(sv, "2");
        assert_eq!(
            headers(&r),
            [
                ("event_id", Some("e-1")),
                ("event_type", Some("Deposited")),
                ("aggregate_type", Some("acct")),
                ("aggregate_id", Some("A-1")),
                ("aggregate_version", Some("3")),
                ("schema_version", Some("2")),
                ("traceparent", Some("00-1")),
            ]
        );
    }

    #[test]
    fn a_row_the_router_cannot_route_is_named() {
        let t = TopicTemplate::parse("outbox.event.{aggregate_type}").unwrap();
        let mut s = stored();
        s.aggregate_type = None;
        let e = rebuild(&s, &t, &names(Columns::default()), &mut String::new()).unwrap_err();
        assert_eq!(e, RouteError::NullField("aggregate_type"));
        // Without the Debezium preset a NULL aggregate id or event type is no event.
        let mut s = stored();
        s.aggregate_id = None;
        let e = rebuild(&s, &t, &names(Columns::default()), &mut String::new()).unwrap_err();
        assert_eq!(e, RouteError::NullField("aggregate_id"));
    }

    #[test]
    fn debezium_nulls_and_placed_headers_are_released_as_the_live_path_sends_them() {
        let t = TopicTemplate::parse("outbox.event.{aggregate_type}").unwrap();
        let n = names(Columns {
            preset: Preset::Debezium,
            additional: vec!["tenant_id:header".into(), "type:header:eventType".into()],
            ..Columns::default()
        });
        let h = |k: &str, v: Option<&str>| (k.to_string(), v.map(str::to_string));
        let s = ParkedRecord {
            aggregate_id: None,
            event_type: None,
            aggregate_version: None,
            // As parked: in the live order, a NULL placed column as a header without value.
            headers: vec![
                h("event_id", Some("e-1")),
                h("aggregate_type", Some("acct")),
                h("id", Some("spoofed")),
                h("tenant_id", Some("t-9")),
                h("eventType", None),
            ],
            ..stored()
        };
        let mut buf = String::new();
        let (r, _) = rebuild(&s, &t, &n, &mut buf).unwrap();
        assert_eq!(
            r.key, None,
            "a NULL aggregate id is a record with a null key"
        );
        assert_eq!(
            headers(&r),
            [
                ("event_id", Some("e-1")),
                ("aggregate_type", Some("acct")),
                ("id", Some("e-1")),
                ("tenant_id", Some("t-9")),
                ("eventType", None),
            ]
        );
        // A template that needs the missing event type cannot route it.
        let by_type = TopicTemplate::parse("{event_type}").unwrap();
        let e = rebuild(&s, &by_type, &n, &mut buf).unwrap_err();
        assert_eq!(e, RouteError::NullField("event_type"));
    }
}
