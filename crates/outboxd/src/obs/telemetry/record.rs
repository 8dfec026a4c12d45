//! A publish span as the delivery path hands it over (issue 55): a fixed-size record — ids,
//! times, the topic, `event_id` and key in inline buffers, partition and offset — built without
//! the SDK and queued as is. The export thread turns it into the SDK's `SpanData` (name,
//! attributes, events, links) and encodes it; the delivery path pays for none of that.

use opentelemetry::trace::{
    Event, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};
use std::borrow::Cow;
use std::time::SystemTime;

/// Bytes a string keeps inline (a UUID `event_id`, most topics and keys); longer ones go to
/// the heap.
const INLINE: usize = 46;

/// A small string copied into a fixed buffer when it fits.
#[derive(Clone)]
pub(super) enum Small {
    Inline { len: u8, buf: [u8; INLINE] },
    Heap(Box<str>),
}

impl Small {
    pub(super) fn new(s: &str) -> Self {
        if s.len() <= INLINE {
            let mut buf = [0u8; INLINE];
            buf[..s.len()].copy_from_slice(s.as_bytes());
            Self::Inline {
                len: s.len() as u8,
                buf,
            }
        } else {
            Self::Heap(s.into())
        }
    }

    pub(super) fn as_str(&self) -> &str {
        match self {
            // Copied from a `&str` whole: valid UTF-8.
            Self::Inline { len, buf } => {
                std::str::from_utf8(&buf[..*len as usize]).unwrap_or_default()
            }
            Self::Heap(s) => s,
        }
    }
}

/// What a span records besides its attributes at the start.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Note {
    None,
    /// `outboxd.republished` (a released event) or `outboxd.replayed`.
    At(&'static str),
}

/// How a span ended.
pub(super) enum End {
    /// Not yet (still waiting for its acknowledgement).
    Open,
    Delivered {
        partition: i32,
        offset: Option<i64>,
    },
    Failed {
        partition: i32,
        event: &'static str,
        class: Small,
        what: &'static str,
    },
    /// The session ended before the acknowledgement.
    SessionEnded,
}

/// One publish span, fixed size (but for rare parts: a `tracestate`, a link, long strings).
pub(super) struct Record {
    pub trace: TraceId,
    pub span: SpanId,
    /// The row's span (`None`: a root span).
    pub parent: Option<SpanId>,
    pub tracestate: Option<Box<TraceState>>,
    pub link: Option<Box<SpanContext>>,
    pub start: SystemTime,
    pub end_time: SystemTime,
    pub topic: Small,
    pub event_id: Small,
    pub key: Option<Small>,
    pub note: Note,
    pub end: End,
}

impl Record {
    /// The span as the SDK's exporters take it (on the export thread).
    pub(super) fn into_span_data(self, scope: &InstrumentationScope) -> SpanData {
        let mut attributes = Vec::with_capacity(8);
        attributes.extend([
            KeyValue::new("messaging.system", "kafka"),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "send"),
            KeyValue::new(
                "messaging.destination.name",
                self.topic.as_str().to_string(),
            ),
            KeyValue::new("messaging.message.id", self.event_id.as_str().to_string()),
        ]);
        if let Some(k) = &self.key {
            attributes.push(KeyValue::new(
                "messaging.kafka.message.key",
                k.as_str().to_string(),
            ));
        }
        let mut events = Vec::new();
        if let Note::At(name) = self.note {
            events.push(Event::new(name, self.start, vec![], 0));
        }
        let mut status = Status::Unset;
        match self.end {
            End::Open => {}
            End::Delivered { partition, offset } => {
                attributes.push(partition_id(partition));
                if let Some(o) = offset {
                    attributes.push(KeyValue::new("messaging.kafka.offset", o));
                }
            }
            End::Failed {
                partition,
                event,
                class,
                what,
            } => {
                attributes.push(partition_id(partition));
                let class = class.as_str().to_string();
                attributes.push(KeyValue::new("error.type", class.clone()));
                events.push(Event::new(
                    event,
                    self.end_time,
                    vec![KeyValue::new("outboxd.failure_class", class)],
                    0,
                ));
                status = Status::error(what);
            }
            End::SessionEnded => {
                events.push(Event::new(
                    "outboxd.session_ended",
                    self.end_time,
                    vec![],
                    0,
                ));
            }
        }
        let state = self.tracestate.map(|s| *s).unwrap_or_default();
        // Both are `non_exhaustive`: filled in, not built.
        let mut span_events = SpanEvents::default();
        span_events.events = events;
        let mut span_links = SpanLinks::default();
        if let Some(l) = self.link {
            span_links.links.push(Link::with_context(*l));
        }
        SpanData {
            span_context: SpanContext::new(
                self.trace,
                self.span,
                TraceFlags::SAMPLED,
                false,
                state,
            ),
            parent_span_id: self.parent.unwrap_or(SpanId::INVALID),
            parent_span_is_remote: self.parent.is_some(),
            span_kind: SpanKind::Producer,
            name: Cow::Owned(format!("send {}", self.topic.as_str())),
            start_time: self.start,
            end_time: self.end_time,
            attributes,
            dropped_attributes_count: 0,
            events: span_events,
            links: span_links,
            status,
            instrumentation_scope: scope.clone(),
        }
    }
}

fn partition_id(p: i32) -> KeyValue {
    KeyValue::new("messaging.destination.partition.id", p.to_string())
}

#[cfg(test)]
mod tests {
    use super::Small;

    #[test]
    fn small_strings_keep_what_they_were_given() {
        for s in ["", "e-1", &"x".repeat(46), &"y".repeat(47), "ünï"] {
            assert_eq!(Small::new(s).as_str(), s);
        }
    }
}
