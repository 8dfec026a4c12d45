//! The producer's hooks into `obs::telemetry`: a publish span per sampled record, started
//! before the record is handed to librdkafka, its `traceparent` header rewritten to the span,
//! ended by the delivery report. Nothing here runs without `[telemetry]`.

use super::{Ctx, Verdict};
use crate::error::RelayError;
use crate::obs::telemetry::span::{Failure, Publish, Publisher, RowTrace, Started, Telemetry};
use crate::poison::record::ParkedRecord;
use crate::relay::route::Event;
use rdkafka::message::{Header, Message as _, OwnedHeaders};
use rdkafka::producer::DeliveryResult;

/// The producer's telemetry (`None`: `[telemetry]` is off), on the relay's trace pipeline.
pub(super) fn telemetry(
    cfg: &crate::config::Config,
    observed: &crate::obs::Observed,
    publisher: Publisher,
) -> Result<Option<Telemetry>, RelayError> {
    Ok(observed
        .traces(cfg)
        .map_err(RelayError::Setup)?
        .map(|t| Telemetry::new(t, publisher)))
}

/// The span of a stream event (`None`: telemetry off, or the row is not sampled).
pub(super) fn start_event(ctx: &Ctx, topic: &str, e: &Event<'_>) -> Option<Started> {
    let t = ctx.telemetry.as_ref()?;
    let row = row_trace(e.headers);
    let p = Publish {
        topic,
        event_id: e.event_id,
        key: e.aggregate_id,
    };
    t.start(&p, &row, None)
}

/// The trace context of the row's `headers` column: read from that JSON alone, and only when
/// it names a `traceparent` at all (most rows of most tables do not; the record's headers are
/// not built twice for it).
fn row_trace(headers: Option<&str>) -> RowTrace {
    let row = RowTrace::default();
    let Some(h) = headers.filter(|h| {
        h.as_bytes()
            .windows(b"traceparent".len())
            .any(|w| w.eq_ignore_ascii_case(b"traceparent"))
    }) else {
        return row;
    };
    // Only the two names are kept: the other members are skipped, not built (issue 55).
    serde_json::from_str::<TraceHeaders>(h).map_or(row, |t| t.0)
}

/// The `traceparent` / `tracestate` members of a headers object (string values only).
struct TraceHeaders(RowTrace);

impl<'de> serde::Deserialize<'de> for TraceHeaders {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, Visitor};
        struct Members;
        impl<'de> Visitor<'de> for Members {
            type Value = RowTrace;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RowTrace, A::Error> {
                let mut row = RowTrace::default();
                while let Some(Name(name)) = m.next_key::<Name>()? {
                    match name {
                        Some(k) => {
                            if let serde_json::Value::String(v) = m.next_value()? {
                                row.see(k, Some(v.as_bytes()));
                            }
                        }
                        None => {
                            m.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(row)
            }
        }
        d.deserialize_map(Members).map(TraceHeaders)
    }
}

/// A member name: `traceparent` or `tracestate` (any case), else `None` (not kept).
struct Name(Option<&'static str>);

impl<'de> serde::Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Name;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E: serde::de::Error>(self, k: &str) -> Result<Name, E> {
                let name = ["traceparent", "tracestate"]
                    .into_iter()
                    .find(|n| k.eq_ignore_ascii_case(n));
                Ok(Name(name))
            }
        }
        d.deserialize_str(V)
    }
}

/// The span of a released parked record: in the trace its stored `traceparent` names (the
/// original publish span), linked to that span.
pub(super) fn start_release(ctx: &Ctx, r: &ParkedRecord) -> Option<Started> {
    let t = ctx.telemetry.as_ref()?;
    let mut row = RowTrace::default();
    for (k, v) in &r.headers {
        row.see(k, v.as_deref().map(str::as_bytes));
    }
    let link = row.traceparent.as_deref().and_then(|tp| {
        crate::obs::telemetry::span::parse_traceparent(tp, row.tracestate.as_deref())
    });
    let key = r.key.as_deref().and_then(|k| std::str::from_utf8(k).ok());
    let p = Publish {
        topic: r.topic.as_deref().unwrap_or(""),
        event_id: &r.event_id,
        key,
    };
    t.start(&p, &row, link)
}

/// The value header `k` carries: the span's `traceparent` instead of the row's.
pub(super) fn rewrite<'a>(
    span: &'a Option<Started>,
    k: &str,
    v: Option<&'a [u8]>,
) -> Option<&'a [u8]> {
    match span {
        Some(s) if k.eq_ignore_ascii_case("traceparent") => Some(s.header.as_bytes()),
        _ => v,
    }
}

/// A root span (row without a `traceparent`) adds the header.
pub(super) fn add_missing(span: &Option<Started>, headers: OwnedHeaders) -> OwnedHeaders {
    use rdkafka::message::Headers as _;
    let Some(s) = span else {
        return headers;
    };
    let has = headers
        .iter()
        .any(|h| h.key.eq_ignore_ascii_case("traceparent"));
    if has {
        return headers;
    }
    headers.insert(Header {
        key: "traceparent",
        value: Some(s.header.as_bytes()),
    })
}

pub(super) fn hold(ctx: &Ctx, opaque: usize, event_id: &str, span: Option<Started>) {
    if let (Some(t), Some(s)) = (&ctx.telemetry, span) {
        t.hold(opaque, event_id, s);
    }
}

/// Ends the span of a delivery report's record.
pub(super) fn delivered(ctx: &Ctx, opaque: usize, r: &DeliveryResult<'_>, v: &Verdict) {
    let (p, o) = match r {
        Ok(m) => (m.partition(), Some(m.offset())),
        Err((_, m)) => (m.partition(), None),
    };
    finish(ctx, opaque, p, o, v);
}

/// Ends the span of `opaque` with what became of its record.
pub(super) fn finish(ctx: &Ctx, opaque: usize, p: i32, offset: Option<i64>, v: &Verdict) {
    let Some(t) = &ctx.telemetry else {
        return;
    };
    let failure = match v {
        Verdict::Delivered => None,
        Verdict::Retriable { class, .. } => Some(Failure {
            event: "outboxd.retry",
            class,
            what: "delivery failed; the session restarts and produces the event again",
        }),
        Verdict::Rejected { class, .. } => Some(Failure {
            event: "outboxd.rejected",
            class,
            what: "the broker refused the record for good; it is parked or the relay halts, \
                   per the event type's policy",
        }),
    };
    t.finish(opaque, p, offset, failure);
}

#[cfg(test)]
mod tests {
    use super::row_trace;

    #[test]
    fn the_row_trace_comes_from_the_headers_column_alone() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let r = row_trace(Some(&format!(
            r#"{{"TraceParent": "{tp}", "tracestate": "k=v", "n": 1}}"#
        )));
        assert_eq!(r.traceparent.as_deref(), Some(tp));
        assert_eq!(r.tracestate.as_deref(), Some("k=v"));
        for none in [
            None,
            Some("{}"),
            Some(r#"{"tenant": "t"}"#),
            Some("not json traceparent"),
        ] {
            assert!(row_trace(none).traceparent.is_none(), "{none:?}");
        }
    }
}
