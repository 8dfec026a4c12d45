//! SQL identifiers that are spliced into statements (table and column names cannot be bind
//! parameters), validated and quoted so configuration can never inject SQL.

use crate::OutboxError;

/// A plain identifier (`[A-Za-z_][A-Za-z0-9_]*`, at most 63 bytes), rendered double-quoted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ident(String);

impl Ident {
    pub(crate) fn parse(what: &'static str, s: &str) -> Result<Self, OutboxError> {
        let mut chars = s.chars();
        let ok_first = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        let ok_rest = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok_first || !ok_rest || s.len() > 63 {
            return Err(OutboxError::invalid(
                what,
                format!("{s:?} is not a plain SQL identifier ([A-Za-z_][A-Za-z0-9_]*, ≤63)"),
            ));
        }
        Ok(Self(s.to_string()))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    pub(crate) fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
}

/// `schema.table` or `table` (then `public` is assumed, so the name never depends on the
/// connection's `search_path`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct QualifiedName {
    pub(crate) schema: Ident,
    pub(crate) name: Ident,
}

impl QualifiedName {
    pub(crate) fn parse(what: &'static str, s: &str) -> Result<Self, OutboxError> {
        match s.split_once('.') {
            Some((schema, name)) => Ok(Self {
                schema: Ident::parse(what, schema)?,
                name: Ident::parse(what, name)?,
            }),
            None => Ok(Self {
                schema: Ident::parse(what, "public")?,
                name: Ident::parse(what, s)?,
            }),
        }
    }

    pub(crate) fn quoted(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.name.quoted())
    }

    pub(crate) fn display(&self) -> String {
        format!("{}.{}", self.schema.as_str(), self.name.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_and_quoted() {
        let q = QualifiedName::parse("table", "outbox").unwrap();
        assert_eq!(q.quoted(), r#""public"."outbox""#);
        let q = QualifiedName::parse("table", "app.events_out").unwrap();
        assert_eq!(q.display(), "app.events_out");
        for bad in ["", "a;drop", "1abc", "a.b.c", "x\"y", "a b"] {
            assert!(QualifiedName::parse("table", bad).is_err(), "{bad}");
        }
    }
}
