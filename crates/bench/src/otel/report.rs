//! The tracing-cost results: every run as measured (JSON), medians per mode and the ratios to
//! "off" (Markdown for docs/benchmarks.md's "What tracing costs").

use crate::procstat::Machine;
use crate::report::{median, LatencyPoint};
use crate::verify::Verified;
use std::fmt::Write as _;

/// How a relay traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Mode {
    /// No endpoint configured (the rows still carry sampled `traceparent`s).
    Off,
    /// Every row sampled, the receiver up.
    All,
    /// Every 100th row sampled (`-01`), the rest `-00`.
    OnePercent,
    /// Every row sampled, the endpoint a closed port.
    ReceiverDown,
}

impl Mode {
    pub const BACKLOG: [Mode; 4] = [Mode::Off, Mode::All, Mode::OnePercent, Mode::ReceiverDown];
    pub const LIVE: [Mode; 3] = [Mode::Off, Mode::All, Mode::ReceiverDown];

    pub fn label(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::All => "all sampled",
            Self::OnePercent => "1 % sampled",
            Self::ReceiverDown => "all sampled, receiver down",
        }
    }

    /// Slot and topic names.
    pub fn tag(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::All => "all",
            Self::OnePercent => "pct1",
            Self::ReceiverDown => "down",
        }
    }

    /// Every how many rows one is sampled.
    pub fn every(self) -> u32 {
        match self {
            Self::OnePercent => 100,
            _ => 1,
        }
    }

    /// Export configured at all.
    pub fn traced(self) -> bool {
        self != Self::Off
    }

    /// The endpoint's port: the receiver's (`up`), a closed one (`down`), or none.
    pub fn receiver(self, up: u16, down: u16) -> Option<u16> {
        match self {
            Self::Off => None,
            Self::ReceiverDown => Some(down),
            _ => Some(up),
        }
    }
}

/// What became of a relay's sampled spans.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Spans {
    /// Rows with a sampled `traceparent` the relay delivered (warm-up rows included).
    pub sampled: u64,
    /// Spans the receiver got from this relay.
    pub received: u64,
    /// `outboxd_trace_spans_dropped_total`, read before the relay stopped.
    pub dropped: u64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct OtelReport {
    pub command: String,
    pub started_at: String,
    pub machine: Machine,
    pub load_avg_at_end: String,
    pub postgres: String,
    pub events: u64,
    pub tx_size: usize,
    pub payload_bytes: usize,
    pub partitions: i32,
    pub runs: usize,
    pub live_rate: f64,
    pub live_secs: f64,
    pub writers: usize,
    pub status_ms: u64,
    /// `--telemetry-env`: a tuned exporter when not empty.
    pub telemetry_env: Vec<String>,
    pub backlog: Vec<BacklogRun>,
    pub live: Vec<LiveRun>,
    pub finished_in_s: f64,
}

/// One backlog drain.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BacklogRun {
    pub mode: Mode,
    pub run: usize,
    pub events: u64,
    pub secs: f64,
    pub rate: f64,
    pub relay_cpu_s: Option<f64>,
    pub walsender_cpu_s: Option<f64>,
    pub peak_rss_kib: Option<u64>,
    pub spans: Spans,
    pub verified: Verified,
}

impl BacklogRun {
    fn us_per_event(&self, cpu: Option<f64>) -> Option<f64> {
        cpu.map(|c| c * 1e6 / self.events.max(1) as f64)
    }

    pub fn line(&self) -> String {
        format!(
            "otel backlog run {} {:<27}: {:>8.0} ev/s, relay {} µs/ev, spans {} of {} received, \
             {} dropped",
            self.run,
            self.mode.label(),
            self.rate,
            fmt1(self.us_per_event(self.relay_cpu_s)),
            self.spans.received,
            self.spans.sampled,
            self.spans.dropped
        )
    }
}

/// One live point.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LiveRun {
    pub mode: Mode,
    pub run: usize,
    pub point: LatencyPoint,
    pub spans: Spans,
}

impl LiveRun {
    /// Events never acknowledged or not on the topic.
    pub fn missing(&self) -> u64 {
        let v = self.point.verified.unwrap_or_default();
        self.point.unacked + v.expected.saturating_sub(v.distinct)
    }

    pub fn line(&self) -> String {
        let p = &self.point;
        format!(
            "otel live run {} {:<27}: {:.0} ev/s, commit→ack p50 {:.1} / p99 {:.1} ms, {} missing, \
             spans {} of {} received, {} dropped",
            self.run,
            self.mode.label(),
            p.achieved_rate,
            p.latency.p50_ms,
            p.latency.p99_ms,
            self.missing(),
            self.spans.received,
            self.spans.sampled,
            self.spans.dropped
        )
    }
}

/// The 1, 5 and 15 minute load averages of a `/proc/loadavg` line.
fn load3(loadavg: &str) -> String {
    loadavg
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn fmt1(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.1}"))
}

/// "97%" of `off`, or "–".
fn ratio(v: Option<f64>, off: Option<f64>) -> String {
    match (v, off) {
        (Some(v), Some(o)) if o > 0.0 => format!("{:.0}%", 100.0 * v / o),
        _ => "–".into(),
    }
}

fn med<T>(runs: &[&T], f: impl Fn(&T) -> Option<f64>) -> Option<f64> {
    median(runs.iter().filter_map(|r| f(r)).collect())
}

impl OtelReport {
    fn backlog_of(&self, m: Mode) -> Vec<&BacklogRun> {
        self.backlog.iter().filter(|r| r.mode == m).collect()
    }

    fn live_of(&self, m: Mode) -> Vec<&LiveRun> {
        self.live.iter().filter(|r| r.mode == m).collect()
    }

    pub fn markdown(&self) -> String {
        let mut w = String::new();
        let exporter = if self.telemetry_env.is_empty() {
            "the exporter's defaults (queue 65,536 spans, batches of 512, 1 s schedule delay)"
                .to_string()
        } else {
            format!("a **tuned** exporter: {}", self.telemetry_env.join(" "))
        };
        let _ = writeln!(
            w,
            "Tracing off / on, relay processes of this build, {exporter}; {} run(s) per mode, the \
             modes in turn (the order rotates between runs), each on a fresh slot and topic.\n",
            self.runs
        );
        self.backlog_markdown(&mut w);
        self.live_markdown(&mut w);
        let m = &self.machine;
        let _ = writeln!(
            w,
            "Machine: {} × {}, {} GiB, kernel {}; load average at start {} and at the end {}; \
             {}; the whole run took {:.0} s.\n\nCommand: `{}`",
            m.cores,
            m.cpu_model,
            m.mem_gib,
            m.kernel,
            load3(&m.load_avg_at_start),
            load3(&self.load_avg_at_end),
            self.postgres.split(" on ").next().unwrap_or(&self.postgres),
            self.finished_in_s,
            self.command
        );
        w
    }

    fn backlog_markdown(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "**Backlog**: {} events (transactions of {}, payload ≈ {} bytes, {} partitions) \
             written while the relay was paused after its warm-up of 1,000, timed from resuming \
             it to the slot confirmed past them. Spans: of the run's sampled rows (warm-up \
             included), received by the bench's OTLP receiver and counted dropped by the relay \
             (medians). Every event read back from the topic, each aggregate in order.\n\n\
             | mode | events/s | of off | relay CPU µs/event | of off | walsender µs/event | \
             sampled rows | spans received | spans dropped | per run (events/s) | verified |\n\
             |---|---|---|---|---|---|---|---|---|---|---|",
            self.events, self.tx_size, self.payload_bytes, self.partitions
        );
        let off = self.backlog_of(Mode::Off);
        let off_rate = med(&off, |r| Some(r.rate));
        let off_cpu = med(&off, |r| r.us_per_event(r.relay_cpu_s));
        for m in Mode::BACKLOG {
            let runs = self.backlog_of(m);
            if runs.is_empty() {
                continue;
            }
            let rate = med(&runs, |r| Some(r.rate));
            let cpu = med(&runs, |r| r.us_per_event(r.relay_cpu_s));
            let ws = med(&runs, |r| r.us_per_event(r.walsender_cpu_s));
            let spans = |f: fn(&Spans) -> u64| {
                med(&runs, |r| Some(f(&r.spans) as f64)).map_or("–".into(), |v| format!("{v:.0}"))
            };
            let per: Vec<String> = runs.iter().map(|r| format!("{:.0}", r.rate)).collect();
            let ok = runs.iter().filter(|r| r.verified.ok()).count();
            let _ = writeln!(
                w,
                "| {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {ok} of {} |",
                m.label(),
                rate.unwrap_or(0.0),
                ratio(rate, off_rate),
                fmt1(cpu),
                ratio(cpu, off_cpu),
                fmt1(ws),
                spans(|s| s.sampled),
                spans(|s| s.received),
                spans(|s| s.dropped),
                per.join(" / "),
                runs.len()
            );
        }
        let _ = writeln!(w);
    }

    fn live_markdown(&self, w: &mut String) {
        if self.live.is_empty() {
            return;
        }
        let _ = writeln!(
            w,
            "**Live**: {:.0} events/s offered for {} s ({} writers, open loop), every row \
             sampled; commit→ack from the slot's confirmed position (medians of the runs' p50 / \
             p99 / max) and the relay's own histogram (bucket bounds of p50 / p99, the upper \
             median); missing: events never acknowledged or not on the topic, summed over the \
             runs.\n\n\
             | mode | achieved events/s | commit→ack p50 ms | p99 ms | max ms | relay's histogram p50 / p99 | \
             relay CPU µs/event | spans received / sampled | spans dropped | per run p99 ms | missing |\n\
             |---|---|---|---|---|---|---|---|---|---|---|",
            self.live_rate, self.live_secs, self.writers
        );
        for m in Mode::LIVE {
            let runs = self.live_of(m);
            if runs.is_empty() {
                continue;
            }
            let p = |f: fn(&LatencyPoint) -> Option<f64>| med(&runs, |r| f(&r.point));
            let upper = |f: fn(&crate::scrape::RelayView) -> f64| {
                let mut v: Vec<f64> = runs
                    .iter()
                    .filter_map(|r| r.point.relay_view.map(|x| f(&x)))
                    .collect();
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2)
                    .map_or("–".into(), |x| format!("≤ {x:.0}"))
            };
            let sum = |f: fn(&Spans) -> u64| runs.iter().map(|r| f(&r.spans)).sum::<u64>();
            let per: Vec<String> = runs
                .iter()
                .map(|r| format!("{:.1}", r.point.latency.p99_ms))
                .collect();
            let _ = writeln!(
                w,
                "| {} | {:.0} | {} | {} | {} | {} / {} | {} | {} / {} | {} | {} | {} |",
                m.label(),
                p(|x| Some(x.achieved_rate)).unwrap_or(0.0),
                fmt1(p(|x| Some(x.latency.p50_ms))),
                fmt1(p(|x| Some(x.latency.p99_ms))),
                fmt1(p(|x| Some(x.latency.max_ms))),
                upper(|v| v.p50_le_ms),
                upper(|v| v.p99_le_ms),
                fmt1(p(|x| x.cpu.relay)),
                sum(|s| s.received),
                sum(|s| s.sampled),
                sum(|s| s.dropped),
                per.join(" / "),
                runs.iter().map(|r| r.missing()).sum::<u64>()
            );
        }
        let _ = writeln!(w);
    }
}
