//! `outboxd parked list|show|retry|discard`: the operator's repair path for parked events (R28).
//!
//! `retry` and `discard` only change the row (and write the audit trail) in one transaction; the
//! running relay publishes retried events — with the SAME `event_id` — and then releases the
//! events held behind them, in order, inside its own stream so nothing can overtake.

use crate::config::tables::ParkedTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::poison::store::{self, operator};
use crate::relay::source;
use clap::Subcommand;
use std::path::PathBuf;

mod bulk;
mod payload;

#[derive(Subcommand, Debug)]
pub enum ParkedCmd {
    /// Parked, blocked and retrying events (`--all` includes delivered and discarded ones).
    List {
        /// Include resolved events (delivered, discarded).
        #[arg(long)]
        all: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        repair: RepairDsn,
    },
    /// One parked event, with its error, its record and its audit trail.
    Show {
        /// The event's event_id (see `outboxd parked list`).
        event_id: String,
        /// Print the whole payload and headers (by default each stops after 1 KiB).
        #[arg(long)]
        full: bool,
        #[command(flatten)]
        repair: RepairDsn,
    },
    /// Republish with the same event_id, optionally with a corrected payload (a JSON file; for
    /// a bytea table, a file of raw bytes).
    ///
    /// The running relay republishes it through the live router: topic from the topic template,
    /// identity headers from the row's columns, the payload checked against its JSON Schema.
    ///
    /// With `--aggregate`, `--type`, `--table` or `--all`: every parked event selected, each
    /// audited (the events held behind them follow in order); `--dry-run` lists them first.
    Retry {
        /// The parked event's event_id (or a selection instead).
        event_id: Option<String>,
        #[command(flatten)]
        select: bulk::BulkArgs,
        /// A file with the corrected payload: JSON (validated against the event's schema), or
        /// for a table whose payload column is bytea its raw bytes, taken as they are.
        #[arg(long)]
        payload: Option<PathBuf>,
        /// Who asks (recorded in the audit row beside the database role).
        #[arg(long, env = "USER", default_value = "unknown")]
        operator: String,
        /// Why (recorded in the audit row; not needed with --dry-run).
        #[arg(long, required_unless_present = "dry_run")]
        reason: Option<String>,
        #[command(flatten)]
        repair: RepairDsn,
    },
    /// Give up on an event; requires a reason; audited; events held behind it are released.
    ///
    /// Works in every open state: parked, waiting for its retry, or held behind another event.
    ///
    /// With `--aggregate`, `--type`, `--table` or `--all`: every open event selected, in one
    /// transaction, each audited; `--dry-run` lists them first.
    Discard {
        /// The event's event_id (or a selection instead).
        event_id: Option<String>,
        #[command(flatten)]
        select: bulk::BulkArgs,
        /// Who decides (recorded in the audit row beside the database role).
        #[arg(long, env = "USER", default_value = "unknown")]
        operator: String,
        /// Why (recorded in the audit row; not needed with --dry-run).
        #[arg(long, required_unless_present = "dry_run")]
        reason: Option<String>,
        #[command(flatten)]
        repair: RepairDsn,
    },
}

/// The connection of a repair: the operator's own database role, so the audit records who
/// really made the change (`session_user`), not the relay's.
#[derive(clap::Args, Debug, Default)]
pub struct RepairDsn {
    /// Connect as this role instead of source.dsn's (recommended: a repair role, see
    /// sql/roles.sql and docs/operations.md).
    #[arg(long = "dsn", env = "OUTBOXD_REPAIR_DSN", hide_env_values = true)]
    pub dsn: Option<String>,
}

impl ParkedCmd {
    fn repair(&self) -> &RepairDsn {
        match self {
            Self::List { repair, .. }
            | Self::Show { repair, .. }
            | Self::Retry { repair, .. }
            | Self::Discard { repair, .. } => repair,
        }
    }
}

pub async fn run(cfg: &Config, cmd: ParkedCmd) -> Result<String, RelayError> {
    let mut cfg = cfg.clone();
    if let Some(dsn) = &cmd.repair().dsn {
        cfg.source.dsn = dsn.clone();
        cfg.source.password = None;
    }
    let cfg = &cfg;
    let mut sql = source::sql_connect(cfg).await?;
    store::ensure_tables(&sql).await?;
    crate::obs::status_row::ensure_table(&sql).await?;
    let slot = &cfg.source.slot;
    match cmd {
        ParkedCmd::List { all, json, .. } => list(cfg, &sql, all, json).await,
        ParkedCmd::Show { event_id, full, .. } => show(cfg, &sql, &event_id, full).await,
        ParkedCmd::Retry {
            event_id,
            select,
            payload,
            operator,
            reason,
            ..
        } => {
            let reason = reason.unwrap_or_default();
            if reason.trim().is_empty() && !select.dry_run {
                return Err(RelayError::Setup("retry needs a --reason".into()));
            }
            if select.selects() && payload.is_some() {
                return Err(RelayError::Setup(
                    "--payload corrects one event: name its event_id instead of a selection".into(),
                ));
            }
            if select.selects() || select.dry_run {
                let (action, id) = (bulk::Action::Retry, event_id.as_deref());
                return bulk::run(cfg, &mut sql, action, id, &select, &operator, &reason).await;
            }
            let event_id = one(event_id, "retry")?;
            // Its own table's mapping and schemas; never another table's.
            let table = table_of(cfg, &sql, &event_id).await?;
            let new_payload = match payload {
                None => None,
                Some(p) => Some(payload::read(&table, &sql, &p).await?),
            };
            if let Some(payload::Read::Json(v)) = &new_payload {
                validate(&table.validation, &sql, slot, &event_id, v).await?;
            }
            let corrected = new_payload.as_ref().map(|p| match p {
                payload::Read::Json(v) => operator::Corrected::Json(v),
                payload::Read::Bytes(b) => operator::Corrected::Bytes(b),
            });
            let req = operator::Request {
                slot,
                event_id: &event_id,
                operator: &operator,
                reason: &reason,
            };
            let nulls = table.columns.resolve()?.debezium_nulls;
            match operator::request_retry(&mut sql, &req, corrected.as_ref(), nulls).await? {
                operator::RetryOutcome::Requested => {}
                operator::RetryOutcome::NotParked => return Err(not_parked(&event_id)),
                operator::RetryOutcome::Unroutable(field) => {
                    return Err(RelayError::Setup(format!(
                        "{event_id} has no {field}, so it cannot be routed or republished: \
                         discard it (`outboxd parked discard {} --reason …`; events held \
                         behind it are then released) and, if it is needed, write a corrected \
                         event to the outbox",
                        crate::model::shell::quote(&event_id)
                    )))
                }
            }
            Ok(format!(
                "retry of {event_id} requested by {operator}; the running relay republishes it with the same event_id{}",
                if new_payload.is_some() { " and the corrected payload" } else { "" }
            ))
        }
        ParkedCmd::Discard {
            event_id,
            select,
            operator,
            reason,
            ..
        } => {
            let reason = reason.unwrap_or_default();
            if reason.trim().is_empty() && !select.dry_run {
                return Err(RelayError::Setup("discard needs a --reason".into()));
            }
            if select.selects() || select.dry_run {
                let (action, id) = (bulk::Action::Discard, event_id.as_deref());
                return bulk::run(cfg, &mut sql, action, id, &select, &operator, &reason).await;
            }
            let event_id = one(event_id, "discard")?;
            let req = operator::Request {
                slot,
                event_id: &event_id,
                operator: &operator,
                reason: &reason,
            };
            if !operator::discard(&mut sql, &req).await? {
                return Err(not_parked(&event_id));
            }
            Ok(format!(
                "{event_id} discarded by {operator} (audited); events held behind it will be released"
            ))
        }
    }
}

/// The listed table a parked event belongs to (see [`ParkedTable`]); Err, with what to do,
/// when it is not open or its table is not listed: the relay would not release it.
async fn table_of(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    event_id: &str,
) -> Result<crate::config::tables::OutboxTable, RelayError> {
    let d = operator::show(sql, &cfg.source.slot, event_id, 0)
        .await?
        .ok_or_else(|| not_parked(event_id))?;
    let tables = cfg.tables();
    match ParkedTable::of(&labels(cfg), d.table.as_deref()) {
        ParkedTable::Listed(i) => Ok(tables[i].clone()),
        other => Err(RelayError::Setup(format!(
            "{event_id} is not retried, nothing changed: {}",
            other.not_listed().unwrap_or_default()
        ))),
    }
}

/// The listed tables' `schema.table`, in configuration order.
fn labels(cfg: &Config) -> Vec<String> {
    cfg.tables().iter().map(|t| t.label()).collect()
}

/// How `list` and `show` name a parked event's table: `None` with one table and a record of
/// it (no column then: a one-table relay's output stays as it was).
fn table_cell(cfg: &Config, labels: &[String], table: Option<&str>) -> Option<String> {
    match ParkedTable::of(labels, table) {
        ParkedTable::Listed(_) if !cfg.is_multi_table() => None,
        ParkedTable::Listed(i) => Some(labels[i].clone()),
        ParkedTable::Unlisted(t) => Some(format!("{t} (not listed)")),
        ParkedTable::Unknown => Some("(none)".into()),
    }
}

/// A corrected payload must pass the event's JSON Schema (when its table's validation has
/// one), as the live path would demand; the relay checks it again when it republishes.
async fn validate(
    validation: &crate::config::ValidationConfig,
    sql: &tokio_postgres::Client,
    slot: &str,
    event_id: &str,
    payload: &serde_json::Value,
) -> Result<(), RelayError> {
    let Some(mut validator) = crate::poison::validate::Validator::from_config(validation) else {
        return Ok(());
    };
    let d = operator::show(sql, slot, event_id, 0)
        .await?
        .ok_or_else(|| not_parked(event_id))?;
    let schema_version = d
        .headers
        .as_deref()
        .and_then(|h| serde_json::from_str::<Vec<(String, Option<String>)>>(h).ok())
        .and_then(|hs| hs.into_iter().find(|(k, _)| k == "schema_version"))
        .and_then(|(_, v)| v)
        .unwrap_or_else(|| "1".into());
    let bytes = serde_json::to_vec(payload).unwrap_or_default();
    validator
        .check(
            d.event_type.as_deref().unwrap_or(""),
            &schema_version,
            &bytes,
        )
        .map_err(|m| {
            RelayError::Setup(format!(
                "the corrected payload fails the event's schema, nothing changed: {m}"
            ))
        })
}

/// The event_id of a one-event `retry`/`discard`, or what to give instead.
fn one(event_id: Option<String>, verb: &str) -> Result<String, RelayError> {
    event_id.ok_or_else(|| {
        RelayError::Setup(format!(
            "{verb} needs an event_id, or a selection: --aggregate ID, --type EVENT_TYPE, \
             --table SCHEMA.TABLE or --all (try --dry-run first)"
        ))
    })
}

fn not_parked(event_id: &str) -> RelayError {
    RelayError::Setup(format!(
        "no open parked event {event_id} for this slot (see `outboxd parked list`)"
    ))
}

/// Text from the table as the terminal may show it: control characters (escape sequences
/// written into a payload or an aggregate id by whoever wrote the row) are escaped, never sent.
pub(crate) fn printable(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

async fn list(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    all: bool,
    json: bool,
) -> Result<String, RelayError> {
    let rows = operator::list(sql, &cfg.source.slot, all).await?;
    let labels = labels(cfg);
    let cells: Vec<Option<String>> = rows
        .iter()
        .map(|r| table_cell(cfg, &labels, r.table.as_deref()))
        .collect();
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "event_id": r.event_id, "state": r.state,
                    "event_type": r.event_type, "aggregate_type": r.aggregate_type,
                    "aggregate_id": r.aggregate_id, "aggregate_version": r.aggregate_version,
                    "error_class": r.error_class, "attempts": r.attempts,
                    "first_seen": r.first_seen, "error": r.error_message,
                    "table": r.table,
                    "listed": matches!(ParkedTable::of(&labels, r.table.as_deref()), ParkedTable::Listed(_)),
                })
            })
            .collect();
        return Ok(serde_json::to_string_pretty(&v).unwrap_or_default());
    }
    // A table column when a row's table needs naming (several tables, or one not listed).
    let table_col = cells.iter().any(Option::is_some);
    let mut out = String::new();
    if table_col {
        out.push_str(&format!("{:<32}  ", "table"));
    }
    out.push_str(&format!(
        "{:<36}  {:<9}  {:<20}  {:<24}  {:>7}  {:<14}  {:>3}  first_seen\n",
        "event_id", "state", "event_type", "aggregate", "version", "error_class", "try"
    ));
    for (r, cell) in rows.iter().zip(&cells) {
        if table_col {
            let cell = cell.as_deref().unwrap_or_default();
            out.push_str(&format!("{:<32}  ", printable(cell)));
        }
        out.push_str(&format!(
            "{:<36}  {:<9}  {:<20}  {:<24}  {:>7}  {:<14}  {:>3}  {}\n",
            printable(&r.event_id),
            r.state,
            printable(&r.event_type),
            printable(&format!("{}/{}", r.aggregate_type, r.aggregate_id)),
            r.aggregate_version
                .map(|v| v.to_string())
                .unwrap_or_default(),
            printable(&r.error_class),
            r.attempts,
            r.first_seen,
        ));
    }
    out.push_str(&format!("{} event(s)", rows.len()));
    Ok(out)
}

/// At most this much of a payload or of the headers unless `--full`.
const SHOW_LIMIT: usize = 1024;

/// At most this much with `--full`: far above what the relay parks (`[parked]
/// max_record_bytes`), so only a row written outside the relay is cut.
const FULL_LIMIT: i32 = 16 << 20;

/// `s` (read from a value of `total` bytes, or characters), cut after [`SHOW_LIMIT`] bytes (at
/// a character boundary) unless `full`; said when it is not everything.
fn clipped(s: String, full: bool, total: Option<i64>) -> String {
    let total = total.map_or(s.len(), |t| usize::try_from(t).unwrap_or(usize::MAX));
    if full && total <= FULL_LIMIT as usize {
        return s;
    }
    if full {
        return format!(
            "{s}… ({total} bytes in all: more than --full shows; written outside the relay?)"
        );
    }
    if s.len() <= SHOW_LIMIT && total <= SHOW_LIMIT {
        return s;
    }
    let mut end = SHOW_LIMIT.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}… ({total} bytes in all; --full shows everything)",
        &s[..end]
    )
}

async fn show(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    event_id: &str,
    full: bool,
) -> Result<String, RelayError> {
    // Read no more than is shown: a row written with the relay's credential can hold
    // hundreds of megabytes (issue 53).
    let limit = if full { FULL_LIMIT } else { SHOW_LIMIT as i32 };
    let d = operator::show(sql, &cfg.source.slot, event_id, limit)
        .await?
        .ok_or_else(|| not_parked(event_id))?;
    let o = |v: &Option<String>| printable(v.as_deref().unwrap_or_default());
    let mut out = format!(
        "event_id:      {}\nstate:         {}\nevent_type:    {}\naggregate:     {}/{} v{}\ntopic:         {}\nerror:         [{}] {}\nattempts:      {}\nfirst_seen:    {}\nlast_seen:     {}\nblocked_by:    {}\nheaders:       {}\npayload:       {}\n",
        printable(event_id), d.state, o(&d.event_type), o(&d.aggregate_type), o(&d.aggregate_id),
        d.aggregate_version.map(|v| v.to_string()).unwrap_or_default(),
        o(&d.topic), printable(&d.error_class), printable(&d.error_message), d.attempts,
        d.first_seen, d.last_seen, o(&d.blocked_by), clipped(o(&d.headers), full, d.headers_chars), clipped(o(&d.payload), full, d.payload_bytes),
    );
    let labels = labels(cfg);
    if let Some(cell) = table_cell(cfg, &labels, d.table.as_deref()) {
        out.push_str(&format!("table:         {}\n", printable(&cell)));
    }
    if let Some(why) = ParkedTable::of(&labels, d.table.as_deref()).not_listed() {
        out.push_str(&format!("not released:  {}\n", printable(&why)));
    }
    for (at, action, operator, reason) in &d.audit {
        out.push_str(&format!(
            "audit:         {at} {action} by {}: {}\n",
            printable(operator),
            printable(reason)
        ));
    }
    Ok(out)
}

/// `outboxd check`: does this config seal what the relay parks (`[parked] key`)? Without a key
/// a held event is released only when its outbox row vouches for it, so a delete-after-insert
/// table needs one operator retry per held event, and rows forged with the relay's database
/// credential are caught only where an outbox row contradicts them.
pub fn integrity_line(cfg: &crate::Config) -> super::check_line::CheckLine {
    use super::check_line::CheckLine;
    let p = &cfg.parked;
    match (&p.key, &p.previous_key, p.accept_untagged) {
        (None, ..) => CheckLine::warn(
            "parked integrity",
            "no [parked] key: parked and held rows carry no integrity tag, so a held event is \
             released only when its outbox row vouches for it (a table whose rows are deleted \
             after insert needs a retry per held event) and a row forged with the relay's \
             database credential is caught only where an outbox row contradicts it. On the \
             relay's config set OUTBOXD_PARKED_KEY or parked.key_file (docs/operations.md, \
             \"Delete-after-insert outboxes\"); the repair role's config needs no key",
        ),
        (Some(_), prev, untagged) => {
            let mut d = "parked and held rows are sealed (HMAC-SHA256) and checked before release"
                .to_string();
            if prev.is_some() {
                d.push_str("; previous_key still verifies: remove it once `outboxd parked list` shows no row parked before the rotation");
            }
            if untagged {
                d.push_str("; accept_untagged = true releases rows without a tag by the older checks: turn it off once the rows parked before the key are resolved");
            }
            match prev.is_some() || untagged {
                true => CheckLine::warn("parked integrity", d),
                false => CheckLine::ok("parked integrity", d),
            }
        }
    }
}
