//! Side-effect ledger (R19): external calls (an email, a payment capture) cannot join the
//! database transaction, so each gets an operation key derived from `event_id` + effect name
//! and a row that moves `pending` → `done`, or to `unknown` when nobody can tell whether the
//! call happened. A non-idempotent call is therefore never repeated blindly.
//!
//! The flow:
//! 1. [`Ledger::record`] inside the handler's transaction: the intent commits atomically with
//!    the business change and `processed_event` (and vanishes with them).
//! 2. After commit, an effect runner lists [`Ledger::pending`] and calls [`Ledger::perform`]
//!    (or [`Ledger::claim`] + [`Ledger::complete`] / [`Ledger::mark_unknown`] /
//!    [`Ledger::not_performed`]). The claim commits *before* the call, so a crash during the
//!    call leaves a started attempt that the next claim turns into `unknown`.
//! 3. `unknown` needs reconciliation (ask the provider with the operation key, or an
//!    operator): [`Ledger::resolve_unknown`].

use std::future::Future;

use serde_json::Value;
use tokio_postgres::{Client, Transaction};
use uuid::Uuid;

use crate::error::InboxError;
use crate::metrics;

/// The operation key for one effect of one event: stable across redeliveries and retries, so
/// it can also be sent as the provider's idempotency key.
pub fn operation_key(event_id: Uuid, effect: &str) -> String {
    format!("{event_id}:{effect}")
}

/// Result of [`Ledger::claim`].
#[derive(Clone, Debug, PartialEq)]
pub enum Claim {
    /// Go ahead: this is attempt number `attempt` (1-based), and it is now recorded as started.
    Proceed { attempt: i32 },
    /// Already performed; here is what it returned.
    AlreadyDone { result: Option<Value> },
    /// A previous attempt started and never reported back (or reported a timeout). Do not call
    /// again blindly: reconcile.
    OutcomeUnknown { attempts: i32 },
}

/// How an external call ended, as the caller of [`Ledger::perform`] classifies it.
#[derive(Debug)]
pub enum EffectError {
    /// Definitely not performed (refused before sending, validation error): safe to retry.
    NotPerformed(String),
    /// May or may not have happened (timeout, connection lost after sending).
    Unknown(String),
}

/// Result of [`Ledger::perform`].
#[derive(Clone, Debug, PartialEq)]
pub enum EffectOutcome {
    Done(Value),
    AlreadyDone(Option<Value>),
    /// Back to pending; a later `perform` may try again.
    NotPerformed,
    /// Needs reconciliation; the call will not be repeated by the ledger.
    Unknown,
}

/// How an `unknown` entry was reconciled.
#[derive(Clone, Debug, PartialEq)]
pub enum Resolution {
    /// The provider confirms it happened.
    Done(Value),
    /// The provider confirms it did not happen: back to pending, to be performed again.
    NotPerformed,
}

/// A recorded effect waiting to be performed.
#[derive(Clone, Debug, PartialEq)]
pub struct PendingEffect {
    pub operation_key: String,
    pub event_id: Uuid,
    pub effect: String,
    pub request: Option<Value>,
}

/// The ledger of one consumer.
#[derive(Clone, Debug)]
pub struct Ledger {
    consumer: String,
}

impl Ledger {
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
        }
    }

    /// Records the intent inside the handler's transaction. Idempotent: recording the same
    /// `(event_id, effect)` twice keeps the first row. `request` is what the runner needs to
    /// perform the call; keep secrets out of it.
    pub async fn record(
        &self,
        tx: &Transaction<'_>,
        event_id: Uuid,
        effect: &str,
        request: &Value,
    ) -> Result<String, InboxError> {
        let key = operation_key(event_id, effect);
        tx.execute(
            "INSERT INTO inbox_side_effect (operation_key, consumer, event_id, effect, state,
                                            request)
             VALUES ($1, $2, $3, $4, 'pending', $5)
             ON CONFLICT (operation_key) DO NOTHING",
            &[&key, &self.consumer, &event_id, &effect, request],
        )
        .await?;
        Ok(key)
    }

    /// Pending effects not yet attempted, oldest first.
    pub async fn pending(
        &self,
        client: &Client,
        limit: i64,
    ) -> Result<Vec<PendingEffect>, InboxError> {
        let rows = client
            .query(
                "SELECT operation_key, event_id, effect, request FROM inbox_side_effect
                  WHERE consumer = $1 AND state = 'pending' AND started_at IS NULL
                  ORDER BY created_at LIMIT $2",
                &[&self.consumer, &limit],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| PendingEffect {
                operation_key: r.get(0),
                event_id: r.get(1),
                effect: r.get(2),
                request: r.get(3),
            })
            .collect())
    }

    /// Marks an attempt as started (committed before the external call) or reports why not.
    /// An attempt that was started and never finished turns into `unknown` here.
    pub async fn claim(&self, client: &Client, key: &str) -> Result<Claim, InboxError> {
        let row = client
            .query_opt(
                "WITH cur AS (
                    SELECT operation_key, state, started_at IS NOT NULL AS started
                      FROM inbox_side_effect WHERE operation_key = $1 FOR UPDATE)
                 UPDATE inbox_side_effect e SET
                    state = CASE WHEN cur.state = 'pending' AND cur.started THEN 'unknown'
                                 ELSE e.state END,
                    attempts = e.attempts + CASE WHEN cur.state = 'pending' AND NOT cur.started
                                                 THEN 1 ELSE 0 END,
                    started_at = CASE WHEN cur.state = 'pending' AND NOT cur.started
                                      THEN now() ELSE e.started_at END,
                    updated_at = now()
                   FROM cur WHERE e.operation_key = cur.operation_key
                 RETURNING cur.state, cur.started, e.state, e.attempts, e.result, e.effect",
                &[&key],
            )
            .await?
            .ok_or_else(|| InboxError::UnknownOperation(key.to_string()))?;
        let (old_state, started): (String, bool) = (row.get(0), row.get(1));
        let (state, attempts): (String, i32) = (row.get(2), row.get(3));
        Ok(match (old_state.as_str(), started) {
            ("pending", false) => Claim::Proceed { attempt: attempts },
            _ if state == "done" => Claim::AlreadyDone { result: row.get(4) },
            _ => {
                if old_state == "pending" {
                    let effect: String = row.get(5);
                    metrics::effect_unknown(&self.consumer, &effect);
                    tracing::error!(
                        consumer = %self.consumer,
                        operation_key = key,
                        attempts,
                        "side effect outcome unknown: an attempt started and never reported"
                    );
                }
                Claim::OutcomeUnknown { attempts }
            }
        })
    }

    /// The call succeeded (also valid from `unknown`: a late success report wins).
    pub async fn complete(
        &self,
        client: &Client,
        key: &str,
        result: &Value,
    ) -> Result<(), InboxError> {
        self.set(client, key, "done", Some(result), None, false)
            .await
    }

    /// The call may or may not have happened.
    pub async fn mark_unknown(
        &self,
        client: &Client,
        key: &str,
        error: &str,
    ) -> Result<(), InboxError> {
        self.set(client, key, "unknown", None, Some(error), false)
            .await?;
        let effect = key.split_once(':').map_or(key, |(_, e)| e);
        metrics::effect_unknown(&self.consumer, effect);
        Ok(())
    }

    /// The call certainly did not happen: back to pending, claimable again.
    pub async fn not_performed(
        &self,
        client: &Client,
        key: &str,
        error: &str,
    ) -> Result<(), InboxError> {
        self.set(client, key, "pending", None, Some(error), true)
            .await
    }

    /// Reconciles an `unknown` entry with what the provider (or an operator) established.
    pub async fn resolve_unknown(
        &self,
        client: &Client,
        key: &str,
        resolution: Resolution,
    ) -> Result<(), InboxError> {
        match resolution {
            Resolution::Done(v) => self.complete(client, key, &v).await,
            Resolution::NotPerformed => {
                self.set(
                    client,
                    key,
                    "pending",
                    None,
                    Some("reconciled: not performed"),
                    true,
                )
                .await
            }
        }
    }

    async fn set(
        &self,
        client: &Client,
        key: &str,
        state: &str,
        result: Option<&Value>,
        error: Option<&str>,
        reset_start: bool,
    ) -> Result<(), InboxError> {
        let n = client
            .execute(
                "UPDATE inbox_side_effect SET state = $2, result = coalesce($3, result),
                        last_error = coalesce($4, last_error),
                        started_at = CASE WHEN $5 THEN NULL ELSE started_at END,
                        updated_at = now()
                  WHERE operation_key = $1",
                &[&key, &state, &result, &error, &reset_start],
            )
            .await?;
        if n == 0 {
            return Err(InboxError::UnknownOperation(key.to_string()));
        }
        Ok(())
    }

    /// Claims, calls `call(operation_key)` if allowed, and records how it ended.
    pub async fn perform<F, Fut>(
        &self,
        client: &Client,
        key: &str,
        call: F,
    ) -> Result<EffectOutcome, InboxError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<Value, EffectError>>,
    {
        match self.claim(client, key).await? {
            Claim::AlreadyDone { result } => Ok(EffectOutcome::AlreadyDone(result)),
            Claim::OutcomeUnknown { .. } => Ok(EffectOutcome::Unknown),
            Claim::Proceed { .. } => match call(key.to_string()).await {
                Ok(v) => {
                    self.complete(client, key, &v).await?;
                    Ok(EffectOutcome::Done(v))
                }
                Err(EffectError::NotPerformed(e)) => {
                    self.not_performed(client, key, &e).await?;
                    Ok(EffectOutcome::NotPerformed)
                }
                Err(EffectError::Unknown(e)) => {
                    self.mark_unknown(client, key, &e).await?;
                    Ok(EffectOutcome::Unknown)
                }
            },
        }
    }
}
