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
//!
//! The delivery path builds no SDK span: a started span is a fixed-size [`Record`] (ids, times,
//! the topic, `event_id` and key copied inline), kept until the acknowledgement and then handed
//! to the export thread, which names it, adds its attributes and encodes it (issue 55).

use super::record::{End, Note, Record, Small};
use super::{Item, Traces};
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

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
#[cfg(test)]
fn traceparent(cx: &SpanContext) -> String {
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

/// A `traceparent` header value, built in place (`00-<trace>-<span>-<flags>`).
#[derive(Clone, Copy)]
pub struct Traceparent([u8; 55]);

impl Traceparent {
    fn new(trace: TraceId, span: SpanId, flags: u8) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut b = [b'-'; 55];
        b[0] = b'0';
        b[1] = b'0';
        let mut put = |at: usize, bytes: &[u8]| {
            for (i, x) in bytes.iter().enumerate() {
                b[at + 2 * i] = HEX[usize::from(x >> 4)];
                b[at + 2 * i + 1] = HEX[usize::from(x & 0xf)];
            }
        };
        put(3, &trace.to_bytes());
        put(36, &span.to_bytes());
        put(53, &[flags]);
        Self(b)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// A started publish span and the `traceparent` the record carries instead of the row's.
pub struct Started {
    pub header: Traceparent,
    record: Box<Record>,
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
/// acknowledged, by the record's delivery opaque.
pub struct Telemetry {
    traces: Arc<Traces>,
    publisher: Publisher,
    open: Mutex<HashMap<usize, Box<Record>>>,
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
            for (_, mut r) in open.drain() {
                r.end = End::SessionEnded;
                r.end_time = SystemTime::now();
                self.traces.send(Item::Publish(r));
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
        let row_cx = row
            .traceparent
            .as_deref()
            .and_then(|tp| parse_traceparent(tp, row.tracestate.as_deref()));
        let trace = match &row_cx {
            // Parent-based: an unsampled parent means no span at all.
            Some(cx) if !cx.is_sampled() => return None,
            Some(cx) => cx.trace_id(),
            // A root span's trace id is derived too (same sampling decision on a redelivery).
            None => {
                let t = super::ids::root_trace(p.event_id);
                if !self.traces.samples_root(t) {
                    return None;
                }
                t
            }
        };
        // A released event links to what it carried; a replayed one to its first publish span
        // (which was sampled: with a sampled parent always, by ratio for a root — the same
        // decision as above).
        let link = match self.publisher {
            Publisher::Replay => Some(SpanContext::new(
                trace,
                super::ids::publish_span(trace, p.event_id, 0),
                TraceFlags::SAMPLED,
                true,
                TraceState::default(),
            )),
            Publisher::Stream => link,
        };
        let span = match (self.publisher, link.is_some()) {
            (Publisher::Stream, false) => {
                super::ids::publish_span(trace, p.event_id, self.traces.failures(p.event_id))
            }
            _ => self.traces.random_span_id(),
        };
        let note = match (self.publisher, link.is_some()) {
            (Publisher::Replay, _) => Note::At("outboxd.replayed"),
            (Publisher::Stream, true) => Note::At("outboxd.republished"),
            (Publisher::Stream, false) => Note::None,
        };
        let (parent, tracestate) = match row_cx {
            Some(cx) => {
                let state = cx.trace_state();
                let state = (*state != TraceState::default()).then(|| Box::new(state.clone()));
                (Some(cx.span_id()), state)
            }
            None => (None, None),
        };
        let now = SystemTime::now();
        let record = Box::new(Record {
            trace,
            span,
            parent,
            tracestate,
            link: link.map(Box::new),
            start: now,
            end_time: now,
            topic: Small::new(p.topic),
            event_id: Small::new(p.event_id),
            key: p.key.map(Small::new),
            note,
            end: End::Open,
        });
        Some(Started {
            header: Traceparent::new(trace, span, TraceFlags::SAMPLED.to_u8()),
            record,
        })
    }

    /// Keeps a started span until its record's acknowledgement.
    pub fn hold(&self, opaque: usize, _event_id: &str, s: Started) {
        let stale = self
            .open
            .lock()
            .ok()
            .and_then(|mut open| open.insert(opaque, s.record));
        // A stale span under the same opaque (not possible within a session) is ended.
        if let Some(mut old) = stale {
            old.end_time = SystemTime::now();
            self.traces.send(Item::Publish(old));
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
        let Some(mut r) = self.open.lock().ok().and_then(|mut o| o.remove(&opaque)) else {
            return;
        };
        if self.publisher == Publisher::Stream {
            self.traces.note(r.event_id.as_str(), failure.is_some());
        }
        r.end = match failure {
            None => End::Delivered { partition, offset },
            Some(f) => End::Failed {
                partition,
                event: f.event,
                class: Small::new(f.class),
                what: f.what,
            },
        };
        r.end_time = SystemTime::now();
        self.traces.send(Item::Publish(r));
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
        let fixed = Traceparent::new(cx.trace_id(), cx.span_id(), 1);
        assert_eq!(fixed.as_bytes(), tp.as_bytes());
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

    /// The cost of a publish span on the delivery path and in the whole process (start, hold,
    /// finish, queue, the export thread's conversion; receiver down: a closed port). Prints
    /// µs per span. `cargo nextest run -p outboxd --lib --run-ignored only --no-capture
    /// span_cost` (a debug build: the SDK and std are unoptimized, compare runs, not releases).
    #[test]
    #[ignore]
    fn span_cost() {
        use std::time::{Duration, Instant};
        let cpu = |path: &str| {
            let s = std::fs::read_to_string(path).unwrap_or_default();
            // After the command's `)`: field 3 (state) first; utime, stime are fields 14, 15,
            // in clock ticks (100 Hz).
            let f: Vec<&str> = s
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect();
            let tick = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
            Duration::from_millis((tick(11) + tick(12)) * 10)
        };
        let cfg = crate::config::telemetry::TelemetryConfig {
            endpoint: Some("http://127.0.0.1:9".into()),
            ..Default::default()
        };
        let traces = super::super::Traces::start(&cfg, &Default::default())
            .unwrap()
            .unwrap();
        let t = Telemetry::new(Arc::new(traces), Publisher::Stream);
        let n: usize = std::env::var("SPANS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100_000);
        let ids: Vec<String> = (0..n)
            .map(|i| format!("{i:08}-0000-4000-8000-000000000000"))
            .collect();
        let row = RowTrace {
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            tracestate: None,
        };
        let (p0, t0, w0) = (
            cpu("/proc/self/stat"),
            cpu("/proc/thread-self/stat"),
            Instant::now(),
        );
        for (i, id) in ids.iter().enumerate() {
            let p = Publish {
                topic: "orders",
                event_id: id,
                key: Some("o-1"),
            };
            let s = t.start(&p, &row, None).expect("sampled");
            t.hold(i, id, s);
            t.finish(i, 0, Some(i as i64), None);
        }
        let (t1, w1) = (cpu("/proc/thread-self/stat"), w0.elapsed());
        drop(t);
        std::thread::sleep(Duration::from_millis(1500));
        let p1 = cpu("/proc/self/stat");
        let us = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
        eprintln!(
            "{n} spans: delivery thread {:.2} µs/span CPU ({:.2} wall), process {:.2} µs/span CPU",
            us(t1 - t0),
            us(w1),
            us(p1 - p0)
        );
    }
}
