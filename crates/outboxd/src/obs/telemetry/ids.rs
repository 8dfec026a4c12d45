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
//!
//! The SDK draws ids from its [`IdGenerator`] while it builds a span, on the calling thread;
//! [`Next::with_ids`] puts the derived ones where [`Derived`] (the relay's generator, sharing
//! that [`Next`]) finds them for exactly that call. Span starts of one relay take turns on
//! [`Next`] (a lock held while one span is built), so no span draws another's id.

use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
use sha2::{Digest as _, Sha256};
use std::sync::{Arc, Mutex};

/// The ids the next span built takes (`None`: random).
#[derive(Debug, Default, Clone, Copy)]
struct Ids {
    span: Option<SpanId>,
    trace: Option<TraceId>,
}

/// One relay's handover of derived ids to its generator.
#[derive(Debug, Default, Clone)]
pub(super) struct Next {
    /// Held while a span is built: span starts take turns.
    turn: Arc<Mutex<()>>,
    ids: Arc<Mutex<Ids>>,
}

impl Next {
    /// Runs `build` (which starts one span) with `span`/`trace` as the ids the SDK draws;
    /// whatever it did not draw is cleared afterwards, so no later span inherits it.
    pub(super) fn with_ids<T>(
        &self,
        span: Option<SpanId>,
        trace: Option<TraceId>,
        build: impl FnOnce() -> T,
    ) -> T {
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.set(Ids { span, trace });
        let out = build();
        self.set(Ids::default());
        out
    }

    fn set(&self, ids: Ids) {
        *self.ids() = ids;
    }

    fn ids(&self) -> std::sync::MutexGuard<'_, Ids> {
        self.ids.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Hands out the ids [`Next::with_ids`] set for the span being built, random ones otherwise.
#[derive(Debug)]
pub(super) struct Derived {
    next: Next,
    random: RandomIdGenerator,
}

impl Derived {
    pub(super) fn new(next: Next) -> Self {
        Self {
            next,
            random: RandomIdGenerator::default(),
        }
    }
}

impl IdGenerator for Derived {
    fn new_trace_id(&self) -> TraceId {
        let set = self.next.ids().trace.take();
        set.unwrap_or_else(|| self.random.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        let set = self.next.ids().span.take();
        set.unwrap_or_else(|| self.random.new_span_id())
    }
}

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

    #[test]
    fn the_generator_hands_out_what_was_set_once() {
        let next = Next::default();
        let g = Derived::new(next.clone());
        let want = SpanId::from_bytes([1, 2, 3, 4, 5, 6, 7, 8]);
        let got = next.with_ids(Some(want), Some(root_trace("e")), || {
            (g.new_span_id(), g.new_trace_id())
        });
        assert_eq!(got, (want, root_trace("e")));
        // Not drawn inside: cleared, the next one is random.
        next.with_ids(Some(want), Some(root_trace("e")), || ());
        assert_ne!(g.new_span_id(), want);
        assert_ne!(g.new_trace_id(), root_trace("e"));
    }
}
