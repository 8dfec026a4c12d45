//! SQL text every floor writes the same way.

/// A SQL identifier, quoted: `"` doubled, the whole wrapped in `"`. Every table, schema,
/// publication and slot name a query names goes through it (names come from configuration and
/// the catalog, both possibly hostile).
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}
