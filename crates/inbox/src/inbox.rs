//! [`Inbox`]: processes one event exactly once per handler, in the consumer's own database.
//!
//! Per event, one transaction: (lock the aggregate's version row) → look for the event id and
//! its `(aggregate, version)` → classify → insert `processed_event` → run the handler → commit.
//! The caller commits the Kafka offset only after [`Inbox::process`] returned `Ok` (R18, R20).

use chrono::Utc;
use serde_json::Value;
use tokio_postgres::{Client, Transaction};
use uuid::Uuid;

use crate::db;
use crate::envelope::Envelope;
use crate::error::{ConflictKind, InboxError};
use crate::handler::{Handler, Ordering};
use crate::metrics;

/// What happened to one event.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The handler ran and its transaction committed. `released` are held events of the same
    /// aggregate that this one unblocked and that were applied after it, in version order.
    Applied { result: Value, released: Vec<Uuid> },
    /// Already processed: the stored result, without running the handler (R20). `None` when the
    /// original was recorded as stale or superseded rather than applied.
    Duplicate { result: Option<Value> },
    /// Older than (or equal to) the version already applied and not seen before: recorded, not
    /// applied, so it never overwrites newer state (R22).
    Stale { current_version: i64 },
    /// Ahead of a missing version: stored durably in `inbox_held_event` until the gap fills or
    /// the hold window ends.
    Held { waiting_for: i64 },
    /// A redelivery of an event that is already held.
    AlreadyHeld,
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Outcome::Applied { .. } => "applied",
            Outcome::Duplicate { .. } => "duplicate",
            Outcome::Stale { .. } => "stale",
            Outcome::Held { .. } => "held",
            Outcome::AlreadyHeld => "duplicate",
        }
    }
}

/// The idempotent consumer for one [`Handler`]. Holds no connection; every call takes the
/// consumer database's client.
pub struct Inbox<H> {
    pub(crate) handler: H,
}

impl<H: Handler> Inbox<H> {
    pub fn new(handler: H) -> Self {
        Self { handler }
    }

    pub fn handler(&self) -> &H {
        &self.handler
    }

    pub(crate) fn consumer(&self) -> &str {
        self.handler.name()
    }

    fn ordered(&self) -> bool {
        matches!(self.handler.ordering(), Ordering::PerAggregate { .. })
    }

    /// Processes one event. On `Ok` everything is durable in the consumer database and the
    /// record's offset may be committed; on `Err` nothing of this event was committed.
    pub async fn process(
        &self,
        client: &mut Client,
        env: &Envelope,
    ) -> Result<Outcome, InboxError> {
        if let Some(d) = env.commit_to_consume_delay(Utc::now()) {
            metrics::delay(self.consumer(), &env.event_type, d);
        }
        // A lost insert race (a concurrent consumer committed the same id or version first)
        // re-classifies once; the second pass then sees a duplicate or a conflict.
        for _ in 0..3 {
            if let Some(outcome) = self.try_process(client, env).await? {
                metrics::outcome(self.consumer(), outcome.label(), 1);
                tracing::debug!(
                    consumer = self.consumer(),
                    event_id = %env.event_id,
                    aggregate_id = %env.aggregate_id,
                    aggregate_version = env.aggregate_version,
                    outcome = outcome.label(),
                    "event processed"
                );
                return Ok(outcome);
            }
        }
        // Three lost races on one event means the uniqueness rules and the lookups disagree.
        Err(self.conflict(
            env,
            ConflictKind::VersionTaken {
                existing_event_id: Uuid::nil(),
            },
        ))
    }

    /// `Ok(None)`: lost an insert race; try again.
    async fn try_process(
        &self,
        client: &mut Client,
        env: &Envelope,
    ) -> Result<Option<Outcome>, InboxError> {
        let consumer = self.consumer();
        let tx = client.transaction().await?;
        let current = if self.ordered() {
            Some(db::lock_version(&tx, consumer, &env.aggregate_type, &env.aggregate_id).await?)
        } else {
            None
        };

        if let Some(ex) = self.check_existing(&tx, "processed_event", env).await? {
            tx.rollback().await?;
            if self.ordered() {
                // Repair path: a crash after the original commit may have left the
                // aggregate's held successors unreleased.
                let released = self
                    .drain(client, &env.aggregate_type, &env.aggregate_id)
                    .await?;
                if !released.is_empty() {
                    tracing::info!(consumer, released = released.len(), "released held events");
                }
            }
            return Ok(Some(Outcome::Duplicate {
                result: ex.result.filter(|_| ex.outcome == "applied"),
            }));
        }
        let Some(current) = current else {
            return self.apply_in(tx, env, None).await;
        };
        if self
            .check_existing(&tx, "inbox_held_event", env)
            .await?
            .is_some()
        {
            return Ok(Some(Outcome::AlreadyHeld));
        }

        let v = env.aggregate_version;
        if v <= current {
            if !db::insert_processed(&tx, consumer, env, "stale").await? {
                return Ok(None);
            }
            tx.commit().await?;
            tracing::info!(
                consumer,
                event_id = %env.event_id,
                aggregate_id = %env.aggregate_id,
                aggregate_version = v,
                current_version = current,
                "stale event recorded, not applied"
            );
            return Ok(Some(Outcome::Stale {
                current_version: current,
            }));
        }
        if v > current + 1 {
            db::hold(&tx, consumer, env).await?;
            tx.commit().await?;
            tracing::warn!(
                consumer,
                event_id = %env.event_id,
                aggregate_id = %env.aggregate_id,
                aggregate_version = v,
                waiting_for = current + 1,
                "version gap: event held"
            );
            return Ok(Some(Outcome::Held {
                waiting_for: current + 1,
            }));
        }
        let outcome = self.apply_in(tx, env, Some(v)).await?;
        let Some(Outcome::Applied { result, .. }) = outcome else {
            return Ok(outcome);
        };
        let released = self
            .drain(client, &env.aggregate_type, &env.aggregate_id)
            .await?;
        Ok(Some(Outcome::Applied { result, released }))
    }

    /// `Some(row)`: the event id is recorded in `table` for the same identity (a duplicate);
    /// `Err(Conflict)`: it clashes with a recorded event; `None`: unseen.
    async fn check_existing(
        &self,
        tx: &Transaction<'_>,
        table: &'static str,
        env: &Envelope,
    ) -> Result<Option<db::Existing>, InboxError> {
        let rows = db::find_existing(tx, table, self.consumer(), env).await?;
        if let Some(same) = rows.iter().position(|r| r.event_id == env.event_id) {
            let ex = &rows[same];
            if !ex.same_identity(env) {
                return Err(self.conflict(
                    env,
                    ConflictKind::EventIdReused {
                        recorded_aggregate_id: ex.aggregate_id.clone(),
                        recorded_version: ex.version,
                    },
                ));
            }
            return Ok(rows.into_iter().nth(same));
        }
        if let Some(other) = rows.first() {
            return Err(self.conflict(
                env,
                ConflictKind::VersionTaken {
                    existing_event_id: other.event_id,
                },
            ));
        }
        Ok(None)
    }

    /// Inserts the dedupe row, runs the handler and commits. `new_version`: also advance the
    /// aggregate's version row (ordered handlers).
    async fn apply_in(
        &self,
        tx: Transaction<'_>,
        env: &Envelope,
        new_version: Option<i64>,
    ) -> Result<Option<Outcome>, InboxError> {
        let consumer = self.consumer();
        if !db::insert_processed(&tx, consumer, env, "applied").await? {
            return Ok(None);
        }
        let result = match self.handler.apply(&tx, env).await {
            Ok(r) => r,
            Err(source) => {
                // Dropping the transaction rolls back the business change AND processed_event
                // (R32): the redelivery is then processed as a first delivery.
                drop(tx);
                metrics::handler_error(consumer);
                tracing::warn!(
                    consumer,
                    event_id = %env.event_id,
                    aggregate_id = %env.aggregate_id,
                    aggregate_version = env.aggregate_version,
                    error = %source,
                    "handler failed; transaction rolled back"
                );
                return Err(InboxError::Handler {
                    consumer: consumer.to_string(),
                    event_id: env.event_id,
                    source,
                });
            }
        };
        db::store_result(&tx, consumer, env.event_id, &result).await?;
        if let Some(v) = new_version {
            db::set_version(&tx, consumer, &env.aggregate_type, &env.aggregate_id, v).await?;
        }
        tx.commit().await?;
        Ok(Some(Outcome::Applied {
            result,
            released: Vec::new(),
        }))
    }

    /// Applies held events of one aggregate that are now next in line, one transaction each,
    /// in version order. Safe to call any time (also from [`Inbox::sweep`]).
    pub(crate) async fn drain(
        &self,
        client: &mut Client,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Result<Vec<Uuid>, InboxError> {
        let consumer = self.consumer();
        let mut released = Vec::new();
        loop {
            let tx = client.transaction().await?;
            let current = db::lock_version(&tx, consumer, aggregate_type, aggregate_id).await?;
            let superseded =
                db::supersede_held(&tx, consumer, aggregate_type, aggregate_id, current).await?;
            if superseded > 0 {
                metrics::outcome(consumer, "superseded", superseded);
            }
            let Some(env) =
                db::take_held(&tx, consumer, aggregate_type, aggregate_id, current + 1).await?
            else {
                tx.commit().await?;
                return Ok(released);
            };
            match self.apply_in(tx, &env, Some(current + 1)).await? {
                Some(_) => {
                    metrics::outcome(consumer, "released", 1);
                    tracing::info!(
                        consumer,
                        event_id = %env.event_id,
                        aggregate_id,
                        aggregate_version = env.aggregate_version,
                        "held event released"
                    );
                    released.push(env.event_id);
                }
                // The held event's id or version is already in processed_event although it
                // was held: inconsistent input; surface it, never skip it.
                None => {
                    return Err(self.conflict(
                        &env,
                        ConflictKind::VersionTaken {
                            existing_event_id: Uuid::nil(),
                        },
                    ))
                }
            }
        }
    }

    pub(crate) fn conflict(&self, env: &Envelope, kind: ConflictKind) -> InboxError {
        metrics::conflict(self.consumer(), &env.aggregate_type);
        tracing::error!(
            consumer = self.consumer(),
            event_id = %env.event_id,
            aggregate_type = %env.aggregate_type,
            aggregate_id = %env.aggregate_id,
            aggregate_version = env.aggregate_version,
            kind = ?kind,
            "event conflict: not applied, not acknowledged"
        );
        InboxError::Conflict {
            event_id: env.event_id,
            aggregate_type: env.aggregate_type.clone(),
            aggregate_id: env.aggregate_id.clone(),
            version: env.aggregate_version,
            kind,
        }
    }
}
