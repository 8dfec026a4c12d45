//! The many-tables results: every run as measured (JSON), medians per table count and
//! arrangement, and the ratios N relays / one relay (Markdown for docs/benchmarks.md).

use super::fleet::{Measured, Mode};
use crate::procstat::Machine;
use crate::report::median;
use crate::verify::Verified;
use std::fmt::Write as _;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TablesReport {
    pub command: String,
    pub started_at: String,
    pub machine: Machine,
    pub postgres: String,
    pub events: u64,
    pub tx_size: usize,
    pub payload_bytes: usize,
    pub aggregates: usize,
    pub partitions: i32,
    pub status_ms: u64,
    pub runs: usize,
    pub live_rate: f64,
    pub live_secs: f64,
    pub writers: usize,
    /// Every table of an arrangement wrote to one topic (`--shared-topics`).
    #[serde(default)]
    pub shared_topics: bool,
    /// Drains of a backlog written before the clock started.
    pub backlog: Vec<ModeRun>,
    /// Paced live loads.
    pub live: Vec<ModeRun>,
    pub finished_in_s: f64,
}

/// One arrangement's measurement in one run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ModeRun {
    /// N, the outbox tables the load is spread over.
    pub tables: usize,
    pub mode: Mode,
    pub run: usize,
    pub relays: usize,
    pub events: u64,
    /// Backlog: events / drain time. Live: the rate the writers achieved.
    pub rate: f64,
    #[serde(flatten)]
    pub measured: Measured,
    /// Live only: CPU of the writers' backends (the application side, equal by construction).
    pub writer_cpu_s: Option<f64>,
    pub verified: Verified,
}

impl ModeRun {
    fn per_event(&self, cpu: Option<f64>) -> Option<f64> {
        cpu.map(|c| c * 1e6 / self.events.max(1) as f64)
    }
}

/// Medians over the runs of one (N, arrangement).
#[derive(Debug, Clone, Copy, Default)]
pub struct Row {
    pub runs: usize,
    pub relays: usize,
    pub rate: f64,
    pub walsender_us: Option<f64>,
    pub relay_us: Option<f64>,
    pub writer_us: Option<f64>,
    pub behind_max: f64,
    pub behind_end: f64,
    pub pinned_max: f64,
    pub pinned_end: f64,
    pub rss_kib: f64,
    pub verified: bool,
}

/// The first line of a relay-process bench's Markdown: the command, the machine, the server.
pub(crate) fn preamble(command: &str, started_at: &str, m: &Machine, postgres: &str) -> String {
    format!(
        "Command: `{command}`  \nStarted {started_at}; {} cores ({}), {} GiB, kernel {}; load \
         average at start {}; {}",
        m.cores,
        m.cpu_model,
        m.mem_gib,
        m.kernel,
        m.load_avg_at_start,
        postgres.split(" on ").next().unwrap_or(postgres),
    )
}

/// Distinct values in the order they first appear (a run's load points or table counts).
pub(crate) fn in_order<T: PartialEq>(v: impl IntoIterator<Item = T>) -> Vec<T> {
    let mut out = vec![];
    for x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

pub(crate) fn med(v: impl Iterator<Item = f64>) -> f64 {
    median(v.collect()).unwrap_or(f64::NAN)
}

fn med_opt(v: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    median(v.collect::<Option<Vec<f64>>>()?)
}

pub fn row(runs: &[ModeRun], n: usize, mode: Mode) -> Option<Row> {
    let rs: Vec<&ModeRun> = runs
        .iter()
        .filter(|r| r.tables == n && r.mode == mode)
        .collect();
    let first = rs.first()?;
    let wal = |f: fn(&ModeRun) -> u64| med(rs.iter().map(|r| f(r) as f64));
    Some(Row {
        runs: rs.len(),
        relays: first.relays,
        rate: med(rs.iter().map(|r| r.rate)),
        walsender_us: med_opt(rs.iter().map(|r| r.per_event(r.measured.walsender_cpu_s))),
        relay_us: med_opt(rs.iter().map(|r| r.per_event(r.measured.relay_cpu_s))),
        writer_us: med_opt(rs.iter().map(|r| r.per_event(r.writer_cpu_s))),
        behind_max: wal(|r| r.measured.wal.behind_max),
        behind_end: wal(|r| r.measured.wal.behind_end),
        pinned_max: wal(|r| r.measured.wal.pinned_max),
        pinned_end: wal(|r| r.measured.wal.pinned_end),
        rss_kib: wal(|r| r.measured.peak_rss_kib),
        verified: rs
            .iter()
            .all(|r| r.verified.distinct == r.verified.expected),
    })
}

fn mib(bytes: f64) -> String {
    format!("{:.1}", bytes / 1024.0 / 1024.0)
}

fn us(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.1}"))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    }
}

impl TablesReport {
    /// Table counts in the order they were run.
    pub fn counts(&self) -> Vec<usize> {
        in_order(self.backlog.iter().chain(&self.live).map(|r| r.tables))
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}; finished in {:.0} s. Transactions of {} rows, payload ≈ {} bytes, {} \
             aggregates per table, {} partitions{}, `status_interval_ms = {}`.\n",
            preamble(
                &self.command,
                &self.started_at,
                &self.machine,
                &self.postgres
            ),
            self.finished_in_s,
            self.tx_size,
            self.payload_bytes,
            self.aggregates,
            self.partitions,
            if self.shared_topics {
                " (every table of an arrangement into one topic)"
            } else {
                " per table's topic"
            },
            self.status_ms,
        );
        let _ = writeln!(
            s,
            "#### Backlog: {} events spread over N tables, drained (medians of {} runs)\n",
            self.events, self.runs
        );
        self.table(&mut s, &self.backlog, false);
        if !self.live.is_empty() {
            let _ = writeln!(
                s,
                "\n#### Live: {:.0} events/s for {} s spread over N tables, {} writers (medians of {} runs)\n",
                self.live_rate, self.live_secs, self.writers, self.runs
            );
            self.table(&mut s, &self.live, true);
        }
        s
    }

    fn table(&self, s: &mut String, runs: &[ModeRun], live: bool) {
        let rate = if live {
            "achieved events/s"
        } else {
            "events/s"
        };
        let writer = if live { " writers µs/event |" } else { "" };
        let _ = writeln!(
            s,
            "| N | arrangement | relays | {rate} | walsender CPU µs/event |{writer} relay CPU \
             µs/event | WAL behind slots, max / end (MiB) | WAL pinned, max / end (MiB) | relay \
             peak RSS (MiB) | every event delivered |"
        );
        let _ = writeln!(
            s,
            "|---|---|---|---|---|{}---|---|---|---|---|",
            if live { "---|" } else { "" }
        );
        for n in self.counts() {
            for mode in [Mode::OneRelay, Mode::RelayPerTable] {
                let Some(r) = row(runs, n, mode) else {
                    continue;
                };
                let writer = if live {
                    format!(" {} |", us(r.writer_us))
                } else {
                    String::new()
                };
                let _ = writeln!(
                    s,
                    "| {n} | {} | {} | {:.0} | {} |{writer} {} | {} / {} | {} / {} | {:.1} | {} |",
                    mode.label(),
                    r.relays,
                    r.rate,
                    us(r.walsender_us),
                    us(r.relay_us),
                    mib(r.behind_max),
                    mib(r.behind_end),
                    mib(r.pinned_max),
                    mib(r.pinned_end),
                    r.rss_kib / 1024.0,
                    if r.verified { "yes" } else { "**no**" },
                );
            }
        }
        let _ = writeln!(
            s,
            "\nN relays / one relay (same N):\n\n| N | throughput | walsender CPU per event | \
             relay CPU per event | WAL behind slots (max) | WAL pinned (max) | relay peak RSS |\n\
             |---|---|---|---|---|---|---|"
        );
        for n in self.counts() {
            let (Some(one), Some(each)) = (
                row(runs, n, Mode::OneRelay),
                row(runs, n, Mode::RelayPerTable),
            ) else {
                continue;
            };
            let _ = writeln!(
                s,
                "| {n} | {} | {} | {} | {} | {} | {} |",
                ratio(Some(each.rate), Some(one.rate)),
                ratio(each.walsender_us, one.walsender_us),
                ratio(each.relay_us, one.relay_us),
                ratio(Some(each.behind_max), Some(one.behind_max)),
                ratio(Some(each.pinned_max), Some(one.pinned_max)),
                ratio(Some(each.rss_kib), Some(one.rss_kib)),
            );
        }
    }
}
