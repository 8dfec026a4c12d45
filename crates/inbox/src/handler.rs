//! The [`Handler`] trait: what a consumer implements, and the explicit version policy it states
//! (R22: how it treats a duplicate, the next version, and an unrecoverable gap).

use std::future::Future;
use std::time::Duration;

use serde_json::Value;
use tokio_postgres::Transaction;

use crate::envelope::Envelope;
use crate::error::HandlerError;

/// How a handler orders events of one aggregate. There is no default: each handler says it.
///
/// In both modes a duplicate (`event_id` already processed) returns the stored result without
/// running the handler, and the same `(aggregate, version)` under another `event_id` is a
/// conflict error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ordering {
    /// Events are independent (e.g. notifications): apply each once, in arrival order.
    Unordered,
    /// Strict per-aggregate sequence (balances, state machines): apply version `n + 1` after
    /// `n`; an event further ahead is held durably for up to `hold_for`, then
    /// [`Handler::on_gap_timeout`] is called; an older or equal version is recorded as stale and
    /// never overwrites newer state. The first version of an aggregate is 1.
    PerAggregate { hold_for: Duration },
}

/// A gap that stayed open past the hold window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gap {
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// Last version applied (0: none yet).
    pub current_version: i64,
    /// Versions held, ascending; the smallest is greater than `current_version + 1`.
    pub held_versions: Vec<i64>,
    /// How long the oldest held event has waited.
    pub waited: Duration,
}

/// What a gap hook decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GapResolution {
    /// The hook fetched the source of truth and wrote it in the given transaction; the state now
    /// corresponds to `version` (snapshots carry versions too). Held events up to `version` are
    /// recorded as superseded, later ones are applied in order. `version` must not be lower
    /// than the current one. Resolving to `held_versions[0] - 1` without writing anything
    /// accepts the gap as lost and applies the held events.
    Resynced { version: i64 },
    /// Keep holding (the alert has been raised); the hook is asked again after another window.
    KeepHolding,
}

/// A consumer's business logic. The inbox calls it inside the transaction that also records
/// `processed_event`, so the business change and the dedupe record commit or vanish together.
///
/// Handlers must not call external services from `apply` (that would hold the transaction open
/// over the network, R12, and could not be rolled back): record the intent with
/// [`crate::Ledger::record`] and perform it after commit.
pub trait Handler: Send + Sync {
    /// Stable consumer name: keys all inbox tables and the `consumer` metric label. Renaming
    /// it makes every event look new.
    fn name(&self) -> &str;

    /// The explicit version policy.
    fn ordering(&self) -> Ordering;

    /// Applies one event (the next version, under [`Ordering::PerAggregate`]). The returned
    /// value is stored and returned to redeliveries.
    fn apply(
        &self,
        tx: &Transaction<'_>,
        event: &Envelope,
    ) -> impl Future<Output = Result<Value, HandlerError>> + Send;

    /// A gap outlived the hold window: the alert has fired; fetch the source of truth (or
    /// decide to keep holding). Only called under [`Ordering::PerAggregate`]; an unordered
    /// handler returns [`GapResolution::KeepHolding`].
    fn on_gap_timeout(
        &self,
        tx: &Transaction<'_>,
        gap: &Gap,
    ) -> impl Future<Output = Result<GapResolution, HandlerError>> + Send;
}

/// Shares one handler between the consumer loop and other tasks (a gap hook's client, tests).
impl<H: Handler> Handler for std::sync::Arc<H> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn ordering(&self) -> Ordering {
        (**self).ordering()
    }

    fn apply(
        &self,
        tx: &Transaction<'_>,
        event: &Envelope,
    ) -> impl Future<Output = Result<Value, HandlerError>> + Send {
        (**self).apply(tx, event)
    }

    fn on_gap_timeout(
        &self,
        tx: &Transaction<'_>,
        gap: &Gap,
    ) -> impl Future<Output = Result<GapResolution, HandlerError>> + Send {
        (**self).on_gap_timeout(tx, gap)
    }
}
