//! Error counts per class since the process started: exported as
//! `outboxd_publish_errors_total{class,event_type}` and summarised in the status row that
//! `outboxd status` reads.

use std::collections::BTreeMap;
use std::sync::Mutex;

fn counts() -> &'static Mutex<BTreeMap<String, u64>> {
    static C: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());
    &C
}

/// Counts one error of `class` (bounded label) for `event_type` (may be empty).
pub fn record(class: &str, event_type: &str) {
    metrics::counter!(crate::obs::PUBLISH_ERRORS, "class" => class.to_string(), "event_type" => event_type.to_string())
        .increment(1);
    if let Ok(mut c) = counts().lock() {
        *c.entry(class.to_string()).or_default() += 1;
    }
}

/// Counts a session restart (exported per class; summarised with the errors).
pub fn restart(class: &'static str) {
    metrics::counter!(crate::obs::SESSION_RESTARTS, "class" => class).increment(1);
    if let Ok(mut c) = counts().lock() {
        *c.entry(format!("restart:{class}")).or_default() += 1;
    }
}

pub fn snapshot() -> BTreeMap<String, u64> {
    counts().lock().map(|c| c.clone()).unwrap_or_default()
}
