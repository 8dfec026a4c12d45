//! `outboxd recover --config F [--since T] [--dry-run]`: the slot-loss recovery of
//! [`crate::slot::recovery`] on an operator's request, e.g. after restoring into a new cluster or
//! under `source.on_slot_loss = "halt"`. It runs one recovery session and exits; `run` streams
//! on from the slot afterwards.

use crate::config::Config;
use crate::relay::source;
use crate::slot::guard::{self as slot_guard, Decision};
use crate::slot::recovery;
use crate::slot::state as slot_state;
use crate::supervisor::session::{self as pipeline, Mode};
use anyhow::{bail, Context};
use chrono::{DateTime, Utc};
use std::fmt::Write;

pub async fn run(
    cfg: &Config,
    since: Option<DateTime<Utc>>,
    dry_run: bool,
) -> anyhow::Result<String> {
    if cfg.shadow.enabled && !dry_run {
        bail!(
            "shadow mode is on (shadow.enabled): `recover` would deliver the gap for real. Let \
             `outboxd run` recover it (in shadow mode it builds and does not deliver), or run \
             recover after the cut-over"
        );
    }
    let sql = source::sql_connect(cfg).await?;
    let host = source::SlotHost::connect(cfg).await?;
    let (slot, _) = source::preflight_opt(cfg, &sql, &host).await?;
    let identity = slot_state::identity(&sql).await?;
    let state = slot_state::load_if_present(&sql, &cfg.source.slot).await?;
    let decision = slot_guard::decide(
        state.as_ref(),
        slot.as_ref(),
        &identity,
        cfg.source.recovery_window,
    );
    let name = &cfg.source.slot;
    let (gap, what, replace) = match (since, &decision) {
        (Some(t), d) => {
            let l = d.manual_loss(slot.is_some(), t);
            let what = match l.gap.as_ref().and_then(|g| g.from_xid) {
                Some(_) => format!("--since and the detected gap ({})", l.reason),
                None => "--since".to_string(),
            };
            (l.gap.unwrap_or_default(), what, l.replace_slot)
        }
        (None, Decision::Lost(l)) => match &l.gap {
            Some(g) => (
                g.clone(),
                format!("the detected gap: {}", l.reason),
                l.replace_slot,
            ),
            None => bail!(
                "{}: nothing proves a gap complete by transaction id; pass --since TIME{}",
                l.reason,
                l.since
                    .map(|t| format!(
                        " (the delivery mark minus source.recovery_window is {}; rows created \
                         earlier are not covered)",
                        t.to_rfc3339()
                    ))
                    .unwrap_or_default()
            ),
        },
        (None, Decision::Create) => bail!(
            "no delivery state for slot {name:?} (outboxd_slot_state, in source.relay_schema): nothing records a \
             gap; pass --since TIME to republish rows created since then"
        ),
        (None, _) => {
            return Ok(format!(
                "slot {name:?} is healthy and no recovery is pending: nothing to recover (pass \
                 --since TIME to republish rows anyway)\n"
            ))
        }
    };
    let active = slot.as_ref().and_then(|s| s.active_pid);
    let summary = recovery::summarize(cfg, &sql, &gap).await?;
    let mut out = String::new();
    let slot_plan = match (&slot, replace) {
        (None, _) => {
            format!("slot {name:?} does not exist: it is created with an exported snapshot")
        }
        (Some(_), true) => format!(
            "slot {name:?} cannot stream what is missing: it is dropped and created again with an \
             exported snapshot"
        ),
        (Some(_), false) => format!("slot {name:?} is kept and streams on from its position"),
    };
    if dry_run {
        writeln!(out, "dry run: nothing was changed")?;
        writeln!(out, "range:   {what}: {gap}")?;
        writeln!(out, "slot:    {slot_plan}")?;
        writeln!(
            out,
            "rows:    {} to republish with their original event_id",
            summary.total
        )?;
        if let (Some(a), Some(b)) = (summary.first, summary.last) {
            writeln!(
                out,
                "         created {} .. {}",
                a.to_rfc3339(),
                b.to_rfc3339()
            )?;
        }
        for (t, n) in &summary.per_type {
            writeln!(out, "         {t}: {n}")?;
        }
        writeln!(
            out,
            "effects: consumers receive these event_ids again; those already delivered are \
             duplicates their inbox absorbs (R2)"
        )?;
        if let Some(pid) = active {
            writeln!(
                out,
                "note:    a relay streams from the slot now (PID {pid}); stop it before recovering"
            )?;
        }
        return Ok(out);
    }
    if let Some(pid) = active {
        bail!(
            "a relay streams from slot {name:?} (PID {pid}): stop it first (a running relay with \
             on_slot_loss = \"recover\" recovers a lost slot by itself)"
        );
    }
    let (_tx, mut rx) = tokio::sync::watch::channel(false);
    pipeline::run_session_as(
        cfg,
        &mut rx,
        Mode::RecoverOnly(since),
        &Default::default(),
        None,
    )
    .await
    .context("recovery")?;
    let after = slot_state::load(&sql, name).await?;
    let events = after
        .as_ref()
        .and_then(|s| s.last_recovery_events)
        .unwrap_or(0);
    writeln!(
        out,
        "recovered: {events} event(s) ({gap}) republished and acknowledged"
    )?;
    writeln!(out, "slot:      {slot_plan}")?;
    writeln!(
        out,
        "next:      start the relay (outboxd run); it streams on from the slot"
    )?;
    Ok(out)
}
