//! Metric names and the small helpers that emit them through the `metrics` facade.
//!
//! Labels are bounded on purpose: `consumer` (handler names, fixed by code), `outcome` (a fixed
//! set), `aggregate_type`, `event_type` and `effect` (fixed by the schema). Never `event_id`
//! or `aggregate_id`: one series per entity would exhaust the metrics backend.

use std::time::Duration;

/// Counter `{consumer, outcome}`; outcome ∈ applied, duplicate, stale, held, released,
/// superseded, conflict. Duplicate hit rate = `outcome="duplicate"` / all.
pub const EVENTS_TOTAL: &str = "inbox_events_total";
/// Counter `{consumer, aggregate_type}`: real conflicts. Alert on any increase.
pub const CONFLICTS_TOTAL: &str = "inbox_conflicts_total";
/// Gauge `{consumer}`: events currently held waiting for a missing version.
pub const HELD_EVENTS: &str = "inbox_held_events";
/// Counter `{consumer}`: gaps that outlived the hold window (an alert each).
pub const GAP_TIMEOUTS_TOTAL: &str = "inbox_gap_timeouts_total";
/// Histogram `{consumer, event_type}`: producer commit (record timestamp) to consumption, s.
pub const COMMIT_TO_CONSUME_SECONDS: &str = "inbox_commit_to_consume_seconds";
/// Counter `{consumer}`: handler failures (the transaction rolled back).
pub const HANDLER_ERRORS_TOTAL: &str = "inbox_handler_errors_total";
/// Counter `{consumer}`: records that break the protocol (the consumer stops on them).
pub const MALFORMED_TOTAL: &str = "inbox_malformed_records_total";
/// Counter `{consumer, effect}`: side effects whose outcome is unknown (need reconciliation).
pub const EFFECT_UNKNOWN_TOTAL: &str = "inbox_side_effect_unknown_total";
/// Counter `{consumer}`: processed_event rows removed by retention.
pub const PRUNED_TOTAL: &str = "inbox_processed_pruned_total";

pub(crate) fn outcome(consumer: &str, outcome: &'static str, n: u64) {
    metrics::counter!(EVENTS_TOTAL, "consumer" => consumer.to_string(), "outcome" => outcome)
        .increment(n);
}

pub(crate) fn conflict(consumer: &str, aggregate_type: &str) {
    metrics::counter!(
        CONFLICTS_TOTAL,
        "consumer" => consumer.to_string(),
        "aggregate_type" => aggregate_type.to_string()
    )
    .increment(1);
}

pub(crate) fn held_events(consumer: &str, n: i64) {
    metrics::gauge!(HELD_EVENTS, "consumer" => consumer.to_string()).set(n as f64);
}

pub(crate) fn gap_timeout(consumer: &str) {
    metrics::counter!(GAP_TIMEOUTS_TOTAL, "consumer" => consumer.to_string()).increment(1);
}

pub(crate) fn delay(consumer: &str, event_type: &str, d: Duration) {
    metrics::histogram!(
        COMMIT_TO_CONSUME_SECONDS,
        "consumer" => consumer.to_string(),
        "event_type" => event_type.to_string()
    )
    .record(d.as_secs_f64());
}

pub(crate) fn handler_error(consumer: &str) {
    metrics::counter!(HANDLER_ERRORS_TOTAL, "consumer" => consumer.to_string()).increment(1);
}

pub(crate) fn malformed(consumer: &str) {
    metrics::counter!(MALFORMED_TOTAL, "consumer" => consumer.to_string()).increment(1);
}

pub(crate) fn effect_unknown(consumer: &str, effect: &str) {
    metrics::counter!(
        EFFECT_UNKNOWN_TOTAL,
        "consumer" => consumer.to_string(),
        "effect" => effect.to_string()
    )
    .increment(1);
}

pub(crate) fn pruned(consumer: &str, n: u64) {
    metrics::counter!(PRUNED_TOTAL, "consumer" => consumer.to_string()).increment(n);
}
