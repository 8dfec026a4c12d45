//! `outboxd parked retry|discard` over a selection (`--aggregate`, `--type`, `--table`, `--all`)
//! and `--dry-run` (issue 40): one decision for many events, each still audited on its own.
//!
//! A retry takes parked heads only: what is held behind a head follows it automatically, in
//! version order, once the head is delivered (the relay checks each). The dry run lists what
//! would go, in the order the relay would publish it, and why any would be refused.

use crate::config::tables::ParkedTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::poison::store::bulk::{self, Candidate, Decision, Selection};
use std::fmt::Write;

/// How many events a dry run names one by one; the rest are counted.
const LISTED: usize = 1_000;

/// The selection flags of `retry` and `discard`.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct BulkArgs {
    /// Every open event of this aggregate_id.
    #[arg(long, value_name = "AGGREGATE_ID")]
    pub aggregate: Option<String>,
    /// Every open event of this event type.
    #[arg(long = "type", value_name = "EVENT_TYPE")]
    pub event_type: Option<String>,
    /// Every open event of this outbox table (`schema.table`).
    #[arg(long, value_name = "TABLE")]
    pub table: Option<String>,
    /// Every open event of this slot.
    #[arg(long)]
    pub all: bool,
    /// List what would go, in which order, and why any would be refused; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Afterwards, follow the running relay's release of the selected aggregates (a progress
    /// bar at a terminal) until nothing of them is left to release.
    #[arg(long, conflicts_with = "dry_run")]
    pub wait: bool,
}

impl BulkArgs {
    pub fn selects(&self) -> bool {
        self.aggregate.is_some() || self.event_type.is_some() || self.table.is_some() || self.all
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Retry,
    Discard,
}

/// Runs a selection (or one `event_id` under `--dry-run`).
pub async fn run(
    cfg: &Config,
    sql: &mut tokio_postgres::Client,
    action: Action,
    event_id: Option<&str>,
    args: &BulkArgs,
    operator: &str,
    reason: &str,
) -> Result<String, RelayError> {
    let (verb, states): (&str, &[&str]) = match action {
        Action::Retry => ("retry", &["parked"]),
        Action::Discard => ("discard", &["parked", "retry", "blocked"]),
    };
    if event_id.is_some() && args.selects() {
        return Err(RelayError::Setup(format!(
            "{verb}: an event_id or a selection (--aggregate, --type, --table, --all), not both"
        )));
    }
    let sel = selection(cfg, args)?;
    let slot = &cfg.source.slot;
    let mut found = bulk::select(sql, slot, &sel, states).await?;
    if let Some(id) = event_id {
        found.retain(|c| c.event_id == id);
    }
    let (go, refused): (Vec<_>, Vec<_>) = found
        .into_iter()
        .map(|c| {
            let why = match action {
                Action::Retry => refusal(cfg, &c),
                Action::Discard => None,
            };
            (c, why)
        })
        .partition(|(_, why)| why.is_none());
    let held: i64 = go.iter().map(|(c, _)| c.held).sum();
    let mut out = String::new();
    if args.dry_run {
        let _ = writeln!(
            out,
            "dry run, nothing changed: {verb} would take {} event(s){}{}",
            go.len(),
            match (action, held) {
                (_, 0) => String::new(),
                (Action::Retry, n) => format!(", then the {n} held behind them follow in order"),
                (Action::Discard, n) =>
                    format!("; {n} held behind them are released after them unless selected too"),
            },
            match refused.len() {
                0 => String::new(),
                n => format!("; {n} refused"),
            }
        );
        for (i, (c, _)) in go.iter().enumerate().take(LISTED) {
            let _ = writeln!(out, "{:>6}. {}", i + 1, describe(c));
        }
        if go.len() > LISTED {
            let _ = writeln!(out, "        … and {} more", go.len() - LISTED);
        }
    } else {
        let ids: Vec<String> = go.iter().map(|(c, _)| c.event_id.clone()).collect();
        let d = Decision {
            slot,
            operator,
            reason,
        };
        let n = match action {
            Action::Retry => bulk::request_retries(sql, &d, &ids).await?,
            Action::Discard => bulk::discard_all(sql, &d, &ids).await?,
        };
        let _ = writeln!(
            out,
            "{verb} of {n} event(s) by {operator}, each audited{}",
            match action {
                Action::Retry => format!(
                    "; the running relay republishes them in stream order with the same \
                     event_ids, and the {held} held behind them follow in order"
                ),
                Action::Discard => String::new(),
            }
        );
        if args.wait {
            let aggregates: Vec<(String, String)> = go
                .iter()
                .filter_map(|(c, _)| Some((c.aggregate_type.clone()?, c.aggregate_id.clone()?)))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            out.push_str(&follow(sql, slot, &aggregates).await?);
            out.push('\n');
        }
    }
    if !refused.is_empty() {
        let _ = writeln!(out, "refused ({}), not {verb}ed:", refused.len());
        for (c, why) in refused.iter().take(LISTED) {
            let _ = writeln!(
                out,
                "        {}: {}",
                describe(c),
                why.as_deref().unwrap_or("")
            );
        }
    }
    Ok(out.trim_end().to_string())
}

/// How long `--wait` waits for the relay to release one more event before it gives up.
const STALLED: std::time::Duration = std::time::Duration::from_secs(30);

/// `--wait`: polls the open events of `aggregates` until the relay has nothing of them left to
/// release; a bar on stderr at a terminal, the outcome as the returned line.
async fn follow(
    sql: &tokio_postgres::Client,
    slot: &str,
    aggregates: &[(String, String)],
) -> Result<String, RelayError> {
    use std::io::IsTerminal;
    let (start, _) = bulk::pending_in(sql, slot, aggregates).await?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::with_draw_target(
            Some(start.max(0) as u64),
            indicatif::ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "released [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, ETA {eta})",
        ) {
            b.set_style(style);
        }
        b
    });
    let began = std::time::Instant::now();
    let (mut last, mut moved) = (start, std::time::Instant::now());
    let outcome = loop {
        let (pending, parked) = bulk::pending_in(sql, slot, aggregates).await?;
        if let Some(b) = &bar {
            b.set_position((start - pending).max(0) as u64);
        }
        if pending == 0 {
            break match parked {
                0 => format!("released {start} event(s) in {:.1?}", began.elapsed()),
                n => format!(
                    "released {} event(s) in {:.1?}; {n} stopped as parked heads again \
                     (`outboxd parked list` says why)",
                    start - pending,
                    began.elapsed()
                ),
            };
        }
        if pending != last {
            (last, moved) = (pending, std::time::Instant::now());
        } else if moved.elapsed() > STALLED {
            break format!(
                "{pending} event(s) still to release, none released for {STALLED:?}: is the \
                 relay running (`outboxd status`)? They are released when it is"
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(outcome)
}

/// The selection of `args`, its table resolved against the config.
fn selection(cfg: &Config, args: &BulkArgs) -> Result<Selection, RelayError> {
    let mut sel = Selection {
        aggregate_id: args.aggregate.clone(),
        event_type: args.event_type.clone(),
        ..Selection::default()
    };
    if let Some(t) = &args.table {
        let (schema, name) = crate::config::tables::split(t);
        let label = format!("{schema}.{name}");
        let labels: Vec<String> = cfg.tables().iter().map(|t| t.label()).collect();
        if !labels.contains(&label) {
            return Err(RelayError::Setup(format!(
                "--table {t}: not an outbox table of this config (it lists {}); nothing changed",
                labels.join(", ")
            )));
        }
        // A one-table relay's records name no table: they are this table's.
        sel.table_untagged = !cfg.is_multi_table();
        sel.table = Some(label);
    }
    Ok(sel)
}

/// Why the relay could not republish this parked event as it is (`None`: it can).
fn refusal(cfg: &Config, c: &Candidate) -> Option<String> {
    let labels: Vec<String> = cfg.tables().iter().map(|t| t.label()).collect();
    let table = match ParkedTable::of(&labels, c.table.as_deref()) {
        ParkedTable::Listed(i) => cfg.tables()[i].clone(),
        other => return other.not_listed(),
    };
    let nulls = table.columns.resolve().is_ok_and(|n| n.debezium_nulls);
    for (missing, field, nullable) in [
        (c.aggregate_type.is_none(), "aggregate_type", false),
        (c.aggregate_id.is_none(), "aggregate_id", nulls),
        (c.event_type.is_none(), "event_type", nulls),
    ] {
        if missing && !nullable {
            return Some(format!(
                "no {field}: it cannot be routed; discard it (and write a corrected event)"
            ));
        }
    }
    if !c.has_payload {
        return Some("no payload: retry it alone with --payload, or discard it".into());
    }
    if matches!(c.error_class.as_str(), "forged" | "tampered") {
        return Some(format!(
            "the relay refused it as {}: it is not what the relay parked; discard it",
            c.error_class
        ));
    }
    if !c.tagged && cfg.parked.key.is_some() && !cfg.parked.accept_untagged {
        return Some(
            "no integrity tag, and this config's relay has a key: it would refuse it \
             (untagged); discard it, or set [parked] accept_untagged if it was parked before \
             the key"
                .into(),
        );
    }
    None
}

/// One line of a dry run.
fn describe(c: &Candidate) -> String {
    let mut s = format!(
        "{}  {}/{} v{}  {}  {} ({})",
        c.event_id,
        c.aggregate_type.as_deref().unwrap_or("?"),
        c.aggregate_id.as_deref().unwrap_or("?"),
        c.aggregate_version.map_or("?".into(), |v| v.to_string()),
        c.event_type.as_deref().unwrap_or("?"),
        c.state,
        c.error_class,
    );
    if c.held > 0 {
        let _ = write!(s, "  +{} held behind it", c.held);
    }
    if !c.tagged {
        s.push_str("  [no integrity tag]");
    }
    s
}
