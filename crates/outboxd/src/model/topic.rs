//! The topic name template (`sink.topic`).

use super::route::{RouteError, SettingError};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Lit(String),
    AggregateType,
    EventType,
}

/// A topic name template: `outbox.event.{aggregate_type}`; placeholders `{aggregate_type}`,
/// `{event_type}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicTemplate(Vec<Part>);

impl TopicTemplate {
    pub fn parse(t: &str) -> Result<Self, SettingError> {
        let mut parts = Vec::new();
        let mut rest = t;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Lit(rest[..open].to_string()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| SettingError(format!("sink.topic {t:?}: unclosed `{{`")))?
                + open;
            parts.push(match &rest[open + 1..close] {
                "aggregate_type" => Part::AggregateType,
                "event_type" => Part::EventType,
                other => {
                    return Err(SettingError(format!(
                        "sink.topic {t:?}: unknown placeholder {{{other}}} (use {{aggregate_type}} or {{event_type}})"
                    )))
                }
            });
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Lit(rest.to_string()));
        }
        if parts.is_empty() {
            return Err(SettingError("sink.topic is empty".into()));
        }
        Ok(Self(parts))
    }

    /// The fixed text before the first placeholder (the whole name when there is none), and
    /// whether the template has placeholders.
    pub fn prefix(&self) -> (String, bool) {
        let mut prefix = String::new();
        for p in &self.0 {
            match p {
                Part::Lit(s) => prefix.push_str(s),
                Part::AggregateType | Part::EventType => return (prefix, true),
            }
        }
        (prefix, false)
    }

    /// Renders an event's topic (its aggregate type, its event type) into `out` (cleared first)
    /// so the hot path reuses one buffer. Err when the template needs the event type and the
    /// row has none (a NULL one, Debezium preset).
    pub fn render(
        &self,
        aggregate_type: &str,
        event_type: Option<&str>,
        out: &mut String,
    ) -> Result<(), RouteError> {
        out.clear();
        for p in &self.0 {
            out.push_str(match p {
                Part::Lit(s) => s,
                Part::AggregateType => aggregate_type,
                Part::EventType => event_type.ok_or(RouteError::NullField("event_type"))?,
            });
        }
        Ok(())
    }

    /// The topic of an event of these types (a topic depends on nothing else): what `replay`'s
    /// dry run shows without building every record.
    pub fn render_for(&self, aggregate_type: &str, event_type: &str, out: &mut String) {
        out.clear();
        for p in &self.0 {
            out.push_str(match p {
                Part::Lit(s) => s,
                Part::AggregateType => aggregate_type,
                Part::EventType => event_type,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates() {
        assert!(TopicTemplate::parse("a.{event_type}.b").is_ok());
        assert!(TopicTemplate::parse("a.{x}").is_err());
        assert!(TopicTemplate::parse("a.{aggregate_type").is_err());
        assert!(TopicTemplate::parse("").is_err());
    }
}
