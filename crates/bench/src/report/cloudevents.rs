//! CloudEvents against plain records (`--cloudevents binary,structured`, issues 42 and 55): each
//! mode's backlog rate and relay CPU per event against outboxd's plain records of the same runs.

use super::{opt, Report, Scenario, Target};
use crate::contest::Contestant;
use std::fmt::Write as _;

const MODES: [Contestant; 2] = [Contestant::OutboxdCeBinary, Contestant::OutboxdCeStructured];

/// One mode against plain, in one scenario.
struct Versus {
    /// Median rate / median plain rate.
    rate_ratio: f64,
    /// Each round's rate / that round's plain rate (the runs are interleaved), in round order.
    round_ratios: Vec<f64>,
    /// Median relay CPU µs per event of the mode and of plain.
    relay_us: Option<(f64, f64)>,
}

fn versus(s: &Scenario, k: Contestant) -> Option<Versus> {
    let ce = s.summary(k)?;
    let plain = s.summary(Contestant::Outboxd)?;
    let of = |c: Contestant| s.runs.iter().filter(move |r| r.contestant == c);
    let round_ratios = of(k)
        .zip(of(Contestant::Outboxd))
        .map(|(c, p)| c.rate / p.rate)
        .collect();
    Some(Versus {
        rate_ratio: ce.rate / plain.rate,
        round_ratios,
        relay_us: ce.relay_us.zip(plain.relay_us),
    })
}

impl Report {
    pub(crate) fn cloudevents_markdown(&self, w: &mut String) {
        let rows: Vec<_> = self
            .scenarios
            .iter()
            .flat_map(|s| MODES.map(|k| (s, k)))
            .filter_map(|(s, k)| Some((s, k, versus(s, k)?)))
            .collect();
        if rows.is_empty() {
            return;
        }
        let _ = writeln!(w, "#### CloudEvents against plain records (same runs)\n");
        let _ = writeln!(
            w,
            "| tx size | mode | rate vs plain (medians) | per round | relay CPU µs/event | plain | difference |\n|---|---|---|---|---|---|---|"
        );
        for (s, k, v) in rows {
            let rounds: Vec<String> = v.round_ratios.iter().map(|r| format!("{r:.2}")).collect();
            let _ = writeln!(
                w,
                "| {} | {} | {:.2} | {} | {} | {} | {} |",
                s.tx_size,
                k.cloudevents().unwrap_or(""),
                v.rate_ratio,
                rounds.join(", "),
                opt(v.relay_us.map(|u| u.0), 2),
                opt(v.relay_us.map(|u| u.1), 2),
                opt(v.relay_us.map(|(c, p)| c - p), 2),
            );
        }
        let _ = writeln!(w);
    }

    /// Issue 55: each mode ≥ 95 % of plain's backlog rate and ≤ +1 µs of relay CPU per event.
    pub(crate) fn cloudevents_targets(&self, t: &mut Vec<Target>) {
        for s in &self.scenarios {
            for k in MODES {
                let Some(v) = versus(s, k) else { continue };
                t.push(Target {
                    what: format!("{} ≥ 95% of plain (tx size {})", k.label(), s.tx_size),
                    measured: format!("{:.0}%", 100.0 * v.rate_ratio),
                    met: v.rate_ratio >= 0.95,
                    impossible: false,
                });
                if let Some((c, p)) = v.relay_us {
                    t.push(Target {
                        what: format!(
                            "{} ≤ +1 µs relay CPU per event (tx size {})",
                            k.label(),
                            s.tx_size
                        ),
                        measured: format!("{:+.2} µs ({c:.2} vs {p:.2})", c - p),
                        met: c - p <= 1.0,
                        impossible: false,
                    });
                }
            }
        }
    }
}
