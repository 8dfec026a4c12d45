//! The results: medians per contestant, the latency points, the targets of issue 7 checked as
//! ratios within this one run, Markdown for docs/benchmarks.md and JSON for tooling.

pub mod cleanup;
pub mod cloudevents;
pub mod kafka_tls;
pub mod rounds;

use crate::contest::{Contestant, RunResult};
use crate::latency::{percentiles, Percentiles, Written};
use crate::procstat::Machine;
use std::fmt::Write as _;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub command: String,
    pub started_at: String,
    pub machine: Machine,
    pub postgres: String,
    pub pg_settings: Vec<String>,
    pub payload_bytes: usize,
    pub aggregates: usize,
    pub partitions: i32,
    pub status_ms: u64,
    pub scenarios: Vec<Scenario>,
    pub latency_tx_size: usize,
    /// The ceiling rate the latency phase's offered loads are fractions of.
    pub latency_ceiling: f64,
    /// The sweep's points, every round's (`round` tells which).
    pub latency: Vec<LatencyPoint>,
    /// Points measured with a consumer reading the topic (`--consumer-at`); not in the sweep.
    #[serde(default)]
    pub consumer_points: Vec<LatencyPoint>,
    /// Rounds of the latency phase (`--latency-runs`): the tables show medians over them.
    #[serde(default = "one")]
    pub latency_runs: usize,
    pub write_capacity: Option<WriteCapacity>,
    /// What TLS to Kafka costs (its throughput runs are in the scenario of its `tx_size`).
    #[serde(default)]
    pub kafka_tls: Option<crate::report::kafka_tls::KafkaTlsReport>,
    /// What cleanup costs live delivery.
    #[serde(default)]
    pub cleanup: Option<crate::report::cleanup::CleanupImpact>,
    pub big_txn: Vec<RunResult>,
    pub finished_in_s: f64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Scenario {
    pub tx_size: usize,
    pub events: u64,
    pub runs: Vec<RunResult>,
}

fn one() -> usize {
    1
}

pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Medians of one contestant's runs.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub runs: usize,
    pub rate: f64,
    pub relay_us: Option<f64>,
    pub pg_us: Option<f64>,
    pub broker_us: Option<f64>,
    pub proxy_us: Option<f64>,
    pub rss_kib: Option<u64>,
    pub verified: bool,
}

impl Scenario {
    pub fn summary(&self, k: Contestant) -> Option<Summary> {
        let rs: Vec<&RunResult> = self.runs.iter().filter(|r| r.contestant == k).collect();
        if rs.is_empty() {
            return None;
        }
        let med = |f: &dyn Fn(&RunResult) -> Option<f64>| {
            median(rs.iter().filter_map(|r| f(r)).collect())
        };
        Some(Summary {
            runs: rs.len(),
            rate: med(&|r| Some(r.rate))?,
            relay_us: med(&|r| r.us_per_event(r.relay_cpu_s)),
            pg_us: med(&|r| r.us_per_event(r.pg_cpu_s)),
            broker_us: med(&|r| r.us_per_event(r.broker_cpu_s)),
            proxy_us: med(&|r| r.us_per_event(r.proxy_cpu_s)),
            rss_kib: rs.iter().filter_map(|r| r.peak_rss_kib).max(),
            verified: rs.iter().all(|r| r.verified.is_some_and(|v| v.ok())),
        })
    }

    /// The physical limit: the faster of the two ceiling readers (medians).
    pub fn ceiling_rate(&self) -> f64 {
        [Contestant::CeilingRecvlogical, Contestant::CeilingBare]
            .into_iter()
            .filter_map(|k| self.summary(k).map(|s| s.rate))
            .fold(0.0, f64::max)
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LatencyPoint {
    pub contestant: Contestant,
    pub target_rate: f64,
    pub fraction_of_ceiling: Option<f64>,
    /// The round of the latency phase (1-based) that measured the point.
    #[serde(default = "one")]
    pub round: usize,
    pub achieved_rate: f64,
    pub events: u64,
    pub latency: Percentiles,
    /// Events not acknowledged within 30 s after the writers stopped.
    pub unacked: u64,
    /// The contestant could not keep up (events left unacknowledged); higher loads skipped.
    pub saturated: bool,
    pub peak_rss_kib: Option<u64>,
    pub verified: Option<crate::verify::Verified>,
    /// The relay's own histogram over this point (outboxd only).
    pub relay_view: Option<crate::scrape::RelayView>,
    pub cpu: LiveCpu,
    /// Commit→consumer latency, for points measured with a consumer.
    #[serde(default)]
    pub consumer_view: Option<crate::consume::ConsumerView>,
}

/// The machine's live write capacity: the latency phase's writers, back to back, nothing else.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct WriteCapacity {
    pub writers: usize,
    pub rate: f64,
    pub writer_us_per_event: Option<f64>,
}

/// CPU µs per event of every process on the live path during one latency point.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct LiveCpu {
    pub writers: Option<f64>,
    pub walsender: Option<f64>,
    pub relay: Option<f64>,
    pub broker: Option<f64>,
    /// The bench's proxy thread between relay and broker (TLS-to-Kafka comparison only).
    #[serde(default)]
    pub proxy: Option<f64>,
}

impl LiveCpu {
    /// "writers / walsender / relay / broker", µs per event.
    pub(crate) fn cells(&self) -> String {
        format!(
            "{} / {} / {} / {}",
            opt(self.writers, 1),
            opt(self.walsender, 1),
            opt(self.relay, 1),
            opt(self.broker, 1)
        )
    }

    pub fn of(
        w: &Written,
        relay: Option<f64>,
        walsender: Option<f64>,
        broker: Option<f64>,
    ) -> Self {
        let per = |s: Option<f64>| {
            s.filter(|_| w.events > 0)
                .map(|s| s * 1e6 / w.events as f64)
        };
        Self {
            writers: per(Some(w.writer_cpu_s)),
            walsender: per(walsender),
            relay: per(relay),
            broker: per(broker),
            proxy: None,
        }
    }

    /// All four together: what one live event costs the machine.
    pub fn total(&self) -> Option<f64> {
        Some(self.writers? + self.walsender? + self.relay? + self.broker?)
    }
}

impl LatencyPoint {
    pub fn new(
        k: Contestant,
        rate: f64,
        fraction: Option<f64>,
        w: &Written,
        lat: Vec<f64>,
        unacked: u64,
    ) -> Self {
        let lat_max_ms = lat.iter().copied().fold(0.0, f64::max);
        Self {
            contestant: k,
            target_rate: rate,
            fraction_of_ceiling: fraction,
            round: 1,
            achieved_rate: w.achieved_rate,
            events: w.events,
            latency: percentiles(lat),
            unacked,
            // Falling behind: some event waited more than a second, or never got acked.
            saturated: unacked > 0 || lat_max_ms > 1000.0,
            peak_rss_kib: None,
            verified: None,
            relay_view: None,
            cpu: LiveCpu::default(),
            consumer_view: None,
        }
    }

    /// The first four cells of a latency row: contestant, offered, of ceiling, achieved.
    pub(crate) fn load_cells(&self) -> String {
        format!(
            "{} | {:.0} | {} | {:.0}",
            self.contestant.label(),
            self.target_rate,
            self.fraction_of_ceiling
                .map_or("–".into(), |f| format!("{:.1}%", f * 100.0)),
            self.achieved_rate
        )
    }

    pub fn consumer_line(&self) -> String {
        let c = self.consumer_view.unwrap_or_default();
        format!(
            "{}; commit→consumer p50 {:.1} ms p99 {:.1} ms max {:.1} ms ({} read, {} missing)",
            self.line(),
            c.latency.p50_ms,
            c.latency.p99_ms,
            c.latency.max_ms,
            c.read,
            c.missing
        )
    }

    pub fn line(&self) -> String {
        format!(
            "latency {:<22} offered {:>8.0} ev/s (achieved {:>8.0}): p50 {:>7.1} ms p99 {:>7.1} ms max {:>7.1} ms{}",
            self.contestant.label(),
            self.target_rate,
            self.achieved_rate,
            self.latency.p50_ms,
            self.latency.p99_ms,
            self.latency.max_ms,
            if self.saturated {
                format!("  SATURATED ({} unacked)", self.unacked)
            } else {
                String::new()
            }
        )
    }
}

pub(crate) fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("–".into(), |v| format!("{v:.prec$}"))
}

fn mib(k: Option<u64>) -> String {
    k.map_or("–".into(), |k| format!("{:.1}", k as f64 / 1024.0))
}

pub(crate) const ORDER: [Contestant; 10] = [
    Contestant::CeilingRecvlogical,
    Contestant::CeilingBare,
    Contestant::CeilingBareTls,
    Contestant::Outboxd,
    Contestant::OutboxdVariant,
    Contestant::OutboxdCeBinary,
    Contestant::OutboxdCeStructured,
    Contestant::OutboxdViaProxy,
    Contestant::OutboxdViaTls,
    Contestant::Polling,
];

/// One target of the issue, checked on this run's numbers.
pub struct Target {
    pub what: String,
    pub measured: String,
    pub met: bool,
    /// Not met because this machine cannot produce the condition (shown by `measured`).
    pub impossible: bool,
}

impl Report {
    pub fn targets(&self) -> Vec<Target> {
        let mut t = vec![];
        for k in [Contestant::Outboxd, Contestant::OutboxdVariant] {
            self.targets_of(k, &mut t);
        }
        self.cloudevents_targets(&mut t);
        t
    }

    fn targets_of(&self, k: Contestant, t: &mut Vec<Target>) {
        let who = k.label();
        for s in &self.scenarios {
            let ceil = s.ceiling_rate();
            let Some(ob) = s.summary(k) else { continue };
            t.push(Target {
                what: format!("{who} ≥ 90% of the ceiling (tx size {})", s.tx_size),
                measured: format!(
                    "{:.0}% ({:.0} / {:.0} ev/s)",
                    100.0 * ob.rate / ceil,
                    ob.rate,
                    ceil
                ),
                met: ob.rate >= 0.9 * ceil,
                impossible: false,
            });
            if let Some(p) = s.summary(Contestant::Polling) {
                t.push(Target {
                    what: format!("{who} ≥ 10× polling (tx size {})", s.tx_size),
                    measured: format!("{:.1}×", ob.rate / p.rate),
                    met: ob.rate >= 10.0 * p.rate,
                    // The ceiling itself below 10× polling: no single-slot reader gets there.
                    impossible: ceil < 10.0 * p.rate && ob.rate < 10.0 * p.rate,
                });
            }
            t.push(Target {
                what: format!("{who} peak RSS ≤ 64 MiB (tx size {})", s.tx_size),
                measured: format!("{} MiB", mib(ob.rss_kib)),
                met: ob.rss_kib.is_some_and(|k| k <= 64 * 1024),
                impossible: false,
            });
        }
        self.latency_targets(k, t);
        if let Some(b) = self.big_txn.iter().find(|r| r.contestant == k) {
            t.push(Target {
                what: format!("{who} peak RSS ≤ 64 MiB, one {}-row transaction", b.events),
                measured: format!("{} MiB", mib(b.peak_rss_kib)),
                met: b.peak_rss_kib.is_some_and(|k| k <= 64 * 1024),
                impossible: false,
            });
        }
    }

    pub fn markdown(&self) -> String {
        let mut m = String::new();
        let w = &mut m;
        let _ = writeln!(
            w,
            "Run {} ({:.0} s), `{}`\n",
            self.started_at, self.finished_in_s, self.command
        );
        let mc = &self.machine;
        let _ = writeln!(
            w,
            "Machine: {} × {} cores, {} GiB RAM, Linux {}; load average at start {}. {}; settings: {}. \
             Payload ≈ {} B, {} aggregates, {} partitions per topic, status interval {} ms.\n",
            mc.cpu_model,
            mc.cores,
            mc.mem_gib,
            mc.kernel,
            mc.load_avg_at_start,
            self.postgres.split(" on ").next().unwrap_or(&self.postgres),
            self.pg_settings.join(", "),
            self.payload_bytes,
            self.aggregates,
            self.partitions,
            self.status_ms
        );
        for s in &self.scenarios {
            let ceil = s.ceiling_rate();
            let _ = writeln!(
                w,
                "#### Throughput, transaction size {}, {} events per run\n",
                s.tx_size, s.events
            );
            let _ = writeln!(
                w,
                "| contestant | runs | events/s (median) | of ceiling | relay CPU µs/event | Postgres CPU µs/event | broker CPU µs/event | relay CPU s / 100k events | peak RSS MiB | verified |\n|---|---|---|---|---|---|---|---|---|---|"
            );
            for k in ORDER {
                let Some(x) = s.summary(k) else { continue };
                let _ = writeln!(
                    w,
                    "| {} | {} | {:.0} | {:.0}% | {} | {} | {} | {} | {} | {} |",
                    k.label(),
                    x.runs,
                    x.rate,
                    100.0 * x.rate / ceil,
                    opt(x.relay_us, 2),
                    opt(x.pg_us, 2),
                    opt(x.broker_us, 2),
                    opt(x.relay_us.map(|u| u / 10.0), 3),
                    mib(x.rss_kib),
                    match k {
                        Contestant::CeilingRecvlogical
                        | Contestant::CeilingBare
                        | Contestant::CeilingBareTls => "n/a",
                        _ if x.verified => "all events, in order",
                        _ => "NO",
                    }
                );
            }
            let _ = writeln!(w, "\nRuns (events/s): {}\n", runs_line(s));
        }
        self.cloudevents_markdown(w);
        self.latency_markdown(w);
        self.kafka_tls_markdown(w);
        self.cleanup_markdown(w);
        if !self.big_txn.is_empty() {
            let _ = writeln!(
                w,
                "#### One transaction of {} rows\n",
                self.big_txn[0].events
            );
            let _ = writeln!(w, "| contestant | events/s | relay CPU µs/event | walsender CPU µs/event | peak RSS MiB |\n|---|---|---|---|---|");
            for r in &self.big_txn {
                let _ = writeln!(
                    w,
                    "| {} | {:.0} | {} | {} | {} |",
                    r.contestant.label(),
                    r.rate,
                    opt(r.us_per_event(r.relay_cpu_s), 2),
                    opt(r.us_per_event(r.pg_cpu_s), 2),
                    mib(r.peak_rss_kib)
                );
            }
            let _ = writeln!(w);
        }
        let _ = writeln!(
            w,
            "#### Targets (ratios within this run)\n\n| target | measured | met |\n|---|---|---|"
        );
        for t in self.targets() {
            let _ = writeln!(
                w,
                "| {} | {} | {} |",
                t.what,
                t.measured,
                match (t.met, t.impossible) {
                    (true, _) => "yes",
                    (false, true) => "**no**: impossible on this machine",
                    (false, false) => "**no**",
                }
            );
        }
        m
    }
}

fn runs_line(s: &Scenario) -> String {
    ORDER
        .iter()
        .filter_map(|k| {
            let v: Vec<String> = s
                .runs
                .iter()
                .filter(|r| r.contestant == *k)
                .map(|r| format!("{:.0}", r.rate))
                .collect();
            (!v.is_empty()).then(|| format!("{} {}", k.label(), v.join(" / ")))
        })
        .collect::<Vec<_>>()
        .join("; ")
}
