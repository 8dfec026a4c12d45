//! Bounded metric labels. Every new `event_type` (and topic) in the stream would add Prometheus
//! series, and the stream is written by whoever can insert into the outbox: beyond
//! [`MAX_LABELS`] distinct values, new ones are reported as `other`, with one warning.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Distinct values per label (event types; topics) before new ones fold into `other`.
pub const MAX_LABELS: usize = 200;

/// One label's admitted values.
#[derive(Debug, Default)]
struct Budget {
    admitted: Mutex<HashSet<String>>,
    warned: AtomicBool,
}

impl Budget {
    fn label<'a>(&self, what: &'static str, v: &'a str) -> Cow<'a, str> {
        let Ok(mut set) = self.admitted.lock() else {
            return Cow::Borrowed("other");
        };
        if set.contains(v) {
            return Cow::Borrowed(v);
        }
        if set.len() < MAX_LABELS {
            set.insert(v.to_string());
            return Cow::Borrowed(v);
        }
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                label = what,
                limit = MAX_LABELS,
                "more distinct {what} values than the metrics keep apart: new ones are counted as \"other\""
            );
        }
        Cow::Borrowed("other")
    }
}

/// The label budgets of one relay (in [`crate::obs::Observed`]).
#[derive(Debug, Default)]
pub struct Labels {
    event_types: Budget,
    topics: Budget,
}

impl Labels {
    /// `event_type` as a metric label: itself, or `other` beyond the budget.
    pub fn event_type<'a>(&self, t: &'a str) -> Cow<'a, str> {
        self.event_types.label("event_type", t)
    }

    /// `topic` as a metric label: itself, or `other` beyond the budget.
    pub fn topic<'a>(&self, t: &'a str) -> Cow<'a, str> {
        self.topics.label("topic", t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_beyond_the_budget_fold_into_other() {
        let l = Labels::default();
        for i in 0..MAX_LABELS {
            assert_eq!(l.event_type(&format!("T{i}")), format!("T{i}"));
        }
        assert_eq!(l.event_type("T0"), "T0");
        assert_eq!(l.event_type("Unseen"), "other");
        assert_eq!(l.topic("t"), "t", "budgets are per label");
    }
}
