//! The outbox tables a relay reads (R44): `[[source.tables]]` entries, or the one-table
//! shorthand `source.table`. Every table goes through the same slot and publication; each has
//! its own column mapping and topic template (unset: `[source.columns]` and `[sink] topic`),
//! and its own poison policy and schemas (`[source.tables.policy]` and
//! `[source.tables.validation]`, merged with `[policy]` and `[validation]`).
//!
//! A leaf module: the resolved [`OutboxTable`] is what the relay's stages, `init` and `check`
//! share, so none of them reaches into the configuration's raw fields.

use super::policy::{PolicyConfig, PolicyOverride};
use crate::model::columns::Columns;
use serde::Deserialize;
use std::path::PathBuf;

/// The table `source.table` names when neither it nor `source.tables` is set.
pub const DEFAULT_TABLE: &str = "public.outbox";

/// The header naming a record's table (`schema.table`), on every record of a relay with more
/// than one table. Not with one: a one-table relay's records stay byte-for-byte what they were
/// (and what Debezium's EventRouter writes with the Debezium preset).
pub const SOURCE_TABLE_HEADER: &str = "source_table";

/// One `[[source.tables]]` entry as written: a table (`name`) or every table matching a
/// pattern (`pattern`, see [`crate::slot::join`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableEntry {
    /// `schema.table` (or `table`, in `public`); empty in a pattern entry.
    #[serde(default)]
    pub name: String,
    /// `schema_like.table_like` with SQL `LIKE` wildcards (`%` any run, `_` any one
    /// character), e.g. `tenant_%.outbox`: every matching table, discovered from the catalog
    /// at each session start and when one joins the publication.
    #[serde(default)]
    pub pattern: Option<String>,
    /// This table's column mapping; unset: `[source.columns]`.
    #[serde(default)]
    pub columns: Option<Columns>,
    /// This table's topic template; unset: `[sink] topic`.
    #[serde(default)]
    pub topic: Option<String>,
    /// Set on the entries a session adds for the tables a pattern matched (the pattern).
    #[serde(skip)]
    pub discovered: Option<String>,
    /// This table's poison-event policy, merged with `[policy]` ([`PolicyOverride`]).
    #[serde(default)]
    pub policy: Option<PolicyOverride>,
    /// This table's JSON Schema checks, merged with `[validation]` ([`ValidationOverride`]).
    #[serde(default)]
    pub validation: Option<ValidationOverride>,
    /// This table's CloudEvents attributes, merged with `[sink.cloudevents]`.
    #[serde(default)]
    pub cloudevents: Option<super::cloudevents::CloudEventsOverride>,
}

/// `[source.tables.validation]`: each key set replaces `[validation]`'s for this table, so a
/// table may validate against schemas of its own (`schema_dir`) or demand one per event type
/// (`require_schema`) while the others do not.
#[derive(Debug, Clone, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ValidationOverride {
    #[serde(default)]
    pub schema_dir: Option<PathBuf>,
    #[serde(default)]
    pub require_schema: Option<bool>,
}

impl ValidationOverride {
    /// `top` with this table's keys applied.
    pub fn merged(&self, top: &super::ValidationConfig) -> super::ValidationConfig {
        super::ValidationConfig {
            schema_dir: self.schema_dir.clone().or_else(|| top.schema_dir.clone()),
            require_schema: self.require_schema.unwrap_or(top.require_schema),
        }
    }
}

/// One outbox table as the relay reads it: every override applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxTable {
    pub schema: String,
    pub name: String,
    pub columns: Columns,
    /// The topic template (unparsed; validated when the configuration is read).
    pub topic: String,
    /// The pattern that matched it, when it is not listed by name.
    pub discovered: Option<String>,
    /// `[policy]` with this table's overrides merged in.
    pub policy: PolicyConfig,
    /// `[validation]` with this table's overrides merged in.
    pub validation: super::ValidationConfig,
    /// `[sink.cloudevents]` with this table's overrides merged in.
    pub cloudevents: super::cloudevents::CloudEventsConfig,
}

impl OutboxTable {
    /// `schema.table`, as in the `source_table` header, metric labels and messages.
    pub fn label(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }

    /// (schema, table).
    pub fn pair(&self) -> (String, String) {
        (self.schema.clone(), self.name.clone())
    }
}

/// The topic template of a table: `{schema}` and `{table}` of an entry's own `topic` (a
/// pattern's tables differ by them) become the table's names; everything else is left to
/// [`crate::model::topic::TopicTemplate`].
pub fn topic_for(template: &str, schema: &str, table: &str) -> String {
    template
        .replace("{schema}", schema)
        .replace("{table}", table)
}

/// outboxd's own tables (`outbox_parked*`, `outboxd_*`): never an outbox, whatever a pattern
/// matches. The catalog queries and the join trigger say the same in SQL
/// (`crate::slot::join`'s `OWN_TABLES`); a Relation message is checked here, so a session never
/// ends for one of them ("joined the publication") and restarts into the same message forever.
pub fn is_own_table(table: &str) -> bool {
    table.starts_with("outbox_parked") || table.starts_with("outboxd_")
}

/// A `[[source.tables]]` pattern: `schema_like.table_like`, SQL `LIKE` semantics without
/// escapes (`%` any run of characters, `_` any one), case-sensitive like the names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    pub schema: String,
    pub table: String,
}

impl Pattern {
    /// Err says what is wrong (the caller names the entry).
    pub fn parse(p: &str) -> Result<Self, String> {
        let ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '%'))
        };
        match p.split_once('.') {
            Some((s, t)) if ok(s) && ok(t) && !t.contains('.') => Ok(Self {
                schema: s.into(),
                table: t.into(),
            }),
            _ => Err(format!(
                "pattern = {p:?}: use `schema.table` where each part is letters, digits, `_`,                  `$` and the SQL LIKE wildcards `%` (any run) and `_` (any one character), e.g.                  \"tenant_%.outbox\""
            )),
        }
    }

    /// Does `schema.table` match? The same answer as SQL `LIKE` gives (the event trigger and
    /// the catalog queries use it), except that outboxd's own tables never match
    /// ([`is_own_table`]): `public.outbox_%` must not make `outbox_parked` an outbox.
    pub fn matches(&self, schema: &str, table: &str) -> bool {
        !is_own_table(table)
            && like(self.schema.as_bytes(), schema.as_bytes())
            && like(self.table.as_bytes(), table.as_bytes())
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.schema, self.table)
    }
}

/// SQL `LIKE` without escapes, on bytes (names are ASCII, validated).
fn like(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'%', rest)) => (0..=s.len()).any(|i| like(rest, &s[i..])),
        Some((b'_', rest)) => !s.is_empty() && like(rest, &s[1..]),
        Some((c, rest)) => s.first() == Some(c) && like(rest, &s[1..]),
    }
}

/// `schema.table` or `table` → (schema, table); the schema defaults to `public`.
pub fn split(name: &str) -> (String, String) {
    match name.split_once('.') {
        Some((s, t)) => (s.to_string(), t.to_string()),
        None => ("public".to_string(), name.to_string()),
    }
}

/// Which listed table a parked event belongs to, by the `source_table` header its stored
/// record carries (`stored`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParkedTable<'a> {
    /// The listed table at this index (configuration order).
    Listed(usize),
    /// A table this configuration does not list (any more): nothing here may release it.
    Unlisted(&'a str),
    /// No header, and several tables listed: parked before the relay listed several tables
    /// (by a one-table relay), so nothing says which.
    Unknown,
}

impl<'a> ParkedTable<'a> {
    /// `labels`: the listed tables' `schema.table`, in configuration order. Without a header,
    /// a one-table configuration's only table (its records carry none).
    pub fn of(labels: &[String], stored: Option<&'a str>) -> Self {
        match stored {
            Some(l) => match labels.iter().position(|x| x == l) {
                Some(i) => Self::Listed(i),
                None => Self::Unlisted(l),
            },
            None if labels.len() == 1 => Self::Listed(0),
            None => Self::Unknown,
        }
    }

    /// Why an event of no listed table is not released, and what to do; `None` when listed.
    pub fn not_listed(&self) -> Option<String> {
        match self {
            Self::Listed(_) => None,
            Self::Unlisted(t) => Some(format!(
                "parked from {t}, which this configuration does not list (any more): no listed \
                 table's mapping, topic or row may release it. Discard it (`outboxd parked \
                 discard`), or list {t} again and retry it"
            )),
            Self::Unknown => Some(
                "parked before this relay listed several tables (its record names no \
                 source_table), so nothing says which table's mapping, topic and row apply. \
                 Discard it (`outboxd parked discard`), or retry it with the one-table \
                 configuration that parked it"
                    .to_string(),
            ),
        }
    }
}

/// The `source_table` header of a stored record's headers, if any.
pub fn stored_table(headers: &[(String, Option<String>)]) -> Option<&str> {
    headers
        .iter()
        .find(|(k, _)| k == SOURCE_TABLE_HEADER)
        .and_then(|(_, v)| v.as_deref())
}

/// The message of a capability that reads the outbox table but not yet several of them: it
/// refuses a multi-table configuration rather than skip a table.
pub fn not_with_several(what: &str, tables: &[OutboxTable]) -> String {
    let names: Vec<String> = tables.iter().map(OutboxTable::label).collect();
    format!(
        "{what} reads one outbox table and this configuration lists {} ({}): it is refused rather \
         than skip a table. Run it with a configuration that lists only the table concerned \
         (`source.table = \"schema.table\"`, the same slot and columns), or see \
         docs/configuration.md, \"Several outbox tables\"",
        names.len(),
        names.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_like_sql_like() {
        let p = Pattern::parse("tenant_%.outbox").unwrap();
        assert!(p.matches("tenant_a", "outbox"));
        assert!(p.matches("tenant_", "outbox"), "% matches nothing too");
        assert!(
            p.matches("tenantXa", "outbox"),
            "_ is any one character, as in LIKE"
        );
        assert!(!p.matches("tenant", "outbox"));
        assert!(!p.matches("tenant_a", "outbox2"));
        assert!(!p.matches("Tenant_a", "outbox"), "case-sensitive");
        assert!(Pattern::parse("%.%").unwrap().matches("a", "b"));
        // outboxd's own tables are never outboxes, whatever the pattern.
        let own = Pattern::parse("public.outbox_%").unwrap();
        assert!(own.matches("public", "outbox_v2"));
        for t in [
            "outbox_parked",
            "outbox_parked_audit",
            "outboxd_status",
            "outboxd_slot_state",
        ] {
            assert!(!own.matches("public", t), "{t}");
            assert!(!Pattern::parse("%.%").unwrap().matches("public", t), "{t}");
        }
        for bad in ["outbox", "a.b.c", "a..b", "a.b-c", "a.b'", ".b"] {
            assert!(Pattern::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            topic_for("t.{schema}.{table}.{aggregate_type}", "s", "o"),
            "t.s.o.{aggregate_type}"
        );
    }

    #[test]
    fn a_parked_event_belongs_to_the_table_its_record_names() {
        let two = ["a.outbox".to_string(), "b.outbox".to_string()];
        assert_eq!(
            ParkedTable::of(&two, Some("b.outbox")),
            ParkedTable::Listed(1)
        );
        assert_eq!(
            ParkedTable::of(&two, Some("old.outbox")),
            ParkedTable::Unlisted("old.outbox")
        );
        assert_eq!(ParkedTable::of(&two, None), ParkedTable::Unknown);
        // One table: its records name none; a record naming another table is not its.
        let one = ["a.outbox".to_string()];
        assert_eq!(ParkedTable::of(&one, None), ParkedTable::Listed(0));
        assert_eq!(
            ParkedTable::of(&one, Some("a.outbox")),
            ParkedTable::Listed(0)
        );
        assert_eq!(
            ParkedTable::of(&one, Some("b.outbox")),
            ParkedTable::Unlisted("b.outbox")
        );
        assert!(ParkedTable::Listed(0).not_listed().is_none());
        let why = ParkedTable::Unlisted("old.outbox").not_listed().unwrap();
        assert!(
            why.contains("old.outbox") && why.contains("discard"),
            "{why}"
        );
        assert!(ParkedTable::Unknown
            .not_listed()
            .unwrap()
            .contains("one-table"));
    }
}
