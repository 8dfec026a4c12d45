//! Publication changes under the stream (docs/reliability.md, "Publication changes").
//!
//! pgoutput decodes a change only when its table is in the publication at that point of the
//! WAL: rows inserted while the outbox table was out of it (`ALTER PUBLICATION … DROP TABLE`,
//! later `ADD TABLE`) are never decoded, silently, and a publication dropped and created again
//! cannot be decoded past at all (`publication "…" does not exist` at every restart). So a
//! change of the relay's publication is treated like a slot loss: the session ends, the state
//! row records the gap (`recovering_xid` from `delivered_xid`, reason [`REASON`]), and the next
//! session — once the table is back in the publication — replaces the slot (its new consistent
//! point is past the change) and republishes the gap from the table
//! ([`crate::slot::recovery`]). Exact: nothing the stream skipped is outside the gap, since the
//! relay confirms nothing past the change.
//!
//! Three ways to notice, in order of precision:
//! - the event trigger of `sql/080_outboxd_publication_guard.sql` (installed by `init` as a
//!   superuser) writes a transactional message with every publication DDL into the WAL, so the
//!   stream says where the publication changed, however briefly ([`concerns`]);
//! - the walsender's `publication "…" does not exist` (SQLSTATE 42704);
//! - without the trigger, a membership check with every state write ([`covered`]): a change
//!   that lasts across one is caught; a shorter one is not (`outboxd check` says so).

use crate::config::Config;
use crate::error::RelayError;
use crate::model::sql::quote_ident;
use tokio_postgres::Client;

pub use crate::model::publication::member_sql;

/// `recovery_reason` of a gap the publication left: its recovery replaces the slot.
pub const REASON: &str = "publication";

/// The event trigger's DDL (`init` applies it as a superuser).
pub const GUARD_SQL: &str = include_str!("../../../../sql/080_outboxd_publication_guard.sql");

/// Whether the publication exists, publishes inserts and includes every listed outbox table
/// right now (a partitioned one by its root or its partitions, see [`member_sql`]). A listed
/// table that does not exist has no rows for the publication to skip: it counts as covered
/// (dropped, the session streams the others; created again, it is another relation, which
/// ends the session before this is asked: `slot::join::changed`). A pattern's table that is
/// gone does not: it may have been renamed out of the pattern, rows and all.
pub async fn covered(cfg: &Config, sql: &Client) -> Result<bool, RelayError> {
    for t in cfg.tables() {
        let (exists, covers) = membership(cfg, sql, &t).await?;
        if !covers && (exists || t.discovered.is_some()) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// While the guard is installed, a state write that finds the publication lacking a table
/// may have run ahead of the stream, which says where the change happened. Whether to wait
/// for it: the guard is there, and every table missing is a pattern's table that still
/// exists (a table that left, put back as a join: issue 56, F5). A listed table missing, or
/// one dropped, is no message of the guard's: `false`.
pub async fn stream_will_say(cfg: &Config, sql: &Client) -> Result<bool, RelayError> {
    if !guarded(sql).await? {
        return Ok(false);
    }
    for t in cfg.tables() {
        let (exists, covers) = membership(cfg, sql, &t).await?;
        let waits = exists && t.discovered.is_some();
        if !(covers || waits) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether table `t` exists under its name, and whether the publication covers it ([`covered`]).
async fn membership(
    cfg: &Config,
    sql: &Client,
    t: &crate::config::tables::OutboxTable,
) -> Result<(bool, bool), RelayError> {
    let name = format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name));
    let row = sql
        .query_one(
            &format!(
                "SELECT to_regclass($2) IS NOT NULL, EXISTS (SELECT 1 FROM pg_publication p \
                 WHERE p.pubname = $1 AND p.pubinsert) AND COALESCE({}, false)",
                member_sql("$1", "to_regclass($2)::oid")
            ),
            &[&cfg.source.publication, &name],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// What the publication covers against what is listed (`check`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Listed tables the publication does not include: their rows are not streamed (the
    /// relay refuses to start until they are).
    pub missing: Vec<String>,
    /// Tables the publication includes that are not listed: their changes are decoded by the
    /// walsender and ignored by the relay.
    pub unlisted: Vec<String>,
}

/// Whether the relay's publication exists.
pub async fn exists(cfg: &Config, sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            &[&cfg.source.publication],
        )
        .await?
        .get(0))
}

/// Whether the connection's role is a superuser (CREATE EVENT TRIGGER needs one).
pub async fn superuser(sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?
        .get(0))
}

/// `ALTER PUBLICATION … ADD TABLE schema.table`.
pub async fn add_table(
    cfg: &Config,
    sql: &Client,
    schema: &str,
    table: &str,
) -> Result<(), tokio_postgres::Error> {
    sql.batch_execute(&format!(
        "ALTER PUBLICATION {} ADD TABLE {}.{}",
        quote_ident(&cfg.source.publication),
        quote_ident(schema),
        quote_ident(table)
    ))
    .await
}

/// The tables the publication includes (`schema.table`); `None` when it does not exist.
async fn published(cfg: &Config, sql: &Client) -> Result<Option<Vec<String>>, RelayError> {
    if !exists(cfg, sql).await? {
        return Ok(None);
    }
    // A partition's rows are its root's (published under the partition's own name without
    // publish_via_partition_root): the root is what is listed.
    let rows = sql
        .query(
            "SELECT DISTINCT rn.nspname::text || '.' || rc.relname::text \
             FROM pg_publication_tables t JOIN pg_namespace n ON n.nspname = t.schemaname \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.tablename \
             JOIN pg_class rc ON rc.oid = COALESCE(pg_partition_root(c.oid), c.oid) \
             JOIN pg_namespace rn ON rn.oid = rc.relnamespace \
             WHERE t.pubname = $1 \
             UNION SELECT n.nspname::text || '.' || c.relname::text FROM pg_publication_rel pr \
             JOIN pg_publication p ON p.oid = pr.prpubid JOIN pg_class c ON c.oid = pr.prrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.pubname = $1 ORDER BY 1",
            &[&cfg.source.publication],
        )
        .await?;
    Ok(Some(rows.iter().map(|r| r.get(0)).collect()))
}

/// `check`: listed tables missing from the publication, published tables not listed.
pub async fn coverage(cfg: &Config, sql: &Client) -> Result<Option<Coverage>, RelayError> {
    let Some(published) = published(cfg, sql).await? else {
        return Ok(None);
    };
    let listed: Vec<String> = cfg.tables().iter().map(|t| t.label()).collect();
    Ok(Some(Coverage {
        missing: listed
            .iter()
            .filter(|l| !published.contains(l))
            .cloned()
            .collect(),
        unlisted: published
            .into_iter()
            .filter(|p| !listed.contains(p))
            .collect(),
    }))
}

/// `init`: adds every listed table the (existing) publication does not include yet. The added
/// table's rows are streamed from the change on; the rows it held before are republished by
/// the next session of a relay that already ran on the slot ([`crate::slot::join`]).
pub async fn extend(cfg: &Config, sql: &Client) -> Result<Vec<String>, RelayError> {
    let Some(cov) = coverage(cfg, sql).await? else {
        return Ok(Vec::new());
    };
    let mut done = Vec::new();
    for label in cov.missing {
        let (schema, table) = crate::config::tables::split(&label);
        let qualified = format!("{}.{}", quote_ident(&schema), quote_ident(&table));
        sql.batch_execute(&format!(
            "ALTER PUBLICATION {} ADD TABLE {qualified}",
            quote_ident(&cfg.source.publication),
        ))
        .await?;
        // pgoutput streams a table's inserts from the change on: what it held before is not
        // in the stream, and saying so is the difference between a choice and a silent loss.
        let earlier: bool = sql
            .query_one(&format!("SELECT EXISTS (SELECT 1 FROM {qualified})"), &[])
            .await?
            .get(0);
        done.push(if earlier {
            format!(
                "publication {} extended with {label}; its rows written before now are NOT \
                 streamed (only inserts from now on are): a relay that has already run on slot \
                 {} republishes them when its next session starts (before it streams the \
                 table); on a slot's first run they are not, and if they must go out, republish \
                 them with `outboxd replay --table {} --since … --until …`",
                cfg.source.publication,
                cfg.source.slot,
                crate::model::shell::quote(&label)
            )
        } else {
            format!(
                "publication {} extended with {label}",
                cfg.source.publication
            )
        });
    }
    Ok(done)
}

/// `init`: installs the event trigger when the role may (a superuser), and says what it did.
/// A superuser re-applies it when present too: the file is idempotent, and an older guard's
/// messages lack what a newer relay reads (the tables that joined, by oid: issue 56).
pub async fn install_guard(sql: &Client) -> Result<String, RelayError> {
    let present = guarded(sql).await?;
    if !superuser(sql).await? {
        if present {
            return Ok(
                "event trigger outboxd_publication_ddl present (publication changes are \
                 seen in the stream; not updated: apply sql/080_outboxd_publication_guard.sql \
                 as a superuser after an upgrade)"
                    .into(),
            );
        }
        return Ok(
            "event trigger outboxd_publication_ddl NOT installed (CREATE EVENT TRIGGER \
                   needs a superuser): publication changes shorter than source.state_interval_ms \
                   go unnoticed; apply sql/080_outboxd_publication_guard.sql as a superuser"
                .into(),
        );
    }
    sql.batch_execute(GUARD_SQL).await?;
    Ok(format!(
        "event trigger outboxd_publication_ddl {} (publication changes are seen in the stream)",
        if present {
            "present, updated"
        } else {
            "installed"
        }
    ))
}

/// Whether the event trigger is installed (`check` reports it).
pub async fn guarded(sql: &Client) -> Result<bool, RelayError> {
    Ok(sql
        .query_one(
            // With its function's search_path pinned (issue 27): an older install's function
            // runs with the caller's path, often a superuser's, and is replaced by init. And
            // with the event in its messages (a table added is no gap): older ones are replaced.
            "SELECT count(*) = 2 FROM pg_event_trigger e JOIN pg_proc p ON p.oid = e.evtfoid \
             WHERE e.evtname IN ('outboxd_publication_ddl', 'outboxd_publication_drop') \
               AND e.evtenabled <> 'D' AND p.proconfig IS NOT NULL \
               AND p.prosrc LIKE '%''event'', TG_EVENT%'",
            &[],
        )
        .await?
        .get(0))
}
