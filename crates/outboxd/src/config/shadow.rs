//! `[shadow]`: streaming and building every record without delivering it, compared with what a
//! legacy "publish inside the transaction" path sends (the work itself: `crate::shadow`).

use serde::Deserialize;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowConfig {
    /// Shadow mode on: records of types not in `deliver_types` are compared, not delivered.
    #[serde(default, deserialize_with = "super::lenient")]
    pub enabled: bool,
    /// The topics the legacy path publishes to (read from their end at start).
    #[serde(default)]
    pub legacy_topics: Vec<String>,
    /// Where a legacy record carries the event id: `header:<name>`, `json:<JSON pointer>` into
    /// its value, or `key`.
    #[serde(default = "d_event_id")]
    pub legacy_event_id: String,
    /// Where a legacy record carries its event type (for reports of events outboxd never saw):
    /// `header:<name>` or `json:<pointer>`; unset: reported as `unknown`.
    #[serde(default)]
    pub legacy_event_type: Option<String>,
    /// What is compared: `key`, `value`, `topic`, `header:<name>`.
    #[serde(default = "d_compare")]
    pub compare: Vec<String>,
    /// `json`: values are equal when they parse to the same JSON (key order, whitespace and
    /// number spelling aside); `bytes`: byte for byte.
    #[serde(default = "d_value_mode")]
    pub value_compare: String,
    /// How long one side waits for the other before it counts as missing there.
    #[serde(default = "d_window", deserialize_with = "super::duration_secs")]
    pub match_window: Duration,
    /// Send the shadowed records to `<prefix><topic>` (real produce, acknowledged like live
    /// records) instead of nowhere.
    #[serde(default)]
    pub shadow_topic_prefix: Option<String>,
    /// Canary: these event types are delivered for real (and not compared).
    #[serde(default)]
    pub deliver_types: Vec<String>,
}

impl Default for ShadowConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            legacy_topics: Vec::new(),
            legacy_event_id: d_event_id(),
            legacy_event_type: None,
            compare: d_compare(),
            value_compare: d_value_mode(),
            match_window: d_window(),
            shadow_topic_prefix: None,
            deliver_types: Vec::new(),
        }
    }
}

fn d_event_id() -> String {
    "header:event_id".into()
}
fn d_compare() -> Vec<String> {
    vec!["key".into(), "value".into()]
}
fn d_value_mode() -> String {
    "json".into()
}
fn d_window() -> Duration {
    Duration::from_secs(60)
}

/// Where a field of a legacy record is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Locator {
    Key,
    Header(String),
    /// A JSON pointer (RFC 6901) into the value.
    Json(String),
}

impl Locator {
    pub fn parse(key: &str, s: &str) -> Result<Self, String> {
        if s == "key" {
            return Ok(Self::Key);
        }
        match s.split_once(':') {
            Some(("header", h)) if !h.is_empty() => Ok(Self::Header(h.to_string())),
            Some(("json", p)) if p.starts_with('/') => Ok(Self::Json(p.to_string())),
            _ => Err(format!(
                "{key} = {s:?}: use \"key\", \"header:<name>\" or \"json:/<pointer>\""
            )),
        }
    }
}

/// One compared field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    Key,
    Value,
    Topic,
    Header(String),
}

impl Field {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "key" => Ok(Self::Key),
            "value" => Ok(Self::Value),
            "topic" => Ok(Self::Topic),
            _ => match s.strip_prefix("header:") {
                Some(h) if !h.is_empty() => Ok(Self::Header(h.to_string())),
                _ => Err(format!(
                    "shadow.compare: {s:?} is not a field: use \"key\", \"value\", \"topic\" or \
                     \"header:<name>\""
                )),
            },
        }
    }

    /// The name reports and metrics use.
    pub fn name(&self) -> String {
        match self {
            Self::Key => "key".into(),
            Self::Value => "value".into(),
            Self::Topic => "topic".into(),
            Self::Header(h) => format!("header:{h}"),
        }
    }
}

impl ShadowConfig {
    /// Checks what serde cannot; each error names the setting and the fix.
    pub fn validate(&self) -> Result<(), String> {
        if !self.enabled {
            return Ok(());
        }
        if self.legacy_topics.is_empty() {
            return Err(
                "shadow.enabled needs shadow.legacy_topics: the topics the legacy path publishes to"
                    .into(),
            );
        }
        for t in &self.legacy_topics {
            if !valid_topic(t) {
                return Err(format!(
                    "shadow.legacy_topics: {t:?} is not a Kafka topic name (1-249 of a-z A-Z 0-9 . _ -)"
                ));
            }
        }
        Locator::parse("shadow.legacy_event_id", &self.legacy_event_id)?;
        if let Some(t) = &self.legacy_event_type {
            Locator::parse("shadow.legacy_event_type", t)?;
        }
        if self.compare.is_empty() {
            return Err(
                "shadow.compare is empty: name at least one of key, value, topic, header:<name>"
                    .into(),
            );
        }
        for f in &self.compare {
            Field::parse(f)?;
        }
        if !matches!(self.value_compare.as_str(), "json" | "bytes") {
            return Err(format!(
                "shadow.value_compare = {:?}: use \"json\" or \"bytes\"",
                self.value_compare
            ));
        }
        if self.match_window.is_zero() || self.match_window > Duration::from_secs(86_400) {
            return Err("shadow.match_window must be between 1s and 1d".into());
        }
        if let Some(p) = &self.shadow_topic_prefix {
            if p.is_empty() || !valid_topic(p) {
                return Err(format!(
                    "shadow.shadow_topic_prefix = {p:?}: use characters of a Kafka topic name (a-z A-Z 0-9 . _ -)"
                ));
            }
        }
        Ok(())
    }
}

fn valid_topic(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 249
        && t.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locators_and_fields_parse_or_name_the_fix() {
        assert_eq!(Locator::parse("k", "key"), Ok(Locator::Key));
        assert_eq!(
            Locator::parse("k", "header:id"),
            Ok(Locator::Header("id".into()))
        );
        assert_eq!(
            Locator::parse("k", "json:/meta/id"),
            Ok(Locator::Json("/meta/id".into()))
        );
        assert!(Locator::parse("k", "json:meta")
            .unwrap_err()
            .contains("json:/<pointer>"));
        assert_eq!(
            Field::parse("header:event_type").unwrap().name(),
            "header:event_type"
        );
        assert!(Field::parse("payload").is_err());
    }

    #[test]
    fn enabled_needs_legacy_topics() {
        let c = ShadowConfig {
            enabled: true,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("legacy_topics"));
        let c = ShadowConfig {
            enabled: true,
            legacy_topics: vec!["orders".into()],
            value_compare: "fuzzy".into(),
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("value_compare"));
    }
}
