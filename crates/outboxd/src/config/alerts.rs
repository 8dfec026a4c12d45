//! `[alerts]`: the delivery-delay budgets and thresholds `outboxd alerts` turns into Prometheus
//! rules (the rules themselves: `crate::cmd::alerts`).

use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertsConfig {
    /// Seconds an event of a type may wait for the broker before an alert; `default` applies to
    /// types not listed.
    #[serde(default)]
    pub delivery_budget_seconds: BTreeMap<String, u64>,
    #[serde(default = "d_lag")]
    pub slot_lag_bytes: u64,
    #[serde(default = "d_hb")]
    pub heartbeat_stale_seconds: u64,
    /// Labels that tell relay pairs apart in one Prometheus (e.g. `database`, set by the
    /// scrape config): every rule aggregates per value, so a pair without an active relay, a
    /// halted pair or a lagging slot alerts on its own instead of being averaged away by the
    /// healthy ones. Empty (default): one relay pair per Prometheus.
    #[serde(default)]
    pub group_by: Vec<String>,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        Self {
            delivery_budget_seconds: BTreeMap::new(),
            slot_lag_bytes: d_lag(),
            heartbeat_stale_seconds: d_hb(),
            group_by: Vec::new(),
        }
    }
}

fn d_lag() -> u64 {
    1 << 30
}
fn d_hb() -> u64 {
    60
}

/// A Prometheus label name (what `group_by` may hold).
fn label_name(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with("__")
}

impl AlertsConfig {
    /// Refuses a `group_by` entry that is not a label name (it would end up in every rule).
    pub fn validate(&self) -> Result<(), String> {
        match self.group_by.iter().find(|l| !label_name(l)) {
            Some(l) => Err(format!(
                "alerts.group_by: {l:?} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)"
            )),
            None => Ok(()),
        }
    }
}
