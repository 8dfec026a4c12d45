//! `processed_event` retention (R21, R39). A dedupe record pruned too early turns a later
//! redelivery into a "first" delivery, i.e. a second business effect. Two things can bring an
//! old event back: the broker (a consumer group reset, or a re-read within topic retention) and
//! a disaster recovery of the *producer* database from a backup, after which the relay
//! re-publishes every outbox row newer than the backup. The minimum covers both.

use std::time::Duration;

use tokio_postgres::Client;

use crate::error::InboxError;
use crate::metrics;

/// The floor below which pruning refuses to go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// How old a record the broker can still redeliver (topic `retention.ms`, plus any replay
    /// window the operators use).
    pub broker_redelivery: Duration,
    /// Age of the oldest producer backup that may be restored (plus the time to notice and
    /// restore).
    pub disaster_recovery: Duration,
}

impl RetentionPolicy {
    pub fn new(broker_redelivery: Duration, disaster_recovery: Duration) -> Self {
        Self {
            broker_redelivery,
            disaster_recovery,
        }
    }

    /// The longest window from which an already processed event can come back.
    pub fn minimum(&self) -> Duration {
        self.broker_redelivery.max(self.disaster_recovery)
    }

    /// Deletes `consumer`'s `processed_event` rows older than `keep_for`, in batches of
    /// `batch` rows (short transactions, no long DELETE), at most `max_batches` batches.
    /// Refuses with [`InboxError::RetentionTooShort`] when `keep_for` is below
    /// [`RetentionPolicy::minimum`]. Returns the number of rows deleted.
    pub async fn prune(
        &self,
        client: &Client,
        consumer: &str,
        keep_for: Duration,
        batch: i64,
        max_batches: u32,
    ) -> Result<u64, InboxError> {
        if keep_for < self.minimum() {
            return Err(InboxError::RetentionTooShort {
                requested: keep_for,
                minimum: self.minimum(),
            });
        }
        let keep_ms = i64::try_from(keep_for.as_millis()).unwrap_or(i64::MAX);
        let mut total = 0;
        for _ in 0..max_batches {
            let n = client
                .execute(
                    "DELETE FROM processed_event
                      WHERE (consumer, event_id) IN (
                            SELECT consumer, event_id FROM processed_event
                             WHERE consumer = $1
                               AND processed_at < now() - $2::bigint * interval '1 millisecond'
                             ORDER BY processed_at
                             LIMIT $3)",
                    &[&consumer, &keep_ms, &batch],
                )
                .await?;
            total += n;
            if n < batch as u64 {
                break;
            }
        }
        metrics::pruned(consumer, total);
        tracing::info!(
            consumer,
            deleted = total,
            keep_for_s = keep_for.as_secs(),
            "processed_event pruned"
        );
        Ok(total)
    }
}
