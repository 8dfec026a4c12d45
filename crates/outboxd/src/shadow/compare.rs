//! Pairs outboxd's records with the legacy path's by `event_id` and compares them. Pure: no
//! I/O, time is passed in, so every rule is unit-tested.

use crate::config::shadow::Field;
use crate::model::record::Rec;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Outbox,
    Legacy,
}

/// What became of one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Matched,
    /// The fields that differ.
    Mismatched(Vec<String>),
    /// outboxd built it; the legacy path never published it within the window.
    MissingLegacy,
    /// The legacy path published it; no outbox row carried it within the window (e.g. the
    /// business transaction rolled back after the legacy send: the dual-write bug).
    MissingOutbox,
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Self::Matched => "matched",
            Self::Mismatched(_) => "mismatched",
            Self::MissingLegacy => "missing_legacy",
            Self::MissingOutbox => "missing_outbox",
        }
    }
}

/// A decided event: its id and type (outboxd's when it saw the event) and the outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    pub event_id: String,
    pub event_type: String,
    pub outcome: Outcome,
}

/// At most this many events wait for their counterpart; beyond it the oldest are decided as
/// missing early, so a legacy topic much busier than the outbox cannot exhaust memory.
const MAX_PENDING: usize = 200_000;

pub struct Matcher {
    fields: Vec<Field>,
    json_values: bool,
    window: Duration,
    pending: HashMap<String, (Side, Rec, Instant)>,
}

impl Matcher {
    pub fn new(fields: Vec<Field>, json_values: bool, window: Duration) -> Self {
        Self {
            fields,
            json_values,
            window,
            pending: HashMap::new(),
        }
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// One side's record arrived. Returns the decision once both sides are there.
    pub fn offer(&mut self, side: Side, rec: Rec, now: Instant) -> Option<Decided> {
        match self.pending.remove(&rec.event_id) {
            Some((other, earlier, _)) if other != side => {
                let (ours, legacy) = match side {
                    Side::Outbox => (rec, earlier),
                    Side::Legacy => (earlier, rec),
                };
                let diff = self.diff(&ours, &legacy);
                Some(Decided {
                    event_id: ours.event_id,
                    event_type: ours.event_type,
                    outcome: if diff.is_empty() {
                        Outcome::Matched
                    } else {
                        Outcome::Mismatched(diff)
                    },
                })
            }
            // The same side twice (a relay restart replays, a legacy retry): keep the first.
            Some(first) => {
                self.pending.insert(rec.event_id.clone(), first);
                None
            }
            None => {
                let evicted = if self.pending.len() >= MAX_PENDING {
                    self.evict_oldest()
                } else {
                    None
                };
                self.pending.insert(rec.event_id.clone(), (side, rec, now));
                evicted
            }
        }
    }

    /// Events whose counterpart did not come within the window.
    pub fn expire(&mut self, now: Instant) -> Vec<Decided> {
        let window = self.window;
        let expired: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, (_, _, at))| now.duration_since(*at) >= window)
            .map(|(id, _)| id.clone())
            .collect();
        expired
            .into_iter()
            .filter_map(|id| self.pending.remove(&id).map(missing))
            .collect()
    }

    fn evict_oldest(&mut self) -> Option<Decided> {
        let id = self
            .pending
            .iter()
            .min_by_key(|(_, (_, _, at))| *at)
            .map(|(id, _)| id.clone())?;
        self.pending.remove(&id).map(missing)
    }

    fn diff(&self, ours: &Rec, legacy: &Rec) -> Vec<String> {
        self.fields
            .iter()
            .filter(|f| !self.same(f, ours, legacy))
            .map(Field::name)
            .collect()
    }

    fn same(&self, f: &Field, a: &Rec, b: &Rec) -> bool {
        match f {
            Field::Key => a.key == b.key,
            Field::Topic => a.topic == b.topic,
            Field::Value if self.json_values => match (&a.value, &b.value) {
                (Some(x), Some(y)) => match (
                    serde_json::from_slice::<serde_json::Value>(x),
                    serde_json::from_slice::<serde_json::Value>(y),
                ) {
                    (Ok(x), Ok(y)) => x == y,
                    _ => x == y,
                },
                (x, y) => x == y,
            },
            Field::Value => a.value == b.value,
            Field::Header(h) => header(a, h) == header(b, h),
        }
    }
}

fn missing((side, rec, _): (Side, Rec, Instant)) -> Decided {
    Decided {
        event_id: rec.event_id,
        event_type: rec.event_type,
        outcome: match side {
            Side::Outbox => Outcome::MissingLegacy,
            Side::Legacy => Outcome::MissingOutbox,
        },
    }
}

/// The header's value: `None` when absent, `Some(None)` when present without a value.
fn header<'a>(r: &'a Rec, name: &str) -> Option<Option<&'a [u8]>> {
    r.headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, value: &str) -> Rec {
        Rec {
            event_id: id.into(),
            event_type: "OrderPlaced".into(),
            topic: "orders".into(),
            key: Some(b"o-1".to_vec()),
            value: Some(value.as_bytes().to_vec()),
            headers: vec![("event_type".into(), Some(b"OrderPlaced".to_vec()))],
        }
    }

    fn matcher(json: bool) -> Matcher {
        Matcher::new(
            vec![Field::Key, Field::Value, Field::Header("event_type".into())],
            json,
            Duration::from_secs(10),
        )
    }

    #[test]
    fn pairs_in_either_order_and_compares_json_semantically() {
        let t = Instant::now();
        let mut m = matcher(true);
        assert_eq!(
            m.offer(Side::Legacy, rec("a", r#"{"x":1,"y":[2]}"#), t),
            None
        );
        let d = m
            .offer(Side::Outbox, rec("a", r#"{"y": [2], "x": 1}"#), t)
            .unwrap();
        assert_eq!(d.outcome, Outcome::Matched);
        assert_eq!(m.offer(Side::Outbox, rec("b", r#"{"x":1}"#), t), None);
        let mut other = rec("b", r#"{"x":2}"#);
        other.key = Some(b"o-2".to_vec());
        let d = m.offer(Side::Legacy, other, t).unwrap();
        assert_eq!(
            d.outcome,
            Outcome::Mismatched(vec!["key".into(), "value".into()])
        );
        assert_eq!(m.pending(), 0);
    }

    #[test]
    fn bytes_mode_sees_formatting_differences() {
        let t = Instant::now();
        let mut m = matcher(false);
        m.offer(Side::Outbox, rec("a", r#"{"x":1}"#), t);
        let d = m.offer(Side::Legacy, rec("a", r#"{"x": 1}"#), t).unwrap();
        assert_eq!(d.outcome, Outcome::Mismatched(vec!["value".into()]));
    }

    #[test]
    fn a_lonely_side_expires_as_missing_on_the_other() {
        let t = Instant::now();
        let mut m = matcher(true);
        m.offer(Side::Outbox, rec("a", "{}"), t);
        m.offer(Side::Legacy, rec("b", "{}"), t);
        // A replayed duplicate of one side does not pair with itself.
        assert_eq!(m.offer(Side::Outbox, rec("a", "{}"), t), None);
        assert!(m.expire(t + Duration::from_secs(9)).is_empty());
        let mut d = m.expire(t + Duration::from_secs(10));
        d.sort_by(|a, b| a.event_id.cmp(&b.event_id));
        assert_eq!(d[0].outcome, Outcome::MissingLegacy);
        assert_eq!(d[1].outcome, Outcome::MissingOutbox);
        assert_eq!(m.pending(), 0);
    }
}
