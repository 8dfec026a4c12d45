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

use crate::config::Config;
use crate::error::RelayError;
use crate::relay::ack::Seq;
use crate::relay::stages::Stages;
use crate::slot::join::{self, Debt, Out};
use std::future::Future;
use std::pin::Pin;
use tokio::sync::watch;

type Settle = Pin<Box<dyn Future<Output = Result<bool, RelayError>> + Send>>;

/// See the module docs. One per session.
#[derive(Default)]
pub struct Joining {
    /// Debts waiting for the settle.
    waiting: Vec<Debt>,
    settle: Option<Settle>,
    /// Debts whose rows and held events were handed over: recorded once every event before
    /// their end is acknowledged.
    fed: Vec<(Seq, Debt)>,
}

impl Joining {
    /// Holds the debts' tables and starts their settle.
    pub fn start(
        cfg: &Config,
        st: &mut Stages,
        debts: Vec<Debt>,
        shutdown: &watch::Receiver<bool>,
    ) -> Self {
        if debts.is_empty() {
            return Self::default();
        }
        for d in &debts {
            st.hold(&d.label());
        }
        let labels: Vec<String> = debts.iter().map(Debt::label).collect();
        tracing::warn!(tables = %labels.join(", "), "tables joined the publication after they held rows: streaming on while their rows are proven whole and republished (their own streamed events wait behind them)");
        let settle = join::settle(cfg.clone(), debts.clone(), shutdown.clone());
        Self {
            waiting: debts,
            settle: Some(Box::pin(settle)),
            fed: Vec::new(),
        }
    }

    /// Is a settle running?
    pub fn settling(&self) -> bool {
        self.settle.is_some()
    }

    /// Resolves when the settle finished (never when none runs): `Ok(false)` on shutdown.
    pub async fn settled(&mut self) -> Result<bool, RelayError> {
        match self.settle.as_mut() {
            Some(f) => {
                let r = f.await;
                self.settle = None;
                r
            }
            None => std::future::pending().await,
        }
    }

    /// After the settle, between transactions: each table's rows, then its held events, at
    /// `lsn` (at or below anything in flight). `Ok(false)`: shutdown first.
    pub async fn pay(
        &mut self,
        cfg: &Config,
        out: &mut Out<'_>,
        lsn: u64,
    ) -> Result<bool, RelayError> {
        for d in std::mem::take(&mut self.waiting) {
            // No stream event is read meanwhile: the rows go out unheld, the held ones after.
            let held = out.st.release(&d.label());
            let Some(end) = join::feed(cfg, out, lsn, &d).await? else {
                return Ok(false);
            };
            for (seq, rec) in &held {
                out.producer.send_held(rec, *seq).await;
            }
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
