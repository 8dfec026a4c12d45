//! The event trigger `outboxd init` installs (as a superuser): a table the patterns match (or a
//! listed one) joins the publication in the transaction that creates it, renames it or moves it
//! into a match. See the parent module's "Who adds a table".

use super::{discover, OWN_TABLES};
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::source::quote_ident;
use crate::slot::publication;
use tokio_postgres::Client;

/// `init`: the event trigger that adds a new matching (or listed) table to the publication in
/// the transaction that creates it. One per publication; its function runs as its owner (the
/// superuser that ran `init`), so tenants' roles need no rights on the publication.
pub fn joiner_sql(cfg: &Config) -> String {
    let publication = &cfg.source.publication;
    let name: String = format!("outboxd_join_{publication}")
        .chars()
        .take(63)
        .collect();
    let lit = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let mut conds: Vec<String> = cfg
        .patterns()
        .iter()
        .map(|(_, p)| {
            format!(
                "(r.nspname LIKE {} AND r.relname LIKE {})",
                lit(&p.schema),
                lit(&p.table)
            )
        })
        .collect();
    conds.extend(
        cfg.tables()
            .iter()
            .filter(|t| t.discovered.is_none())
            .map(|t| {
                format!(
                    "(r.nspname = {} AND r.relname = {})",
                    lit(&t.schema),
                    lit(&t.name)
                )
            }),
    );
    format!(
        "CREATE OR REPLACE FUNCTION public.{name}() RETURNS event_trigger \
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$ \
DECLARE r record; \
BEGIN \
  FOR r IN SELECT DISTINCT c.oid, n.nspname::text AS nspname, c.relname::text AS relname \
           FROM pg_event_trigger_ddl_commands() d JOIN pg_class c ON c.oid = d.objid \
           JOIN pg_namespace n ON n.oid = c.relnamespace \
           WHERE d.classid = 'pg_class'::regclass AND c.relkind IN ('r', 'p') \
             AND c.relpersistence = 'p' AND NOT c.relispartition AND NOT ({OWN_TABLES}) LOOP \
    IF ({conds}) AND EXISTS (SELECT 1 FROM pg_publication p \
        WHERE p.pubname = {pubname} AND NOT p.puballtables) \
      AND NOT EXISTS (SELECT 1 FROM pg_publication_rel pr \
        JOIN pg_publication p ON p.oid = pr.prpubid \
        WHERE p.pubname = {pubname} AND pr.prrelid = r.oid) THEN \
      EXECUTE format('ALTER PUBLICATION %I ADD TABLE %I.%I', {pubname}, r.nspname, r.relname); \
    END IF; \
  END LOOP; \
END $fn$; \
DROP EVENT TRIGGER IF EXISTS {name}; \
CREATE EVENT TRIGGER {name} ON ddl_command_end \
  WHEN TAG IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO', 'ALTER TABLE') \
  EXECUTE FUNCTION public.{name}();",
        conds = conds.join(" OR "),
        pubname = lit(publication),
    )
}

/// `init`: installs [`joiner_sql`] when the role may (a superuser) — for patterns and for
/// listed tables alike: a listed table dropped and created again (a migration's rebuild) joins
/// the publication in the transaction that creates it, so every row of it is streamed (issue
/// 56) — and adds the matching tables the publication lacks. Says what it did.
pub async fn install(cfg: &Config, sql: &Client) -> Result<Vec<String>, RelayError> {
    let mut said = Vec::new();
    if cfg.has_patterns() && !publication::exists(cfg, sql).await? {
        // Only patterns and no table yet: the tables join it as they come.
        sql.batch_execute(&format!(
            "CREATE PUBLICATION {} WITH (publish = 'insert', publish_via_partition_root = true)",
            quote_ident(&cfg.source.publication)
        ))
        .await?;
        said.push(format!(
            "publication {} created (empty)",
            cfg.source.publication
        ));
    }
    if publication::superuser(sql).await? {
        let ddl = crate::schema::qualified(&joiner_sql(cfg), &crate::schema::current(sql).await?);
        sql.batch_execute(&ddl).await?;
        said.push(format!(
            "event trigger outboxd_join_{} installed: a new table the patterns match (or a \
             listed table created again) joins publication {} in the transaction that creates it",
            cfg.source.publication, cfg.source.publication
        ));
    } else if cfg.has_patterns() {
        said.push(
            "event trigger outboxd_join_… NOT installed (CREATE EVENT TRIGGER needs a \
             superuser): new tables the patterns match join when `outboxd init` runs again or \
             a relay that may add them starts a session; their earlier rows are then \
             republished"
                .into(),
        );
    }
    if !cfg.has_patterns() {
        return Ok(said);
    }
    for f in discover(cfg, sql)
        .await?
        .into_iter()
        .filter(|f| !f.published)
    {
        publication::add_table(cfg, sql, &f.schema, &f.table).await?;
        said.push(format!(
            "publication {} extended with {}.{} (pattern): the relay republishes the rows it \
             held before",
            cfg.source.publication, f.schema, f.table
        ));
    }
    Ok(said)
}
