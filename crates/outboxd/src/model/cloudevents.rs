//! CloudEvents 1.0 settings of one outbox table, resolved at startup (issue 42): the content
//! mode of the Kafka protocol binding and the attribute templates. `config` parses
//! `[sink.cloudevents]` into these; `relay/route/cloudevents` builds the envelope from them.
//!
//! Templates are checked once here, so a bad placeholder or an invalid `source` is a startup
//! error naming the setting, never a record the SDKs refuse.

use super::route::SettingError;
use std::collections::{HashMap, HashSet};

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

    /// [`Template::render`] without copying what needs no copy: a template of one literal or
    /// one placeholder is that text itself; only a composite one is written into `buf` (the
    /// per-event path, issue 55).
    pub fn render_with<'v>(
        &'v self,
        value: impl Fn(Var) -> Option<&'v str>,
        buf: &'v mut String,
    ) -> Option<&'v str> {
        match self.0.as_slice() {
            [Part::Lit(s)] => Some(s),
            [Part::Var(v)] => value(*v),
            parts => {
                buf.clear();
                for p in parts {
                    match p {
                        Part::Lit(s) => buf.push_str(s),
                        Part::Var(v) => buf.push_str(value(*v)?),
                    }
                }
                Some(buf)
            }
        }
    }

    /// Whether every placeholder has a value (the event can be rendered), without rendering.
    pub fn renders(&self, has: impl Fn(Var) -> bool) -> bool {
        self.0.iter().all(|p| match p {
            Part::Lit(_) => true,
            Part::Var(v) => has(*v),
        })
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

/// A CloudEvents attribute name as CloudEvents 1.0 requires ("Attribute Naming Convention":
/// names MUST consist of lower-case ASCII letters `a`–`z` or digits `0`–`9`). The spec's other
/// rule, at most 20 characters, is a SHOULD: the SDKs (Python, Go, Java) accept longer names.
/// A row's `ce_<name>` header must pass this to become an extension (issue 55).
pub fn is_attribute_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// A header name that structured mode carries as an extension attribute without being asked
/// (no `ce_` prefix): a valid attribute name within the recommended 20 characters.
pub fn is_extension_name(s: &str) -> bool {
    s.len() <= 20 && is_attribute_name(s)
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
    /// Event type → schema versions with a schema file under `[validation] schema_dir`.
    pub registered: HashMap<String, HashSet<String>>,
}

impl CloudEvents {
    /// Has (event type, schema version) a registered schema? (No allocation: per event.)
    pub fn is_registered(&self, event_type: &str, version: &str) -> bool {
        self.registered
            .get(event_type)
            .is_some_and(|v| v.contains(version))
    }
}

/// The header of a parked CloudEvent holding its raw `created_at` (a parked CloudEvent is
/// stored in outboxd's own form, see `relay::route::Event::parked_record`); never sent, and
/// not one of the row's headers when a parked copy is compared with its row.
pub const CREATED_AT_HEADER: &str = "outboxd_ce_created_at";

/// The attribute and extension names outboxd sets itself (and the JSON format's `data`
/// members): a row header may not take them, with or without the `ce_` prefix.
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

/// The Distributed Tracing extension's attributes, which outboxd takes from the row's
/// `traceparent`/`tracestate` headers: a `ce_traceparent` row header would set them twice.
pub const TRACE: &[&str] = &["traceparent", "tracestate"];

/// The attribute a `ce_<name>` row header (or a header named like an attribute) would shadow:
/// one outboxd sets itself, named for the parking reason. `None`: free for the row.
pub fn own_attribute(name: &str) -> Option<&'static str> {
    OWN.iter()
        .chain(TRACE)
        .copied()
        .find(|a| a.eq_ignore_ascii_case(name))
}

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
        // Longer than the recommended 20: still an attribute name (the rule is a SHOULD).
        assert!(!is_extension_name("averyveryverylongname1"));
        assert!(is_attribute_name("averyveryverylongname1"));
        assert!(is_attribute_name("9lives"));
        assert!(!is_attribute_name(""));
        assert!(!is_attribute_name("my-ext"));
        assert_eq!(own_attribute("Subject"), Some("subject"));
        assert_eq!(own_attribute("tracestate"), Some("tracestate"));
        assert_eq!(own_attribute("phase"), None);
        assert!(check_uri_reference("source", "/outboxd/app/public.outbox").is_ok());
        assert!(check_uri_reference("source", "urn:x:y").is_ok());
        assert!(check_uri_reference("source", "/a b").is_err());
    }
}
