//! Shadow mode's tap (R35): what the stages hold to hand built records to the comparator of
//! `crate::shadow`, which creates it (and reads the other end of its queue). It lives with the
//! stages, so the relay imports nothing of shadow mode.

use crate::model::record::Rec;
use crate::relay::route::Event;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

/// What the session's stages hold: decides per event type and hands records over.
#[derive(Clone)]
pub struct Tap {
    pub(crate) tx: mpsc::Sender<Rec>,
    pub(crate) deliver: Arc<HashSet<String>>,
    pub(crate) prefix: Option<Arc<str>>,
    /// Commits before this (unix ms) are not compared.
    pub(crate) since_ms: i64,
    /// The first drop was logged.
    pub(crate) warned: Arc<AtomicBool>,
}

impl Tap {
    /// Whether this event type is delivered for real (canary) instead of compared.
    pub fn delivers(&self, event_type: &str) -> bool {
        self.deliver.contains(event_type)
    }

    /// Where shadowed records go: `Some(prefix)` to `<prefix><topic>`, `None` nowhere.
    pub fn prefix(&self) -> Option<&str> {
        self.prefix.as_deref()
    }

    /// Hands a built record to the comparator; never waits.
    pub fn offer(&self, commit_ms: i64, rec: impl FnOnce() -> Rec) {
        if commit_ms < self.since_ms {
            return;
        }
        // Only the drop path touches the metric: nothing per offered record.
        if self.tx.try_send(rec()).is_err() {
            metrics::counter!(crate::obs::SHADOW_EVENTS, "event_type" => "unknown", "result" => "dropped")
                .increment(1);
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!("shadow: the comparator falls behind; records are dropped uncompared (counted in outboxd_shadow_events_total{{result=\"dropped\"}})");
            }
        }
    }
}

/// The record as outboxd would produce it to `topic`, for comparing.
pub fn record_of(e: &Event<'_>, topic: &str) -> Rec {
    let mut headers = Vec::new();
    let _ = e.for_each_header(|k, v| headers.push((k.to_string(), v.map(<[u8]>::to_vec))));
    Rec {
        event_id: e.event_id.to_string(),
        event_type: e.type_or_empty().to_string(),
        topic: topic.to_string(),
        key: e.aggregate_id.map(|k| k.as_bytes().to_vec()),
        value: (!e.tombstone).then(|| e.value().into_owned()),
        headers,
    }
}
