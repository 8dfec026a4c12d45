//! The benchmark run: throughput per transaction size (ceiling, outboxd, polling), latency at
//! fixed offered loads, what TLS to Kafka costs, and one very large transaction; then the report.

pub mod cleanup;
pub mod live;

use crate::contest::{self, Contestant, RunCfg, RunResult};
use crate::kafka_hop::KafkaHop;
use crate::latency;
use crate::report::kafka_tls::KafkaTlsReport;
use crate::report::{LiveCpu, Report, Scenario, WriteCapacity};
use crate::verify::verify_topic;
use crate::world::{self, RowOpts, Shape, World, AGG_TYPE};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Workload knobs and outputs of one benchmark run.
#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    /// Events per throughput run (loaded before the contestant starts).
    #[arg(long, default_value_t = 200_000)]
    pub events: u64,
    /// Transaction sizes of the throughput phase; the first is also the latency phase's.
    #[arg(long, value_delimiter = ',', default_value = "10,1")]
    pub tx_sizes: Vec<usize>,
    #[command(flatten)]
    pub rows: RowOpts,
    /// Timed runs per contestant and transaction size; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Events per polling run (default: --events).
    #[arg(long)]
    pub poll_events: Option<u64>,
    /// Rows per poll of the polling relay.
    #[arg(long, default_value_t = 500)]
    pub poll_batch: i64,
    /// The polling relay's `linger.ms`. Default: librdkafka's own default, what a team's relay
    /// gets unless it tunes it (outboxd defaults to 10; a poller's batches are set by its poll
    /// cycle, which already includes one linger and one acknowledgement round trip).
    #[arg(long, default_value = "5")]
    pub poll_linger_ms: String,
    /// Offered loads of the latency phase, as fractions of the measured ceiling.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.01,0.025,0.05,0.075,0.1,0.125,0.15,0.2,0.25,0.5"
    )]
    pub sweep: Vec<f64>,
    /// Offered loads in events/s (open loop), instead of --sweep.
    #[arg(long, value_delimiter = ',')]
    pub target_rate: Vec<f64>,
    /// Adds a point at this many events/s; where the writers cannot keep that schedule they
    /// commit back to back, i.e. closed loop at the highest rate the machine sustains.
    #[arg(long)]
    pub max_rate: Option<f64>,
    /// More latency points at these fractions of the ceiling with a consumer reading the
    /// topic: commit→consumer latency (0 or empty: none). Kept out of the sweep because the
    /// consumer competes with the relay for CPU.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.25")]
    pub consumer_at: Vec<f64>,
    /// Rounds of the latency phase: the whole sweep and the points with a consumer, all
    /// contestants in turn, then again (each round on fresh relay processes, slots and topics);
    /// the report shows medians over the rounds and each round's p50 and p99.
    #[arg(long, default_value_t = 1)]
    pub latency_runs: usize,
    /// Seconds of writing per latency point.
    #[arg(long, default_value_t = 5.0)]
    pub latency_secs: f64,
    /// Writer connections of the latency phase.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Rows of the single large transaction (0: skip).
    #[arg(long, default_value_t = 1_000_000)]
    pub big_txn_rows: u64,
    /// outboxd's and the bare reader's `status_interval_ms` (bounds stopwatch overshoot).
    #[arg(long, default_value_t = 10)]
    pub status_ms: u64,
    /// Period of the confirmed-LSN sampler of the latency phase.
    #[arg(long, default_value_t = 5)]
    pub confirm_poll_ms: u64,
    /// Relay binary (default: `outboxd-bench-relay` next to this binary).
    #[arg(long)]
    pub relay_bin: Option<PathBuf>,
    /// Write the latency chart (SVG) here.
    #[arg(long)]
    pub chart: Option<PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the results as Markdown here (always printed to stdout).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Small everything: 2,000 events, one run, short latency points (for the test suite).
    #[arg(long)]
    pub smoke: bool,
    /// Postgres also accepts TLS (self-signed certificate) and the throughput phase adds the
    /// bare reader over TLS. The other contestants stream in plain text; measure outboxd over
    /// TLS as a variant: --variant-env OUTBOXD_SOURCE_SSLMODE=require.
    #[arg(long)]
    pub ssl: bool,
    #[arg(long)]
    pub skip_polling: bool,
    #[arg(long)]
    pub skip_latency: bool,
    /// Skips what TLS to Kafka costs: outboxd through a plain and a TLS proxy to a second
    /// broker, in the first transaction size's throughput runs and at one live load.
    #[arg(long)]
    pub skip_kafka_tls: bool,
    /// The live load of the TLS-to-Kafka comparison, as a fraction of the ceiling (0: none).
    #[arg(long, default_value_t = 0.1)]
    pub kafka_tls_at: f64,
    /// The load of the cleanup comparison (a fraction of the ceiling; 0: skip): one live point
    /// without, one while `outboxd cleanup` deletes --cleanup-rows old rows.
    #[arg(long, default_value_t = 0.1)]
    pub cleanup_at: f64,
    /// Old, delivered rows `outboxd cleanup` deletes during the cleanup comparison.
    #[arg(long, default_value_t = 300_000)]
    pub cleanup_rows: u64,
    /// Command prefix for the relay, e.g. "valgrind --tool=callgrind" to profile it.
    #[arg(long)]
    pub relay_wrapper: Option<String>,
    /// Extra environment of the relay process, KEY=VALUE (repeatable), e.g.
    /// OUTBOXD_RELAY_MAX_IN_FLIGHT_EVENTS=20000.
    #[arg(long)]
    pub relay_env: Vec<String>,
    /// Adds the contestant "outboxd (variant)": the relay with this extra environment
    /// (repeatable), run in the same interleaved order as outboxd.
    #[arg(long)]
    pub variant_env: Vec<String>,
    /// Adds the contestant "outboxd (variant)" running this relay binary instead (with
    /// `--variant-env`, if given): an A/B of two builds in one run, e.g. the
    /// `outboxd-bench-relay` of the commit before a change.
    #[arg(long)]
    pub variant_bin: Option<PathBuf>,
    /// Adds a contestant per CloudEvents content mode listed (`binary`, `structured`, or
    /// both: `binary,structured`): outboxd with `[sink] format = "cloudevents"` in that mode
    /// (`OUTBOXD_SINK_FORMAT`, `OUTBOXD_SINK_CLOUDEVENTS_MODE`), interleaved with outboxd's
    /// plain records in the same runs; the report adds each mode's rate and relay CPU against
    /// plain (issues 42 and 55).
    #[arg(long, value_delimiter = ',', value_parser = ["binary", "structured"])]
    pub cloudevents: Vec<String>,
}

impl Opts {
    /// Is there an "outboxd (variant)" contestant?
    pub(crate) fn has_variant(&self) -> bool {
        !self.variant_env.is_empty() || self.variant_bin.is_some()
    }

    /// The CloudEvents contestants (`--cloudevents`), each mode once.
    pub(crate) fn cloudevents_kinds(&self) -> Vec<Contestant> {
        let mut v: Vec<Contestant> = self
            .cloudevents
            .iter()
            .filter_map(|m| Contestant::for_cloudevents(m))
            .collect();
        v.dedup();
        v
    }

    fn apply_smoke(&mut self) {
        if self.smoke {
            self.events = self.events.min(2_000);
            self.tx_sizes.truncate(1);
            self.runs = 1;
            self.poll_events = Some(self.events);
            // A fixed, modest rate: the smoke run checks the machinery, not the machine.
            self.target_rate = vec![2_000.0];
            self.max_rate = None;
            self.latency_secs = self.latency_secs.min(1.0);
            self.big_txn_rows = self.big_txn_rows.min(5_000);
            self.cleanup_rows = self.cleanup_rows.min(5_000);
        }
    }

    pub(crate) fn shape(&self, tx_size: usize) -> Shape {
        self.rows.shape(tx_size)
    }
}

pub(crate) fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.parent().context("exe dir")?.join(name);
    if !p.exists() {
        bail!(
            "{} not found: build with `cargo build --release -p outboxd-bench`",
            p.display()
        );
    }
    Ok(p)
}

pub(crate) fn env_pairs(kvs: &[String]) -> Vec<(String, String)> {
    kvs.iter()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub(crate) fn log(msg: impl AsRef<str>) {
    eprintln!(
        "[bench {}] {}",
        chrono::Local::now().format("%H:%M:%S"),
        msg.as_ref()
    );
}

/// Runs the whole benchmark and returns the report.
pub async fn run(mut o: Opts, command: String) -> Result<Report> {
    o.apply_smoke();
    if o.tx_sizes.is_empty() || o.runs == 0 || o.latency_runs == 0 || o.events == 0 {
        bail!("--tx-sizes, --runs, --latency-runs and --events must be non-empty/positive");
    }
    let cfg = RunCfg {
        relay_bin: match &o.relay_bin {
            Some(p) => p.clone(),
            None => sibling("outboxd-bench-relay")?,
        },
        bench_bin: std::env::current_exe()?,
        status_ms: o.status_ms,
        poll_batch: o.poll_batch,
        linger_ms: o.poll_linger_ms.clone(),
        relay_wrapper: o
            .relay_wrapper
            .as_deref()
            .map(|w| w.split_whitespace().map(String::from).collect())
            .unwrap_or_default(),
        relay_env: env_pairs(&o.relay_env),
        variant_env: env_pairs(&o.variant_env),
        variant_bin: o.variant_bin.clone(),
    };
    let machine = crate::procstat::machine();
    let started = chrono::Local::now();
    log("starting postgres and broker");
    let mut w = World::start(o.ssl).await?;
    if !o.skip_kafka_tls {
        w.hop = Some(KafkaHop::start(w.dir.path())?);
    }
    let mut report = Report {
        command,
        started_at: started.to_rfc3339(),
        machine,
        postgres: w.server_version().await?,
        pg_settings: world::PG_SETTINGS
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .chain(["fsync=off", "full_page_writes=off", "wal_level=logical"].map(String::from))
            .collect(),
        payload_bytes: o.rows.payload_bytes,
        aggregates: o.rows.aggregates,
        partitions: o.rows.partitions,
        status_ms: o.status_ms,
        scenarios: vec![],
        latency_tx_size: o.tx_sizes[0],
        latency_ceiling: 0.0,
        latency: vec![],
        consumer_points: vec![],
        latency_runs: o.latency_runs,
        write_capacity: None,
        kafka_tls: None,
        cleanup: None,
        big_txn: vec![],
        finished_in_s: 0.0,
    };
    let t_all = Instant::now();
    for &tx in &o.tx_sizes.clone() {
        let s = throughput(&mut w, &o, &cfg, tx).await?;
        report.scenarios.push(s);
    }
    let ceiling = report.scenarios[0].ceiling_rate();
    report.latency_ceiling = ceiling;
    let mut rates: Vec<(f64, Option<f64>)> = if o.target_rate.is_empty() {
        o.sweep.iter().map(|f| (f * ceiling, Some(*f))).collect()
    } else {
        o.target_rate.iter().map(|r| (*r, None)).collect()
    };
    if let Some(m) = o.max_rate {
        rates.push((m, None));
    }
    if !o.skip_latency {
        report.write_capacity = Some(write_capacity(&mut w, &o).await?);
        // The smoke run's rate is fixed: it checks the machinery, not the machine.
        let consumer_at: Vec<(f64, Option<f64>)> = if o.smoke {
            vec![(2_000.0, None)]
        } else {
            o.consumer_at
                .iter()
                .filter(|f| **f > 0.0)
                .map(|f| (f * ceiling, Some(*f)))
                .collect()
        };
        let (points, with_consumer) =
            crate::bench::live::latency_phase(&mut w, &o, &cfg, &rates, &consumer_at).await?;
        report.latency = points;
        report.consumer_points = with_consumer;
    }
    if w.hop.is_some() {
        let mut k = KafkaTlsReport {
            tx_size: o.tx_sizes[0],
            ..KafkaTlsReport::default()
        };
        let load = if o.smoke {
            Some((2_000.0, None))
        } else {
            (o.kafka_tls_at > 0.0).then_some((o.kafka_tls_at * ceiling, Some(o.kafka_tls_at)))
        };
        if let Some(load) = load.filter(|_| !o.skip_latency) {
            k.latency = crate::bench::live::kafka_tls_points(&mut w, &o, &cfg, load).await?;
        }
        k.negotiated = w.hop.as_ref().and_then(KafkaHop::negotiated);
        report.kafka_tls = Some(k);
    }
    let cleanup_load = if o.smoke {
        Some((2_000.0, None))
    } else {
        (o.cleanup_at > 0.0).then_some((o.cleanup_at * ceiling, Some(o.cleanup_at)))
    };
    if let Some(load) = cleanup_load.filter(|_| !o.skip_latency && o.cleanup_rows > 0) {
        report.cleanup = Some(crate::bench::cleanup::cleanup_points(&mut w, &o, &cfg, load).await?);
    }
    if o.big_txn_rows > 0 {
        report.big_txn = big_txn(&mut w, &o, &cfg).await?;
    }
    report.finished_in_s = t_all.elapsed().as_secs_f64();
    Ok(report)
}

async fn throughput(w: &mut World, o: &Opts, cfg: &RunCfg, tx: usize) -> Result<Scenario> {
    let mut kinds = vec![
        Contestant::CeilingRecvlogical,
        Contestant::CeilingBare,
        Contestant::Outboxd,
    ];
    if o.ssl {
        kinds.insert(2, Contestant::CeilingBareTls);
    }
    if o.has_variant() {
        kinds.push(Contestant::OutboxdVariant);
    }
    kinds.extend(o.cloudevents_kinds());
    // What TLS to Kafka costs, in the first transaction size's runs.
    if w.hop.is_some() && tx == o.tx_sizes[0] {
        kinds.extend([Contestant::OutboxdViaProxy, Contestant::OutboxdViaTls]);
    }
    let slot = |k: Contestant, r: usize| format!("{}_tx{tx}_r{r}", k.tag());
    let topic = |k: Contestant, r: usize| format!("{}.tx{tx}.r{r}.{AGG_TYPE}", k.tag());
    let mut topics = vec![];
    for r in 1..=o.runs {
        for &k in &kinds {
            w.create_slot(&slot(k, r)).await?;
        }
        topics.push(topic(Contestant::Outboxd, r));
        topics.push(topic(Contestant::OutboxdVariant, r));
        topics.push(topic(Contestant::Polling, r));
        for k in o.cloudevents_kinds() {
            topics.push(topic(k, r));
        }
    }
    w.create_topics(&topics, o.rows.partitions).await?;
    for &k in kinds.iter().filter(|k| k.hop().is_some()) {
        let names: Vec<String> = (1..=o.runs).map(|r| topic(k, r)).collect();
        world::create_topics_at(&w.sink(k)?.bootstrap, &names, o.rows.partitions).await?;
    }
    // Warm-up rows first: every reader streams them, then pauses until the timed rows exist.
    let (warm_first, warm_lsn) = w.load("outbox", WARM_ROWS, o.shape(tx)).await?;
    let mut paused = std::collections::VecDeque::new();
    for r in 1..=o.runs {
        for &k in run_order(&kinds, r)
            .iter()
            .filter(|k| **k != Contestant::CeilingRecvlogical)
        {
            let tpl = format!("{}.tx{tx}.r{r}.{{aggregate_type}}", k.tag());
            paused.push_back(contest::start_paused(w, k, &slot(k, r), &tpl, warm_lsn, cfg).await?);
        }
    }
    log(format!("tx size {tx}: loading {} events", o.events));
    let t = Instant::now();
    let (_, end_lsn) = w.load("outbox", o.events as usize, o.shape(tx)).await?;
    log(format!("loaded in {:.1} s", t.elapsed().as_secs_f64()));
    let mut runs = vec![];
    for r in 1..=o.runs {
        for k in run_order(&kinds, r) {
            let mut res = match k {
                // pg_recvlogical starts after loading: it streams the warm-up rows too.
                Contestant::CeilingRecvlogical => {
                    let n = o.events + WARM_ROWS as u64;
                    contest::run_recvlogical(w, &slot(k, r), end_lsn, n, cfg).await?
                }
                _ => {
                    let p = paused.pop_front().context("paused reader")?;
                    contest::run_paused(w, p, end_lsn, o.events).await?
                }
            };
            if k.is_outboxd() {
                let n = o.events + WARM_ROWS as u64;
                let v = verify_topic(
                    &w.sink(k)?.bootstrap,
                    &topic(k, r),
                    warm_first,
                    n,
                    verify_timeout(n),
                )?;
                if !v.ok() {
                    bail!("{} run {r} (tx {tx}) failed verification: {v:?}", k.label());
                }
                res.verified = Some(v);
            }
            log(format!(
                "tx {tx} run {r}: {:<24} {:>9.0} ev/s ({:.2} s, first ack after {:.3} s, CPU relay {:.2} s, walsender {:.2} s{})",
                k.label(),
                res.rate,
                res.secs,
                res.first_ack_s.unwrap_or(0.0),
                res.relay_cpu_s.unwrap_or(0.0),
                res.pg_cpu_s.unwrap_or(0.0),
                res.proxy_cpu_s
                    .map_or(String::new(), |c| format!(", proxy {c:.2} s")),
            ));
            w.drop_slot(&slot(k, r)).await?;
            runs.push(res);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    if !o.skip_polling {
        let n = o.poll_events.unwrap_or(o.events);
        for r in 1..=o.runs {
            w.sql()
                .await?
                .batch_execute("TRUNCATE outbox_poll RESTART IDENTITY")
                .await?;
            let (first, _) = w.load("outbox_poll", n as usize, o.shape(tx)).await?;
            w.sql()
                .await?
                .batch_execute("VACUUM ANALYZE outbox_poll")
                .await?;
            let tp = topic(Contestant::Polling, r);
            let mut res = contest::run_polling(w, n, &tp, cfg).await?;
            let v = verify_topic(&w.bootstrap(), &tp, first, n, verify_timeout(n))?;
            if !v.ok() {
                bail!("polling run {r} (tx {tx}) failed verification: {v:?}");
            }
            res.verified = Some(v);
            log(format!(
                "tx {tx} run {r}: {:<24} {:>9.0} ev/s",
                res.contestant.label(),
                res.rate
            ));
            runs.push(res);
        }
    }
    Ok(Scenario {
        tx_size: tx,
        events: o.events,
        runs,
    })
}

/// `kinds` in run `r`'s order: the two hops of the TLS-to-Kafka comparison take turns going
/// first, so neither always runs right after the same contestant.
fn run_order(kinds: &[Contestant], r: usize) -> Vec<Contestant> {
    let mut v = kinds.to_vec();
    if r.is_multiple_of(2) {
        let px = v.iter().position(|k| *k == Contestant::OutboxdViaProxy);
        let tls = v.iter().position(|k| *k == Contestant::OutboxdViaTls);
        if let (Some(a), Some(b)) = (px, tls) {
            v.swap(a, b);
        }
    }
    v
}

/// Rows every slot reader streams (and then pauses) before the timed rows are loaded.
pub(crate) const WARM_ROWS: usize = 1_000;

/// The most outbox rows this machine commits with no relay, no slot reader and no broker
/// at work: the same writers as the latency phase, back to back. No relay can be shown a live
/// load above this here, whatever the ceiling (a reader of a backlog) says.
async fn write_capacity(w: &mut World, o: &Opts) -> Result<WriteCapacity> {
    let shape = o.shape(o.tx_sizes[0]);
    let secs = if o.smoke { 0.5 } else { 4.0 };
    let written = latency::open_loop(w, "outbox", None, secs, shape, o.writers).await?;
    let cap = WriteCapacity {
        writers: o.writers,
        rate: written.achieved_rate,
        writer_us_per_event: LiveCpu::of(&written, None, None, None).writers,
    };
    log(format!(
        "write capacity ({} writers, no relay): {:.0} ev/s, {:.1} µs of backend CPU per event",
        cap.writers,
        cap.rate,
        cap.writer_us_per_event.unwrap_or(0.0)
    ));
    Ok(cap)
}

pub(crate) fn verify_timeout(n: u64) -> Duration {
    Duration::from_secs(60 + n / 5_000)
}

/// One transaction of `big_txn_rows` rows: the ceiling reader and outboxd, once each; outboxd's
/// peak RSS is the point.
async fn big_txn(w: &mut World, o: &Opts, cfg: &RunCfg) -> Result<Vec<RunResult>> {
    let n = o.big_txn_rows;
    let mut kinds = vec![Contestant::CeilingBare, Contestant::Outboxd];
    if o.has_variant() {
        kinds.push(Contestant::OutboxdVariant);
    }
    for &k in &kinds {
        w.create_slot(&format!("{}_big", k.tag())).await?;
    }
    let topics = [Contestant::Outboxd, Contestant::OutboxdVariant]
        .map(|k| format!("{}.big.{AGG_TYPE}", k.tag()));
    w.create_topics(&topics, o.rows.partitions).await?;
    let (warm_first, warm_lsn) = w.load("outbox", WARM_ROWS, o.shape(100)).await?;
    let mut paused = std::collections::VecDeque::new();
    for &k in &kinds {
        let tpl = format!("{}.big.{{aggregate_type}}", k.tag());
        let slot = format!("{}_big", k.tag());
        paused.push_back(contest::start_paused(w, k, &slot, &tpl, warm_lsn, cfg).await?);
    }
    log(format!("loading one transaction of {n} rows"));
    let (_, end_lsn) = w.load("outbox", n as usize, o.shape(n as usize)).await?;
    let mut out = vec![];
    for k in kinds {
        let slot = format!("{}_big", k.tag());
        let p = paused.pop_front().context("paused reader")?;
        let mut res = contest::run_paused(w, p, end_lsn, n).await?;
        if k != Contestant::CeilingBare {
            let topic = format!("{}.big.{AGG_TYPE}", k.tag());
            let total = n + WARM_ROWS as u64;
            let v = verify_topic(
                &w.bootstrap(),
                &topic,
                warm_first,
                total,
                verify_timeout(total),
            )?;
            if !v.ok() {
                bail!("{} big transaction failed verification: {v:?}", k.label());
            }
            res.verified = Some(v);
        }
        log(format!(
            "big txn: {:<24} {:>9.0} ev/s, peak RSS {:?} KiB",
            k.label(),
            res.rate,
            res.peak_rss_kib
        ));
        w.drop_slot(&slot).await?;
        out.push(res);
    }
    Ok(out)
}
