//! All SQL of the shadow tables (`sql/070_outboxd_shadow.sql`): recording outcomes and reading
//! them back for `outboxd shadow report`.

use super::compare::Decided;
use crate::error::RelayError;
use std::collections::BTreeMap;
use tokio_postgres::Client;

pub const SHADOW_SQL: &str = include_str!("../../../../sql/070_outboxd_shadow.sql");

/// Non-matching events one relay process records one by one; beyond it only counts.
pub const MAX_DIFFS: u64 = 10_000;

pub async fn ensure_tables(sql: &Client) -> Result<(), RelayError> {
    let exists: bool = sql
        .query_one(
            "SELECT to_regclass('outboxd_shadow_counts') IS NOT NULL \
                AND to_regclass('outboxd_shadow_diffs') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    if !exists {
        sql.batch_execute(&crate::schema::unqualified(SHADOW_SQL))
            .await?;
    }
    Ok(())
}

/// Adds one tick's outcomes: counts per (type, result), and the non-matching events while
/// `diffs_left` lasts. One transaction.
pub async fn record(
    sql: &mut Client,
    slot: &str,
    decided: &[Decided],
    diffs_left: &mut u64,
) -> Result<(), RelayError> {
    let mut counts: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for d in decided {
        *counts
            .entry((d.event_type.as_str(), d.outcome.label()))
            .or_default() += 1;
    }
    let tx = sql.transaction().await?;
    for ((event_type, result), n) in counts {
        tx.execute(
            "INSERT INTO outboxd_shadow_counts (slot, event_type, result, events) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (slot, event_type, result) \
             DO UPDATE SET events = outboxd_shadow_counts.events + $4, last_at = now()",
            &[&slot, &event_type, &result, &n],
        )
        .await?;
    }
    for d in decided.iter().filter(|d| d.outcome.label() != "matched") {
        if *diffs_left == 0 {
            break;
        }
        *diffs_left -= 1;
        let fields: Option<Vec<String>> = match &d.outcome {
            super::compare::Outcome::Mismatched(f) => Some(f.clone()),
            _ => None,
        };
        tx.execute(
            "INSERT INTO outboxd_shadow_diffs (slot, event_id, event_type, result, fields) \
             VALUES ($1, $2, $3, $4, $5)",
            &[
                &slot,
                &d.event_id,
                &d.event_type,
                &d.outcome.label(),
                &fields,
            ],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// `outboxd shadow report`: counts per event type and outcome, the fields that differ most,
/// and the latest non-matching events.
pub async fn report(sql: &Client, slot: &str) -> Result<serde_json::Value, RelayError> {
    let counts = sql
        .query(
            "SELECT event_type, result, events, first_at, last_at FROM outboxd_shadow_counts \
             WHERE slot = $1 ORDER BY event_type, result",
            &[&slot],
        )
        .await?;
    let mut types: BTreeMap<String, serde_json::Map<String, serde_json::Value>> = BTreeMap::new();
    for r in &counts {
        let t: String = r.get(0);
        let e = types.entry(t).or_default();
        e.insert(r.get::<_, String>(1), r.get::<_, i64>(2).into());
    }
    let fields = sql
        .query(
            "SELECT event_type, f, count(*) FROM outboxd_shadow_diffs, unnest(fields) f \
             WHERE slot = $1 GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT 50",
            &[&slot],
        )
        .await?;
    for r in &fields {
        let e = types.entry(r.get::<_, String>(0)).or_default();
        let by_field = e
            .entry("mismatched_fields")
            .or_insert_with(|| serde_json::json!({}));
        by_field[r.get::<_, String>(1)] = r.get::<_, i64>(2).into();
    }
    let latest = sql
        .query(
            "SELECT event_id, event_type, result, fields, detected_at FROM outboxd_shadow_diffs \
             WHERE slot = $1 ORDER BY id DESC LIMIT 20",
            &[&slot],
        )
        .await?;
    let latest: Vec<serde_json::Value> = latest
        .iter()
        .map(|r| {
            serde_json::json!({
                "event_id": r.get::<_, String>(0),
                "event_type": r.get::<_, String>(1),
                "result": r.get::<_, String>(2),
                "fields": r.get::<_, Option<Vec<String>>>(3),
                "detected_at": r.get::<_, chrono::DateTime<chrono::Utc>>(4).to_rfc3339(),
            })
        })
        .collect();
    Ok(serde_json::json!({
        "slot": slot,
        "event_types": types,
        "latest_differences": latest,
    }))
}
