//! The delivery checks of the reliability tests: what the broker holds against what
//! committed ([`verify_delivery`]), the consumer's effects ([`verify_effects`]), and "the slot
//! never passed an undelivered event" ([`check_slot_invariant`]).

use super::inbox_reader::{InboxReader, InboxStats, Raw};
use super::writer::{connect_retry, WriteLog};
use crate::kafka::scan_topic;
use anyhow::{bail, Context, Result};
use rdkafka::message::{Headers, Message};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

/// What [`verify_delivery`] found.
#[derive(Debug, Clone, Default)]
pub struct DeliveryReport {
    pub records: usize,
    pub distinct: usize,
    pub duplicates: usize,
    /// Largest number of copies of one event.
    pub max_copies: usize,
}

/// Checks every record read against what committed:
/// - every record is a committed event (never a rolled-back or unknown one) and carries
///   exactly what was written: key = aggregate_id, value = payload, `aggregate_version`,
///   `aggregate_id`, `aggregate_type`, `event_type` headers;
/// - every copy of an event is byte-identical to the first (key, value, headers in order,
///   timestamp) and landed on the same partition;
/// - nothing committed is missing;
/// - per aggregate, first occurrences arrive in version order with no gap (a replay may
///   repeat earlier versions).
pub fn verify_delivery(records: &[Raw], log: &WriteLog, agg_type: &str) -> Result<DeliveryReport> {
    let mut first: HashMap<Uuid, &Raw> = HashMap::new();
    let mut copies: HashMap<Uuid, usize> = HashMap::new();
    // (reader, aggregate) → highest version seen so far; aggregate → partition
    let mut max_seen: HashMap<&str, i64> = HashMap::new();
    let mut partition_of: HashMap<(u32, &str), i32> = HashMap::new();
    for r in records {
        let id = r
            .header("event_id")
            .and_then(|s| Uuid::parse_str(s).ok())
            .with_context(|| format!("record without a valid event_id: {r:?}"))?;
        if log.rolled_back.contains(&id) {
            bail!(
                "rolled-back event {id} was delivered ({}:{}@{})",
                r.topic,
                r.partition,
                r.offset
            );
        }
        let Some(w) = log.committed.get(&id) else {
            bail!("unknown event {id} on the topic");
        };
        if r.key.as_deref() != Some(w.aggregate_id.as_bytes()) {
            bail!(
                "{id}: key {:?} is not the aggregate_id {}",
                r.key,
                w.aggregate_id
            );
        }
        let value: serde_json::Value =
            serde_json::from_slice(r.value.as_deref().unwrap_or_default())
                .with_context(|| format!("{id}: value is not JSON"))?;
        if value != w.payload {
            bail!("{id}: payload differs from the committed one");
        }
        let ver = w.version.to_string();
        for (h, want) in [
            ("aggregate_version", ver.as_str()),
            ("aggregate_id", w.aggregate_id.as_str()),
            ("aggregate_type", agg_type),
            ("event_type", "Deposited"),
        ] {
            if r.header(h) != Some(want) {
                bail!("{id}: header {h} = {:?}, written {want:?}", r.header(h));
            }
        }
        match partition_of.get(&(r.reader, w.aggregate_id.as_str())) {
            Some(p) if *p != r.partition => {
                bail!(
                    "aggregate {} on partitions {p} and {}",
                    w.aggregate_id,
                    r.partition
                )
            }
            _ => {
                partition_of.insert((r.reader, &w.aggregate_id), r.partition);
            }
        }
        *copies.entry(id).or_default() += 1;
        match first.get(&id) {
            Some(f) => {
                if f.content() != r.content() || f.partition != r.partition || f.topic != r.topic {
                    bail!(
                        "a copy of {id} differs from the first copy:\n first {f:?}\n later {r:?}"
                    );
                }
            }
            None => {
                first.insert(id, r);
                let m = max_seen.entry(&w.aggregate_id).or_insert(0);
                if w.version != *m + 1 {
                    bail!(
                        "order: {} version {} first arrived after version {} ({}:{}@{})",
                        w.aggregate_id,
                        w.version,
                        m,
                        r.topic,
                        r.partition,
                        r.offset
                    );
                }
                *m = w.version;
            }
        }
    }
    let missing: Vec<&Uuid> = log
        .committed
        .keys()
        .filter(|k| !first.contains_key(k))
        .collect();
    if !missing.is_empty() {
        bail!(
            "{} of {} committed events never delivered, e.g. {:?}",
            missing.len(),
            log.committed.len(),
            &missing[..missing.len().min(3)]
        );
    }
    Ok(DeliveryReport {
        records: records.len(),
        distinct: first.len(),
        duplicates: records.len() - first.len(),
        max_copies: copies.values().copied().max().unwrap_or(0),
    })
}

/// Waits until `reader` applied every committed event and went quiet, stops it, and checks
/// the records (`verify_delivery`) and the consumer's effects (`verify_effects`).
pub async fn drain_and_verify(
    reader: InboxReader,
    wlog: &WriteLog,
    agg_type: &str,
    inbox_dsn: &str,
) -> Result<(InboxStats, DeliveryReport)> {
    let ids = wlog.committed.keys().copied().collect();
    reader.wait_applied(&ids, Duration::from_secs(120)).await?;
    reader
        .wait_quiet(Duration::from_secs(1), Duration::from_secs(30))
        .await?;
    let (stats, records) = reader.stop().await?;
    let report = verify_delivery(&records, wlog, agg_type)?;
    verify_effects(inbox_dsn, wlog).await?;
    assert!(stats.fatal.is_none(), "{stats:?}");
    Ok((stats, report))
}

/// The consumer's business table shows each committed event's effect exactly once:
/// one `movement` row per committed event and none for anything else, and every account's
/// balance, version and application count equal what the committed events imply.
pub async fn verify_effects(dsn: &str, log: &WriteLog) -> Result<()> {
    let c = connect_retry(dsn).await?;
    let twice: Vec<(Uuid, i64)> = c
        .query(
            "SELECT event_id, count(*) FROM movement GROUP BY event_id HAVING count(*) > 1 LIMIT 5",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    if !twice.is_empty() {
        bail!("events applied more than once: {twice:?}");
    }
    let applied: HashSet<Uuid> = c
        .query("SELECT event_id FROM movement", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let committed: HashSet<Uuid> = log.committed.keys().copied().collect();
    if let Some(x) = applied.difference(&committed).next() {
        bail!("event {x} applied but never committed");
    }
    if applied.len() != committed.len() {
        bail!(
            "{} events applied, {} committed",
            applied.len(),
            committed.len()
        );
    }
    let mut want: HashMap<&str, (i64, i64, i32)> = HashMap::new();
    for w in log.committed.values() {
        let e = want.entry(&w.aggregate_id).or_default();
        e.0 += w.amount;
        e.1 = e.1.max(w.version);
        e.2 += 1;
    }
    let rows = c
        .query("SELECT id, balance, version, applied FROM account", &[])
        .await?;
    if rows.len() != want.len() {
        bail!("{} accounts, {} expected", rows.len(), want.len());
    }
    for r in rows {
        let id: String = r.get(0);
        let got = (r.get::<_, i64>(1), r.get::<_, i64>(2), r.get::<_, i32>(3));
        let exp = want.get(id.as_str()).copied().unwrap_or_default();
        if got != exp {
            bail!("account {id}: (balance, version, applied) = {got:?}, expected {exp:?}");
        }
    }
    let processed: i64 = c
        .query_one(
            "SELECT count(*) FROM processed_event WHERE consumer = 'balances' AND outcome = 'applied'",
            &[],
        )
        .await?
        .get(0);
    if processed as usize != committed.len() {
        bail!(
            "{processed} processed_event rows, {} committed",
            committed.len()
        );
    }
    Ok(())
}

/// "The slot never passed an undelivered event": every transaction whose commit is surely
/// at or before `confirmed` (the slot's confirmed_flush_lsn) must have all its events in
/// `delivered`. Returns how many transactions the check covered.
pub fn check_slot_invariant(
    log: &WriteLog,
    confirmed: u64,
    delivered: &HashSet<Uuid>,
) -> Result<usize> {
    let mut covered = 0;
    for tx in &log.txs {
        if tx.lsn_after <= confirmed {
            covered += 1;
            if let Some(id) = tx.ids.iter().find(|i| !delivered.contains(i)) {
                bail!(
                    "the slot's confirmed LSN {} passed event {id} (committed by {}) that the broker never got",
                    source_lsn(confirmed),
                    source_lsn(tx.lsn_after)
                );
            }
        }
    }
    Ok(covered)
}

/// [`check_slot_invariant`] against a fresh read of `topic` from the beginning (use it while
/// no relay runs, so the broker's content cannot change under the check). Returns how many
/// transactions the check covered and the event ids on the topic.
pub fn check_slot_against_broker(
    bootstrap: &str,
    topic: &str,
    log: &WriteLog,
    confirmed: u64,
) -> Result<(usize, HashSet<Uuid>)> {
    let expected: usize = log
        .txs
        .iter()
        .filter(|t| t.lsn_after <= confirmed)
        .map(|t| t.ids.len())
        .sum();
    let mut delivered = HashSet::new();
    scan_topic(bootstrap, topic, expected, Duration::from_secs(60), |m| {
        if let Some(id) = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "event_id"))
            .and_then(|h| h.value)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| Uuid::parse_str(s).ok())
        {
            delivered.insert(id);
        }
    })?;
    let covered = check_slot_invariant(log, confirmed, &delivered)?;
    Ok((covered, delivered))
}

/// Transactions on the broker that the slot has surely not confirmed (their commit LSN is
/// above `confirmed`): a successor must deliver them again.
pub fn delivered_beyond_slot(log: &WriteLog, confirmed: u64, delivered: &HashSet<Uuid>) -> usize {
    log.txs
        .iter()
        .filter(|t| t.lsn_before >= confirmed && t.ids.iter().any(|i| delivered.contains(i)))
        .count()
}

fn source_lsn(l: u64) -> String {
    format!("{:X}/{:X}", l >> 32, l & 0xffff_ffff)
}
