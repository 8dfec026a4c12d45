//! `outboxd parked list|show|retry|discard`: the operator's repair path for parked events (R28).
//!
//! `retry` and `discard` only change the row (and write the audit trail) in one transaction; the
//! running relay publishes retried events — with the SAME `event_id` — and then releases the
//! events held behind them, in order, inside its own stream so nothing can overtake.

use crate::config::Config;
use crate::error::RelayError;
use crate::source;
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
    crate::parking::ensure_tables(&sql).await?;
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
                    // Store it the way Postgres renders jsonb, like every other payload.
                    let row = sql.query_one("SELECT $1::jsonb::text", &[&v]).await?;
                    Some(row.get::<_, String>(0).into_bytes())
                }
            };
            let tx = sql.transaction().await?;
            let row = tx
                .query_opt(
                    "SELECT payload FROM outbox_parked WHERE slot = $1 AND event_id = $2 AND state = 'parked' FOR UPDATE",
                    &[slot, &event_id],
                )
                .await?
                .ok_or_else(|| not_parked(&event_id))?;
            let old: Option<Vec<u8>> = row.get(0);
            tx.execute(
                "UPDATE outbox_parked SET state = 'retry', payload = coalesce($3, payload), last_seen = now() \
                 WHERE slot = $1 AND event_id = $2",
                &[slot, &event_id, &new_payload],
            )
            .await?;
            tx.execute(
                "INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason, old_payload, new_payload) \
                 VALUES ($1, $2, 'retry', $3, $4, $5, $6)",
                &[slot, &event_id, &operator, &reason, &new_payload.as_ref().map(|_| old), &new_payload],
            )
            .await?;
            tx.commit().await?;
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
            let tx = sql.transaction().await?;
            let n = tx
                .execute(
                    "UPDATE outbox_parked SET state = 'discarded', resolved_at = now() \
                     WHERE slot = $1 AND event_id = $2 AND state = 'parked'",
                    &[slot, &event_id],
                )
                .await?;
            if n == 0 {
                return Err(not_parked(&event_id));
            }
            tx.execute(
                "INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason) \
                 VALUES ($1, $2, 'discard', $3, $4)",
                &[slot, &event_id, &operator, &reason],
            )
            .await?;
            tx.commit().await?;
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
    let rows = sql
        .query(
            "SELECT event_id, state, coalesce(event_type, ''), coalesce(aggregate_type, ''), \
                    coalesce(aggregate_id, ''), aggregate_version, error_class, attempts, \
                    to_char(first_seen, 'YYYY-MM-DD\"T\"HH24:MI:SSOF'), error_message \
             FROM outbox_parked WHERE slot = $1 \
               AND ($2 OR state IN ('parked', 'blocked', 'retry')) ORDER BY id",
            &[&slot, &all],
        )
        .await?;
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "event_id": r.get::<_, String>(0), "state": r.get::<_, String>(1),
                    "event_type": r.get::<_, String>(2), "aggregate_type": r.get::<_, String>(3),
                    "aggregate_id": r.get::<_, String>(4), "aggregate_version": r.get::<_, Option<i64>>(5),
                    "error_class": r.get::<_, String>(6), "attempts": r.get::<_, i32>(7),
                    "first_seen": r.get::<_, String>(8), "error": r.get::<_, String>(9),
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
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, String>(2),
            format!("{}/{}", r.get::<_, String>(3), r.get::<_, String>(4)),
            r.get::<_, Option<i64>>(5)
                .map(|v| v.to_string())
                .unwrap_or_default(),
            r.get::<_, String>(6),
            r.get::<_, i32>(7),
            r.get::<_, String>(8),
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
    let r = sql
        .query_opt(
            "SELECT state, event_type, aggregate_type, aggregate_id, aggregate_version, topic, \
                    error_class, error_message, attempts, first_seen::text, last_seen::text, \
                    blocked_by, convert_from(payload, 'UTF8'), headers::text \
             FROM outbox_parked WHERE slot = $1 AND event_id = $2",
            &[&slot, &event_id],
        )
        .await?
        .ok_or_else(|| not_parked(event_id))?;
    let o = |i: usize| r.get::<_, Option<String>>(i).unwrap_or_default();
    let audit = sql
        .query(
            "SELECT at::text, action, operator, reason FROM outbox_parked_audit \
             WHERE slot = $1 AND event_id = $2 ORDER BY id",
            &[&slot, &event_id],
        )
        .await?;
    let mut out = format!(
        "event_id:      {event_id}\nstate:         {}\nevent_type:    {}\naggregate:     {}/{} v{}\ntopic:         {}\nerror:         [{}] {}\nattempts:      {}\nfirst_seen:    {}\nlast_seen:     {}\nblocked_by:    {}\nheaders:       {}\npayload:       {}\n",
        r.get::<_, String>(0), o(1), o(2), o(3),
        r.get::<_, Option<i64>>(4).map(|v| v.to_string()).unwrap_or_default(),
        o(5), r.get::<_, String>(6), r.get::<_, String>(7), r.get::<_, i32>(8),
        r.get::<_, String>(9), r.get::<_, String>(10), o(11), o(13), o(12),
    );
    for a in audit {
        out.push_str(&format!(
            "audit:         {} {} by {}: {}\n",
            a.get::<_, String>(0),
            a.get::<_, String>(1),
            a.get::<_, String>(2),
            a.get::<_, String>(3)
        ));
    }
    Ok(out)
}
