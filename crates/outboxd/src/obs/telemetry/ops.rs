//! The relay's own work as spans an operator can find next to the publish spans: a session
//! starting (connect, slot guard, joins, until it streams), a session ending with an error
//! (its class and fix, and how long the relay waits before the next one), a slot recovery (the
//! gap, the rows republished, how long it took).
//!
//! Each is an INTERNAL root span in a trace of its own, always sampled (they are a handful per
//! session, not per event). Attributes are names, LSNs, counts and classes — never a DSN, a
//! payload, or an error's text (errors may quote a row or a server's message): the class and
//! the fix are fixed strings.

use super::Traces;
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::trace::Span;

/// An operation's span; ended when dropped (`failed` unless [`Op::ok`] said otherwise).
pub struct Op {
    span: Option<Span>,
    done: bool,
}

impl Op {
    /// Starts `name` (e.g. `outboxd session start`); a no-op without a trace pipeline.
    pub fn start(traces: Option<&Traces>, name: &'static str, attrs: Vec<KeyValue>) -> Self {
        let span = traces.map(|t| {
            let tracer = t.tracer();
            tracer
                .span_builder(name)
                .with_kind(SpanKind::Internal)
                .with_attributes(attrs)
                .start(tracer)
        });
        Self { span, done: false }
    }

    /// Sets an attribute (values must be safe to export: see the module docs).
    pub fn set(&mut self, key: &'static str, value: impl Into<Value>) {
        if let Some(s) = &mut self.span {
            s.set_attribute(KeyValue::new(key, value));
        }
    }

    /// Adds a timestamped event.
    pub fn event(&mut self, name: &'static str) {
        if let Some(s) = &mut self.span {
            s.add_event(name, vec![]);
        }
    }

    /// Ends the span as succeeded.
    pub fn ok(mut self) {
        self.done = true;
    }

    /// Ends the span with error status: `class` (`error.type`) and a fixed description.
    pub fn fail(mut self, class: &'static str, what: &'static str) {
        if let Some(s) = &mut self.span {
            s.set_attribute(KeyValue::new("error.type", class));
            s.set_status(Status::error(what));
        }
        self.done = true;
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        let Some(mut s) = self.span.take() else {
            return;
        };
        if !self.done {
            // Left by `?` or a shutdown: it did not get to the end.
            s.set_status(Status::error(
                "did not complete (an error or a shutdown came first)",
            ));
        }
        s.end();
    }
}
