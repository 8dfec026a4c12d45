//! `outboxd-bench otel` — what OpenTelemetry trace export costs delivery (issue 43), release
//! relay processes against the bench's in-process OTLP/gRPC receiver ([`crate::otlp`]).
//!
//! Every row the bench writes carries a W3C `traceparent` in its `headers` (the outbox table's
//! column default, [`HEADERS_SQL`]): sampled (`-01`) on every row, or on every 100th with the
//! rest `-00`. The relay runs with the exporter's defaults (queue 2,048, batches of 512, 1 s
//! schedule delay: what users get); only the endpoint is set (`OUTBOXD_TELEMETRY_ENDPOINT`), or
//! nothing at all when off. `--telemetry-env` adds settings to every traced relay and the
//! report labels them as tuned.
//!
//! Per run, the modes take turns (the order rotates between runs), each on a fresh slot and
//! topic:
//! - **backlog**: off, all sampled, 1 % sampled, all sampled with the receiver down (the
//!   endpoint a closed port). The relay streams a warm-up, is paused (as `run` does), `--events`
//!   rows are loaded, and it is timed from resuming to the slot confirmed past them; relay and
//!   walsender CPU, spans received, `outboxd_trace_spans_dropped_total` from its `/metrics`
//!   (read once the receiver went quiet, before the relay stops), every event read back in
//!   order.
//! - **live**: off, all sampled with the receiver up, and with it down, at `--live-rate` for
//!   `--live-secs` (the `run` bench's live point: open-loop writers, commit→ack from the slot's
//!   confirmed position and the relay's histogram); every event read back.

pub mod report;

use crate::bench::live::{finish_relay, relay_point, start_relay, LivePlan};
use crate::bench::{env_pairs, log, verify_timeout, WARM_ROWS};
use crate::contest::{self, Contestant, RunCfg};
use crate::otlp::{self, Receiver};
use crate::procstat;
use crate::scrape;
use crate::tables::OutOpts;
use crate::verify::verify_topic;
use crate::world::{RowOpts, Shape, World, AGG_TYPE};
use anyhow::{bail, Result};
use report::{BacklogRun, LiveRun, Mode, OtelReport, Spans};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    /// Events per backlog.
    #[arg(long, default_value_t = 100_000)]
    pub events: u64,
    /// Rows per transaction (backlog and live).
    #[arg(long, default_value_t = 10)]
    pub tx_size: usize,
    #[command(flatten)]
    pub rows: RowOpts,
    /// Runs of every mode; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Events/s of the live points (0: no live points).
    #[arg(long, default_value_t = 2_000.0)]
    pub live_rate: f64,
    /// Seconds of writing per live point.
    #[arg(long, default_value_t = 10.0)]
    pub live_secs: f64,
    /// Writer connections of the live points.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// The relay's `status_interval_ms` (bounds how far the confirmed position, the stopwatch,
    /// trails the acks).
    #[arg(long, default_value_t = 10)]
    pub status_ms: u64,
    /// Period of the live points' confirmed-LSN sampler.
    #[arg(long, default_value_t = 5)]
    pub confirm_poll_ms: u64,
    /// Extra environment of every traced relay, KEY=VALUE (repeatable), e.g.
    /// OUTBOXD_TELEMETRY_MAX_QUEUE_SIZE=65536: a tuned exporter instead of the defaults (the
    /// report says so).
    #[arg(long)]
    pub telemetry_env: Vec<String>,
    #[command(flatten)]
    pub out: OutOpts,
}

impl Opts {
    fn shape(&self) -> Shape {
        self.rows.shape(self.tx_size)
    }
}

/// The outbox table's `headers` default: a `traceparent` per row (trace id and parent span id
/// from a sequence, so every row is its own trace), sampled on every `every`-th row.
const HEADERS_SQL: &str = r#"
CREATE SEQUENCE IF NOT EXISTS otel_bench_seq;
CREATE OR REPLACE FUNCTION otel_bench_headers(every int) RETURNS jsonb
LANGUAGE sql VOLATILE AS $$
    SELECT jsonb_build_object('traceparent', '00-' || md5(n::text) || '-'
        || left(md5('s' || n), 16) || CASE WHEN n % every = 0 THEN '-01' ELSE '-00' END)
    FROM (SELECT nextval('otel_bench_seq') AS n) s
$$;
"#;

/// Rows written from here on are sampled every `every`-th; the sequence restarts, so every
/// 100th row of a backlog is the 100th, 200th, ….
async fn sample_every(w: &World, every: u32) -> Result<()> {
    w.sql()
        .await?
        .batch_execute(&format!(
            "ALTER SEQUENCE otel_bench_seq RESTART WITH 1; \
             ALTER TABLE outbox ALTER COLUMN headers SET DEFAULT otel_bench_headers({every})"
        ))
        .await?;
    Ok(())
}

/// Sampled rows in the outbox table (it holds one backlog run's rows: it is emptied first).
async fn sampled_rows(w: &World) -> Result<u64> {
    let n: i64 = w
        .sql()
        .await?
        .query_one(
            "SELECT count(*) FROM outbox WHERE headers->>'traceparent' LIKE '%-01'",
            &[],
        )
        .await?
        .get(0);
    Ok(n as u64)
}

pub async fn run(o: Opts, command: String) -> Result<OtelReport> {
    if o.runs == 0 || o.events == 0 {
        bail!("--runs and --events must be positive");
    }
    // "off" must be off: the relay would read these from the bench's environment.
    for k in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ] {
        if std::env::var_os(k).is_some() {
            bail!("{k} is set: unset it, the relays would all export");
        }
    }
    let relay_bin = o.out.relay_bin()?;
    let machine = procstat::machine();
    let started = chrono::Local::now();
    log("starting postgres, the broker and the OTLP receiver");
    let mut w = World::start(false).await?;
    w.sql().await?.batch_execute(HEADERS_SQL).await?;
    let rx = Receiver::start().await?;
    let down = otlp::closed_port();
    let mut report = OtelReport {
        command,
        started_at: started.to_rfc3339(),
        machine,
        load_avg_at_end: String::new(),
        postgres: w.server_version().await?,
        events: o.events,
        tx_size: o.tx_size,
        payload_bytes: o.rows.payload_bytes,
        partitions: o.rows.partitions,
        runs: o.runs,
        live_rate: o.live_rate,
        live_secs: o.live_secs,
        writers: o.writers,
        status_ms: o.status_ms,
        telemetry_env: o.telemetry_env.clone(),
        backlog: vec![],
        live: vec![],
        finished_in_s: 0.0,
    };
    let t_all = Instant::now();
    for r in 1..=o.runs {
        for mode in rotated(&Mode::BACKLOG, r) {
            let env = Env::new(&o, &relay_bin, mode, rx.port, down)?;
            let b = backlog(&mut w, &o, (&env, &rx), r).await?;
            log(b.line());
            report.backlog.push(b);
        }
        if o.live_rate > 0.0 {
            for mode in rotated(&Mode::LIVE, r) {
                let env = Env::new(&o, &relay_bin, mode, rx.port, down)?;
                let l = live(&mut w, &o, (&env, &rx), r).await?;
                log(l.line());
                report.live.push(l);
            }
        }
    }
    report.finished_in_s = t_all.elapsed().as_secs_f64();
    report.load_avg_at_end = procstat::machine().load_avg_at_start;
    Ok(report)
}

/// `modes` starting at run `r`'s turn: no mode always goes first.
fn rotated(modes: &[Mode], r: usize) -> Vec<Mode> {
    let mut v = modes.to_vec();
    v.rotate_left((r - 1) % modes.len());
    v
}

/// One relay process's configuration in `mode`.
struct Env {
    cfg: RunCfg,
    mode: Mode,
}

impl Env {
    fn new(o: &Opts, relay_bin: &std::path::Path, mode: Mode, up: u16, down: u16) -> Result<Self> {
        let mut relay_env = vec![];
        if let Some(port) = mode.receiver(up, down) {
            relay_env.push((
                "OUTBOXD_TELEMETRY_ENDPOINT".to_string(),
                format!("http://127.0.0.1:{port}"),
            ));
            relay_env.extend(env_pairs(&o.telemetry_env));
        }
        let cfg = RunCfg {
            relay_bin: relay_bin.to_path_buf(),
            bench_bin: std::env::current_exe()?,
            status_ms: o.status_ms,
            poll_batch: 0,
            linger_ms: String::new(),
            relay_wrapper: vec![],
            relay_env,
            variant_env: vec![],
            variant_bin: None,
        };
        Ok(Self { cfg, mode })
    }

    /// The same, with the relay's metrics on `port` (the `run` bench's live relay sets its own).
    fn with_metrics(&self, port: u16) -> RunCfg {
        let mut cfg = self.cfg.clone();
        cfg.relay_env
            .push(("OUTBOXD_METRICS_LISTEN".into(), format!("127.0.0.1:{port}")));
        cfg
    }

    /// Waits (at most 30 s) until the relay's exporter is done with `sampled` spans: received
    /// and dropped add up, or neither moved for two schedule delays (spans still queued when
    /// the export thread ends are neither). Returns the counts at that point.
    async fn settle(&self, rx: &Receiver, spans0: u64, metrics: u16, sampled: u64) -> Spans {
        let read = || {
            let dropped = scrape::metrics_text(metrics)
                .map(|t| scrape::counter(&t, outboxd::obs::TRACE_SPANS_DROPPED) as u64)
                .unwrap_or(0);
            (rx.spans() - spans0, dropped)
        };
        let mut last = read();
        if self.mode.traced() {
            let (deadline, mut still) = (Instant::now() + Duration::from_secs(30), Instant::now());
            while last.0 + last.1 < sampled && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let now = read();
                if now != last {
                    (last, still) = (now, Instant::now());
                } else if last.0 + last.1 > 0 && still.elapsed() > Duration::from_secs(2) {
                    // Nothing accounted yet is the first export still waiting (a receiver
                    // that is down fails it only after its connection attempt).
                    break;
                }
            }
        }
        Spans {
            sampled,
            received: last.0,
            dropped: last.1,
        }
    }
}

/// One backlog drained in `mode`, on a fresh slot and topic.
async fn backlog(
    w: &mut World,
    o: &Opts,
    (env, rx): (&Env, &Receiver),
    r: usize,
) -> Result<BacklogRun> {
    let mode = env.mode;
    let slot = format!("otel_b{r}_{}", mode.tag());
    let tpl = format!("otel.b{r}.{}.{{aggregate_type}}", mode.tag());
    let topic = tpl.replace("{aggregate_type}", AGG_TYPE);
    w.create_topics(std::slice::from_ref(&topic), o.rows.partitions)
        .await?;
    w.sql().await?.batch_execute("TRUNCATE outbox").await?;
    sample_every(w, mode.every()).await?;
    w.create_slot(&slot).await?;
    let (first, warm_lsn) = w.load("outbox", WARM_ROWS, o.shape()).await?;
    let metrics = outboxd_testkit::free_port();
    let cfg = env.with_metrics(metrics);
    let spans0 = rx.spans();
    let p = contest::start_paused(w, Contestant::Outboxd, &slot, &tpl, warm_lsn, &cfg).await?;
    let (_, end_lsn) = w.load("outbox", o.events as usize, o.shape()).await?;
    let res = contest::drain_paused(w, &p, end_lsn, o.events).await?;
    let spans = env
        .settle(rx, spans0, metrics, sampled_rows(w).await?)
        .await;
    let exit = procstat::terminate(p.pid, Duration::from_secs(30))?;
    if !exit.success {
        bail!("{slot}: the relay exited with an error ({exit:?})");
    }
    drop(p);
    let n = o.events + WARM_ROWS as u64;
    let verified = verify_topic(&w.bootstrap(), &topic, first, n, verify_timeout(n))?;
    // One writer commits in version order: every event, each aggregate in order.
    if !verified.ok() {
        bail!("{slot} failed verification: {verified:?}");
    }
    w.drop_slot(&slot).await?;
    Ok(BacklogRun {
        mode,
        run: r,
        events: o.events,
        secs: res.secs,
        rate: res.rate,
        relay_cpu_s: res.relay_cpu_s,
        walsender_cpu_s: res.pg_cpu_s,
        peak_rss_kib: res.peak_rss_kib,
        spans,
        verified,
    })
}

/// One live point in `mode`, on a fresh relay process, slot and topic.
async fn live(w: &mut World, o: &Opts, (env, rx): (&Env, &Receiver), r: usize) -> Result<LiveRun> {
    let mode = env.mode;
    let plan = LivePlan {
        shape: o.shape(),
        partitions: o.rows.partitions,
        secs: o.live_secs,
        writers: o.writers,
        confirm_poll_ms: o.confirm_poll_ms,
    };
    sample_every(w, mode.every()).await?;
    let kind = Contestant::Outboxd;
    let spans0 = rx.spans();
    let round = Some(format!("_otel_r{r}_{}", mode.tag()));
    let mut s = start_relay(w, &plan, &env.cfg, kind, round).await?;
    let (point, written) = relay_point(w, &plan, &s.run(kind), (o.live_rate, None)).await?;
    s.total += written.events;
    // Every row since the relay started is sampled (its warm-up's too).
    let spans = env.settle(rx, spans0, s.metrics_port(), s.total).await;
    let mut points = [point];
    // Stops the relay, drops the slot, and fails unless every event is on the topic.
    finish_relay(w, kind, s, &mut points, &mut []).await?;
    let [point] = points;
    Ok(LiveRun {
        mode,
        run: r,
        point,
        spans,
    })
}
