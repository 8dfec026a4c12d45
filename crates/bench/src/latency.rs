//! Commit→ack latency at a fixed offered load (open loop).
//!
//! Writers (`bench_paced`, inside the server) commit transactions on a fixed schedule, whatever
//! the relay does, and record for each commit its start time and a WAL position at or after its
//! end. A poller samples the slot's `confirmed_flush_lsn` every few ms with the server's clock;
//! the first sample covering a commit's position is its ack time. outboxd confirms only
//! broker-acknowledged transactions, so this is an upper bound on commit→ack that needs no
//! consumer (it adds up to one status interval plus one poll period). The relay's own
//! `outboxd_commit_to_ack_seconds` histogram (scraped per point, see `scrape`) measures the same
//! thing from the commit record's timestamp. The polling relay reports `created_at`→ack per row
//! itself: it knows when each delivery was acknowledged.

use crate::world::{Shape, World};
use anyhow::{bail, Context, Result};
use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// One committed transaction of the writer.
#[derive(Debug, Clone, Copy)]
pub struct Commit {
    /// Wall clock (unix µs, the server's clock: same host) just before the INSERT.
    pub sent_us: i64,
    /// A WAL position at or after the commit's end.
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
    /// CPU seconds of the writers' Postgres backends (inserts, commits, WAL).
    pub writer_cpu_s: f64,
}

/// Percentiles of one latency sample, in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Percentiles {
    /// "p50 / p99 / max", ms.
    pub fn cells(&self) -> String {
        format!(
            "{:.1} / {:.1} / {:.1}",
            self.p50_ms, self.p99_ms, self.max_ms
        )
    }
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

pub(crate) fn unix_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Commits events into `table` in transactions of `shape.tx_size` from `writers` connections.
/// `Some(rate)`: open loop, `rate × secs` events on a fixed schedule whatever the relay does
/// (every scheduled transaction is written, however late). `None`: closed loop, back to back
/// for `secs` — the most the machine can commit. The writers are `bench_paced` procedures, so
/// the load generator costs the inserts and nothing else.
pub async fn open_loop(
    w: &mut World,
    table: &'static str,
    rate: Option<f64>,
    secs: f64,
    shape: Shape,
    writers: usize,
) -> Result<Written> {
    open_loop_into(w, &[table.to_string()], rate, secs, shape, writers).await
}

/// [`open_loop`] spread over `tables`: transaction j goes to `tables[j mod len]`, whichever
/// writer commits it.
pub async fn open_loop_into(
    w: &mut World,
    tables: &[String],
    rate: Option<f64>,
    secs: f64,
    shape: Shape,
    writers: usize,
) -> Result<Written> {
    let table = crate::world::regclass_array(tables);
    let tx = shape.tx_size.max(1) as i64;
    let writers = writers.max(1);
    let (total_tx, interval, deadline) = match rate {
        Some(r) => (
            ((r * secs) / tx as f64).round().max(1.0) as u64,
            tx as f64 / r,
            f64::MAX,
        ),
        // Versions are only reserved, never required to be contiguous here: a closed-loop
        // phase runs without a relay.
        None => (
            (secs * 1_000_000.0) as u64 / tx as u64,
            0.0,
            unix_secs() + secs,
        ),
    };
    let first = w.take_versions((total_tx as i64 * tx) as usize);
    let t0 = unix_secs() + 0.05;
    let mut tasks = Vec::new();
    for lane in 0..writers {
        let c = w.sql().await?;
        let call = format!(
            "CALL bench_paced({table}, {first}, {total_tx}, {tx}, {aggs}, {pad}, {t0:.6}, \
             {interval:.9}, {writers}, {lane}, {deadline:.6})",
            aggs = shape.aggregates.max(1),
            pad = shape.pad(),
            deadline = deadline.min(1e12),
        );
        tasks.push(tokio::spawn(async move {
            c.batch_execute(
                "CREATE TEMP TABLE IF NOT EXISTS bench_commits (t timestamptz, lsn pg_lsn, n int); \
                 TRUNCATE bench_commits",
            )
            .await?;
            let pid: i32 = c.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
            let cpu0 = crate::procstat::cpu_secs(pid as u32);
            c.batch_execute(&call).await.context("bench_paced")?;
            let cpu = crate::procstat::cpu_secs(pid as u32)
                .zip(cpu0)
                .map_or(0.0, |(b, a)| b - a);
            let rows = c
                .query(
                    "SELECT (extract(epoch FROM t) * 1e6)::int8, (lsn - '0/0')::int8, n \
                     FROM bench_commits",
                    &[],
                )
                .await?;
            let commits = rows
                .iter()
                .map(|r| Commit {
                    sent_us: r.get(0),
                    lsn: r.get::<_, i64>(1) as u64,
                    events: r.get::<_, i32>(2) as u32,
                })
                .collect::<Vec<_>>();
            Ok::<_, anyhow::Error>((commits, cpu))
        }));
    }
    let mut commits = Vec::new();
    let mut writer_cpu_s = 0.0;
    for t in tasks {
        let (c, cpu) = t.await??;
        commits.extend(c);
        writer_cpu_s += cpu;
    }
    commits.sort_by_key(|c| c.sent_us);
    let span = match (commits.first(), commits.last()) {
        (Some(a), Some(b)) => (b.sent_us - a.sent_us) as f64 / 1e6 + interval,
        _ => 1.0,
    }
    .max(1e-3);
    let events = commits.iter().map(|c| u64::from(c.events)).sum();
    Ok(Written {
        commits,
        first_version: first,
        events,
        achieved_rate: events as f64 / span,
        writer_cpu_s,
    })
}

/// Samples a slot's confirmed LSN every `period` until stopped.
pub struct ConfirmPoller {
    stop: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<Result<Vec<(i64, u64)>>>,
}

impl ConfirmPoller {
    pub async fn start(w: &World, slot: &str, period: Duration) -> Result<Self> {
        Ok(Self::on(w.sql().await?, Some(slot.to_string()), period))
    }

    /// A slot's confirmed LSN on the server `c` is connected to (a standby's slot).
    pub fn slot_on(c: tokio_postgres::Client, slot: &str, period: Duration) -> Self {
        Self::on(c, Some(slot.to_string()), period)
    }

    /// A standby's replayed position (`pg_last_wal_replay_lsn`) instead of a slot's: against
    /// commits, commit→replayed (the replay lag a standby slot's decoding waits for).
    pub fn replay_on(c: tokio_postgres::Client, period: Duration) -> Self {
        Self::on(c, None, period)
    }

    fn on(c: tokio_postgres::Client, slot: Option<String>, period: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            const NOW: &str = "(extract(epoch FROM clock_timestamp()) * 1e6)::int8";
            while !s.load(Ordering::Relaxed) {
                tick.tick().await;
                let row = match &slot {
                    Some(slot) => {
                        c.query_one(
                            &format!(
                                "SELECT {NOW}, (confirmed_flush_lsn - '0/0')::int8 \
                                 FROM pg_replication_slots WHERE slot_name = $1"
                            ),
                            &[slot],
                        )
                        .await?
                    }
                    None => {
                        c.query_one(
                            &format!("SELECT {NOW}, (pg_last_wal_replay_lsn() - '0/0')::int8"),
                            &[],
                        )
                        .await?
                    }
                };
                samples.push((
                    row.get::<_, i64>(0),
                    row.get::<_, Option<i64>>(1).unwrap_or(0) as u64,
                ));
            }
            Ok(samples)
        });
        Self { stop, handle }
    }

    pub async fn finish(self) -> Result<Vec<(i64, u64)>> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.await?
    }
}

/// Latencies (ms, one entry per event) of `commits` against confirmed-LSN `samples`, and how
/// many events were never covered.
pub fn slot_latencies(commits: &[Commit], samples: &[(i64, u64)]) -> (Vec<f64>, u64) {
    let mut out = Vec::new();
    let mut unacked = 0;
    for c in commits {
        let i = samples.partition_point(|s| s.1 < c.lsn);
        match samples.get(i) {
            Some(&(t, _)) => {
                let ms = (t - c.sent_us).max(0) as f64 / 1e3;
                out.resize(out.len() + c.events as usize, ms);
            }
            None => unacked += u64::from(c.events),
        }
    }
    (out, unacked)
}

/// Writes `offset_ms lsn latency_ms` per commit (debugging aid: where in a run the tail sits).
pub fn dump(path: &str, commits: &[Commit], samples: &[(i64, u64)]) -> Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let Some(t0) = commits.first().map(|c| c.sent_us) else {
        return Ok(());
    };
    let ms = |a: i64, b: i64| (a - b) as f64 / 1e3;
    for c in commits {
        let i = samples.partition_point(|s| s.1 < c.lsn);
        let lat = samples.get(i).map_or(-1.0, |s| ms(s.0, c.sent_us));
        writeln!(f, "{:.1} {:X} {lat:.1}", ms(c.sent_us, t0), c.lsn)?;
    }
    for s in samples {
        writeln!(f, "# {:.1} {:X}", ms(s.0, t0), s.1)?;
    }
    Ok(())
}

/// The polling relay running continuously, reporting each row's created_at→ack latency.
pub struct PollingLive {
    pub pid: u32,
    /// The polling relay's Postgres backend (its SELECT … FOR UPDATE and UPDATE run there).
    pub backend_pid: Arc<std::sync::atomic::AtomicU32>,
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
        let backend_pid = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let bp = backend_pid.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let mut f = line.split_whitespace();
                match f.next() {
                    Some("L") => {}
                    Some("P") => {
                        if let Some(p) = f.next().and_then(|s| s.parse().ok()) {
                            bp.store(p, Ordering::Relaxed);
                        }
                        continue;
                    }
                    _ => continue,
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
            backend_pid,
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
