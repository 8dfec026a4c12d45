//! [`Inbox::sweep`]: the periodic pass over held events. It releases aggregates whose gap has
//! filled (repairing a crash between a commit and its drain), and for gaps older than the hold
//! window raises the alert and calls [`Handler::on_gap_timeout`] (R22).
//!
//! Time is a parameter ([`Inbox::sweep_at`]) so tests decide "the window has passed" without
//! sleeping; `held_at` is the consumer database's `now()` when the event was held.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::Client;
use uuid::Uuid;

use crate::db;
use crate::error::InboxError;
use crate::handler::{Gap, GapResolution, Handler, Ordering};
use crate::inbox::Inbox;
use crate::metrics;

/// What one sweep did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Held events applied because their predecessor is now there.
    pub released: Vec<Uuid>,
    /// Gaps that outlived the window: alert raised, hook called.
    pub timed_out: Vec<Gap>,
    /// `(aggregate_type, aggregate_id, version)` the hooks resynced to.
    pub resynced: Vec<(String, String, i64)>,
    /// Events still held after the sweep.
    pub held: i64,
}

struct HeldAggregate {
    aggregate_type: String,
    aggregate_id: String,
    min_version: i64,
    oldest_held_at: DateTime<Utc>,
    last_alert: Option<DateTime<Utc>>,
    current: i64,
}

impl<H: Handler> Inbox<H> {
    /// [`Inbox::sweep_at`] with the wall clock.
    pub async fn sweep(&self, client: &mut Client) -> Result<SweepReport, InboxError> {
        self.sweep_at(client, Utc::now()).await
    }

    /// One pass over the held events as of `now`. A gap's window starts when its oldest held
    /// event was held; after an alert whose hook chose [`GapResolution::KeepHolding`], the hook
    /// is asked again one window later (so the alert repeats while the gap stays open).
    pub async fn sweep_at(
        &self,
        client: &mut Client,
        now: DateTime<Utc>,
    ) -> Result<SweepReport, InboxError> {
        let mut report = SweepReport::default();
        let Ordering::PerAggregate { hold_for } = self.handler.ordering() else {
            return Ok(report);
        };
        let window = chrono::Duration::from_std(hold_for).unwrap_or(chrono::Duration::MAX);
        // An unrepresentable deadline never comes.
        let passed =
            |since: DateTime<Utc>| since.checked_add_signed(window).is_some_and(|d| d <= now);
        for agg in self.held_aggregates(client).await? {
            if agg.min_version <= agg.current + 1 {
                let released = self
                    .drain(client, &agg.aggregate_type, &agg.aggregate_id)
                    .await?;
                report.released.extend(released);
                continue;
            }
            let due = passed(agg.last_alert.unwrap_or(agg.oldest_held_at));
            if !due {
                continue;
            }
            let waited = (now - agg.oldest_held_at)
                .to_std()
                .unwrap_or(Duration::ZERO);
            self.gap_timeout(client, &agg, waited, now, &mut report)
                .await?;
        }
        report.held = client
            .query_one(
                "SELECT count(*) FROM inbox_held_event WHERE consumer = $1",
                &[&self.consumer()],
            )
            .await?
            .get(0);
        metrics::held_events(self.consumer(), report.held);
        Ok(report)
    }

    async fn held_aggregates(&self, client: &Client) -> Result<Vec<HeldAggregate>, InboxError> {
        let rows = client
            .query(
                "SELECT h.aggregate_type, h.aggregate_id, min(h.aggregate_version),
                        min(h.held_at), max(h.alerted_at), coalesce(max(v.version), 0)
                   FROM inbox_held_event h
                   LEFT JOIN inbox_aggregate_version v
                     ON v.consumer = h.consumer AND v.aggregate_type = h.aggregate_type
                    AND v.aggregate_id = h.aggregate_id
                  WHERE h.consumer = $1
                  GROUP BY h.aggregate_type, h.aggregate_id
                  ORDER BY min(h.held_at)",
                &[&self.consumer()],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| HeldAggregate {
                aggregate_type: r.get(0),
                aggregate_id: r.get(1),
                min_version: r.get(2),
                oldest_held_at: r.get(3),
                last_alert: r.get(4),
                current: r.get(5),
            })
            .collect())
    }

    async fn gap_timeout(
        &self,
        client: &mut Client,
        agg: &HeldAggregate,
        waited: Duration,
        now: DateTime<Utc>,
        report: &mut SweepReport,
    ) -> Result<(), InboxError> {
        let consumer = self.consumer();
        let (t, id) = (agg.aggregate_type.as_str(), agg.aggregate_id.as_str());
        let tx = client.transaction().await?;
        let current = db::lock_version(&tx, consumer, t, id).await?;
        let held_versions: Vec<i64> = tx
            .query(
                "SELECT aggregate_version FROM inbox_held_event
                  WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3
                  ORDER BY aggregate_version",
                &[&consumer, &t, &id],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        // Re-checked under the lock: the gap may have filled since the listing.
        let filled = match held_versions.first() {
            Some(&v) => v <= current + 1,
            None => true,
        };
        if filled {
            tx.commit().await?;
            report.released.extend(self.drain(client, t, id).await?);
            return Ok(());
        }
        let gap = Gap {
            aggregate_type: t.to_string(),
            aggregate_id: id.to_string(),
            current_version: current,
            held_versions,
            waited,
        };
        metrics::gap_timeout(consumer);
        tracing::error!(
            consumer,
            aggregate_type = t,
            aggregate_id = id,
            current_version = current,
            held_versions = ?gap.held_versions,
            waited_s = waited.as_secs_f64(),
            "ALERT: version gap outlived the hold window; asking the source of truth"
        );
        let resolution = self
            .handler
            .on_gap_timeout(&tx, &gap)
            .await
            .map_err(|source| InboxError::Handler {
                consumer: consumer.to_string(),
                event_id: Uuid::nil(),
                source,
            })?;
        match resolution {
            GapResolution::Resynced { version } => {
                if version < current {
                    return Err(InboxError::ResyncBackwards {
                        aggregate_type: t.to_string(),
                        aggregate_id: id.to_string(),
                        current,
                        to: version,
                    });
                }
                db::set_version(&tx, consumer, t, id, version).await?;
                let superseded = db::supersede_held(&tx, consumer, t, id, version).await?;
                tx.commit().await?;
                metrics::outcome(consumer, "superseded", superseded);
                tracing::info!(
                    consumer,
                    aggregate_type = t,
                    aggregate_id = id,
                    version,
                    superseded,
                    "aggregate resynced from the source of truth"
                );
                report
                    .resynced
                    .push((t.to_string(), id.to_string(), version));
                report.released.extend(self.drain(client, t, id).await?);
            }
            GapResolution::KeepHolding => {
                tx.execute(
                    "UPDATE inbox_held_event SET alerted_at = $4
                      WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3",
                    &[&consumer, &t, &id, &now],
                )
                .await?;
                tx.commit().await?;
            }
        }
        report.timed_out.push(gap);
        Ok(())
    }
}
