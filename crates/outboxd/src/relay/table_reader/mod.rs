//! The table reader: publishes outbox rows read from the table, not from the WAL, through a
//! session's stages ([`Stages`]), so each record is byte-identical to the one the live stream
//! made of the same row — same router, validation, producer, original `event_id`.
//!
//! Rows become what pgoutput would have sent: one Relation message built from the catalog
//! (columns as pgoutput announces them), then per batch a synthetic Begin, one Insert per row
//! (every column as its text output) and a Commit. The ack tracker then tells which batches the
//! broker fully acknowledged, in order, exactly as it does for real transactions.
//!
//! Two users, two ways to read:
//! - slot-loss recovery ([`crate::slot::recovery`]) reads a cursor under the snapshot the new
//!   slot exported (`Rows::Cursor`): the gap must be exactly what that snapshot saw, and all
//!   batches share the slot's consistent point as their LSN;
//! - replay ([`crate::replay`]) reads pages per aggregate in version order, each page its own
//!   statement (`Rows::Pages`): a rate-capped replay may take hours, and a snapshot held that
//!   long would hold back vacuum. Each batch gets its own synthetic LSN, so the position of the
//!   last fully acknowledged batch is known ([`Hooks::acknowledged`]): that is where a replay
//!   resumes after a crash.

mod rows;

pub use rows::{relation, relation_of, Filter, Position};

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::kafka::{Ack, Producer};
use crate::relay::pgoutput::encode;
use crate::relay::stages::Stages;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use pgwire_replication::{Lsn, ReplicationEvent};
use rows::{Rows, Source};
use std::collections::VecDeque;
use std::future::Future;
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;

/// The LSNs of the synthetic transactions.
#[derive(Debug, Clone, Copy)]
pub enum Lsns {
    /// All at one LSN (recovery: the slot's consistent point, where the stream continues).
    Fixed(u64),
    /// 1, 2, 3, … (stages started at 0): the confirmed LSN names the acknowledged batch.
    Counting,
}

/// What the publisher calls back.
pub trait Hooks {
    /// Before each row is handed to the stages: a rate cap waits here.
    fn before_row(&mut self) -> impl Future<Output = ()>;
    /// Every row up to and including `through` (`acked` rows in all, in this reader) is
    /// acknowledged by the broker.
    fn acknowledged(
        &mut self,
        through: Option<&Position>,
        acked: u64,
    ) -> impl Future<Output = Result<(), RelayError>>;
}

/// No pacing, no bookkeeping (recovery).
pub struct NoHooks;

impl Hooks for NoHooks {
    async fn before_row(&mut self) {}
    async fn acknowledged(&mut self, _: Option<&Position>, _: u64) -> Result<(), RelayError> {
        Ok(())
    }
}

/// How publishing ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Flow {
    /// Every row was read, produced and acknowledged.
    Done,
    /// Shutdown was requested first; what was acknowledged was reported to the hooks.
    Shutdown,
}

/// A batch handed to the stages and not yet reported as acknowledged.
struct Batch {
    lsn: u64,
    last: Option<Position>,
    rows: u64,
}

/// See the module docs.
pub struct TableReader {
    src: Source,
    commit_us: i64,
    lsns: Lsns,
    next_lsn: u64,
    pending: VecDeque<Batch>,
    sent: u64,
    acked: u64,
    /// Crash hook hit after each row (`recovery_produced`, `replay_produced`).
    fail_point: &'static str,
}

impl TableReader {
    /// Prepares `client` (a connection of its own) for reading: text output as the reader
    /// expects it. Call before opening the caller's transaction.
    pub async fn prepare_session(client: &Client) -> Result<(), RelayError> {
        Source::prepare_session(client).await
    }

    /// A reader of the rows matching `filter` (SQL over alias `o`, literals only) in `order`,
    /// through a cursor declared now, inside the transaction (and snapshot) `client` holds.
    pub async fn cursor(
        table: &OutboxTable,
        client: Client,
        filter: &str,
        order: &[String],
        lsn: u64,
        commit_at: DateTime<Utc>,
        fail_point: &'static str,
    ) -> Result<Self, RelayError> {
        let src = Source::new(table, client, Rows::Cursor).await?;
        src.declare(filter, order).await?;
        Ok(Self::new(src, Lsns::Fixed(lsn), commit_at, fail_point))
    }

    /// A reader of the rows matching `filter` after `after`, per aggregate in version order
    /// ([`rows::Order`]), `batch` rows per page (and per synthetic transaction). `client` must have had
    /// [`TableReader::prepare_session`].
    pub async fn pages(
        cfg: &Config,
        client: Client,
        filter: Filter,
        after: Option<Position>,
        batch: usize,
        fail_point: &'static str,
    ) -> Result<Self, RelayError> {
        // Replay reads one table (it refuses a configuration listing several).
        let table = &cfg.tables()[0];
        let mut src = Source::new(table, client, Rows::Pages { filter, after }).await?;
        if src.order.is_none() {
            return Err(RelayError::Setup(
                "the outbox mapping does not name the columns the replay order needs \
                 (aggregate type, aggregate id, event_id)"
                    .into(),
            ));
        }
        src.batch = batch.max(1);
        Ok(Self::new(src, Lsns::Counting, Utc::now(), fail_point))
    }

    fn new(src: Source, lsns: Lsns, commit_at: DateTime<Utc>, fail_point: &'static str) -> Self {
        Self {
            src,
            commit_us: commit_at.timestamp_micros() - crate::relay::lsn::PG_EPOCH_US,
            next_lsn: match lsns {
                Lsns::Fixed(l) => l,
                Lsns::Counting => 1,
            },
            lsns,
            pending: VecDeque::new(),
            sent: 0,
            acked: 0,
            fail_point,
        }
    }

    /// The reader's connection (the caller ends its transaction).
    pub fn client(&self) -> &Client {
        &self.src.client
    }

    /// The reader's connection back, its transaction (and snapshot) still open, to read the
    /// next table (after `CLOSE outboxd_table_reader`).
    pub fn into_client(self) -> Client {
        self.src.client
    }

    /// Rows handed to the stages so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    fn xlog(&self, data: Vec<u8>) -> ReplicationEvent {
        ReplicationEvent::XLogData {
            wal_start: Lsn(0),
            wal_end: Lsn(0),
            server_time_micros: self.commit_us,
            data: Bytes::from(data),
        }
    }

    /// Reads every row, feeds it to the stages and waits until the broker acknowledged all of
    /// them (`Flow::Done`), or until shutdown is requested (`Flow::Shutdown`). Backpressure is
    /// the live stream's: at most `relay.max_in_flight_events` unacknowledged.
    pub async fn publish(
        &mut self,
        cfg: &Config,
        st: &mut Stages,
        producer: &Producer,
        acks: &mut mpsc::UnboundedReceiver<Ack>,
        shutdown: &mut watch::Receiver<bool>,
        hooks: &mut impl Hooks,
    ) -> Result<Flow, RelayError> {
        if self.feed(cfg, st, producer, acks, shutdown, hooks).await? == Flow::Shutdown {
            return Ok(Flow::Shutdown);
        }
        if self.settle(st, producer, acks, shutdown, hooks).await? {
            Ok(Flow::Done)
        } else {
            Ok(Flow::Shutdown)
        }
    }

    /// [`TableReader::publish`] without waiting for the acknowledgements: every row is handed
    /// to the stages (so the producer has them in order), some may still be in flight. For a
    /// session that streams on meanwhile ([`crate::relay::held`]): events it holds count in
    /// the in-flight window but cannot be acknowledged before this returns, so they do not
    /// count against the bound here.
    pub async fn feed(
        &mut self,
        cfg: &Config,
        st: &mut Stages,
        producer: &Producer,
        acks: &mut mpsc::UnboundedReceiver<Ack>,
        shutdown: &mut watch::Receiver<bool>,
        hooks: &mut impl Hooks,
    ) -> Result<Flow, RelayError> {
        st.on_event(self.xlog(encode::relation(&self.src.relation)), producer)
            .await?;
        let max_events = cfg.relay.max_in_flight_events + st.held();
        loop {
            while st.in_flight().events() >= max_events {
                tokio::select! {
                    _ = shutdown.changed() => return Ok(Flow::Shutdown),
                    Some(ack) = acks.recv() => st.on_ack(ack, producer).await?,
                }
                self.report(st, hooks).await?;
            }
            if *shutdown.borrow() {
                return Ok(Flow::Shutdown);
            }
            let (rows, last) = self.src.fetch().await?;
            if rows.is_empty() {
                break;
            }
            let lsn = self.next_lsn;
            if let Lsns::Counting = self.lsns {
                self.next_lsn += 1;
            }
            st.on_event(
                ReplicationEvent::Begin {
                    final_lsn: Lsn(lsn),
                    xid: 0,
                    commit_time_micros: self.commit_us,
                },
                producer,
            )
            .await?;
            for r in &rows {
                hooks.before_row().await;
                let values: Vec<Option<&[u8]>> =
                    r.iter().map(|v| v.as_deref().map(str::as_bytes)).collect();
                st.on_event(
                    self.xlog(encode::insert(self.src.relation.id, &values)),
                    producer,
                )
                .await?;
                self.sent += 1;
                crate::fail::hit(self.fail_point);
            }
            st.on_event(
                ReplicationEvent::Commit {
                    lsn: Lsn(lsn),
                    end_lsn: Lsn(lsn),
                    commit_time_micros: self.commit_us,
                },
                producer,
            )
            .await?;
            self.pending.push_back(Batch {
                lsn,
                last,
                rows: rows.len() as u64,
            });
            while let Ok(ack) = acks.try_recv() {
                st.on_ack(ack, producer).await?;
            }
            self.report(st, hooks).await?;
        }
        Ok(Flow::Done)
    }

    /// Waits until everything handed to the stages is acknowledged; `false` when shutdown was
    /// requested first.
    pub async fn settle(
        &mut self,
        st: &mut Stages,
        producer: &Producer,
        acks: &mut mpsc::UnboundedReceiver<Ack>,
        shutdown: &mut watch::Receiver<bool>,
        hooks: &mut impl Hooks,
    ) -> Result<bool, RelayError> {
        while st.in_flight().events() > 0 {
            tokio::select! {
                _ = shutdown.changed() => return Ok(false),
                Some(ack) = acks.recv() => st.on_ack(ack, producer).await?,
            }
            self.report(st, hooks).await?;
        }
        self.report(st, hooks).await?;
        Ok(true)
    }

    /// Tells the hooks about batches that became fully acknowledged.
    async fn report(&mut self, st: &Stages, hooks: &mut impl Hooks) -> Result<(), RelayError> {
        let done = |b: &Batch| match self.lsns {
            Lsns::Counting => b.lsn <= st.in_flight().confirmed(),
            Lsns::Fixed(_) => st.in_flight().events() == 0,
        };
        let mut through = None;
        while let Some(b) = self.pending.front() {
            if !done(b) {
                break;
            }
            let b = self.pending.pop_front().expect("front exists");
            self.acked += b.rows;
            through = Some(b.last);
        }
        match through {
            Some(last) => hooks.acknowledged(last.as_ref(), self.acked).await,
            None => Ok(()),
        }
    }
}
