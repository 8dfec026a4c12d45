//! The latency-vs-offered-load chart as a self-contained SVG (no font or plotting dependency:
//! a handful of lines and labels are simpler to emit than to configure).

use crate::contest::Contestant;
use crate::report::Report;
use std::fmt::Write as _;

const W: f64 = 760.0;
const H: f64 = 440.0;
const L: f64 = 70.0;
const R: f64 = 180.0;
const T: f64 = 40.0;
const B: f64 = 55.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders p50 and p99 commit→ack latency (log scale) against the achieved offered load
/// (medians over the rounds of the latency phase).
pub fn latency_svg(r: &Report) -> String {
    let pts = &r.latency_medians();
    let x_max = pts
        .iter()
        .map(|p| p.achieved_rate.max(p.target_rate))
        .fold(r.latency_ceiling, f64::max)
        * 1.08;
    let y_hi = pts
        .iter()
        .map(|p| p.latency.max_ms.max(p.latency.p99_ms))
        .fold(100.0, f64::max);
    let (lo, hi) = (0.0_f64, y_hi.log10().ceil()); // 1 ms .. 10^hi ms
    let x = |v: f64| L + (v / x_max) * (W - L - R);
    let y = |ms: f64| {
        let l = ms.max(1.0).log10();
        H - B - (l - lo) / (hi - lo) * (H - T - B)
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">commit→ack latency vs offered load (tx size {}, open loop)</text>"#,
        (L + W - R) / 2.0,
        r.latency_tx_size
    );
    // Axes, grid and tick labels.
    let _ = writeln!(
        s,
        r#"<path d="M{L} {T} V{} H{}" stroke="black" fill="none"/>"#,
        H - B,
        W - R
    );
    for d in (lo as i32)..=(hi as i32) {
        let ms = 10f64.powi(d);
        let yy = y(ms);
        let _ = writeln!(
            s,
            r##"<line x1="{L}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - R,
            L - 6.0,
            yy + 4.0,
            if ms >= 1000.0 {
                format!("{} s", ms / 1000.0)
            } else {
                format!("{ms} ms")
            }
        );
    }
    let step = nice_step(x_max / 6.0);
    let mut v = 0.0;
    while v <= x_max {
        let xx = x(v);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{T}" y2="{}" stroke="#eee"/><text x="{xx:.1}" y="{}" text-anchor="middle">{}k</text>"##,
            H - B,
            H - B + 16.0,
            v / 1000.0
        );
        v += step;
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">offered load, events/s (achieved by the writers)</text>"#,
        (L + W - R) / 2.0,
        H - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(16 {}) rotate(-90)" text-anchor="middle">latency (log scale)</text>"#,
        (T + H - B) / 2.0
    );
    // Reference lines: the ceiling and the 50 ms target.
    let cx = x(r.latency_ceiling);
    let _ = writeln!(
        s,
        r##"<line x1="{cx:.1}" x2="{cx:.1}" y1="{T}" y2="{}" stroke="#888" stroke-dasharray="6 4"/><text x="{:.1}" y="{}" fill="#555">ceiling</text>"##,
        H - B,
        cx + 4.0,
        T + 12.0
    );
    // What the machine can carry at all: live writes with nothing else running, and the
    // live bound (writes + walsender + broker, a relay that costs nothing).
    let mut marks = vec![];
    if let Some(c) = r.write_capacity {
        marks.push((c.rate, "write capacity"));
    }
    if let Some(b) = r.live_bound(Contestant::Outboxd) {
        marks.push((b.max_rate, "live bound (CDC path)"));
    }
    for (i, (v, label)) in marks.iter().enumerate() {
        let mx = x(*v);
        let _ = writeln!(
            s,
            r##"<line x1="{mx:.1}" x2="{mx:.1}" y1="{T}" y2="{}" stroke="#7a4fb4" stroke-dasharray="3 3"/><text x="{:.1}" y="{}" fill="#7a4fb4" font-size="11">{label}</text>"##,
            H - B,
            mx + 4.0,
            T + 28.0 + 14.0 * i as f64
        );
    }
    let ty = y(50.0);
    let _ = writeln!(
        s,
        r##"<line x1="{L}" x2="{}" y1="{ty:.1}" y2="{ty:.1}" stroke="#c33" stroke-dasharray="2 3"/><text x="{}" y="{:.1}" fill="#c33">50 ms target (p99)</text>"##,
        W - R,
        W - R + 4.0,
        ty + 4.0
    );
    // Series.
    let series = [
        (Contestant::Outboxd, "p99", "#1f6fb4", ""),
        (Contestant::Outboxd, "p50", "#1f6fb4", "5 4"),
        (Contestant::OutboxdVariant, "p99", "#2a9d4b", ""),
        (Contestant::OutboxdVariant, "p50", "#2a9d4b", "5 4"),
        (Contestant::Polling, "p99", "#d9822b", ""),
        (Contestant::Polling, "p50", "#d9822b", "5 4"),
    ];
    for (i, (k, q, color, dash)) in series.iter().enumerate() {
        let ps: Vec<(f64, f64, bool)> = pts
            .iter()
            .filter(|p| p.contestant == *k)
            .map(|p| {
                let ms = if *q == "p99" {
                    p.latency.p99_ms
                } else {
                    p.latency.p50_ms
                };
                (x(p.achieved_rate), y(ms), p.saturated)
            })
            .collect();
        if ps.is_empty() {
            continue;
        }
        let d: Vec<String> = ps
            .iter()
            .enumerate()
            .map(|(j, (a, b, _))| format!("{}{a:.1} {b:.1}", if j == 0 { "M" } else { "L" }))
            .collect();
        let _ = writeln!(
            s,
            r#"<path d="{}" stroke="{color}" stroke-width="2" fill="none" stroke-dasharray="{dash}"/>"#,
            d.join(" ")
        );
        for (a, b, sat) in &ps {
            if *sat {
                let _ = writeln!(
                    s,
                    r#"<path d="M{} {} l8 8 m0 -8 l-8 8" stroke="{color}" stroke-width="2"/>"#,
                    a - 4.0,
                    b - 4.0
                );
            } else {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{a:.1}" cy="{b:.1}" r="3" fill="{color}"/>"#
                );
            }
        }
        let ly = T + 40.0 + i as f64 * 20.0;
        let _ = writeln!(
            s,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/><text x="{}" y="{}">{} {q}</text>"#,
            W - R + 10.0,
            W - R + 40.0,
            W - R + 46.0,
            ly + 4.0,
            esc(match k {
                Contestant::OutboxdVariant => "outboxd variant",
                _ => k.label().split(' ').next().unwrap_or(""),
            })
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" font-size="11">× = saturated</text>"#,
        W - R + 10.0,
        T + 170.0
    );
    s.push_str("</svg>\n");
    s
}

fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.max(1.0).log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= raw {
            return m * p;
        }
    }
    10.0 * p
}
