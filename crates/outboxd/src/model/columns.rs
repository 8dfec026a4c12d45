//! Which columns of the outbox table hold which event field: our names, Debezium's preset, or
//! the operator's (`[source.columns]`).

use super::route::{is_reserved_header, SettingError};
use serde::{Deserialize, Deserializer};
use std::sync::Arc;

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
    /// Extra columns placed into the record, in Debezium's `table.fields.additional.placement`
    /// syntax: `column:header[:name]` entries, comma-separated in one string (pasted from a
    /// connector config, or from the environment) or given as a list of strings.
    #[serde(default, deserialize_with = "entries")]
    pub additional: Vec<String>,
    /// The table's CloudEvents settings (`[sink] format = "cloudevents"`), filled in by
    /// `Config::tables`, never read from `[source.columns]`.
    #[serde(skip)]
    pub cloudevents: Option<Arc<super::cloudevents::CloudEvents>>,
    /// The payload's media type (e.g. `application/vnd.apache.avro+binary` for a bytea column
    /// of registry-framed Avro), sent as header `content-type` on every record when set.
    #[serde(default)]
    pub content_type: Option<String>,
}

/// One comma-separated string or a list of strings (each may hold commas too): the entries,
/// trimmed, in order. Empty entries are kept, to be refused by [`Columns::resolve`].
fn entries<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let all = match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    };
    // A trailing comma is no entry (Java's split, which Debezium uses, drops it as well).
    Ok(all
        .iter()
        .flat_map(|s| s.trim_end_matches([',', ' ', '\t']).split(','))
        .map(|e| e.trim().to_string())
        .collect())
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
            additional: Vec::new(),
            cloudevents: None,
            content_type: None,
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
    /// A NULL aggregate id or event type is delivered as Debezium's EventRouter delivers it (a
    /// record with a null key; no `event_type` header) instead of parked; on with the Debezium
    /// preset. Without it both are required.
    pub debezium_nulls: bool,
    /// Columns copied into headers (`[source.columns] additional`), in the configured order.
    pub additional: Vec<Placement>,
    /// Records are CloudEvents with these settings (`None`: outboxd's own records).
    pub cloudevents: Option<Arc<super::cloudevents::CloudEvents>>,
    /// `content_type`: the `content-type` header of every record (CloudEvents'
    /// `datacontenttype`); `None`: no such header, as before.
    pub content_type: Option<Arc<str>>,
}

/// One `column:header[:name]` entry of `additional`: the column's value goes into header
/// `header` as Debezium's `SimpleHeaderConverter` writes it (a NULL as a header without value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub column: String,
    pub header: Arc<str>,
}

/// The longest header name accepted from `additional` (Kafka sets no limit; nobody needs more).
const MAX_HEADER_NAME: usize = 255;

/// Parses and checks the `additional` entries. `id_header`: header `id` is taken.
fn placements(entries: &[String], id_header: bool) -> Result<Vec<Placement>, SettingError> {
    let err = |e: &str, why: String| {
        SettingError(format!(
            "source.columns.additional entry {e:?}: {why} (the syntax is Debezium's \
             table.fields.additional.placement: column:header or column:header:name)"
        ))
    };
    let mut out: Vec<Placement> = Vec::with_capacity(entries.len());
    for e in entries {
        let parts: Vec<&str> = e.split(':').map(str::trim).collect();
        let (column, placement, alias) = match parts[..] {
            [c, p] => (c, p, c),
            [c, p, a] => (c, p, a),
            _ if e.is_empty() => return Err(err(e, "empty entry".into())),
            [_] => return Err(err(e, "no placement".into())),
            _ => return Err(err(e, "too many parts".into())),
        };
        if column.is_empty() || column.len() > 63 || column.chars().any(char::is_control) {
            return Err(err(
                e,
                "the column must be a column name of the outbox table".into(),
            ));
        }
        match placement.to_ascii_lowercase().as_str() {
            "header" => {}
            "envelope" => {
                return Err(err(
                    e,
                    "envelope placement is not supported: outboxd's record \
                value is the payload itself, and what Debezium writes there with an envelope field \
                (Kafka Connect's Struct text under StringConverter, or a JsonConverter/Avro \
                structure) is not JSON a consumer reads; place the column in a header instead \
                (docs/migrating-from-debezium.md)"
                        .into(),
                ))
            }
            "partition" => {
                return Err(err(
                    e,
                    "partition placement is not supported: outboxd \
                partitions by the record key, the aggregate id, which keeps each aggregate's \
                events in order; a partition taken from a column would not survive parking and \
                an operator's release (docs/migrating-from-debezium.md)"
                        .into(),
                ))
            }
            other => return Err(err(e, format!("unknown placement {other:?}, use header"))),
        }
        let taken = is_reserved_header(alias) || (id_header && alias.eq_ignore_ascii_case("id"));
        if taken {
            return Err(err(
                e,
                format!(
                    "header {alias:?} is one outboxd sets itself (event_id, event_type, \
                     aggregate_type, aggregate_id, aggregate_version, schema_version{}, in any \
                     letter case): give the header another name, column:header:name",
                    if id_header { ", id" } else { "" }
                ),
            ));
        }
        if alias.is_empty() || alias.len() > MAX_HEADER_NAME || alias.chars().any(char::is_control)
        {
            return Err(err(
                e,
                format!(
                    "a header name must be 1 to {MAX_HEADER_NAME} bytes without control characters"
                ),
            ));
        }
        if out.iter().any(|p| p.header.eq_ignore_ascii_case(alias)) {
            return Err(err(
                e,
                format!("header {alias:?} is placed twice (names compare in any letter case)"),
            ));
        }
        out.push(Placement {
            column: column.to_string(),
            header: alias.into(),
        });
    }
    Ok(out)
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
                debezium_nulls: false,
                additional: Vec::new(),
                cloudevents: self.cloudevents.clone(),
                content_type: None,
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
                debezium_nulls: true,
                additional: Vec::new(),
                cloudevents: self.cloudevents.clone(),
                content_type: None,
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
        n.additional = placements(&self.additional, n.id_header)?;
        n.content_type = content_type(self.content_type.as_deref())?;
        Ok(n)
    }
}

/// A media type as a header value: printable ASCII, no spaces at either end, not too long
/// (`type/subtype` plus parameters; RFC 6838 names are at most 127 + 1 + 127 characters).
fn content_type(v: Option<&str>) -> Result<Option<Arc<str>>, SettingError> {
    let Some(v) = v else { return Ok(None) };
    let ok = v.len() <= 255
        && v.trim() == v
        && v.bytes().all(|b| (0x20..0x7f).contains(&b))
        && v.split(';').next().is_some_and(|t| {
            let mut p = t.trim().splitn(2, '/');
            matches!((p.next(), p.next()), (Some(a), Some(b)) if !a.is_empty() && !b.is_empty())
        });
    if !ok {
        return Err(SettingError(format!(
            "source.columns.content_type {v:?} is not a media type: write type/subtype in \
             printable ASCII, e.g. \"application/vnd.apache.avro+binary\" or \
             \"application/x-protobuf\" (or leave it unset for no content-type header)"
        )));
    }
    Ok(Some(Arc::from(v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml: &str) -> Result<ColumnNames, String> {
        let c: Columns = toml::from_str(toml).map_err(|e| e.to_string())?;
        c.resolve().map_err(|e| e.0)
    }

    fn headers(n: &ColumnNames) -> Vec<(&str, &str)> {
        n.additional
            .iter()
            .map(|p| (p.column.as_str(), &*p.header))
            .collect()
    }

    #[test]
    fn content_type_is_a_media_type() {
        let n = parse("content_type = \"application/vnd.apache.avro+binary\"").unwrap();
        assert_eq!(
            n.content_type.as_deref(),
            Some("application/vnd.apache.avro+binary")
        );
        assert_eq!(parse("").unwrap().content_type, None);
        for bad in ["", "avro", " a/b", "a/", "/b", "a/b\\u00e9", "a/b\\n"] {
            let e = parse(&format!("content_type = \"{bad}\"")).unwrap_err();
            assert!(e.contains("not a media type"), "{bad}: {e}");
        }
        let ok = parse("content_type = \"application/json; charset=utf-8\"").unwrap();
        assert!(ok.content_type.is_some());
    }

    #[test]
    fn additional_takes_debeziums_string_or_a_list() {
        // Pasted from a connector config: one string, spaces and a trailing comma tolerated.
        let n = parse(
            "preset = \"debezium\"\nadditional = \"tenant_id:header, type:HEADER:eventType ,tenant_id:header:tenant,\"",
        )
        .unwrap();
        assert_eq!(
            headers(&n),
            [
                ("tenant_id", "tenant_id"),
                ("type", "eventType"),
                ("tenant_id", "tenant")
            ]
        );
        let n = parse("additional = [\"tenant_id:header\", \"type:header:eventType\"]").unwrap();
        assert_eq!(
            headers(&n),
            [("tenant_id", "tenant_id"), ("type", "eventType")]
        );
        assert!(parse("").unwrap().additional.is_empty());
        assert!(parse("additional = []").unwrap().additional.is_empty());
        assert!(parse("additional = 5").is_err());
    }

    #[test]
    fn additional_entries_are_checked() {
        let e = |t: &str| {
            let v = toml::Value::String(t.to_string());
            parse(&format!("additional = {v}")).unwrap_err()
        };
        assert!(
            e("tenant_id").contains("no placement"),
            "{}",
            e("tenant_id")
        );
        assert!(e("a:header,,b:header").contains("empty entry"));
        assert!(e("a:header:b:c").contains("too many parts"));
        assert!(e(":header").contains("column name"));
        assert!(e("a:headers").contains("unknown placement"));
        // Not supported, each with the reason.
        let env = e("tenant_id:envelope:tenant");
        assert!(env.contains("envelope placement is not supported"), "{env}");
        let part = e("shard:partition");
        assert!(
            part.contains("partition placement is not supported"),
            "{part}"
        );
        // Reserved names, in any letter case: the row's identity is outboxd's.
        for name in ["event_id", "Event_Type", "AGGREGATE_ID", "schema_version"] {
            let m = e(&format!("x:header:{name}"));
            assert!(m.contains("outboxd sets itself"), "{m}");
        }
        // `id` carries the event id with the Debezium preset; without it the name is free.
        let m = parse("preset = \"debezium\"\nadditional = \"x:header:ID\"").unwrap_err();
        assert!(m.contains("schema_version, id,"), "{m}");
        assert_eq!(
            headers(&parse("additional = \"x:header:id\"").unwrap()),
            [("x", "id")]
        );
        // Header names: bounded, no control characters, each once.
        assert!(e("x:header:a\u{1b}b").contains("control characters"));
        assert!(e(&format!("x:header:{}", "h".repeat(256))).contains("1 to 255 bytes"));
        assert!(e("a:header:t,b:header:T").contains("placed twice"));
        // The message names the entry and the syntax, never anything from the database.
        assert!(e("tenant_id").contains("column:header:name"));
    }
}
