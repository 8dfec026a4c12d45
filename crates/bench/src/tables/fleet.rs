//! The relays of one arrangement — one relay over N tables, or N one-table relays — as real
//! processes: configured and `init`ed like an operator would, started and warmed up together,
//! and measured together (every relay process, every walsender, every slot).

use crate::contest::{self, RelaySource};
use crate::latency::{self, Written};
use crate::procstat::{self, CpuSnap};
use crate::world::{Shape, World};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the N tables are relayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Mode {
    /// One relay, one slot, one publication, `[[source.tables]]` listing every table.
    OneRelay,
    /// One relay per table, each with `source.table` and its own slot and publication.
    RelayPerTable,
}

impl Mode {
    pub fn label(self) -> &'static str {
        match self {
            Self::OneRelay => "one relay",
            Self::RelayPerTable => "N relays",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::OneRelay => "one",
            Self::RelayPerTable => "each",
        }
    }
}

/// The bench's outbox tables: `public.mt_1` … `public.mt_n` (shared by every N; a slot made
/// right before a load sees only that load).
pub fn tables(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("public.mt_{i}")).collect()
}

/// What every relay of a fleet shares.
#[derive(Debug, Clone)]
pub struct FleetCfg {
    pub relay_bin: PathBuf,
    pub status_ms: u64,
    /// The slots live on the world's standby (`source.replication_dsn`), not the primary.
    pub on_standby: bool,
}

/// One relay's slot and config file, `init` done.
#[derive(Debug, Clone)]
pub struct Spec {
    slot: String,
    config: PathBuf,
}

/// Writes the configs of `mode` over `n` tables (slots named after `tag`, table i's records to
/// the topic template `topic(i)`, as services with their own topics) and runs `outboxd init`
/// on each: it creates the tables, the publication and the slot, as
/// for an operator. Slots exist from here on, so every later row is in their future.
pub async fn prepare(
    w: &World,
    fc: &FleetCfg,
    n: usize,
    mode: Mode,
    tag: &str,
    topic: impl Fn(usize) -> String,
) -> Result<Vec<Spec>> {
    let all = tables(n);
    let replication_dsn = match fc.on_standby {
        true => Some(w.standby_dsn()?),
        false => None,
    };
    let sources: Vec<RelaySource> = match mode {
        Mode::OneRelay => vec![RelaySource {
            slot: format!("{tag}_{}", mode.tag()),
            publication: format!("mt_pub_n{n}"),
            tables: all.clone(),
            topics: (1..=n).map(&topic).collect(),
            slot_exists: false,
            replication_dsn,
        }],
        Mode::RelayPerTable => (1..=n)
            .map(|i| RelaySource {
                slot: format!("{tag}_{}{i}", mode.tag()),
                publication: format!("mt_pub_t{i}"),
                tables: vec![all[i - 1].clone()],
                topics: vec![topic(i)],
                slot_exists: false,
                replication_dsn: replication_dsn.clone(),
            })
            .collect(),
    };
    let sink = w.sink(crate::contest::Contestant::Outboxd)?;
    let mut specs = vec![];
    for src in sources {
        let config = w.dir.path().join(format!("{}.toml", src.slot));
        std::fs::write(
            &config,
            // With one table its topic is `[sink] topic`; with several each entry names its own.
            contest::relay_toml(w, &sink, &src, &src.topics[0], fc.status_ms),
        )?;
        let out = tokio::process::Command::new(&fc.relay_bin)
            .arg("init")
            .arg("--config")
            .arg(&config)
            .output()
            .await
            .context("run outboxd init")?;
        if !out.status.success() {
            bail!(
                "outboxd init ({}) failed: {}{}",
                src.slot,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        specs.push(Spec {
            slot: src.slot,
            config,
        });
    }
    // An append-only outbox needs no vacuum during a benchmark (as `world` does for `outbox`).
    // Only where not yet set: a catalog row changed after a standby's slot was made, then
    // pruned on the primary before the standby's feedback carried the slot's catalog_xmin
    // there, invalidates that slot (`rows_removed`).
    let sql = w.sql().await?;
    for t in &all {
        sql.batch_execute(&format!(
            "DO $$ BEGIN IF NOT coalesce((SELECT reloptions FROM pg_class WHERE oid = '{t}'::regclass) \
             @> '{{autovacuum_enabled=false}}', false) THEN \
             ALTER TABLE {t} SET (autovacuum_enabled = false); END IF; END $$"
        ))
        .await?;
    }
    // A slot on the standby is safe from here: `outboxd init` returned only once the primary
    // held its catalog_xmin (the standby's feedback).
    Ok(specs)
}

struct Proc {
    slot: String,
    pid: u32,
    walsender: u32,
    log: PathBuf,
}

/// The running relays of one arrangement.
pub struct Fleet {
    procs: Vec<Proc>,
    slots: Vec<String>,
    /// A client of the server the slots live on.
    sql: tokio_postgres::Client,
    on_standby: bool,
    paused: bool,
}

impl Drop for Fleet {
    /// A paused walsender must never outlive the run: a stopped backend would hang the
    /// cluster's shutdown (see `contest::Paused`).
    fn drop(&mut self) {
        for p in &self.procs {
            // SAFETY: kill(2) on a backend of the bench's own cluster; harmless when it runs.
            unsafe { libc::kill(p.walsender as i32, libc::SIGCONT) };
        }
    }
}

/// CPU, WAL and memory of a fleet over one timed stretch.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Measured {
    pub secs: f64,
    /// Summed over the relay processes.
    pub relay_cpu_s: Option<f64>,
    /// Summed over the walsenders (one per slot).
    pub walsender_cpu_s: Option<f64>,
    pub broker_cpu_s: Option<f64>,
    pub wal: WalRetained,
    /// Peak RSS (`VmHWM`) summed over the relay processes.
    pub peak_rss_kib: u64,
}

/// WAL held for the fleet's slots, sampled every 50 ms: `behind` is
/// `pg_current_wal_lsn() - restart_lsn` summed over the slots (what each slot makes its
/// walsender re-read after a restart, and what the issue asks for); `pinned` is the WAL kept
/// on disk for them, from the oldest `restart_lsn` (slots share the files they both need).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct WalRetained {
    pub behind_max: u64,
    pub behind_end: u64,
    pub pinned_max: u64,
    pub pinned_end: u64,
}

impl Fleet {
    /// Starts a relay per spec, all at once, and waits until every slot confirmed `warm_lsn`
    /// (the warm-up rows: connections, broker metadata and producer ids are start-up, not
    /// throughput).
    pub async fn start(w: &World, fc: &FleetCfg, specs: &[Spec], warm_lsn: u64) -> Result<Self> {
        let sql = w.slot_sql(fc.on_standby).await?;
        let mut started = vec![];
        for s in specs {
            let log = w.dir.path().join(format!("{}.log", s.slot));
            let mut cmd = std::process::Command::new(&fc.relay_bin);
            cmd.arg("run").arg("--config").arg(&s.config);
            started.push((s.slot.clone(), contest::spawn(&mut cmd, &log)?, log));
        }
        let mut procs = vec![];
        for (slot, pid, log) in started {
            let walsender = contest::wait_active(&sql, &slot, pid, &log).await?;
            procs.push(Proc {
                slot,
                pid,
                walsender,
                log,
            });
        }
        let f = Self {
            slots: procs.iter().map(|p| p.slot.clone()).collect(),
            procs,
            sql,
            on_standby: fc.on_standby,
            paused: false,
        };
        f.wait_confirmed(warm_lsn, Duration::from_secs(120)).await?;
        Ok(f)
    }

    /// The fleet's slots.
    pub fn slots(&self) -> &[String] {
        &self.slots
    }

    /// Relay processes.
    pub fn relays(&self) -> usize {
        self.procs.len()
    }

    /// Pauses every relay and its walsender (SIGSTOP) while a backlog loads: a running
    /// walsender would decode it into the socket buffers and the clock would time only the
    /// rest (see `contest::start_paused`).
    pub fn pause(&mut self) {
        for p in &self.procs {
            // SAFETY: kill(2) on our own child and a backend of the bench's own cluster.
            unsafe {
                libc::kill(p.pid as i32, libc::SIGSTOP);
                libc::kill(p.walsender as i32, libc::SIGSTOP);
            }
        }
        self.paused = true;
    }

    /// Resumes every paused relay at once and times them until every slot confirmed `end_lsn`.
    pub async fn drain(&mut self, w: &World, end_lsn: u64, events: u64) -> Result<Measured> {
        let m = Meter::start(w, self).await?;
        for p in &self.procs {
            // SAFETY: as in `pause`.
            unsafe {
                libc::kill(p.walsender as i32, libc::SIGCONT);
                libc::kill(p.pid as i32, libc::SIGCONT);
            }
        }
        self.paused = false;
        self.wait_confirmed(end_lsn, Duration::from_secs(300 + events / 2000))
            .await?;
        m.finish(self).await
    }

    /// A paced live load of `rate` events/s for `secs`, spread over `tables`; measured until
    /// every slot confirmed the last commit.
    pub async fn live(
        &self,
        w: &mut World,
        tables: &[String],
        (rate, secs): (f64, f64),
        shape: Shape,
        writers: usize,
    ) -> Result<(Measured, Written)> {
        let m = Meter::start(w, self).await?;
        let written = latency::open_loop_into(w, tables, Some(rate), secs, shape, writers).await?;
        let target = written.commits.iter().map(|c| c.lsn).max().unwrap_or(0);
        self.wait_confirmed(target, Duration::from_secs(120))
            .await?;
        Ok((m.finish(self).await?, written))
    }

    /// Stops every relay (SIGTERM: each drains and confirms) and drops the slots.
    pub async fn stop(self, w: &World) -> Result<()> {
        for p in &self.procs {
            let e = procstat::terminate(p.pid, Duration::from_secs(30))?;
            if !e.success {
                bail!(
                    "{}: relay exited with an error: {}",
                    p.slot,
                    procstat::tail(&p.log, 20)
                );
            }
        }
        for s in &self.slots {
            w.drop_slot_on(s, self.on_standby).await?;
        }
        Ok(())
    }

    fn pids(&self, w: &World) -> Vec<Option<u32>> {
        let relays = self.procs.iter().map(|p| Some(p.pid));
        let walsenders = self.procs.iter().map(|p| Some(p.walsender));
        relays.chain(walsenders).chain([w.broker_pid]).collect()
    }

    /// Waits until the slowest slot's confirmed LSN covers `lsn`; fails when a relay dies.
    async fn wait_confirmed(&self, lsn: u64, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let row = self
                .sql
                .query_one(
                    "SELECT coalesce(min(confirmed_flush_lsn - '0/0'), 0)::int8 \
                     FROM pg_replication_slots WHERE slot_name = ANY($1)",
                    &[&self.slots],
                )
                .await?;
            if row.get::<_, i64>(0) as u64 >= lsn {
                return Ok(());
            }
            for p in &self.procs {
                if let Some(e) = procstat::try_reap(p.pid)? {
                    bail!(
                        "{}: relay died ({e:?}): {}",
                        p.slot,
                        procstat::tail(&p.log, 30)
                    );
                }
            }
            if Instant::now() > deadline {
                let behind: Vec<&str> = self.slots.iter().map(String::as_str).collect();
                bail!(
                    "slots {behind:?} did not confirm {:X}/{:X} within {limit:?}",
                    lsn >> 32,
                    lsn & 0xffff_ffff
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The server's WAL head: written on a primary, replayed on a standby (where a slot there
/// decodes up to).
const HEAD: &str = "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                    ELSE pg_current_wal_lsn() END";

/// CPU snapshots and the WAL sampler around one timed stretch.
struct Meter {
    t0: Instant,
    pids: Vec<Option<u32>>,
    cpu0: CpuSnap,
    stop: Arc<AtomicBool>,
    sampler: tokio::task::JoinHandle<Result<WalRetained>>,
}

impl Meter {
    async fn start(w: &World, f: &Fleet) -> Result<Self> {
        let c = w.slot_sql(f.on_standby).await?;
        let slots = f.slots.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let sampler = tokio::spawn(async move {
            let mut r = WalRetained::default();
            loop {
                let done = s.load(Ordering::Relaxed);
                let row = c
                    .query_one(
                        &format!(
                            "SELECT coalesce(sum(pg_wal_lsn_diff({HEAD}, restart_lsn)), 0)::int8, \
                                    coalesce(pg_wal_lsn_diff({HEAD}, min(restart_lsn)), 0)::int8 \
                             FROM pg_replication_slots WHERE slot_name = ANY($1)"
                        ),
                        &[&slots],
                    )
                    .await?;
                let (behind, pinned) = (row.get::<_, i64>(0) as u64, row.get::<_, i64>(1) as u64);
                r.behind_max = r.behind_max.max(behind);
                r.pinned_max = r.pinned_max.max(pinned);
                (r.behind_end, r.pinned_end) = (behind, pinned);
                if done {
                    return Ok(r);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let pids = f.pids(w);
        Ok(Self {
            t0: Instant::now(),
            cpu0: CpuSnap::take(&pids),
            pids,
            stop,
            sampler,
        })
    }

    async fn finish(self, f: &Fleet) -> Result<Measured> {
        let secs = self.t0.elapsed().as_secs_f64();
        let n = f.procs.len();
        let d = self.cpu0.delta(&CpuSnap::take(&self.pids));
        let sum = |v: &[Option<f64>]| v.iter().copied().sum::<Option<f64>>();
        self.stop.store(true, Ordering::Relaxed);
        let wal = self.sampler.await??;
        Ok(Measured {
            secs,
            relay_cpu_s: sum(&d[..n]),
            walsender_cpu_s: sum(&d[n..2 * n]),
            broker_cpu_s: d[2 * n],
            wal,
            peak_rss_kib: f
                .procs
                .iter()
                .filter_map(|p| procstat::peak_rss_kib(p.pid))
                .sum(),
        })
    }
}
