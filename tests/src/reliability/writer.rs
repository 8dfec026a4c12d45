//! The writer of the reliability tests: random transactions on its own connection, surviving
//! a crashing Postgres, and the record of exactly what committed ([`WriteLog`]).

use crate::wait::eventually;
use anyhow::Result;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use uuid::Uuid;

/// One event as written by [`Writer`].
#[derive(Debug, Clone)]
pub struct Written {
    pub aggregate_id: String,
    pub version: i64,
    pub amount: i64,
    pub payload: serde_json::Value,
}

/// A committed transaction: its events and LSNs bracketing its commit record's end
/// (`pg_current_wal_insert_lsn()` read before COMMIT and after it returned; `u64::MAX`
/// if the latter is unknown).
#[derive(Debug, Clone)]
pub struct CommittedTx {
    pub ids: Vec<Uuid>,
    /// Read inside the transaction just before COMMIT: strictly below its commit LSN
    /// (0 if unknown).
    pub lsn_before: u64,
    pub lsn_after: u64,
}

/// Everything the writer knows: the truth the delivery is checked against.
#[derive(Debug, Clone, Default)]
pub struct WriteLog {
    pub committed: HashMap<Uuid, Written>,
    pub rolled_back: HashSet<Uuid>,
    pub txs: Vec<CommittedTx>,
    /// Transactions whose COMMIT failed and whose outcome was then read from the outbox.
    pub resolved_unknown: usize,
    /// Connection errors the writer survived.
    pub errors: usize,
}

/// Shape of the write load.
#[derive(Debug, Clone)]
pub struct Load {
    pub aggregate_type: String,
    pub aggregates: usize,
    pub max_tx_events: usize,
    pub rollback_ratio: f64,
    /// Pause between transactions, in milliseconds (uniform in the range).
    pub pause_ms: std::ops::Range<u64>,
    pub max_pad: usize,
}

impl Default for Load {
    fn default() -> Self {
        Self {
            aggregate_type: "acct".into(),
            aggregates: 40,
            max_tx_events: 10,
            rollback_ratio: 0.15,
            pause_ms: 20..60,
            max_pad: 300,
        }
    }
}

/// Writes random transactions until stopped. See the module docs.
pub struct Writer {
    log: Arc<Mutex<WriteLog>>,
    stop: watch::Sender<bool>,
    paused: watch::Sender<bool>,
    /// Set by the loop while it is parked on `paused` (no transaction open).
    idle: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<Result<()>>,
}

impl Writer {
    pub fn start(dsn: String, load: Load) -> Self {
        let log = Arc::new(Mutex::new(WriteLog::default()));
        let (stop, stop_rx) = watch::channel(false);
        let (paused, paused_rx) = watch::channel(false);
        let idle = Arc::new(AtomicBool::new(false));
        let handle = tokio::spawn(write_loop(
            dsn,
            load,
            log.clone(),
            stop_rx,
            paused_rx,
            idle.clone(),
        ));
        Self {
            log,
            stop,
            paused,
            idle,
            handle,
        }
    }

    /// A copy of what is known so far.
    pub fn snapshot(&self) -> WriteLog {
        self.log.lock().unwrap().clone()
    }

    pub fn committed_events(&self) -> usize {
        self.log.lock().unwrap().committed.len()
    }

    /// Waits until at least `n` events committed.
    pub async fn wait_committed(&self, n: usize, timeout: Duration) -> Result<()> {
        eventually(timeout, || async { Ok(self.committed_events() >= n) }).await
    }

    /// Pauses (true) or resumes (false) writing; returns once no transaction is open.
    pub async fn pause(&self, on: bool) {
        let _ = self.paused.send(on);
        if on {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !self.idle.load(AtomicOrdering::SeqCst) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// Stops the writer and returns the final log (every outcome resolved).
    pub async fn stop(self) -> Result<WriteLog> {
        let _ = self.stop.send(true);
        self.handle.await??;
        let log = self.log.lock().unwrap().clone();
        Ok(log)
    }
}

pub(super) async fn connect(dsn: &str) -> Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// Connects, retrying for up to a minute (the server may be restarting).
pub async fn connect_retry(dsn: &str) -> Result<tokio_postgres::Client> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match connect(dsn).await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.context("reconnect for 60 s")),
        }
    }
}

enum TxEnd {
    /// (lsn_before, lsn_after)
    Committed(u64, u64),
    RolledBack,
    /// COMMIT was sent and no answer came back.
    Unknown,
}

async fn write_tx(
    c: &mut tokio_postgres::Client,
    agg_type: &str,
    batch: &[(Uuid, Written)],
    rollback: bool,
) -> std::result::Result<TxEnd, (bool, tokio_postgres::Error)> {
    // Err((commit_sent, e))
    let tx = c.transaction().await.map_err(|e| (false, e))?;
    let stmt = tx
        .prepare(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
             VALUES ($1, $2, $3, $4, 'Deposited', $5)",
        )
        .await
        .map_err(|e| (false, e))?;
    for (id, w) in batch {
        tx.execute(
            &stmt,
            &[id, &agg_type, &w.aggregate_id, &w.version, &w.payload],
        )
        .await
        .map_err(|e| (false, e))?;
    }
    if rollback {
        tx.rollback().await.map_err(|e| (false, e))?;
        return Ok(TxEnd::RolledBack);
    }
    let before = tx
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[])
        .await
        .map_err(|e| (false, e))?
        .get::<_, i64>(0) as u64;
    if let Err(e) = tx.commit().await {
        return if e.as_db_error().is_some() {
            Err((false, e)) // the server refused the commit: rolled back
        } else {
            let _ = e;
            Ok(TxEnd::Unknown)
        };
    }
    let lsn = match c
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[])
        .await
    {
        Ok(r) => r.get::<_, i64>(0) as u64,
        Err(_) => u64::MAX,
    };
    Ok(TxEnd::Committed(before, lsn))
}

async fn write_loop(
    dsn: String,
    load: Load,
    log: Arc<Mutex<WriteLog>>,
    mut stop: watch::Receiver<bool>,
    mut paused: watch::Receiver<bool>,
    idle: Arc<AtomicBool>,
) -> Result<()> {
    let mut rng = rand::rngs::StdRng::from_entropy();
    let mut versions: HashMap<String, i64> = HashMap::new();
    let mut c = connect_retry(&dsn).await?;
    loop {
        if *stop.borrow_and_update() {
            return Ok(());
        }
        if *paused.borrow_and_update() {
            idle.store(true, AtomicOrdering::SeqCst);
            tokio::select! {
                _ = paused.changed() => {}
                _ = stop.changed() => {}
            }
            idle.store(false, AtomicOrdering::SeqCst);
            continue;
        }
        let rollback = rng.gen_bool(load.rollback_ratio);
        let mut next = versions.clone();
        let batch: Vec<(Uuid, Written)> = (0..rng.gen_range(1..=load.max_tx_events))
            .map(|_| {
                let agg = format!(
                    "{}-{}",
                    load.aggregate_type,
                    rng.gen_range(0..load.aggregates)
                );
                let v = next.entry(agg.clone()).or_insert(0);
                *v += 1;
                let amount = rng.gen_range(1..1000i64);
                let pad = "p".repeat(rng.gen_range(0..=load.max_pad));
                (
                    Uuid::now_v7(),
                    Written {
                        aggregate_id: agg,
                        version: *v,
                        amount,
                        payload: serde_json::json!({"amount": amount, "pad": pad}),
                    },
                )
            })
            .collect();
        let end = match write_tx(&mut c, &load.aggregate_type, &batch, rollback).await {
            Ok(end) => end,
            Err((_, e)) => {
                // Failed before COMMIT (or the server refused it): nothing committed.
                log.lock().unwrap().errors += 1;
                let _ = e;
                TxEnd::RolledBack
            }
        };
        let end = match end {
            TxEnd::Unknown => {
                log.lock().unwrap().errors += 1;
                c = connect_retry(&dsn).await?;
                let n: i64 = c
                    .query_one(
                        "SELECT count(*) FROM outbox WHERE event_id = $1",
                        &[&batch[0].0],
                    )
                    .await?
                    .get(0);
                log.lock().unwrap().resolved_unknown += 1;
                if n > 0 {
                    TxEnd::Committed(0, u64::MAX)
                } else {
                    TxEnd::RolledBack
                }
            }
            e => e,
        };
        {
            let mut l = log.lock().unwrap();
            match end {
                TxEnd::Committed(before, after) => {
                    versions = next;
                    l.txs.push(CommittedTx {
                        ids: batch.iter().map(|(id, _)| *id).collect(),
                        lsn_before: before,
                        lsn_after: after,
                    });
                    l.committed.extend(batch);
                }
                _ => l.rolled_back.extend(batch.into_iter().map(|(id, _)| id)),
            }
        }
        if c.is_closed() {
            c = connect_retry(&dsn).await?;
        }
        let pause = rng.gen_range(load.pause_ms.clone());
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(pause)) => {}
            _ = stop.changed() => {}
        }
    }
}
