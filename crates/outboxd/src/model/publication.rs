//! What the stream and the catalog say about the relay's publication, as plain functions: the
//! event trigger's messages (`PREFIX`, [`concerns`]) and the SQL of membership
//! ([`member_sql`]). The decoder's stages read the messages and the source checks membership;
//! `slot/publication` acts on both (docs/reliability.md, "Publication changes").

/// Prefix of the event trigger's messages.
pub const PREFIX: &str = "outboxd.publication";

/// What a publication message says about `publication`, when it concerns it.
pub fn concerns(content: &[u8], publication: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(content).ok()?;
    let tag = v["tag"].as_str().unwrap_or("publication DDL");
    // A publication created anew skipped nothing: it either did not exist for the stream
    // (changes before it make the walsender fail: the 42704 path) or was dropped before, and
    // that drop's own message ended the session.
    if tag == "CREATE PUBLICATION" {
        return None;
    }
    let objects = v["objects"].as_array().cloned().unwrap_or_default();
    // Tables added, nothing dropped (the guard's `event` says which; older guards do not):
    // what was streamed before stays streamed. A table that joins is the join's
    // ([`crate::slot::join`]): the relay notices it at its first Relation message.
    let added_only = v["event"].as_str() == Some("ddl_command_end")
        && !objects.is_empty()
        && objects
            .iter()
            .all(|o| o[0].as_str() == Some("publication relation"));
    if added_only {
        return None;
    }
    let quoted = format!("\"{}\"", publication.replace('"', "\"\""));
    let hit = objects.is_empty()
        || objects.iter().any(|o| {
            let kind = o[0].as_str().unwrap_or_default();
            let id = o[1].as_str().unwrap_or_default();
            if kind == "publication" {
                id == publication || id == quoted
            } else {
                id.ends_with(&format!(" in publication {publication}"))
                    || id.ends_with(&format!(" in publication {quoted}"))
            }
        });
    hit.then(|| format!("{tag} on publication {publication:?}"))
}

/// A table the guard's message says joined `publication` (sql/080's `joined`): its oid, and
/// its schema and name at that point of the WAL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    pub oid: u32,
    pub schema: String,
    pub name: String,
}

/// The tables a message says were added to `publication` (none from an older guard, or from
/// a drop).
pub fn joined(content: &[u8], publication: &str) -> Vec<Joined> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(content) else {
        return Vec::new();
    };
    if v["event"].as_str() != Some("ddl_command_end") {
        return Vec::new();
    }
    let Some(rels) = v["joined"].as_array() else {
        return Vec::new();
    };
    rels.iter()
        .filter(|r| r[0].as_str() == Some(publication))
        .filter_map(|r| {
            Some(Joined {
                oid: u32::try_from(r[1].as_u64()?).ok()?,
                schema: r[2].as_str()?.to_string(),
                name: r[3].as_str()?.to_string(),
            })
        })
        .collect()
}

/// The tables a message says were taken out of `publication` (sql/080's `left`), when that is
/// all it says: a drop of publication relations only, each named with its oid (a guard older
/// than issue 56's F5 names none: `None`, the whole publication's change).
pub fn left(content: &[u8], publication: &str) -> Option<Vec<Joined>> {
    let v: serde_json::Value = serde_json::from_slice(content).ok()?;
    if v["event"].as_str() != Some("sql_drop") {
        return None;
    }
    let objects = v["objects"].as_array()?;
    if objects.is_empty()
        || !objects
            .iter()
            .all(|o| o[0].as_str() == Some("publication relation"))
    {
        return None;
    }
    let quoted = format!("\"{}\"", publication.replace('"', "\"\""));
    let ours = objects
        .iter()
        .filter(|o| {
            let id = o[1].as_str().unwrap_or_default();
            id.ends_with(&format!(" in publication {publication}"))
                || id.ends_with(&format!(" in publication {quoted}"))
        })
        .count();
    let out: Vec<Joined> = v["left"]
        .as_array()?
        .iter()
        .filter(|r| r[0].as_str() == Some(publication))
        .filter_map(|r| {
            Some(Joined {
                oid: u32::try_from(r[1].as_u64()?).ok()?,
                schema: r[2].as_str()?.to_string(),
                name: r[3].as_str()?.to_string(),
            })
        })
        .collect();
    (out.len() == ours).then_some(out)
}

/// Is this the `ddl_command_end` message of an `ALTER PUBLICATION` that names no object but
/// `publication` itself, and no table added? Every `… DROP TABLE` writes one (with no object:
/// measured on 15) right after its `sql_drop` message ([`left`]), which already said what
/// changed.
pub fn ends_alter(content: &[u8], publication: &str) -> bool {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(content) else {
        return false;
    };
    let quoted = format!("\"{}\"", publication.replace('"', "\"\""));
    let objects = v["objects"].as_array().cloned().unwrap_or_default();
    v["tag"].as_str() == Some("ALTER PUBLICATION")
        && v["event"].as_str() == Some("ddl_command_end")
        && v["joined"].as_array().is_none_or(|j| j.is_empty())
        && objects.iter().all(|o| {
            o[0].as_str() == Some("publication")
                && matches!(o[1].as_str(), Some(id) if id == publication || id == quoted)
        })
}

/// SQL: whether the relation whose oid is the expression `oid` is in the publication named by
/// the expression `publication`: listed in `pg_publication_tables` (itself, or for a
/// partitioned table one of its partitions: a publication without `publish_via_partition_root`
/// lists only those), or a member by `pg_publication_rel` (a partitioned table without
/// partitions yet).
pub fn member_sql(publication: &str, oid: &str) -> String {
    format!(
        "(EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication pp \
             ON pp.oid = pr.prpubid WHERE pp.pubname = {publication} AND pr.prrelid = {oid}) \
          OR EXISTS (SELECT 1 FROM pg_publication_tables pt JOIN pg_namespace pn \
             ON pn.nspname = pt.schemaname JOIN pg_class pc ON pc.relnamespace = pn.oid \
             AND pc.relname = pt.tablename WHERE pt.pubname = {publication} \
             AND (pc.oid = {oid} OR pc.oid IN (SELECT relid FROM pg_partition_tree({oid})))))"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drop_of_tables_only_names_the_tables_that_left() {
        let m = br#"{"tag":"ALTER PUBLICATION","event":"sql_drop","objects":[["publication relation","tenant_1.outbox in publication outbox_pub"]],"left":[["outbox_pub",16384,"tenant_1","outbox"]]}"#;
        assert_eq!(
            left(m, "outbox_pub"),
            Some(vec![Joined {
                oid: 16384,
                schema: "tenant_1".into(),
                name: "outbox".into()
            }])
        );
        // An older guard names no oids; a dropped publication is no table leaving.
        let old = br#"{"tag":"ALTER PUBLICATION","event":"sql_drop","objects":[["publication relation","tenant_1.outbox in publication outbox_pub"]]}"#;
        assert_eq!(left(old, "outbox_pub"), None);
        let whole = br#"{"tag":"DROP PUBLICATION","event":"sql_drop","objects":[["publication","outbox_pub"]],"left":[]}"#;
        assert_eq!(left(whole, "outbox_pub"), None);
        let short = br#"{"tag":"ALTER PUBLICATION","event":"sql_drop","objects":[["publication relation","a.b in publication outbox_pub"],["publication relation","c.d in publication outbox_pub"]],"left":[["outbox_pub",1,"a","b"]]}"#;
        assert_eq!(left(short, "outbox_pub"), None);
    }

    #[test]
    fn a_message_names_the_tables_that_joined_its_publication() {
        let m = br#"{"tag":"ALTER PUBLICATION","event":"ddl_command_end","objects":[],"joined":[["outbox_pub",16384,"tenant_1","outbox"],["other",16385,"t","o"],["outbox_pub",-1,"x","y"]]}"#;
        assert_eq!(
            joined(m, "outbox_pub"),
            vec![Joined {
                oid: 16384,
                schema: "tenant_1".into(),
                name: "outbox".into()
            }]
        );
        let drop = br#"{"tag":"ALTER PUBLICATION","event":"sql_drop","joined":[["outbox_pub",1,"a","b"]]}"#;
        assert!(joined(drop, "outbox_pub").is_empty());
        assert!(joined(
            br#"{"tag":"ALTER PUBLICATION","event":"ddl_command_end"}"#,
            "outbox_pub"
        )
        .is_empty());
        assert!(joined(b"not json", "outbox_pub").is_empty());
    }

    #[test]
    fn a_message_concerns_the_publication_it_names() {
        let m = br#"{"tag":"ALTER PUBLICATION","objects":[["publication","outbox_pub"]]}"#;
        assert!(concerns(m, "outbox_pub")
            .unwrap()
            .contains("ALTER PUBLICATION"));
        assert_eq!(concerns(m, "other"), None);
        let rel = br#"{"tag":"ALTER PUBLICATION","objects":[["publication relation","public.outbox in publication \"Pub\""]]}"#;
        assert!(concerns(rel, "Pub").is_some());
        assert!(concerns(rel, "outbox_pub").is_none());
        let drop = br#"{"tag":"DROP PUBLICATION","objects":[]}"#;
        assert!(concerns(drop, "outbox_pub").is_some(), "unknown: assume it");
        // A table added (measured on PG 15: ADD TABLE's ddl_command_end) is no gap; the same
        // objects from sql_drop (DROP TABLE), or from a guard without `event`, are.
        let add = br#"{"tag":"ALTER PUBLICATION","event":"ddl_command_end","objects":[["publication relation","t.outbox in publication outbox_pub"]]}"#;
        assert_eq!(concerns(add, "outbox_pub"), None);
        let dropped = br#"{"tag":"ALTER PUBLICATION","event":"sql_drop","objects":[["publication relation","t.outbox in publication outbox_pub"]]}"#;
        assert!(concerns(dropped, "outbox_pub").is_some());
        let options = br#"{"tag":"ALTER PUBLICATION","event":"ddl_command_end","objects":[["publication","outbox_pub"]]}"#;
        assert!(concerns(options, "outbox_pub").is_some());
        let create = br#"{"tag":"CREATE PUBLICATION","objects":[["publication","outbox_pub"]]}"#;
        assert!(concerns(create, "outbox_pub").is_none());
        assert!(concerns(b"not json", "outbox_pub").is_none());
    }
}
