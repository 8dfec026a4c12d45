//! Events of tables that are catching up (issue 56): a table that joined after it held rows is
//! owed those rows, and each aggregate's versions must leave in order — the republished rows
//! first, then what the stream brings of the table. Instead of stopping the stream until the
//! table is caught up (which stalled every other table for a statistics settle, 11 s), the
//! session streams on and *holds* the table's streamed events here: each keeps the stream
//! position the ack tracker gave it, so nothing past it is confirmed, and is sent under that
//! position once the table's republished rows were handed to the producer (the producer keeps
//! their order). A crash loses nothing: held events were never acknowledged, so the slot
//! gives them again.

use crate::poison::store::ParkedRecord;
use crate::relay::ack::Seq;
use std::collections::HashSet;
use std::sync::Arc;

/// See the module docs. Tables by their index in the session's [`crate::relay::outboxes`].
#[derive(Default)]
pub struct Held {
    tables: HashSet<usize>,
    events: Vec<(usize, Seq, ParkedRecord)>,
}

impl Held {
    /// From now on `table`'s streamed events are held.
    pub fn hold(&mut self, table: usize) {
        self.tables.insert(table);
    }

    /// Are `table`'s events held?
    pub fn holds(&self, table: usize) -> bool {
        self.tables.contains(&table)
    }

    /// Keeps one event (its record exactly as it would have been produced).
    pub fn push(&mut self, table: usize, seq: Seq, record: ParkedRecord) {
        self.events.push((table, seq, record));
    }

    /// Stops holding `table` and hands over its events, in stream order.
    pub fn release(&mut self, table: usize) -> Vec<(Seq, ParkedRecord)> {
        self.tables.remove(&table);
        let (mine, rest) = std::mem::take(&mut self.events)
            .into_iter()
            .partition(|(t, _, _)| *t == table);
        self.events = rest;
        mine.into_iter().map(|(_, s, r)| (s, r)).collect()
    }

    /// [`Held::hold`] of the table labelled `label` among `labels`: false when none is.
    pub fn hold_label(&mut self, labels: &[Arc<str>], label: &str) -> bool {
        let i = labels.iter().position(|l| &**l == label);
        i.inspect(|i| self.hold(*i)).is_some()
    }

    /// Is the table labelled `label` among `labels` held?
    pub fn holds_label(&self, labels: &[Arc<str>], label: &str) -> bool {
        labels
            .iter()
            .position(|l| &**l == label)
            .is_some_and(|i| self.holds(i))
    }

    /// [`Held::release`] of the table labelled `label` among `labels`.
    pub fn release_label(&mut self, labels: &[Arc<str>], label: &str) -> Vec<(Seq, ParkedRecord)> {
        match labels.iter().position(|l| &**l == label) {
            Some(i) => self.release(i),
            None => Vec::new(),
        }
    }

    /// How many events are held.
    pub fn len(&self) -> usize {
        self.events.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_is_released_in_stream_order_and_alone() {
        let mut h = Held::default();
        h.hold(1);
        h.hold(2);
        let rec = |id: &str| ParkedRecord {
            event_id: id.into(),
            ..ParkedRecord::default()
        };
        h.push(1, 10, rec("a"));
        h.push(2, 11, rec("b"));
        h.push(1, 12, rec("c"));
        assert!(h.holds(1) && h.holds(2));
        let one: Vec<(Seq, String)> = h
            .release(1)
            .into_iter()
            .map(|(s, r)| (s, r.event_id))
            .collect();
        assert_eq!(one, vec![(10, "a".to_string()), (12, "c".to_string())]);
        assert!(!h.holds(1) && h.holds(2));
        assert_eq!(h.len(), 1);
    }
}
