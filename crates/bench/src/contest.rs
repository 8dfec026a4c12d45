//! Timed throughput runs of each contestant over rows loaded before its clock starts.
//!
//! Slot readers (pg_recvlogical, the bare reader, outboxd) each get their own slot created
//! before loading, so the loaded rows are in every slot's future. The bare reader and outboxd
//! stream a few warm-up rows, are paused (SIGSTOP, with their walsender) while the timed rows
//! load, and are timed from SIGCONT until the slot's confirmed LSN covers the WAL position after loading (outboxd
//! confirms only what the broker acknowledged). pg_recvlogical is started after loading and
//! timed until it exits at `--endpos`. No consumer runs while a clock runs; the topics are read
//! back and verified afterwards.

use crate::procstat::{self, CpuSnap};
use crate::world::{self, Sink, World, PUBLICATION};
use anyhow::{bail, Context, Result};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use crate::contestant::Contestant;

/// One timed run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunResult {
    pub contestant: Contestant,
    pub events: u64,
    /// Wall time of the timed phase (resume → confirmed, active → exit, first → last poll).
    pub secs: f64,
    pub rate: f64,
    /// Resume → first confirmed advance.
    pub first_ack_s: Option<f64>,
    /// CPU of the contestant's own process during the run.
    pub relay_cpu_s: Option<f64>,
    /// CPU of its Postgres process: the walsender (slot readers) or the backend (polling).
    pub pg_cpu_s: Option<f64>,
    pub broker_cpu_s: Option<f64>,
    /// CPU of the bench's proxy thread between relay and broker (TLS-to-Kafka comparison).
    #[serde(default)]
    pub proxy_cpu_s: Option<f64>,
    pub peak_rss_kib: Option<u64>,
    pub verified: Option<crate::verify::Verified>,
}

impl RunResult {
    /// CPU µs per event of one process.
    pub fn us_per_event(&self, cpu: Option<f64>) -> Option<f64> {
        cpu.map(|c| c * 1e6 / self.events.max(1) as f64)
    }
}

/// Paths and knobs the runs need.
#[derive(Debug, Clone)]
pub struct RunCfg {
    pub relay_bin: PathBuf,
    pub bench_bin: PathBuf,
    pub status_ms: u64,
    pub poll_batch: i64,
    pub linger_ms: String,
    /// Command prefix of the relay (a profiler); empty: run it directly.
    pub relay_wrapper: Vec<String>,
    /// Extra environment of the relay process.
    pub relay_env: Vec<(String, String)>,
    /// Environment of the variant relay, on top of `relay_env`.
    pub variant_env: Vec<(String, String)>,
    /// Relay binary of the variant (default: `relay_bin`).
    pub variant_bin: Option<PathBuf>,
}

/// Spawns `cmd` with output to `log`; the child dies with the bench (PR_SET_PDEATHSIG).
pub fn spawn(cmd: &mut Command, log: &Path) -> Result<u32> {
    let f = std::fs::File::create(log)?;
    cmd.stdin(Stdio::null()).stdout(f.try_clone()?).stderr(f);
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("spawn {:?}", cmd.get_program()))?;
    // Reaped with wait4 (procstat) for its rusage, never through `Child`.
    Ok(child.id())
}

/// The outboxd config of one run: library defaults except a short status interval, so the
/// slot's confirmed LSN (our stopwatch) trails the broker acks by at most `status_ms`, and
/// plain text (the bare reader's terms; TLS is measured as a variant, see `--ssl`). The broker
/// is `sink`'s, over TLS with the bench's CA when it takes TLS.
pub fn outboxd_toml(w: &World, sink: &Sink, slot: &str, topic: &str, status_ms: u64) -> String {
    relay_toml(w, sink, &RelaySource::bench(slot), topic, status_ms)
}

/// What a relay reads: its slot, its publication and its tables (none: `public.outbox`, the
/// default; one: `source.table`; more: `[[source.tables]]`).
#[derive(Debug, Clone)]
pub struct RelaySource {
    pub slot: String,
    pub publication: String,
    pub tables: Vec<String>,
    /// Each listed table's topic template (`[[source.tables]] topic`), with several tables.
    pub topics: Vec<String>,
    /// `create_slot = false`: the bench (or `outboxd init`) made the slot.
    pub slot_exists: bool,
    /// `source.replication_dsn`: the slot and the stream on this standby (None: on `dsn`).
    pub replication_dsn: Option<String>,
}

impl RelaySource {
    /// The throughput and latency runs' relay: `public.outbox` through the bench's publication,
    /// on a slot the bench created.
    pub fn bench(slot: &str) -> Self {
        Self {
            slot: slot.to_string(),
            publication: PUBLICATION.to_string(),
            tables: vec![],
            topics: vec![],
            slot_exists: true,
            replication_dsn: None,
        }
    }
}

/// [`outboxd_toml`] for any slot, publication and tables.
pub fn relay_toml(
    w: &World,
    sink: &Sink,
    src: &RelaySource,
    topic: &str,
    status_ms: u64,
) -> String {
    let tls = sink.tls_ca.as_ref().map_or(String::new(), |ca| {
        format!(
            "\"security.protocol\" = \"SSL\"\n\"ssl.ca.location\" = \"{}\"\n",
            ca.display()
        )
    });
    let (table, list) = match src.tables.as_slice() {
        [] => (String::new(), String::new()),
        [t] => (format!("table = \"{t}\"\n"), String::new()),
        ts => (
            String::new(),
            ts.iter()
                .enumerate()
                .map(|(i, t)| match src.topics.get(i) {
                    Some(topic) => {
                        format!("[[source.tables]]\nname = \"{t}\"\ntopic = \"{topic}\"\n")
                    }
                    None => format!("[[source.tables]]\nname = \"{t}\"\n"),
                })
                .collect(),
        ),
    };
    let replication = src
        .replication_dsn
        .as_ref()
        .map_or(String::new(), |d| format!("replication_dsn = \"{d}\"\n"));
    format!(
        r#"[source]
dsn = "{dsn}"
{replication}slot = "{slot}"
publication = "{publication}"
{table}create_slot = {create}
status_interval_ms = {status_ms}
sslmode = "disable"
{list}[sink]
topic = "{topic}"
[sink.kafka]
"bootstrap.servers" = "{bootstrap}"
{tls}"#,
        dsn = w.dsn(),
        slot = src.slot,
        publication = src.publication,
        create = !src.slot_exists,
        bootstrap = sink.bootstrap,
    )
}

/// Builds the command of a slot reader.
pub fn slot_command(
    w: &World,
    kind: Contestant,
    slot: &str,
    end_lsn: u64,
    topic: &str,
    cfg: &RunCfg,
) -> Result<Command> {
    Ok(match kind {
        Contestant::CeilingRecvlogical => {
            let mut c = Command::new(outboxd_testkit::pg_bin_dir().join("pg_recvlogical"));
            c.args([
                "-d",
                &w.libpq_conninfo(),
                "-S",
                slot,
                "--start",
                "--no-loop",
            ])
            .arg(format!(
                "--endpos={:X}/{:X}",
                end_lsn >> 32,
                end_lsn & 0xffff_ffff
            ))
            .args(["-o", "proto_version=1", "-o"])
            .arg(format!("publication_names={PUBLICATION}"))
            .args(["-f", "/dev/null", "-F", "0", "-s", "1"])
            .env("PGPASSWORD", w.password());
            c
        }
        Contestant::CeilingBare | Contestant::CeilingBareTls => {
            let mut c = Command::new(&cfg.bench_bin);
            c.arg("bare-reader")
                .args(["--port", &w.pg.port.to_string(), "--db", world::DB])
                .args(["--slot", slot, "--status-ms", &cfg.status_ms.to_string()])
                .env("PGPASSWORD", w.password());
            if kind == Contestant::CeilingBareTls {
                c.arg("--tls");
            }
            c
        }
        Contestant::Outboxd
        | Contestant::OutboxdVariant
        | Contestant::OutboxdCeBinary
        | Contestant::OutboxdCeStructured
        | Contestant::OutboxdViaProxy
        | Contestant::OutboxdViaTls => {
            let path = w.dir.path().join(format!("{slot}.toml"));
            let sink = w.sink(kind)?;
            std::fs::write(&path, outboxd_toml(w, &sink, slot, topic, cfg.status_ms))?;
            let bin = match (&cfg.variant_bin, kind) {
                (Some(b), Contestant::OutboxdVariant) => b,
                _ => &cfg.relay_bin,
            };
            let mut c = match cfg.relay_wrapper.split_first() {
                Some((prog, args)) => {
                    let mut c = Command::new(prog);
                    c.args(args).arg(bin);
                    c
                }
                None => Command::new(bin),
            };
            c.arg("run")
                .arg("--config")
                .arg(path)
                .envs(cfg.relay_env.clone());
            if kind == Contestant::OutboxdVariant {
                c.envs(cfg.variant_env.clone());
            }
            if let Some(mode) = kind.cloudevents() {
                c.env("OUTBOXD_SINK_FORMAT", "cloudevents")
                    .env("OUTBOXD_SINK_CLOUDEVENTS_MODE", mode);
            }
            c
        }
        Contestant::Polling => bail!("polling has no slot"),
    })
}

/// Waits until `slot` is active; returns the walsender pid.
pub async fn wait_active(
    sql: &tokio_postgres::Client,
    slot: &str,
    pid: u32,
    log: &Path,
) -> Result<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let (Some(ws), _) = world::slot_state(sql, slot).await? {
            return Ok(ws as u32);
        }
        if let Some(e) = procstat::try_reap(pid)? {
            bail!(
                "{slot}: reader exited early ({e:?}): {}",
                procstat::tail(log, 20)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "{slot}: slot not active after 60 s: {}",
                procstat::tail(log, 20)
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A slot reader that streamed the warm-up rows and was then paused (SIGSTOP) before the
/// timed rows were loaded, so its one-time start-up (connections, broker metadata, producer id:
/// about a second with tansu) is not timed, and nothing it could read ahead during start-up
/// is either.
pub struct Paused {
    pub kind: Contestant,
    pub slot: String,
    pub pid: u32,
    pub walsender: u32,
    sink: Sink,
    log: PathBuf,
}

impl Drop for Paused {
    /// A paused walsender must never outlive the run: a stopped backend would hang the
    /// cluster's shutdown.
    fn drop(&mut self) {
        // SAFETY: kill(2) on a backend of the bench's own cluster; harmless when it runs.
        unsafe { libc::kill(self.walsender as i32, libc::SIGCONT) };
    }
}

/// Starts a slot reader, waits until it confirmed `warm_lsn`, and pauses it (and its
/// walsender).
pub async fn start_paused(
    w: &World,
    kind: Contestant,
    slot: &str,
    topic: &str,
    warm_lsn: u64,
    cfg: &RunCfg,
) -> Result<Paused> {
    let sql = w.sql().await?;
    let log = w.dir.path().join(format!("{slot}.log"));
    let pid = spawn(&mut slot_command(w, kind, slot, 0, topic, cfg)?, &log)?;
    let walsender = wait_active(&sql, slot, pid, &log).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while world::slot_state(&sql, slot).await?.1 < warm_lsn {
        if let Some(e) = procstat::try_reap(pid)? {
            bail!("{slot}: reader died ({e:?}): {}", procstat::tail(&log, 30));
        }
        if Instant::now() > deadline {
            bail!(
                "{slot}: warm-up not confirmed: {}",
                procstat::tail(&log, 30)
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    // Its walsender too, idle now (it sent the warm-up and waits for WAL): left running, it
    // would decode the timed rows during the load and park them in the socket buffers, which
    // hold 36 MB on a kernel with tcp_rmem max = 32 MB, i.e. the whole run, and the clock
    // would time only what is left (seen: runs of "0.00 s" at 200,000 events).
    // SAFETY: kill(2) on a Postgres backend of the bench's own cluster.
    unsafe { libc::kill(walsender as i32, libc::SIGSTOP) };
    Ok(Paused {
        kind,
        slot: slot.to_string(),
        pid,
        walsender,
        sink: w.sink(kind)?,
        log,
    })
}

/// Resumes a paused reader and times it until the slot's confirmed LSN covers `end_lsn`.
pub async fn run_paused(w: &World, p: Paused, end_lsn: u64, events: u64) -> Result<RunResult> {
    let mut r = drain_paused(w, &p, end_lsn, events).await?;
    let e = procstat::terminate(p.pid, Duration::from_secs(30))?;
    r.peak_rss_kib = r.peak_rss_kib.or(Some(e.max_rss_kib));
    Ok(r)
}

/// [`run_paused`] that leaves the reader running afterwards (the caller reads what else it
/// needs of it, e.g. its `/metrics`, then terminates `p.pid`).
pub async fn drain_paused(w: &World, p: &Paused, end_lsn: u64, events: u64) -> Result<RunResult> {
    let sql = w.sql().await?;
    let (slot, pid, log) = (&p.slot, p.pid, &p.log);
    let pids = [Some(pid), Some(p.walsender), p.sink.broker_pid];
    let cpu0 = CpuSnap::take(&pids);
    let proxy0 = p.sink.proxy_tid.and_then(procstat::thread_cpu_secs);
    let start_lsn = world::slot_state(&sql, slot).await?.1;
    let t0 = Instant::now();
    // SAFETY: kill(2) on our own child and its walsender.
    unsafe {
        libc::kill(p.walsender as i32, libc::SIGCONT);
        libc::kill(pid as i32, libc::SIGCONT);
    }
    let deadline = t0 + Duration::from_secs(300 + events / 2000);
    let mut first_ack = None;
    loop {
        let confirmed = world::slot_state(&sql, slot).await?.1;
        if confirmed > start_lsn && first_ack.is_none() {
            first_ack = Some(t0.elapsed().as_secs_f64());
        }
        if confirmed >= end_lsn {
            break;
        }
        if let Some(e) = procstat::try_reap(pid)? {
            bail!("{slot}: reader died ({e:?}): {}", procstat::tail(log, 30));
        }
        if Instant::now() > deadline {
            let _ = procstat::terminate(pid, Duration::from_secs(5));
            bail!(
                "{slot}: not done before the deadline: {}",
                procstat::tail(log, 30)
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu0.delta(&CpuSnap::take(&pids));
    let proxy1 = p.sink.proxy_tid.and_then(procstat::thread_cpu_secs);
    let rss = procstat::peak_rss_kib(pid);
    if std::env::var_os("BENCH_THREADS").is_some() {
        eprintln!("{} threads:\n{}", p.kind.label(), procstat::threads(pid));
        eprintln!("walsender:\n{}", procstat::threads(p.walsender));
    }
    Ok(RunResult {
        contestant: p.kind,
        events,
        secs,
        rate: events as f64 / secs,
        first_ack_s: first_ack,
        relay_cpu_s: cpu[0],
        pg_cpu_s: cpu[1],
        broker_cpu_s: cpu[2],
        proxy_cpu_s: proxy0.zip(proxy1).map(|(a, b)| b - a),
        peak_rss_kib: rss,
        verified: None,
    })
}

/// pg_recvlogical, started after loading with `--endpos`: timed from its slot turning active
/// to its exit (its start-up is a few milliseconds, and it has no broker to wait for).
pub async fn run_recvlogical(
    w: &World,
    slot: &str,
    end_lsn: u64,
    events: u64,
    cfg: &RunCfg,
) -> Result<RunResult> {
    let sql = w.sql().await?;
    let log = w.dir.path().join(format!("{slot}.log"));
    let kind = Contestant::CeilingRecvlogical;
    let pid = spawn(&mut slot_command(w, kind, slot, end_lsn, "", cfg)?, &log)?;
    let walsender = wait_active(&sql, slot, pid, &log).await?;
    let t0 = Instant::now();
    let pids = [Some(walsender), w.broker_pid];
    let cpu0 = CpuSnap::take(&pids);
    let deadline = t0 + Duration::from_secs(300 + events / 2000);
    // The walsender exits with the client: keep its last good sample.
    let mut last = cpu0.clone();
    let exit = loop {
        for (l, s) in last.0.iter_mut().zip(CpuSnap::take(&pids).0) {
            if s.is_some() {
                *l = s;
            }
        }
        if let Some(e) = procstat::try_reap(pid)? {
            if !e.success {
                bail!("pg_recvlogical failed: {}", procstat::tail(&log, 20));
            }
            break e;
        }
        if Instant::now() > deadline {
            let _ = procstat::terminate(pid, Duration::from_secs(5));
            bail!("pg_recvlogical not done before the deadline");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu0.delta(&last);
    Ok(RunResult {
        contestant: kind,
        events,
        secs,
        rate: events as f64 / secs,
        first_ack_s: None,
        relay_cpu_s: Some(exit.cpu_secs),
        pg_cpu_s: cpu[0],
        broker_cpu_s: cpu[1],
        proxy_cpu_s: None,
        peak_rss_kib: Some(exit.max_rss_kib),
        verified: None,
    })
}

/// Runs the polling relay over the pre-loaded `outbox_poll` rows until it finds none left.
pub async fn run_polling(w: &World, events: u64, topic: &str, cfg: &RunCfg) -> Result<RunResult> {
    let log = w.dir.path().join(format!("{topic}.log"));
    let mut cmd = poll_relay_command(w, topic, cfg);
    cmd.arg("--exit-when-empty");
    let pid = spawn(&mut cmd, &log)?;
    let broker0 = w.broker_pid.and_then(procstat::cpu_secs);
    let deadline = Instant::now() + Duration::from_secs(600 + events / 200);
    let exit = loop {
        if let Some(e) = procstat::try_reap(pid)? {
            break e;
        }
        if Instant::now() > deadline {
            let _ = procstat::terminate(pid, Duration::from_secs(5));
            bail!("polling relay not done before the deadline");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let broker1 = w.broker_pid.and_then(procstat::cpu_secs);
    let out = std::fs::read_to_string(&log)?;
    let summary: crate::poll::PollSummary = out
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("R "))
        .map(serde_json::from_str)
        .transpose()?
        .with_context(|| {
            format!(
                "polling relay failed ({exit:?}): {}",
                procstat::tail(&log, 20)
            )
        })?;
    if !exit.success || summary.events != events {
        bail!(
            "polling relay sent {} of {events} ({exit:?}): {}",
            summary.events,
            procstat::tail(&log, 20)
        );
    }
    Ok(RunResult {
        contestant: Contestant::Polling,
        events,
        secs: summary.secs,
        rate: events as f64 / summary.secs,
        first_ack_s: None,
        relay_cpu_s: Some(exit.cpu_secs),
        pg_cpu_s: Some(summary.backend_cpu_s),
        broker_cpu_s: broker0.zip(broker1).map(|(a, b)| b - a),
        proxy_cpu_s: None,
        peak_rss_kib: Some(exit.max_rss_kib),
        verified: None,
    })
}

/// The polling relay process for `topic`, with the options every polling run shares.
pub fn poll_relay_command(w: &World, topic: &str, cfg: &RunCfg) -> Command {
    let mut cmd = Command::new(&cfg.bench_bin);
    cmd.arg("poll-relay")
        .args([
            "--dsn",
            &w.dsn(),
            "--bootstrap",
            &w.bootstrap(),
            "--topic",
            topic,
        ])
        .args([
            "--batch",
            &cfg.poll_batch.to_string(),
            "--linger-ms",
            &cfg.linger_ms,
        ]);
    cmd
}
