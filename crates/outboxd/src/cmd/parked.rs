//! `outboxd parked list|show|retry|discard`: the operator's repair path for parked events (R28).
//!
//! `retry` and `discard` only change the row (and write the audit trail) in one transaction; the
//! running relay publishes retried events — with the SAME `event_id` — and then releases the
//! events held behind them, in order, inside its own stream so nothing can overtake.

use crate::config::Config;
use crate::error::RelayError;
use crate::poison::store::{self, operator};
use crate::relay::source;
use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum ParkedCmd {
    /// Parked, blocked and retrying events (`--all` includes delivered and discarded ones).
    List {
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// One parked event, with its error and its record.
    Show { event_id: String },
    /// Republish with the same event_id, optionally with a corrected payload (JSON file).
    Retry {
        event_id: String,
        #[arg(long)]
        payload: Option<PathBuf>,
        #[arg(long, env = "USER", default_value = "unknown")]
        operator: String,
        #[arg(long)]
        reason: String,
    },
    /// Give up on an event; requires a reason; audited; events held behind it are released.
    Discard {
        event_id: String,
        #[arg(long, env = "USER", default_value = "unknown")]
        operator: String,
        #[arg(long)]
        reason: String,
    },
}

pub async fn run(cfg: &Config, cmd: ParkedCmd) -> Result<String, RelayError> {
    let mut sql = source::sql_connect(cfg).await?;
    store::ensure_tables(&sql).await?;
    crate::obs::status_row::ensure_table(&sql).await?;
    let slot = &cfg.source.slot;
    match cmd {
        ParkedCmd::List { all, json } => list(&sql, slot, all, json).await,
        ParkedCmd::Show { event_id } => show(&sql, slot, &event_id).await,
        ParkedCmd::Retry {
            event_id,
            payload,
            operator,
            reason,
        } => {
            let new_payload = match payload {
                None => None,
                Some(p) => {
                    let bytes = std::fs::read(&p).map_err(|e| {
                        RelayError::Setup(format!("cannot read {}: {e}", p.display()))
                    })?;
                    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
                        RelayError::Setup(format!("{} is not JSON: {e}", p.display()))
                    })?;
                    Some(v)
                }
            };
            let req = operator::Request {
                slot,
                event_id: &event_id,
                operator: &operator,
                reason: &reason,
            };
            if !operator::request_retry(&mut sql, &req, new_payload.as_ref()).await? {
                return Err(not_parked(&event_id));
            }
            Ok(format!(
                "retry of {event_id} requested by {operator}; the running relay republishes it with the same event_id{}",
                if new_payload.is_some() { " and the corrected payload" } else { "" }
            ))
        }
        ParkedCmd::Discard {
            event_id,
            operator,
            reason,
        } => {
            if reason.trim().is_empty() {
                return Err(RelayError::Setup("discard needs a --reason".into()));
            }
            let req = operator::Request {
                slot,
                event_id: &event_id,
                operator: &operator,
                reason: &reason,
            };
            if !operator::discard(&mut sql, &req).await? {
                return Err(not_parked(&event_id));
            }
            Ok(format!(
                "{event_id} discarded by {operator} (audited); events held behind it will be released"
            ))
        }
    }
}

fn not_parked(event_id: &str) -> RelayError {
    RelayError::Setup(format!(
        "no parked event {event_id} for this slot (see `outboxd parked list`)"
    ))
}

async fn list(
    sql: &tokio_postgres::Client,
    slot: &str,
    all: bool,
    json: bool,
) -> Result<String, RelayError> {
    let rows = operator::list(sql, slot, all).await?;
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "event_id": r.event_id, "state": r.state,
                    "event_type": r.event_type, "aggregate_type": r.aggregate_type,
                    "aggregate_id": r.aggregate_id, "aggregate_version": r.aggregate_version,
                    "error_class": r.error_class, "attempts": r.attempts,
                    "first_seen": r.first_seen, "error": r.error_message,
                })
            })
            .collect();
        return Ok(serde_json::to_string_pretty(&v).unwrap_or_default());
    }
    let mut out = format!(
        "{:<36}  {:<9}  {:<20}  {:<24}  {:>7}  {:<14}  {:>3}  first_seen\n",
        "event_id", "state", "event_type", "aggregate", "version", "error_class", "try"
    );
    for r in &rows {
        out.push_str(&format!(
            "{:<36}  {:<9}  {:<20}  {:<24}  {:>7}  {:<14}  {:>3}  {}\n",
            r.event_id,
            r.state,
            r.event_type,
            format!("{}/{}", r.aggregate_type, r.aggregate_id),
            r.aggregate_version
                .map(|v| v.to_string())
                .unwrap_or_default(),
            r.error_class,
            r.attempts,
            r.first_seen,
        ));
    }
    out.push_str(&format!("{} event(s)", rows.len()));
    Ok(out)
}

async fn show(
    sql: &tokio_postgres::Client,
    slot: &str,
    event_id: &str,
) -> Result<String, RelayError> {
    let d = operator::show(sql, slot, event_id)
        .await?
        .ok_or_else(|| not_parked(event_id))?;
    let o = |v: &Option<String>| v.clone().unwrap_or_default();
    let mut out = format!(
        "event_id:      {event_id}\nstate:         {}\nevent_type:    {}\naggregate:     {}/{} v{}\ntopic:         {}\nerror:         [{}] {}\nattempts:      {}\nfirst_seen:    {}\nlast_seen:     {}\nblocked_by:    {}\nheaders:       {}\npayload:       {}\n",
        d.state, o(&d.event_type), o(&d.aggregate_type), o(&d.aggregate_id),
        d.aggregate_version.map(|v| v.to_string()).unwrap_or_default(),
        o(&d.topic), d.error_class, d.error_message, d.attempts,
        d.first_seen, d.last_seen, o(&d.blocked_by), o(&d.headers), o(&d.payload),
    );
    for (at, action, operator, reason) in &d.audit {
        out.push_str(&format!(
            "audit:         {at} {action} by {operator}: {reason}\n"
        ));
    }
    Ok(out)
}
