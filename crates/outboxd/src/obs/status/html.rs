//! The status page as server-rendered HTML: every fact is in the page as sent, so it reads
//! without JavaScript; the embedded script (`page.js`) only refreshes it from `/status.json`.
//! Everything is embedded (no CDN, no fonts): it works on an air-gapped host. Every value is
//! HTML-escaped ([`esc`]): event ids, aggregates and reasons come from rows anyone who can
//! write the outbox controls.

use super::facts::Facts;
use super::history::{polyline, CHART_H, CHART_W};
use std::fmt::Write;

const CSS: &str = include_str!("page.css");
const JS: &str = include_str!("page.js");

/// A dot on the newest sample (a chart of one sample is otherwise empty).
fn last_point(samples: &[super::history::Sample]) -> String {
    let pts = polyline(samples);
    match pts.rsplit(' ').next().and_then(|p| p.split_once(',')) {
        Some((x, y)) => format!("<circle id=\"lag-dot\" r=\"3\" cx=\"{x}\" cy=\"{y}\"/>"),
        None => "<circle id=\"lag-dot\" r=\"0\" cx=\"0\" cy=\"0\"/>".into(),
    }
}

/// The page's script, as embedded (the Content-Security-Policy allows it by its hash).
pub fn script() -> &'static str {
    JS
}

/// `text` safe inside HTML text and double- or single-quoted attributes.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "—".into())
}

fn secs(v: Option<f64>) -> String {
    v.map(|s| format!("{s:.1} s")).unwrap_or_else(|| "—".into())
}

/// A row `<tr><th>label</th><td data-k="key">value</td></tr>` (the script updates `data-k`).
fn row(out: &mut String, label: &str, key: &str, value: &str) {
    let _ = write!(
        out,
        "<tr><th>{}</th><td data-k=\"{}\">{}</td></tr>",
        esc(label),
        esc(key),
        esc(value)
    );
}

/// The page for `f`. The script fetches `/status.json` with the page's own query string (a
/// `token` given there).
pub fn page(f: &Facts) -> String {
    let mut o = String::with_capacity(16 * 1024);
    let _ = write!(
        o,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>outboxd {role} · {slot}</title><style>{CSS}</style></head><body>\
         <header><h1>outboxd <span class=\"role role-{role}\" data-k=\"role\">{role}</span></h1>\
         <p>slot <b data-k=\"slot.name\">{slot}</b> · instance <span data-k=\"instance\">{inst}</span> · \
         version <span data-k=\"version\">{ver}</span> · <span id=\"refreshed\">static page (generated {gen})</span></p></header><main>",
        role = esc(&f.role),
        slot = esc(&f.slot.name),
        inst = esc(&f.instance),
        ver = esc(&f.version),
        gen = esc(&f.generated_at),
    );
    o.push_str("<section><h2>Relay</h2><table>");
    row(&mut o, "Role", "role", &f.role);
    row(&mut o, "Ready", "ready", if f.ready { "yes" } else { "no" });
    row(
        &mut o,
        "Not ready because",
        "not_ready",
        &opt(f.not_ready.as_deref()),
    );
    row(&mut o, "Slot", "slot.name", &f.slot.name);
    row(&mut o, "Slot lives on", "slot.location", &f.slot.location);
    row(
        &mut o,
        "Slot holder",
        "slot.holder",
        &opt(f.slot.holder.as_deref()),
    );
    row(
        &mut o,
        "Confirmed LSN",
        "slot.confirmed_lsn",
        &opt(f.slot.confirmed_lsn.as_deref()),
    );
    row(
        &mut o,
        "Lag (bytes)",
        "slot.lag_bytes",
        &opt(f.slot.lag_bytes.map(|b| b as u64)),
    );
    row(
        &mut o,
        "Lag (time)",
        "slot.lag_seconds",
        &secs(f.slot.lag_seconds),
    );
    row(
        &mut o,
        "Events relayed",
        "events.relayed",
        &f.events.relayed.to_string(),
    );
    row(
        &mut o,
        "Rate (events/s)",
        "events.rate_per_second",
        &format!("{:.1}", f.events.rate_per_second),
    );
    row(
        &mut o,
        "Pending events",
        "events.pending",
        &f.events.pending.to_string(),
    );
    row(&mut o, "Build features", "features", &f.features.join(", "));
    o.push_str("</table></section>");

    let _ = write!(
        o,
        "<section><h2>Lag, last hour</h2><svg id=\"chart\" viewBox=\"0 0 {CHART_W} {CHART_H}\" \
         width=\"{CHART_W}\" height=\"{CHART_H}\" role=\"img\" aria-label=\"slot lag in bytes over the last hour\">\
         <rect width=\"{CHART_W}\" height=\"{CHART_H}\" class=\"bg\"/>\
         <polyline id=\"lag-line\" points=\"{}\"/>{}</svg><p class=\"note\">max <span id=\"lag-max\">{}</span> bytes</p></section>",
        polyline(&f.lag_history),
        last_point(&f.lag_history),
        f.lag_history.iter().map(|s| s.lag_bytes as u64).max().unwrap_or(0),
    );

    o.push_str("<section><h2>Oldest undelivered, per type</h2><table id=\"oldest\"><thead><tr><th>Event type</th><th>Age</th></tr></thead><tbody>");
    for t in &f.oldest_undelivered {
        let _ = write!(
            o,
            "<tr><td>{}</td><td>{}</td></tr>",
            esc(&t.event_type),
            esc(&secs(Some(t.age_seconds)))
        );
    }
    o.push_str("</tbody></table></section>");

    let _ = write!(
        o,
        "<section><h2>Parked and held events: <span data-k=\"parked.count\">{}</span></h2>\
         <table id=\"parked\"><thead><tr><th>Event id</th><th>Aggregate</th><th>Type</th><th>State</th>\
         <th>Reason</th><th>Age</th><th>Fix</th></tr></thead><tbody>",
        f.parked.count
    );
    for p in &f.parked.events {
        let _ = write!(
            o,
            "<tr><td class=\"id\">{}</td><td>{}/{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&p.event_id),
            esc(&p.aggregate_type),
            esc(&p.aggregate_id),
            esc(&p.event_type),
            esc(&p.state),
            esc(&p.reason_class),
            esc(&secs(p.age_seconds)),
            esc(&p.fix)
        );
    }
    o.push_str("</tbody></table></section>");

    o.push_str("<section><h2>Last errors</h2><table id=\"errors\"><thead><tr><th>At</th><th>Class</th><th>Message</th><th>Fix</th></tr></thead><tbody>");
    for e in &f.errors.last {
        let _ = write!(
            o,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&e.at),
            esc(&e.class),
            esc(&e.message),
            esc(&e.fix)
        );
    }
    o.push_str("</tbody></table><p class=\"note\">counts per class: <span id=\"error-counts\">");
    let counts: Vec<String> = f
        .errors
        .counts
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    o.push_str(&esc(&counts.join(", ")));
    o.push_str("</span></p></section>");

    let config = serde_json::to_string_pretty(&f.config).unwrap_or_default();
    let _ = write!(
        o,
        "<section><h2>Effective configuration (secrets redacted)</h2><pre id=\"config\">{}</pre></section>",
        esc(&config)
    );
    let _ = write!(o, "</main><script>{JS}</script></body></html>");
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::obs::status::facts::ParkedEvent;

    #[test]
    fn row_values_are_escaped() {
        assert_eq!(
            esc("<a href='x'>&\"</a>"),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;&lt;/a&gt;"
        );
        let mut f = Facts::default();
        f.parked.events.push(ParkedEvent {
            event_id: "<script>alert(1)</script>".into(),
            fix: "\"><img src=x onerror=alert(1)>".into(),
            ..Default::default()
        });
        let html = page(&f);
        assert!(!html.contains("<script>alert(1)"), "escaped");
        assert!(!html.contains("<img src=x"), "escaped");
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    }
}
