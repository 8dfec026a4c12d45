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
//! row's headers; they also stay Kafka headers, for Kafka tracing instrumentation), and the
//! row's own extensions: a `ce_<name>` row header is the extension `<name>` (issue 55; the
//! rules and what is parked: [`row`]). Other headers: Kafka headers in binary mode; in
//! structured mode extensions when their name is a valid extension name, Kafka headers
//! otherwise (nothing is dropped).
//!
//! Cost (issue 55): each attribute is written once, straight into the record's header list or
//! the envelope ([`attrs`]); the envelope is written in one pass into one buffer.

mod attrs;
mod row;
mod time;

use super::Event;
use crate::model::cloudevents::{is_extension_name, own_attribute, CloudEvents, Mode};
use crate::model::route::RouteError;
use base64::Engine as _;
use row::Item;
use std::sync::Arc;

/// The CloudEvents side of one event: the table's settings and the raw `created_at` text
/// (kept to the microsecond, unlike the record timestamp).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ce<'a> {
    pub spec: Arc<CloudEvents>,
    pub created_at: Option<&'a str>,
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

/// The stage's check, once per event before it is routed: the `type` template renders and
/// every row header can travel (see [`row`]). What it passed cannot fail when the headers and
/// the envelope are written; nothing is built or kept.
pub fn check(e: &Event<'_>, ce: &Ce<'_>) -> Result<(), RouteError> {
    attrs::check(e, ce)?;
    if let Some(h) = e.headers {
        row::each(e, &row::parse(h)?, |_, _| {})?;
    }
    Ok(())
}

/// The placed columns (`[source.columns] additional`) structured mode carries as extensions:
/// a value, a valid extension name, not an attribute outboxd sets.
fn promoted(k: &str, v: Option<&str>) -> bool {
    v.is_some() && is_extension_name(k) && own_attribute(k).is_none()
}

/// Binary mode: `ce_<attr>` headers (`content-type` for `datacontenttype`), the placed
/// columns, then the row's headers (its `ce_<name>` extensions as they are, `traceparent`
/// and `tracestate` both as `ce_` attributes and as themselves). Structured mode:
/// `content-type` and the headers that are no extension (the others are in the envelope).
pub fn for_each_header(
    e: &Event<'_>,
    ce: &Ce<'_>,
    mut f: impl FnMut(&str, Option<&[u8]>),
) -> Result<(), RouteError> {
    let map = e.headers.map(row::parse).transpose()?;
    match ce.spec.mode {
        Mode::Binary => {
            attrs::each(e, ce, |a, v| f(a.header, Some(v.as_bytes())))?;
            for (k, v) in &e.additional {
                f(k, v.as_deref().map(str::as_bytes));
            }
            if let Some(map) = &map {
                row::each(e, map, |item, v| match item {
                    Item::Extension { header, .. } | Item::Plain { header, .. } => {
                        f(header, Some(v.as_bytes()))
                    }
                    Item::Trace(t) => {
                        let mut name = [0u8; 16];
                        f(ce_name(&mut name, t), Some(v.as_bytes()));
                        f(t, Some(v.as_bytes()));
                    }
                })?;
            }
        }
        Mode::Structured => {
            f("content-type", Some(STRUCTURED_CONTENT_TYPE.as_bytes()));
            for (k, v) in &e.additional {
                if !promoted(k, v.as_deref()) {
                    f(k, v.as_deref().map(str::as_bytes));
                }
            }
            if let Some(map) = &map {
                row::each(e, map, |item, v| match item {
                    Item::Extension { .. } | Item::Plain { promoted: true, .. } => {}
                    Item::Trace(header) | Item::Plain { header, .. } => {
                        f(header, Some(v.as_bytes()))
                    }
                })?;
            }
        }
    }
    Ok(())
}

/// `ce_<name>` in `buf` (the trace attributes' headers; `name` is at most 13 bytes).
fn ce_name<'b>(buf: &'b mut [u8; 16], name: &str) -> &'b str {
    let n = 3 + name.len().min(13);
    buf[..3].copy_from_slice(b"ce_");
    buf[3..n].copy_from_slice(&name.as_bytes()[..n - 3]);
    std::str::from_utf8(&buf[..n]).unwrap_or_default()
}

/// Appends `s` as a JSON string: copied as is when nothing needs escaping (ids, versions,
/// times, types almost always), else escaped by serde_json.
fn json_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Strings serialize infallibly.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

/// Appends `,"name":"value"` (no comma after the opening brace).
fn member(out: &mut Vec<u8>, name: &str, value: &str) {
    if out.len() > 1 {
        out.push(b',');
    }
    json_str(out, name);
    out.push(b':');
    json_str(out, value);
}

/// Structured mode's value: the JSON envelope (`data` for a JSON payload, `data_base64`
/// otherwise), written in one pass. `Ok(None)`: binary mode or a tombstone (the payload is the
/// value as it is).
pub fn envelope(e: &Event<'_>, ce: &Ce<'_>) -> Result<Option<Vec<u8>>, RouteError> {
    if ce.spec.mode != Mode::Structured || e.tombstone {
        return Ok(None);
    }
    let map = e.headers.map(row::parse).transpose()?;
    let json = embeds_as_json(e);
    let data = if json {
        e.payload.len()
    } else {
        base64::encoded_len(e.payload.len(), true).unwrap_or(0)
    };
    let mut out = Vec::with_capacity(data + 448 + e.headers.map_or(0, str::len));
    out.push(b'{');
    attrs::each(e, ce, |a, v| member(&mut out, a.name, v))?;
    for (k, v) in &e.additional {
        if let Some(v) = v.as_deref().filter(|v| promoted(k, Some(v))) {
            member(&mut out, k, v);
        }
    }
    if let Some(map) = &map {
        row::each(e, map, |item, v| match item {
            Item::Extension { name, .. } => member(&mut out, name, v),
            Item::Trace(name)
            | Item::Plain {
                header: name,
                promoted: true,
            } => member(&mut out, name, v),
            Item::Plain { .. } => {}
        })?;
    }
    if json {
        // The payload is one JSON value (json/jsonb, text checked by the router, or bytes just
        // parsed): embedded as is.
        out.extend_from_slice(b",\"data\":");
        out.extend_from_slice(&e.payload);
    } else {
        out.extend_from_slice(b",\"data_base64\":\"");
        let at = out.len();
        out.resize(at + data, 0);
        let n = base64::engine::general_purpose::STANDARD
            .encode_slice(&*e.payload, &mut out[at..])
            .unwrap_or(0);
        out.truncate(at + n);
        out.push(b'"');
    }
    out.push(b'}');
    Ok(Some(out))
}

#[cfg(test)]
mod tests;
