//! The decoding-on-a-standby results: every run as measured (JSON), medians per load point and
//! arrangement, and the ratios on standby / on primary (Markdown for docs/benchmarks.md).

use crate::latency::Percentiles;
use crate::procstat::Machine;
use crate::tables::fleet::Measured;
use crate::tables::report::{in_order, med, preamble};
use crate::verify::Verified;
use crate::world::PacedOpts;
use std::fmt::Write as _;

/// Where the relay's logical slot lives (the standby streams in both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Arrangement {
    OnPrimary,
    OnStandby,
}

impl Arrangement {
    pub fn label(self) -> &'static str {
        match self {
            Self::OnPrimary => "slot on primary",
            Self::OnStandby => "slot on standby",
        }
    }

    pub(super) fn tag(self) -> &'static str {
        match self {
            Self::OnPrimary => "primary",
            Self::OnStandby => "standby",
        }
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct StandbyReport {
    pub command: String,
    pub started_at: String,
    pub machine: Machine,
    pub postgres: String,
    #[serde(flatten)]
    pub load: PacedOpts,
    pub status_ms: u64,
    pub poll_ms: u64,
    pub points: Vec<SbRun>,
    pub finished_in_s: f64,
}

/// One arrangement at one load in one run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SbRun {
    pub arrangement: Arrangement,
    pub run: usize,
    /// Offered events/s.
    pub offered: f64,
    pub events: u64,
    /// Events/s the writers achieved.
    pub rate: f64,
    /// The relay, its logical walsender (on the slot's server) and the broker.
    #[serde(flatten)]
    pub measured: Measured,
    /// The writers' backends on the primary.
    pub writer_cpu_s: f64,
    /// The primary's walsender streaming to the standby.
    pub physical_walsender_cpu_s: Option<f64>,
    /// The standby's startup (replay) and walreceiver processes.
    pub replay_cpu_s: Option<f64>,
    /// The relay's SQL sessions on the primary.
    pub relay_sessions_cpu_s: Option<f64>,
    pub relay_sessions: usize,
    /// Commit (start of the writer's INSERT) → the slot's confirmed position covers it.
    pub ack: Percentiles,
    /// Commit → the standby's replayed position covers it.
    pub replayed: Percentiles,
    pub verified: Verified,
}

/// CPU µs per event of one run, by where it is spent.
#[derive(Debug, Clone, Copy, Default)]
struct PerEvent {
    writers: f64,
    logical_primary: f64,
    physical: f64,
    sessions: f64,
    replay: f64,
    logical_standby: f64,
    relay: f64,
}

impl PerEvent {
    fn primary(&self) -> f64 {
        self.writers + self.logical_primary + self.physical + self.sessions
    }

    fn standby(&self) -> f64 {
        self.replay + self.logical_standby
    }
}

impl SbRun {
    fn per_event(&self) -> PerEvent {
        let n = self.events.max(1) as f64;
        let us = |c: Option<f64>| c.map_or(f64::NAN, |c| c * 1e6 / n);
        let logical = us(self.measured.walsender_cpu_s);
        let (logical_primary, logical_standby) = match self.arrangement {
            Arrangement::OnPrimary => (logical, 0.0),
            Arrangement::OnStandby => (0.0, logical),
        };
        PerEvent {
            writers: self.writer_cpu_s * 1e6 / n,
            logical_primary,
            physical: us(self.physical_walsender_cpu_s),
            sessions: us(self.relay_sessions_cpu_s),
            replay: us(self.replay_cpu_s),
            logical_standby,
            relay: us(self.measured.relay_cpu_s),
        }
    }

    /// The progress line of one run.
    pub fn line(&self) -> String {
        let e = self.per_event();
        format!(
            "{:>6.0} ev/s {:<15} run {}: primary {:.1} µs/ev (writers {:.1}, logical walsender \
             {:.1}, physical {:.1}, relay sessions {:.1}), standby {:.1} µs/ev, relay {:.1} µs/ev, \
             commit→ack p50/p99 {:.1}/{:.1} ms, commit→replayed p50/p99 {:.1}/{:.1} ms",
            self.offered,
            self.arrangement.label(),
            self.run,
            e.primary(),
            e.writers,
            e.logical_primary,
            e.physical,
            e.sessions,
            e.standby(),
            e.relay,
            self.ack.p50_ms,
            self.ack.p99_ms,
            self.replayed.p50_ms,
            self.replayed.p99_ms,
        )
    }
}

/// Medians over the runs of one (load, arrangement).
#[derive(Debug, Clone, Copy)]
struct Row {
    rate: f64,
    cpu: PerEvent,
    primary: f64,
    standby: f64,
    ack: Percentiles,
    replayed: Percentiles,
    verified: bool,
}

fn row(runs: &[SbRun], offered: f64, a: Arrangement) -> Option<Row> {
    let rs: Vec<&SbRun> = runs
        .iter()
        .filter(|r| r.offered == offered && r.arrangement == a)
        .collect();
    if rs.is_empty() {
        return None;
    }
    let es: Vec<PerEvent> = rs.iter().map(|r| r.per_event()).collect();
    let m = |f: fn(&PerEvent) -> f64| med(es.iter().map(f));
    let p = |f: fn(&SbRun) -> f64| med(rs.iter().map(|r| f(r)));
    Some(Row {
        rate: p(|r| r.rate),
        cpu: PerEvent {
            writers: m(|e| e.writers),
            logical_primary: m(|e| e.logical_primary),
            physical: m(|e| e.physical),
            sessions: m(|e| e.sessions),
            replay: m(|e| e.replay),
            logical_standby: m(|e| e.logical_standby),
            relay: m(|e| e.relay),
        },
        primary: m(PerEvent::primary),
        standby: m(PerEvent::standby),
        ack: Percentiles {
            p50_ms: p(|r| r.ack.p50_ms),
            p99_ms: p(|r| r.ack.p99_ms),
            max_ms: p(|r| r.ack.max_ms),
        },
        replayed: Percentiles {
            p50_ms: p(|r| r.replayed.p50_ms),
            p99_ms: p(|r| r.replayed.p99_ms),
            max_ms: p(|r| r.replayed.max_ms),
        },
        verified: rs
            .iter()
            .all(|r| r.verified.distinct == r.verified.expected),
    })
}

impl StandbyReport {
    /// Offered loads in the order they were run.
    fn loads(&self) -> Vec<f64> {
        in_order(self.points.iter().map(|p| p.offered))
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}, primary + one physical standby (`hot_standby_feedback = on`, \
             `primary_slot_name`) in both arrangements; finished in {:.0} s. {}, \
             `status_interval_ms = {}`, samplers every {} ms. Medians of {} runs.\n",
            preamble(
                &self.command,
                &self.started_at,
                &self.machine,
                &self.postgres
            ),
            self.finished_in_s,
            self.load.describe(),
            self.status_ms,
            self.poll_ms,
            self.load.runs,
        );
        let _ = writeln!(
            s,
            "CPU µs per event. Primary = writers + logical walsender + physical walsender + the \
             relay's SQL sessions; standby = replay (startup + walreceiver) + logical walsender.\n\n\
             | offered ev/s | arrangement | achieved ev/s | writers | logical walsender (primary) \
             | physical walsender | relay SQL sessions | **primary total** | standby replay | \
             logical walsender (standby) | standby total | relay | commit→ack p50 / p99 (ms) | \
             commit→replayed p50 / p99 (ms) | every event delivered |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        let f = |v: f64| format!("{v:.1}");
        for load in self.loads() {
            for a in [Arrangement::OnPrimary, Arrangement::OnStandby] {
                let Some(r) = row(&self.points, load, a) else {
                    continue;
                };
                let c = r.cpu;
                let _ = writeln!(
                    s,
                    "| {load:.0} | {} | {:.0} | {} | {} | {} | {} | **{}** | {} | {} | {} | {} | \
                     {:.1} / {:.1} | {:.1} / {:.1} | {} |",
                    a.label(),
                    r.rate,
                    f(c.writers),
                    f(c.logical_primary),
                    f(c.physical),
                    f(c.sessions),
                    f(r.primary),
                    f(c.replay),
                    f(c.logical_standby),
                    f(r.standby),
                    f(c.relay),
                    r.ack.p50_ms,
                    r.ack.p99_ms,
                    r.replayed.p50_ms,
                    r.replayed.p99_ms,
                    if r.verified { "yes" } else { "**no**" },
                );
            }
        }
        let _ = writeln!(
            s,
            "\nSlot on standby against slot on primary (same load):\n\n| offered ev/s | primary \
             CPU per event | primary µs/event saved | standby µs/event added | commit→ack p50 \
             added (ms) | commit→ack p99 added (ms) |\n|---|---|---|---|---|---|"
        );
        for load in self.loads() {
            let (Some(p), Some(sb)) = (
                row(&self.points, load, Arrangement::OnPrimary),
                row(&self.points, load, Arrangement::OnStandby),
            ) else {
                continue;
            };
            let _ = writeln!(
                s,
                "| {load:.0} | {:.2}× | {:.1} | {:.1} | {:+.1} | {:+.1} |",
                sb.primary / p.primary,
                p.primary - sb.primary,
                sb.standby - p.standby,
                sb.ack.p50_ms - p.ack.p50_ms,
                sb.ack.p99_ms - p.ack.p99_ms,
            );
        }
        s
    }
}
