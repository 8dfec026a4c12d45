//! Fencing at the broker (`relay.broker_fencing`; docs/reliability.md, "Fencing").
//!
//! Why: a holder frozen (SIGSTOP, a paused VM) with records in librdkafka's queue sends them the
//! moment it thaws: librdkafka's threads resume with the rest of the process, before the session
//! loop can see that a standby took the slot, so older versions would land after the new
//! holder's. No check inside the process closes that — the freeze can fall between any check and
//! the send — but the broker can: every session produces in Kafka transactions under one
//! `transactional.id` per database and slot ([`transactional_id`]). The new holder's
//! `init_transactions` bumps the producer epoch, so the broker refuses every Produce of the old
//! producer from then on (and Kafka aborts its open transaction: `read_committed` consumers never
//! see those records).
//!
//! Acknowledgements wait for the commit: a delivered record of an open transaction may still be
//! aborted, so its position must not be confirmed before the commit. A committer task commits as
//! soon as every record of the open transaction has its report (under a steady load after
//! `linger.ms`, and no sooner than the last commit took), keeping sends out meanwhile (librdkafka refuses a send during a commit),
//! then hands the held acknowledgements to the session. Refusals are not held: the session ends
//! (or parks) on them at once.
//!
//! A transaction that does not commit (the commit timed out in a broker outage, a record was
//! refused, the producer was fenced) acknowledges nothing, ever: its held acknowledgements and
//! every report still to come — librdkafka's abort waits for the requests in flight, and the
//! broker may have appended them — become failures, and one failure for the transaction itself
//! ends the session even when no report came back ([`Txn::fail`]). The next session's producer
//! fences this one and sends the records again from the slot. A record the broker refused
//! inside a transaction is parked; it is remembered for the relay's later sessions
//! ([`remember_refusal`]), which park it again without sending it, so its neighbours commit
//! instead of being aborted with it in every session (`ordering = "none"` holds nothing back
//! behind a parked event).

use super::outstanding::Outstanding;
use super::{Ack, Ctx, Origin, Producer, Verdict};
use crate::config::Config;
use crate::error::RelayError;
use crate::obs::telemetry::span::Publisher;
use crate::poison::policy;
use rdkafka::error::KafkaError;
use rdkafka::producer::{Producer as _, ThreadedProducer};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, Notify, RwLock};

/// How long a transaction stays open while its reports never all catch up (a steady load):
/// librdkafka's `linger.ms`, the wait it applies to a batch anyway. A commit makes librdkafka
/// send at once, so committing sooner would defeat `linger.ms`; committing later only delays
/// the acknowledgements (measured: a fixed 1 s made commit→ack p99 1.3 s at 2.5 % load).
/// At least [`MIN_COMMIT_AFTER`]: the default `linger.ms` (1) only covers handing a gathered
/// burst over (`relay::gulp`), and a commit per millisecond would make every request a
/// transaction of its own.
fn commit_after(cfg: &Config) -> Duration {
    let linger = super::client_config(cfg)
        .get("linger.ms")
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(10.0);
    Duration::from_secs_f64((linger / 1000.0).clamp(0.001, 60.0)).max(MIN_COMMIT_AFTER)
}

/// The shortest time a Kafka transaction stays open under a steady load (the `linger.ms`
/// default of the measurements in docs/benchmarks.md, "Broker fencing: what it costs").
const MIN_COMMIT_AFTER: Duration = Duration::from_millis(10);
/// Bound on `init_transactions` and on a commit (which waits for the transaction's records).
const TXN_TIMEOUT: Duration = Duration::from_secs(30);

/// The `transactional.id` of every session of one slot on one database: what lets the next
/// holder fence this one. The timeline is left out so that a promoted replica's relay fences
/// the old primary's.
pub fn transactional_id(system_id: &str, database: &str, slot: &str) -> String {
    format!("outboxd:{system_id}:{database}:{slot}")
}

/// A failed commit or abort, as the transaction's state machine needs it (the seam the unit
/// tests replace: [`TxnOps`]).
#[derive(Debug, Clone)]
pub(super) struct OpError {
    /// librdkafka's code name (`TimedOut`, `ProducerFenced`, …), for the message.
    code: String,
    /// Bounded label for metrics.
    class: &'static str,
    /// Redacted.
    message: String,
    /// The transaction cannot commit any more: abort it so the broker ends it now (a
    /// `read_committed` consumer waits behind an open transaction until it ends).
    requires_abort: bool,
}

/// What the transaction's state machine asks of the producer. librdkafka's transactional
/// producer in the relay; a fake in the unit tests, which make reports arrive during an abort.
pub(super) trait TxnOps {
    fn commit(&self) -> Result<(), OpError>;
    fn abort(&self) -> Result<(), OpError>;
    fn begin(&self) -> Result<(), OpError>;
}

impl TxnOps for ThreadedProducer<Ctx> {
    fn commit(&self) -> Result<(), OpError> {
        self.commit_transaction(TXN_TIMEOUT)
            .map_err(|e| op_error(self, &e))
    }
    fn abort(&self) -> Result<(), OpError> {
        self.abort_transaction(TXN_TIMEOUT)
            .map_err(|e| op_error(self, &e))
    }
    fn begin(&self) -> Result<(), OpError> {
        self.begin_transaction().map_err(|e| op_error(self, &e))
    }
}

fn op_error(p: &ThreadedProducer<Ctx>, e: &KafkaError) -> OpError {
    let code = e.rdkafka_error_code();
    OpError {
        code: code.map_or_else(|| "Unknown".into(), |c| format!("{c:?}")),
        class: code.map(policy::class_of).unwrap_or("delivery"),
        message: p.context().redactor.scrub(&e.to_string()),
        requires_abort: matches!(e, KafkaError::Transaction(t) if t.txn_requires_abort()),
    }
}

/// The open transaction's bookkeeping, shared by the sends, librdkafka's delivery callback and
/// the committer.
pub(super) struct Txn {
    /// Sends hold it shared; a commit holds it exclusively.
    gate: Arc<RwLock<()>>,
    /// The producer's count of records handed over and reported on.
    out: Outstanding,
    /// Records handed over at the last commit.
    committed: AtomicU64,
    /// Delivered records' acknowledgements, until their transaction commits; and whether a
    /// transaction of this producer failed (one lock: a report is either held before the
    /// failure, and turned into a failure with the rest, or sees it).
    held: Mutex<Held>,
    wake: Notify,
}

#[derive(Default)]
struct Held {
    acks: Vec<Ack>,
    /// Set once, never cleared: a transaction of this producer did not commit. Every report
    /// from then on is a failure, whatever the broker said — a record delivered into an
    /// aborted (or never committed) transaction is not delivered — and nothing is committed
    /// or released any more: the session ends on the failure and the next one, with a new
    /// producer, sends these records again from the slot.
    failed: Option<OpError>,
}

impl Txn {
    pub(super) fn new(out: Outstanding) -> Self {
        Self {
            gate: Default::default(),
            out,
            committed: Default::default(),
            held: Default::default(),
            wake: Notify::new(),
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// librdkafka's report on one record, before it is counted (`Outstanding::reported`):
    /// a delivered record's acknowledgement waits for its transaction to commit. After a
    /// failed transaction it is a failure instead (see [`Held::failed`]); a refusal stays a
    /// refusal (the record itself is refused: parked or halted on).
    pub(super) fn hold(&self, ack: Ack, acks: &mpsc::UnboundedSender<Ack>) {
        let mut held = self.held();
        match (&held.failed, &ack.verdict) {
            (_, Verdict::Rejected { .. }) | (None, Verdict::Retriable { .. }) => {
                drop(held);
                let _ = acks.send(ack);
            }
            (None, Verdict::Delivered) => held.acks.push(ack),
            (Some(f), _) => {
                let _ = acks.send(Ack::now(ack.origin, retriable(f)));
            }
        }
    }

    /// Every record handed over is reported on: a commit may be due.
    pub(super) fn all_reported(&self) {
        self.wake.notify_one();
    }

    /// A send starts (hold the returned guard until librdkafka took or refused the record).
    pub(super) async fn enter(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.gate.read().await
    }

    /// Under the exclusive gate: commit what was sent since the last commit and open the next
    /// transaction, then release the held acknowledgements (all of committed records: nothing
    /// is sent meanwhile). Returns whether the producer can go on; when a commit fails it
    /// cannot (see [`Txn::fail`]).
    fn settle(&self, p: &impl TxnOps, acks: &mpsc::UnboundedSender<Ack>) -> bool {
        if self.held().failed.is_some() {
            return false;
        }
        let sent = self.out.handed();
        if sent != self.committed.swap(sent, SeqCst) {
            if let Err(e) = p.commit().and_then(|()| p.begin()) {
                self.fail(p, e, acks);
                return false;
            }
        }
        let held = std::mem::take(&mut self.held().acks);
        // Acknowledged when the transaction committed, not when the broker had the record.
        let at_us = crate::obs::now_us();
        for a in held {
            let _ = acks.send(Ack { at_us, ..a });
        }
        true
    }

    /// The open transaction did not commit: from now on every acknowledgement of this
    /// producer is a failure (held ones now, reports still to come — during the abort, after
    /// it — as they arrive), and one failure names the transaction, so the session ends even
    /// when no report came back at all (a commit that timed out in a broker outage). The
    /// next session's producer fences this one (`init_transactions`) and sends it all again
    /// from the slot.
    fn fail(&self, p: &impl TxnOps, e: OpError, acks: &mpsc::UnboundedSender<Ack>) {
        tracing::warn!(
            error = %e.message,
            code = %e.code,
            "Kafka transaction not committed: its records are not acknowledged; the session \
             restarts from the slot and sends them again"
        );
        let held = {
            let mut held = self.held();
            held.failed = Some(e.clone());
            std::mem::take(&mut held.acks)
        };
        let _ = acks.send(Ack::now(Origin::Transaction, retriable(&e)));
        for a in held {
            let _ = acks.send(Ack::now(a.origin, retriable(&e)));
        }
        if e.requires_abort {
            // Reports of records still in flight arrive during the abort: failures (above).
            if let Err(a) = p.abort() {
                tracing::warn!(error = %a.message, "Kafka transaction not aborted: the broker ends it after transaction.timeout.ms, or the next session's producer does");
            }
        }
    }

    /// Something to commit, or held acknowledgements of committed records to hand over.
    /// `timed_out`: the transaction has been open [`commit_after`].
    fn due(&self, timed_out: bool) -> bool {
        let (sent, committed) = (self.out.handed(), self.committed.load(SeqCst));
        let all_in = self.out.all_reported();
        let held = !self.held().acks.is_empty();
        (sent > committed && (all_in || timed_out)) || (sent == committed && held)
    }

    /// [`Producer::flush`]: commit now if no commit runs (the drain at the end of a session
    /// blocks the runtime thread, so the committer task may not get to run).
    pub(super) fn flush(&self, p: &ThreadedProducer<Ctx>, acks: &mpsc::UnboundedSender<Ack>) {
        if let Ok(_gate) = self.gate.try_write() {
            self.settle(p, acks);
        }
    }
}

/// How many refusals [`remember_refusal`] keeps (one relay's poison events, a few at most).
const REFUSALS_KEPT: usize = 10_000;

/// A stream event the broker refused inside a Kafka transaction: the refusal aborts the whole
/// transaction (librdkafka), so its neighbours are sent again by the next session; remembered
/// so that session parks it again instead of sending it (which would abort them again, in
/// every session: `ordering = "none"` holds nothing back behind a parked event).
pub(super) fn remember_refusal(observed: &crate::obs::Observed, ack: &Ack) {
    if let (
        Origin::Stream(_),
        Verdict::Rejected {
            class,
            message,
            record,
        },
    ) = (&ack.origin, &ack.verdict)
    {
        let mut kept = observed
            .refused_in_txn
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if kept.len() < REFUSALS_KEPT {
            kept.insert(record.event_id.clone(), (class, message.clone()));
        }
    }
}

/// [`remember_refusal`]'s verdict for an event about to be sent, if the broker refused it in
/// an earlier transaction of this relay: parked again, not sent. (After a restart of the
/// process it is sent once more, refused, and remembered: one more session, never a loop.)
pub(super) fn refused_before(
    observed: &crate::obs::Observed,
    event_id: &str,
    record: impl FnOnce() -> crate::poison::record::ParkedRecord,
) -> Option<Verdict> {
    let kept = observed
        .refused_in_txn
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let (class, message) = kept.get(event_id)?;
    Some(Verdict::Rejected {
        class,
        message: format!(
            "{message} (refused by the broker inside a Kafka transaction: parked without \
             sending it again, which would abort the transaction of the events around it)"
        ),
        record: record(),
    })
}

/// The failure every acknowledgement of a failed transaction becomes.
fn retriable(e: &OpError) -> Verdict {
    Verdict::Retriable {
        event_id: String::new(),
        code: e.code.clone(),
        class: e.class,
        message: format!(
            "Kafka transaction not committed: {} — nothing of it is confirmed; the session \
             restarts from the slot and sends its records again (if this repeats, check the \
             brokers and the transaction coordinator: `outboxd check`)",
            e.message
        ),
    }
}

/// The committer task; aborted when the producer is dropped.
pub(super) struct Committer(tokio::task::JoinHandle<()>);

impl Drop for Committer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Producer {
    /// The session's producer: transactional, fencing earlier holders of the slot at the broker,
    /// with `relay.broker_fencing`; plain otherwise. `system_id` is the database's.
    pub async fn for_session(
        cfg: &Config,
        observed: Arc<crate::obs::Observed>,
        system_id: &str,
        sql: &tokio_postgres::Client,
    ) -> Result<(Self, mpsc::UnboundedReceiver<Ack>), RelayError> {
        if !cfg.relay.broker_fencing {
            return Self::new(cfg, observed);
        }
        let db = crate::relay::source::sql_bounded(async {
            Ok(sql.query_one("SELECT current_database()", &[]).await?)
        })
        .await?
        .get::<_, String>(0);
        let id = transactional_id(system_id, &db, &cfg.source.slot);
        let (mut p, rx) = Self::create(cfg, observed, Some(&id), Publisher::Stream)?;
        let txn = p.inner.context().txn.clone().expect("transactional");
        // Blocking, once per session: this is the fence (the broker bumps the epoch).
        p.inner
            .init_transactions(TXN_TIMEOUT)
            .and_then(|()| p.inner.begin_transaction())
            .map_err(|e| {
                let msg = cfg.redactor.scrub(&e.to_string());
                RelayError::Kafka(format!("cannot start Kafka transactions: {msg}"))
            })?;
        let (inner, acks) = (p.inner.clone(), p.inner.context().acks.clone());
        let linger = commit_after(cfg);
        p._committer = Some(Committer(tokio::spawn(async move {
            let mut opened: Option<std::time::Instant> = None;
            // Sends wait while a commit runs (librdkafka refuses them), so a transaction stays
            // open at least as long as the last commit took: on a broker whose commits are slow
            // the batches grow instead of the stream stalling on back-to-back commits.
            let mut after = linger;
            loop {
                let _ = tokio::time::timeout(after, txn.wake.notified()).await;
                let open = txn.out.handed() > txn.committed.load(SeqCst);
                let since = match (open, opened) {
                    (false, _) => {
                        opened = None;
                        std::time::Instant::now()
                    }
                    (true, Some(t)) => t,
                    (true, None) => *opened.insert(std::time::Instant::now()),
                };
                if !txn.due(since.elapsed() >= after) {
                    continue;
                }
                opened = None;
                let gate = txn.gate.clone().write_owned().await;
                let (t, p, a) = (txn.clone(), inner.clone(), acks.clone());
                let started = std::time::Instant::now();
                let settled = tokio::task::spawn_blocking(move || {
                    let _gate = gate;
                    t.settle(&*p, &a)
                });
                if !settled.await.unwrap_or(false) {
                    // Nothing commits any more: the session ends on the failure (`Txn::fail`).
                    return;
                }
                after = linger.max(started.elapsed().min(Duration::from_secs(1)));
            }
        })));
        Ok((p, rx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poison::record::ParkedRecord;

    /// librdkafka's transaction calls, scripted: the commits' results (then `Ok`), and the
    /// reports that arrive while the abort waits for the records still in flight (librdkafka's
    /// abort flushes them; the broker may well have appended them).
    struct Fake<'a> {
        txn: &'a Txn,
        acks: &'a mpsc::UnboundedSender<Ack>,
        commits: Mutex<Vec<Result<(), OpError>>>,
        during_abort: Mutex<Vec<Ack>>,
        aborted: std::sync::atomic::AtomicBool,
    }

    impl TxnOps for Fake<'_> {
        fn commit(&self) -> Result<(), OpError> {
            let mut commits = self.commits.lock().unwrap();
            if commits.is_empty() {
                Ok(())
            } else {
                commits.remove(0)
            }
        }
        fn abort(&self) -> Result<(), OpError> {
            for a in std::mem::take(&mut *self.during_abort.lock().unwrap()) {
                report(self.txn, a, self.acks);
            }
            self.aborted.store(true, SeqCst);
            Ok(())
        }
        fn begin(&self) -> Result<(), OpError> {
            Ok(())
        }
    }

    fn fake<'a>(
        txn: &'a Txn,
        acks: &'a mpsc::UnboundedSender<Ack>,
        commit: Result<(), OpError>,
    ) -> Fake<'a> {
        Fake {
            txn,
            acks,
            commits: Mutex::new(vec![commit]),
            during_abort: Mutex::default(),
            aborted: Default::default(),
        }
    }

    /// What the delivery callback does with a report (`Ctx::delivery`).
    fn report(txn: &Txn, ack: Ack, acks: &mpsc::UnboundedSender<Ack>) {
        txn.hold(ack, acks);
        if txn.out.reported() {
            txn.all_reported();
        }
    }

    fn delivered(seq: u64) -> Ack {
        Ack::now(Origin::Stream(seq), Verdict::Delivered)
    }

    fn refused(seq: u64) -> Ack {
        let record = ParkedRecord {
            event_id: format!("e{seq}"),
            ..Default::default()
        };
        let (class, message) = ("invalid_record", "refused".into());
        Ack::now(
            Origin::Stream(seq),
            Verdict::Rejected {
                class,
                message,
                record,
            },
        )
    }

    fn error(requires_abort: bool) -> OpError {
        OpError {
            code: if requires_abort {
                "InvalidRecord"
            } else {
                "TimedOut"
            }
            .into(),
            class: "delivery",
            message: "broker said no".into(),
            requires_abort,
        }
    }

    fn drain(rx: &mut mpsc::UnboundedReceiver<Ack>) -> Vec<Ack> {
        std::iter::from_fn(|| rx.try_recv().ok()).collect()
    }

    fn hand(txn: &Txn, n: usize) {
        for _ in 0..n {
            txn.out.handing();
        }
    }

    #[test]
    fn a_committed_transaction_releases_its_acknowledgements() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let txn = Txn::new(Outstanding::default());
        hand(&txn, 2);
        report(&txn, delivered(1), &tx);
        report(&txn, delivered(2), &tx);
        assert!(drain(&mut rx).is_empty(), "released before the commit");
        assert!(txn.due(false));
        assert!(txn.settle(&fake(&txn, &tx, Ok(())), &tx));
        let acks = drain(&mut rx);
        assert_eq!(acks.len(), 2);
        assert!(acks.iter().all(|a| matches!(a.verdict, Verdict::Delivered)));
    }

    /// Issue 39: acknowledgements held when the commit failed, reports arriving during the
    /// abort and after it: none is ever released as delivered.
    #[test]
    fn an_aborted_transaction_never_releases_an_acknowledgement() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let txn = Txn::new(Outstanding::default());
        hand(&txn, 3);
        report(&txn, delivered(1), &tx);
        report(&txn, refused(2), &tx);
        let ops = fake(&txn, &tx, Err(error(true)));
        ops.during_abort.lock().unwrap().push(delivered(3));
        assert!(
            !txn.settle(&ops, &tx),
            "the producer goes on after a failed commit"
        );
        assert!(ops.aborted.load(SeqCst), "not aborted");
        // A record sent before the session saw the failure, reported later; the next commit
        // would succeed (the transaction after the abort), and must release none of them.
        hand(&txn, 1);
        report(&txn, delivered(4), &tx);
        assert!(!txn.settle(&ops, &tx));
        let acks = drain(&mut rx);
        assert!(
            !acks.iter().any(|a| matches!(a.verdict, Verdict::Delivered)),
            "{acks:?}"
        );
        let origins: Vec<Origin> = acks.iter().map(|a| a.origin).collect();
        for o in [Origin::Transaction, Origin::Stream(1), Origin::Stream(3)] {
            assert!(origins.contains(&o), "{o:?} missing: {acks:?}");
        }
        assert!(origins.contains(&Origin::Stream(4)), "{acks:?}");
        // The refused record stays refused (parked), never retried as a neighbour would be.
        let two = acks.iter().find(|a| a.origin == Origin::Stream(2));
        assert!(matches!(
            two.map(|a| &a.verdict),
            Some(Verdict::Rejected { .. })
        ));
    }

    /// Issue 39: a commit that times out (a broker outage) with every report still missing
    /// ends the session: a failure for the transaction itself, and the late reports are
    /// failures too.
    #[test]
    fn a_commit_that_times_out_ends_the_session() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let txn = Txn::new(Outstanding::default());
        hand(&txn, 2);
        let ops = fake(&txn, &tx, Err(error(false)));
        assert!(txn.due(true));
        assert!(!txn.settle(&ops, &tx));
        assert!(
            !ops.aborted.load(SeqCst),
            "a retriable failure needs no abort"
        );
        let acks = drain(&mut rx);
        assert_eq!(acks.len(), 1, "{acks:?}");
        assert_eq!(acks[0].origin, Origin::Transaction);
        match &acks[0].verdict {
            Verdict::Retriable { code, message, .. } => {
                assert_eq!(code, "TimedOut");
                assert!(message.contains("restarts from the slot"), "{message}");
            }
            v => panic!("{v:?}"),
        }
        report(&txn, delivered(1), &tx);
        report(&txn, delivered(2), &tx);
        let late = drain(&mut rx);
        assert_eq!(late.len(), 2);
        assert!(late
            .iter()
            .all(|a| matches!(a.verdict, Verdict::Retriable { .. })));
    }

    #[test]
    fn a_refusal_in_a_transaction_is_parked_again_without_sending() {
        let observed = crate::obs::Observed::default();
        let rec = || ParkedRecord {
            event_id: "e2".into(),
            ..Default::default()
        };
        assert!(refused_before(&observed, "e2", rec).is_none());
        remember_refusal(&observed, &delivered(1));
        remember_refusal(&observed, &refused(2));
        match refused_before(&observed, "e2", rec) {
            Some(Verdict::Rejected { class, record, .. }) => {
                assert_eq!(class, "invalid_record");
                assert_eq!(record.event_id, "e2");
            }
            v => panic!("{v:?}"),
        }
        assert!(refused_before(&observed, "e1", rec).is_none());
    }
}
