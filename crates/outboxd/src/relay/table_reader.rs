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
//!   slot exported ([`Rows::Cursor`]): the gap must be exactly what that snapshot saw, and all
//!   batches share the slot's consistent point as their LSN;
//! - replay ([`crate::replay`]) reads pages in `(created_at, event_id)` order, each page its own
//!   statement ([`Rows::Pages`]): a rate-capped replay may take hours, and a snapshot held that
//!   long would hold back vacuum. Each batch gets its own synthetic LSN, so the position of the
//!   last fully acknowledged batch is known ([`Hooks::acknowledged`]): that is where a replay
//!   resumes after a crash.

use crate::config::Config;
use crate::error::RelayError;
use crate::relay::kafka::{Ack, Producer};
use crate::relay::pgoutput::{encode, Column, Relation};
use crate::relay::source::quote_ident;
use crate::relay::stages::Stages;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use pgwire_replication::{Lsn, ReplicationEvent};
use std::collections::VecDeque;
use std::future::Future;
use tokio::sync::{mpsc, watch};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, SimpleQueryMessage};

/// A row's place in the replay order: `created_at` and `event_id` as Postgres prints them
/// (the reader's session prints timestamps in ISO format, UTC, so the text reads back exactly).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    pub created_at: String,
    pub event_id: String,
}

/// A filter over the outbox table (alias `o`) with its parameters (`$1`…).
pub struct Filter {
    pub sql: String,
    pub params: Vec<Box<dyn ToSql + Sync + Send>>,
}

/// Where the rows come from.
pub enum Rows {
    /// `FETCH` from the cursor [`TableReader::cursor`] declared inside the caller's transaction.
    Cursor,
    /// Pages in `(created_at, event_id)` order after a position, each its own statement.
    Pages {
        filter: Filter,
        after: Option<Position>,
    },
}

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
    client: Client,
    relation: Relation,
    /// `format_type` of each column (casts of parameters compared with a column).
    types: Vec<String>,
    rows: Rows,
    batch: usize,
    commit_us: i64,
    lsns: Lsns,
    next_lsn: u64,
    /// Indexes of `created_at` and `event_id` in the relation, when created_at is mapped.
    key: Option<(usize, usize)>,
    pending: VecDeque<Batch>,
    sent: u64,
    acked: u64,
    /// Crash hook hit after each row (`recovery_produced`, `replay_produced`).
    fail_point: &'static str,
}

const SESSION: &str = "SET datestyle = ISO, YMD; SET timezone = UTC; SET extra_float_digits = 3";

impl TableReader {
    /// Prepares `client` (a connection of its own) for reading: text output as the reader
    /// expects it. Call before opening the caller's transaction.
    pub async fn prepare_session(client: &Client) -> Result<(), RelayError> {
        Ok(client.batch_execute(SESSION).await?)
    }

    /// A reader of the rows matching `filter` (SQL over alias `o`, literals only) in `order`,
    /// through a cursor declared now, inside the transaction (and snapshot) `client` holds.
    pub async fn cursor(
        cfg: &Config,
        client: Client,
        filter: &str,
        order: &[String],
        lsn: u64,
        commit_at: DateTime<Utc>,
        fail_point: &'static str,
    ) -> Result<Self, RelayError> {
        let mut r = Self::new(cfg, client, Rows::Cursor, Lsns::Fixed(lsn), commit_at).await?;
        r.fail_point = fail_point;
        let cols = r.select_list();
        r.client
            .batch_execute(&format!(
                "DECLARE outboxd_table_reader NO SCROLL CURSOR FOR SELECT {cols} FROM {} AS o \
                 WHERE {filter} ORDER BY {}",
                qualified(cfg),
                order.join(", ")
            ))
            .await?;
        Ok(r)
    }

    /// A reader of the rows matching `filter` after `after`, in `(created_at, event_id)`
    /// order, `batch` rows per page (and per synthetic transaction). `client` must have had
    /// [`TableReader::prepare_session`].
    pub async fn pages(
        cfg: &Config,
        client: Client,
        filter: Filter,
        after: Option<Position>,
        batch: usize,
        fail_point: &'static str,
    ) -> Result<Self, RelayError> {
        let rows = Rows::Pages { filter, after };
        let mut r = Self::new(cfg, client, rows, Lsns::Counting, Utc::now()).await?;
        if r.key.is_none() {
            return Err(RelayError::Setup(
                "the outbox mapping has no created_at column (source.columns.created_at): rows \
                 cannot be read in a stable order"
                    .into(),
            ));
        }
        r.batch = batch.max(1);
        r.fail_point = fail_point;
        Ok(r)
    }

    async fn new(
        cfg: &Config,
        client: Client,
        rows: Rows,
        lsns: Lsns,
        commit_at: DateTime<Utc>,
    ) -> Result<Self, RelayError> {
        let (relation, types) = relation(cfg, &client).await?;
        let names = cfg.source.columns.resolve()?;
        let find = |n: &str| relation.columns.iter().position(|c| c.name == n);
        let key = names
            .created_at
            .as_deref()
            .and_then(find)
            .zip(find(&names.event_id));
        Ok(Self {
            client,
            relation,
            types,
            rows,
            batch: 1_000,
            commit_us: commit_at.timestamp_micros() - crate::relay::lsn::PG_EPOCH_US,
            next_lsn: match lsns {
                Lsns::Fixed(l) => l,
                Lsns::Counting => 1,
            },
            lsns,
            key,
            pending: VecDeque::new(),
            sent: 0,
            acked: 0,
            fail_point: "",
        })
    }

    /// The reader's connection (the caller ends its transaction).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Rows handed to the stages so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// `SELECT` list: every column as pgoutput would send it (its text output).
    fn select_list(&self) -> String {
        let cols: Vec<String> = self
            .relation
            .columns
            .iter()
            .map(|c| format!("o.{}::text", quote_ident(&c.name)))
            .collect();
        cols.join(", ")
    }

    /// The next batch of rows (each column's text or NULL); empty when all were read.
    async fn fetch(&mut self) -> Result<Vec<Vec<Option<String>>>, RelayError> {
        match &self.rows {
            Rows::Cursor => {
                let msgs = self
                    .client
                    .simple_query(&format!("FETCH {} FROM outboxd_table_reader", self.batch))
                    .await?;
                Ok(msgs
                    .into_iter()
                    .filter_map(|m| match m {
                        SimpleQueryMessage::Row(r) => {
                            Some((0..r.len()).map(|i| r.get(i).map(str::to_string)).collect())
                        }
                        _ => None,
                    })
                    .collect())
            }
            Rows::Pages { filter, after } => {
                let (ts, id) = self.key.expect("checked by pages()");
                let id_type = &self.types[id];
                let ts = quote_ident(&self.relation.columns[ts].name);
                let id = quote_ident(&self.relation.columns[id].name);
                let mut params: Vec<&(dyn ToSql + Sync)> = filter
                    .params
                    .iter()
                    .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                    .collect();
                let n = params.len();
                let keyset = match after {
                    Some(p) => {
                        params.push(&p.created_at);
                        params.push(&p.event_id);
                        format!(
                            " AND (o.{ts}, o.{id}) > (${}::text::timestamptz, CAST(${}::text AS {id_type}))",
                            n + 1,
                            n + 2
                        )
                    }
                    None => String::new(),
                };
                let q = format!(
                    "SELECT {} FROM {} AS o WHERE ({}){keyset} ORDER BY o.{ts}, o.{id} LIMIT {}",
                    self.select_list(),
                    qualified_names(&self.relation),
                    filter.sql,
                    self.batch
                );
                let rows = self.client.query(&q, &params).await?;
                Ok(rows
                    .iter()
                    .map(|r| {
                        (0..r.len())
                            .map(|i| r.get::<_, Option<String>>(i))
                            .collect()
                    })
                    .collect())
            }
        }
    }

    fn position(&self, row: &[Option<String>]) -> Option<Position> {
        let (ts, id) = self.key?;
        Some(Position {
            created_at: row.get(ts)?.clone()?,
            event_id: row.get(id)?.clone()?,
        })
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
        st.on_event(self.xlog(encode::relation(&self.relation)), producer)
            .await?;
        let max_events = cfg.relay.max_in_flight_events;
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
            let rows = self.fetch().await?;
            let Some(last) = rows.last() else { break };
            let last = self.position(last);
            if let (Rows::Pages { after, .. }, Some(p)) = (&mut self.rows, &last) {
                *after = Some(p.clone());
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
                    self.xlog(encode::insert(self.relation.id, &values)),
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
        if self.settle(st, producer, acks, shutdown, hooks).await? {
            Ok(Flow::Done)
        } else {
            Ok(Flow::Shutdown)
        }
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

fn qualified(cfg: &Config) -> String {
    let (schema, table) = cfg.table_name();
    format!("{}.{}", quote_ident(&schema), quote_ident(&table))
}

fn qualified_names(rel: &Relation) -> String {
    format!("{}.{}", quote_ident(&rel.namespace), quote_ident(&rel.name))
}

/// The outbox table's columns as pgoutput announces them (no dropped or generated columns),
/// with each column's SQL type.
pub async fn relation(
    cfg: &Config,
    client: &Client,
) -> Result<(Relation, Vec<String>), RelayError> {
    let (schema, table) = cfg.table_name();
    let rows = client
        .query(
            "SELECT c.oid, a.attname::text, a.atttypid, format_type(a.atttypid, a.atttypmod) \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_attribute a ON a.attrelid = c.oid \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
               AND a.attgenerated = '' ORDER BY a.attnum",
            &[&schema, &table],
        )
        .await?;
    let id: u32 = rows
        .first()
        .map(|r| r.get(0))
        .ok_or_else(|| RelayError::Setup(format!("outbox table {schema}.{table} not found")))?;
    let relation = Relation {
        id,
        namespace: schema,
        name: table,
        columns: rows
            .iter()
            .map(|r| Column {
                name: r.get(1),
                type_oid: r.get(2),
            })
            .collect(),
    };
    Ok((relation, rows.iter().map(|r| r.get(3)).collect()))
}
