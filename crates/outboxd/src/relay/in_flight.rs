//! In-flight accounting: the events handed to the producer and not yet acknowledged.
//!
//! It wraps the [`AckTracker`] (which LSN is safe to confirm) with what the rest of the session
//! needs to know about the same events: their bytes (backpressure), the `(event_type, topic)`
//! label each one counts under once the broker has it, and the commit→ack histogram fed as
//! transactions complete. Everything is released in sequence order as the acknowledged prefix
//! grows, so memory follows the in-flight window, not the stream.

use crate::model::stream::ProtocolError;
use crate::obs;
use crate::obs::labels::Labels;
use crate::relay::ack::{AckTracker, Seq};
use metrics::{Counter, Histogram};
use std::collections::{HashMap, VecDeque};

/// One `(event_type, topic)` pair and its counter handle: resolved once, incremented per ack.
struct Label {
    event_type: String,
    published: Counter,
}

/// See the module docs. Owned by the session's stages; single-threaded.
pub struct InFlight {
    tracker: AckTracker,
    /// Bytes of events since the oldest unacknowledged one (approximate, for backpressure).
    bytes: usize,
    sizes: VecDeque<(Seq, usize)>,
    /// Label index (into `labels`), listed table (index into `tables`) and the oid of the
    /// table it was read from (0: unknown; what a refused one is parked under, issue 56) of
    /// each event from the oldest unacknowledged one on.
    meta: VecDeque<(u32, u16, u32)>,
    meta_base: Seq,
    labels: Vec<Label>,
    label_idx: HashMap<String, HashMap<String, u32>>,
    /// With several outbox tables: each listed table's published-events counter
    /// (`outboxd_table_events_published_total{table}`); empty with one.
    tables: Vec<Counter>,
    commit_to_ack: Histogram,
}

impl InFlight {
    /// Nothing in flight; the slot is confirmed up to `confirmed`.
    pub fn new(confirmed: u64) -> Self {
        Self {
            tracker: AckTracker::new(confirmed),
            bytes: 0,
            sizes: VecDeque::new(),
            meta: VecDeque::new(),
            meta_base: 0,
            labels: Vec::new(),
            label_idx: HashMap::new(),
            tables: Vec::new(),
            commit_to_ack: metrics::histogram!(obs::COMMIT_TO_ACK),
        }
    }

    /// Counts acknowledged events per listed table too, under these `schema.table` labels
    /// (configuration order: the index [`InFlight::add`] takes). Bounded: the tables are the
    /// configuration's.
    pub fn count_tables(&mut self, tables: &[std::sync::Arc<str>]) {
        self.tables = tables
            .iter()
            .map(|t| metrics::counter!(obs::TABLE_PUBLISHED, "table" => t.to_string()))
            .collect();
    }

    /// The open transaction's commit time (unix ms), if one is open.
    pub fn open_commit_ms(&self) -> Option<i64> {
        self.tracker.open_commit_us().map(|us| us / 1000)
    }

    /// Is a transaction open (its Begin read, its Commit not yet)?
    pub fn in_transaction(&self) -> bool {
        self.tracker.in_transaction()
    }

    /// A transaction begins; `commit_us` is its commit time (unix µs).
    pub fn begin_at(&mut self, commit_us: i64) -> Result<(), ProtocolError> {
        self.tracker.begin_at(commit_us)
    }

    /// The current transaction's Commit, with its end LSN.
    pub fn commit(&mut self, end_lsn: u64) -> Result<(), ProtocolError> {
        self.tracker.commit(end_lsn)?;
        self.release(None);
        Ok(())
    }

    /// A row may be routed only inside a transaction: outside one it has no position.
    pub fn check_open(&self) -> Result<(), ProtocolError> {
        match self.tracker.in_transaction() {
            true => Ok(()),
            false => Err(ProtocolError::InsertWithoutBegin),
        }
    }

    /// A position the server says holds nothing for us (keepalive, our own heartbeat).
    pub fn keepalive(&mut self, wal_end: u64) {
        self.tracker.keepalive(wal_end);
    }

    /// An event of `size` bytes, counted under `(event_type, topic)` (as `labels` bounds
    /// them), goes to the producer.
    pub fn add(
        &mut self,
        table: usize,
        relid: Option<u32>,
        event_type: &str,
        topic: &str,
        size: usize,
        labels: &Labels,
    ) -> Result<Seq, ProtocolError> {
        let seq = self.tracker.add_event()?;
        let label = self.label(event_type, topic, labels);
        self.meta
            .push_back((label, table as u16, relid.unwrap_or(0)));
        self.bytes += size;
        self.sizes.push_back((seq, size));
        Ok(seq)
    }

    /// A position that is no record (a join the stream announced): nothing past it is
    /// confirmed until [`InFlight::parked`] settles it. Counted in no metric.
    pub fn add_mark(&mut self) -> Result<Seq, ProtocolError> {
        let seq = self.tracker.add_event()?;
        self.meta.push_back((u32::MAX, u16::MAX, 0));
        self.sizes.push_back((seq, 0));
        Ok(seq)
    }

    /// The broker has the event (outboxd learned it at `at_us`, unix µs): it counts as
    /// published.
    pub fn delivered(&mut self, seq: Seq, at_us: i64) {
        self.tracker.ack(seq, true);
        if let Some(l) = self.label_of(seq) {
            l.published.increment(1);
        }
        if let Some(t) = self.table_of(seq).and_then(|t| self.tables.get(t)) {
            t.increment(1);
        }
        self.release(Some(at_us));
    }

    /// The event is durably parked instead: its position may be confirmed.
    pub fn parked(&mut self, seq: Seq) {
        self.tracker.ack(seq, true);
        self.release(None);
    }

    /// The event failed transiently: nothing from it on is confirmed in this session. Returns
    /// its event type, for the error counters.
    pub fn failed(&mut self, seq: Seq) -> Option<&str> {
        self.tracker.ack(seq, false);
        self.label_of(seq).map(|l| l.event_type.as_str())
    }

    /// The LSN safe to confirm to Postgres.
    pub fn confirmed(&self) -> u64 {
        self.tracker.confirmed()
    }

    /// Every event before `end` (a sequence number) is acknowledged.
    pub fn acked_before(&self, end: Seq) -> bool {
        self.tracker.oldest_unacked() >= end
    }

    /// The sequence number the next event will get.
    pub fn next_seq(&self) -> Seq {
        self.tracker.next_seq()
    }

    /// Events waiting for the broker.
    pub fn events(&self) -> usize {
        self.tracker.in_flight()
    }

    /// Approximate bytes waiting for the broker.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Commit time (unix µs) of the newest fully acknowledged transaction with events.
    pub fn delivery_mark_us(&self) -> Option<i64> {
        self.tracker.delivery_mark_us()
    }

    /// Commit time (unix µs) of the oldest unacknowledged event, per event type.
    pub fn oldest_pending(&self) -> HashMap<String, i64> {
        let mut oldest = HashMap::new();
        for (i, &(label, _, _)) in self.meta.iter().enumerate() {
            let seq = self.meta_base + i as u64;
            if !self.tracker.is_pending(seq) {
                continue;
            }
            let Some(l) = self.labels.get(label as usize) else {
                continue;
            };
            if oldest.contains_key(l.event_type.as_str()) {
                continue;
            }
            if let Some(c) = self.tracker.commit_us_of(seq) {
                oldest.insert(l.event_type.clone(), c);
            }
        }
        oldest
    }

    fn label_of(&self, seq: Seq) -> Option<&Label> {
        let i = seq.checked_sub(self.meta_base)?;
        let &(l, _, _) = self.meta.get(i as usize)?;
        self.labels.get(l as usize)
    }

    /// The listed table (index) an in-flight event came from.
    fn table_of(&self, seq: Seq) -> Option<usize> {
        let i = seq.checked_sub(self.meta_base)?;
        self.meta.get(i as usize).map(|&(_, t, _)| t as usize)
    }

    /// The oid of the table an in-flight event was read from, when the session knew it.
    pub fn relid_of(&self, seq: Seq) -> Option<u32> {
        let i = seq.checked_sub(self.meta_base)?;
        self.meta
            .get(i as usize)
            .map(|&(_, _, r)| r)
            .filter(|&r| r != 0)
    }

    /// Interned `(event_type, topic)` label of the published-events counter. Only label
    /// values (admitted ones and `other`) are interned: a stream of ever new event types costs
    /// a budget lookup per event, never memory.
    fn label(&mut self, event_type: &str, topic: &str, budget: &Labels) -> u32 {
        if let Some(&i) = self.label_idx.get(event_type).and_then(|m| m.get(topic)) {
            return i;
        }
        let (event_type, topic) = (budget.event_type(event_type), budget.topic(topic));
        let (event_type, topic) = (event_type.as_ref(), topic.as_ref());
        if let Some(&i) = self.label_idx.get(event_type).and_then(|m| m.get(topic)) {
            return i;
        }
        let i = self.labels.len() as u32;
        self.labels.push(Label {
            event_type: event_type.to_string(),
            published: metrics::counter!(obs::PUBLISHED, "event_type" => event_type.to_string(), "topic" => topic.to_string()),
        });
        self.label_idx
            .entry(event_type.to_string())
            .or_default()
            .insert(topic.to_string(), i);
        i
    }

    /// Labels and bytes are released in sequence order as the acknowledged prefix grows;
    /// completed transactions feed the commit→ack histogram, as acknowledged at `acked_us` (the
    /// acknowledgement that completed them) or, completed by a parked event or a Commit, now.
    fn release(&mut self, acked_us: Option<i64>) {
        let oldest_unacked = self.tracker.oldest_unacked();
        while self.meta_base < oldest_unacked && self.meta.pop_front().is_some() {
            self.meta_base += 1;
        }
        let hist = &self.commit_to_ack;
        let at_us = acked_us.unwrap_or_else(obs::now_us);
        self.tracker
            .drain_completed(|c| hist.record(at_us.saturating_sub(c).max(0) as f64 / 1e6));
        while let Some(&(seq, n)) = self.sizes.front() {
            if seq >= oldest_unacked {
                break;
            }
            self.bytes -= n;
            self.sizes.pop_front();
        }
    }
}

/// What the watch reads of the in-flight events (`crate::obs::view`).
impl obs::view::Pending for InFlight {
    fn confirmed(&self) -> u64 {
        InFlight::confirmed(self)
    }
    fn events(&self) -> usize {
        InFlight::events(self)
    }
    fn bytes(&self) -> usize {
        InFlight::bytes(self)
    }
    fn oldest_pending(&self) -> HashMap<String, i64> {
        InFlight::oldest_pending(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_labels_follow_the_acknowledged_prefix() {
        let mut f = InFlight::new(10);
        f.begin_at(1).unwrap();
        let a = f
            .add(0, None, "Paid", "t", 100, &Labels::default())
            .unwrap();
        let b = f
            .add(0, None, "Shipped", "t", 50, &Labels::default())
            .unwrap();
        f.commit(20).unwrap();
        assert_eq!((f.events(), f.bytes()), (2, 150));
        assert_eq!(f.oldest_pending().len(), 2);
        // Out of order: b first keeps the window (from a on), its bytes and the LSN.
        f.delivered(b, 0);
        assert_eq!((f.events(), f.bytes(), f.confirmed()), (2, 150, 10));
        f.delivered(a, 0);
        assert_eq!((f.events(), f.bytes(), f.confirmed()), (0, 0, 20));
        assert!(f.oldest_pending().is_empty());
    }

    #[test]
    fn a_failed_event_names_its_type_and_stops_the_confirm() {
        let mut f = InFlight::new(10);
        f.begin_at(1).unwrap();
        let a = f.add(0, None, "Paid", "t", 1, &Labels::default()).unwrap();
        f.commit(20).unwrap();
        assert_eq!(f.failed(a), Some("Paid"));
        assert_eq!(f.confirmed(), 10);
    }

    #[test]
    fn protocol_order_violations_are_definite_errors() {
        let mut f = InFlight::new(10);
        // Insert before Begin (a broken or hostile server): nothing is tracked.
        assert_eq!(f.check_open(), Err(ProtocolError::InsertWithoutBegin));
        assert_eq!(
            f.add(0, None, "Paid", "t", 1, &Labels::default()),
            Err(ProtocolError::InsertWithoutBegin)
        );
        assert_eq!((f.events(), f.bytes()), (0, 0));
        // Commit without Begin.
        assert_eq!(f.commit(20), Err(ProtocolError::CommitWithoutBegin));
        assert_eq!(f.confirmed(), 10);
        let e = crate::error::RelayError::from(ProtocolError::CommitWithoutBegin);
        assert_eq!(e.class(), "protocol");
        assert!(!e.is_transient());
    }

    #[test]
    fn hostile_commit_times_do_not_overflow() {
        let mut f = InFlight::new(0);
        f.begin_at(i64::MIN).unwrap();
        let a = f.add(0, None, "Paid", "t", 1, &Labels::default()).unwrap();
        f.commit(1).unwrap();
        f.delivered(a, 0);
        f.begin_at(i64::MAX).unwrap();
        f.commit(2).unwrap();
        assert_eq!(f.confirmed(), 2);
    }
}
