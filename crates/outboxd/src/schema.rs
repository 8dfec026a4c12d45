//! Where outboxd's own tables live: `source.relay_schema`. Every SQL connection of the relay
//! sets `search_path` to that schema alone (see `relay::source::sql_connect`), so the relay's
//! SQL names its tables unqualified and they resolve there, and only there.

/// The shipped DDL (`sql/030…050`, written for psql users as `public.…`) as the relay runs it:
/// unqualified, so the tables are created in the connection's current schema, the relay schema.
pub fn unqualified(ddl: &str) -> String {
    ddl.replace("public.", "")
}

/// The shipped DDL with its `public.` names in `schema` (quoted). For DDL whose functions run
/// with `SET search_path = pg_catalog, pg_temp` (trigger functions that guard a trust boundary):
/// a search path that holds a schema others may write lets them shadow a function or operator
/// the guard calls, so the guard names its tables by schema and searches nothing else.
pub fn qualified(ddl: &str, schema: &str) -> String {
    ddl.replace(
        "public.",
        &format!("{}.", crate::model::sql::quote_ident(schema)),
    )
}

/// Applies guarded DDL (`qualified` in the connection's schema): creates the tables, or
/// upgrades them and (re)installs their guards. A role that may not change tables that are
/// `present` (a least-privilege relay after an upgrade of outboxd) goes on with a warning, since
/// the tables work without the new guards: `outboxd init` as the admin role installs them, and
/// `outboxd check` says they are missing.
pub async fn install(
    sql: &tokio_postgres::Client,
    ddl: &str,
    what: &str,
    present: bool,
) -> Result<(), crate::error::RelayError> {
    use crate::error::RelayError;
    let ddl = qualified(ddl, &current(sql).await?);
    match sql.batch_execute(&ddl).await {
        Ok(()) => Ok(()),
        Err(e) if present => {
            tracing::warn!(
                "{what} lacks the guards of this version and this role cannot add them ({}): \
                 run `outboxd init` as the admin role (sql/roles.sql)",
                RelayError::from(e)
            );
            Ok(())
        }
        Err(e) => Err(RelayError::Setup(format!(
            "cannot create or upgrade {what} ({}): run `outboxd init` as a role that may \
             create tables and owns outboxd's tables",
            RelayError::from(e)
        ))),
    }
}

/// The connection's current schema: the relay schema on a relay connection (see the module
/// docs), where [`qualified`] DDL must go.
pub async fn current(sql: &tokio_postgres::Client) -> Result<String, tokio_postgres::Error> {
    Ok(sql
        .query_one("SELECT current_schema()::text", &[])
        .await?
        .get(0))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_shipped_ddl_names_only_relay_tables() {
        // Unqualifying must never move a business object: the files name relay tables only.
        for ddl in [
            crate::poison::store::PARKED_SQL,
            crate::obs::status_row::STATUS_SQL,
            crate::slot::state::STATE_SQL,
            crate::shadow::store::SHADOW_SQL,
            crate::replay::store::REPLAY_SQL,
        ] {
            for (i, _) in ddl.match_indices("public.") {
                let name: String = ddl[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                assert!(
                    name.starts_with("outbox_parked") || name.starts_with("outboxd_"),
                    "{name}"
                );
            }
        }
    }
}
