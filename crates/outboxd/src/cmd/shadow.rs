//! `outboxd shadow report [--json]`: what shadow mode found so far (`crate::shadow`), per event
//! type, with the fields that differ most and the latest differing events — the evidence for
//! switching a type to real delivery (`shadow.deliver_types`).

use crate::config::Config;
use crate::relay::source;
use std::fmt::Write;

#[derive(clap::Subcommand, Debug)]
pub enum ShadowCmd {
    /// Events per type: matched, mismatched (which fields), missing on either side.
    Report {
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(cfg: &Config, cmd: ShadowCmd) -> anyhow::Result<String> {
    let ShadowCmd::Report { json } = cmd;
    let sql = source::sql_connect(cfg).await?;
    crate::shadow::store::ensure_tables(&sql).await?;
    let v = crate::shadow::store::report(&sql, &cfg.source.slot).await?;
    if json {
        return Ok(serde_json::to_string_pretty(&v)? + "\n");
    }
    Ok(render(&v))
}

fn render(v: &serde_json::Value) -> String {
    let mut out = String::new();
    let types = v["event_types"].as_object().cloned().unwrap_or_default();
    if types.is_empty() {
        return "no shadow results yet (is shadow.enabled set and the relay running?)\n".into();
    }
    let _ = writeln!(
        out,
        "{:<32} {:>10} {:>10} {:>14} {:>14}  differing fields",
        "event type", "matched", "mismatched", "missing_legacy", "missing_outbox"
    );
    let n = |t: &serde_json::Value, k: &str| t[k].as_i64().unwrap_or(0);
    for (name, t) in &types {
        let fields: Vec<String> = t["mismatched_fields"]
            .as_object()
            .map(|m| m.iter().map(|(f, c)| format!("{f} ({c})")).collect())
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<32} {:>10} {:>10} {:>14} {:>14}  {}",
            super::parked::printable(name),
            n(t, "matched"),
            n(t, "mismatched"),
            n(t, "missing_legacy"),
            n(t, "missing_outbox"),
            fields.join(", ")
        );
    }
    let latest = v["latest_differences"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !latest.is_empty() {
        let _ = writeln!(out, "\nlatest differences:");
        for d in latest {
            let _ = writeln!(
                out,
                "  {}  {}  {}  {}{}",
                d["detected_at"].as_str().unwrap_or(""),
                d["event_id"]
                    .as_str()
                    .map(super::parked::printable)
                    .unwrap_or_default(),
                d["event_type"]
                    .as_str()
                    .map(super::parked::printable)
                    .unwrap_or_default(),
                d["result"].as_str().unwrap_or(""),
                d["fields"]
                    .as_array()
                    .map(|f| format!(
                        " ({})",
                        f.iter()
                            .filter_map(|x| x.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                    .unwrap_or_default()
            );
        }
    }
    out
}
