//! `outboxd-bench mqbridge` — outboxd against mq-bridge at light load, end to end (issue 28):
//! commit → first read by a consumer.
//!
//! One Postgres and one broker (the bench's [`World`]). Each relay reads its own outbox table
//! through its own publication, slot and topic: outboxd `public.outbox` (`outbox_pub`),
//! mq-bridge `public.outbox_mqb` (`mqb_pub`, the same columns and indexes). Both run as their
//! own process with their defaults:
//! - **outboxd**: the bench's relay binary with the bench's relay config minus every tuning knob
//!   (no `status_interval_ms`, no producer settings; metrics off, its default);
//! - **mq-bridge**: its CLI (`mqb`, crates.io `mq-bridge-app`, installed by
//!   `scripts/mqbridge.sh`) running one route written as its docs' "Postgres CDC example" with a
//!   Kafka output and nothing else (see [`mqb_yaml`]); its metrics endpoint stays on, its
//!   default, on a free port instead of 9090.
//!
//! Per run and relay (the order alternates between runs): a fresh slot (made by the bench, so
//! it exists before the first row for both) and topic (`--partitions`, made by the bench), the
//! relay started, a warm-up that must reach the consumer, then each offered load in turn:
//! `bench_paced` writers (transactions of `--tx-size` rows, open loop) for `--secs` with a
//! [`LiveConsumer`] assigned every partition at its end, reading with `fetch.wait.max.ms = 10`
//! (what a latency-sensitive application sets; librdkafka's default of 500 ms would dominate
//! every figure). An event's latency is the moment the consumer's poll returned it minus the
//! row's `created_at` (`clock_timestamp()` at the INSERT, a fraction of a millisecond before
//! the COMMIT returns), cut to whole milliseconds for both relays (see [`crate::consume`]):
//! outboxd carries it as the record timestamp, mq-bridge in the row it sends as JSON. CPU of
//! the relay process, its walsender and the broker over the point; missing and duplicate
//! events as the consumer saw them.

pub mod report;

use crate::bench::log;
use crate::consume::{LiveConsumer, Stamp};
use crate::contest::{self, Contestant};
use crate::latency;
use crate::procstat::{self, CpuSnap};
use crate::tables::{in_turn, OutOpts};
use crate::world::{PacedOpts, World, AGG_TYPE};
use anyhow::{bail, ensure, Context, Result};
use report::{MqbReport, MqbRun, Relay};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    /// Offered loads (events/s), each measured for both relays.
    #[arg(long, value_delimiter = ',', default_value = "300,900,3000")]
    pub rates: Vec<f64>,
    /// Each run starts each relay once (taking turns going first) for every load.
    #[command(flatten)]
    pub load: PacedOpts,
    /// mq-bridge's CLI, `mqb` (install it with `scripts/mqbridge.sh`).
    #[arg(long, default_value = ".dev/mqb/bin/mqb")]
    pub mqb_bin: PathBuf,
    #[command(flatten)]
    pub out: OutOpts,
}

/// mq-bridge's outbox table: outboxd's columns, keys and indexes, and a publication as its
/// docs write one (`CREATE PUBLICATION … FOR TABLE …`).
const MQB_SQL: &str = "CREATE TABLE outbox_mqb (LIKE outbox INCLUDING ALL);
ALTER TABLE outbox_mqb SET (autovacuum_enabled = false);
CREATE PUBLICATION mqb_pub FOR TABLE outbox_mqb;";

/// Events of the warm-up (2,000 ev/s for 0.5 s): connections, broker metadata and producer ids
/// are start-up, not latency.
const WARM: (f64, f64) = (2_000.0, 0.5);

impl Relay {
    fn table(self) -> &'static str {
        match self {
            Self::Outboxd => "public.outbox",
            Self::MqBridge => "public.outbox_mqb",
        }
    }

    fn stamp(self) -> Stamp {
        match self {
            Self::Outboxd => Stamp::Record,
            Self::MqBridge => Stamp::RowJson,
        }
    }
}

/// The binaries of both relays.
struct Bins {
    outboxd: PathBuf,
    mqb: PathBuf,
}

pub async fn run(o: Opts, command: String) -> Result<MqbReport> {
    let l = &o.load;
    if o.rates.is_empty() || o.rates.iter().any(|r| *r <= 0.0) || l.runs == 0 || l.secs <= 0.0 {
        bail!("--rates (each > 0), --secs and --runs must be non-empty/positive");
    }
    let bins = Bins {
        outboxd: o.out.relay_bin()?,
        mqb: mqb_bin(&o.mqb_bin)?,
    };
    let mqb_version = mqb_version(&bins.mqb)?;
    let machine = procstat::machine();
    let started = chrono::Local::now();
    log(format!("{mqb_version}; starting postgres and broker"));
    let mut w = World::start(false).await?;
    w.sql().await?.batch_execute(MQB_SQL).await?;
    let mut report = MqbReport {
        command,
        started_at: started.to_rfc3339(),
        machine,
        postgres: w.server_version().await?,
        mqb_version,
        mqb_config: redact(&w, &mqb_yaml(&w, "<slot>", "<topic>")),
        outboxd_config: redact(&w, &outboxd_config(&w, "<slot>", "<topic>")?),
        load: o.load.clone(),
        points: vec![],
        finished_in_s: 0.0,
    };
    let t_all = Instant::now();
    for r in 1..=o.load.runs {
        for relay in in_turn(r, [Relay::Outboxd, Relay::MqBridge]) {
            let p = Proc::start(&mut w, &o, &bins, relay, r).await?;
            let mut points = vec![];
            for &rate in &o.rates {
                let pt = p.point(&mut w, &o, r, rate).await?;
                log(pt.line());
                points.push(pt);
            }
            let rss = p.stop(&w).await?;
            for pt in &mut points {
                pt.peak_rss_kib = rss;
            }
            report.points.extend(points);
        }
    }
    report.finished_in_s = t_all.elapsed().as_secs_f64();
    Ok(report)
}

/// `--mqb-bin` as an absolute path (the relay runs in the bench's directory), or why not.
fn mqb_bin(p: &Path) -> Result<PathBuf> {
    if !p.is_file() {
        bail!(
            "mq-bridge's CLI not found at {}: install it with scripts/mqbridge.sh (optional, \
             not part of CI: it builds mq-bridge-app from crates.io, tens of minutes on 2 cores) \
             or pass --mqb-bin",
            p.display()
        );
    }
    p.canonicalize().with_context(|| p.display().to_string())
}

/// What `mqb --version` says (`mq-bridge-app 1.3.0`).
fn mqb_version(bin: &Path) -> Result<String> {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .with_context(|| format!("run {} --version", bin.display()))?;
    if !out.status.success() {
        bail!(
            "{} --version failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The config text with the database password masked (for the report).
fn redact(w: &World, config: &str) -> String {
    config.replace(w.password(), "***")
}

/// outboxd's config at its defaults: the bench's relay config (its slot, publication, table,
/// broker, plain text to Postgres) without the short `status_interval_ms` the other benches'
/// confirmed-LSN stopwatches need (it paces the feedback to Postgres, not delivery).
fn outboxd_config(w: &World, slot: &str, topic_template: &str) -> Result<String> {
    const MS: u64 = 10;
    let sink = w.sink(Contestant::Outboxd)?;
    let toml = contest::outboxd_toml(w, &sink, slot, topic_template, MS);
    let line = format!("status_interval_ms = {MS}\n");
    ensure!(toml.contains(&line), "the relay config has no {line:?}");
    Ok(toml.replace(&line, ""))
}

/// mq-bridge's route: its docs' "Postgres CDC example" (`url`, `publication`, `slot_name`;
/// the slot is used when it exists, else created) with a Kafka output (`url`, `topic`), every
/// other setting at its default: the app's route defaults (concurrency 4, batch size 1024),
/// `postgres_cdc`'s (`status_interval_ms` 10 s) and its Kafka producer's (`linger.ms` 1,
/// `acks` all, idempotence, lz4, each send awaited before the source is acknowledged).
fn mqb_yaml(w: &World, slot: &str, topic: &str) -> String {
    format!(
        r#"outbox_to_kafka:
  input:
    postgres_cdc:
      url: "{dsn}"
      publication: "mqb_pub"
      slot_name: "{slot}"
  output:
    kafka:
      url: "{bootstrap}"
      topic: "{topic}"
"#,
        dsn = w.dsn(),
        bootstrap = w.bootstrap(),
    )
}

/// One relay process of one run, on its own slot and topic.
struct Proc {
    relay: Relay,
    slot: String,
    topic: String,
    pid: u32,
    walsender: u32,
    log: PathBuf,
}

impl Proc {
    /// Creates the slot and topic, starts the relay and warms it up.
    async fn start(w: &mut World, o: &Opts, bins: &Bins, relay: Relay, r: usize) -> Result<Self> {
        let tag = relay.tag();
        let slot = format!("cmp_{tag}_r{r}");
        let topic = format!("cmp.{tag}.r{r}.{AGG_TYPE}");
        w.create_topics(std::slice::from_ref(&topic), o.load.rows.partitions)
            .await?;
        w.create_slot(&slot).await?;
        let dir = w.dir.path();
        let log = dir.join(format!("{slot}.log"));
        let mut cmd = match relay {
            Relay::Outboxd => {
                let config = dir.join(format!("{slot}.toml"));
                let tpl = topic.replace(AGG_TYPE, "{aggregate_type}");
                std::fs::write(&config, outboxd_config(w, &slot, &tpl)?)?;
                let mut c = Command::new(&bins.outboxd);
                c.arg("run").arg("--config").arg(config);
                c
            }
            Relay::MqBridge => {
                let config = dir.join(format!("{slot}.yaml"));
                std::fs::write(&config, mqb_yaml(w, &slot, &topic))?;
                let metrics = std::net::TcpListener::bind("127.0.0.1:0")?
                    .local_addr()?
                    .port();
                let mut c = Command::new(&bins.mqb);
                c.arg("--config")
                    .arg(config)
                    .arg("--no-ui")
                    .arg("--metrics-addr")
                    .arg(format!("127.0.0.1:{metrics}"))
                    .env("NO_COLOR", "1")
                    // Its `.env` lookup and any state it keeps stay in the bench's directory.
                    .current_dir(dir);
                c
            }
        };
        let pid = contest::spawn(&mut cmd, &log)?;
        let walsender = contest::wait_active(&w.sql().await?, &slot, pid, &log).await?;
        let p = Self {
            relay,
            slot,
            topic,
            pid,
            walsender,
            log,
        };
        let c = LiveConsumer::start_as(&w.bootstrap(), &p.topic, relay.stamp())?;
        let written = latency::open_loop_into(
            w,
            &[relay.table().to_string()],
            Some(WARM.0),
            WARM.1,
            o.load.shape(),
            1,
        )
        .await?;
        let v = c.finish(&written)?;
        if v.missing > 0 {
            bail!(
                "{}: {} of {} warm-up events never reached the consumer: {}",
                relay.label(),
                v.missing,
                written.events,
                procstat::tail(&p.log, 20)
            );
        }
        Ok(p)
    }

    /// One offered load, measured from the writers' first commit until the consumer read the
    /// last event (or gave up after 30 s).
    async fn point(&self, w: &mut World, o: &Opts, r: usize, rate: f64) -> Result<MqbRun> {
        let c = LiveConsumer::start_as(&w.bootstrap(), &self.topic, self.relay.stamp())?;
        let pids = [Some(self.pid), Some(self.walsender), w.broker_pid];
        let cpu0 = CpuSnap::take(&pids);
        let written = latency::open_loop_into(
            w,
            &[self.relay.table().to_string()],
            Some(rate),
            o.load.secs,
            o.load.shape(),
            o.load.writers,
        )
        .await?;
        let consumer = c.finish(&written)?;
        let cpu = cpu0.delta(&CpuSnap::take(&pids));
        if let Some(e) = procstat::try_reap(self.pid)? {
            bail!(
                "{} died ({e:?}): {}",
                self.relay.label(),
                procstat::tail(&self.log, 30)
            );
        }
        Ok(MqbRun {
            relay: self.relay,
            run: r,
            offered: rate,
            events: written.events,
            rate: written.achieved_rate,
            consumer,
            relay_cpu_s: cpu[0],
            walsender_cpu_s: cpu[1],
            broker_cpu_s: cpu[2],
            writer_cpu_s: written.writer_cpu_s,
            peak_rss_kib: None,
        })
    }

    /// Stops the relay (SIGTERM) and drops its slot; returns its peak RSS.
    async fn stop(self, w: &World) -> Result<Option<u64>> {
        let rss = procstat::peak_rss_kib(self.pid);
        let e = procstat::terminate(self.pid, Duration::from_secs(30))?;
        match self.relay {
            Relay::Outboxd if !e.success => bail!(
                "outboxd exited with an error on SIGTERM: {}",
                procstat::tail(&self.log, 20)
            ),
            // mq-bridge 1.3.0 logs "Shutdown complete" on SIGTERM and exits non-zero all the
            // same: not a failure of the point (whose events the consumer already counted).
            _ => {}
        }
        w.drop_slot(&self.slot).await?;
        Ok(rss)
    }
}
