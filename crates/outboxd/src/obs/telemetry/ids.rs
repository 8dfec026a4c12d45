//! Span and trace ids derived from the event, not drawn at random.
//!
//! A publish span's id is a hash of its trace id, the `event_id` and how often this relay
//! already failed to deliver that event. Three things follow:
//! - a crash's redelivery of an event (the WAL replays it) writes a byte-identical record,
//!   `traceparent` header included: the consumer sees the same record twice and dedupes it, and
//!   both copies name the same publish span;
//! - `outboxd replay` (another process, days later) can link its span to the first publish
//!   span without anything stored per event: it derives that span's context again;
//! - a root span (row without a `traceparent`, `root_sample_ratio` > 0) gets a trace id derived
//!   from the `event_id`, so a redelivery makes the same sampling decision and lands in the
//!   same trace.

use opentelemetry::trace::{SpanId, TraceId};
use sha2::{Digest as _, Sha256};

/// The trace id of a root span for `event_id`.
pub fn root_trace(event_id: &str) -> TraceId {
    let h = Sha256::new()
        .chain_update(b"outboxd/root-trace/v1\0")
        .chain_update(event_id.as_bytes())
        .finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&h[..16]);
    if b == [0; 16] {
        b[15] = 1;
    }
    TraceId::from_bytes(b)
}

/// The id of `event_id`'s publish span in `trace` after `failed` failed deliveries (0: the
/// first publish, the one a replay links to).
pub fn publish_span(trace: TraceId, event_id: &str, failed: u32) -> SpanId {
    let h = Sha256::new()
        .chain_update(b"outboxd/publish-span/v1\0")
        .chain_update(trace.to_bytes())
        .chain_update(event_id.as_bytes())
        .chain_update(failed.to_le_bytes())
        .finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[..8]);
    // The all-zero id is invalid (W3C); one in 2^64.
    if b == [0; 8] {
        b[7] = 1;
    }
    SpanId::from_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_distinct_per_attempt_and_valid() {
        let t = root_trace("e1");
        assert_eq!(t, root_trace("e1"));
        assert_ne!(t, root_trace("e2"));
        assert_ne!(t, TraceId::INVALID);
        let s0 = publish_span(t, "e1", 0);
        assert_eq!(s0, publish_span(t, "e1", 0));
        assert_ne!(s0, publish_span(t, "e1", 1));
        assert_ne!(s0, publish_span(t, "e2", 0));
        assert_ne!(s0, publish_span(root_trace("x"), "e1", 0));
        assert_ne!(s0, SpanId::INVALID);
    }
}
