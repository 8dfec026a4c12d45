//! A parked event rebuilt for release through the live router.
//!
//! `outbox_parked` is a table anyone with write access can change, and an operator's repair
//! edits its payload. So a released event is never published as stored: its topic comes from
//! the topic template, its key from `aggregate_id`, and the relay's own headers (`event_id`,
//! `event_type`, `aggregate_*`, `schema_version`) from the row's columns, exactly as the live
//! path would produce them. Of the stored headers only the row's extra ones are kept; stored
//! copies of reserved names are the relay's own from when it parked the event and are
//! recomputed, never trusted.

use super::{is_reserved_header, Event, RouteError, TopicTemplate};
use crate::poison::record::ParkedRecord;

/// The record to publish for a stored parked row, and the schema version it carries (for
/// validation). Err when the row cannot be routed (a field the router needs is missing).
pub fn rebuild(
    stored: &ParkedRecord,
    topic: &TopicTemplate,
    id_header: bool,
    buf: &mut String,
) -> Result<(ParkedRecord, String), RouteError> {
    fn need<'a>(v: &'a Option<String>, name: &'static str) -> Result<&'a str, RouteError> {
        v.as_deref()
            .filter(|s| !s.is_empty())
            .ok_or(RouteError::NullField(name))
    }
    let aggregate_type = need(&stored.aggregate_type, "aggregate_type")?;
    let aggregate_id = need(&stored.aggregate_id, "aggregate_id")?;
    let event_type = need(&stored.event_type, "event_type")?;
    let payload = stored
        .payload
        .as_deref()
        .ok_or(RouteError::NullField("payload"))?;
    let schema_version = stored
        .headers
        .iter()
        .find(|(k, _)| k == "schema_version")
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .unwrap_or("1")
        .to_string();
    let extra: serde_json::Map<String, serde_json::Value> = stored
        .headers
        .iter()
        .filter(|(k, _)| !(is_reserved_header(k) || id_header && k.eq_ignore_ascii_case("id")))
        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
        .collect();
    let extra = (!extra.is_empty()).then(|| serde_json::Value::Object(extra).to_string());
    let version = stored.aggregate_version.map(|v| v.to_string());
    let event = Event {
        event_id: &stored.event_id,
        aggregate_type,
        aggregate_id,
        event_type,
        payload,
        tombstone: false,
        aggregate_version: version.as_deref(),
        schema_version: Some(&schema_version),
        headers: extra.as_deref(),
        created_at_ms: stored.timestamp_ms,
        id_header,
    };
    topic.render(&event, buf);
    Ok((event.parked_record(buf), schema_version))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> ParkedRecord {
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
                ("event_id".into(), "spoofed".into()),
                ("schema_version".into(), "2".into()),
                ("AGGREGATE_VERSION".into(), "99".into()),
                ("traceparent".into(), "00-1".into()),
            ],
            timestamp_ms: Some(5),
        }
    }

    #[test]
    fn topic_key_and_identity_come_from_the_columns() {
        let t = TopicTemplate::parse("outbox.event.{aggregate_type}").unwrap();
        let mut buf = String::new();
        let (r, sv) = rebuild(&stored(), &t, false, &mut buf).unwrap();
        assert_eq!(r.topic.as_deref(), Some("outbox.event.acct"));
        assert_eq!(r.key.as_deref(), Some(&b"A-1"[..]));
        assert_eq!(sv, "2");
        let h: Vec<(&str, &str)> = r
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            h,
            [
                ("event_id", "e-1"),
                ("event_type", "Deposited"),
                ("aggregate_type", "acct"),
                ("aggregate_id", "A-1"),
                ("aggregate_version", "3"),
                ("schema_version", "2"),
                ("traceparent", "00-1"),
            ]
        );
    }

    #[test]
    fn a_row_the_router_cannot_route_is_named() {
        let t = TopicTemplate::parse("outbox.event.{aggregate_type}").unwrap();
        let mut s = stored();
        s.aggregate_type = None;
        let e = rebuild(&s, &t, false, &mut String::new()).unwrap_err();
        assert_eq!(e, RouteError::NullField("aggregate_type"));
    }
}
