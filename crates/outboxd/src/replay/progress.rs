//! Progress of a replay run: a bar with rate and ETA for a person at a terminal, plain lines
//! (every [`EVERY`]) for logs and pipes. Both go to stderr; stdout keeps the result.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How often a plain progress line is written.
const EVERY: Duration = Duration::from_secs(2);
/// When the first one is written.
const FIRST: Duration = Duration::from_secs(1);

pub enum Progress {
    Bar(ProgressBar),
    Lines {
        id: i64,
        total: u64,
        /// Acknowledged before this run (resumed at the cursor).
        before: u64,
        started: Instant,
        last: Instant,
        acked: u64,
    },
}

impl Progress {
    /// `total` selected events, `before` of them acknowledged by earlier runs.
    pub fn new(id: i64, total: u64, before: u64) -> Self {
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template(
                "replay {prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} sent, {msg} ({per_sec}, ETA {eta})",
            ) {
                bar.set_style(style);
            }
            bar.set_prefix(id.to_string());
            bar.set_position(before);
            bar.reset_eta();
            Self::Bar(bar)
        } else {
            let now = Instant::now();
            Self::Lines {
                id,
                total,
                before,
                started: now,
                // The first line after a second, then every EVERY.
                last: now.checked_sub(EVERY - FIRST).unwrap_or(now),
                acked: before,
            }
        }
    }

    /// `sent` rows (over all runs) handed to the producer.
    pub fn sent(&mut self, sent: u64) {
        if let Self::Bar(b) = self {
            b.set_position(sent);
        }
    }

    /// `acked` rows (over all runs) acknowledged by the broker.
    pub fn acknowledged(&mut self, acked: u64) {
        match self {
            Self::Bar(b) => b.set_message(format!("{acked} acknowledged")),
            Self::Lines { last, acked: a, .. } => {
                *a = acked;
                if last.elapsed() >= EVERY {
                    *last = Instant::now();
                    eprintln!("{}", self.line());
                }
            }
        }
    }

    fn line(&self) -> String {
        let Self::Lines {
            id,
            total,
            before,
            started,
            acked,
            ..
        } = self
        else {
            return String::new();
        };
        let secs = started.elapsed().as_secs_f64().max(0.001);
        let rate = acked.saturating_sub(*before) as f64 / secs;
        let left = total.saturating_sub(*acked);
        let eta = if rate > 0.0 {
            format!("{:.0}s", left as f64 / rate)
        } else {
            "unknown".into()
        };
        let pct = if *total > 0 {
            (*acked as f64 * 100.0 / *total as f64).min(100.0)
        } else {
            100.0
        };
        format!(
            "replay {id}: {acked}/{total} events acknowledged ({pct:.0}%), {rate:.1}/s, ETA {eta}"
        )
    }

    /// The run ended (any way): the bar is left as it stands, a last line is written.
    pub fn finish(&mut self) {
        match self {
            Self::Bar(b) => b.abandon(),
            Self::Lines { .. } => eprintln!("{}", self.line()),
        }
    }
}
