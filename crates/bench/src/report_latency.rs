//! The latency part of the report: the open-loop table, the machine's live write capacity, and
//! the latency targets, including the proof when a target's load cannot be produced here.

use crate::contest::Contestant;
use crate::report::rounds::{spread_header, PointSummary};
use crate::report::{opt, LatencyPoint, Report, Target};
use crate::scrape::RelayView;
use std::fmt::Write as _;

/// See [`Report::live_bound`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveBound {
    pub write_capacity: f64,
    pub writers_us: f64,
    pub walsender_us: f64,
    pub broker_us: f64,
    pub floor_us: f64,
    pub max_rate: f64,
}

impl Report {
    /// The highest offered load this contestant kept with p99 ≤ 50 ms (both measures; medians
    /// over the rounds).
    pub fn best_within_50ms(&self, k: Contestant) -> Option<LatencyPoint> {
        self.latency_medians()
            .into_iter()
            .filter(|p| p.contestant == k && !p.saturated && p.latency.p99_ms <= 50.0)
            .max_by(|a, b| a.achieved_rate.total_cmp(&b.achieved_rate))
    }

    pub(crate) fn latency_targets(&self, k: Contestant, t: &mut Vec<Target>) {
        let who = k.label();
        let half = 0.5 * self.latency_ceiling;
        let medians = self.latency_medians();
        let at_half = medians.iter().find(|p| {
            p.contestant == k
                && p.fraction_of_ceiling
                    .is_some_and(|f| (f - 0.5).abs() < 1e-9)
        });
        let what = format!("{who} commit→ack p99 ≤ 50 ms at 50% of the ceiling");
        let bound = self.live_bound(k);
        match at_half {
            Some(p) if !p.saturated => t.push(Target {
                what,
                measured: format!("{:.1} ms", p.latency.p99_ms),
                met: p.latency.p99_ms <= 50.0,
                impossible: false,
            }),
            _ if bound.is_some_and(|b| b.max_rate < half) => {
                let b = bound.unwrap_or_default();
                t.push(Target {
                    what,
                    measured: format!(
                        "50% = {half:.0} ev/s of live commits{}. Without outboxd a live event still \
                         costs {:.1} µs of CPU (writers' backends {:.1} at the write capacity of \
                         {:.0} ev/s, walsender {:.1} and broker {:.1} at their cheapest live points), \
                         so {} cores carry at most {:.0} ev/s ({:.0}% of the ceiling) even with a \
                         relay that costs nothing",
                        at_half.map_or(String::new(), |p| format!(
                            " (offered with outboxd running, the writers achieved {:.0})",
                            p.achieved_rate
                        )),
                        b.floor_us,
                        b.writers_us,
                        b.write_capacity,
                        b.walsender_us,
                        b.broker_us,
                        self.machine.cores,
                        b.max_rate,
                        100.0 * b.max_rate / self.latency_ceiling
                    ),
                    met: false,
                    impossible: true,
                });
            }
            Some(p) => t.push(Target {
                what,
                measured: format!("{:.1} ms (falling behind)", p.latency.p99_ms),
                met: false,
                impossible: false,
            }),
            None => {}
        }
        if let Some(p) = self.best_within_50ms(k) {
            t.push(Target {
                what: format!("{who}: highest live load with commit→ack p99 ≤ 50 ms"),
                measured: format!(
                    "{:.0} ev/s ({:.1}% of the ceiling{}): p99 {:.1} ms{}",
                    p.achieved_rate,
                    100.0 * p.achieved_rate / self.latency_ceiling,
                    self.write_capacity.map_or(String::new(), |c| format!(
                        ", {:.0}% of the write capacity",
                        100.0 * p.achieved_rate / c.rate
                    )),
                    p.latency.p99_ms,
                    p.relay_view.map_or(String::new(), |v| format!(
                        "; relay histogram {:.2}% ≤ 50 ms",
                        100.0 * v.within_50ms
                    ))
                ),
                met: true,
                impossible: false,
            });
        }
    }

    /// The most live events per second this machine could carry with a relay that costs
    /// nothing: its cores divided by what writing an event and decoding it cost, both measured
    /// in this run. Above it no relay can be shown the load, let alone keep a latency.
    pub fn live_bound(&self, k: Contestant) -> Option<LiveBound> {
        let cap = self.write_capacity?;
        let writers_us = cap.writer_us_per_event?;
        let medians = self.latency_medians();
        let cheapest = |f: fn(&LatencyPoint) -> Option<f64>| {
            medians
                .iter()
                .filter(|p| p.contestant == k && !p.saturated)
                .filter_map(f)
                .min_by(f64::total_cmp)
        };
        let walsender_us = cheapest(|p| p.cpu.walsender)?;
        let broker_us = cheapest(|p| p.cpu.broker)?;
        let floor_us = writers_us + walsender_us + broker_us;
        Some(LiveBound {
            write_capacity: cap.rate,
            writers_us,
            walsender_us,
            broker_us,
            floor_us,
            max_rate: (self.machine.cores as f64 * 1e6 / floor_us).min(cap.rate),
        })
    }

    pub(crate) fn latency_markdown(&self, w: &mut String) {
        if self.latency.is_empty() {
            return;
        }
        let _ = writeln!(
            w,
            "#### Commit→ack latency, open loop, transaction size {} (ceiling {:.0} events/s)\n",
            self.latency_tx_size, self.latency_ceiling
        );
        if let Some(c) = self.write_capacity {
            let _ = writeln!(
                w,
                "Write capacity (the same {} writers back to back, no relay, no slot reader): \
                 **{:.0} events/s** = {:.0}% of the ceiling, {} µs of Postgres backend CPU per event.\n",
                c.writers,
                c.rate,
                100.0 * c.rate / self.latency_ceiling,
                opt(c.writer_us_per_event, 1)
            );
        }
        if let Some(b) = self.live_bound(Contestant::Outboxd) {
            let _ = writeln!(
                w,
                "Live bound: writing an event costs {:.1} µs of backend CPU, decoding it {:.1} µs of \
                 walsender CPU and storing it {:.1} µs of broker CPU (the latter two at their cheapest \
                 live points), so {} cores carry at most **{:.0} live events/s** ({:.0}% of the \
                 ceiling) with a relay that costs nothing.\n",
                b.writers_us,
                b.walsender_us,
                b.broker_us,
                self.machine.cores,
                b.max_rate,
                100.0 * b.max_rate / self.latency_ceiling
            );
        }
        let n = self.latency_runs.max(1);
        if n > 1 {
            let _ = writeln!(
                w,
                "Medians of {n} rounds (a round: each contestant's sweep, then its points with a \
                 consumer, each contestant on a fresh relay process, slot and topic); the CPU \
                 and relay-histogram figures are medians too (a histogram's p50 and p99 the \
                 upper median, a bucket bound), counts of events are summed over the rounds. \
                 \"per round\" lists the rounds \
                 in order (–: not measured, the contestant had fallen behind at a lower load in \
                 that round).\n"
            );
        }
        let _ = writeln!(
            w,
            "| contestant | offered events/s | of ceiling | achieved | p50 ms | p99 ms | max ms |{} relay's histogram: share ≤ 5 / ≤ 15 / ≤ 50 ms / p50 / p99 (ms) | CPU µs/event: writers / walsender (polling: its backend) / relay / broker | note |\n|---|---|---|---|---|---|---|{}---|---|---|",
            spread_header(n, ""),
            "---|".repeat(if n > 1 { 2 } else { 0 })
        );
        for s in self.latency_summaries() {
            let p = &s.median;
            let _ = writeln!(
                w,
                "| {} | {:.1} | {:.1} | {:.1} |{} {} | {} | {} |",
                p.load_cells(),
                p.latency.p50_ms,
                p.latency.p99_ms,
                p.latency.max_ms,
                s.spread_cells(|p| p.latency),
                p.relay_view.map_or("–".into(), |v| relay_cells(&v)),
                p.cpu.cells(),
                note(&s)
            );
        }
        let _ = writeln!(w);
        self.consumer_markdown(w);
    }

    fn consumer_markdown(&self, w: &mut String) {
        if self.consumer_points.is_empty() {
            return;
        }
        let n = self.latency_runs.max(1);
        let _ = writeln!(
            w,
            "Commit→consumer: one more point per contestant with a consumer reading the topic \
             (assigned at the end of every partition, `fetch.wait.max.ms` = 10); latency = read \
             time − record timestamp (the row's `created_at`; whole ms, so 0–1 ms late).\n\n\
             | contestant | offered events/s | of ceiling | achieved | commit→ack p50 / p99 / max ms | commit→consumer p50 / p99 / max ms |{}{} read / missing | CPU µs/event: writers / walsender (polling: its backend) / relay / broker |\n|---|---|---|---|---|---|{}---|---|",
            spread_header(n, "commit→ack "),
            spread_header(n, "commit→consumer "),
            "---|".repeat(if n > 1 { 4 } else { 0 })
        );
        for s in self.consumer_summaries() {
            let p = &s.median;
            let c = p.consumer_view.unwrap_or_default();
            let _ = writeln!(
                w,
                "| {} | {} | {} |{}{} {} / {} | {} |",
                p.load_cells(),
                p.latency.cells(),
                c.latency.cells(),
                s.spread_cells(|p| p.latency),
                s.spread_cells(|p| p.consumer_view.unwrap_or_default().latency),
                c.read,
                c.missing,
                p.cpu.cells(),
            );
        }
        let _ = writeln!(w);
    }
}

/// The relay's histogram over a point: shares ≤ 5 / ≤ 15 / ≤ 50 ms, then the buckets holding
/// p50 and p99.
fn relay_cells(v: &RelayView) -> String {
    let pct = |x: Option<f64>| x.map_or("–".into(), |x| format!("{:.2}%", 100.0 * x));
    let le = |ms: f64| {
        if !ms.is_finite() {
            "> 60 000".into()
        } else if ms.fract() == 0.0 {
            format!("≤ {ms:.0}")
        } else {
            format!("≤ {ms:.1}")
        }
    };
    format!(
        "{} / {} / {} / {} / {}",
        pct(v.within_5ms),
        pct(v.within_15ms),
        pct(Some(v.within_50ms)),
        le(v.p50_le_ms),
        le(v.p99_le_ms)
    )
}

/// The note of a sweep row: whether (and in how many rounds) the contestant fell behind, and
/// in how many rounds the point was measured when not in all.
fn note(s: &PointSummary) -> String {
    let (n, p) = (s.rounds.len(), &s.median);
    let mut parts = vec![];
    if p.saturated {
        let rounds = if n > 1 {
            format!(" in {} of {n} rounds", s.saturated())
        } else {
            String::new()
        };
        parts.push(format!(
            "falling behind{rounds}: an event waited > 1 s ({} of {} not acked 30 s after the writers stopped)",
            p.unacked, p.events
        ));
    }
    if s.measured() < n {
        parts.push(format!("measured in {} of {n} rounds", s.measured()));
    }
    parts.join("; ")
}
