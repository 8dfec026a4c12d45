//! Error counts per class since the relay started: exported as
//! `outboxd_publish_errors_total{class,event_type}` (and per class for restarts and broker
//! refusals) and summarised in the status row that `outboxd status` reads.
//!
//! The counts belong to one relay ([`crate::obs::Observed`]); the Prometheus counters are the
//! process's, as the `metrics` recorder is.

use std::collections::BTreeMap;
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Counts(Mutex<BTreeMap<String, u64>>);

impl Counts {
    fn bump(&self, key: String) {
        if let Ok(mut c) = self.0.lock() {
            *c.entry(key).or_default() += 1;
        }
    }

    /// Counts one error of `class` (bounded label) for `event_type` (may be empty).
    pub fn record(&self, class: &str, event_type: &str) {
        metrics::counter!(crate::obs::PUBLISH_ERRORS, "class" => class.to_string(), "event_type" => event_type.to_string())
            .increment(1);
        self.bump(class.to_string());
    }

    /// Counts a session restart (exported per class; summarised with the errors).
    pub fn restart(&self, class: &'static str) {
        metrics::counter!(crate::obs::SESSION_RESTARTS, "class" => class).increment(1);
        self.bump(format!("restart:{class}"));
    }

    /// Counts an error on a broker connection (summarised as `broker:<class>`).
    pub fn broker(&self, class: &'static str) {
        self.bump(format!("broker:{class}"));
    }

    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0.lock().map(|c| c.clone()).unwrap_or_default()
    }
}
