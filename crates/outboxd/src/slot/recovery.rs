//! Slot-loss recovery: republish, from the outbox table, what a lost slot never streamed.
//!
//! The outbox table is the source of truth; the slot is only a cursor over its inserts. When
//! the cursor is gone ([`crate::slot::guard`] decides that), the gap is every row created since
//! the delivery mark minus `source.recovery_window`. The procedure leaves no gap and is safe to
//! kill at any point:
//!
//! 1. Record the intent (`recovering_since`) in `outboxd_slot_state`: a relay killed from here
//!    on recovers the same range again.
//! 2. Replace the slot when it cannot stream (missing, invalidated, another cluster's): drop
//!    it, then `CREATE_REPLICATION_SLOT … EXPORT_SNAPSHOT` on a replication session. The
//!    exported snapshot sees exactly the transactions that committed before the new slot's
//!    consistent point; everything after it comes from the slot. A slot that can still stream
//!    is kept and read under a fresh snapshot, which sees at least everything before it.
//! 3. Under that snapshot, read the rows through a cursor, ordered by aggregate and version,
//!    and feed them to the session's stages as pgoutput Insert messages: the same router,
//!    validation, parking and producer as the live stream, so the records are byte-identical.
//! 4. Wait for every acknowledgement, then rebase the state row (clearing the intent) and
//!    start streaming from the slot's consistent point.
//!
//! Duplicates are the price (rows between the mark minus the window and the consistent point
//! that had been delivered); consumers dedupe on `event_id`.

use crate::config::{Config, SlotLossPolicy};
use crate::error::RelayError;
use crate::relay::kafka::{Ack, Producer};
use crate::relay::pgoutput::{encode, Column, Relation};
use crate::relay::source::{self, quote_ident};
use crate::relay::stages::Stages;
use crate::slot::guard::{Loss, LossReason};
use crate::slot::state::{self as slot_state, Identity};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tokio::sync::{mpsc, watch};
use tokio_postgres::{Client, SimpleQueryMessage};

/// Rows fetched from the cursor per round trip (and per synthetic transaction).
const BATCH: usize = 1_000;

/// A recovery ready to publish: the slot is in place and the reader holds the snapshot.
pub struct Prepared {
    /// The gated session the slot was created on (streams from its consistent point), or
    /// `None` when the existing slot was kept.
    pub repl: Option<ReplicationClient>,
    /// Where the stream continues: the new slot's consistent point, or the kept slot's position.
    pub start: u64,
    reader: Client,
    relation: Relation,
    since: DateTime<Utc>,
    reason: LossReason,
    /// Database clock before the slot was created: every transaction that committed earlier is
    /// published once this recovery finished (the new delivery mark).
    mark: DateTime<Utc>,
    identity: Identity,
    new_slot: bool,
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

fn created_at(cfg: &Config) -> Result<String, RelayError> {
    cfg.source.columns.resolve()?.created_at.ok_or_else(|| {
        RelayError::SlotLost(
            "the outbox mapping has no created_at column (source.columns.created_at), so the gap \
             cannot be found by time: map a timestamptz column the writer fills with now()"
                .into(),
        )
    })
}

fn qualified(cfg: &Config) -> String {
    let (schema, table) = cfg.table_name();
    format!("{}.{}", quote_ident(&schema), quote_ident(&table))
}

/// Counts the rows a recovery from `since` would republish.
pub async fn summarize(
    cfg: &Config,
    sql: &Client,
    since: DateTime<Utc>,
) -> Result<GapSummary, RelayError> {
    let names = cfg.source.columns.resolve()?;
    let ts = quote_ident(&created_at(cfg)?);
    let q = format!(
        "SELECT {}::text, count(*), min({ts}), max({ts}) FROM {} WHERE {ts} >= $1 GROUP BY 1 ORDER BY 1",
        quote_ident(&names.event_type),
        qualified(cfg)
    );
    let mut s = GapSummary::default();
    for r in sql.query(&q, &[&since]).await? {
        let n: i64 = r.get(1);
        s.per_type
            .push((r.get::<_, Option<String>>(0).unwrap_or_default(), n));
        s.total += n;
        let (a, b): (DateTime<Utc>, DateTime<Utc>) = (r.get(2), r.get(3));
        s.first = Some(s.first.map_or(a, |f| f.min(a)));
        s.last = Some(s.last.map_or(b, |l| l.max(b)));
    }
    Ok(s)
}

/// The error a loss turns into when outboxd will not recover it by itself: what happened, the
/// gap, and the command that recovers it.
async fn refusal(cfg: &Config, sql: &Client, loss: &Loss, why: &str) -> RelayError {
    let gap = match loss.since {
        Some(since) => match summarize(cfg, sql, since).await {
            Ok(s) => format!(
                "the gap is every outbox row created since {}: {s} now in the table",
                since.to_rfc3339()
            ),
            Err(e) => format!(
                "the gap starts at {} (rows not counted: {e})",
                since.to_rfc3339()
            ),
        },
        None => "nothing records where the gap starts".into(),
    };
    let cmd = match loss.since {
        Some(since) => format!(
            "outboxd recover --config FILE --dry-run, then outboxd recover --config FILE --since {}",
            since.to_rfc3339()
        ),
        None => "outboxd recover --config FILE --since <time the relay last delivered, minus the longest transaction>".into(),
    };
    RelayError::SlotLost(format!(
        "replication slot {:?}: {}. {why}; {gap}. Nothing past the gap was published. Recover \
         with: {cmd}",
        cfg.source.slot, loss.reason
    ))
}

/// Steps 1–2 of the module docs. Refuses (definite [`RelayError::SlotLost`]) under
/// `on_slot_loss = "halt"`, when nothing bounds the gap, or when the table no longer holds the
/// rows at the delivery mark; `manual` (the `recover` command) skips the last two checks.
pub async fn prepare(
    cfg: &Config,
    sql: &Client,
    identity: &Identity,
    loss: &Loss,
    manual: bool,
    status_interval: std::time::Duration,
) -> Result<Prepared, RelayError> {
    let label = loss.reason.label();
    metrics::counter!(crate::obs::SLOT_LOSSES, "reason" => label).increment(1);
    metrics::gauge!(crate::obs::SLOT_LAST_LOSS).set(crate::obs::now_us() as f64 / 1e6);
    tracing::error!(slot = %cfg.source.slot, reason = label, since = ?loss.since.map(|s| s.to_rfc3339()), "replication slot lost: {}", loss.reason);
    if !manual && cfg.source.on_slot_loss == SlotLossPolicy::Halt {
        return Err(refusal(cfg, sql, loss, "source.on_slot_loss = \"halt\"").await);
    }
    let Some(since) = loss.since else {
        return Err(refusal(cfg, sql, loss, "outboxd cannot recover it by itself").await);
    };
    let ts = quote_ident(&created_at(cfg)?);
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
    if let (Some(mark), false, false) = (
        loss.mark,
        manual,
        matches!(loss.reason, LossReason::Interrupted(_)),
    ) {
        // Rows delivered at the mark were in the table; if none is left, cleanup (or a writer
        // that deletes in the inserting transaction) may have removed gap rows too.
        let q = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE {ts} <= $1)",
            qualified(cfg)
        );
        let present: bool = sql.query_one(&q, &[&mark]).await?.get(0);
        if !present {
            let why = format!(
                "The outbox table no longer holds the rows delivered at the delivery mark {} \
                 (cleaned up, or deleted in the transaction that inserted them), so it cannot \
                 vouch for the rows of the gap: events committed after the mark may be lost and \
                 must be re-emitted by their writers",
                mark.to_rfc3339()
            );
            return Err(refusal(cfg, sql, loss, &why).await);
        }
    }
    slot_state::begin_recovery(sql, &cfg.source.slot, identity, since, label).await?;
    crate::fail::hit("recovery_intent");
    let mark: DateTime<Utc> = sql.query_one("SELECT clock_timestamp()", &[]).await?.get(0);
    let reader = source::sql_connect(cfg).await?;
    reader
        .batch_execute(
            "SET datestyle = ISO, YMD; SET timezone = UTC; SET extra_float_digits = 3; \
             BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
        )
        .await?;
    let (repl, start) = if loss.replace_slot {
        if loss.slot_exists {
            drop_slot(cfg, sql).await?;
        }
        let mut repl = source::open_gated(cfg, status_interval).await?;
        let major = source::server_major(sql).await?;
        let (consistent, snapshot) = source::create_slot_exported(cfg, &mut repl, major).await?;
        tracing::info!(slot = %cfg.source.slot, consistent_point = %source::fmt_lsn(consistent), "created replication slot with an exported snapshot");
        reader
            .batch_execute(&format!(
                "SET TRANSACTION SNAPSHOT {}",
                quote_literal(&snapshot)
            ))
            .await?;
        (Some(repl), consistent)
    } else {
        // The slot streams on; any snapshot taken now sees at least what it lacks.
        let slot = source::slot_state(cfg, sql)
            .await?
            .ok_or_else(|| RelayError::Postgres(format!("slot {:?} vanished", cfg.source.slot)))?;
        (None, slot.confirmed_flush)
    };
    let relation = relation(cfg, &reader).await?;
    let names = cfg.source.columns.resolve()?;
    // Qualified: a bare name would sort by the same-named ::text output column ("10" < "9").
    let mut order = vec![
        format!("o.{}", quote_ident(&names.aggregate_type)),
        format!("o.{}", quote_ident(&names.aggregate_id)),
    ];
    if let Some(v) = &names.aggregate_version {
        if relation.columns.iter().any(|c| &c.name == v) {
            order.push(format!("o.{}", quote_ident(v)));
        }
    }
    order.push(format!("o.{ts}"));
    let cols: Vec<String> = relation
        .columns
        .iter()
        .map(|c| format!("o.{}::text", quote_ident(&c.name)))
        .collect();
    reader
        .batch_execute(&format!(
            "DECLARE outboxd_recovery NO SCROLL CURSOR FOR SELECT {} FROM {} AS o \
             WHERE o.{ts} >= {} ORDER BY {}",
            cols.join(", "),
            qualified(cfg),
            quote_literal(&since.to_rfc3339()),
            order.join(", ")
        ))
        .await?;
    Ok(Prepared {
        repl,
        start,
        reader,
        relation,
        since,
        reason: loss.reason.clone(),
        mark,
        identity: identity.clone(),
        new_slot: loss.replace_slot,
    })
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

/// The outbox table's columns as pgoutput announces them (no dropped or generated columns).
async fn relation(cfg: &Config, reader: &Client) -> Result<Relation, RelayError> {
    let (schema, table) = cfg.table_name();
    let rows = reader
        .query(
            "SELECT c.oid, a.attname::text, a.atttypid, a.atttypmod \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_attribute a ON a.attrelid = c.oid \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
               AND a.attgenerated = '' ORDER BY a.attnum",
            &[&schema, &table],
        )
        .await?;
    let id: u32 = rows
        .first()
        .map(|r| r.get(0))
        .ok_or_else(|| RelayError::Setup(format!("outbox table {schema}.{table} not found")))?;
    Ok(Relation {
        id,
        namespace: schema,
        name: table,
        columns: rows
            .iter()
            .map(|r| Column {
                name: r.get(1),
                type_oid: r.get(2),
                type_modifier: r.get(3),
            })
            .collect(),
    })
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
    let commit_us = p.mark.timestamp_micros() - crate::relay::lsn::PG_EPOCH_US;
    let xlog = |data: Vec<u8>| ReplicationEvent::XLogData {
        wal_start: Lsn(0),
        wal_end: Lsn(0),
        server_time_micros: commit_us,
        data: Bytes::from(data),
    };
    st.on_event(xlog(encode::relation(&p.relation)), producer)
        .await?;
    let max_events = cfg.relay.max_in_flight_events;
    let mut events: i64 = 0;
    loop {
        // Backpressure: the same window as the live stream.
        while st.in_flight().events() >= max_events {
            tokio::select! {
                _ = shutdown.changed() => return Ok(None),
                Some(ack) = acks.recv() => st.on_ack(ack, producer).await?,
            }
        }
        let msgs = p
            .reader
            .simple_query(&format!("FETCH {BATCH} FROM outboxd_recovery"))
            .await?;
        let rows: Vec<_> = msgs
            .into_iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(r) => Some(r),
                _ => None,
            })
            .collect();
        if rows.is_empty() {
            break;
        }
        st.on_event(
            ReplicationEvent::Begin {
                final_lsn: Lsn(p.start),
                xid: 0,
                commit_time_micros: commit_us,
            },
            producer,
        )
        .await?;
        for r in &rows {
            let values: Vec<Option<&[u8]>> =
                (0..r.len()).map(|i| r.get(i).map(str::as_bytes)).collect();
            st.on_event(xlog(encode::insert(p.relation.id, &values)), producer)
                .await?;
            events += 1;
            crate::fail::hit("recovery_produced");
        }
        st.on_event(
            ReplicationEvent::Commit {
                lsn: Lsn(p.start),
                end_lsn: Lsn(p.start),
                commit_time_micros: commit_us,
            },
            producer,
        )
        .await?;
        while let Ok(ack) = acks.try_recv() {
            st.on_ack(ack, producer).await?;
        }
    }
    while st.in_flight().events() > 0 {
        tokio::select! {
            _ = shutdown.changed() => return Ok(None),
            Some(ack) = acks.recv() => st.on_ack(ack, producer).await?,
        }
    }
    p.reader.batch_execute("COMMIT").await?;
    let lsn = p.new_slot.then_some(p.start);
    slot_state::finish_recovery(st.sql(), st.slot(), &p.identity, lsn, p.mark, events).await?;
    let secs = started.elapsed().as_secs_f64();
    metrics::counter!(crate::obs::RECOVERIES, "reason" => p.reason.label()).increment(1);
    metrics::counter!(crate::obs::RECOVERED_EVENTS).increment(events as u64);
    tracing::warn!(
        slot = %cfg.source.slot,
        reason = p.reason.label(),
        since = %p.since.to_rfc3339(),
        events,
        seconds = secs,
        resume_lsn = %source::fmt_lsn(p.start),
        "recovery finished: every outbox row of the gap is acknowledged by the broker"
    );
    Ok(Some((p.repl.take(), p.start)))
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}
