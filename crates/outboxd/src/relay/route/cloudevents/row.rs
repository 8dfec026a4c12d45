//! The row's own headers (the `headers` column) in a CloudEvent (issues 42 and 55).
//!
//! Each header is one of:
//! - `ce_<name>`: the extension attribute `<name>`, as the Kafka protocol binding carries one
//!   (binary mode: the header itself; structured mode: the envelope member `<name>`). `<name>`
//!   must be a CloudEvents 1.0 attribute name (lower-case ASCII letters and digits; longer than
//!   the recommended 20 characters is allowed, the SDKs accept it), else the event is parked
//!   ([`RouteError::CloudEventExtensionName`], `invalid_event`); one of the attributes outboxd
//!   sets itself ([`crate::model::cloudevents::own_attribute`]) is parked as a collision naming
//!   the attribute ([`RouteError::CloudEventAttribute`], `reserved_header`).
//! - `traceparent`/`tracestate`: the Distributed Tracing extension's attributes, and also
//!   Kafka headers (for Kafka tracing instrumentation).
//! - any other name: a Kafka header; in structured mode an extension instead when the name is
//!   a valid extension name of at most 20 characters and no `ce_` header names the same
//!   extension. A name that is an attribute outboxd sets, or `content-type`, is parked as a
//!   collision; the relay's own outbox headers and the placed columns' as [`RouteError::ReservedHeader`].

use super::Event;
use crate::model::cloudevents::{is_attribute_name, is_extension_name, own_attribute, OWN, TRACE};
use crate::model::route::{is_reserved_header, RouteError};

/// What one row header is in a CloudEvent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Item<'h> {
    /// `ce_<name>`: the extension `name`; binary mode sends the header as it is.
    Extension { header: &'h str, name: &'h str },
    /// `traceparent` or `tracestate`: an attribute and a Kafka header.
    Trace(&'h str),
    /// Any other header; `promoted`: an extension in structured mode.
    Plain { header: &'h str, promoted: bool },
}

pub type Map = serde_json::Map<String, serde_json::Value>;

/// The headers column's JSON object.
pub fn parse(h: &str) -> Result<Map, RouteError> {
    serde_json::from_str(h).map_err(|e| RouteError::BadHeaders(e.to_string()))
}

/// What `k` is, or why the event cannot carry it.
fn classify<'h>(e: &Event<'_>, map: &Map, k: &'h str) -> Result<Item<'h>, RouteError> {
    let placed = |n: &str| e.additional.iter().any(|(a, _)| a.eq_ignore_ascii_case(n));
    if is_reserved_header(k) || placed(k) {
        return Err(RouteError::ReservedHeader(k.to_string()));
    }
    let collision = |attribute| RouteError::CloudEventAttribute {
        header: k.to_string(),
        attribute,
    };
    if let Some(name) = k
        .get(..3)
        .filter(|p| p.eq_ignore_ascii_case("ce_"))
        .map(|_| &k[3..])
    {
        if let Some(a) = own_attribute(name) {
            return Err(collision(a));
        }
        if !k.starts_with("ce_") || !is_attribute_name(name) {
            return Err(RouteError::CloudEventExtensionName(k.to_string()));
        }
        // A placed column structured mode would promote to the same extension.
        if placed(name) {
            return Err(RouteError::ReservedHeader(k.to_string()));
        }
        return Ok(Item::Extension { header: k, name });
    }
    if k.eq_ignore_ascii_case(crate::model::route::CONTENT_TYPE_HEADER) {
        return Err(collision("datacontenttype"));
    }
    if let Some(t) = TRACE.iter().find(|t| **t == k) {
        return Ok(Item::Trace(t));
    }
    if let Some(a) = OWN.iter().find(|a| a.eq_ignore_ascii_case(k)) {
        return Err(collision(a));
    }
    let promoted = is_extension_name(k)
        && !map
            .keys()
            .any(|o| o.strip_prefix("ce_").is_some_and(|n| n == k));
    Ok(Item::Plain {
        header: k,
        promoted,
    })
}

/// Checks every header, then calls `f(item, value)` for each one with a value, in the map's
/// order (a JSON `null` is no header; other non-strings are sent as their JSON text). Nothing
/// is called when any header is refused.
pub fn each<'h>(
    e: &Event<'_>,
    map: &'h Map,
    mut f: impl FnMut(Item<'h>, &str),
) -> Result<(), RouteError> {
    for k in map.keys() {
        classify(e, map, k)?;
    }
    for (k, v) in map {
        let item = classify(e, map, k)?;
        match v {
            serde_json::Value::String(s) => f(item, s),
            serde_json::Value::Null => {}
            other => f(item, &other.to_string()),
        }
    }
    Ok(())
}
