//! What the relay hands the status page (`obs::status`) of its parked events: obs imports no
//! other stage, so the rows `poison::store::operator::list` reads are turned into obs's plain
//! values here, with their fix.

use crate::obs::status::facts::{age_of, parked_fix, ParkedEvent};
use crate::poison::store::operator::Listed;

/// When the status page is due new facts: the open parked events (at most what it shows) and
/// their `count`.
pub async fn refresh(
    sql: &tokio_postgres::Client,
    slot: &str,
    observed: &crate::obs::Observed,
    count: i64,
) -> Result<(), crate::error::RelayError> {
    if observed.status.parked_due() {
        let shown = Some(crate::obs::status::PARKED_SHOWN as i64);
        let rows = crate::poison::store::operator::list_at_most(sql, slot, false, shown).await?;
        observed.status.parked(count, parked(rows));
    }
    Ok(())
}

/// The page's view of open parked and held events (oldest first, as listed).
pub fn parked(rows: Vec<Listed>) -> Vec<ParkedEvent> {
    rows.into_iter()
        .take(crate::obs::status::PARKED_SHOWN)
        .map(|r| {
            let reason_class = if r.state == "blocked" {
                "blocked".to_string()
            } else {
                r.error_class.clone()
            };
            ParkedEvent {
                fix: parked_fix(&r.error_class, &r.state, &r.event_id),
                age_seconds: age_of(&r.first_seen),
                event_id: r.event_id,
                aggregate_type: r.aggregate_type,
                aggregate_id: r.aggregate_id,
                event_type: r.event_type,
                state: r.state,
                reason_class,
            }
        })
        .collect()
}
