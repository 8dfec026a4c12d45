//! CloudEvents 1.0 settings of one outbox table, resolved at startup (issue 42): the content
//! mode of the Kafka protocol binding and the attribute templates. `config` parses
//! `[sink.cloudevents]` into these; `relay/route/cloudevents` builds the envelope from them.
//!
//! Templates are checked once here, so a bad placeholder or an invalid `source` is a startup
//! error naming the setting, never a record the SDKs refuse.

use super::route::SettingError;
use std::collections::HashSet;

/// The CloudEvents Kafka protocol binding's content modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Attributes as `ce_*` headers, the payload bytes as the value (no re-encoding).
    #[default]
    Binary,
    /// The value is the `application/cloudevents+json` envelope.
    Structured,
}

/// One piece of a template: literal text or a placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Lit(String),
    Var(Var),
}

/// The placeholders a template may use (which ones: per attribute, see [`Template::parse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Var {
    AggregateType,
    EventType,
    SchemaVersion,
}

/// A parsed attribute template (`type`, `dataschema`); `{database}`, `{schema}` and `{table}`
/// are substituted when the table's settings are resolved, the rest per event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template(pub Vec<Part>);

impl Template {
    /// Parses `text` for setting `key`; `allowed` are the per-event placeholders it may use,
    /// `fixed` the per-table ones with their values.
    pub fn parse(
        key: &str,
        text: &str,
        allowed: &[(&str, Var)],
        fixed: &[(&str, &str)],
    ) -> Result<Self, SettingError> {
        let mut parts = Vec::new();
        let mut lit = String::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            lit.push_str(&rest[..open]);
            let close = rest[open..].find('}').ok_or_else(|| {
                SettingError(format!(
                    "sink.cloudevents.{key} = {text:?}: a `{{` without `}}`"
                ))
            })? + open;
            let name = &rest[open + 1..close];
            if let Some((_, v)) = fixed.iter().find(|(n, _)| *n == name) {
                lit.push_str(v);
            } else if let Some((_, v)) = allowed.iter().find(|(n, _)| *n == name) {
                if !lit.is_empty() {
                    parts.push(Part::Lit(std::mem::take(&mut lit)));
                }
                parts.push(Part::Var(*v));
            } else {
                let known: Vec<String> = fixed
                    .iter()
                    .map(|(n, _)| format!("{{{n}}}"))
                    .chain(allowed.iter().map(|(n, _)| format!("{{{n}}}")))
                    .collect();
                return Err(SettingError(format!(
                    "sink.cloudevents.{key} = {text:?}: unknown placeholder {{{name}}}; \
                     known here: {}",
                    known.join(", ")
                )));
            }
            rest = &rest[close + 1..];
        }
        if rest.contains('}') {
            return Err(SettingError(format!(
                "sink.cloudevents.{key} = {text:?}: a `}}` without `{{`"
            )));
        }
        lit.push_str(rest);
        if !lit.is_empty() {
            parts.push(Part::Lit(lit));
        }
        if parts.is_empty() {
            return Err(SettingError(format!(
                "sink.cloudevents.{key} is empty: CloudEvents requires a non-empty value"
            )));
        }
        Ok(Self(parts))
    }

    /// The template with the event's values (`None` when a placeholder's value is missing).
    pub fn render(&self, value: impl Fn(Var) -> Option<String>) -> Option<String> {
        let mut out = String::new();
        for p in &self.0 {
            match p {
                Part::Lit(s) => out.push_str(s),
                Part::Var(v) => out.push_str(&value(*v)?),
            }
        }
        Some(out)
    }
}

/// `source` must be a URI-reference (RFC 3986): no whitespace, control characters or the
/// characters RFC 3986 never allows unescaped.
pub fn check_uri_reference(key: &str, s: &str) -> Result<(), SettingError> {
    let bad = s
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || "\"<>\\^`{|}".contains(*c));
    match bad {
        Some(c) => Err(SettingError(format!(
            "sink.cloudevents.{key} = {s:?} is not a URI-reference: {c:?} must be \
             percent-encoded (CloudEvents requires a URI-reference)"
        ))),
        None if s.is_empty() => Err(SettingError(format!(
            "sink.cloudevents.{key} is empty: CloudEvents requires a non-empty URI-reference"
        ))),
        None => Ok(()),
    }
}

/// A CloudEvents extension attribute name: lowercase ASCII letters and digits only
/// (CloudEvents 1.0, "Attribute Naming Convention"), at most 20 characters recommended.
pub fn is_extension_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 20
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// A table's CloudEvents settings, resolved (templates parsed, table names filled in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    pub mode: Mode,
    /// `type`: default `{event_type}`.
    pub type_: Template,
    /// `source`, a URI-reference, fully rendered (per table).
    pub source: String,
    /// `dataschema`: rendered for events whose (event type, schema version) has a registered
    /// JSON Schema (`registered`); unset: no `dataschema`.
    pub dataschema: Option<Template>,
    /// (event type, schema version) pairs with a schema file under `[validation] schema_dir`.
    pub registered: HashSet<(String, String)>,
}

/// The header of a parked CloudEvent holding its raw `created_at` (a parked CloudEvent is
/// stored in outboxd's own form, see `relay::route::Event::parked_record`); never sent, and
/// not one of the row's headers when a parked copy is compared with its row.
pub const CREATED_AT_HEADER: &str = "outboxd_ce_created_at";

/// The attribute and extension names outboxd sets itself: a row header may not take them.
pub const OWN: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
    "data_base64",
    "partitionkey",
    "aggregatetype",
    "aggregateversion",
    "schemaversion",
];

#[cfg(test)]
mod tests {
    use super::*;

    const TYPE_VARS: &[(&str, Var)] = &[
        ("aggregate_type", Var::AggregateType),
        ("event_type", Var::EventType),
    ];

    #[test]
    fn templates_render_and_refuse_unknown_placeholders() {
        let t = Template::parse(
            "type",
            "com.acme.{aggregate_type}.{event_type}",
            TYPE_VARS,
            &[],
        )
        .unwrap();
        let got = t.render(|v| {
            Some(match v {
                Var::AggregateType => "order".into(),
                _ => "OrderPaid".into(),
            })
        });
        assert_eq!(got.as_deref(), Some("com.acme.order.OrderPaid"));
        let e = Template::parse("type", "x.{nope}", TYPE_VARS, &[]).unwrap_err();
        assert!(e.0.contains("unknown placeholder {nope}"), "{e}");
        assert!(Template::parse("type", "x.{event_type", TYPE_VARS, &[]).is_err());
        assert!(Template::parse("type", "", TYPE_VARS, &[]).is_err());
        let s = Template::parse(
            "source",
            "/{database}/{table}",
            &[],
            &[("database", "app"), ("table", "t")],
        )
        .unwrap();
        assert_eq!(s.render(|_| None).as_deref(), Some("/app/t"));
    }

    #[test]
    fn names_and_uri_references() {
        assert!(is_extension_name("traceparent"));
        assert!(!is_extension_name("trace_parent"));
        assert!(!is_extension_name("Tenant"));
        assert!(check_uri_reference("source", "/outboxd/app/public.outbox").is_ok());
        assert!(check_uri_reference("source", "urn:x:y").is_ok());
        assert!(check_uri_reference("source", "/a b").is_err());
    }
}
