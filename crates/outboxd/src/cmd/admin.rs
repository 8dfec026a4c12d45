//! `outboxd init`: create what is missing (schema, tables, functions, publication, slot),
//! idempotently; `outboxd check` (cmd/check.rs) reports what is still wrong.

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::model::columns::Preset;
use crate::relay::source::{self, quote_ident};

/// The default schema, exactly as shipped in `sql/001_outbox.sql`.
pub const OUTBOX_SQL: &str = include_str!("../../../../sql/001_outbox.sql");

/// `outbox_uuid_v7()` and `outbox_emit()`, exactly as shipped in `sql/010_outbox_emit.sql`.
const EMIT_SQL: &str = include_str!("../../../../sql/010_outbox_emit.sql");

/// `EMIT_SQL` for the outbox table `qualified` in `schema`: the functions live next to the table
/// and insert into it (one pair per schema: with two outbox tables in one schema, the functions
/// write into the table whose `init` created them).
fn emit_sql(schema: &str, qualified: &str) -> String {
    let schema = quote_ident(schema);
    EMIT_SQL
        .replace("public.outbox_uuid_v7", &format!("{schema}.outbox_uuid_v7"))
        .replace("public.outbox_emit", &format!("{schema}.outbox_emit"))
        .replace("public.outbox (", &format!("{qualified} ("))
}

/// Creates the outbox table (default schema only), the publication and the slot when missing;
/// with the default schema also the producer functions `outbox_uuid_v7()` and `outbox_emit()`.
pub async fn init(cfg: &Config) -> Result<Vec<String>, RelayError> {
    let sql = source::sql_connect(cfg).await?;
    // The shipped SQL says DROP … IF EXISTS before it creates: no NOTICE on a fresh install.
    sql.batch_execute("SET client_min_messages = warning")
        .await?;
    let mut done = Vec::new();
    for t in cfg.tables() {
        init_table(cfg, &sql, &t, &mut done).await?;
    }
    // Several tables (or a publication an administrator made for another): the publication
    // is extended to cover every listed table.
    done.extend(crate::slot::publication::extend(cfg, &sql).await?);
    done.push(crate::slot::publication::install_guard(&sql).await?);
    // outboxd's own tables go to source.relay_schema (the connection's search_path).
    let schema_exists: bool = sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
            &[&cfg.source.relay_schema],
        )
        .await?
        .get(0);
    if !schema_exists {
        sql.batch_execute(&format!(
            "CREATE SCHEMA {}",
            quote_ident(&cfg.source.relay_schema)
        ))
        .await?;
    }
    // The join trigger's function lives in the relay schema (created just above).
    done.extend(crate::slot::join::install(cfg, &sql).await?);
    crate::poison::store::ensure_tables(&sql).await?;
    crate::obs::status_row::ensure_table(&sql).await?;
    crate::shadow::store::ensure_tables(&sql).await?;
    crate::replay::store::install(&sql, cfg)
        .await
        .map_err(|e| match e {
            crate::replay::ReplayError::Relay(e) => e,
            e => RelayError::Setup(e.to_string()),
        })?;
    done.push(
        "tables outbox_parked, outbox_parked_audit, outboxd_status, outboxd_shadow_* and \
         outboxd_replay present"
            .into(),
    );
    // From now on a lost slot is detected and its gap recovered (docs/reliability.md). The row
    // is written BEFORE the slot exists: a change written after the slot but before a
    // publication the user creates next would make pgoutput fail with "publication does not
    // exist" (it reads publications as of each change).
    crate::slot::state::ensure_table(&sql).await?;
    let host = source::SlotHost::connect(cfg).await?;
    // What the standby of replication_dsn lacks: refused here, or said (and streamed anyway).
    for w in host.check(&sql).await? {
        done.push(format!("WARNING: {w}"));
    }
    let existing = source::slot_state(cfg, host.sql(&sql)).await?;
    match crate::slot::state::load(&sql, &cfg.source.slot).await? {
        None => {
            let identity = crate::slot::state::identity(&sql).await?;
            // Before the slot exists: transactions older than the oldest one running now
            // committed before it, so they are not this relay's (the first delivered_xid).
            let (lsn, xid) = match &existing {
                Some(s) => (s.confirmed_flush, None),
                None => {
                    let p = crate::slot::state::XidProbe::take(&sql).await?;
                    (p.lsn, Some(p.xmin))
                }
            };
            crate::slot::state::reset(&sql, &cfg.source.slot, &identity, lsn, xid).await?;
        }
        // Never a new slot over a loss: the new slot would start now, and the slot guard could
        // not tell it from the one the relay streamed from, so the gap would be skipped.
        Some(_) if !matches!(&existing, Some(s) if s.invalidation.is_none()) => {
            done.push("table outboxd_slot_state present".into());
            done.push(format!(
                "slot {} NOT created: outboxd delivered from it before (outboxd_slot_state) and \
                 it is {}, so its gap must be republished from the outbox table; `outboxd run` \
                 does that when it starts (source.on_slot_loss = \"recover\"), or run \
                 `outboxd recover --config FILE --dry-run`, then `outboxd recover --config FILE`",
                cfg.source.slot,
                match &existing {
                    None => "missing".to_string(),
                    Some(s) => format!(
                        "invalidated ({})",
                        s.invalidation.as_deref().unwrap_or_default()
                    ),
                }
            ));
            tracing::warn!(slot = %cfg.source.slot, "init: the replication slot is lost; not recreating it (outboxd run recovers the gap)");
            return Ok(done);
        }
        Some(_) => {}
    }
    let (slot, _) = source::preflight(cfg, &sql, &host, true).await?;
    done.push("table outboxd_slot_state present".into());
    done.push(format!(
        "slot {} present (confirmed_flush_lsn {}){}",
        cfg.source.slot,
        crate::model::lsn::fmt_lsn(slot.confirmed_flush),
        if host.is_separate() {
            " on the server of source.replication_dsn"
        } else {
            ""
        }
    ));
    Ok(done)
}

/// `init` for one listed table: the table (outboxd preset) or a check that it exists, the
/// publication when missing, the producer functions next to it.
async fn init_table(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    t: &OutboxTable,
    done: &mut Vec<String>,
) -> Result<(), RelayError> {
    let (schema, table) = t.pair();
    let qualified = format!("{}.{}", quote_ident(&schema), quote_ident(&table));
    // Idempotent without privileges it does not need: what exists is not created again (a
    // CREATE … IF NOT EXISTS still demands CREATE on the schema), so a least-privilege role can
    // run `init` once an administrator has created everything.
    let table_exists: bool = sql
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
        .await?
        .get(0);
    let pub_exists: bool = sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            &[&cfg.source.publication],
        )
        .await?
        .get(0);
    if t.columns.preset == Preset::Outboxd && table_exists && pub_exists {
        done.push(format!(
            "table {schema}.{table} and publication {} present",
            cfg.source.publication
        ));
    } else if t.columns.preset == Preset::Outboxd {
        let ddl = OUTBOX_SQL
            .replace("public.outbox", &qualified)
            .replace(
                "outbox_created_at_idx",
                &quote_ident(&format!("{table}_created_at_idx")),
            )
            .replace("'outbox_pub'", &format!("'{}'", cfg.source.publication))
            .replace(
                "PUBLICATION outbox_pub",
                &format!("PUBLICATION {}", quote_ident(&cfg.source.publication)),
            );
        sql.batch_execute(&ddl).await?;
        done.push(format!(
            "table {schema}.{table} and publication {} present",
            cfg.source.publication
        ));
    }
    if t.columns.preset == Preset::Outboxd {
        // Only when missing, like everything else (CREATE OR REPLACE needs ownership).
        let present: i64 = sql
            .query_one(
                "SELECT count(DISTINCT p.proname) FROM pg_proc p \
                 JOIN pg_namespace n ON n.oid = p.pronamespace \
                 WHERE n.nspname = $1 AND p.proname IN ('outbox_emit', 'outbox_uuid_v7')",
                &[&schema],
            )
            .await?
            .get(0);
        let installed = if present < 2 {
            match sql.batch_execute(&emit_sql(&schema, &qualified)).await {
                Ok(()) => true,
                // Optional for the relay: a least-privilege role still gets through `init`.
                Err(e)
                    if e.code()
                        == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) =>
                {
                    false
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            true
        };
        done.push(if installed {
            format!("functions {schema}.outbox_uuid_v7() and {schema}.outbox_emit() present")
        } else {
            format!(
                "functions {schema}.outbox_uuid_v7() and {schema}.outbox_emit() NOT installed \
                 (no CREATE on schema {schema}): an administrator can install \
                 sql/010_outbox_emit.sql (optional, for producers writing through SQL)"
            )
        });
    } else {
        let exists: bool = sql
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
            .await?
            .get(0);
        if !exists {
            return Err(RelayError::Setup(format!(
                "table {schema}.{table} does not exist; with preset {:?} outboxd reads your \
                 existing table and does not create it",
                t.columns.preset
            )));
        }
        let has_pub: bool = sql
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
                &[&cfg.source.publication],
            )
            .await?
            .get(0);
        if !has_pub {
            sql.batch_execute(&format!(
                "CREATE PUBLICATION {} FOR TABLE {qualified} \
                 WITH (publish = 'insert', publish_via_partition_root = true)",
                quote_ident(&cfg.source.publication)
            ))
            .await?;
        }
        done.push(format!("publication {} present", cfg.source.publication));
    }
    Ok(())
}
