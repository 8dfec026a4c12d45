//! Where outboxd's own tables live: `source.relay_schema`. Every SQL connection of the relay
//! sets `search_path` to that schema alone (see `relay::source::sql_connect`), so the relay's
//! SQL names its tables unqualified and they resolve there, and only there.

/// The shipped DDL (`sql/030…050`, written for psql users as `public.…`) as the relay runs it:
/// unqualified, so the tables are created in the connection's current schema, the relay schema.
pub fn unqualified(ddl: &str) -> String {
    ddl.replace("public.", "")
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
