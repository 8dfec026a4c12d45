//! Ack tracker: turns out-of-order broker acknowledgements into the one LSN that is safe to
//! confirm to Postgres.
//!
//! Many events share one commit LSN, and the broker acknowledges partitions independently, so
//! acknowledgements are tracked per event (a sequence number handed out in stream order) and per
//! transaction (its pending count), never per LSN. The confirmable LSN is the commit end-LSN of
//! the newest transaction such that it and every earlier transaction are fully acknowledged —
//! Vector's ordered finalizer, except that a failure stops the advance for good: nothing past a
//! failed event is ever confirmed (the session restarts from the slot instead).

use crate::model::stream::ProtocolError;
use std::collections::VecDeque;

/// Sequence number of an event within one replication session.
pub type Seq = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pending,
    Acked,
    Failed,
}

#[derive(Debug)]
struct Txn {
    first_seq: Seq,
    /// Events of this transaction not yet acknowledged (failed ones stay pending forever).
    pending: u64,
    /// Commit end-LSN once the Commit message was seen.
    commit_lsn: Option<u64>,
    /// Commit time (unix µs) from the Begin message, for the commit→ack latency.
    commit_us: i64,
    events: u64,
}

/// See the module docs. Single-threaded; the pipeline owns it.
#[derive(Debug, Default)]
pub struct AckTracker {
    /// Per-event state for seqs `base_seq..next_seq`; acknowledged ones are trimmed off the front.
    window: VecDeque<State>,
    base_seq: Seq,
    next_seq: Seq,
    txns: VecDeque<Txn>,
    confirmed: u64,
    failed: Option<Seq>,
    /// Commit times of transactions with events that became fully acknowledged.
    completed: Vec<i64>,
    /// Commit time (unix µs) of the newest fully acknowledged transaction with events: the
    /// delivery mark recorded in `outboxd_slot_state` (0: none in this session).
    mark_us: i64,
}

impl AckTracker {
    /// A tracker that starts from `confirmed` (the slot's `confirmed_flush_lsn`).
    pub fn new(confirmed: u64) -> Self {
        Self {
            confirmed,
            ..Self::default()
        }
    }

    /// A Begin message without a commit time (tests).
    #[cfg(test)]
    pub fn begin(&mut self) {
        self.begin_at(0).unwrap();
    }

    /// A Begin message: a new transaction opens, committed at `commit_us` (unix µs).
    /// Transactions arrive strictly one after another: a Begin inside an open one would leave
    /// that one uncommitted forever (nothing confirmed again), so it is an error.
    pub fn begin_at(&mut self, commit_us: i64) -> Result<(), ProtocolError> {
        if self.in_transaction() {
            return Err(ProtocolError::BeginBeforeCommit);
        }
        self.txns.push_back(Txn {
            first_seq: self.next_seq,
            pending: 0,
            commit_lsn: None,
            commit_us,
            events: 0,
        });
        Ok(())
    }

    /// Is a transaction open (a Begin seen, its Commit not yet)?
    pub fn in_transaction(&self) -> bool {
        self.txns.back().is_some_and(|t| t.commit_lsn.is_none())
    }

    /// The open transaction's commit time (unix µs).
    pub fn open_commit_us(&self) -> Option<i64> {
        self.txns
            .back()
            .filter(|t| t.commit_lsn.is_none())
            .map(|t| t.commit_us)
    }

    /// An event of the open transaction was handed to the producer; returns its sequence number.
    pub fn add_event(&mut self) -> Result<Seq, ProtocolError> {
        let txn = self
            .txns
            .back_mut()
            .filter(|t| t.commit_lsn.is_none())
            .ok_or(ProtocolError::InsertWithoutBegin)?;
        txn.pending += 1;
        txn.events += 1;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.window.push_back(State::Pending);
        Ok(seq)
    }

    /// The Commit message of the open transaction, with its end LSN.
    pub fn commit(&mut self, end_lsn: u64) -> Result<(), ProtocolError> {
        let txn = self
            .txns
            .back_mut()
            .filter(|t| t.commit_lsn.is_none())
            .ok_or(ProtocolError::CommitWithoutBegin)?;
        txn.commit_lsn = Some(end_lsn);
        self.advance();
        Ok(())
    }

    /// The broker's verdict on one event. A second verdict for the same event is ignored.
    pub fn ack(&mut self, seq: Seq, ok: bool) {
        let Some(idx) = seq.checked_sub(self.base_seq).map(|i| i as usize) else {
            return; // already acknowledged and trimmed
        };
        let Some(state) = self.window.get_mut(idx) else {
            return;
        };
        if *state != State::Pending {
            return;
        }
        if !ok {
            *state = State::Failed;
            self.failed = Some(self.failed.map_or(seq, |f| f.min(seq)));
            return;
        }
        *state = State::Acked;
        let t = self.txns.partition_point(|t| t.first_seq <= seq) - 1;
        self.txns[t].pending -= 1;
        while self.window.front() == Some(&State::Acked) {
            self.window.pop_front();
            self.base_seq += 1;
        }
        if t == 0 {
            self.advance();
        }
    }

    fn advance(&mut self) {
        while let Some(front) = self.txns.front() {
            match front.commit_lsn {
                Some(lsn) if front.pending == 0 => {
                    self.confirmed = self.confirmed.max(lsn);
                    if front.events > 0 {
                        self.completed.push(front.commit_us);
                        self.mark_us = self.mark_us.max(front.commit_us);
                    }
                    self.txns.pop_front();
                }
                _ => break,
            }
        }
    }

    /// Commit time (unix µs) of the newest fully acknowledged transaction that had events, or
    /// `None` before the first one in this session.
    pub fn delivery_mark_us(&self) -> Option<i64> {
        (self.mark_us > 0).then_some(self.mark_us)
    }

    /// A keepalive with the server's WAL position: confirmable only when nothing is in flight
    /// and no transaction is open, so an idle outbox does not pin WAL.
    pub fn keepalive(&mut self, wal_end: u64) {
        if self.is_idle() {
            self.confirmed = self.confirmed.max(wal_end);
        }
    }

    /// Nothing in flight and no transaction open or awaiting acknowledgement.
    pub fn is_idle(&self) -> bool {
        self.txns.is_empty() && self.window.is_empty()
    }

    /// The LSN that is safe to confirm.
    pub fn confirmed(&self) -> u64 {
        self.confirmed
    }

    /// Events from the oldest unacknowledged one to the newest: what backpressure bounds.
    pub fn in_flight(&self) -> usize {
        self.window.len()
    }

    /// Hands over the commit times of transactions completed since the last call.
    pub fn drain_completed(&mut self, mut f: impl FnMut(i64)) {
        for c in self.completed.drain(..) {
            f(c);
        }
    }

    /// Is this event still waiting for the broker?
    pub fn is_pending(&self, seq: Seq) -> bool {
        seq.checked_sub(self.base_seq)
            .and_then(|i| self.window.get(i as usize))
            .is_some_and(|s| *s != State::Acked)
    }

    /// Commit time (unix µs) of the transaction an event belongs to.
    pub fn commit_us_of(&self, seq: Seq) -> Option<i64> {
        let t = self.txns.partition_point(|t| t.first_seq <= seq);
        t.checked_sub(1).map(|t| self.txns[t].commit_us)
    }

    /// Sequence number of the oldest event not yet acknowledged (the next one when none is).
    pub fn oldest_unacked(&self) -> Seq {
        self.base_seq
    }

    /// The sequence number the next event will get.
    pub fn next_seq(&self) -> Seq {
        self.next_seq
    }

    /// Sequence number of the first failed event, if any.
    #[cfg(test)]
    pub fn first_failure(&self) -> Option<Seq> {
        self.failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn empty_transactions_confirm_at_commit() {
        let mut t = AckTracker::new(10);
        t.begin();
        t.commit(20).unwrap();
        assert_eq!(t.confirmed(), 20);
        assert!(t.is_idle());
    }

    #[test]
    fn out_of_order_acks_confirm_only_the_complete_prefix() {
        let mut t = AckTracker::new(0);
        t.begin();
        let a = t.add_event().unwrap();
        let b = t.add_event().unwrap();
        t.commit(100).unwrap();
        t.begin();
        let c = t.add_event().unwrap();
        t.commit(200).unwrap();
        t.ack(c, true);
        assert_eq!(t.confirmed(), 0, "txn 2 acked but txn 1 is not");
        t.ack(b, true);
        assert_eq!(t.confirmed(), 0, "txn 1 still has an event in flight");
        t.ack(a, true);
        assert_eq!(t.confirmed(), 200);
        assert!(t.is_idle());
    }

    #[test]
    fn a_failure_blocks_forever() {
        let mut t = AckTracker::new(0);
        t.begin();
        let a = t.add_event().unwrap();
        t.commit(100).unwrap();
        t.begin();
        let b = t.add_event().unwrap();
        t.commit(200).unwrap();
        t.ack(a, false);
        t.ack(b, true);
        t.ack(a, true); // a late success after the failure changes nothing
        assert_eq!(t.confirmed(), 0);
        assert_eq!(t.first_failure(), Some(a));
        t.keepalive(500);
        assert_eq!(t.confirmed(), 0);
    }

    #[test]
    fn keepalive_moves_only_when_idle() {
        let mut t = AckTracker::new(0);
        t.keepalive(50);
        assert_eq!(t.confirmed(), 50);
        t.begin();
        t.keepalive(60);
        assert_eq!(t.confirmed(), 50, "open transaction");
        let a = t.add_event().unwrap();
        t.commit(70).unwrap();
        t.keepalive(80);
        assert_eq!(t.confirmed(), 50, "event in flight");
        t.ack(a, true);
        assert_eq!(t.confirmed(), 70);
        t.keepalive(80);
        assert_eq!(t.confirmed(), 80);
        t.keepalive(75);
        assert_eq!(t.confirmed(), 80, "never moves backwards");
    }

    #[test]
    fn events_of_an_open_transaction_never_confirm() {
        let mut t = AckTracker::new(0);
        t.begin();
        let a = t.add_event().unwrap();
        t.ack(a, true);
        assert_eq!(t.confirmed(), 0);
        assert_eq!(t.in_flight(), 0);
        t.commit(9).unwrap();
        assert_eq!(t.confirmed(), 9);
    }

    #[test]
    fn protocol_order_violations_are_errors() {
        let mut t = AckTracker::new(5);
        assert_eq!(t.add_event(), Err(ProtocolError::InsertWithoutBegin));
        assert_eq!(t.commit(9), Err(ProtocolError::CommitWithoutBegin));
        t.begin();
        assert_eq!(t.begin_at(1), Err(ProtocolError::BeginBeforeCommit));
        let a = t.add_event().unwrap();
        t.commit(10).unwrap();
        assert_eq!(t.commit(11), Err(ProtocolError::CommitWithoutBegin));
        assert_eq!(t.add_event(), Err(ProtocolError::InsertWithoutBegin));
        // The refused messages changed nothing: the transaction confirms as usual.
        t.ack(a, true);
        assert_eq!(t.confirmed(), 10);
        assert!(t.is_idle());
    }

    /// One message of a stream from a broken or hostile server.
    #[derive(Debug, Clone)]
    enum Step {
        Begin(i64),
        Event,
        Commit(u64),
        Ack(u64, bool),
        Keepalive(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            any::<i64>().prop_map(Step::Begin),
            Just(Step::Event),
            any::<u64>().prop_map(Step::Commit),
            (0u64..64, any::<bool>()).prop_map(|(s, ok)| Step::Ack(s, ok)),
            any::<u64>().prop_map(Step::Keepalive),
        ]
    }

    proptest! {
        /// Any order of messages and acknowledgements: errors for the out-of-order ones, never
        /// a panic, and the confirmed LSN never moves backwards.
        #[test]
        fn any_message_order_is_an_error_not_a_panic(
            steps in proptest::collection::vec(step(), 0..64),
        ) {
            let mut t = AckTracker::new(0);
            let mut last = 0;
            for s in steps {
                let open = t.in_transaction();
                match s {
                    Step::Begin(us) => prop_assert_eq!(t.begin_at(us).is_err(), open),
                    Step::Event => prop_assert_eq!(t.add_event().is_err(), !open),
                    Step::Commit(lsn) => prop_assert_eq!(t.commit(lsn).is_err(), !open),
                    Step::Ack(seq, ok) => t.ack(seq, ok),
                    Step::Keepalive(lsn) => t.keepalive(lsn),
                }
                prop_assert!(t.confirmed() >= last);
                last = t.confirmed();
                let _ = (t.is_pending(0), t.commit_us_of(0), t.in_flight(), t.delivery_mark_us());
                t.drain_completed(|_| {});
            }
        }

        /// Random transactions, random ack order, random failures: the confirmed LSN is exactly
        /// the commit LSN of the longest fully-acknowledged prefix of transactions.
        #[test]
        fn confirmed_is_the_longest_acked_prefix(
            sizes in proptest::collection::vec(0usize..6, 1..12),
            order_seed in any::<u64>(),
            fail_at in proptest::option::of(0usize..40),
            acked_fraction in 0.0f64..=1.0,
        ) {
            let mut t = AckTracker::new(0);
            let mut txn_of = Vec::new();
            for (i, &n) in sizes.iter().enumerate() {
                t.begin();
                for _ in 0..n { t.add_event().unwrap(); txn_of.push(i); }
                t.commit((i as u64 + 1) * 10).unwrap();
            }
            let total = txn_of.len();
            let mut seqs: Vec<usize> = (0..total).collect();
            // deterministic shuffle
            let mut s = order_seed | 1;
            for i in (1..seqs.len()).rev() {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                seqs.swap(i, (s % (i as u64 + 1)) as usize);
            }
            let n_acked = (total as f64 * acked_fraction) as usize;
            let mut ok = vec![false; total];
            for &q in &seqs[..n_acked] {
                let success = Some(q) != fail_at;
                t.ack(q as u64, success);
                ok[q] = success;
            }
            // model: txn i complete iff all its events ok
            let mut expect = 0u64;
            for (i, _) in sizes.iter().enumerate() {
                let complete = txn_of.iter().enumerate().filter(|(_, &tx)| tx == i).all(|(q, _)| ok[q]);
                if !complete { break; }
                expect = (i as u64 + 1) * 10;
            }
            prop_assert_eq!(t.confirmed(), expect);
        }
    }
}
