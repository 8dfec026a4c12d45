//! Where the replication slot lives (R45): on the primary (`source.dsn`, the default), or on a
//! physical standby named by `source.replication_dsn` (Postgres 16+), so the primary does not
//! pay for decoding.
//!
//! Two servers, one history. A physical standby replays the primary's WAL byte for byte: the
//! LSNs, transaction ids, the system identifier, the outbox rows and the publication are the
//! primary's. What differs is what each server can do:
//! - the **slot** (its state in `pg_replication_slots`, its walsender, its confirmed position)
//!   exists only on the standby; so do the stream, the slot's creation and, for a slot-loss
//!   recovery, the exported snapshot and the outbox read under it (the standby holds every row
//!   that committed before the new slot's consistent point: it decodes only what it replayed);
//! - **outboxd's own tables** (`outboxd_slot_state`, `outboxd_status`, `outbox_parked`) are
//!   written on the primary (a standby is read-only), and so is the heartbeat
//!   (`pg_logical_emit_message`: the standby decodes it once it replayed it, which keeps an idle
//!   standby slot moving).
//!
//! On one server, the statements that tie outboxd's rows to the slot check the slot in the same
//! statement ("only while our walsender holds it"). Across two servers that takes two
//! statements: the holder check on the standby, then the write on the primary. What the window
//! between them allows is bounded by what is written: the delivery state only moves forward
//! (`GREATEST`) and only by what this instance's broker acknowledged, so an instance that lost
//! the slot between the two statements writes a position that is still true; a beat written in
//! that window delays a standby's takeover by one beat. The fence (terminating a silent holder)
//! reads the beat on the primary and kills on the standby only if the same walsender still holds
//! the slot at the same confirmed position, in one statement there.

use crate::config::Config;
use crate::error::RelayError;
use crate::obs::view::Answer;
use tokio_postgres::Client;

/// A connection to the server of the slot when it is not the primary's.
pub struct SlotHost {
    /// `None`: the slot lives where `source.dsn` points.
    standby: Option<Client>,
    /// The slot's server was in recovery when connected: a slot created there cannot be a
    /// failover slot, and creating one waits for the primary's next running-transactions record.
    in_recovery: bool,
    /// The timeline its WAL receiver received when connected (`None`: no receiver, or a role
    /// that may not see it): a change under a session means it follows another server now.
    receiver_tli: Option<i32>,
}

/// What the status row and the watch ask of the slot's server (`crate::obs::view`).
impl crate::obs::view::SlotServer for SlotHost {
    fn sql<'a>(&'a self, primary: &'a Client) -> &'a Client {
        SlotHost::sql(self, primary)
    }
    fn is_separate(&self) -> bool {
        SlotHost::is_separate(self)
    }
    fn holds<'a>(&'a self, primary: &'a Client, slot: &'a str, pid: i32) -> Answer<'a, bool> {
        Box::pin(SlotHost::holds(self, primary, slot, pid))
    }
    fn holder_clause<'a>(&self, same_server: &'a str) -> &'a str {
        SlotHost::holder_clause(self, same_server)
    }
    fn still_follows<'a>(&'a self, primary: &'a Client) -> Answer<'a, ()> {
        Box::pin(SlotHost::still_follows(self, primary))
    }
}

impl SlotHost {
    /// The slot lives on the primary.
    pub fn primary() -> Self {
        Self {
            standby: None,
            in_recovery: false,
            receiver_tli: None,
        }
    }

    /// Connects to `source.replication_dsn` when set.
    pub async fn connect(cfg: &Config) -> Result<Self, RelayError> {
        let Some(dsn) = cfg.source.replication_dsn.as_deref() else {
            return Ok(Self::primary());
        };
        let client = crate::relay::address::sql_connect_to(cfg, dsn).await?;
        let row = client.query_one(STILL_STANDBY, &[]).await?;
        Ok(Self {
            standby: Some(client),
            in_recovery: row.get(0),
            receiver_tli: row.get(1),
        })
    }

    /// The connection on which the slot's views and functions are queried.
    pub fn sql<'a>(&'a self, primary: &'a Client) -> &'a Client {
        self.standby.as_ref().unwrap_or(primary)
    }

    /// Whether the slot lives on another server than outboxd's tables.
    pub fn is_separate(&self) -> bool {
        self.standby.is_some()
    }

    /// Whether the slot's server is a standby now (not yet promoted).
    pub fn in_recovery(&self) -> bool {
        self.in_recovery
    }

    /// Whether the slot's server, a standby when connected, still is one following the same
    /// timeline: a promotion (a failover, or a DR drill while the primary runs on) or a switch
    /// of its WAL receiver to another timeline (its upstream promoted) ends the session, and
    /// the next one's preflight tells a failover from divergence ([`SlotHost::check`]). Asked
    /// every tick: what the diverged server commits before the session ends could still be
    /// relayed, so the window is kept to a tick.
    pub async fn still_follows(&self, primary: &Client) -> Result<(), RelayError> {
        if !self.in_recovery {
            return Ok(());
        }
        let row = self.sql(primary).query_one(STILL_STANDBY, &[]).await?;
        let (recovering, tli): (bool, Option<i32>) = (row.get(0), row.get(1));
        let what = match (recovering, tli, self.receiver_tli) {
            (false, _, _) => "was promoted".to_string(),
            (true, Some(now), Some(then)) if now != then => {
                format!("switched from timeline {then} to {now} (its upstream was promoted)")
            }
            _ => return Ok(()),
        };
        Err(RelayError::Replication(format!(
            "the standby of source.replication_dsn {what} while the session streamed from it: \
             the session restarts, and streams on only if that standby still follows \
             source.dsn (or is source.dsn's server now)"
        )))
    }

    /// Whether walsender `pid` holds `slot` now, asked of the slot's server. Only for the
    /// two-statement form (see the module's prose); on one server the check is part of the
    /// statement that writes.
    pub async fn holds(&self, primary: &Client, slot: &str, pid: i32) -> Result<bool, RelayError> {
        Ok(self
            .sql(primary)
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid = $2)",
                &[&slot, &pid],
            )
            .await?
            .get(0))
    }

    /// The SQL condition "walsender `$pid` holds slot `$slot`" for a statement on the primary:
    /// `same_server` (the clause itself) when the slot lives there; `TRUE` when it lives on a
    /// standby, after [`SlotHost::holds`] said so.
    pub fn holder_clause<'a>(&self, same_server: &'a str) -> &'a str {
        if self.is_separate() {
            "TRUE"
        } else {
            same_server
        }
    }

    /// What the slot's server lacks for logical decoding on a standby, as errors (nothing can
    /// stream) and warnings (it streams, at a risk the message names).
    pub async fn check(&self, primary: &Client) -> Result<Vec<String>, RelayError> {
        let Some(sb) = &self.standby else {
            return Ok(Vec::new());
        };
        let v: String = sb.query_one("SHOW server_version_num", &[]).await?.get(0);
        let major = v.parse::<u32>().unwrap_or(0) / 10_000;
        if self.in_recovery && major < 16 {
            return Err(RelayError::Setup(format!(
                "source.replication_dsn points at a Postgres {major} standby: logical decoding on \
                 a standby needs Postgres 16 or later; upgrade it, or unset \
                 source.replication_dsn to decode on the primary"
            )));
        }
        let same: bool = sb
            .query_one(
                "SELECT system_identifier::text = $1 FROM pg_control_system()",
                &[&primary
                    .query_one(
                        "SELECT system_identifier::text FROM pg_control_system()",
                        &[],
                    )
                    .await?
                    .get::<_, String>(0)],
            )
            .await?
            .get(0);
        if !same {
            return Err(RelayError::Setup(
                "source.replication_dsn and source.dsn are different clusters (their system \
                 identifiers differ): replication_dsn must be a physical standby of dsn's \
                 primary (pg_basebackup), or unset"
                    .into(),
            ));
        }
        let mut warnings = self.follows(primary, sb).await?;
        let setting = |name: &'static str| async move {
            let v: String = sb
                .query_one("SELECT current_setting($1)", &[&name])
                .await?
                .get(0);
            Ok::<String, RelayError>(v)
        };
        let level = setting("wal_level").await?;
        if level != "logical" {
            return Err(RelayError::Setup(format!(
                "the server of source.replication_dsn has wal_level = {level:?}: decoding on a \
                 standby needs wal_level = logical there too (ALTER SYSTEM SET wal_level = \
                 logical; then restart the standby)"
            )));
        }
        if self.in_recovery && setting("hot_standby_feedback").await? != "on" {
            warnings.push(
                "hot_standby_feedback is off on the standby of source.replication_dsn: the \
                 primary's vacuum may remove catalog rows the slot still needs, which \
                 invalidates it (rows_removed) and costs a slot-loss recovery; set \
                 hot_standby_feedback = on there (and primary_slot_name, so the primary keeps \
                 the WAL the standby has not replayed)"
                    .to_string(),
            );
        }
        Ok(warnings)
    }

    /// Whether the slot's server still follows `source.dsn`'s primary. A promoted standby keeps
    /// the system identifier, so after a DR drill or a blue/green switch the identifiers still
    /// match while the two servers' histories have parted: the relay would stream the diverged
    /// server, and the primary's new events would never reach the slot. Refused, naming both
    /// servers (host:port, never a password) and the fix:
    /// - not in recovery: only the primary itself is right (the standby was promoted because the
    ///   primary died, and `dsn` now leads to it too: the same postmaster answers both);
    /// - in recovery: its WAL receiver, when streaming, must stream the primary's timeline. A
    ///   receiver that is not streaming only delays events (a warning), and a role that may not
    ///   see the receiver's status gets a warning naming the grant.
    async fn follows(&self, primary: &Client, sb: &Client) -> Result<Vec<String>, RelayError> {
        const SERVER: &str = "SELECT coalesce(host(inet_server_addr()), 'local socket') || ':' \
                              || current_setting('port'), pg_postmaster_start_time()::text, \
                              CASE WHEN pg_is_in_recovery() THEN NULL ELSE \
                                ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)) \
                                ::bit(32)::int END";
        let p = primary.query_one(SERVER, &[]).await?;
        let s = sb.query_one(SERVER, &[]).await?;
        let (here, there): (String, String) = (p.get(0), s.get(0));
        let primary_tli: Option<i32> = p.get(2);
        if !self.in_recovery {
            if p.get::<_, String>(1) == s.get::<_, String>(1) && primary_tli.is_some() {
                return Ok(Vec::new());
            }
            return Err(RelayError::Setup(format!(
                "source.replication_dsn ({there}) no longer follows source.dsn ({here}): it is \
                 out of recovery (promoted: a DR drill, a switchover) and another server than \
                 the primary, so its history has parted from the primary's; streaming its slot \
                 would relay what is written there and never the primary's new events. Fix: if \
                 {there} is the primary now, point source.dsn at it too (the slot streams on); \
                 otherwise rebuild {there} as a standby of {here} (pg_basebackup, or pg_rewind) \
                 and start outboxd again (its slot is gone there: the relay republishes the gap \
                 from the outbox table, source.on_slot_loss), or unset source.replication_dsn to \
                 decode on the primary"
            )));
        }
        let receiver = sb
            .query_opt("SELECT status, received_tli FROM pg_stat_wal_receiver", &[])
            .await?;
        let (status, tli): (Option<String>, Option<i32>) = match &receiver {
            Some(r) => (r.get(0), r.get(1)),
            None => (None, None),
        };
        match (receiver.is_some(), status.as_deref(), tli, primary_tli) {
            // Behind the primary's timeline: a cascade still converging after a failover (it
            // may yet follow), or a standby of the old primary: not streamed until it follows.
            (true, Some("streaming"), Some(t), Some(p)) if t < p => {
                Err(RelayError::Replication(format!(
                    "source.replication_dsn ({there}) does not follow source.dsn ({here}) yet: \
                     its WAL receiver streams timeline {t}, the primary writes timeline {p} (a \
                     failover the standby has not followed, or it streams from the old \
                     primary); retried until it follows. Fix if it persists: point its \
                     primary_conninfo at {here} (recovery_target_timeline = 'latest')"
                )))
            }
            // Ahead of it: it follows a server that was promoted while the primary ran on.
            (true, Some("streaming"), Some(t), Some(p)) if t > p => {
                Err(RelayError::Setup(format!(
                    "source.replication_dsn ({there}) does not follow source.dsn ({here}): its \
                     WAL receiver streams timeline {t}, the primary writes timeline {p}, so it \
                     replays another server's history (a standby of a promoted server) and the \
                     primary's new events would never reach its slot. Fix: point its \
                     primary_conninfo at {here} (with recovery_target_timeline = 'latest'), or \
                     set source.replication_dsn to a standby that follows {here}, or unset it to \
                     decode on the primary"
                )))
            }
            (true, Some("streaming"), _, _) => Ok(Vec::new()),
            (true, None, _, _) => Ok(vec![format!(
                "cannot see whether the standby of source.replication_dsn ({there}) streams from \
                 source.dsn ({here}): pg_stat_wal_receiver shows its status only to superusers \
                 and members of pg_read_all_stats; GRANT pg_read_all_stats TO the relay's role \
                 there, so outboxd can refuse a standby that follows another server"
            )]),
            (_, status, _, _) => Ok(vec![format!(
                "the standby of source.replication_dsn ({there}) is in recovery but its WAL \
                 receiver is not streaming ({}): it replays nothing new from source.dsn \
                 ({here}), so events wait there (none is lost) until it streams again; check its \
                 primary_conninfo, the primary's pg_hba.conf and primary_slot_name",
                status.map_or("no WAL receiver".to_string(), |s| format!("status {s}"))
            )]),
        }
    }

    /// A slot created on a standby is safe from the primary's vacuum only once the standby's
    /// hot-standby feedback carried its `catalog_xmin` to the primary (every
    /// `wal_receiver_status_interval`, 10 s by default): a catalog change on the primary pruned
    /// before that invalidates the new slot (`rows_removed`), which costs a recovery. Waits up to
    /// `within` until the primary holds it (the standby's physical slot, or its walsender's
    /// `backend_xmin`); `false`: not seen in time.
    pub async fn wait_feedback(
        &self,
        primary: &Client,
        slot: &str,
        within: std::time::Duration,
    ) -> Result<bool, RelayError> {
        if !self.in_recovery {
            return Ok(true);
        }
        let row = self
            .sql(primary)
            .query_opt(
                "SELECT catalog_xmin::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?;
        let Some(xmin) = row.and_then(|r| r.get::<_, Option<String>>(0)) else {
            return Ok(false);
        };
        let deadline = std::time::Instant::now() + within;
        loop {
            let held: bool = primary
                .query_one(
                    "SELECT coalesce(bool_or(age(h) >= age($1::text::xid)), false) FROM ( \
                       SELECT catalog_xmin AS h FROM pg_replication_slots \
                        WHERE slot_type = 'physical' AND catalog_xmin IS NOT NULL \
                       UNION ALL \
                       SELECT backend_xmin FROM pg_stat_replication \
                        WHERE backend_xmin IS NOT NULL) s",
                    &[&xmin],
                )
                .await?
                .get(0);
            if held {
                return Ok(true);
            }
            if std::time::Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// Runs `create` (a slot's creation on this host) to its end. On a standby the creation
    /// waits for the primary's next running-transactions record (logged every 15 s by the
    /// background writer while there is activity): meanwhile ask the primary for one every
    /// half second (`pg_log_standby_snapshot`, Postgres 16+, superuser unless granted; without
    /// the right the creation just waits for the background writer).
    pub async fn creating<T>(
        &self,
        primary: &Client,
        create: impl std::future::Future<Output = T>,
    ) -> T {
        if !self.in_recovery {
            return create.await;
        }
        let nudges = async {
            let mut denied = false;
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                if denied {
                    continue;
                }
                if let Err(e) = primary
                    .query_one("SELECT pg_log_standby_snapshot()", &[])
                    .await
                {
                    denied = true;
                    tracing::info!(error = %RelayError::from(e), "the slot's creation on the standby waits for the primary's next running-transactions record (up to 15 s)");
                }
            }
        };
        tokio::select! {
            out = create => out,
            never = nudges => never,
        }
    }
}

/// Whether a server is in recovery, and the timeline its WAL receiver received (NULL without a
/// receiver, or for a role that may not see it: pg_read_all_stats).
const STILL_STANDBY: &str =
    "SELECT pg_is_in_recovery(), (SELECT received_tli FROM pg_stat_wal_receiver)";

/// Bytes the standby of `host` has still to replay (the primary's WAL end minus its replay
/// position); `None` when the slot lives on the primary or the standby was promoted.
pub async fn replay_lag(primary: &Client, host: &SlotHost) -> Result<Option<i64>, RelayError> {
    if !host.in_recovery() {
        return Ok(None);
    }
    let end: String = primary
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    Ok(host
        .sql(primary)
        .query_one(
            "SELECT ($1::text::pg_lsn - pg_last_wal_replay_lsn())::bigint",
            &[&end],
        )
        .await?
        .get(0))
}

/// Parked and held rows the standby has not replayed yet. A park or hold is written on the
/// primary, while the event's position is confirmed on the standby's slot: if the primary died
/// before the standby replayed the row and the standby were promoted, the slot would be past
/// the event and neither the topic nor `outbox_parked` would hold it. So after each such write
/// the fence records the primary's WAL insert position (the row's commit lies before it) and
/// the position confirmable at that moment (before the event: its acknowledgement, or its
/// transaction's Commit, comes later), and nothing is confirmed past that until the standby's
/// `pg_last_wal_replay_lsn()` reached the row. Only while the slot's server is a standby: on one
/// server, the row and the slot share the WAL.
#[derive(Debug, Default)]
pub struct ReplayFence {
    /// (confirmable when the row was written, the primary's insert position after it), in
    /// write order: both only grow.
    pending: std::collections::VecDeque<(u64, u64)>,
}

impl ReplayFence {
    /// A park or hold row was just written on `primary`, while `confirmable` was the position
    /// safe to confirm (before its event).
    pub async fn written(
        &mut self,
        primary: &Client,
        host: &SlotHost,
        confirmable: u64,
    ) -> Result<(), RelayError> {
        if !host.in_recovery() {
            return Ok(());
        }
        let at: String = primary
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await?
            .get(0);
        let at = crate::relay::lsn::parse_lsn(&at)?;
        self.pending.push_back((confirmable, at));
        Ok(())
    }

    /// `confirmed`, held back before the oldest row the standby has not replayed.
    pub fn cap(&self, confirmed: u64) -> u64 {
        self.pending
            .front()
            .map_or(confirmed, |&(before, _)| confirmed.min(before))
    }

    /// Releases the rows the standby has replayed by now (asked of it while any is pending).
    pub async fn refresh(&mut self, primary: &Client, host: &SlotHost) -> Result<(), RelayError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let replayed: Option<String> = host
            .sql(primary)
            .query_one("SELECT pg_last_wal_replay_lsn()::text", &[])
            .await?
            .get(0);
        let replayed = replayed
            .as_deref()
            .map(crate::relay::lsn::parse_lsn)
            .transpose()?
            .unwrap_or(0);
        while self.pending.front().is_some_and(|&(_, at)| at <= replayed) {
            self.pending.pop_front();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ReplayFence;

    #[test]
    fn the_fence_holds_the_confirm_before_the_oldest_unreplayed_row() {
        let mut f = ReplayFence::default();
        assert_eq!(f.cap(100), 100);
        f.pending.push_back((40, 200));
        f.pending.push_back((60, 300));
        assert_eq!(f.cap(100), 40);
        assert_eq!(f.cap(30), 30);
        f.pending.pop_front();
        assert_eq!(f.cap(100), 60);
    }
}
