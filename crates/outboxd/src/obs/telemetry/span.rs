//! The publish span of one event: started when the relay hands the record to the producer (the
//! moment it read it from the WAL or the table, routed), ended at the broker's acknowledgement.
//!
//! Parent-based sampling: a row whose `traceparent` is sampled (flags `01`) gets a child span
//! in that trace; one with flags `00` gets none and its header travels untouched; a row without
//! one gets a root span only with `telemetry.root_sample_ratio` > 0. The record's `traceparent`
//! is rewritten to the span, so consumers continue from the outbox hop. Attributes follow the
//! OpenTelemetry messaging conventions for Kafka; never a payload, never a header value.

use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, Span};
use std::collections::HashMap;
use std::sync::Mutex;

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

/// Trace export for one producer: the tracer and the spans of records not yet acknowledged,
/// by the record's delivery opaque.
pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    open: Mutex<HashMap<usize, Span>>,
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
            for (_, mut s) in open.drain() {
                opentelemetry::trace::Span::add_event(&mut s, "outboxd.session_ended", vec![]);
                opentelemetry::trace::Span::end(&mut s);
            }
        }
        let _ = self.provider.shutdown();
    }
}

impl Telemetry {
    /// `None` when telemetry is off.
    pub fn new(
        cfg: &crate::config::telemetry::TelemetryConfig,
        redactor: &crate::config::secrets::Redactor,
    ) -> Result<Option<Self>, String> {
        Ok(super::provider(cfg, redactor)?.map(|provider| Self {
            tracer: provider.tracer("outboxd"),
            provider,
            open: Mutex::new(HashMap::new()),
        }))
    }

    /// Starts the publish span of a record (`None`: not sampled; the headers stay as they are).
    /// `link`: the original span of a released or replayed event, linked to.
    pub fn start(
        &self,
        p: &Publish<'_>,
        row: &RowTrace,
        link: Option<SpanContext>,
    ) -> Option<Started> {
        use opentelemetry::trace::Span as _;
        let parent = match &row.traceparent {
            Some(tp) => match parse_traceparent(tp, row.tracestate.as_deref()) {
                // Parent-based: an unsampled parent means no span at all.
                Some(cx) if !cx.is_sampled() => return None,
                Some(cx) => Context::new().with_remote_span_context(cx),
                None => Context::new(),
            },
            None => Context::new(),
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
        let linked = link.is_some();
        let mut b = self
            .tracer
            .span_builder(format!("send {}", p.topic))
            .with_kind(SpanKind::Producer)
            .with_attributes(attrs);
        if let Some(l) = link {
            b = b.with_links(vec![Link::with_context(l)]);
        }
        let mut span = b.start_with_context(&self.tracer, &parent);
        let cx = span.span_context().clone();
        if !cx.is_sampled() {
            return None;
        }
        if linked {
            span.add_event("outboxd.republished", vec![]);
        }
        Some(Started {
            header: traceparent(&cx),
            span,
        })
    }

    /// Keeps a started span until its record's acknowledgement.
    pub fn hold(&self, opaque: usize, s: Started) {
        if let Ok(mut open) = self.open.lock() {
            // A stale span under the same opaque (not possible within a session) is ended.
            if let Some(mut old) = open.insert(opaque, s.span) {
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
        let Some(mut span) = self.open.lock().ok().and_then(|mut o| o.remove(&opaque)) else {
            return;
        };
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
