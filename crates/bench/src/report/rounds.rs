//! The latency phase repeated over rounds (`--latency-runs`): one summary per contestant and
//! offered load, holding the median over the rounds of every figure (latency, the relay's
//! histogram, CPU per event, commit→consumer) and each round's own point, so a table shows the
//! medians and the spread. With one round the summary is that round's point unchanged.

use super::{median, LatencyPoint, LiveCpu, Report, ORDER};
use crate::consume::ConsumerView;
use crate::latency::Percentiles;
use crate::scrape::RelayView;
use crate::verify::Verified;

/// One contestant at one offered load, over the rounds.
#[derive(Debug, Clone)]
pub struct PointSummary {
    /// Medians over the rounds that measured the point (see [`median_point`]).
    pub median: LatencyPoint,
    /// Each round's point, round 1 first; `None` where a round did not measure it (it fell
    /// behind at a lower load and skipped the higher ones).
    pub rounds: Vec<Option<LatencyPoint>>,
}

impl PointSummary {
    /// Rounds that measured the point.
    pub fn measured(&self) -> usize {
        self.rounds.iter().flatten().count()
    }

    /// Rounds in which the contestant fell behind at this point.
    pub fn saturated(&self) -> usize {
        self.rounds.iter().flatten().filter(|p| p.saturated).count()
    }

    /// One figure of every round, "4.1 / 4.3 / 4.0" ("–": not measured in that round).
    pub fn per_round(&self, f: impl Fn(&LatencyPoint) -> f64) -> String {
        self.rounds
            .iter()
            .map(|p| p.as_ref().map_or("–".into(), |p| format!("{:.1}", f(p))))
            .collect::<Vec<_>>()
            .join(" / ")
    }

    /// With more than one round, the cells " p50s | p99s |" of `f`'s percentiles per round
    /// (they follow the median cells of a table row); with one, nothing.
    pub fn spread_cells(&self, f: impl Fn(&LatencyPoint) -> Percentiles) -> String {
        if self.rounds.len() < 2 {
            return String::new();
        }
        format!(
            " {} | {} |",
            self.per_round(|p| f(p).p50_ms),
            self.per_round(|p| f(p).p99_ms)
        )
    }
}

impl Report {
    /// The sweep, one summary per contestant and load.
    pub fn latency_summaries(&self) -> Vec<PointSummary> {
        summarize(&self.latency, self.latency_runs, &ORDER)
    }

    /// The points with a consumer, one summary per contestant and load.
    pub fn consumer_summaries(&self) -> Vec<PointSummary> {
        summarize(&self.consumer_points, self.latency_runs, &ORDER)
    }

    /// The sweep's medians: what the targets, the live bound and the chart read.
    pub fn latency_medians(&self) -> Vec<LatencyPoint> {
        self.latency_summaries()
            .into_iter()
            .map(|s| s.median)
            .collect()
    }
}

/// The header cells matching [`PointSummary::spread_cells`] (`what`: whose latency).
pub fn spread_header(rounds: usize, what: &str) -> String {
    if rounds < 2 {
        return String::new();
    }
    format!(" {what}p50 ms per round | {what}p99 ms per round |")
}

/// Groups `points` by contestant and offered load (in the order of the first round that
/// measured them, contestants in `order`) and summarises each over `rounds` rounds.
pub fn summarize(
    points: &[LatencyPoint],
    rounds: usize,
    order: &[crate::contest::Contestant],
) -> Vec<PointSummary> {
    let rounds = rounds.max(1);
    let mut groups: Vec<Vec<&LatencyPoint>> = vec![];
    for p in points {
        let same = |q: &&LatencyPoint| {
            q.contestant == p.contestant
                && q.target_rate.to_bits() == p.target_rate.to_bits()
                && q.fraction_of_ceiling.map(f64::to_bits)
                    == p.fraction_of_ceiling.map(f64::to_bits)
        };
        match groups.iter_mut().find(|g| g.first().is_some_and(same)) {
            Some(g) => g.push(p),
            None => groups.push(vec![p]),
        }
    }
    let rank = |g: &Vec<&LatencyPoint>| {
        order
            .iter()
            .position(|k| *k == g[0].contestant)
            .unwrap_or(order.len())
    };
    groups.sort_by_key(rank);
    groups
        .into_iter()
        .map(|g| {
            let mut by_round = vec![None; rounds];
            for p in &g {
                let i = p.round.max(1) - 1;
                if i >= by_round.len() {
                    by_round.resize(i + 1, None);
                }
                by_round[i] = Some((*p).clone());
            }
            PointSummary {
                median: median_point(&g),
                rounds: by_round,
            }
        })
        .collect()
}

/// The median of `f` over `xs` (`None`: no value).
fn med<T>(xs: &[&T], f: impl Fn(&T) -> Option<f64>) -> Option<f64> {
    median(xs.iter().filter_map(|x| f(x)).collect())
}

/// The upper median: with an even count the higher of the two middle values, so the median
/// of bucket bounds ("≤ X") is itself a bucket bound and still an upper bound.
fn upper_med<T>(xs: &[&T], f: impl Fn(&T) -> f64) -> f64 {
    let mut v: Vec<f64> = xs.iter().map(|x| f(x)).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn median_percentiles(xs: &[&Percentiles]) -> Percentiles {
    Percentiles {
        p50_ms: med(xs, |p| Some(p.p50_ms)).unwrap_or_default(),
        p99_ms: med(xs, |p| Some(p.p99_ms)).unwrap_or_default(),
        max_ms: med(xs, |p| Some(p.max_ms)).unwrap_or_default(),
    }
}

fn median_cpu(xs: &[&LiveCpu]) -> LiveCpu {
    LiveCpu {
        writers: med(xs, |c| c.writers),
        walsender: med(xs, |c| c.walsender),
        relay: med(xs, |c| c.relay),
        broker: med(xs, |c| c.broker),
        proxy: med(xs, |c| c.proxy),
    }
}

fn median_relay_view(xs: &[&RelayView]) -> RelayView {
    RelayView {
        transactions: med(xs, |v| Some(v.transactions as f64)).unwrap_or_default() as u64,
        within_50ms: med(xs, |v| Some(v.within_50ms)).unwrap_or_default(),
        within_5ms: med(xs, |v| v.within_5ms),
        within_15ms: med(xs, |v| v.within_15ms),
        p50_le_ms: upper_med(xs, |v| v.p50_le_ms),
        p99_le_ms: upper_med(xs, |v| v.p99_le_ms),
    }
}

fn median_consumer(xs: &[&ConsumerView]) -> ConsumerView {
    let lat: Vec<&Percentiles> = xs.iter().map(|c| &c.latency).collect();
    ConsumerView {
        latency: median_percentiles(&lat),
        read: xs.iter().map(|c| c.read).sum(),
        missing: xs.iter().map(|c| c.missing).sum(),
        duplicates: xs.iter().map(|c| c.duplicates).sum(),
    }
}

/// Keeps the `Some`s of `f` over `ps` (`None` when there are none).
fn some<'a, T>(
    ps: &[&'a LatencyPoint],
    f: impl Fn(&'a LatencyPoint) -> Option<&'a T>,
) -> Option<Vec<&'a T>> {
    let v: Vec<&T> = ps.iter().filter_map(|p| f(p)).collect();
    (!v.is_empty()).then_some(v)
}

/// One point standing for `ps` (one contestant, one load, ≥ 1 rounds): the median of each
/// latency, histogram, rate and CPU figure; counts (events, unacknowledged, read, missing,
/// verification) summed; peak RSS the highest; falling behind if it did in any round.
pub fn median_point(ps: &[&LatencyPoint]) -> LatencyPoint {
    let first = ps[0];
    let lat: Vec<&Percentiles> = ps.iter().map(|p| &p.latency).collect();
    let cpu: Vec<&LiveCpu> = ps.iter().map(|p| &p.cpu).collect();
    LatencyPoint {
        contestant: first.contestant,
        target_rate: first.target_rate,
        fraction_of_ceiling: first.fraction_of_ceiling,
        round: first.round,
        achieved_rate: med(ps, |p| Some(p.achieved_rate)).unwrap_or_default(),
        events: ps.iter().map(|p| p.events).sum(),
        latency: median_percentiles(&lat),
        unacked: ps.iter().map(|p| p.unacked).sum(),
        saturated: ps.iter().any(|p| p.saturated),
        peak_rss_kib: ps.iter().filter_map(|p| p.peak_rss_kib).max(),
        verified: some(ps, |p| p.verified.as_ref()).map(|v| Verified {
            expected: v.iter().map(|v| v.expected).sum(),
            distinct: v.iter().map(|v| v.distinct).sum(),
            duplicates: v.iter().map(|v| v.duplicates).sum(),
            out_of_order: v.iter().map(|v| v.out_of_order).sum(),
        }),
        relay_view: some(ps, |p| p.relay_view.as_ref()).map(|v| median_relay_view(&v)),
        cpu: median_cpu(&cpu),
        consumer_view: some(ps, |p| p.consumer_view.as_ref()).map(|v| median_consumer(&v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contest::Contestant;

    fn point(k: Contestant, rate: f64, round: usize, p50: f64, p99: f64) -> LatencyPoint {
        LatencyPoint {
            contestant: k,
            target_rate: rate,
            fraction_of_ceiling: Some(rate / 100_000.0),
            round,
            achieved_rate: rate - round as f64,
            events: 1_000,
            latency: Percentiles {
                p50_ms: p50,
                p99_ms: p99,
                max_ms: 2.0 * p99,
            },
            unacked: 0,
            saturated: p99 > 1_000.0,
            peak_rss_kib: Some(1_000 * round as u64),
            verified: None,
            relay_view: Some(RelayView {
                transactions: 100 * round as u64,
                within_50ms: 1.0,
                within_5ms: Some(0.1 * round as f64),
                within_15ms: None,
                p50_le_ms: [5.0, 7.5, 10.0][round - 1],
                p99_le_ms: 20.0,
            }),
            cpu: LiveCpu {
                relay: Some(10.0 * round as f64),
                ..LiveCpu::default()
            },
            consumer_view: None,
        }
    }

    #[test]
    fn medians_per_contestant_and_load_with_each_round_kept() {
        use Contestant::{Outboxd, Polling};
        // Three rounds, polling listed before outboxd; outboxd falls behind at 2000 ev/s in
        // round 2 and so never measures 3000 ev/s there.
        let pts = vec![
            point(Polling, 1_000.0, 1, 9.0, 20.0),
            point(Outboxd, 1_000.0, 1, 4.1, 9.0),
            point(Outboxd, 2_000.0, 1, 5.0, 12.0),
            point(Outboxd, 3_000.0, 1, 6.0, 14.0),
            point(Outboxd, 1_000.0, 2, 4.3, 11.0),
            point(Outboxd, 2_000.0, 2, 50.0, 1_500.0),
            point(Polling, 1_000.0, 2, 10.0, 30.0),
            point(Outboxd, 1_000.0, 3, 4.0, 10.0),
            point(Outboxd, 2_000.0, 3, 5.2, 13.0),
            point(Outboxd, 3_000.0, 3, 7.0, 16.0),
        ];
        let s = summarize(&pts, 3, &ORDER);
        let loads: Vec<(Contestant, f64, usize)> = s
            .iter()
            .map(|s| (s.median.contestant, s.median.target_rate, s.measured()))
            .collect();
        assert_eq!(
            loads,
            [
                (Outboxd, 1_000.0, 3),
                (Outboxd, 2_000.0, 3),
                (Outboxd, 3_000.0, 2),
                (Polling, 1_000.0, 2)
            ]
        );
        let low = &s[0].median;
        assert_eq!(low.latency.p50_ms, 4.1);
        assert_eq!(low.latency.p99_ms, 10.0);
        assert_eq!(low.latency.max_ms, 20.0);
        assert_eq!(low.achieved_rate, 998.0);
        assert_eq!(low.events, 3_000);
        assert_eq!(low.peak_rss_kib, Some(3_000));
        assert_eq!(low.cpu.relay, Some(20.0));
        assert_eq!(low.cpu.walsender, None);
        let v = low.relay_view.unwrap();
        assert_eq!(v.transactions, 200);
        assert!((v.within_5ms.unwrap() - 0.2).abs() < 1e-12);
        assert_eq!(v.within_15ms, None);
        assert_eq!(v.p50_le_ms, 7.5);
        assert_eq!(s[0].per_round(|p| p.latency.p50_ms), "4.1 / 4.3 / 4.0");
        assert_eq!(
            s[0].spread_cells(|p| p.latency),
            " 4.1 / 4.3 / 4.0 | 9.0 / 11.0 / 10.0 |"
        );
        // Falling behind in one round marks the point; the median still counts that round.
        assert_eq!(s[1].saturated(), 1);
        assert!(s[1].median.saturated);
        assert_eq!(s[1].median.latency.p99_ms, 13.0);
        // A round that skipped the load shows as "–"; the median is of the rounds measured.
        assert_eq!(s[2].per_round(|p| p.latency.p99_ms), "14.0 / – / 16.0");
        assert_eq!(s[2].median.latency.p99_ms, 15.0);
        // Two rounds of bucket bounds 5 and 10: the upper one, still a bucket bound.
        assert_eq!(s[2].median.relay_view.unwrap().p50_le_ms, 10.0);
        assert_eq!(s[3].per_round(|p| p.latency.p50_ms), "9.0 / 10.0 / –");
    }

    #[test]
    fn one_round_is_the_point_itself() {
        let p = point(Contestant::Outboxd, 1_000.0, 1, 4.1, 9.0);
        let s = summarize(std::slice::from_ref(&p), 1, &ORDER);
        assert_eq!(s.len(), 1);
        assert_eq!(
            serde_json::to_value(&s[0].median).unwrap(),
            serde_json::to_value(&p).unwrap()
        );
        assert_eq!(s[0].spread_cells(|p| p.latency), "");
        assert_eq!(spread_header(1, ""), "");
    }
}
