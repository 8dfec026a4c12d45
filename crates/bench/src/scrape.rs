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
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("metrics endpoint 127.0.0.1:{port}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(parse(&body))
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
    /// Upper bucket bounds (ms) holding the median and the 99th percentile.
    pub p50_le_ms: f64,
    pub p99_le_ms: f64,
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
        RelayView {
            transactions: total,
            within_50ms: if total == 0 {
                0.0
            } else {
                d.iter()
                    .find(|(le, _)| (*le - 0.05).abs() < 1e-9)
                    .map_or(0.0, |x| x.1 as f64 / total as f64)
            },
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
             outboxd_commit_to_ack_seconds_bucket{le=\"0.025\"} 10\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.05\"} 10\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"+Inf\"} 10\n",
        );
        let b = parse(
            "outboxd_commit_to_ack_seconds_bucket{le=\"0.025\"} 90\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"0.05\"} 109\n\
             outboxd_commit_to_ack_seconds_bucket{le=\"+Inf\"} 110\n\
             outboxd_commit_to_ack_seconds_sum 1.5\n",
        );
        let v = b.since(&a);
        assert_eq!(v.transactions, 100);
        assert!((v.within_50ms - 0.99).abs() < 1e-9);
        assert_eq!(v.p50_le_ms, 25.0);
        assert_eq!(v.p99_le_ms, 50.0);
    }
}
