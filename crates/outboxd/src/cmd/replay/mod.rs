//! `outboxd replay`: republish chosen events with their original `event_id`s (R38).
//!
//! ```text
//! outboxd replay ID… | --ids-file F | --since T --until T [--event-type X]…   dry run
//! outboxd replay … --execute --reason R [--rate N]        small, harmless: runs now (audited)
//! outboxd replay request … --reason R                     larger or side-effecting: prints ID
//! outboxd replay approve ID                               another database role (--dsn)
//! outboxd replay run ID                                   runs it, or continues it at its cursor
//! outboxd replay list [--all] | show ID
//! ```

mod render;

use super::parked::printable;
use crate::config::Config;
use crate::relay::source;
use crate::replay::consumers::{self, Consumers};
use crate::replay::select::{self, Selection, Summary};
use crate::replay::{run, store, ReplayError};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct ReplayArgs {
    #[command(subcommand)]
    pub cmd: Option<ReplayCmd>,
    #[command(flatten)]
    pub select: SelectArgs,
    /// Republish now instead of a dry run (only a replay that needs no approval; it is
    /// audited all the same).
    #[arg(long)]
    pub execute: bool,
    #[command(flatten)]
    pub req: RequestArgs,
    /// Connect as this role instead of source.dsn's: the role recorded as requester, approver
    /// or runner (see sql/roles.sql, outboxd_replay).
    #[arg(
        long = "dsn",
        env = "OUTBOXD_REPLAY_DSN",
        hide_env_values = true,
        global = true
    )]
    pub dsn: Option<String>,
}

// Parsed once per process: boxing the selection would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum ReplayCmd {
    /// Record a replay that needs an approval (large, or of side-effecting types); prints its id.
    Request {
        #[command(flatten)]
        select: SelectArgs,
        #[command(flatten)]
        req: RequestArgs,
    },
    /// Approve a requested replay, as a database role other than the one that requested it.
    Approve {
        /// The replay's id (`outboxd replay list`).
        id: i64,
    },
    /// Run an approved replay, or continue one that stopped, right after its cursor.
    Run {
        /// The replay's id.
        id: i64,
        /// Events per second; at most the rate it was approved with.
        #[arg(long)]
        rate: Option<u32>,
    },
    /// Replays that are not finished (`--all`: every one), newest first.
    List {
        /// Include finished replays.
        #[arg(long)]
        all: bool,
    },
    /// One replay: its selection, counts per event type and topic, who, when, result, and the
    /// consumer groups of its topics now (with their lag).
    Show {
        /// The replay's id.
        id: i64,
    },
}

/// Which events: exact ids, or a time range narrowed by types and ids.
#[derive(Args, Debug, Default)]
pub struct SelectArgs {
    /// Event ids to replay.
    #[arg(value_name = "EVENT_ID")]
    pub ids: Vec<String>,
    /// A file of event ids, one per line (blank lines and # comments are skipped).
    #[arg(long)]
    pub ids_file: Option<PathBuf>,
    /// Events created at or after this time (RFC 3339, e.g. 2026-12-03T10:00:00Z).
    #[arg(long)]
    pub since: Option<DateTime<Utc>>,
    /// Events created before this time (RFC 3339).
    #[arg(long)]
    pub until: Option<DateTime<Utc>>,
    /// Only this event type (repeatable).
    #[arg(long = "event-type", value_name = "TYPE")]
    pub event_types: Vec<String>,
    /// Only this aggregate type (repeatable).
    #[arg(long = "aggregate-type", value_name = "TYPE")]
    pub aggregate_types: Vec<String>,
    /// Only this aggregate id (repeatable).
    #[arg(long = "aggregate-id", value_name = "ID")]
    pub aggregate_ids: Vec<String>,
    /// The outbox table to replay from (`schema.table`): required when the configuration lists
    /// several (`[[source.tables]]`); recorded with the replay, which then runs on it only.
    #[arg(long, value_name = "SCHEMA.TABLE")]
    pub table: Option<String>,
}

/// Why, who, how fast.
#[derive(Args, Debug, Default)]
pub struct RequestArgs {
    /// Why (recorded in the audit row; required to execute or request).
    #[arg(long)]
    pub reason: Option<String>,
    /// Events per second (default: replay.rate).
    #[arg(long)]
    pub rate: Option<u32>,
    /// Who asks (recorded beside the database role).
    #[arg(long, env = "USER", default_value = "unknown")]
    pub operator: String,
}

impl SelectArgs {
    fn selection(&self, uuid_column: bool) -> Result<Selection, ReplayError> {
        let by_ids = !self.ids.is_empty() || self.ids_file.is_some();
        let by_range = self.since.is_some() || self.until.is_some();
        let filters = !(self.event_types.is_empty()
            && self.aggregate_types.is_empty()
            && self.aggregate_ids.is_empty());
        match (by_ids, by_range) {
            (true, true) => Err(ReplayError::Selection(
                "select by event ids or by --since/--until, not both".into(),
            )),
            (true, false) if filters => Err(ReplayError::Selection(
                "--event-type, --aggregate-type and --aggregate-id narrow a --since/--until \
                 range; with event ids, list only the ones you want"
                    .into(),
            )),
            (true, false) => {
                let mut ids = self.ids.clone();
                if let Some(f) = &self.ids_file {
                    let text = std::fs::read_to_string(f).map_err(|e| {
                        ReplayError::Selection(format!("cannot read {}: {e}", f.display()))
                    })?;
                    ids.extend(text.lines().map(str::to_string));
                }
                Selection::ids(ids, uuid_column)
            }
            (false, true) => match (self.since, self.until) {
                (Some(since), Some(until)) if since < until => Ok(Selection::Range {
                    since,
                    until,
                    event_types: self.event_types.clone(),
                    aggregate_types: self.aggregate_types.clone(),
                    aggregate_ids: self.aggregate_ids.clone(),
                }),
                (Some(_), Some(_)) => Err(ReplayError::Selection(
                    "--since must be before --until".into(),
                )),
                _ => Err(ReplayError::Selection(
                    "a range needs both --since and --until (an audited range has two ends)".into(),
                )),
            },
            (false, false) => Err(ReplayError::Selection(
                "select events: EVENT_ID…, --ids-file FILE, or --since T --until T (see \
                 `outboxd replay --help`)"
                    .into(),
            )),
        }
    }
}

fn reason(req: &RequestArgs) -> Result<&str, ReplayError> {
    match req.reason.as_deref().map(str::trim) {
        Some(r) if !r.is_empty() => Ok(r),
        _ => Err(ReplayError::Selection(
            "say why with --reason (recorded in the audit row)".into(),
        )),
    }
}

/// Runs a `replay` command; returns what to print on stdout and the exit code.
pub async fn main(cfg: &Config, args: ReplayArgs) -> Result<(String, ExitCode), ReplayError> {
    let mut cfg = cfg.clone();
    if let Some(dsn) = &args.dsn {
        cfg.source.dsn = dsn.clone();
        cfg.source.password = None;
    }
    let all = &cfg;
    let s = &args.select;
    let parent_options = args.execute
        || !s.ids.is_empty()
        || s.ids_file.is_some()
        || s.since.is_some()
        || s.until.is_some()
        || args.req.reason.is_some()
        || args.req.rate.is_some();
    if args.cmd.is_some() && parent_options {
        return Err(ReplayError::Selection(
            "put the selection and options after the subcommand (`outboxd replay request \
             --since T --until T --reason R`)"
                .into(),
        ));
    }
    let sql = source::sql_connect(all).await?;
    // Never created here: its creator would own it, and an owner can disable its guard.
    store::require_installed(&sql).await?;
    let slot = &all.source.slot;
    let ok = |s: String| Ok((s, ExitCode::SUCCESS));
    // The one table a selection reads, its records tagged like the relay's (several tables).
    let one = |table: Option<&str>| -> Result<Config, ReplayError> {
        let setup = |m: String| ReplayError::Selection(m);
        match table {
            Some(t) => all.for_table(t).map_err(setup),
            None if all.is_multi_table() => Err(setup(format!(
                "this configuration lists several outbox tables ({}): name the one to replay \
                 from with --table SCHEMA.TABLE",
                all.tables()
                    .iter()
                    .map(|t| t.label())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
            None => Ok(all.clone()),
        }
    };
    match args.cmd {
        None if !args.execute => {
            let cfg = &one(s.table.as_deref())?;
            let p = plan(cfg, &sql, &args.select).await?;
            let rate = args.req.rate.unwrap_or(cfg.replay.rate);
            let who = who(cfg, &p.summary).await;
            ok(render::plan(
                &p.sel, &p.summary, &p.policy, p.capped, rate, &who,
            ))
        }
        None => {
            let cfg = &one(s.table.as_deref())?;
            let reason = reason(&args.req)?;
            let p = plan(cfg, &sql, &args.select).await?;
            let (sel, summary) = (&p.sel, &p.summary);
            select::refuse_shadowed(&summary.shadowed)?;
            let why = summary.approval_reasons(&p.policy);
            if !why.is_empty() {
                return Err(ReplayError::NeedsApproval {
                    why: why.join("; "),
                });
            }
            if summary.total == 0 {
                let who = who(cfg, summary).await;
                let plan = render::plan(sel, summary, &p.policy, p.capped, cfg.replay.rate, &who);
                return ok(format!("nothing to replay\n{plan}"));
            }
            let id = record(cfg, &sql, sel, summary, &args.req, reason, false).await?;
            drop(sql);
            execute(cfg, id, args.req.rate).await
        }
        Some(ReplayCmd::Request { select, req }) => {
            let cfg = &one(select.table.as_deref())?;
            let reason = reason(&req)?;
            let Plan { sel, summary, .. } = plan(cfg, &sql, &select).await?;
            select::refuse_shadowed(&summary.shadowed)?;
            if summary.total == 0 {
                return Err(ReplayError::Selection(format!(
                    "nothing to replay: no outbox row matches ({})",
                    sel.describe()
                )));
            }
            let id = record(cfg, &sql, &sel, &summary, &req, reason, true).await?;
            let r = store::load(&sql, slot, id).await?;
            // As stored (the guard ends a range at its now()): what runs.
            let stored = Selection::from_json(&r.selection)?;
            let mut out = format!(
                "replay {id} requested by database role {}: {} event(s), {}\n",
                printable(&r.requested_by),
                summary.total,
                stored.describe()
            );
            for (i, l) in render::consumers(&who(cfg, &summary).await)
                .iter()
                .enumerate()
            {
                let label = if i == 0 { "consumers: " } else { "           " };
                out.push_str(&format!("{label}{l}\n"));
            }
            out.push_str(&format!(
                "next: another database role runs `outboxd replay approve {id}` (--dsn), then \
                 `outboxd replay run {id}`\n"
            ));
            ok(out)
        }
        Some(ReplayCmd::Approve { id }) => {
            let r = store::approve(&sql, slot, id).await?;
            ok(format!(
                "replay {id} approved by database role {} (requested by {}): run it with \
                 `outboxd replay run {id}`\n",
                printable(r.approved_by.as_deref().unwrap_or("?")),
                printable(&r.requested_by)
            ))
        }
        Some(ReplayCmd::Run { id, rate }) => {
            // The table it was recorded for (run::execute checks the binding again).
            let r = store::load(&sql, slot, id).await?;
            let cfg = &one(select::recorded_table(&r.selection))?;
            drop(sql);
            execute(cfg, id, rate).await
        }
        Some(ReplayCmd::List { all: every }) => {
            let rows = store::list(&sql, slot, every).await?;
            ok(render::list(&rows))
        }
        Some(ReplayCmd::Show { id }) => {
            let r = store::load(&sql, slot, id).await?;
            let topics: Vec<&str> = r
                .summary
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|g| g.get(1).and_then(serde_json::Value::as_str))
                .collect();
            let who = consumers::lookup(all, topics).await;
            ok(render::show(&r, &who))
        }
    }
}

/// The consumer groups of the summary's topics (never fails: unknown says why).
async fn who(cfg: &Config, summary: &Summary) -> Consumers {
    consumers::lookup(cfg, summary.groups.iter().map(|g| g.1.as_str())).await
}

/// A selection as it would be recorded, what it holds now, and the database's policy.
struct Plan {
    sel: Selection,
    summary: Summary,
    policy: store::Policy,
    /// The `--until` asked for, when later than the database's now() (which the range ends at).
    capped: Option<DateTime<Utc>>,
}

async fn plan(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    args: &SelectArgs,
) -> Result<Plan, ReplayError> {
    let policy = store::policy(sql, &cfg.source.slot).await?;
    let uuid_column = select::event_id_type(cfg, sql).await? == "uuid";
    let mut sel = args.selection(uuid_column)?;
    // A range ends no later than now (the table's guard caps it too): rows written after the
    // request or the approval are never part of it.
    let mut capped = None;
    if let Selection::Range { since, until, .. } = &mut sel {
        let now = store::now(sql).await?;
        if *until > now {
            capped = Some(*until);
            *until = now;
            if *since >= now {
                return Err(ReplayError::Selection(format!(
                    "--since {} is not in the past (the database's now() is {})",
                    since.to_rfc3339(),
                    now.to_rfc3339()
                )));
            }
        }
    }
    let summary = select::summarize(cfg, sql, &sel, &policy).await?;
    Ok(Plan {
        sel,
        summary,
        policy,
        capped,
    })
}

#[allow(clippy::too_many_arguments)]
async fn record(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    sel: &Selection,
    summary: &Summary,
    req: &RequestArgs,
    reason: &str,
    needs_approval: bool,
) -> Result<i64, ReplayError> {
    store::insert(
        sql,
        &store::NewReplay {
            slot: &cfg.source.slot,
            selection: select::with_table(sel.to_json(), cfg),
            events: summary.total,
            summary: summary.groups_json(),
            side_effects: &summary.side_effects,
            needs_approval,
            reason,
            operator: &req.operator,
            rate: req.rate.unwrap_or(cfg.replay.rate).max(1),
        },
    )
    .await
}

async fn execute(
    cfg: &Config,
    id: i64,
    rate: Option<u32>,
) -> Result<(String, ExitCode), ReplayError> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let signals = tokio::spawn(async move {
        super::wait_for_signal().await;
        tracing::warn!(
            "stopping the replay: waiting for the events in flight, then recording the cursor"
        );
        let _ = tx.send(true);
        super::wait_for_signal().await;
        std::process::exit(130);
    });
    let result = run::execute(cfg, id, rate, rx).await;
    signals.abort();
    let o = result?;
    let text = match o.state {
        "finished" => format!(
            "replay {id} finished: {} event(s) sent by this run; {} of {} selected acknowledged \
             by the broker (original event_ids: consumers deduplicate the copies)\n",
            o.sent_now, o.acknowledged, o.selected
        ),
        _ => format!(
            "replay {id} interrupted: {} of {} selected acknowledged; `outboxd replay run {id}` \
             continues after them\n",
            o.acknowledged, o.selected
        ),
    };
    let code = if o.state == "finished" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    Ok((text, code))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> ReplayArgs {
        match crate::cmd::Cli::try_parse_from(args).unwrap().cmd {
            crate::cmd::Cmd::Replay { args, .. } => *args,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn subcommands_after_global_options_and_selections_without() {
        let a = parse(&[
            "outboxd",
            "replay",
            "--config",
            "f",
            "request",
            "--since",
            "2026-01-01T00:00:00Z",
            "--until",
            "2026-01-02T00:00:00Z",
            "--reason",
            "r",
            "--dsn",
            "postgres://a@h/d",
        ]);
        match a.cmd {
            Some(ReplayCmd::Request { select, req }) => {
                assert!(select.ids.is_empty(), "{select:?}");
                assert!(select.since.is_some());
                assert_eq!(req.reason.as_deref(), Some("r"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(a.dsn.as_deref(), Some("postgres://a@h/d"));
        let a = parse(&[
            "outboxd",
            "replay",
            "--config",
            "f",
            "0190a0b0-c0d0-7e0f-8000-000000000001",
            "--execute",
            "--reason",
            "r",
        ]);
        assert!(a.cmd.is_none() && a.execute);
        assert_eq!(a.select.ids.len(), 1);
    }
}
