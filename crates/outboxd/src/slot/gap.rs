//! Which outbox rows a lost slot's gap holds, as SQL (docs/reliability.md, "The gap").
//!
//! The slot was a cursor over committed transactions; the state row's `delivered_xid` says
//! every transaction with a smaller id finished before the acknowledged position
//! ([`crate::slot::state::XidProbe`]). So every row the stream may not have delivered was
//! written by a transaction whose id is `delivered_xid` or later, and Postgres stamps that id on
//! the row itself: the system column `xmin`, which no application, backfill or clock can set.
//! Selecting `xmin`-from-the-mark-on therefore cannot miss a committed row, whatever its
//! `created_at` says, however long its transaction ran, and on whatever clock. It can select
//! more: rows updated since (an update stamps its own id) and rows written in a savepoint of
//! an older transaction; those are duplicates the inbox absorbs.
//!
//! `xmin` is 32 bits and wraps; `age(xmin)` is its distance back from the transaction counter,
//! the same for every row of one statement, so "id ≥ mark" is `age(xmin) <= age(mark)`. That
//! holds while the mark is less than 2^31 transactions old (Postgres freezes rows long before
//! that); a mark beyond it selects every row.
//!
//! The cost: `xmin` has no index, so a recovery reads the whole outbox table once (cleanup keeps
//! it small); the writers pay nothing. docs/benchmarks.md has the numbers.

use crate::error::RelayError;
use crate::relay::source::quote_ident;
use chrono::{DateTime, Utc};
use tokio_postgres::Client;

/// Which outbox rows a recovery republishes: those matching either bound that is set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gap {
    /// Rows written by transactions with this id or a later one: exact, whatever the rows'
    /// `created_at`, a transaction's length or the clocks ([`crate::slot::gap`]).
    pub from_xid: Option<u64>,
    /// Rows created at or after this time: an operator's range (`outboxd recover --since`).
    pub since: Option<DateTime<Utc>>,
}

impl std::fmt::Display for Gap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.from_xid, self.since) {
            (Some(x), None) => write!(f, "rows of transactions from id {x} on"),
            (None, Some(t)) => write!(f, "rows created since {}", t.to_rfc3339()),
            (Some(x), Some(t)) => write!(
                f,
                "rows of transactions from id {x} on and rows created since {}",
                t.to_rfc3339()
            ),
            (None, None) => write!(f, "no rows"),
        }
    }
}

/// A mark this far behind the transaction counter is past what `age()` can compare: every row
/// is selected (2^31 minus a margin for transactions that start while the statement runs).
const AGE_LIMIT: u64 = (1 << 31) - (1 << 27);

/// The gap as a condition over the outbox table's alias `o` (literals only: a cursor takes no
/// parameters). Reads the transaction counter as `client`'s snapshot sees it, so call it inside
/// the transaction that reads the rows.
pub async fn filter(
    client: &Client,
    gap: &Gap,
    created_at: Option<&str>,
) -> Result<String, RelayError> {
    let mut parts = Vec::new();
    if let Some(mark) = gap.from_xid {
        let next = next_xid(client).await?;
        parts.push(xid_condition(mark, next)?);
    }
    if let Some(since) = gap.since {
        let ts = created_at.ok_or_else(|| {
            RelayError::SlotLost(
                "a time range needs a created_at column (source.columns.created_at)".into(),
            )
        })?;
        parts.push(format!(
            "o.{} >= '{}'::timestamptz",
            quote_ident(ts),
            since.to_rfc3339()
        ));
    }
    if parts.is_empty() {
        return Err(RelayError::SlotLost(
            "nothing bounds the gap (no delivered_xid and no --since)".into(),
        ));
    }
    Ok(format!("({})", parts.join(" OR ")))
}

/// The next transaction id `client`'s current snapshot knows of.
pub async fn next_xid(client: &Client) -> Result<u64, RelayError> {
    let t: String = client
        .query_one("SELECT pg_snapshot_xmax(pg_current_snapshot())::text", &[])
        .await?
        .get(0);
    t.parse()
        .map_err(|_| RelayError::Postgres(format!("unreadable xid8 {t:?}")))
}

/// Rows of `o` written by transactions older than `mark`: delivered on the slot whose
/// `delivered_xid` it is (cleanup deletes only those). `None` when the mark is too old for
/// `age()` to compare (see the module docs): nothing can be said then.
pub fn older_than(mark: u64, next: u64) -> Option<String> {
    (mark <= next && next - mark < AGE_LIMIT)
        .then(|| format!("age(o.xmin) > age('{}'::xid)", mark & 0xFFFF_FFFF))
}

/// `age(xmin) <= age(mark)`, see the module docs.
fn xid_condition(mark: u64, next: u64) -> Result<String, RelayError> {
    if mark > next {
        return Err(RelayError::SlotLost(format!(
            "the delivery state's transaction id {mark} is ahead of this server's next one \
             ({next}): the state row was written on another history (a restore from another \
             server?), so its gap cannot be found by transaction id"
        )));
    }
    if next - mark >= AGE_LIMIT {
        return Ok("TRUE".into());
    }
    Ok(format!("age(o.xmin) <= age('{}'::xid)", mark & 0xFFFF_FFFF))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_condition_compares_ages_in_the_32_bit_space() {
        assert_eq!(
            xid_condition(5_000_000_123, 5_000_001_000).unwrap(),
            format!(
                "age(o.xmin) <= age('{}'::xid)",
                5_000_000_123u64 & 0xFFFF_FFFF
            )
        );
        assert_eq!(xid_condition(10, 10 + AGE_LIMIT).unwrap(), "TRUE");
        assert!(xid_condition(11, 10).is_err());
    }
}
