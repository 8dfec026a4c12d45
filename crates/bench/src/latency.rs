//! Commit→ack latency at a fixed offered load (open loop).
//!
//! Writers commit transactions on a fixed schedule, whatever the relay does. For outboxd each
//! commit is followed, in the same round trip, by `pg_current_wal_insert_lsn()`, a position at
//! or after the commit's end. A poller samples the slot's `confirmed_flush_lsn` every few ms;
//! the first sample covering a commit's position is its ack time. outboxd confirms only
//! broker-acknowledged transactions, so this is an upper bound on commit→ack that needs no
//! consumer (it adds up to one status interval plus one poll period). The polling relay reports
//! `created_at`→ack per row itself: it knows when each delivery was acknowledged.

use crate::world::{self, Shape, World};
use anyhow::{bail, Context, Result};
use std::io::BufRead;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// One committed transaction of the writer.
#[derive(Debug, Clone, Copy)]
pub struct Commit {
    pub sent: Instant,
    pub lsn: u64,
    pub events: u32,
}

/// What the writers did.
#[derive(Debug, Clone)]
pub struct Written {
    pub commits: Vec<Commit>,
    pub first_version: i64,
    pub events: u64,
    /// Events per second actually offered (first send to last send).
    pub achieved_rate: f64,
}

/// Percentiles of one latency sample, in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

pub fn percentiles(mut v: Vec<f64>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
    Percentiles {
        p50_ms: at(0.50),
        p99_ms: at(0.99),
        max_ms: v[v.len() - 1],
    }
}

/// The INSERT of one writer transaction: `tx_size` rows with versions `a..=b`.
fn insert_sql(table: &str, a: i64, b: i64, shape: Shape) -> String {
    format!(
        "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, aggregate_version, \
         event_type, payload, created_at) SELECT gen_random_uuid(), 'bench', 'agg-' || (g % {aggs}), \
         g, 'BenchEvent', jsonb_build_object('v', g, 'pad', repeat('x', {pad})), clock_timestamp() \
         FROM generate_series({a}, {b}) g",
        aggs = shape.aggregates.max(1),
        pad = shape.pad()
    )
}

/// Commits `rate × secs` events into `table` in transactions of `shape.tx_size`, on a fixed
/// schedule shared by `writers` connections (open loop: a slow relay does not slow the writers).
pub async fn open_loop(
    w: &mut World,
    table: &'static str,
    rate: f64,
    secs: f64,
    shape: Shape,
    writers: usize,
) -> Result<Written> {
    let tx = shape.tx_size.max(1) as i64;
    let total_tx = ((rate * secs) / tx as f64).round().max(1.0) as u64;
    let first = w.take_versions((total_tx as i64 * tx) as usize);
    let interval = Duration::from_secs_f64(tx as f64 / rate);
    let next = Arc::new(AtomicU64::new(0));
    let t0 = tokio::time::Instant::now() + Duration::from_millis(20);
    let want_lsn = table == "outbox";
    let mut tasks = Vec::new();
    for _ in 0..writers.max(1) {
        let c = w.sql().await?;
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let j = next.fetch_add(1, Ordering::Relaxed);
                if j >= total_tx {
                    return Ok::<_, anyhow::Error>(out);
                }
                tokio::time::sleep_until(t0 + interval.mul_f64(j as f64)).await;
                let a = first + j as i64 * tx;
                let mut q = format!(
                    "BEGIN; {}; COMMIT;",
                    insert_sql(table, a, a + tx - 1, shape)
                );
                if want_lsn {
                    q.push_str(" SELECT (pg_current_wal_insert_lsn() - '0/0')::text");
                }
                let sent = Instant::now();
                let msgs = c.simple_query(&q).await?;
                let lsn = msgs
                    .iter()
                    .find_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0)?.parse().ok(),
                        _ => None,
                    })
                    .unwrap_or(0);
                out.push(Commit {
                    sent,
                    lsn,
                    events: tx as u32,
                });
            }
        }));
    }
    let mut commits = Vec::new();
    for t in tasks {
        commits.extend(t.await??);
    }
    commits.sort_by_key(|c| c.sent);
    let span = match (commits.first(), commits.last()) {
        (Some(a), Some(b)) => (b.sent - a.sent).as_secs_f64() + interval.as_secs_f64(),
        _ => 1.0,
    };
    let events = commits.len() as u64 * tx as u64;
    Ok(Written {
        commits,
        first_version: first,
        events,
        achieved_rate: events as f64 / span,
    })
}

/// Samples a slot's confirmed LSN every `period` until stopped.
pub struct ConfirmPoller {
    stop: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<Result<Vec<(Instant, u64)>>>,
}

impl ConfirmPoller {
    pub async fn start(w: &World, slot: &str, period: Duration) -> Result<Self> {
        let c = w.sql().await?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let slot = slot.to_string();
        let handle = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !s.load(Ordering::Relaxed) {
                tick.tick().await;
                let (_, lsn) = world::slot_state(&c, &slot).await?;
                samples.push((Instant::now(), lsn));
            }
            Ok(samples)
        });
        Ok(Self { stop, handle })
    }

    pub async fn finish(self) -> Result<Vec<(Instant, u64)>> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.await?
    }
}

/// Latencies (ms, one entry per event) of `commits` against confirmed-LSN `samples`, and how
/// many events were never covered.
pub fn slot_latencies(commits: &[Commit], samples: &[(Instant, u64)]) -> (Vec<f64>, u64) {
    let mut out = Vec::new();
    let mut unacked = 0;
    for c in commits {
        let i = samples.partition_point(|s| s.1 < c.lsn);
        match samples.get(i) {
            Some(&(t, _)) => {
                let ms = t.saturating_duration_since(c.sent).as_secs_f64() * 1e3;
                out.resize(out.len() + c.events as usize, ms);
            }
            None => unacked += u64::from(c.events),
        }
    }
    (out, unacked)
}

/// Writes `offset_ms lsn latency_ms` per commit (debugging aid: where in a run the tail sits).
pub fn dump(path: &str, commits: &[Commit], samples: &[(Instant, u64)]) -> Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let Some(t0) = commits.first().map(|c| c.sent) else {
        return Ok(());
    };
    for c in commits {
        let i = samples.partition_point(|s| s.1 < c.lsn);
        let ms = samples.get(i).map_or(-1.0, |s| {
            s.0.saturating_duration_since(c.sent).as_secs_f64() * 1e3
        });
        writeln!(
            f,
            "{:.1} {:X} {ms:.1}",
            (c.sent - t0).as_secs_f64() * 1e3,
            c.lsn
        )?;
    }
    for s in samples {
        writeln!(
            f,
            "# {:.1} {:X}",
            s.0.saturating_duration_since(t0).as_secs_f64() * 1e3,
            s.1
        )?;
    }
    Ok(())
}

/// The polling relay running continuously, reporting each row's created_at→ack latency.
pub struct PollingLive {
    pub pid: u32,
    rx: mpsc::Receiver<(i64, f64)>,
    got: std::collections::HashMap<i64, f64>,
}

impl PollingLive {
    pub fn start(w: &World, topic: &str, cfg: &crate::contest::RunCfg) -> Result<Self> {
        let mut cmd = crate::contest::poll_relay_command(w, topic, cfg);
        cmd.arg("--report-latency")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(w.dir.path().join("poll-live.log"))?);
        // SAFETY: prctl is async-signal-safe; the relay dies with the bench.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("spawn polling relay")?;
        let out = child.stdout.take().context("stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let mut f = line.split_whitespace();
                if f.next() != Some("L") {
                    continue;
                }
                let v = f.next().and_then(|s| s.parse().ok());
                let us = f.next().and_then(|s| s.parse::<f64>().ok());
                if let (Some(v), Some(us)) = (v, us) {
                    if tx.send((v, us / 1e3)).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Self {
            pid: child.id(),
            rx,
            got: Default::default(),
        })
    }

    /// Latencies of versions `first..first+n`, waiting up to `timeout` for them.
    pub fn collect(&mut self, first: i64, n: u64, timeout: Duration) -> (Vec<f64>, u64) {
        let deadline = Instant::now() + timeout;
        let have = |g: &std::collections::HashMap<i64, f64>| {
            (first..first + n as i64)
                .filter(|v| g.contains_key(v))
                .count() as u64
        };
        let mut count = have(&self.got);
        while count < n && Instant::now() < deadline {
            match self.rx.recv_timeout(Duration::from_millis(100)) {
                Ok((v, ms)) => {
                    self.got.insert(v, ms);
                    if v >= first && v < first + n as i64 {
                        count += 1;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let lat: Vec<f64> = (first..first + n as i64)
            .filter_map(|v| self.got.remove(&v))
            .collect();
        let missing = n - lat.len() as u64;
        (lat, missing)
    }

    pub fn stop(self) -> Result<()> {
        let e = crate::procstat::terminate(self.pid, Duration::from_secs(10))?;
        if !e.success {
            bail!("polling relay exited with an error (see poll-live.log)");
        }
        Ok(())
    }
}
