//! One run of an approved replay: the selected rows, read per aggregate in version order
//! after the replay's cursor, go through the live path's stages and a producer of their own,
//! rate-capped. After each batch the broker fully acknowledged (and every batch before it), the
//! cursor moves to its last row: a run killed at any point (SIGKILL included) is continued by
//! the next `replay run` right after the cursor, so it re-sends at most the unacknowledged tail
//! and never skips an event. Before it runs, the stored selection is counted again
//! against the database's policy ([`recount`]).

use super::pace::Pacer;
use super::progress::Progress;
use super::select::{self, Selection};
use super::{store, ReplayError};
use crate::config::Config;
use crate::error::RelayError;
use crate::obs::Observed;
use crate::relay::kafka::Producer;
use crate::relay::source;
use crate::relay::stages::Stages;
use crate::relay::table_reader::{Flow, Hooks, Position, TableReader};
use std::sync::Arc;
use tokio::sync::watch;
use tokio_postgres::Client;

/// How a run ended without error.
#[derive(Debug)]
pub struct Outcome {
    /// `finished` or `interrupted`.
    pub state: &'static str,
    /// Rows handed to the producer by this run.
    pub sent_now: u64,
    /// Events acknowledged up to the cursor, over all runs.
    pub acknowledged: i64,
    /// Events selected when the replay was requested.
    pub selected: i64,
}

/// Rows per page and per synthetic transaction: about a fifth of a second at the rate, so the
/// cursor moves often and a killed run re-sends little.
fn batch(rate: u32) -> usize {
    (rate as usize / 5).clamp(1, 500)
}

struct RunHooks<'a> {
    audit: &'a Client,
    id: i64,
    /// Events requested: no more are acknowledged over all runs.
    events: i64,
    /// Acknowledged by earlier runs.
    before: i64,
    pacer: Pacer,
    progress: Progress,
    sent: u64,
}

impl Hooks for RunHooks<'_> {
    async fn before_row(&mut self) {
        self.pacer.wait().await;
        self.sent += 1;
        self.progress.sent(self.before as u64 + self.sent);
    }

    async fn acknowledged(
        &mut self,
        through: Option<&Position>,
        acked: u64,
    ) -> Result<(), RelayError> {
        let total = self.before + acked as i64;
        // Over budget: the cursor went back, or rows landed in the selection since the recount.
        // What the broker acknowledged is recorded, and the run stops.
        let over = (total > self.events).then_some(ReplayError::Overrun {
            id: self.id,
            sent: total,
            events: self.events,
        });
        if let Some(p) = through {
            store::save_cursor(self.audit, self.id, p, total)
                .await
                .map_err(|e| match e {
                    ReplayError::Relay(r) => r,
                    other => RelayError::Postgres(other.to_string()),
                })?;
            crate::fail::hit("replay_cursor_saved");
        }
        self.progress.acknowledged(total as u64);
        match over {
            Some(e) => Err(RelayError::Setup(e.to_string())),
            None => Ok(()),
        }
    }
}

/// What was approved is what runs: no more events acknowledged over all runs than were
/// requested (also checked as the run goes: [`RunHooks`]); the stored selection, counted again
/// now, may hold no more events than were requested (rows written or back-dated into it since would ride on the
/// approval), and may not need an approval, by the database's policy now, that the replay does
/// not have (a type marked as having side effects since, a row with a lying summary).
async fn recount(
    cfg: &Config,
    sql: &Client,
    r: &store::Replay,
    sel: &Selection,
) -> Result<(), ReplayError> {
    if r.sent > r.events {
        return Err(ReplayError::Overrun {
            id: r.id,
            sent: r.sent,
            events: r.events,
        });
    }
    let policy = store::policy(sql, &cfg.source.slot).await?;
    let now = select::summarize(cfg, sql, sel, &policy).await?;
    if now.total > r.events {
        return Err(ReplayError::Grown {
            id: r.id,
            now: now.total,
            requested: r.events,
        });
    }
    let why = now.approval_reasons(&policy);
    if !why.is_empty() && r.approved_by.is_none() {
        return Err(ReplayError::Unapproved {
            id: r.id,
            why: why.join("; "),
        });
    }
    Ok(())
}

/// Runs (or continues) replay `id`. `cfg.source.dsn` is the replay's role; `rate` may lower
/// the approved rate cap, never raise it. Ends at the selection's end (`finished`) or when
/// `shutdown` fires (`interrupted`, after what was in flight landed or
/// `relay.shutdown_timeout_ms` passed).
pub async fn execute(
    cfg: &Config,
    id: i64,
    rate: Option<u32>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<Outcome, ReplayError> {
    let audit = source::sql_connect(cfg).await?;
    store::require_installed(&audit).await?;
    if !store::lock(&audit, id).await? {
        return Err(ReplayError::Busy(id));
    }
    let r = store::load(&audit, &cfg.source.slot, id).await?;
    match r.state.as_str() {
        "requested" => return Err(ReplayError::State {
            id,
            state: r.state,
            hint:
                "it needs an approval first: `outboxd replay approve ID` by another database role",
        }),
        "finished" => {
            return Err(ReplayError::State {
                id,
                state: r.state,
                hint: "every selected event was republished; replaying them again is a new request",
            })
        }
        _ => {}
    }
    // Shadow mode may have been switched on since the request.
    let types = r.summary.as_array().into_iter().flatten();
    let types = types.filter_map(|g| g.get(0).and_then(serde_json::Value::as_str));
    select::refuse_shadowed(&select::shadowed(cfg, types))?;
    let approved = u32::try_from(r.rate).unwrap_or(1).max(1);
    let rate = rate.map_or(approved, |x| x.clamp(1, approved));
    select::check_table(&r.selection, cfg)?;
    let sel = Selection::from_json(&r.selection)?;
    recount(cfg, &audit, &r, &sel).await?;
    let names = cfg.source.columns.resolve().map_err(RelayError::from)?;
    let reader = source::sql_connect(cfg).await?;
    TableReader::prepare_session(&reader).await?;
    let filter = sel.filter(&names, &select::event_id_type(cfg, &reader).await?)?;
    let cursor = r.cursor.clone();
    let mut reader =
        TableReader::pages(cfg, reader, filter, cursor, batch(rate), "replay_produced").await?;
    store::start_run(&audit, id).await?;
    tracing::info!(
        replay = id,
        selection = %sel.describe(),
        rate,
        acknowledged_before = r.sent,
        resumes_after = ?r.cursor.as_ref().map(|c| c.event_id()),
        "replay run started"
    );
    let observed = Arc::new(Observed::default());
    let stages_sql = source::sql_connect(cfg).await?;
    let mut st = Stages::refusing_poison(cfg, stages_sql, observed.clone())?;
    let (producer, mut acks) = Producer::replaying(cfg, observed)?;
    let mut hooks = RunHooks {
        audit: &audit,
        id,
        events: r.events,
        before: r.sent,
        pacer: Pacer::new(rate),
        progress: Progress::new(id, r.events.max(0) as u64, r.sent.max(0) as u64),
        sent: 0,
    };
    let published = reader
        .publish(
            cfg,
            &mut st,
            &producer,
            &mut acks,
            &mut shutdown,
            &mut hooks,
        )
        .await;
    let ended = match published {
        Ok(Flow::Done) => Ok("finished"),
        Ok(Flow::Shutdown) => {
            // Let what is in flight land and move the cursor past it, bounded.
            let (_keep, mut never) = watch::channel(false);
            let settle = reader.settle(&mut st, &producer, &mut acks, &mut never, &mut hooks);
            match tokio::time::timeout(cfg.shutdown_timeout(), settle).await {
                Ok(Err(e)) => Err(ReplayError::from(e)),
                _ => Ok("interrupted"),
            }
        }
        Err(e) => Err(ReplayError::from(e)),
    };
    hooks.progress.finish();
    match ended {
        Ok(state) => {
            store::end_run(&audit, id, state, None).await?;
            let after = store::load(&audit, &cfg.source.slot, id).await?;
            tracing::info!(
                replay = id,
                state,
                sent = reader.sent(),
                acknowledged = after.sent,
                "replay run ended"
            );
            Ok(Outcome {
                state,
                sent_now: reader.sent(),
                acknowledged: after.sent,
                selected: r.events,
            })
        }
        Err(e) => {
            let msg = cfg.redactor.scrub(&e.to_string());
            let _ = store::end_run(&audit, id, "failed", Some(&msg)).await;
            Err(e)
        }
    }
}
