//! What `outboxd check` says about the jobs beside streaming: cleanup (can its role delete, and
//! where does it run), shadow mode (do the legacy topics exist), the replay audit (is its
//! guard installed and enabled, is the database's approval policy this config's) and the
//! schema validation of each table (is its schema directory there), and the tenants of
//! `[[source.tables]]` (how partitioned tables are published, delete-after-insert tables a late
//! join could not republish).

use super::check_line::CheckLine;
use crate::config::Config;
use crate::relay::source::quote_ident;

/// Lines for the configured jobs only; `topics`: what the broker lists (None: unreachable).
pub async fn lines(cfg: &Config, topics: Option<&[String]>) -> Vec<CheckLine> {
    let mut out = Vec::new();
    if let Some(retention) = cfg.cleanup.retention {
        out.push(cleanup(cfg, retention).await);
    }
    if cfg.shadow.enabled {
        out.push(shadow(cfg, topics));
    }
    out.extend(replay(cfg).await);
    out.extend(schemas(cfg));
    out.extend(tenants(cfg).await);
    out
}

/// Partitioned outbox tables: how the publication streams them (as their root, or under each
/// partition's name, mapped by the relay). With patterns and no event trigger: matching tables
/// whose rows the application deletes, for which a late join would find nothing to republish
/// (the relay halts on one, `crate::slot::join`). Nothing when Postgres is unreachable (said
/// elsewhere).
async fn tenants(cfg: &Config) -> Vec<CheckLine> {
    let Ok(sql) = crate::relay::source::sql_connect(cfg).await else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let session = crate::slot::join::view(cfg).await;
    let tables = session.tables();
    let parted = crate::slot::join::partitions::members(&sql, &tables).await;
    let mut roots: Vec<String> = parted
        .unwrap_or_default()
        .into_iter()
        .map(|(_, root)| root)
        .collect();
    roots.sort();
    roots.dedup();
    let p = &cfg.source.publication;
    if !roots.is_empty() {
        const WHAT: &str = "partitioned tables";
        let roots = roots.join(", ");
        out.push(
            match crate::slot::join::partitions::via_root(cfg, &sql).await {
                Ok(Some(true)) => CheckLine::ok(
                    WHAT,
                    format!(
                        "{roots}: publication {p} publishes via the partition root \
                     (publish_via_partition_root): rows arrive as their table's"
                    ),
                ),
                Ok(_) => CheckLine::warn(
                    WHAT,
                    format!(
                        "{roots}: publication {p} publishes rows under each partition's name \
                     (publish_via_partition_root = false): the relay maps every partition to \
                     its table, and republishes the whole table (or partition) when one joins \
                     later (duplicates); to stream them as their table: ALTER PUBLICATION {p} \
                     SET (publish_via_partition_root = true) (a publication change: the relay \
                     republishes its gap)"
                    ),
                ),
                Err(e) => CheckLine::fail(WHAT, e.to_string()),
            },
        );
    }
    if cfg.has_patterns() {
        out.extend(deleting(cfg, &sql).await);
    }
    out
}

/// Without the event trigger: the matching tables whose statistics show deleted rows.
async fn deleting(cfg: &Config, sql: &tokio_postgres::Client) -> Option<CheckLine> {
    let trigger = format!("outboxd_join_{}", cfg.source.publication);
    let present: bool = sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = $1 \
                 AND evtenabled <> 'D')",
            &[&trigger],
        )
        .await
        .ok()?
        .get(0);
    if present {
        return None;
    }
    // The matched tables the configuration already reads, and those still outside.
    let mut matched: Vec<(String, String)> = cfg
        .tables()
        .into_iter()
        .filter(|t| t.discovered.is_some())
        .map(|t| t.pair())
        .collect();
    for f in crate::slot::join::discover(cfg, sql).await.ok()? {
        matched.push((f.schema, f.table));
    }
    let mut names = Vec::new();
    for (schema, table) in matched {
        let q = "SELECT COALESCE(sum(n_tup_del), 0)::bigint > 0 FROM pg_stat_user_tables \
             WHERE relid = to_regclass($1)::oid \
                OR relid IN (SELECT relid::oid FROM pg_partition_tree(to_regclass($1)))";
        let name = format!("{}.{}", quote_ident(&schema), quote_ident(&table));
        if sql.query_one(q, &[&name]).await.ok()?.get::<_, bool>(0) {
            names.push(format!("{schema}.{table}"));
        }
    }
    (!names.is_empty()).then(|| {
        CheckLine::warn(
            "deleted outbox rows",
            format!(
                "{} delete their rows (pg_stat_user_tables n_tup_del > 0) and there is no \
                 event trigger {trigger}: a new table of this kind that joins the publication \
                 after it was written holds nothing to republish, and the relay halts naming \
                 it; run `outboxd init --config FILE` as a superuser so that new tenants join \
                 in the transaction that creates them",
                names.join(", ")
            ),
        )
    })
}

/// Each table's `validation.schema_dir` (its own or `[validation]`'s), once per directory
/// with the tables it validates: a directory that is not there validates nothing, and with
/// `require_schema` parks every event of its tables.
fn schemas(cfg: &Config) -> Vec<CheckLine> {
    let mut dirs: std::collections::BTreeMap<std::path::PathBuf, Vec<String>> = Default::default();
    for t in cfg.tables() {
        if let Some(d) = &t.validation.schema_dir {
            dirs.entry(d.clone()).or_default().push(t.label());
        }
    }
    dirs.into_iter()
        .map(|(dir, tables)| {
            let what = format!("schemas of {}", tables.join(", "));
            match std::fs::metadata(&dir) {
                Ok(m) if m.is_dir() => CheckLine::ok(&what, dir.display().to_string()),
                Ok(_) => CheckLine::warn(&what, format!("{} is not a directory", dir.display())),
                Err(e) => CheckLine::warn(
                    &what,
                    format!(
                        "{}: {e} (validation.schema_dir: every event of these tables would \
                         pass unvalidated, or park with require_schema)",
                        dir.display()
                    ),
                ),
            }
        })
        .collect()
}

/// The replay audit's install and policy: a warning each when something is missing, disabled
/// or not this config's (nothing when all is well, or Postgres is unreachable: said elsewhere).
async fn replay(cfg: &Config) -> Vec<CheckLine> {
    let Ok(sql) = crate::relay::source::sql_connect(cfg).await else {
        return Vec::new();
    };
    match crate::replay::store::check_install(&sql, cfg).await {
        Ok(warnings) => warnings
            .into_iter()
            .map(|w| CheckLine::warn("replay", w))
            .collect(),
        Err(e) => vec![CheckLine::warn("replay", e.to_string())],
    }
}

async fn cleanup(cfg: &Config, retention: std::time::Duration) -> CheckLine {
    const WHAT: &str = "cleanup";
    let sql = match crate::cleanup::connect(cfg, None).await {
        Ok(s) => s,
        Err(e) => {
            return CheckLine::fail(
                WHAT,
                format!("cannot connect as the cleanup role (cleanup.dsn, else source.dsn): {e}"),
            )
        }
    };
    let state = format!(
        "{}.outboxd_slot_state",
        quote_ident(&cfg.source.relay_schema)
    );
    // Cleanup reads every relay's state and replays (crate::cleanup): at least this relay's.
    let replay = format!("{}.outboxd_replay", quote_ident(&cfg.source.relay_schema));
    // Every listed table: the first one the role cannot clean is the line's.
    let mut checked = None;
    for t in cfg.tables() {
        let outbox = format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name));
        let row = sql
            .query_one(
                "SELECT current_user::text, \
                        has_table_privilege($1, 'SELECT') AND has_table_privilege($1, 'DELETE'), \
                        (to_regclass($2) IS NULL OR has_table_privilege($2, 'SELECT')) \
                        AND (to_regclass($3) IS NULL OR has_table_privilege($3, 'SELECT'))",
                &[&outbox, &state, &replay],
            )
            .await;
        let done = !matches!(&row, Ok(r) if r.get::<_, bool>(1) && r.get::<_, bool>(2));
        checked = Some((row, outbox));
        if done {
            break;
        }
    }
    let Some((row, outbox)) = checked else {
        return CheckLine::fail(WHAT, "no outbox table configured");
    };
    let where_ = match cfg.cleanup.every {
        Some(every) => format!(
            "inside `outboxd run` every {}",
            humantime::format_duration(every)
        ),
        None => "when `outboxd cleanup` runs (cron)".into(),
    };
    match row {
        Err(e) => CheckLine::fail(WHAT, crate::error::RelayError::from(e).to_string()),
        Ok(r) => {
            let (role, outbox_ok, state_ok): (String, bool, bool) = (r.get(0), r.get(1), r.get(2));
            if outbox_ok && state_ok {
                CheckLine::ok(
                    WHAT,
                    format!(
                        "retention {}, {where_}, as role {role}",
                        humantime::format_duration(retention)
                    ),
                )
            } else {
                CheckLine::fail(
                    WHAT,
                    format!(
                        "role {role} cannot delete: GRANT SELECT, DELETE ON {outbox} TO {r}; \
                         GRANT SELECT ON {state}, {replay} TO {r}; (sql/roles.sql, \
                         outboxd_cleanup; set cleanup.dsn to connect as it)",
                        r = quote_ident(&role)
                    ),
                )
            }
        }
    }
}

fn shadow(cfg: &Config, topics: Option<&[String]>) -> CheckLine {
    const WHAT: &str = "shadow mode";
    let Some(topics) = topics else {
        return CheckLine::fail(WHAT, "the broker is unreachable: legacy topics not checked");
    };
    let missing: Vec<&String> = cfg
        .shadow
        .legacy_topics
        .iter()
        .filter(|t| !topics.contains(t))
        .collect();
    if !missing.is_empty() {
        return CheckLine::fail(
            WHAT,
            format!("shadow.legacy_topics not on the broker: {missing:?}"),
        );
    }
    CheckLine::warn(
        WHAT,
        format!(
            "ON: records are compared with {:?} and NOT delivered{}",
            cfg.shadow.legacy_topics,
            if cfg.shadow.deliver_types.is_empty() {
                String::new()
            } else {
                format!(" (except {:?})", cfg.shadow.deliver_types)
            }
        ),
    )
}
