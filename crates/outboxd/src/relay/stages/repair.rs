//! The stages' side of poison events: parking a deterministic failure (or halting), holding
//! later events of a blocked aggregate, and releasing repaired ones one at a time, in order.
//! All SQL is in [`crate::poison::store`].

use super::Stages;
use crate::error::RelayError;
use crate::fail;
use crate::poison::policy::{OnPoison, Ordering};
use crate::poison::store::{self as parking, ParkState, ParkedRecord};
use crate::relay::kafka::{Producer, Verdict};
use crate::relay::route::Event;
use crate::relay::source::sql_bounded;

/// A parked event being republished (one at a time, in stream order).
pub(super) struct Releasing {
    id: i64,
    event_id: String,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
}

impl Stages {
    /// A deterministic failure: park (and block the aggregate if its policy says so) or halt.
    pub(super) async fn poison(
        &mut self,
        rec: ParkedRecord,
        class: &str,
        message: &str,
    ) -> Result<(), RelayError> {
        let event_type = rec.event_type.clone().unwrap_or_default();
        let pol = self.policy.for_type(&event_type);
        metrics::counter!(crate::obs::POISON, "event_type" => event_type.clone(), "class" => class.to_string())
            .increment(1);
        self.observed.errors.record(class, &event_type);
        if pol.on_poison == OnPoison::Halt {
            return Err(RelayError::Halted {
                event_id: rec.event_id,
                class: class.to_string(),
                message: message.to_string(),
            });
        }
        let blocks = pol.ordering == Ordering::Aggregate
            && rec.aggregate_type.is_some()
            && rec.aggregate_id.is_some();
        let state = sql_bounded(parking::park(
            &self.sql,
            &self.slot,
            &rec,
            ParkState::Parked,
            blocks,
            None,
            class,
            message,
        ))
        .await?;
        fail::hit("parked");
        tracing::error!(
            event_id = %rec.event_id,
            aggregate_id = rec.aggregate_id.as_deref().unwrap_or(""),
            aggregate_version = rec.aggregate_version,
            event_type = %event_type,
            class,
            state = %state,
            blocks_aggregate = blocks,
            "event parked: {message}"
        );
        if blocks && matches!(state.as_str(), "parked" | "blocked" | "retry") {
            if let (Some(t), Some(a)) = (rec.aggregate_type, rec.aggregate_id) {
                self.blocked.entry(t).or_default().insert(a, rec.event_id);
            }
        }
        Ok(())
    }

    /// A later event of a blocked aggregate waits, durably, behind the parked one.
    pub(super) async fn hold(&mut self, e: &Event<'_>, head: &str) -> Result<(), RelayError> {
        let rec = self.record_of(e);
        sql_bounded(parking::park(
            &self.sql,
            &self.slot,
            &rec,
            ParkState::Blocked,
            true,
            Some(head),
            "blocked",
            &format!(
                "held behind parked event {head} of the same aggregate (ordering = \"aggregate\")"
            ),
        ))
        .await?;
        metrics::counter!(crate::obs::BLOCKED, "event_type" => e.event_type.to_string())
            .increment(1);
        tracing::warn!(
            event_id = e.event_id,
            aggregate_id = e.aggregate_id,
            aggregate_version = e.aggregate_version.unwrap_or(""),
            event_type = e.event_type,
            blocked_by = head,
            "event held behind a parked event"
        );
        Ok(())
    }

    /// Periodic: pick up operator repairs (retry/discard) and refresh parked-event metrics.
    pub async fn repair_tick(&mut self, producer: &Producer) -> Result<(), RelayError> {
        let stats = parking::open_stats(&self.sql, &self.slot).await?;
        self.watch.parked_gauges(&stats);
        if self.releasing.is_none() {
            self.blocked = parking::blocked_aggregates(&self.sql, &self.slot).await?;
            self.release_next(producer).await?;
        }
        Ok(())
    }

    async fn release_next(&mut self, producer: &Producer) -> Result<(), RelayError> {
        let Some(r) = parking::next_release(&self.sql, &self.slot).await? else {
            return Ok(());
        };
        self.releasing = Some(Releasing {
            id: r.id,
            event_id: r.record.event_id.clone(),
            aggregate_type: r.record.aggregate_type.clone(),
            aggregate_id: r.record.aggregate_id.clone(),
        });
        // Its verdict, a synchronous refusal included, arrives as an Ack.
        producer.send_parked(&r.record, r.id).await;
        Ok(())
    }

    pub(super) async fn on_release_ack(
        &mut self,
        id: i64,
        verdict: Verdict,
        producer: &Producer,
    ) -> Result<(), RelayError> {
        let Some(rel) = self.releasing.take_if(|r| r.id == id) else {
            return Ok(());
        };
        match verdict {
            Verdict::Delivered => {
                parking::mark_delivered(&self.sql, rel.id).await?;
                tracing::info!(event_id = %rel.event_id, aggregate_id = rel.aggregate_id.as_deref().unwrap_or(""), "parked event delivered");
            }
            Verdict::Rejected { class, message, .. } => {
                parking::mark_failed(&self.sql, rel.id, class, &message).await?;
            }
            Verdict::Retriable { message, .. } => {
                // The row keeps its state and is tried again on the next tick.
                tracing::warn!(event_id = %rel.event_id, "release failed transiently: {message}");
                return Ok(());
            }
        }
        if let (Some(t), Some(a)) = (&rel.aggregate_type, &rel.aggregate_id) {
            if !parking::still_blocked(&self.sql, &self.slot, t, a).await? {
                if let Some(m) = self.blocked.get_mut(t) {
                    m.remove(a);
                }
            }
        }
        self.release_next(producer).await
    }
}
