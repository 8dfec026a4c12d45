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

/// One `[[source.tables]]` entry as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableEntry {
    /// `schema.table` (or `table`, in `public`).
    pub name: String,
    /// This table's column mapping; unset: `[source.columns]`.
    #[serde(default)]
    pub columns: Option<Columns>,
    /// This table's topic template; unset: `[sink] topic`.
    #[serde(default)]
    pub topic: Option<String>,
}

/// One outbox table as the relay reads it: every override applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxTable {
    pub schema: String,
    pub name: String,
    pub columns: Columns,
    /// The topic template (unparsed; validated when the configuration is read).
    pub topic: String,
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
