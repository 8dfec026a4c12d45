//! What TLS to Kafka costs, in the report: outboxd through the bench's proxy to a second broker
//! ([`crate::kafka_hop`]), plain against TLS, in one transaction size's throughput runs and at
//! one live load; ratios within the run.

use super::{opt, LatencyPoint, Report, Summary};
use crate::contest::Contestant;
use std::fmt::Write as _;

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct KafkaTlsReport {
    /// The transaction size whose throughput runs include both hops.
    pub tx_size: usize,
    /// TLS version and cipher suite the proxy negotiated with the relay.
    pub negotiated: Option<String>,
    /// The live points: one per round and hop.
    pub latency: Vec<LatencyPoint>,
}

/// Medians over one hop's live points.
#[derive(Debug, Clone, Copy)]
pub struct LiveSummary {
    pub rounds: usize,
    pub offered: f64,
    pub fraction: Option<f64>,
    pub achieved: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub relay_us: Option<f64>,
    pub proxy_us: Option<f64>,
    pub broker_us: Option<f64>,
    pub walsender_us: Option<f64>,
    pub saturated: usize,
}

impl KafkaTlsReport {
    pub fn live(&self, k: Contestant) -> Option<LiveSummary> {
        let ps: Vec<&LatencyPoint> = self.latency.iter().filter(|p| p.contestant == k).collect();
        if ps.is_empty() {
            return None;
        }
        let m = super::rounds::median_point(&ps);
        Some(LiveSummary {
            rounds: ps.len(),
            offered: m.target_rate,
            fraction: m.fraction_of_ceiling,
            achieved: m.achieved_rate,
            p50_ms: m.latency.p50_ms,
            p99_ms: m.latency.p99_ms,
            relay_us: m.cpu.relay,
            proxy_us: m.cpu.proxy,
            broker_us: m.cpu.broker,
            walsender_us: m.cpu.walsender,
            saturated: ps.iter().filter(|p| p.saturated).count(),
        })
    }
}

/// One figure of a throughput summary, one of a live summary.
type Of = fn(&Summary) -> Option<f64>;
type LiveOf = fn(&LiveSummary) -> Option<f64>;

/// "×1.23 (+1.50)": the TLS figure against the plain one.
fn cost(plain: Option<f64>, tls: Option<f64>) -> String {
    match (plain, tls) {
        (Some(a), Some(b)) if a > 0.0 => format!("×{:.2} ({:+.2})", b / a, b - a),
        _ => "–".into(),
    }
}

impl Report {
    /// The two hops' throughput medians, from the scenario the comparison ran in.
    pub fn kafka_tls_throughput(&self) -> Option<(Summary, Summary)> {
        let k = self.kafka_tls.as_ref()?;
        let s = self.scenarios.iter().find(|s| s.tx_size == k.tx_size)?;
        Some((
            s.summary(Contestant::OutboxdViaProxy)?,
            s.summary(Contestant::OutboxdViaTls)?,
        ))
    }

    pub(crate) fn kafka_tls_markdown(&self, w: &mut String) {
        let Some(k) = &self.kafka_tls else { return };
        let Some(s) = self.scenarios.iter().find(|s| s.tx_size == k.tx_size) else {
            return;
        };
        let (Some(px), Some(tls)) = (
            s.summary(Contestant::OutboxdViaProxy),
            s.summary(Contestant::OutboxdViaTls),
        ) else {
            return;
        };
        let direct = s.summary(Contestant::Outboxd);
        let _ = writeln!(
            w,
            "#### What TLS to Kafka costs (transaction size {})\n\n\
             outboxd with its default configuration, producing to a second broker that is reachable \
             only through one proxy on a thread of the bench process. The proxy forwards the bytes \
             as they come (plain) or after ending TLS (rustls{}), with the same code, so the two \
             differ in TLS alone. The relay over TLS: `security.protocol = \"SSL\"`, \
             `ssl.ca.location` = the run's throwaway CA (librdkafka, OpenSSL). Relay CPU is the relay \
             process's (TLS client side); the proxy column is the proxy thread's (forwarding, plus the \
             TLS server side a broker's TLS listener would pay), counted in neither the relay nor the \
             broker; broker CPU is the second broker's. Backlog: runs of the throughput table above, \
             interleaved with the other contestants, the two hops taking turns going first. \
             \"outboxd\" is the same relay straight to the main broker, for the hop's own cost.\n",
            k.tx_size,
            k.negotiated
                .as_deref()
                .map_or(String::new(), |n| format!(", negotiated {n}"))
        );
        let _ = writeln!(
            w,
            "| per event | outboxd | {} | {} | TLS / plain |\n|---|---|---|---|---|",
            Contestant::OutboxdViaProxy.label(),
            Contestant::OutboxdViaTls.label()
        );
        let d = |f: Of, prec: usize| opt(direct.as_ref().and_then(f), prec);
        let _ = writeln!(
            w,
            "| backlog events/s (median of {}) | {} | {:.0} | {:.0} | **{:.0}%** |",
            px.runs.min(tls.runs),
            direct.map_or("–".into(), |x| format!("{:.0}", x.rate)),
            px.rate,
            tls.rate,
            100.0 * tls.rate / px.rate
        );
        let rows: [(&str, Of); 4] = [
            ("relay CPU µs", |x| x.relay_us),
            ("proxy CPU µs", |x| x.proxy_us),
            ("broker CPU µs", |x| x.broker_us),
            ("walsender CPU µs", |x| x.pg_us),
        ];
        for (what, f) in rows {
            let _ = writeln!(
                w,
                "| {what} | {} | {} | {} | {} |",
                d(f, 2),
                opt(f(&px), 2),
                opt(f(&tls), 2),
                cost(f(&px), f(&tls))
            );
        }
        let mib = |x: &Summary| x.rss_kib.map(|k| k as f64 / 1024.0);
        let _ = writeln!(
            w,
            "| relay peak RSS MiB | {} | {} | {} | {} |",
            opt(direct.as_ref().and_then(mib), 1),
            opt(mib(&px), 1),
            opt(mib(&tls), 1),
            cost(mib(&px), mib(&tls))
        );
        if let (Some(a), Some(b)) = (
            k.live(Contestant::OutboxdViaProxy),
            k.live(Contestant::OutboxdViaTls),
        ) {
            // The sweep's outboxd point at the same load, if there is one (its medians).
            let medians = self.latency_medians();
            let sweep = medians.iter().find(|p| {
                p.contestant == Contestant::Outboxd
                    && match (p.fraction_of_ceiling, a.fraction) {
                        (Some(x), Some(y)) => (x - y).abs() < 1e-9,
                        _ => (p.target_rate - a.offered).abs() < 0.5,
                    }
            });
            let load = format!(
                "{:.0} events/s offered{}",
                a.offered,
                a.fraction.map_or(String::new(), |f| format!(
                    " ({:.1}% of the ceiling)",
                    f * 100.0
                ))
            );
            let _ = writeln!(
                w,
                "| live, {load}: commit→ack p50 / p99 ms (median of {}) | {} | {:.1} / {:.1} | {:.1} / {:.1} | {:+.1} / {:+.1} ms |",
                a.rounds.min(b.rounds),
                sweep.map_or("–".into(), |p| format!(
                    "{:.1} / {:.1} (sweep)",
                    p.latency.p50_ms, p.latency.p99_ms
                )),
                a.p50_ms,
                a.p99_ms,
                b.p50_ms,
                b.p99_ms,
                b.p50_ms - a.p50_ms,
                b.p99_ms - a.p99_ms
            );
            let live: [(&str, LiveOf, Option<f64>); 4] = [
                (
                    "relay CPU µs",
                    |x| x.relay_us,
                    sweep.and_then(|p| p.cpu.relay),
                ),
                ("proxy CPU µs", |x| x.proxy_us, None),
                (
                    "broker CPU µs",
                    |x| x.broker_us,
                    sweep.and_then(|p| p.cpu.broker),
                ),
                (
                    "walsender CPU µs",
                    |x| x.walsender_us,
                    sweep.and_then(|p| p.cpu.walsender),
                ),
            ];
            for (what, f, sw) in live {
                let _ = writeln!(
                    w,
                    "| live: {what} | {} | {} | {} | {} |",
                    opt(sw, 1),
                    opt(f(&a), 1),
                    opt(f(&b), 1),
                    cost(f(&a), f(&b))
                );
            }
            if a.saturated + b.saturated > 0 {
                let _ = writeln!(
                    w,
                    "\nFalling behind (an event waited > 1 s) in {} plain and {} TLS round(s).",
                    a.saturated, b.saturated
                );
            }
        }
        let per_run = |c: Contestant| {
            s.runs
                .iter()
                .filter(|r| r.contestant == c)
                .map(|r| format!("{:.0}", r.rate))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let per_round = |c: Contestant| {
            k.latency
                .iter()
                .filter(|p| p.contestant == c)
                .map(|p| format!("{:.1}", p.latency.p99_ms))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let _ = write!(
            w,
            "\nRuns (events/s): plain {}; TLS {}",
            per_run(Contestant::OutboxdViaProxy),
            per_run(Contestant::OutboxdViaTls)
        );
        if !k.latency.is_empty() {
            let _ = write!(
                w,
                ". Live rounds (p99 ms): plain {}; TLS {}",
                per_round(Contestant::OutboxdViaProxy),
                per_round(Contestant::OutboxdViaTls)
            );
        }
        let _ = writeln!(w, ".\n");
    }
}
