//! The outboxd-against-mq-bridge results: every run as measured (JSON), medians per load and
//! relay, and the two side by side (Markdown for docs/benchmarks.md).

use crate::consume::ConsumerView;
use crate::procstat::Machine;
use crate::tables::report::{in_order, med, preamble};
use crate::world::PacedOpts;
use std::fmt::Write as _;

/// Who relays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Relay {
    Outboxd,
    MqBridge,
}

impl Relay {
    pub fn label(self) -> &'static str {
        match self {
            Self::Outboxd => "outboxd",
            Self::MqBridge => "mq-bridge",
        }
    }

    pub(super) fn tag(self) -> &'static str {
        match self {
            Self::Outboxd => "outboxd",
            Self::MqBridge => "mqb",
        }
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct MqbReport {
    pub command: String,
    pub started_at: String,
    pub machine: Machine,
    pub postgres: String,
    /// `mqb --version`.
    pub mqb_version: String,
    /// mq-bridge's route as run (password masked; slot and topic per run).
    pub mqb_config: String,
    /// outboxd's config as run (likewise).
    pub outboxd_config: String,
    #[serde(flatten)]
    pub load: PacedOpts,
    pub points: Vec<MqbRun>,
    pub finished_in_s: f64,
}

/// One relay at one offered load in one run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct MqbRun {
    pub relay: Relay,
    pub run: usize,
    /// Offered events/s.
    pub offered: f64,
    pub events: u64,
    /// Events/s the writers achieved.
    pub rate: f64,
    /// Commit (the row's `created_at`) → first read by the consumer.
    pub consumer: ConsumerView,
    pub relay_cpu_s: Option<f64>,
    pub walsender_cpu_s: Option<f64>,
    pub broker_cpu_s: Option<f64>,
    pub writer_cpu_s: f64,
    /// Peak RSS (`VmHWM`) of the relay process over its whole run.
    pub peak_rss_kib: Option<u64>,
}

impl MqbRun {
    fn us(&self, cpu: Option<f64>) -> f64 {
        cpu.map_or(f64::NAN, |c| c * 1e6 / self.events.max(1) as f64)
    }

    /// The progress line of one run.
    pub fn line(&self) -> String {
        let c = &self.consumer;
        format!(
            "{:>6.0} ev/s {:<9} run {}: achieved {:.0} ev/s, commit→consumer p50/p99/max \
             {} ms ({} read, {} missing, {} duplicates), relay {:.1} µs/ev, walsender {:.1} \
             µs/ev, broker {:.1} µs/ev",
            self.offered,
            self.relay.label(),
            self.run,
            self.rate,
            c.latency.cells(),
            c.read,
            c.missing,
            c.duplicates,
            self.us(self.relay_cpu_s),
            self.us(self.walsender_cpu_s),
            self.us(self.broker_cpu_s),
        )
    }
}

/// Medians over the runs of one (load, relay); missing and duplicates summed.
#[derive(Debug, Clone, Default)]
struct Row {
    runs: usize,
    rate: f64,
    p50: f64,
    p99: f64,
    max: f64,
    p99_each: Vec<f64>,
    read: u64,
    missing: u64,
    duplicates: u64,
    relay_us: f64,
    walsender_us: f64,
    broker_us: f64,
    rss_mib: f64,
}

fn row(points: &[MqbRun], offered: f64, relay: Relay) -> Option<Row> {
    let rs: Vec<&MqbRun> = points
        .iter()
        .filter(|p| p.offered == offered && p.relay == relay)
        .collect();
    if rs.is_empty() {
        return None;
    }
    let m = |f: &dyn Fn(&MqbRun) -> f64| med(rs.iter().map(|r| f(r)));
    let sum = |f: fn(&ConsumerView) -> u64| rs.iter().map(|r| f(&r.consumer)).sum();
    Some(Row {
        runs: rs.len(),
        rate: m(&|r| r.rate),
        p50: m(&|r| r.consumer.latency.p50_ms),
        p99: m(&|r| r.consumer.latency.p99_ms),
        max: m(&|r| r.consumer.latency.max_ms),
        p99_each: rs.iter().map(|r| r.consumer.latency.p99_ms).collect(),
        read: sum(|c| c.read),
        missing: sum(|c| c.missing),
        duplicates: sum(|c| c.duplicates),
        relay_us: m(&|r| r.us(r.relay_cpu_s)),
        walsender_us: m(&|r| r.us(r.walsender_cpu_s)),
        broker_us: m(&|r| r.us(r.broker_cpu_s)),
        rss_mib: m(&|r| r.peak_rss_kib.map_or(f64::NAN, |k| k as f64 / 1024.0)),
    })
}

impl MqbReport {
    /// Offered loads in the order they were run.
    fn loads(&self) -> Vec<f64> {
        in_order(self.points.iter().map(|p| p.offered))
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}; {}; finished in {:.0} s. {}. Medians of {} runs (each relay once per run, \
             taking turns going first); missing and duplicates are totals.\n",
            preamble(
                &self.command,
                &self.started_at,
                &self.machine,
                &self.postgres
            ),
            self.mqb_version,
            self.finished_in_s,
            self.load.describe(),
            self.load.runs,
        );
        let _ = writeln!(
            s,
            "Commit → consumer: the row's `created_at` (cut to whole ms) → the consumer's poll \
             returning the record (`fetch.wait.max.ms = 10`). CPU µs per event.\n\n\
             | offered ev/s | relay | achieved ev/s | commit→consumer p50 / p99 / max (ms) | \
             p99 of each run (ms) | read | missing | duplicates | relay µs/event | walsender \
             µs/event | broker µs/event | relay peak RSS (MiB) |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for load in self.loads() {
            for relay in [Relay::Outboxd, Relay::MqBridge] {
                let Some(r) = row(&self.points, load, relay) else {
                    continue;
                };
                let each: Vec<String> = r.p99_each.iter().map(|v| format!("{v:.1}")).collect();
                let _ = writeln!(
                    s,
                    "| {load:.0} | {} | {:.0} | {:.1} / {:.1} / {:.1} | {} | {} | {} | {} | \
                     {:.1} | {:.1} | {:.1} | {:.1} |",
                    relay.label(),
                    r.rate,
                    r.p50,
                    r.p99,
                    r.max,
                    each.join(", "),
                    r.read,
                    r.missing,
                    r.duplicates,
                    r.relay_us,
                    r.walsender_us,
                    r.broker_us,
                    r.rss_mib,
                );
            }
        }
        let _ = writeln!(
            s,
            "\noutboxd against mq-bridge (same load; negative: outboxd is faster):\n\n\
             | offered ev/s | runs | commit→consumer p50 outboxd / mq-bridge (ms) | p50 \
             difference (ms) | p99 outboxd / mq-bridge (ms) | p99 difference (ms) | relay CPU \
             per event outboxd / mq-bridge |\n|---|---|---|---|---|---|---|"
        );
        for load in self.loads() {
            let (Some(o), Some(q)) = (
                row(&self.points, load, Relay::Outboxd),
                row(&self.points, load, Relay::MqBridge),
            ) else {
                continue;
            };
            let _ = writeln!(
                s,
                "| {load:.0} | {} | {:.1} / {:.1} | {:+.1} | {:.1} / {:.1} | {:+.1} | {:.2}× |",
                o.runs.min(q.runs),
                o.p50,
                q.p50,
                o.p50 - q.p50,
                o.p99,
                q.p99,
                o.p99 - q.p99,
                o.relay_us / q.relay_us,
            );
        }
        let _ = writeln!(
            s,
            "\nmq-bridge's route (`{}`; password masked, slot and topic per run):\n\n```yaml\n{}```",
            self.mqb_version, self.mqb_config
        );
        s
    }
}
