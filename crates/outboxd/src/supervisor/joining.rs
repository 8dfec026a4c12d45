//! The tables a session catches up while it streams (issue 56, R53): a table that joined the
//! relayed set after it held rows is owed them ([`crate::slot::join`]). Before, the session
//! paid every debt before it streamed anything: a statistics settle (11 s) and the republishing,
//! during which no table was delivered. Now the session streams from the start; the joining
//! tables' streamed events are held ([`crate::relay::held`]); the settle runs off the session's
//! path, on its own connection; once it proved the tables whole, the session — between two
//! transactions — hands each table's rows to the stages and then its held events (so each
//! aggregate's versions leave in order), and records the table as joined once all of that is
//! acknowledged. A crash at any point loses nothing: held events were never acknowledged, and
//! an unrecorded table is owed again by the next session (duplicates only).

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::ack::Seq;
use crate::relay::kafka::Producer;
use crate::relay::source::sql_bounded;
use crate::relay::stages::Stages;
use crate::slot::join::{self, Debt, Out};
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use tokio::sync::watch;

type Settle = Pin<Box<dyn Future<Output = Result<bool, RelayError>> + Send>>;

/// Debts waiting for one settle.
struct Batch {
    debts: Vec<Debt>,
    settle: Settle,
}

/// See the module docs. One per session.
#[derive(Default)]
pub struct Joining {
    batches: Vec<Batch>,
    /// Debts whose rows and held events were handed over: recorded once every event before
    /// their end is acknowledged.
    fed: Vec<(Seq, Debt)>,
    /// Tables taken into the running session (`schema.table`).
    known: Vec<String>,
}

impl Joining {
    /// Holds the debts' tables (found at the session's start) and starts their settle.
    pub fn start(
        cfg: &Config,
        st: &mut Stages,
        debts: Vec<Debt>,
        shutdown: &watch::Receiver<bool>,
    ) -> Self {
        let mut j = Self::default();
        for d in &debts {
            st.hold(&d.label());
        }
        j.settle(cfg, debts, shutdown);
        j
    }

    fn settle(&mut self, cfg: &Config, debts: Vec<Debt>, shutdown: &watch::Receiver<bool>) {
        if debts.is_empty() {
            return;
        }
        let labels: Vec<String> = debts.iter().map(Debt::label).collect();
        tracing::warn!(tables = %labels.join(", "), "tables joined the publication after they held rows: streaming on while their rows are proven whole and republished (their own streamed events wait behind them)");
        let settle = join::settle(cfg.clone(), debts.clone(), shutdown.clone());
        self.batches.push(Batch {
            debts,
            settle: Box::pin(settle),
        });
    }

    /// A table that joined while the session streams, taken in by the stages (its events
    /// held): released at once when it is owed nothing, otherwise paid like the others.
    pub async fn arrive(
        &mut self,
        cfg: &Config,
        st: &mut Stages,
        producer: &Producer,
        (t, oid): (OutboxTable, Option<u32>),
        shutdown: &watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let label = t.label();
        self.known.push(label.clone());
        match sql_bounded(join::assess(cfg, st.sql(), &t, oid)).await? {
            None => {
                for (seq, rec) in st.release(&label) {
                    producer.send_held(&rec, seq).await;
                }
                st.unmark(&label);
            }
            Some(debt) => self.settle(cfg, vec![debt], shutdown),
        }
        Ok(())
    }

    /// The tables taken into the running session.
    pub fn known(&self) -> &[String] {
        &self.known
    }

    /// Is a settle running?
    pub fn settling(&self) -> bool {
        !self.batches.is_empty()
    }

    /// Resolves when a settle finished (never when none runs), with its batch: `Ok(false)` on
    /// shutdown.
    pub async fn settled(&mut self) -> (usize, Result<bool, RelayError>) {
        std::future::poll_fn(|cx| {
            for (i, b) in self.batches.iter_mut().enumerate() {
                if let Poll::Ready(r) = b.settle.as_mut().poll(cx) {
                    return Poll::Ready((i, r));
                }
            }
            Poll::Pending
        })
        .await
    }

    /// After batch `i`'s settle, between transactions: each table's rows, then its held
    /// events, at `lsn` (at or below anything in flight). `Ok(false)`: shutdown first.
    pub async fn pay(
        &mut self,
        i: usize,
        cfg: &Config,
        out: &mut Out<'_>,
        lsn: u64,
    ) -> Result<bool, RelayError> {
        let batch = self.batches.remove(i);
        for d in batch.debts {
            // No stream event is read meanwhile: the rows go out unheld, the held ones after.
            let held = out.st.release(&d.label());
            let Some(end) = join::feed(cfg, out, lsn, &d).await? else {
                return Ok(false);
            };
            for (seq, rec) in &held {
                out.producer.send_held(rec, *seq).await;
            }
            // Its rows are in flight under `lsn`: the join may be confirmed past once they land.
            out.st.unmark(&d.label());
            self.fed.push((end, d));
        }
        Ok(true)
    }

    /// With the state writes: records the tables whose rows and held events are acknowledged.
    pub async fn record_acked(&mut self, cfg: &Config, st: &Stages) -> Result<(), RelayError> {
        let mut i = 0;
        while i < self.fed.len() {
            if st.in_flight().acked_before(self.fed[i].0) {
                let (_, d) = self.fed.remove(i);
                join::record(cfg, st.sql(), &d).await?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }
}
