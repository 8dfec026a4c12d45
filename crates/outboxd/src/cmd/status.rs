//! `outboxd status`: the slot as Postgres sees it, the active relay, what it last reported, and
//! the parked events — a human table by default, `--json` for scripts.

use crate::config::Config;
use crate::error::RelayError;
use crate::relay::source;
use serde_json::{json, Value};

/// Collects the status document.
pub async fn collect(cfg: &Config) -> Result<Value, RelayError> {
    let sql = source::sql_connect(cfg).await?;
    // Operators run this when something is wrong, e.g. while a maintenance transaction holds
    // the parking table: wait briefly for locks, then report what could not be read.
    sql.batch_execute("SET lock_timeout = '3s'").await?;
    let slot = &cfg.source.slot;
    let host = source::SlotHost::connect(cfg).await?;
    // Lags count from the primary's WAL end (a standby has none of its own).
    let end: String = sql
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let s = host
        .sql(&sql)
        .query_opt(
            "SELECT active_pid, confirmed_flush_lsn::text, \
                    ($2::text::pg_lsn - confirmed_flush_lsn)::bigint, \
                    ($2::text::pg_lsn - restart_lsn)::bigint, wal_status, safe_wal_size \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[slot, &end],
        )
        .await?;
    let server = match (host.is_separate(), host.in_recovery()) {
        (false, _) => "primary",
        (true, true) => "standby",
        (true, false) => "replication_dsn (not in recovery)",
    };
    let replay_lag = crate::relay::slot_host::replay_lag(&sql, &host).await?;
    let slot_doc = match &s {
        None => json!({"name": slot, "exists": false, "server": server,
                       "standby_replay_lag_bytes": replay_lag}),
        Some(r) => json!({
            "name": slot,
            "exists": true,
            "server": server,
            "standby_replay_lag_bytes": replay_lag,
            "active_pid": r.get::<_, Option<i32>>(0),
            "confirmed_flush_lsn": r.get::<_, Option<String>>(1),
            "lag_bytes": r.get::<_, Option<i64>>(2),
            "retained_wal_bytes": r.get::<_, Option<i64>>(3),
            "wal_status": r.get::<_, Option<String>>(4),
            "safe_wal_size": r.get::<_, Option<i64>>(5),
        }),
    };
    let relay = host
        .sql(&sql)
        .query_opt(
            "SELECT application_name, client_addr::text, state FROM pg_stat_replication \
             WHERE application_name LIKE $1 LIMIT 1",
            &[&format!("outboxd:{slot}:%")],
        )
        .await?
        .map(|r| {
            let app: String = r.get(0);
            json!({
                "relay_pid": app.rsplit(':').next().and_then(|p| p.parse::<i64>().ok()),
                "client_addr": r.get::<_, Option<String>>(1),
                "state": r.get::<_, Option<String>>(2),
            })
        });
    let has_tables: bool = sql
        .query_one(
            "SELECT to_regclass('outboxd_status') IS NOT NULL AND to_regclass('outbox_parked') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    let (reported, parked) = if has_tables {
        let rep = crate::obs::status_row::read(&sql, slot).await?;
        let parked = match crate::poison::store::open_stats(&sql, slot).await {
            Ok(stats) => stats
                .into_iter()
                .map(|(t, st, n, age)| json!({"event_type": t, "state": st, "count": n, "oldest_age_seconds": age}))
                .collect(),
            Err(e) => json!({"unavailable": e.to_string()}),
        };
        (rep, parked)
    } else {
        (None, json!([]))
    };
    let stuck = match has_tables {
        true => stuck(&sql, slot).await,
        false => json!({"count": 0, "oldest": []}),
    };
    let delivery = delivery_state(cfg, &sql, &host).await?;
    let mut doc = json!({"slot": slot_doc, "active_relay": relay, "reported": reported, "parked": parked, "stuck_aggregates": stuck, "delivery_state": delivery});
    let tables = tables(cfg, &sql, has_tables).await?;
    if !tables.is_empty() {
        doc["tables"] = Value::Array(tables);
    }
    Ok(doc)
}

/// Each listed table (and each a pattern matches, with its pattern; one outside the
/// publication waits to join), whether the publication includes it, and its open parked events; then
/// the open parked events of each table that is not listed (`"listed": false`: the relay
/// releases none of them), those of no table under `null` (parked by a one-table relay, in a
/// configuration that lists several). A one-table configuration shows this only when some of
/// its parked events are not its table's.
async fn tables(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    has_tables: bool,
) -> Result<Vec<Value>, RelayError> {
    use crate::config::tables::ParkedTable;
    // Unreadable (a lock held by someone else): said under "parked"; null counts here.
    let parked = match has_tables {
        true => crate::poison::store::open_per_table(sql, &cfg.source.slot)
            .await
            .ok(),
        false => Some(Vec::new()),
    };
    let readable = parked.is_some();
    let labels: Vec<String> = cfg.tables().iter().map(|t| t.label()).collect();
    let mut listed = vec![0i64; labels.len()];
    let mut others: std::collections::BTreeMap<Option<String>, i64> = Default::default();
    for (t, n) in parked.iter().flatten() {
        match ParkedTable::of(&labels, t.as_deref()) {
            ParkedTable::Listed(i) => listed[i] += n,
            ParkedTable::Unlisted(t) => *others.entry(Some(t.to_string())).or_default() += n,
            ParkedTable::Unknown => *others.entry(None).or_default() += n,
        }
    }
    if !cfg.is_multi_table() && others.is_empty() {
        return Ok(Vec::new());
    }
    let cov = crate::slot::publication::coverage(cfg, sql).await?;
    // A listed table dropped: the relay streams the others (issue 56); said here.
    let oids = crate::slot::join::identities(sql, &cfg.tables()).await?;
    let mut out: Vec<Value> = labels
        .iter()
        .zip(listed)
        .zip(cfg.tables())
        .zip(oids)
        .map(|(((label, n), t), oid)| {
            let published = cov.as_ref().map(|c| !c.missing.contains(label));
            let n = readable.then_some(n);
            json!({"table": label, "pattern": t.discovered, "listed": true, "exists": oid.is_some(), "published": published, "open_parked": n})
        })
        .collect();
    // Tables a pattern matches that have not joined the publication: not relayed yet.
    for f in crate::slot::join::discover(cfg, sql).await? {
        let label = format!("{}.{}", f.schema, f.table);
        let pattern = cfg.source.tables[f.entry].pattern.clone();
        out.push(json!({"table": label, "pattern": pattern, "listed": true, "published": false, "open_parked": 0}));
    }
    for (table, n) in others {
        out.push(json!({"table": table, "listed": false, "published": null, "open_parked": n}));
    }
    Ok(out)
}

/// The relay's durable memory of the stream, and what the slot guard would decide now.
async fn delivery_state(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    host: &source::SlotHost,
) -> Result<Value, RelayError> {
    let state = crate::slot::state::load_if_present(sql, &cfg.source.slot).await?;
    let Some(st) = state else {
        return Ok(Value::Null);
    };
    let slot = source::slot_state(cfg, host.sql(sql)).await?;
    let identity = crate::slot::state::identity(sql).await?;
    let verdict = match crate::slot::guard::decide(
        Some(&st),
        slot.as_ref(),
        &identity,
        cfg.source.recovery_window,
    ) {
        crate::slot::guard::Decision::Lost(l) => format!(
            "LOST ({}): {}; gap: {}",
            l.reason.label(),
            l.reason,
            l.gap.as_ref().map_or(
                "not provable by transaction id (outboxd recover --since)".into(),
                |g| g.to_string()
            )
        ),
        _ => "ok".into(),
    };
    Ok(json!({
        "verdict": verdict,
        "system_identifier": st.identity.system_id,
        "timeline": st.identity.timeline,
        "acked_lsn": crate::model::lsn::fmt_lsn(st.acked_lsn),
        "delivery_mark": st.delivery_mark.map(|t| t.to_rfc3339()),
        "delivered_xid": st.delivered_xid,
        "recovering_since": st.recovering_since.map(|t| t.to_rfc3339()),
        "recovering_xid": st.recovering_xid,
        "recoveries": st.recoveries,
        "last_recovery_at": st.last_recovery_at.map(|t| t.to_rfc3339()),
        "last_recovery_events": st.last_recovery_events,
        "updated_seconds_ago": (chrono::Utc::now() - st.updated_at).num_milliseconds() as f64 / 1000.0,
    }))
}

/// The human-readable form.
pub fn render(v: &Value) -> String {
    let g = |p: &str| -> String {
        match v.pointer(p) {
            None | Some(Value::Null) => "-".into(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(f) if n.is_f64() => format!("{f:.1}"),
                _ => n.to_string(),
            },
            Some(other) => other.to_string(),
        }
    };
    let mut out = String::new();
    let mut row = |k: &str, val: String| out.push_str(&format!("{k:<28} {val}\n"));
    row("slot", g("/slot/name"));
    row("  lives on", g("/slot/server"));
    if v.pointer("/slot/standby_replay_lag_bytes")
        .is_some_and(|l| !l.is_null())
    {
        row(
            "  standby replay lag bytes",
            g("/slot/standby_replay_lag_bytes"),
        );
    }
    row("  active walsender pid", g("/slot/active_pid"));
    row("  active relay pid", g("/active_relay/relay_pid"));
    row("  confirmed_flush_lsn", g("/slot/confirmed_flush_lsn"));
    row("  lag bytes", g("/slot/lag_bytes"));
    row("  retained WAL bytes", g("/slot/retained_wal_bytes"));
    row("  wal_status", g("/slot/wal_status"));
    row("  safe_wal_size", g("/slot/safe_wal_size"));
    row("delivery state", g("/delivery_state/verdict"));
    row("  acked lsn", g("/delivery_state/acked_lsn"));
    row("  delivery mark", g("/delivery_state/delivery_mark"));
    row(
        "  system id / timeline",
        format!(
            "{} / {}",
            g("/delivery_state/system_identifier"),
            g("/delivery_state/timeline")
        ),
    );
    row("  delivered xid", g("/delivery_state/delivered_xid"));
    row(
        "  recovering",
        format!(
            "since {} / from xid {}",
            g("/delivery_state/recovering_since"),
            g("/delivery_state/recovering_xid")
        ),
    );
    row(
        "  recoveries (last)",
        format!(
            "{} ({} at {})",
            g("/delivery_state/recoveries"),
            g("/delivery_state/last_recovery_events"),
            g("/delivery_state/last_recovery_at")
        ),
    );
    row("relay (last report)", g("/reported/instance"));
    row(
        "  reported seconds ago",
        g("/reported/reported_seconds_ago"),
    );
    row("  pending events", g("/reported/pending_events"));
    row(
        "  oldest pending age s",
        g("/reported/oldest_pending_age_seconds"),
    );
    row("  heartbeat age s", g("/reported/heartbeat_age_seconds"));
    row(
        "  heartbeat delay s",
        g("/reported/heartbeat_delay_seconds"),
    );
    row("  halted", g("/reported/halted"));
    row("  errors", g("/reported/errors"));
    row("  failed attempts in a row", g("/reported/attempt"));
    row(
        "  last error",
        format!(
            "[{}] {}",
            g("/reported/last_error_class"),
            g("/reported/last_error")
        ),
    );
    row(
        "  next attempt in s",
        g("/reported/next_attempt_in_seconds"),
    );
    for t in v
        .get("tables")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let line = match t["listed"].as_bool() {
            Some(true) if t["exists"].as_bool() == Some(false) => format!(
                "{}: DOES NOT EXIST (dropped?): the other tables stream on; created again \
                 (outboxd init) it is taken in, open parked {}",
                t["table"].as_str().unwrap_or("-"),
                t["open_parked"]
            ),
            Some(false) => format!(
                "{}: NOT LISTED, open parked {} (not released: discard them, or list the \
                 table again; `outboxd parked list`)",
                t["table"]
                    .as_str()
                    .unwrap_or("(no table: parked by a one-table relay)"),
                t["open_parked"]
            ),
            _ => format!(
                "{}{}: published {}, open parked {}",
                t["table"].as_str().unwrap_or("-"),
                match t["pattern"].as_str() {
                    Some(p) => format!(" (pattern {p})"),
                    None => String::new(),
                },
                match t["published"].as_bool() {
                    Some(true) => "yes",
                    Some(false) => "NO",
                    None => "-",
                },
                match &t["open_parked"] {
                    Value::Null => "unavailable".to_string(),
                    n => n.to_string(),
                }
            ),
        };
        row("table", line);
    }
    if let Some(n) = v.pointer("/stuck_aggregates/count").and_then(Value::as_i64) {
        if n > 0 {
            row(
                "stuck",
                format!("{n} aggregate(s) held behind a parked head, oldest first:"),
            );
        }
        for a in v
            .pointer("/stuck_aggregates/oldest")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            row(
                "stuck",
                format!(
                    "  {}/{} behind {} ({}), {} held, {:.0}s",
                    a["aggregate_type"].as_str().unwrap_or("?"),
                    a["aggregate_id"].as_str().unwrap_or("?"),
                    a["head"].as_str().unwrap_or("?"),
                    a["class"].as_str().unwrap_or("?"),
                    a["held"],
                    a["age_seconds"].as_f64().unwrap_or(0.0)
                ),
            );
        }
    }
    match v.get("parked").and_then(Value::as_array) {
        Some(p) if !p.is_empty() => {
            for e in p {
                row(
                    "parked",
                    format!(
                        "{} {} x{} (oldest {:.0}s)",
                        e["event_type"].as_str().unwrap_or("?"),
                        e["state"].as_str().unwrap_or("?"),
                        e["count"],
                        e["oldest_age_seconds"].as_f64().unwrap_or(0.0)
                    ),
                );
            }
        }
        _ => match v.pointer("/parked/unavailable").and_then(Value::as_str) {
            Some(why) => row("parked", format!("unavailable: {why}")),
            None => row("parked", "none".into()),
        },
    }
    out
}

/// Aggregates held behind a parked head: how many, and the 10 oldest (`outboxd parked retry
/// --aggregate ID --dry-run` shows what one decision would release).
async fn stuck(sql: &tokio_postgres::Client, slot: &str) -> Value {
    match crate::poison::store::stuck_aggregates(sql, slot, 10).await {
        Ok((n, oldest)) => json!({
            "count": n,
            "oldest": oldest.into_iter().map(|(t, id, head, class, held, age)| json!({
                "aggregate_type": t, "aggregate_id": id, "head": head, "class": class,
                "held": held, "age_seconds": age,
            })).collect::<Vec<_>>(),
        }),
        Err(e) => json!({"unavailable": e.to_string()}),
    }
}
