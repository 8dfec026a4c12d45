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

use super::outstanding::Outstanding;
use super::{Ack, Ctx, Producer, Verdict};
use crate::config::Config;
use crate::error::RelayError;
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

/// The open transaction's bookkeeping, shared by the sends, librdkafka's delivery callback and
/// the committer.
pub(super) struct Txn {
    /// Sends hold it shared; a commit holds it exclusively.
    gate: Arc<RwLock<()>>,
    /// The producer's count of records handed over and reported on.
    out: Outstanding,
    /// Records handed over at the last commit.
    committed: AtomicU64,
    /// Delivered records' acknowledgements, until their transaction commits.
    held: Mutex<Vec<Ack>>,
    wake: Notify,
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

    /// librdkafka's report on one record, before it is counted (`Outstanding::reported`):
    /// a delivered record's acknowledgement waits for its transaction to commit.
    pub(super) fn hold(&self, ack: Ack, acks: &mpsc::UnboundedSender<Ack>) {
        if matches!(ack.verdict, Verdict::Delivered) {
            self.held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(ack);
        } else {
            let _ = acks.send(ack);
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
    /// is sent meanwhile). A failed commit turns them into retriable failures: the session ends
    /// and the next one produces them again from the slot.
    fn settle(&self, p: &ThreadedProducer<Ctx>, acks: &mpsc::UnboundedSender<Ack>) -> bool {
        let sent = self.out.handed();
        let mut failed = None;
        if sent != self.committed.swap(sent, SeqCst) {
            if let Err(e) = p
                .commit_transaction(TXN_TIMEOUT)
                .and_then(|()| p.begin_transaction())
            {
                failed = Some(e);
            }
        }
        let held = std::mem::take(&mut *self.held.lock().unwrap_or_else(|e| e.into_inner()));
        let Some(e) = failed else {
            // Acknowledged when the transaction committed, not when the broker had the record.
            let at_us = crate::obs::now_us();
            for a in held {
                let _ = acks.send(Ack { at_us, ..a });
            }
            return true;
        };
        let message = p.context().redactor.scrub(&e.to_string());
        let code = e.rdkafka_error_code();
        tracing::warn!(error = %message, "Kafka transaction not committed: the session restarts from the slot");
        for a in held {
            let verdict = Verdict::Retriable {
                event_id: String::new(),
                code: code.map_or_else(|| "Unknown".into(), |c| format!("{c:?}")),
                class: code.map(policy::class_of).unwrap_or("delivery"),
                message: message.clone(),
            };
            let _ = acks.send(Ack::now(a.origin, verdict));
        }
        if let KafkaError::Transaction(t) = &e {
            if t.txn_requires_abort() {
                let _ = p.abort_transaction(TXN_TIMEOUT);
                let _ = p.begin_transaction();
                return true;
            }
        }
        // Fenced or fatal: this producer can do nothing more.
        false
    }

    /// Something to commit, or held acknowledgements of committed records to hand over.
    /// `timed_out`: the transaction has been open [`commit_after`].
    fn due(&self, timed_out: bool) -> bool {
        let (sent, committed) = (self.out.handed(), self.committed.load(SeqCst));
        let all_in = self.out.all_reported();
        let held = !self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
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
        let (mut p, rx) = Self::create(cfg, observed, Some(&id))?;
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
                    t.settle(&p, &a)
                });
                if !settled.await.unwrap_or(false) {
                    return;
                }
                after = linger.max(started.elapsed().min(Duration::from_secs(1)));
            }
        })));
        Ok((p, rx))
    }
}
