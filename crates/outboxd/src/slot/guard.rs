//! Slot-loss detection: what the slot, the state row ([`crate::slot::state`]) and the server's
//! identity say together, decided once per session before anything streams.
//!
//! | state row | slot | decision |
//! |---|---|---|
//! | none | none | first start: create the slot, publish nothing already in the table |
//! | none | present | adopt the slot (an upgrade, or `init` created it) |
//! | recovery pending | any | a recovery was interrupted: recover the same rows again |
//! | another system id | any | a different cluster (logical restore): transaction ids mean nothing here, so nothing proves a gap complete: halt with `outboxd recover --since` |
//! | present | none | the slot was dropped, or the server failed over without it: recover the rows of transactions from `delivered_xid` on |
//! | present | invalidated | `max_slot_wal_keep_size` (or a conflict) removed its WAL: recover likewise |
//! | present without `delivered_xid` | none / invalidated | written by an older outboxd and not yet probed: halt with `outboxd recover --since` |
//! | present | present | stream from `max(slot, acked_lsn)`: after a Postgres crash the slot's checkpointed position is older than what the broker already holds |
//!
//! "Recover" follows `source.on_slot_loss`; see [`crate::slot::recovery`].

use crate::model::lsn::fmt_lsn;
use crate::relay::source::SlotState;
pub use crate::slot::gap::Gap;
use crate::slot::state::{Identity, Recorded};
use chrono::{DateTime, Utc};
use std::time::Duration;

/// What the session does before streaming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No state and no slot: create the slot and start from its consistent point.
    Create,
    /// A slot without state: record it and stream from it.
    Adopt { start: u64 },
    /// Stream from `start`; `notes` are logged (failover survived, crash replay skipped).
    Stream { start: u64, notes: Vec<String> },
    /// The slot cannot be trusted to hold every unacknowledged event.
    Lost(Loss),
}

impl Decision {
    /// A word for logs and the session span: `create`, `adopt`, `stream` or `lost`.
    pub fn label(&self) -> &'static str {
        match self {
            Decision::Create => "create",
            Decision::Adopt { .. } => "adopt",
            Decision::Stream { .. } => "stream",
            Decision::Lost(_) => "lost",
        }
    }

    /// The loss an operator's `recover --since T` stands for: the range is theirs; the slot is
    /// replaced only when this decision found it unusable (or missing).
    pub fn manual_loss(&self, slot_exists: bool, since: DateTime<Utc>) -> Loss {
        Loss {
            reason: LossReason::Manual,
            since: Some(since),
            mark: None,
            slot_exists,
            replace_slot: match self {
                Decision::Lost(l) => l.replace_slot,
                Decision::Create => true,
                Decision::Adopt { .. } | Decision::Stream { .. } => false,
            },
            // A gap this decision found is still owed: the operator's range widens it, never
            // replaces it.
            gap: Some(Gap {
                from_xid: match self {
                    Decision::Lost(l) => l.gap.as_ref().and_then(|g| g.from_xid),
                    _ => None,
                },
                since: Some(since),
            }),
        }
    }
}

/// Why the slot's stream has a gap, and where the gap starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loss {
    pub reason: LossReason,
    /// The rows to republish; `None`: nothing proves a gap complete, so outboxd halts.
    pub gap: Option<Gap>,
    /// Where a time range over `created_at` would start (delivery mark − recovery window): what
    /// an operator may pass to `outboxd recover --since` when `gap` is `None`. Only a guess:
    /// rows whose `created_at` lies before it are not covered.
    pub since: Option<DateTime<Utc>>,
    /// The delivery mark the range was derived from (rows at or before it must still exist).
    pub mark: Option<DateTime<Utc>>,
    /// A slot by that name exists (it is dropped first when it must be replaced).
    pub slot_exists: bool,
    /// The slot cannot stream what the gap needs (missing, invalidated, another cluster's):
    /// recovery creates a new one. A slot that can stream is kept.
    pub replace_slot: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LossReason {
    /// The slot does not exist although the relay streamed from it before.
    Missing,
    /// The slot exists but its WAL is gone (`wal_status = lost`, PG17+ `invalidation_reason`).
    Invalidated(String),
    /// The state row was written by another cluster (logical restore into a new cluster).
    NewSystem { recorded: String, now: String },
    /// A recovery was under way when the relay stopped.
    Interrupted(String),
    /// An invalidated slot and no state row: nothing says where the gap starts.
    InvalidatedWithoutState(String),
    /// `outboxd recover` on an operator's request.
    Manual,
}

impl LossReason {
    /// A bounded label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Invalidated(_) | Self::InvalidatedWithoutState(_) => "invalidated",
            Self::NewSystem { .. } => "new_system",
            Self::Interrupted(_) => "interrupted",
            Self::Manual => "manual",
        }
    }
}

impl std::fmt::Display for LossReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing => write!(
                f,
                "the replication slot does not exist although outboxd streamed from it before \
                 (dropped, or Postgres failed over / was restored without it)"
            ),
            Self::Invalidated(why) => write!(
                f,
                "the replication slot was invalidated ({why}): Postgres removed WAL it still \
                 needed (max_slot_wal_keep_size, or a conflict on a standby)"
            ),
            Self::NewSystem { recorded, now } => write!(
                f,
                "the database now belongs to another cluster (system identifier {now}, the \
                 state was written on {recorded}): restored into a new cluster"
            ),
            Self::Interrupted(why) => write!(f, "a recovery ({why}) did not finish"),
            Self::InvalidatedWithoutState(why) => write!(
                f,
                "the replication slot was invalidated ({why}) and outboxd has no delivery state \
                 for it (outboxd_slot_state, in source.relay_schema), so nothing says where the gap starts"
            ),
            Self::Manual => write!(f, "recovery requested by an operator"),
        }
    }
}

/// See the module docs. Pure, so every row of the table is a unit test.
pub fn decide(
    state: Option<&Recorded>,
    slot: Option<&SlotState>,
    identity: &Identity,
    window: Duration,
) -> Decision {
    let invalid = slot.and_then(|s| s.invalidation.clone());
    let Some(st) = state else {
        return match (slot, invalid) {
            (None, _) => Decision::Create,
            (Some(_), Some(why)) => Decision::Lost(Loss {
                reason: LossReason::InvalidatedWithoutState(why),
                gap: None,
                since: None,
                mark: None,
                slot_exists: true,
                replace_slot: true,
            }),
            (Some(s), None) => Decision::Adopt {
                start: s.confirmed_flush,
            },
        };
    };
    let window = chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
    // Only a hint for a person: rows of a transaction carry its start time (up to `window`
    // before its commit), when the writer did not set created_at itself.
    let from_mark = st
        .delivery_mark
        .unwrap_or(st.created_at)
        .checked_sub_signed(window)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    // A slot that still streams, on the history the state was written on, is kept.
    let replace_slot =
        slot.is_none() || invalid.is_some() || st.identity.system_id != identity.system_id;
    let exact = st.delivered_xid.map(|x| Gap {
        from_xid: Some(x),
        since: None,
    });
    let lost = |reason, gap: Option<Gap>, since: DateTime<Utc>| {
        Decision::Lost(Loss {
            reason,
            gap,
            since: Some(since),
            mark: st.delivery_mark,
            slot_exists: slot.is_some(),
            replace_slot,
        })
    };
    if st.recovering_since.is_some() || st.recovering_xid.is_some() {
        let why = st
            .recovery_reason
            .clone()
            .unwrap_or_else(|| "unknown".into());
        let gap = Gap {
            from_xid: st.recovering_xid,
            since: st.recovering_since,
        };
        // A gap the publication left: the slot cannot decode past the change, a new one must
        // start beyond it.
        let replace_slot = replace_slot || why.starts_with(crate::slot::publication::REASON);
        let hint = st.recovering_since.unwrap_or(from_mark);
        // An interrupted recovery into another cluster: its ids are that cluster's.
        let gap =
            (st.identity.system_id == identity.system_id || gap.from_xid.is_none()).then_some(gap);
        return Decision::Lost(Loss {
            reason: LossReason::Interrupted(why),
            gap,
            since: Some(hint),
            mark: st.delivery_mark,
            slot_exists: slot.is_some(),
            replace_slot,
        });
    }
    if st.identity.system_id != identity.system_id {
        return lost(
            LossReason::NewSystem {
                recorded: st.identity.system_id.clone(),
                now: identity.system_id.clone(),
            },
            None,
            from_mark,
        );
    }
    let Some(slot) = slot else {
        return lost(LossReason::Missing, exact, from_mark);
    };
    if let Some(why) = invalid {
        return lost(LossReason::Invalidated(why), exact, from_mark);
    }
    let mut notes = Vec::new();
    if st.identity.timeline != identity.timeline {
        notes.push(format!(
            "timeline changed from {} to {} (failover or point-in-time restore) and the slot \
             survived it: streaming on",
            st.identity.timeline, identity.timeline
        ));
    }
    let start = if st.acked_lsn > slot.confirmed_flush {
        notes.push(format!(
            "the slot's confirmed position {} is behind the acknowledged position {} recorded \
             in outboxd_slot_state (Postgres crashed or was restored before its checkpoint): \
             transactions committed before {} are already on the broker and are skipped",
            fmt_lsn(slot.confirmed_flush),
            fmt_lsn(st.acked_lsn),
            fmt_lsn(st.acked_lsn)
        ));
        st.acked_lsn
    } else {
        slot.confirmed_flush
    };
    Decision::Stream { start, notes }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn id(sys: &str, tl: u32) -> Identity {
        Identity {
            system_id: sys.into(),
            timeline: tl,
        }
    }
    fn t(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
    }
    fn state(lsn: u64, mark: Option<i64>) -> Recorded {
        Recorded {
            identity: id("7", 1),
            acked_lsn: lsn,
            delivery_mark: mark.map(t),
            delivered_xid: Some(1_000),
            recovering_since: None,
            recovering_xid: None,
            recovery_reason: None,
            recoveries: 0,
            last_recovery_at: None,
            last_recovery_events: None,
            created_at: t(-1000),
            updated_at: t(0),
        }
    }
    fn slot(lsn: u64) -> SlotState {
        SlotState {
            confirmed_flush: lsn,
            active_pid: None,
            invalidation: None,
        }
    }
    const W: Duration = Duration::from_secs(600);

    #[test]
    fn first_start_creates_and_an_existing_slot_is_adopted() {
        assert_eq!(decide(None, None, &id("7", 1), W), Decision::Create);
        assert_eq!(
            decide(None, Some(&slot(50)), &id("7", 1), W),
            Decision::Adopt { start: 50 }
        );
    }

    #[test]
    fn a_healthy_slot_streams_from_the_further_of_slot_and_state() {
        let d = decide(Some(&state(40, Some(0))), Some(&slot(50)), &id("7", 1), W);
        assert_eq!(
            d,
            Decision::Stream {
                start: 50,
                notes: vec![]
            }
        );
        // After a Postgres crash the slot is back at its checkpoint: skip what was acknowledged.
        let Decision::Stream { start, notes } =
            decide(Some(&state(90, Some(0))), Some(&slot(50)), &id("7", 1), W)
        else {
            panic!()
        };
        assert_eq!(start, 90);
        assert!(notes[0].contains("skipped"), "{notes:?}");
    }

    #[test]
    fn a_missing_slot_is_a_loss_from_the_mark_minus_the_window() {
        let Decision::Lost(l) = decide(Some(&state(90, Some(0))), None, &id("7", 1), W) else {
            panic!()
        };
        assert_eq!(l.reason, LossReason::Missing);
        assert_eq!(
            l.gap,
            Some(Gap {
                from_xid: Some(1_000),
                since: None
            }),
            "the gap is exact: by transaction id, not by time"
        );
        assert_eq!(l.since, Some(t(-600)), "the time hint for an operator");
        assert_eq!(l.mark, Some(t(0)));
        assert!(!l.slot_exists && l.replace_slot);
        // Never delivered anything: the gap starts when the state was created.
        let Decision::Lost(l) = decide(Some(&state(90, None)), None, &id("7", 1), W) else {
            panic!()
        };
        assert_eq!(l.since, Some(t(-1600)));
    }

    #[test]
    fn invalidated_new_system_and_interrupted_are_losses() {
        let mut bad = slot(50);
        bad.invalidation = Some("wal_removed".into());
        let d = decide(Some(&state(90, Some(0))), Some(&bad), &id("7", 1), W);
        assert!(
            matches!(&d, Decision::Lost(l) if l.reason == LossReason::Invalidated("wal_removed".into()) && l.slot_exists),
            "{d:?}"
        );
        let d = decide(Some(&state(90, Some(0))), Some(&slot(50)), &id("8", 1), W);
        assert!(
            matches!(&d, Decision::Lost(l) if l.reason.label() == "new_system" && l.gap.is_none()),
            "a logical restore cannot prove a gap complete: {d:?}"
        );
        let mut st = state(90, Some(0));
        st.recovering_since = Some(t(-5));
        st.recovery_reason = Some("missing".into());
        let d = decide(Some(&st), Some(&slot(50)), &id("7", 1), W);
        assert!(
            matches!(&d, Decision::Lost(l) if l.gap == Some(Gap { from_xid: None, since: Some(t(-5)) }) && l.reason.label() == "interrupted" && !l.replace_slot),
            "{d:?}"
        );
        st.recovering_since = None;
        st.recovering_xid = Some(900);
        let d = decide(Some(&st), None, &id("7", 1), W);
        assert!(
            matches!(&d, Decision::Lost(l) if l.gap == Some(Gap { from_xid: Some(900), since: None }) && l.replace_slot),
            "an interrupted exact recovery resumes with its own bound: {d:?}"
        );
        st.identity.system_id = "6".into();
        let d = decide(Some(&st), Some(&slot(50)), &id("7", 1), W);
        assert!(
            matches!(&d, Decision::Lost(l) if l.replace_slot && l.gap.is_none()),
            "an interrupted recovery into another cluster replaces the slot, and its ids do not \
             count here: {d:?}"
        );
        let d = decide(None, Some(&bad), &id("7", 1), W);
        assert!(
            matches!(&d, Decision::Lost(l) if l.since.is_none()),
            "{d:?}"
        );
    }

    #[test]
    fn a_row_without_delivered_xid_cannot_recover_by_itself() {
        let mut st = state(90, Some(0));
        st.delivered_xid = None;
        let Decision::Lost(l) = decide(Some(&st), None, &id("7", 1), W) else {
            panic!()
        };
        assert_eq!(l.gap, None);
        assert_eq!(l.since, Some(t(-600)));
    }

    #[test]
    fn an_operators_range_widens_an_owed_gap() {
        let d = decide(Some(&state(90, Some(0))), None, &id("7", 1), W);
        let l = d.manual_loss(false, t(-60));
        assert_eq!(
            l.gap,
            Some(Gap {
                from_xid: Some(1_000),
                since: Some(t(-60))
            })
        );
        let healthy = decide(Some(&state(40, Some(0))), Some(&slot(50)), &id("7", 1), W);
        assert_eq!(
            healthy.manual_loss(true, t(-60)).gap.unwrap().from_xid,
            None
        );
    }

    #[test]
    fn a_new_timeline_with_the_slot_streams_on_and_says_so() {
        let Decision::Stream { start, notes } =
            decide(Some(&state(40, Some(0))), Some(&slot(50)), &id("7", 2), W)
        else {
            panic!()
        };
        assert_eq!(start, 50);
        assert!(
            notes[0].contains("timeline changed from 1 to 2"),
            "{notes:?}"
        );
    }
}
