//! The relay's own view of commit→ack: its `outboxd_commit_to_ack_seconds` histogram, scraped
//! from `/metrics` before and after a latency point. The relay observes one value per
//! transaction, from the commit record's timestamp to the broker acknowledgement of its last
//! event — exact, where the slot sampler of `latency` is an upper bound. Buckets make it coarse
//! (5, 10, 25, 50, 100 ms …), but "p99 ≤ 50 ms" is a bucket boundary, so the share of
//! transactions at or under 50 ms answers the target exactly.

use anyhow::{Context, Result};
use std::io::{Read, Write};
use std::time::Duration;

const METRIC: &str = "outboxd_commit_to_ack_seconds_bucket";

/// Cumulative bucket counts `(le, count)`, ascending, `+Inf` last.
#[derive(Debug, Clone, Default)]
pub struct Buckets(pub Vec<(f64, u64)>);

/// Fetches the relay's histogram from `http://127.0.0.1:{port}/metrics`.
pub fn commit_to_ack(port: u16) -> Result<Buckets> {
    Ok(parse(&metrics_text(port)?))
}

/// The relay's whole `/metrics` page (the HTTP response, headers included).
pub fn metrics_text(port: u16) -> Result<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("metrics endpoint 127.0.0.1:{port}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(body)
}

/// The sum over every label set of the counter `name` (a relay that never counted one has no
/// such line: 0).
pub fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn parse(text: &str) -> Buckets {
    let mut v: Vec<(f64, u64)> = text
        .lines()
        .filter(|l| l.starts_with(METRIC))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let n = l.rsplit(' ').next()?.parse::<f64>().ok()? as u64;
            Some((le, n))
        })
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    Buckets(v)
}

/// What the relay measured during one latency point.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct RelayView {
    /// Transactions observed.
    pub transactions: u64,
    /// Share of them acknowledged within 50 ms of their commit.
    pub within_50ms: f64,
    /// … within 5 ms and within 15 ms (absent in reports of older runs).
    #[serde(default)]
    pub within_5ms: Option<f64>,
    #[serde(default)]
    pub within_15ms: Option<f64>,
    /// Upper bucket bounds (ms) holding the median and the 99th percentile (infinite: beyond
    /// the last bucket).
    #[serde(deserialize_with = "inf_if_null")]
    pub p50_le_ms: f64,
    #[serde(deserialize_with = "inf_if_null")]
    pub p99_le_ms: f64,
}

/// JSON has no infinity (serde_json writes it as `null`): a bound beyond the last bucket, e.g.
/// of a relay paused for a minute mid-point, reads back as infinite instead of failing `render`.
fn inf_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(<Option<f64> as serde::Deserialize>::deserialize(d)?.unwrap_or(f64::INFINITY))
}

impl Buckets {
    /// The observations between `earlier` and `self`.
    pub fn since(&self, earlier: &Buckets) -> RelayView {
        let count = |b: &Buckets, le: f64| {
            b.0.iter()
                .find(|(l, _)| (*l - le).abs() < 1e-9 || (l.is_infinite() && le.is_infinite()))
                .map_or(0, |x| x.1)
        };
        let d: Vec<(f64, u64)> = self
            .0
            .iter()
            .map(|&(le, n)| (le, n.saturating_sub(count(earlier, le))))
            .collect();
        let total = d.last().map_or(0, |x| x.1);
        let q = |q: f64| {
            d.iter()
                .find(|(_, n)| *n as f64 >= q * total as f64)
                .map_or(f64::INFINITY, |x| x.0 * 1e3)
        };
        // The share at or under a bucket bound (0 when there is no such bucket).
        let within = |secs: f64| {
            d.iter()
                .find(|(le, _)| (*le - secs).abs() < 1e-9)
                .filter(|_| total > 0)
                .map_or(0.0, |x| x.1 as f64 / total as f64)
        };
        RelayView {
            transactions: total,
            within_50ms: within(0.05),
            within_5ms: Some(within(0.005)),
            within_15ms: Some(within(0.015)),
            p50_le_ms: q(0.5),
            p99_le_ms: q(0.99),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn difference_of_two_scrapes() {
        let a = parse(
            "# TYPE outboxd_commit_to_ack_seconds histogram\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.005\"} 5\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.015\"} 8\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.025\"} 10\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.05\"} 10\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"+Inf\"} 10\n",
        );
        let b = parse(
            "outboxd_commit_to_ack_seconds_bucket{le=\"0.005\"} 45\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.015\"} 78\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.025\"} 90\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.05\"} 109\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"+Inf\"} 110\n\
             outboxd_commit_to_ack_seconds_sum 1.5\n",
        );
        let v = b.since(&a);
        assert_eq!(v.transactions, 100);
        assert!((v.within_50ms - 0.99).abs() < 1e-9);
        assert_eq!(v.within_5ms, Some(0.4));
        assert_eq!(v.within_15ms, Some(0.7));
        assert_eq!(v.p50_le_ms, 15.0);
        assert_eq!(v.p99_le_ms, 50.0);
    }

    #[test]
    fn a_counter_sums_its_label_sets_and_is_zero_when_absent() {
        let text = "# TYPE outboxd_trace_spans_dropped_total counter\n\
                    outboxd_trace_spans_dropped_total{reason=\"queue_full\"} 7\n\
                    outboxd_trace_spans_dropped_total{reason=\"export_failed\"} 5\n\
                    outboxd_trace_spans_dropped_total_other 100\n";
        assert_eq!(counter(text, "outboxd_trace_spans_dropped_total"), 12.0);
        assert_eq!(counter("", "outboxd_trace_spans_dropped_total"), 0.0);
        assert_eq!(counter("x_total 3\n", "x_total"), 3.0);
    }

    #[test]
    fn a_bound_beyond_the_last_bucket_survives_json() {
        let v = RelayView {
            p99_le_ms: f64::INFINITY,
            ..RelayView::default()
        };
        let json = serde_json::to_string(&v).unwrap();
        assert!(json.contains("\"p99_le_ms\":null"), "{json}");
        let back: RelayView = serde_json::from_str(&json).unwrap();
        assert!(back.p99_le_ms.is_infinite());
        assert_eq!(back.p50_le_ms, 0.0);
    }
}
