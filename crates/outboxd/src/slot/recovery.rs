//! Slot-loss recovery: republish, from the outbox table, what a lost slot never streamed.
//!
//! The outbox table is the source of truth; the slot is only a cursor over its inserts. When
//! the cursor is gone ([`crate::slot::guard`] decides that), the gap is every row written by a
//! transaction at or after the state row's `delivered_xid` ([`crate::slot::gap`]: exact, whatever
//! `created_at` holds), plus, on an operator's request, rows created since `--since`. The
//! procedure leaves no gap and is safe to kill at any point:
//!
//! 1. Record the intent (`recovering_xid`, `recovering_since`) in `outboxd_slot_state`: a relay
//!    killed from here on recovers the same rows again.
//! 2. Replace the slot when it cannot stream (missing, invalidated, another cluster's): drop
//!    it, then `CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT` on a replication session. The
//!    exported snapshot sees exactly the transactions that committed before the new slot's
//!    consistent point; everything after it comes from the slot. A slot that can still stream
//!    is kept and read under a fresh snapshot, which sees at least everything before it.
//! 3. Under that snapshot, read the rows through a cursor, ordered by aggregate and version,
//!    and feed them to the session's stages as pgoutput Insert messages
//!    ([`crate::relay::table_reader`], which replay uses too): the same router, validation,
//!    parking and producer as the live stream, so the records are byte-identical.
//! 4. Wait for every acknowledgement, then rebase the state row (clearing the intent) and
//!    start streaming from the slot's consistent point.
//!
//! With several outbox tables (`[[source.tables]]`) step 3 reads each listed table in turn,
//! under the same snapshot, each through its own mapping: the gap is every table's.
//!
//! Duplicates are the price (rows of transactions between `delivered_xid` and the loss that had
//! been delivered); consumers dedupe on `event_id`.

use crate::config::tables::OutboxTable;
use crate::config::{Config, SlotLossPolicy};
use crate::error::RelayError;
use crate::model::columns::ColumnNames;
use crate::obs::telemetry::ops::Op;
use crate::relay::kafka::{Ack, Producer};
use crate::relay::slot_host::SlotHost;
use crate::relay::source::{self, quote_ident};
use crate::relay::stages::Stages;
use crate::relay::table_reader::{self, Flow, NoHooks, TableReader};
use crate::slot::gap;
use crate::slot::guard::{Gap, Loss, LossReason};
use crate::slot::state::{self as slot_state, Identity};
use chrono::{DateTime, Utc};
use opentelemetry::KeyValue;
use pgwire_replication::ReplicationClient;
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;

/// A recovery ready to publish: the slot is in place and the reader holds the snapshot.
pub struct Prepared {
    /// The gated session the slot was created on (streams from its consistent point), or
    /// `None` when the existing slot was kept.
    pub repl: Option<ReplicationClient>,
    /// Where the stream continues: the new slot's consistent point, or the kept slot's position.
    pub start: u64,
    /// The reader of the first listed table; the others follow ([`Prepared::rest`]).
    reader: TableReader,
    /// The other listed tables' gap filters and orders, read after the first under the same
    /// snapshot.
    rest: std::collections::VecDeque<TableGap>,
    gap: Gap,
    reason: LossReason,
    /// Database clock before the slot was created: every transaction that committed earlier is
    /// published once this recovery finished (the new delivery mark).
    mark: DateTime<Utc>,
    /// The oldest transaction the reader's snapshot saw running, when the gap was exact: the
    /// new `delivered_xid` once everything is acknowledged.
    snapshot_xmin: Option<u64>,
    identity: Identity,
    new_slot: bool,
}

/// One listed table's share of a recovery: its gap as SQL and the order to read it in.
struct TableGap {
    table: OutboxTable,
    filter: String,
    order: Vec<String>,
}

/// What the gap holds now: rows per event type and their time range.
#[derive(Debug, Default)]
pub struct GapSummary {
    pub per_type: Vec<(String, i64)>,
    pub total: i64,
    pub first: Option<DateTime<Utc>>,
    pub last: Option<DateTime<Utc>>,
}

impl std::fmt::Display for GapSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} row(s)", self.total)?;
        if let (Some(a), Some(b)) = (self.first, self.last) {
            write!(f, " created {} .. {}", a.to_rfc3339(), b.to_rfc3339())?;
        }
        if !self.per_type.is_empty() {
            let parts: Vec<String> = self
                .per_type
                .iter()
                .map(|(t, n)| format!("{t}: {n}"))
                .collect();
            write!(f, " ({})", parts.join(", "))?;
        }
        Ok(())
    }
}

fn qualified(t: &OutboxTable) -> String {
    format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name))
}

/// Counts the rows a recovery of `gap` would republish, over every listed table (`first`/
/// `last`: their `created_at`, when one is mapped; with several tables the event types are
/// prefixed with their table).
pub async fn summarize(cfg: &Config, sql: &Client, gap: &Gap) -> Result<GapSummary, RelayError> {
    let mut s = GapSummary::default();
    let multi = cfg.is_multi_table();
    for t in cfg.tables() {
        let names = t.columns.resolve()?;
        let filter = gap::filter(sql, gap, names.created_at.as_deref()).await?;
        let range = match &names.created_at {
            Some(c) => format!("min(o.{0}), max(o.{0})", quote_ident(c)),
            None => "NULL::timestamptz, NULL::timestamptz".into(),
        };
        let q = format!(
            "SELECT o.{}::text, count(*), {range} FROM {} AS o WHERE {filter} GROUP BY 1 \
             ORDER BY 1",
            quote_ident(&names.event_type),
            qualified(&t)
        );
        for r in sql.query(&q, &[]).await? {
            let n: i64 = r.get(1);
            let ty = r.get::<_, Option<String>>(0).unwrap_or_default();
            let ty = if multi {
                format!("{}/{ty}", t.label())
            } else {
                ty
            };
            s.per_type.push((ty, n));
            s.total += n;
            let (a, b): (Option<DateTime<Utc>>, Option<DateTime<Utc>>) = (r.get(2), r.get(3));
            if let (Some(a), Some(b)) = (a, b) {
                s.first = Some(s.first.map_or(a, |f| f.min(a)));
                s.last = Some(s.last.map_or(b, |l| l.max(b)));
            }
        }
    }
    Ok(s)
}

/// Why nothing proves this loss's gap complete (its `gap` is `None`).
fn unproven(loss: &Loss) -> &'static str {
    match loss.reason {
        LossReason::NewSystem { .. } | LossReason::Interrupted(_) => {
            "the delivery state was written by another cluster (a logical restore, or a copy), \
             whose transaction ids say nothing about this one, so no gap can be proven complete"
        }
        LossReason::InvalidatedWithoutState(_) => "outboxd cannot recover it by itself",
        _ => {
            "the delivery state has no transaction-id mark yet (delivered_xid: written by an \
             older outboxd, or an adopted slot whose first mark was not acknowledged yet), so no \
             gap can be proven complete"
        }
    }
}

/// The error a loss turns into when outboxd will not recover it by itself: what happened, the
/// gap, and the command that recovers it.
async fn refusal(cfg: &Config, sql: &Client, loss: &Loss, why: &str) -> RelayError {
    let (gap, cmd) = match (&loss.gap, loss.since) {
        (Some(g), _) => (
            match summarize(cfg, sql, g).await {
                Ok(s) => format!("the gap is the outbox {g}: {s} now in the table"),
                Err(e) => format!("the gap is the outbox {g} (rows not counted: {e})"),
            },
            "outboxd recover --config FILE --dry-run, then outboxd recover --config FILE".into(),
        ),
        (None, Some(since)) => {
            let guess = Gap {
                from_xid: None,
                since: Some(since),
            };
            (
                match summarize(cfg, sql, &guess).await {
                    Ok(s) => format!(
                        "a time range can only approximate the gap: since {} (the delivery mark \
                         minus source.recovery_window) the table holds {s}; rows whose \
                         created_at lies earlier are not in it",
                        since.to_rfc3339()
                    ),
                    Err(e) => format!(
                        "a time range can only approximate the gap: since {} (rows not \
                         counted: {e})",
                        since.to_rfc3339()
                    ),
                },
                format!(
                    "outboxd recover --config FILE --dry-run --since {0}, then outboxd recover \
                     --config FILE --since {0} (choose an earlier time to be sure)",
                    since.to_rfc3339()
                ),
            )
        }
        (None, None) => (
            "nothing records where the gap starts".into(),
            "outboxd recover --config FILE --since <time the relay last delivered, minus the \
             longest transaction>"
                .into(),
        ),
    };
    RelayError::SlotLost(format!(
        "replication slot {:?}: {}. {why}; {gap}. Nothing past the gap was published. Recover \
         with: {cmd}",
        cfg.source.slot, loss.reason
    ))
}

/// Steps 1–2 of the module docs. Refuses (definite [`RelayError::SlotLost`]) under
/// `on_slot_loss = "halt"`, when nothing proves the gap complete, or when the table no longer
/// holds the rows at the delivery mark; `manual` (the `recover` command) skips the last check.
#[allow(clippy::too_many_arguments)]
pub async fn prepare(
    cfg: &Config,
    sql: &Client,
    host: &SlotHost,
    identity: &Identity,
    loss: &Loss,
    manual: bool,
    status_interval: std::time::Duration,
) -> Result<Prepared, RelayError> {
    let label = loss.reason.label();
    metrics::counter!(crate::obs::SLOT_LOSSES, "reason" => label).increment(1);
    metrics::gauge!(crate::obs::SLOT_LAST_LOSS).set(crate::obs::now_us() as f64 / 1e6);
    tracing::error!(slot = %cfg.source.slot, reason = label, gap = ?loss.gap.as_ref().map(|g| g.to_string()), "replication slot lost: {}", loss.reason);
    if !manual && cfg.source.on_slot_loss == SlotLossPolicy::Halt {
        return Err(refusal(cfg, sql, loss, "source.on_slot_loss = \"halt\"").await);
    }
    let Some(gap) = loss.gap.clone() else {
        return Err(refusal(cfg, sql, loss, unproven(loss)).await);
    };
    let tables = cfg.tables();
    // Two instances may detect the loss at once: one recovers, the other stands by.
    let locked: bool = sql
        .query_one(
            "SELECT pg_try_advisory_lock(hashtext('outboxd.recovery'), hashtext($1))",
            &[&cfg.source.slot],
        )
        .await?
        .get(0);
    if !locked {
        return Err(RelayError::SlotBusy {
            slot: cfg.source.slot.clone(),
            pid: "(another instance is recovering it)".into(),
        });
    }
    // Every automatic recovery asks each table whether it still holds the gap (a witness row
    // from before it, or statistics showing no row ever left): per table, since one table's
    // rows vouch for nothing in another. The operator's `recover` is their explicit choice.
    if !manual {
        let why = crate::slot::vouch::all(cfg, sql, &tables, &gap, loss.mark).await?;
        if let Some(why) = why {
            return Err(refusal(cfg, sql, loss, &why).await);
        }
    }
    slot_state::begin_recovery(sql, &cfg.source.slot, identity, &gap, label).await?;
    crate::fail::hit("recovery_intent");
    let mark = mark_before_slot(sql, host).await?;
    // The slot's server reads the gap: the exported snapshot is only valid there.
    let reader = match cfg.source.replication_dsn.as_deref() {
        Some(dsn) => source::sql_connect_to(cfg, dsn).await?,
        None => source::sql_connect(cfg).await?,
    };
    TableReader::prepare_session(&reader).await?;
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await?;
    let (repl, start) = if loss.replace_slot {
        if loss.slot_exists {
            drop_slot(cfg, host.sql(sql)).await?;
        }
        let mut repl = source::open_gated(cfg, status_interval).await?;
        // A slot created on a standby cannot be a failover slot.
        let failover = source::server_major(sql).await? >= 17 && !host.in_recovery();
        let create = source::create_slot_exported(cfg, &mut repl, failover);
        let (consistent, snapshot) = crate::relay::blockers::bounded(
            sql,
            Some(host.sql(sql)),
            &cfg.source.slot,
            "the recovery's new slot",
            cfg.source.slot_create_timeout,
            host.creating(sql, create),
        )
        .await?;
        tracing::info!(slot = %cfg.source.slot, consistent_point = %crate::model::lsn::fmt_lsn(consistent), "created replication slot with an exported snapshot");
        reader
            .batch_execute(&format!(
                "SET TRANSACTION SNAPSHOT {}",
                quote_literal(&snapshot)
            ))
            .await?;
        (Some(repl), consistent)
    } else {
        // The slot streams on; any snapshot taken now sees at least what it lacks.
        let slot = source::slot_state(cfg, host.sql(sql))
            .await?
            .ok_or_else(|| RelayError::Postgres(format!("slot {:?} vanished", cfg.source.slot)))?;
        (None, slot.confirmed_flush)
    };
    // Once every row this snapshot sees is published, every transaction older than the oldest
    // one it saw running is delivered: the new delivered_xid, when the gap was exact.
    let snapshot_xmin = match gap.from_xid {
        Some(_) => {
            let t: String = reader
                .query_one("SELECT pg_snapshot_xmin(pg_current_snapshot())::text", &[])
                .await?
                .get(0);
            t.parse().ok()
        }
        None => None,
    };
    // A pattern's table this snapshot sees that the recovery's tables lack was created (or
    // renamed in) after they were resolved: its rows before the new slot are in no slot, and
    // the session would take it for one born in the publication, streamed from its first row
    // (issue 56, seed 5007). The recovery stops here, interrupted; the next one resolves it.
    if let Some(f) = crate::slot::join::discover(cfg, &reader)
        .await?
        .into_iter()
        .find(|f| f.published)
    {
        return Err(RelayError::TablesChanged(format!(
            "outbox table {}.{} joined the publication while the recovery began",
            f.schema, f.table
        )));
    }
    // A table not joined yet (it came into the relayed set during the gap: moved, renamed,
    // created with rows) is read whole, in version order: its join would republish its older
    // rows after the gap's, out of order (issue 56).
    let joined = slot_state::joined(sql, &cfg.source.slot)
        .await
        .ok()
        .flatten();
    let mut rest = std::collections::VecDeque::new();
    for table in tables {
        let names = table.columns.resolve()?;
        let (relation, _) = table_reader::relation_of(&table, &reader).await?;
        let filter = match &joined {
            Some(j) if !j.contains(&relation.id) => "TRUE".to_string(),
            _ => gap::filter(&reader, &gap, names.created_at.as_deref()).await?,
        };
        let order = version_order(&names, &reader, &relation).await?;
        rest.push_back(TableGap {
            table,
            filter,
            order,
        });
    }
    let Some(first) = rest.pop_front() else {
        return Err(RelayError::Setup(
            "no outbox table to recover from: the patterns of source.tables match no table in \
             the publication yet"
                .into(),
        ));
    };
    let reader = first.cursor(reader, start, mark).await?;
    Ok(Prepared {
        repl,
        start,
        reader,
        rest,
        gap,
        reason: loss.reason.clone(),
        mark,
        snapshot_xmin,
        identity: identity.clone(),
        new_slot: loss.replace_slot,
    })
}

/// The order a recovery republishes rows in (docs/reliability.md, "Order"): per aggregate, by
/// version when the mapping has one; then by commit time when Postgres records it
/// (`track_commit_timestamp = on`); then by the writing transaction's id, older first (ids are
/// handed out at a transaction's first write, so for two transactions writing one aggregate it
/// follows the order of their writes, where `created_at`, a transaction's start or whatever
/// the application put there, may not); then by the row's place in the table (insertion order
/// within a transaction). Qualified: a bare name would sort by the same-named `::text` output
/// column ("10" < "9").
pub async fn version_order(
    names: &ColumnNames,
    client: &Client,
    relation: &crate::relay::pgoutput::Relation,
) -> Result<Vec<String>, RelayError> {
    let mut order = vec![
        format!("o.{}", quote_ident(&names.aggregate_type)),
        format!("o.{}", quote_ident(&names.aggregate_id)),
    ];
    if let Some(v) = &names.aggregate_version {
        if relation.columns.iter().any(|col| &col.name == v) {
            order.push(format!("o.{}", quote_ident(v)));
        }
    }
    let commit_ts: String = client
        .query_one("SELECT current_setting('track_commit_timestamp')", &[])
        .await?
        .get(0);
    if commit_ts == "on" {
        order.push("pg_xact_commit_timestamp(o.xmin) NULLS FIRST".into());
    }
    order.push("age(o.xmin) DESC".into());
    order.push("o.ctid".into());
    Ok(order)
}

/// The database clock before the slot is created: every transaction that committed earlier is
/// in the snapshot or the stream. With the slot on a standby, no later than the commit time of
/// the last transaction the standby replayed (a transaction the primary committed but the
/// standby has not replayed yet comes from the stream, after this recovery).
async fn mark_before_slot(sql: &Client, host: &SlotHost) -> Result<DateTime<Utc>, RelayError> {
    let now: DateTime<Utc> = sql.query_one("SELECT clock_timestamp()", &[]).await?.get(0);
    if !host.in_recovery() {
        return Ok(now);
    }
    let replayed: Option<DateTime<Utc>> = host
        .sql(sql)
        .query_one("SELECT pg_last_xact_replay_timestamp()", &[])
        .await?
        .get(0);
    Ok(replayed.map_or(now, |r| r.min(now)))
}

async fn drop_slot(cfg: &Config, sql: &Client) -> Result<(), RelayError> {
    match sql
        .execute(
            "SELECT pg_drop_replication_slot($1) WHERE EXISTS \
             (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            &[&cfg.source.slot],
        )
        .await
    {
        Ok(_) => {
            tracing::warn!(slot = %cfg.source.slot, "dropped the unusable replication slot");
            Ok(())
        }
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE) => {
            Err(RelayError::SlotBusy {
                slot: cfg.source.slot.clone(),
                pid: "(held while recovering)".into(),
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// Steps 3–4: publishes the gap through the stages, waits for every acknowledgement, records
/// the recovery. `Ok(None)`: shutdown was requested first (the intent stays recorded).
pub async fn publish(
    cfg: &Config,
    mut p: Prepared,
    st: &mut Stages,
    producer: &Producer,
    acks: &mut mpsc::UnboundedReceiver<Ack>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Option<(Option<ReplicationClient>, u64)>, RelayError> {
    let started = std::time::Instant::now();
    let traces = st.observed().started_traces();
    let mut op = Op::start(
        traces.as_deref(),
        "outboxd slot recovery",
        vec![
            KeyValue::new("outboxd.slot", cfg.source.slot.clone()),
            KeyValue::new("outboxd.slot_loss.reason", p.reason.label()),
            KeyValue::new("outboxd.recovery.gap", p.gap.to_string()),
            KeyValue::new("outboxd.recovery.new_slot", p.new_slot),
        ],
    );
    let mut reader = p.reader;
    let mut events = 0;
    loop {
        let flow = reader
            .publish(cfg, st, producer, acks, shutdown, &mut NoHooks)
            .await?;
        if flow == Flow::Shutdown {
            // Not a failure: the next session resumes it.
            op.event("outboxd.shutdown");
            op.ok();
            return Ok(None);
        }
        events += reader.sent() as i64;
        // The next listed table, under the same snapshot.
        let Some(next) = p.rest.pop_front() else {
            break;
        };
        let client = reader.into_client();
        client.batch_execute("CLOSE outboxd_table_reader").await?;
        reader = next.cursor(client, p.start, p.mark).await?;
    }
    reader.client().batch_execute("COMMIT").await?;
    let lsn = p.new_slot.then_some(p.start);
    slot_state::finish_recovery(
        st.sql(),
        st.slot(),
        &p.identity,
        lsn,
        p.mark,
        p.snapshot_xmin,
        events,
    )
    .await?;
    let secs = started.elapsed().as_secs_f64();
    op.set("outboxd.recovery.events", events);
    op.set(
        "outboxd.resume_lsn",
        crate::model::lsn::fmt_lsn(p.start).to_string(),
    );
    op.ok();
    metrics::counter!(crate::obs::RECOVERIES, "reason" => p.reason.label()).increment(1);
    metrics::counter!(crate::obs::RECOVERED_EVENTS).increment(events as u64);
    tracing::warn!(
        slot = %cfg.source.slot,
        reason = p.reason.label(),
        gap = %p.gap,
        events,
        seconds = secs,
        resume_lsn = %crate::model::lsn::fmt_lsn(p.start),
        "recovery finished: every outbox row of the gap is acknowledged by the broker"
    );
    Ok(Some((p.repl.take(), p.start)))
}

impl TableGap {
    /// The reader of this table's gap, on `client` (in the recovery's snapshot).
    async fn cursor(
        &self,
        client: Client,
        lsn: u64,
        mark: DateTime<Utc>,
    ) -> Result<TableReader, RelayError> {
        TableReader::cursor(
            &self.table,
            client,
            &self.filter,
            &self.order,
            lsn,
            mark,
            "recovery_produced",
        )
        .await
    }
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}
