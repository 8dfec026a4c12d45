//! The batch of released parked events out for their acknowledgements (issue 55).
//!
//! A batch's rows are sent together, each only after the row it follows in its aggregate
//! (`prev`, see `poison::store::release`) was sent in the same batch; the idempotent producer
//! keeps them in that order per partition. When every verdict is in, the batch settles in one
//! transaction: a row counts as delivered only when the row it follows did too. A row the
//! broker refused becomes a parked head again, and the rows after it stay held (one the
//! broker had already taken behind it is published again after the head's repair: a
//! duplicate with the same `event_id`, never a loss).

use crate::error::RelayError;
use crate::poison::store::{release, Blocked};
use crate::relay::kafka::Verdict;

/// What became of one sent row.
enum Outcome {
    Waiting,
    Delivered,
    /// Refused by the broker: parked again with the class and reason.
    Failed(&'static str, String),
    /// A transient failure: the row keeps its state and goes again in a later batch.
    Later,
}

/// One released row out for its verdict.
pub struct Sent {
    pub id: i64,
    /// The row of its aggregate it follows, sent earlier in this batch.
    pub prev: Option<i64>,
    pub event_id: String,
    pub aggregate: Option<(String, String)>,
    /// The published-events counter it counts under once delivered.
    pub published: metrics::Counter,
    outcome: Outcome,
}

impl Sent {
    pub fn new(
        id: i64,
        prev: Option<i64>,
        event_id: String,
        aggregate: Option<(String, String)>,
        published: metrics::Counter,
    ) -> Self {
        Self {
            id,
            prev,
            event_id,
            aggregate,
            published,
            outcome: Outcome::Waiting,
        }
    }
}

/// The batch in flight (empty between batches).
#[derive(Default)]
pub struct InFlight {
    rows: Vec<Sent>,
    waiting: usize,
}

/// A settled batch: what to write, and the aggregates whose holds to read again.
#[derive(Default)]
pub struct Settled {
    pub delivered: Vec<i64>,
    pub failed: Vec<(i64, &'static str, String)>,
    /// Delivered by the broker behind a row that was not: they stay held (see the module docs).
    pub kept: Vec<String>,
    pub aggregates: Vec<(String, String)>,
}

impl InFlight {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn push(&mut self, s: Sent) {
        self.rows.push(s);
        self.waiting += 1;
    }

    /// Records the verdict on row `id`; true when it was the batch's last.
    pub fn on_ack(&mut self, id: i64, verdict: Verdict) -> bool {
        let Some(s) = self
            .rows
            .iter_mut()
            .find(|s| s.id == id && matches!(s.outcome, Outcome::Waiting))
        else {
            return false;
        };
        s.outcome = match verdict {
            Verdict::Delivered => Outcome::Delivered,
            Verdict::Rejected { class, message, .. } => Outcome::Failed(class, message),
            Verdict::Retriable { message, .. } => {
                tracing::warn!(event_id = %s.event_id, "release failed transiently: {message}");
                Outcome::Later
            }
        };
        self.waiting -= 1;
        self.waiting == 0
    }

    /// Every verdict is in: what the batch's transaction writes (rows in stream order).
    pub fn settle(&mut self) -> Settled {
        let mut out = Settled::default();
        let mut ok: Vec<i64> = Vec::new();
        for s in std::mem::take(&mut self.rows) {
            let follows = s.prev.is_none_or(|p| ok.contains(&p));
            if let Some(a) = &s.aggregate {
                if !out.aggregates.contains(a) {
                    out.aggregates.push(a.clone());
                }
            }
            match s.outcome {
                Outcome::Delivered if follows => {
                    s.published.increment(1);
                    tracing::info!(event_id = %s.event_id, aggregate_id = s.aggregate.as_ref().map_or("", |a| a.1.as_str()), "parked event delivered");
                    ok.push(s.id);
                    out.delivered.push(s.id);
                }
                Outcome::Delivered => out.kept.push(s.event_id),
                Outcome::Failed(class, message) => out.failed.push((s.id, class, message)),
                Outcome::Later | Outcome::Waiting => {}
            }
        }
        self.waiting = 0;
        if let Some(first) = out.kept.first() {
            tracing::warn!(
                kept = out.kept.len(),
                first = %first,
                "released events the broker took behind one it refused stay held: they go again, \
                 with the same event_id, after that one is repaired"
            );
        }
        out
    }
}

/// The heads of a settled batch's aggregates in every table, afresh: the batch may have freed
/// its own table's hold and no other.
pub async fn refresh_heads(
    sql: &tokio_postgres::Client,
    slot: &str,
    blocked: &mut Blocked,
    settled: &Settled,
) -> Result<(), RelayError> {
    if settled.aggregates.is_empty() {
        return Ok(());
    }
    let heads = release::heads_of_many(sql, slot, &settled.aggregates).await?;
    for (t, a) in &settled.aggregates {
        let now = heads.get(t).and_then(|ids| ids.get(a)).cloned();
        let ids = blocked.entry(t.clone()).or_default();
        match now {
            None => ids.remove(a),
            Some(h) => ids.insert(a.clone(), h),
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(id: i64, prev: Option<i64>) -> Sent {
        Sent::new(id, prev, format!("e{id}"), None, metrics::Counter::noop())
    }

    #[test]
    fn a_row_counts_as_delivered_only_behind_a_delivered_row() {
        let mut f = InFlight::default();
        for (id, prev) in [
            (1, None),
            (2, Some(1)),
            (3, Some(2)),
            (4, None),
            (5, Some(4)),
        ] {
            f.push(sent(id, prev));
        }
        let record = crate::poison::record::ParkedRecord::default();
        assert!(!f.on_ack(1, Verdict::Delivered));
        assert!(!f.on_ack(9, Verdict::Delivered), "not of this batch");
        let rejected = Verdict::Rejected {
            class: "too_large",
            message: "m".into(),
            record,
        };
        assert!(!f.on_ack(2, rejected));
        assert!(!f.on_ack(3, Verdict::Delivered));
        assert!(!f.on_ack(5, Verdict::Delivered));
        assert!(f.on_ack(4, Verdict::Delivered));
        let s = f.settle();
        assert_eq!(s.delivered, [1, 4, 5]);
        assert_eq!(s.failed.iter().map(|f| f.0).collect::<Vec<_>>(), [2]);
        assert_eq!(s.kept, ["e3"]);
        assert!(f.is_empty());
    }
}
