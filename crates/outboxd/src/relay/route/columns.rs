//! Which columns of the outbox table hold which event field: our names, Debezium's preset, or
//! the operator's (`[source.columns]`).

use super::SettingError;
use serde::Deserialize;

/// Column names of the outbox table. `preset = "debezium"` reads Debezium's outbox table
/// (`id`, `aggregatetype`, `aggregateid`, `type`, `payload`) unchanged.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Columns {
    #[serde(default)]
    pub preset: Preset,
    pub event_id: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<String>,
    pub event_type: Option<String>,
    pub schema_version: Option<String>,
    pub payload: Option<String>,
    pub headers: Option<String>,
    pub created_at: Option<String>,
}

impl Default for Columns {
    fn default() -> Self {
        Self {
            preset: Preset::Outboxd,
            event_id: None,
            aggregate_type: None,
            aggregate_id: None,
            aggregate_version: None,
            event_type: None,
            schema_version: None,
            payload: None,
            headers: None,
            created_at: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    #[default]
    Outboxd,
    Debezium,
}

/// Resolved column names; `None` means "this table has no such column".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnNames {
    pub event_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_version: Option<String>,
    pub event_type: String,
    pub schema_version: Option<String>,
    pub payload: String,
    pub headers: Option<String>,
    pub created_at: Option<String>,
    /// Also send the event id in header `id`, as Debezium's EventRouter does (its consumers
    /// deduplicate on it); on with the Debezium preset.
    pub id_header: bool,
}

impl Columns {
    /// Applies the preset, then explicit names. An explicit empty string removes an optional
    /// column (e.g. `aggregate_version = ""` for a table without versions).
    pub fn resolve(&self) -> Result<ColumnNames, SettingError> {
        let mut n = match self.preset {
            Preset::Outboxd => ColumnNames {
                event_id: "event_id".into(),
                aggregate_type: "aggregate_type".into(),
                aggregate_id: "aggregate_id".into(),
                aggregate_version: Some("aggregate_version".into()),
                event_type: "event_type".into(),
                schema_version: Some("schema_version".into()),
                payload: "payload".into(),
                headers: Some("headers".into()),
                created_at: Some("created_at".into()),
                id_header: false,
            },
            Preset::Debezium => ColumnNames {
                event_id: "id".into(),
                aggregate_type: "aggregatetype".into(),
                aggregate_id: "aggregateid".into(),
                aggregate_version: None,
                event_type: "type".into(),
                schema_version: None,
                payload: "payload".into(),
                headers: None,
                created_at: None,
                id_header: true,
            },
        };
        let required = [
            (&self.event_id, &mut n.event_id, "event_id"),
            (
                &self.aggregate_type,
                &mut n.aggregate_type,
                "aggregate_type",
            ),
            (&self.aggregate_id, &mut n.aggregate_id, "aggregate_id"),
            (&self.event_type, &mut n.event_type, "event_type"),
            (&self.payload, &mut n.payload, "payload"),
        ];
        for (set, slot, key) in required {
            match set.as_deref() {
                Some("") => {
                    return Err(SettingError(format!(
                        "source.columns.{key} cannot be empty"
                    )))
                }
                Some(v) => *slot = v.to_string(),
                None => {}
            }
        }
        let optional = [
            (&self.aggregate_version, &mut n.aggregate_version),
            (&self.schema_version, &mut n.schema_version),
            (&self.headers, &mut n.headers),
            (&self.created_at, &mut n.created_at),
        ];
        for (set, slot) in optional {
            match set.as_deref() {
                Some("") => *slot = None,
                Some(v) => *slot = Some(v.to_string()),
                None => {}
            }
        }
        Ok(n)
    }
}
