//! The publish span of one event: started when the relay hands the record to the producer (the
//! moment it read it from the WAL or the table, routed), ended at the broker's acknowledgement.
//!
//! Parent-based sampling: a row whose `traceparent` is sampled (flags `01`) gets a child span
//! in that trace; one with flags `00` gets none and its header travels untouched; a row without
//! one gets a root span only with `telemetry.root_sample_ratio` > 0. The record's `traceparent`
//! is rewritten to the span, so consumers continue from the outbox hop. Attributes follow the
//! OpenTelemetry messaging conventions for Kafka; never a payload, never a header value.
//! Span ids are derived from the event ([`super::ids`]): a redelivered record is byte-identical
//! and a replay links to the first publish span without anything stored per event.

use super::Traces;
use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::Span;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A W3C `traceparent` as a span context (`None`: absent or malformed, which the spec says to
/// treat as absent).
pub fn parse_traceparent(tp: &str, tracestate: Option<&str>) -> Option<SpanContext> {
    let mut parts = tp.trim().split('-');
    let (v, t, s, f) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if v.len() != 2 || v == "ff" || t.len() != 32 || s.len() != 16 || f.len() != 2 {
        return None;
    }
    if v == "00" && parts.next().is_some() {
        return None;
    }
    let trace = TraceId::from_hex(t).ok()?;
    let span = SpanId::from_hex(s).ok()?;
    let flags = u8::from_str_radix(f, 16).ok()?;
    if trace == TraceId::INVALID || span == SpanId::INVALID {
        return None;
    }
    let state = tracestate
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags),
        true,
        state,
    ))
}

/// The `traceparent` naming `cx`.
pub fn traceparent(cx: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        cx.trace_id(),
        cx.span_id(),
        cx.trace_flags().to_u8()
    )
}

/// What a row's headers say about its trace.
#[derive(Debug, Default)]
pub struct RowTrace {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl RowTrace {
    /// Notes a header of the record (names are compared case-insensitively, as HTTP does).
    pub fn see(&mut self, k: &str, v: Option<&[u8]>) {
        let v = || {
            v.and_then(|v| std::str::from_utf8(v).ok())
                .map(str::to_string)
        };
        if k.eq_ignore_ascii_case("traceparent") {
            self.traceparent = v();
        } else if k.eq_ignore_ascii_case("tracestate") {
            self.tracestate = v();
        }
    }
}

/// A started publish span and the `traceparent` the record carries instead of the row's.
pub struct Started {
    pub header: String,
    span: Span,
}

/// The fields of a record a span describes.
pub struct Publish<'a> {
    pub topic: &'a str,
    pub event_id: &'a str,
    pub key: Option<&'a str>,
}

/// Whose publish a span is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publisher {
    /// The relay's stream (WAL, or the table during slot recovery): ids derived from the event
    /// ([`super::ids`]), so a redelivery is the same record with the same span.
    Stream,
    /// `outboxd replay`: a new span (random id) that links to the event's first publish span.
    Replay,
}

/// One producer's publish spans: the relay's [`Traces`] and the spans of records not yet
/// acknowledged, by the record's delivery opaque (with their `event_id`).
pub struct Telemetry {
    traces: Arc<Traces>,
    publisher: Publisher,
    open: Mutex<HashMap<usize, (Span, String)>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Telemetry")
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        // Spans of records never acknowledged (session ended) are ended as such.
        if let Ok(mut open) = self.open.lock() {
            for (_, (mut s, _)) in open.drain() {
                opentelemetry::trace::Span::add_event(&mut s, "outboxd.session_ended", vec![]);
                opentelemetry::trace::Span::end(&mut s);
            }
        }
    }
}

impl Telemetry {
    pub fn new(traces: Arc<Traces>, publisher: Publisher) -> Self {
        Self {
            traces,
            publisher,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// Starts the publish span of a record (`None`: not sampled; the headers stay as they are).
    /// `link`: the original span of a released event, linked to (a replay derives its own).
    pub fn start(
        &self,
        p: &Publish<'_>,
        row: &RowTrace,
        link: Option<SpanContext>,
    ) -> Option<Started> {
        use opentelemetry::trace::Span as _;
        let row_cx = row
            .traceparent
            .as_deref()
            .and_then(|tp| parse_traceparent(tp, row.tracestate.as_deref()));
        let (parent, trace) = match &row_cx {
            // Parent-based: an unsampled parent means no span at all.
            Some(cx) if !cx.is_sampled() => return None,
            Some(cx) => (
                Context::new().with_remote_span_context(cx.clone()),
                cx.trace_id(),
            ),
            None => (Context::new(), super::ids::root_trace(p.event_id)),
        };
        // A released event links to what it carried; a replayed one to its first publish span
        // (when that one was sampled: always with a sampled parent, by ratio for a root).
        let link = match self.publisher {
            Publisher::Replay if row_cx.is_some() || self.traces.samples_root(trace) => {
                Some(SpanContext::new(
                    trace,
                    super::ids::publish_span(trace, p.event_id, 0),
                    TraceFlags::SAMPLED,
                    true,
                    TraceState::default(),
                ))
            }
            _ => link,
        };
        let span_id = match (self.publisher, link.is_some()) {
            (Publisher::Stream, false) => Some(super::ids::publish_span(
                trace,
                p.event_id,
                self.traces.failures(p.event_id),
            )),
            _ => None,
        };
        let mut attrs = vec![
            KeyValue::new("messaging.system", "kafka"),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "send"),
            KeyValue::new("messaging.destination.name", p.topic.to_string()),
            KeyValue::new("messaging.message.id", p.event_id.to_string()),
        ];
        if let Some(k) = p.key {
            attrs.push(KeyValue::new("messaging.kafka.message.key", k.to_string()));
        }
        let republished = match (self.publisher, link.is_some()) {
            (Publisher::Replay, _) => Some("outboxd.replayed"),
            (Publisher::Stream, true) => Some("outboxd.republished"),
            (Publisher::Stream, false) => None,
        };
        // A root span's trace id is derived too (same sampling decision on a redelivery).
        let root_trace = row_cx.is_none().then_some(trace);
        let mut span = self.traces.build(span_id, root_trace, |tracer| {
            let mut b = tracer
                .span_builder(format!("send {}", p.topic))
                .with_kind(SpanKind::Producer)
                .with_attributes(attrs);
            if let Some(l) = link {
                b = b.with_links(vec![Link::with_context(l)]);
            }
            b.start_with_context(tracer, &parent)
        });
        let cx = span.span_context().clone();
        if !cx.is_sampled() {
            return None;
        }
        if let Some(ev) = republished {
            span.add_event(ev, vec![]);
        }
        Some(Started {
            header: traceparent(&cx),
            span,
        })
    }

    /// Keeps a started span until its record's acknowledgement.
    pub fn hold(&self, opaque: usize, event_id: &str, s: Started) {
        if let Ok(mut open) = self.open.lock() {
            // A stale span under the same opaque (not possible within a session) is ended.
            if let Some((mut old, _)) = open.insert(opaque, (s.span, event_id.to_string())) {
                opentelemetry::trace::Span::end(&mut old);
            }
        }
    }

    /// Ends the span of the record `opaque` at its acknowledgement: delivered at
    /// `partition`/`offset`, or failed (`failure`: the class and what follows).
    pub fn finish(
        &self,
        opaque: usize,
        partition: i32,
        offset: Option<i64>,
        failure: Option<Failure<'_>>,
    ) {
        use opentelemetry::trace::Span as _;
        let Some((mut span, event_id)) = self.open.lock().ok().and_then(|mut o| o.remove(&opaque))
        else {
            return;
        };
        if self.publisher == Publisher::Stream {
            self.traces.note(&event_id, failure.is_some());
        }
        span.set_attribute(KeyValue::new(
            "messaging.destination.partition.id",
            partition.to_string(),
        ));
        match failure {
            None => {
                if let Some(o) = offset {
                    span.set_attribute(KeyValue::new("messaging.kafka.offset", o));
                }
            }
            Some(f) => {
                span.set_attribute(KeyValue::new("error.type", f.class.to_string()));
                span.add_event(
                    f.event,
                    vec![KeyValue::new("outboxd.failure_class", f.class.to_string())],
                );
                span.set_status(Status::error(f.what.to_string()));
            }
        }
        span.end();
    }
}

/// A failed delivery as a span shows it.
pub struct Failure<'a> {
    /// `outboxd.retry` (the session restarts and produces it again, in a new span) or
    /// `outboxd.rejected` (parked or halted, per the event type's policy).
    pub event: &'static str,
    pub class: &'a str,
    /// A fixed description (never the broker's message: it may quote the record).
    pub what: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_round_trip_and_bad_ones_are_absent() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = parse_traceparent(tp, Some("k=v")).unwrap();
        assert!(cx.is_sampled() && cx.is_remote());
        assert_eq!(traceparent(&cx), tp);
        for bad in [
            "",
            "00-1",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(parse_traceparent(bad, None).is_none(), "{bad}");
        }
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(!parse_traceparent(unsampled, None).unwrap().is_sampled());
    }
}
