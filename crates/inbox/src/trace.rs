//! The W3C trace context a record carries (issue 43): outboxd rewrites `traceparent` to its
//! publish span, so a consumer span started from this context continues the trace from the
//! outbox hop. The library has no tracing SDK of its own: a handler passes this context to
//! whichever it uses (OpenTelemetry's `TraceContextPropagator` reads the same two headers).

use std::collections::BTreeMap;

/// A record's parent context: its consumer span is a child of `parent_span_id` in `trace_id`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// 16 lowercase hex digits: the producer's (outboxd's publish) span.
    pub parent_span_id: String,
    /// The trace flags' sampled bit.
    pub sampled: bool,
    /// The `tracestate` header, as it came.
    pub tracestate: Option<String>,
}

/// The context in `headers` (`None`: no `traceparent`, or a malformed one, which W3C says to
/// treat as absent).
pub fn trace_context(headers: &BTreeMap<String, String>) -> Option<TraceContext> {
    let tp = headers.get("traceparent")?.trim();
    let p: Vec<&str> = tp.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if p.len() < 4 || !hex(p[0], 2) || p[0] == "ff" || (p[0] == "00" && p.len() != 4) {
        return None;
    }
    let (t, s, f) = (p[1].to_ascii_lowercase(), p[2].to_ascii_lowercase(), p[3]);
    if !hex(&t, 32) || !hex(&s, 16) || !hex(f, 2) {
        return None;
    }
    if t.bytes().all(|b| b == b'0') || s.bytes().all(|b| b == b'0') {
        return None;
    }
    Some(TraceContext {
        trace_id: t,
        parent_span_id: s,
        sampled: u8::from_str_radix(f, 16).ok()? & 1 == 1,
        tracestate: headers.get("tracestate").cloned(),
    })
}

impl crate::Envelope {
    /// The trace context of this record, to start the consumer span from.
    pub fn trace_context(&self) -> Option<TraceContext> {
        trace_context(&self.headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_valid_traceparent_and_ignores_bad_ones() {
        let mut h = BTreeMap::new();
        h.insert(
            "traceparent".to_string(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
        );
        h.insert("tracestate".to_string(), "a=b".to_string());
        let cx = trace_context(&h).unwrap();
        assert_eq!(cx.parent_span_id, "00f067aa0ba902b7");
        assert!(cx.sampled);
        assert_eq!(cx.tracestate.as_deref(), Some("a=b"));
        h.insert("traceparent".to_string(), "00-abc".to_string());
        assert!(trace_context(&h).is_none());
    }
}
