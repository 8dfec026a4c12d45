//! The outbox tables a relay reads (R44): `[[source.tables]]` entries, or the one-table
//! shorthand `source.table`. Every table goes through the same slot and publication; each has
//! its own column mapping and topic template (unset: `[source.columns]` and `[sink] topic`).
//!
//! A leaf module: the resolved [`OutboxTable`] is what the relay's stages, `init` and `check`
//! share, so none of them reaches into the configuration's raw fields.

use crate::relay::route::Columns;
use serde::Deserialize;

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
/// [`crate::relay::route::TopicTemplate`].
pub fn topic_for(template: &str, schema: &str, table: &str) -> String {
    template
        .replace("{schema}", schema)
        .replace("{table}", table)
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
    /// the catalog queries use it).
    pub fn matches(&self, schema: &str, table: &str) -> bool {
        like(self.schema.as_bytes(), schema.as_bytes())
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
        for bad in ["outbox", "a.b.c", "a..b", "a.b-c", "a.b'", ".b"] {
            assert!(Pattern::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            topic_for("t.{schema}.{table}.{aggregate_type}", "s", "o"),
            "t.s.o.{aggregate_type}"
        );
    }
}
