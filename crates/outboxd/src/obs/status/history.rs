//! The last hour of lag, kept in memory for the status page's chart: a bounded ring of samples
//! (one per watch report, every 5 s: 720 an hour), so a long-running relay never grows it.

use serde::Serialize;
use std::collections::VecDeque;

/// Samples kept: an hour at the watch's 5 s report interval.
pub const CAPACITY: usize = 720;
/// Oldest sample shown (seconds).
pub const WINDOW_S: f64 = 3600.0;

/// One point of the chart.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Sample {
    /// Unix seconds.
    pub at: f64,
    pub lag_bytes: f64,
    pub lag_seconds: f64,
    /// Events relayed since the process started, at `at` (the rate is taken between samples).
    #[serde(skip)]
    pub relayed: u64,
}

#[derive(Debug, Default)]
pub struct History(VecDeque<Sample>);

impl History {
    /// Adds `s`, dropping the oldest beyond [`CAPACITY`] and those older than the window.
    pub fn push(&mut self, s: Sample) {
        if self.0.len() == CAPACITY {
            self.0.pop_front();
        }
        self.0.push_back(s);
        while self.0.front().is_some_and(|f| s.at - f.at > WINDOW_S) {
            self.0.pop_front();
        }
    }

    pub fn samples(&self) -> Vec<Sample> {
        self.0.iter().copied().collect()
    }

    /// Events per second over the last minute of samples (the whole ring when shorter); 0
    /// with fewer than two samples.
    pub fn rate(&self) -> f64 {
        let Some(last) = self.0.back() else {
            return 0.0;
        };
        let first = self
            .0
            .iter()
            .find(|s| last.at - s.at <= 60.0)
            .unwrap_or(last);
        let dt = last.at - first.at;
        if dt <= 0.0 {
            return 0.0;
        }
        last.relayed.saturating_sub(first.relayed) as f64 / dt
    }
}

/// Width and height of the chart's drawing area (SVG user units).
pub const CHART_W: f64 = 600.0;
pub const CHART_H: f64 = 120.0;

/// The `points` of an SVG polyline of lag bytes over the window ending at the last sample
/// (the page's script draws the same from `/status.json`).
pub fn polyline(samples: &[Sample]) -> String {
    let Some(last) = samples.last() else {
        return String::new();
    };
    let max = samples.iter().map(|s| s.lag_bytes).fold(1.0, f64::max);
    samples
        .iter()
        .map(|s| {
            let x = CHART_W - (last.at - s.at) / WINDOW_S * CHART_W;
            let y = CHART_H - s.lag_bytes / max * CHART_H;
            format!("{x:.1},{y:.1}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(at: f64, lag: f64, relayed: u64) -> Sample {
        Sample {
            at,
            lag_bytes: lag,
            lag_seconds: 0.0,
            relayed,
        }
    }

    #[test]
    fn the_ring_is_bounded_and_keeps_one_hour() {
        let mut h = History::default();
        for i in 0..2000 {
            h.push(s(f64::from(i) * 5.0, 10.0, u64::from(i as u32) * 50));
        }
        let v = h.samples();
        assert!(v.len() <= CAPACITY);
        assert!(v.last().unwrap().at - v[0].at <= WINDOW_S);
        assert!((h.rate() - 10.0).abs() < 1e-9, "{}", h.rate());
        let pts = polyline(&v);
        assert!(pts.ends_with("600.0,0.0"), "{pts}");
        assert_eq!(polyline(&[]), "");
    }
}
