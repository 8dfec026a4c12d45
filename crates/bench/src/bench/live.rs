//! The latency phase: per round (`--latency-runs`), one relay process per contestant; after a
//! warm-up, the points at `--consumer-at` with a consumer reading the topic (commit→consumer),
//! then each offered load of the sweep in turn (open loop, no consumer). Also the TLS-to-Kafka
//! comparison's live point.

use super::{log, verify_timeout, Opts};
use crate::consume::LiveConsumer;
use crate::contest::{self, Contestant, RunCfg};
use crate::latency::{self, ConfirmPoller, PollingLive, Written};
use crate::procstat::{self, CpuSnap};
use crate::report::{LatencyPoint, LiveCpu};
use crate::scrape;
use crate::verify::verify_topic;
use crate::world::{self, Shape, World, AGG_TYPE};
use anyhow::{bail, Result};
use std::time::{Duration, Instant};

/// An offered load: events/s and, when given as one, the fraction of the ceiling.
pub type Load = (f64, Option<f64>);

/// The sweep's points, then the consumer points, of every round (`--latency-runs`): per
/// round each contestant in turn (outboxd, the variant, polling) on a fresh relay process, slot
/// and topic; a point's `round` says which.
pub async fn latency_phase(
    w: &mut World,
    o: &Opts,
    cfg: &RunCfg,
    rates: &[Load],
    consumer_at: &[Load],
) -> Result<(Vec<LatencyPoint>, Vec<LatencyPoint>)> {
    let (mut points, mut with_consumer) = (vec![], vec![]);
    let mut relays = vec![Contestant::Outboxd];
    if o.has_variant() {
        relays.push(Contestant::OutboxdVariant);
    }
    let rounds = o.latency_runs.max(1);
    for round in 1..=rounds {
        // Slots and topics named by round, so no round reuses another's (one round: the
        // names of a single run).
        let name = (rounds > 1).then(|| {
            log(format!("latency round {round} of {rounds}"));
            format!("r{round}")
        });
        let mut got = vec![];
        for &k in &relays {
            got.push(latency_relay(w, o, cfg, k, name.clone(), rates, consumer_at).await?);
        }
        if !o.skip_polling {
            got.push(latency_polling(w, o, cfg, name.as_deref(), rates, consumer_at).await?);
        }
        for (mut p, mut c) in got {
            for x in p.iter_mut().chain(c.iter_mut()) {
                x.round = round;
            }
            points.extend(p);
            with_consumer.extend(c);
        }
    }
    Ok((points, with_consumer))
}

async fn latency_polling(
    w: &mut World,
    o: &Opts,
    cfg: &RunCfg,
    round: Option<&str>,
    rates: &[Load],
    consumer_at: &[Load],
) -> Result<(Vec<LatencyPoint>, Vec<LatencyPoint>)> {
    let shape = o.shape(o.tx_sizes[0]);
    let topic = format!("poll.lat{}.{AGG_TYPE}", round.unwrap_or_default());
    w.create_topics(std::slice::from_ref(&topic), o.rows.partitions)
        .await?;
    w.sql()
        .await?
        .batch_execute("TRUNCATE outbox_poll RESTART IDENTITY")
        .await?;
    let mut live = PollingLive::start(w, &topic, cfg)?;
    let warm = latency::open_loop(w, "outbox_poll", Some(2_000.0), 0.25, shape, 1).await?;
    live.collect(warm.first_version, warm.events, Duration::from_secs(30));
    let backend = live.backend_pid.load(std::sync::atomic::Ordering::Relaxed);
    let pids = [
        Some(live.pid),
        (backend > 0).then_some(backend),
        w.broker_pid,
    ];
    // First, as for the relays.
    let mut with_consumer = vec![];
    for &load in consumer_at {
        let c = LiveConsumer::start(&w.bootstrap(), &topic)?;
        let (p, written) = polling_point(w, o, &mut live, &pids, load).await?;
        with_consumer.push(consumer_view(p, c, &written)?);
    }
    let mut points = vec![];
    for &load in rates {
        let (p, _) = polling_point(w, o, &mut live, &pids, load).await?;
        let saturated = p.saturated;
        points.push(p);
        if saturated {
            break;
        }
    }
    live.stop()?;
    Ok((points, with_consumer))
}

/// Adds what the consumer read of the point's events.
fn consumer_view(mut p: LatencyPoint, c: LiveConsumer, written: &Written) -> Result<LatencyPoint> {
    p.consumer_view = Some(c.finish(written)?);
    log(p.consumer_line());
    Ok(p)
}

async fn polling_point(
    w: &mut World,
    o: &Opts,
    live: &mut PollingLive,
    pids: &[Option<u32>; 3],
    (rate, fraction): Load,
) -> Result<(LatencyPoint, Written)> {
    let shape = o.shape(o.tx_sizes[0]);
    let cpu0 = CpuSnap::take(pids);
    let written = latency::open_loop(
        w,
        "outbox_poll",
        Some(rate),
        o.latency_secs,
        shape,
        o.writers,
    )
    .await?;
    let (lat, missing) = live.collect(
        written.first_version,
        written.events,
        Duration::from_secs(30),
    );
    let mut p = LatencyPoint::new(Contestant::Polling, rate, fraction, &written, lat, missing);
    let cpu = cpu0.delta(&CpuSnap::take(pids));
    // The polling relay's backend stands where the walsender stands for outboxd.
    p.cpu = LiveCpu::of(&written, cpu[0], cpu[1], cpu[2]);
    log(p.line());
    Ok((p, written))
}

/// The TLS-to-Kafka comparison's live point: per round, one relay process through the plain
/// proxy and one through the TLS proxy (taking turns going first), each at `load` after its
/// warm-up.
pub async fn kafka_tls_points(
    w: &mut World,
    o: &Opts,
    cfg: &RunCfg,
    load: Load,
) -> Result<Vec<LatencyPoint>> {
    let mut out = vec![];
    for r in 1..=o.runs {
        let mut pair = [Contestant::OutboxdViaProxy, Contestant::OutboxdViaTls];
        if r.is_multiple_of(2) {
            pair.reverse();
        }
        for k in pair {
            let (p, _) = latency_relay(w, o, cfg, k, Some(r.to_string()), &[load], &[]).await?;
            out.extend(p);
        }
    }
    Ok(out)
}

/// What a relay's live points need of a bench's options (`run`'s [`Opts::live_plan`], or
/// another bench's own), so every bench measures a live point the same way.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LivePlan {
    /// The rows the writers commit (its transaction size too).
    pub shape: Shape,
    /// Partitions of the relay's topic.
    pub partitions: i32,
    /// Seconds of writing per point.
    pub secs: f64,
    /// Writer connections.
    pub writers: usize,
    /// Period of the confirmed-LSN sampler.
    pub confirm_poll_ms: u64,
}

impl Opts {
    /// The latency phase's plan: the first transaction size, `--latency-secs`, `--writers`.
    pub(crate) fn live_plan(&self) -> LivePlan {
        LivePlan {
            shape: self.shape(self.tx_sizes[0]),
            partitions: self.rows.partitions,
            secs: self.latency_secs,
            writers: self.writers,
            confirm_poll_ms: self.confirm_poll_ms,
        }
    }
}

/// What one relay process's points share.
pub(crate) struct RelayRun<'a> {
    pub kind: Contestant,
    pub sql: &'a tokio_postgres::Client,
    pub slot: &'a str,
    metrics_port: u16,
    pids: [Option<u32>; 3],
    proxy_tid: Option<u32>,
}

/// A relay process on a fresh slot, warmed up: what its points and its end need.
pub(crate) struct Started {
    pub slot: String,
    /// The relay's config file (other outboxd commands may use it).
    pub config: std::path::PathBuf,
    sql: tokio_postgres::Client,
    pid: u32,
    walsender: Option<u32>,
    metrics_port: u16,
    topic: String,
    bootstrap: String,
    broker_pid: Option<u32>,
    proxy_tid: Option<u32>,
    first: i64,
    pub total: u64,
}

impl Started {
    /// The relay's `/metrics` port (OUTBOXD_METRICS_LISTEN), for figures beyond commit→ack.
    pub fn metrics_port(&self) -> u16 {
        self.metrics_port
    }

    pub fn run(&self, kind: Contestant) -> RelayRun<'_> {
        RelayRun {
            kind,
            sql: &self.sql,
            slot: &self.slot,
            metrics_port: self.metrics_port,
            pids: [Some(self.pid), self.walsender, self.broker_pid],
            proxy_tid: self.proxy_tid,
        }
    }
}

/// Starts one relay process (fresh slot and topic) and warms it up. `round` numbers the slot
/// and topic when a contestant gets more than one process.
pub(crate) async fn start_relay(
    w: &mut World,
    plan: &LivePlan,
    cfg: &RunCfg,
    kind: Contestant,
    round: Option<String>,
) -> Result<Started> {
    let shape = plan.shape;
    let r = round.unwrap_or_default();
    let slot = format!("{}_lat{r}", kind.tag());
    let topic = format!("{}.lat{r}.{AGG_TYPE}", kind.tag());
    let sink = w.sink(kind)?;
    w.create_slot(&slot).await?;
    world::create_topics_at(
        &sink.bootstrap,
        std::slice::from_ref(&topic),
        plan.partitions,
    )
    .await?;
    let sql = w.sql().await?;
    let log_path = w.dir.path().join(format!("{slot}.log"));
    let tpl = format!("{}.lat{r}.{{aggregate_type}}", kind.tag());
    let mut cmd = contest::slot_command(w, kind, &slot, 0, &tpl, cfg)?;
    // The relay's own commit→ack histogram (see `scrape`): production runs with metrics on.
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    cmd.env(
        "OUTBOXD_METRICS_LISTEN",
        format!("127.0.0.1:{metrics_port}"),
    );
    let pid = contest::spawn(&mut cmd, &log_path)?;
    contest::wait_active(&sql, &slot, pid, &log_path).await?;
    let walsender = world::slot_state(&sql, &slot).await?.0.map(|p| p as u32);
    // Warm-up: the relay's first delivery pays for broker metadata and the producer id
    // (about a second on tansu); that is start-up, not commit→ack latency.
    let warm = latency::open_loop(w, "outbox", Some(2_000.0), 0.25, shape, 1).await?;
    let warm_lsn = warm.commits.iter().map(|c| c.lsn).max().unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while world::slot_state(&sql, &slot).await?.1 < warm_lsn && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(Started {
        config: w.dir.path().join(format!("{slot}.toml")),
        slot,
        sql,
        pid,
        walsender,
        metrics_port,
        topic,
        bootstrap: sink.bootstrap.clone(),
        broker_pid: sink.broker_pid,
        proxy_tid: sink.proxy_tid,
        first: warm.first_version,
        total: warm.events,
    })
}

/// Stops the relay, drops its slot and verifies its topic holds every event written (the
/// verdict goes on the last of `points`; RSS on all points).
pub(crate) async fn finish_relay(
    w: &mut World,
    kind: Contestant,
    s: Started,
    points: &mut [LatencyPoint],
    others: &mut [LatencyPoint],
) -> Result<()> {
    let rss = crate::procstat::peak_rss_kib(s.pid);
    crate::procstat::terminate(s.pid, Duration::from_secs(30))?;
    w.drop_slot(&s.slot).await?;
    for p in points.iter_mut().chain(others.iter_mut()) {
        p.peak_rss_kib = rss;
    }
    let v = verify_topic(
        &s.bootstrap,
        &s.topic,
        s.first,
        s.total,
        verify_timeout(s.total),
    )?;
    // Concurrent writers commit versions out of order, so only completeness is checked.
    if v.distinct != v.expected {
        bail!("{} latency run failed verification: {v:?}", kind.label());
    }
    if let Some(last) = points.last_mut() {
        last.verified = Some(v);
    }
    Ok(())
}

/// One relay process for all offered loads, after a warm-up.
async fn latency_relay(
    w: &mut World,
    o: &Opts,
    cfg: &RunCfg,
    kind: Contestant,
    round: Option<String>,
    rates: &[Load],
    consumer_at: &[Load],
) -> Result<(Vec<LatencyPoint>, Vec<LatencyPoint>)> {
    let plan = o.live_plan();
    let mut s = start_relay(w, &plan, cfg, kind, round).await?;
    // The consumer point comes first, while the topic is short: tansu's fetches (memory
    // storage) cost more the longer the topic, which would charge the broker, not the relay.
    let mut with_consumer = vec![];
    for &load in consumer_at {
        let c = LiveConsumer::start(&s.bootstrap, &s.topic)?;
        let (p, written) = relay_point(w, &plan, &s.run(kind), load).await?;
        s.total += written.events;
        with_consumer.push(consumer_view(p, c, &written)?);
    }
    let mut points = vec![];
    for &load in rates {
        let (p, written) = relay_point(w, &plan, &s.run(kind), load).await?;
        s.total += written.events;
        let saturated = p.saturated;
        points.push(p);
        if saturated {
            break;
        }
    }
    finish_relay(w, kind, s, &mut points, &mut with_consumer).await?;
    Ok((points, with_consumer))
}

pub(crate) async fn relay_point(
    w: &mut World,
    plan: &LivePlan,
    r: &RelayRun<'_>,
    (rate, fraction): Load,
) -> Result<(LatencyPoint, Written)> {
    let hist0 = scrape::commit_to_ack(r.metrics_port)?;
    let cpu0 = CpuSnap::take(&r.pids);
    let threads0 = std::env::var_os("BENCH_THREADS")
        .and(r.pids[0])
        .map(procstat::thread_snaps);
    let proxy0 = r.proxy_tid.and_then(procstat::thread_cpu_secs);
    let poller =
        ConfirmPoller::start(w, r.slot, Duration::from_millis(plan.confirm_poll_ms)).await?;
    let written =
        latency::open_loop(w, "outbox", Some(rate), plan.secs, plan.shape, plan.writers).await?;
    let target = written.commits.iter().map(|c| c.lsn).max().unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while world::slot_state(r.sql, r.slot).await?.1 < target && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let samples = poller.finish().await?;
    let cpu = cpu0.delta(&CpuSnap::take(&r.pids));
    if let (Some(t0), Some(pid)) = (threads0, r.pids[0]) {
        let t1 = procstat::thread_snaps(pid);
        let per = procstat::threads_per_event(&t0, &t1, written.events);
        log(format!(
            "{} at {rate:.0} ev/s, per event:\n{per}",
            r.kind.label()
        ));
    }
    let proxy1 = r.proxy_tid.and_then(procstat::thread_cpu_secs);
    let relay_view = scrape::commit_to_ack(r.metrics_port)?.since(&hist0);
    let (lat, unacked) = latency::slot_latencies(&written.commits, &samples);
    if let Ok(path) = std::env::var("BENCH_DUMP_LATENCY") {
        latency::dump(&path, &written.commits, &samples)?;
    }
    let mut p = LatencyPoint::new(r.kind, rate, fraction, &written, lat, unacked);
    p.relay_view = Some(relay_view);
    p.cpu = LiveCpu::of(&written, cpu[0], cpu[1], cpu[2]);
    p.cpu.proxy = proxy0
        .zip(proxy1)
        .filter(|_| written.events > 0)
        .map(|(a, b)| (b - a) * 1e6 / written.events as f64);
    log(p.line());
    Ok((p, written))
}
