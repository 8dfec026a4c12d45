//! `outboxd check`: report every problem with its fix (exit non-zero on any). Each line is a
//! `CheckLine`; the checks of jobs, privileges and the parked store live beside it.

use super::check_line::{line, CheckLine};
use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::kafka::Producer;
use crate::relay::source;
use std::time::Duration;

/// Runs every check it can; a failed connection skips the checks that need it.
pub async fn check(cfg: &Config) -> Vec<CheckLine> {
    let mut out = vec![line(true, "config", "parsed and valid")];
    out.push(super::parked::integrity_line(cfg));
    match source::sql_connect(cfg).await {
        Err(e) => out.push(line(
            false,
            "postgres",
            format!("{e} — is source.dsn right and the server up?"),
        )),
        Ok(sql) => {
            out.push(line(true, "postgres", "connected"));
            out.extend(super::privileges::check(cfg, &sql).await);
            out.extend(super::privileges::encryption(cfg));
            out.extend(super::privileges::guards(cfg, &sql).await);
            let host = match source::SlotHost::connect(cfg).await {
                Ok(h) => h,
                Err(e) => {
                    out.push(line(
                        false,
                        "slot server",
                        format!("{e} — is source.replication_dsn right and the standby up?"),
                    ));
                    return out;
                }
            };
            out.extend(slot_server(&sql, &host).await);
            let preflight = source::preflight(cfg, &sql, &host, false).await;
            let confirmed = preflight.as_ref().map_or(0, |(s, _)| s.confirmed_flush);
            out.push(replication(cfg, confirmed).await);
            match preflight {
                Ok((slot, _)) => {
                    out.push(line(true, "wal_level / table / publication", "ok"));
                    out.push(line(
                        true,
                        "slot",
                        match slot.active_pid {
                            Some(pid) => format!(
                                "{} exists, in use by PID {pid} (this instance would stand by)",
                                cfg.source.slot
                            ),
                            None => format!(
                                "{} exists, confirmed_flush_lsn {}",
                                cfg.source.slot,
                                crate::model::lsn::fmt_lsn(slot.confirmed_flush)
                            ),
                        },
                    ));
                }
                Err(RelayError::Setup(m)) if m.contains("slot") && cfg.source.create_slot => {
                    out.push(line(true, "slot", format!("{m} (run will create it)")))
                }
                Err(e) => out.push(line(false, "source setup", e.to_string())),
            }
            for t in cfg.tables() {
                out.extend(columns(cfg, &t, &sql).await);
            }
            out.extend(coverage(cfg, &sql).await);
            out.extend(patterns(cfg, &sql).await);
            out.push(if host.is_separate() {
                line(
                    true,
                    "failover",
                    "the slot lives on the server of source.replication_dsn: it survives that \
                     standby's promotion; if the standby is lost, outboxd republishes the gap \
                     from the outbox table on the next standby (source.on_slot_loss)",
                )
            } else {
                failover(cfg, &sql).await
            });
            out.push(match crate::slot::publication::guarded(&sql).await {
                Ok(true) => CheckLine::ok(
                    "publication changes",
                    "event trigger outboxd_publication_ddl: seen in the stream, gap recovered",
                ),
                Ok(false) => CheckLine::warn(
                    "publication changes",
                    "no event trigger: a change of the publication shorter than \
                     source.state_interval_ms goes unnoticed and its rows unpublished; apply \
                     sql/080_outboxd_publication_guard.sql as a superuser (outboxd init does)",
                ),
                Err(e) => CheckLine::fail("publication changes", e.to_string()),
            });
        }
    }
    let listed = match broker(cfg) {
        Ok(topics) => {
            out.push(line(true, "broker", "metadata fetched"));
            for t in cfg.tables() {
                out.push(topics_line(cfg, &t, &topics));
            }
            Some(topics)
        }
        Err(e) => {
            let msg = crate::relay::kafka::hint::explain(&e.to_string(), &cfg.sink.kafka);
            let msg = if crate::relay::kafka::hint::names_fix(&msg) {
                msg
            } else {
                format!("{msg} — check sink.kafka.\"bootstrap.servers\" and that the broker is up")
            };
            out.push(line(false, "broker", cfg.redactor.scrub(&msg)));
            None
        }
    };
    out.extend(super::check_jobs::lines(cfg, listed.as_deref()).await);
    out
}

/// The replication connection has its own TLS handshake and needs a free walsender, so it is
/// tried for real: started on the slot and stopped at once, confirming nothing (the status updates
/// carry at most the slot's own position, and the server never moves a slot backwards).
async fn replication(cfg: &Config, confirmed: u64) -> CheckLine {
    const WHAT: &str = "replication connection";
    let start = source::start_stream(cfg, confirmed, Duration::from_secs(10));
    match tokio::time::timeout(Duration::from_secs(15), start).await {
        Ok(Ok(client)) => {
            client.stop();
            line(true, WHAT, "authenticated, streaming starts")
        }
        Ok(Err(RelayError::SlotBusy { pid, .. })) => line(
            true,
            WHAT,
            format!("authenticated (the slot is streaming to PID {pid})"),
        ),
        Ok(Err(e)) if e.to_string().contains("does not exist") => {
            line(true, WHAT, "authenticated (the slot does not exist yet)")
        }
        Ok(Err(e)) => line(false, WHAT, e.to_string()),
        Err(_) => line(false, WHAT, "no answer within 15 s"),
    }
}

/// Whether the slot survives a promotion (PG17+ failover slots synchronized to standbys).
/// Where the slot lives, and what its standby lacks (`source.replication_dsn`).
async fn slot_server(sql: &tokio_postgres::Client, host: &source::SlotHost) -> Vec<CheckLine> {
    const WHAT: &str = "slot server";
    if !host.is_separate() {
        return Vec::new();
    }
    let mut out = Vec::new();
    match host.check(sql).await {
        Err(e) => out.push(line(false, WHAT, e.to_string())),
        Ok(warnings) => {
            let lag = crate::relay::slot_host::replay_lag(sql, host).await;
            out.push(line(
                true,
                WHAT,
                match (host.in_recovery(), lag) {
                    (true, Ok(Some(b))) => format!(
                        "source.replication_dsn is a standby; it has replayed up to {b} bytes \
                         behind the primary (decoding waits for replay)"
                    ),
                    (true, _) => "source.replication_dsn is a standby".to_string(),
                    (false, _) => "source.replication_dsn is not in recovery (a promoted \
                                   standby, or a primary): the slot lives there"
                        .to_string(),
                },
            ));
            out.extend(warnings.into_iter().map(|w| CheckLine::warn(WHAT, w)));
        }
    }
    out
}

async fn failover(cfg: &Config, sql: &tokio_postgres::Client) -> CheckLine {
    const WHAT: &str = "failover";
    let major = match source::server_major(sql).await {
        Ok(m) => m,
        Err(e) => return line(false, WHAT, e.to_string()),
    };
    if major < 17 {
        return line(
            true,
            WHAT,
            format!(
                "Postgres {major} has no failover slots: after a promotion the slot is missing and \
                 outboxd republishes the gap from the outbox table (on_slot_loss = {:?})",
                cfg.source.on_slot_loss
            ),
        );
    }
    let q = "SELECT (SELECT failover FROM pg_replication_slots WHERE slot_name = $1), \
                    current_setting('synchronized_standby_slots'), \
                    (SELECT count(*) FROM pg_stat_replication WHERE application_name NOT LIKE 'outboxd:%')";
    let row = match sql.query_one(q, &[&cfg.source.slot]).await {
        Ok(r) => r,
        Err(e) => return line(false, WHAT, RelayError::from(e).to_string()),
    };
    let (fo, sync, standbys): (Option<bool>, String, i64) = (row.get(0), row.get(1), row.get(2));
    let slot = match fo {
        Some(true) => "a failover slot",
        Some(false) => "NOT a failover slot (created before outboxd made failover slots; a promotion loses it and outboxd recovers from the table)",
        None => "not created yet (it will be a failover slot)",
    };
    let sync_txt = if sync.is_empty() {
        "synchronized_standby_slots is empty: the relay may be sent changes a standby has not \
         received yet, so after a promotion the synced slot can be behind (duplicates) or, if \
         the standby's copy never caught up, missing (outboxd recovers). List the standbys' \
         physical slots there"
            .to_string()
    } else {
        format!("synchronized_standby_slots = '{sync}'")
    };
    line(
        true,
        WHAT,
        format!(
            "slot {} is {slot}; {sync_txt}; {standbys} standby connection(s); standbys need \
             sync_replication_slots = on, hot_standby_feedback = on and dbname in primary_conninfo",
            cfg.source.slot
        ),
    )
}

/// The publication against the listed tables: a listed table it lacks fails (the relay
/// refuses to start), a published table that is not listed warns (decoded for nothing).
async fn coverage(cfg: &Config, sql: &tokio_postgres::Client) -> Option<CheckLine> {
    const WHAT: &str = "publication tables";
    let cov = match crate::slot::publication::coverage(cfg, sql).await {
        Ok(c) => c?, // no publication: preflight reported it
        Err(e) => return Some(CheckLine::fail(WHAT, e.to_string())),
    };
    let p = &cfg.source.publication;
    Some(if !cov.missing.is_empty() {
        CheckLine::fail(
            WHAT,
            format!(
                "publication {p} does not include listed table(s) {}: their rows are not \
                 streamed and the relay refuses to start; run `outboxd init --config FILE` \
                 (ALTER PUBLICATION {p} ADD TABLE …)",
                cov.missing.join(", ")
            ),
        )
    } else if !cov.unlisted.is_empty() {
        CheckLine::warn(
            WHAT,
            format!(
                "publication {p} also includes {}, not listed in source.table(s): the walsender \
                 decodes their changes and the relay ignores them; list them ([[source.tables]]) \
                 or ALTER PUBLICATION {p} DROP TABLE them",
                cov.unlisted.join(", ")
            ),
        )
    } else {
        let n = cfg.tables().len();
        let found: Vec<String> = cfg
            .tables()
            .iter()
            .filter(|t| t.discovered.is_some())
            .map(|t| t.label())
            .collect();
        let found = match found.is_empty() {
            true => String::new(),
            false => format!(
                " ({} matched by pattern: {})",
                found.len(),
                found.join(", ")
            ),
        };
        CheckLine::ok(
            WHAT,
            format!("publication {p} covers the {n} listed table(s){found}"),
        )
    })
}

/// `[[source.tables]]` patterns: the matching tables outside the publication (not relayed
/// until they join; nothing of theirs is lost) and whether new ones join by themselves (the
/// event trigger `init` installs as a superuser).
async fn patterns(cfg: &Config, sql: &tokio_postgres::Client) -> Option<CheckLine> {
    const WHAT: &str = "table patterns";
    if !cfg.has_patterns() {
        return None;
    }
    let waiting = match crate::slot::join::discover(cfg, sql).await {
        Ok(found) => found,
        Err(e) => return Some(CheckLine::fail(WHAT, e.to_string())),
    };
    let trigger = format!("outboxd_join_{}", cfg.source.publication);
    let joiner: bool = match sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = $1 \
                 AND evtenabled <> 'D')",
            &[&trigger],
        )
        .await
    {
        Ok(r) => r.get(0),
        Err(e) => return Some(CheckLine::fail(WHAT, RelayError::from(e).to_string())),
    };
    let matched = cfg
        .tables()
        .iter()
        .filter(|t| t.discovered.is_some())
        .count();
    let mut problems = Vec::new();
    if !waiting.is_empty() {
        let names: Vec<String> = waiting
            .iter()
            .map(|f| format!("{}.{}", f.schema, f.table))
            .collect();
        problems.push(format!(
            "{} match but are not in publication {}: not relayed until they join (outboxd \
             init adds them, or a relay whose role may; their rows are then republished)",
            names.join(", "),
            cfg.source.publication
        ));
    }
    if !joiner {
        problems.push(format!(
            "no event trigger {trigger}: a new matching table joins only when outboxd init or \
             a relay that may add it runs (and its rows are then republished); run `outboxd \
             init` as a superuser"
        ));
    }
    Some(match problems.is_empty() {
        true => CheckLine::ok(
            WHAT,
            format!(
                "{matched} table(s) matched and published; event trigger {trigger} adds new ones"
            ),
        ),
        false => CheckLine::warn(
            WHAT,
            format!("{matched} matched and published; {}", problems.join("; ")),
        ),
    })
}

/// Required columns of the table's mapping (`additional` ones included) that it lacks.
async fn columns(cfg: &Config, t: &OutboxTable, sql: &tokio_postgres::Client) -> Option<CheckLine> {
    let names = t.columns.resolve().ok()?;
    let (schema, table) = t.pair();
    let what = if cfg.is_multi_table() {
        format!("columns of {schema}.{table}")
    } else {
        "columns".to_string()
    };
    let rows = sql
        .query(
            "SELECT column_name::text FROM information_schema.columns \
             WHERE table_schema = $1 AND table_name = $2",
            &[&schema, &table],
        )
        .await
        .ok()?;
    if rows.is_empty() {
        return None; // reported by preflight
    }
    let have: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let missing: Vec<&str> = [
        &names.event_id,
        &names.aggregate_type,
        &names.aggregate_id,
        &names.event_type,
        &names.payload,
    ]
    .into_iter()
    // The columns placed in headers are required too.
    .chain(names.additional.iter().map(|p| &p.column))
    .filter(|n| !have.contains(n))
    .map(String::as_str)
    .collect();
    Some(if missing.is_empty() {
        line(true, &what, "all required columns present")
    } else {
        line(
            false,
            &what,
            format!(
                "{schema}.{table} lacks {missing:?}: set source.columns.* (or preset) to your names"
            ),
        )
    })
}

/// outboxd creates no topics: a missing one is created by the broker on first use with its
/// defaults (if `auto.create.topics.enable`), often one partition — or refused.
fn topics_line(cfg: &Config, table: &OutboxTable, topics: &[String]) -> CheckLine {
    let what = if cfg.is_multi_table() {
        format!("topics of {}", table.label())
    } else {
        "topics".to_string()
    };
    let what = what.as_str();
    let Ok(t) = crate::model::topic::TopicTemplate::parse(&table.topic) else {
        return line(false, what, "the topic template is not valid");
    };
    let (prefix, templated) = t.prefix();
    let found = topics
        .iter()
        .filter(|n| {
            if templated {
                n.starts_with(&prefix)
            } else {
                **n == prefix
            }
        })
        .count();
    let advice = "outboxd does not create topics: the broker creates a missing one on first use \
                  with its defaults (num.partitions, often 1) if auto.create.topics.enable, or \
                  refuses the events; create them with the partitions you need (docs, \"Topics\")";
    match (templated, found) {
        (false, 0) => CheckLine::warn(what, format!("topic {prefix} does not exist; {advice}")),
        (true, 0) => CheckLine::warn(
            what,
            format!(
                "no topic named {prefix}… exists yet ({}); {advice}",
                table.topic
            ),
        ),
        (false, _) => line(true, what, format!("{prefix} exists")),
        (true, n) => line(true, what, format!("{n} topic(s) named {prefix}… exist")),
    }
}

fn broker(cfg: &Config) -> Result<Vec<String>, RelayError> {
    let (p, _rx) = Producer::new(cfg, Default::default())?;
    p.ping(Duration::from_secs(5))
}
