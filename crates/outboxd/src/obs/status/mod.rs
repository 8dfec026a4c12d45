//! The status page (`GET /`, `GET /status.json` on the `[metrics] listen` server): one relay
//! instance's state for an operator without a terminal — role and slot holder, slot position
//! and lag (with the last hour in memory, `history`), events relayed, oldest undelivered age per
//! type, parked events with their fix, the last errors, the effective configuration redacted
//! (`config_view`), version and build features.
//!
//! obs imports no other stage: the relay and the supervisor hand the [`Board`] values (the
//! watch's samples, a page of parked events, a failed session's class and fix), and the page is
//! rendered from a [`facts::Facts`] snapshot (`facts`: the documented JSON; `html`: the page;
//! `serve`: methods, the routes, a cached rendering; `gate`: who may load it and how often).

pub(crate) mod config_view;
pub(crate) mod facts;
pub(crate) mod gate;
pub(crate) mod history;
#[cfg(test)]
mod hostile;
pub(crate) mod html;
pub(crate) mod serve;

use facts::{LastError, ParkedEvent, TypeAge};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Last errors kept for the page.
const LAST_ERRORS: usize = 10;
/// Parked events listed (the count covers them all).
pub const PARKED_SHOWN: usize = 50;
/// The parked list is read at most this often (it is a query on `outbox_parked`).
const PARKED_EVERY: Duration = Duration::from_secs(5);

/// What one relay instance hands its status page. Cheap to update: a lock held for a copy.
#[derive(Debug, Default)]
pub struct Board {
    relayed: AtomicU64,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    slot: String,
    /// `primary` or `standby` (`source.replication_dsn`).
    location: &'static str,
    /// The redacted configuration (`config_view`), built once.
    config: serde_json::Value,
    token: Option<String>,
    /// `metrics.status_hosts`: the names accepted as `Host` (`gate`).
    hosts: Vec<String>,
    holder: Option<String>,
    confirmed_lsn: Option<String>,
    lag_bytes: Option<f64>,
    lag_seconds: Option<f64>,
    pending_events: u64,
    pending_bytes: u64,
    oldest: Vec<TypeAge>,
    parked_count: i64,
    parked: Vec<ParkedEvent>,
    parked_at: Option<Instant>,
    errors: VecDeque<LastError>,
    history: history::History,
}

/// What the watch reports every few seconds.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub confirmed_lsn: String,
    pub lag_bytes: Option<f64>,
    pub lag_seconds: f64,
    pub pending_events: u64,
    pub pending_bytes: u64,
    /// Per event type, seconds since the oldest unacknowledged event's commit.
    pub oldest: Vec<(String, f64)>,
}

impl Board {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> Option<T> {
        self.inner.lock().ok().map(|mut i| f(&mut i))
    }

    /// At start-up: the slot, where it lives, the redacted configuration and the page's token.
    pub fn configure(&self, cfg: &crate::config::Config) {
        let config = config_view::of(cfg);
        self.with(|i| {
            i.slot = cfg.source.slot.clone();
            i.location = if cfg.source.replication_dsn.is_some() {
                "standby"
            } else {
                "primary"
            };
            i.config = config;
            i.token = cfg.metrics.status_token.clone();
            i.hosts = cfg.metrics.status_hosts.clone();
        });
    }

    pub(crate) fn hosts(&self) -> Vec<String> {
        self.with(|i| i.hosts.clone()).unwrap_or_default()
    }

    pub(crate) fn token(&self) -> Option<String> {
        self.with(|i| i.token.clone()).flatten()
    }

    /// Events the broker acknowledged.
    pub fn relayed(&self, n: u64) {
        self.relayed.fetch_add(n, Ordering::Relaxed);
    }

    /// The watch's report: position, lag, pending events; one point of the chart.
    pub fn sample(&self, s: Sample) {
        let relayed = self.relayed.load(Ordering::Relaxed);
        self.with(|i| {
            i.confirmed_lsn = Some(s.confirmed_lsn);
            i.lag_bytes = s.lag_bytes;
            i.lag_seconds = Some(s.lag_seconds);
            i.pending_events = s.pending_events;
            i.pending_bytes = s.pending_bytes;
            let mut oldest: Vec<TypeAge> = s
                .oldest
                .into_iter()
                .map(|(event_type, age_seconds)| TypeAge {
                    event_type,
                    age_seconds,
                })
                .collect();
            oldest.sort_by(|a, b| a.event_type.cmp(&b.event_type));
            i.oldest = oldest;
            i.history.push(history::Sample {
                at: crate::obs::now_us() as f64 / 1e6,
                lag_bytes: s.lag_bytes.unwrap_or(0.0),
                lag_seconds: s.lag_seconds,
                relayed,
            });
        });
    }

    /// Whether the relay should read the parked list again (at most every [`PARKED_EVERY`]).
    pub fn parked_due(&self) -> bool {
        self.with(|i| i.parked_at.is_none_or(|t| t.elapsed() >= PARKED_EVERY))
            .unwrap_or(false)
    }

    /// The open parked and held events: `count` of them, the first [`PARKED_SHOWN`] listed.
    pub fn parked(&self, count: i64, mut events: Vec<ParkedEvent>) {
        events.truncate(PARKED_SHOWN);
        self.with(|i| {
            i.parked_count = count;
            i.parked = events;
            i.parked_at = Some(Instant::now());
        });
    }

    /// Standing by: the instance holding the slot, as its beats name it (`None`: unknown).
    pub fn holder(&self, instance: Option<String>) {
        self.with(|i| i.holder = instance);
    }

    /// A failed session (its message redacted by the caller), class and fix.
    pub fn error(&self, class: &str, message: &str, fix: &str) {
        let e = LastError {
            at: chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string(),
            class: class.to_string(),
            message: message.to_string(),
            fix: fix.to_string(),
        };
        self.with(|i| {
            if i.errors.len() == LAST_ERRORS {
                i.errors.pop_back();
            }
            i.errors.push_front(e);
        });
    }

    /// Everything the page shows, now.
    pub fn facts(&self, observed: &crate::obs::Observed) -> facts::Facts {
        let relayed = self.relayed.load(Ordering::Relaxed);
        self.with(|i| facts::Facts::of(i, relayed, observed))
            .unwrap_or_default()
    }
}
