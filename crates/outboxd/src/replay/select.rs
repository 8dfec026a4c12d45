//! What a replay selects: exact `event_id`s, or a time range `[since, until)` of `created_at`
//! narrowed by event types, aggregate types and aggregate ids. The selection is stored as JSON
//! in the audit row (what was approved is what runs) and becomes the SQL filter of the table
//! reader; the dry run's [`Summary`] counts what it selects, per event type and topic.

use super::store::Policy;
use super::ReplayError;
use crate::config::Config;
use crate::model::columns::ColumnNames;
use crate::model::topic::TopicTemplate;
use crate::relay::route::is_uuid;
use crate::relay::source::quote_ident;
use crate::relay::table_reader::{self, Filter};
use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use tokio_postgres::Client;

/// The stored selection's key naming its outbox table (`schema.table`): written when the
/// configuration lists several tables, so `replay run` reads the table that was approved.
const TABLE_KEY: &str = "table";

/// `json` (a selection) with the table `cfg` reads, when `cfg` is one table of several
/// ([`Config::for_table`]); unchanged otherwise (one-table replays stay as they were).
pub fn with_table(mut json: Value, cfg: &Config) -> Value {
    if cfg.tags_records() {
        let (schema, table) = cfg.table_name();
        json[TABLE_KEY] = json!(format!("{schema}.{table}"));
    }
    json
}

/// The table a stored selection was recorded for, if any.
pub fn recorded_table(json: &Value) -> Option<&str> {
    json.get(TABLE_KEY).and_then(Value::as_str)
}

/// Refuses to run a stored replay on another table than the one it was recorded (and
/// approved) for, or one recorded without a table under a multi-table configuration.
pub fn check_table(json: &Value, cfg: &Config) -> Result<(), ReplayError> {
    let (schema, table) = cfg.table_name();
    let here = format!("{schema}.{table}");
    match recorded_table(json) {
        Some(t) if crate::config::tables::split(t) == (schema, table) => Ok(()),
        Some(t) => Err(ReplayError::Selection(format!(
            "this replay was recorded for outbox table {t}, not {here}: run it with \
             --table {t} (or a configuration that reads {t})"
        ))),
        None if cfg.tags_records() => Err(ReplayError::Selection(format!(
            "this replay was recorded without a table (by a one-table configuration) and this \
             configuration lists several: run it with the one-table configuration it was \
             recorded under, not {here}"
        ))),
        None => Ok(()),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// These events (deduplicated, in the order given).
    Ids(Vec<String>),
    /// Events created in `[since, until)`; an empty list does not narrow.
    Range {
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        event_types: Vec<String>,
        aggregate_types: Vec<String>,
        aggregate_ids: Vec<String>,
    },
}

/// `Xx…` → `xx…` with hyphens: Postgres's output of a uuid, so found ids compare as text.
fn canonical_uuid(s: &str) -> String {
    let s = s.to_ascii_lowercase();
    if s.len() == 32 {
        format!(
            "{}-{}-{}-{}-{}",
            &s[..8],
            &s[8..12],
            &s[12..16],
            &s[16..20],
            &s[20..]
        )
    } else {
        s
    }
}

impl Selection {
    /// Ids from arguments and file lines (blank lines and `#` comments skipped). Each must be a
    /// UUID: the relay never published an event whose `event_id` is not one. With a `uuid`
    /// column they are compared in Postgres's spelling.
    pub fn ids(raw: Vec<String>, uuid_column: bool) -> Result<Self, ReplayError> {
        let mut out: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut bad = Vec::new();
        for id in raw {
            let id = id.trim();
            if id.is_empty() || id.starts_with('#') {
                continue;
            }
            if !is_uuid(id) {
                bad.push(
                    id.chars()
                        .take(64)
                        .collect::<String>()
                        .escape_default()
                        .to_string(),
                );
                continue;
            }
            let id = if uuid_column {
                canonical_uuid(id)
            } else {
                id.to_string()
            };
            if seen.insert(id.clone()) {
                out.push(id);
            }
        }
        if !bad.is_empty() {
            return Err(ReplayError::Selection(format!(
                "not a UUID (outboxd publishes only events whose event_id is one): {}",
                bad.join(", ")
            )));
        }
        if out.is_empty() {
            return Err(ReplayError::Selection(
                "no event_id given (arguments or --ids-file)".into(),
            ));
        }
        Ok(Self::Ids(out))
    }

    pub fn to_json(&self) -> Value {
        match self {
            Self::Ids(ids) => json!({"by": "ids", "ids": ids}),
            Self::Range {
                since,
                until,
                event_types,
                aggregate_types,
                aggregate_ids,
            } => json!({
                "by": "range",
                "since": since.to_rfc3339(),
                "until": until.to_rfc3339(),
                "event_types": event_types,
                "aggregate_types": aggregate_types,
                "aggregate_ids": aggregate_ids,
            }),
        }
    }

    pub fn from_json(v: &Value) -> Result<Self, ReplayError> {
        let bad = || ReplayError::Selection(format!("unreadable selection in the audit row: {v}"));
        let list = |k: &str| -> Vec<String> {
            v.get(k)
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let time = |k: &str| -> Result<DateTime<Utc>, ReplayError> {
            v.get(k)
                .and_then(Value::as_str)
                .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
                .map(|t| t.with_timezone(&Utc))
                .ok_or_else(bad)
        };
        match v.get("by").and_then(Value::as_str) {
            Some("ids") => Ok(Self::Ids(list("ids"))),
            Some("range") => Ok(Self::Range {
                since: time("since")?,
                until: time("until")?,
                event_types: list("event_types"),
                aggregate_types: list("aggregate_types"),
                aggregate_ids: list("aggregate_ids"),
            }),
            _ => Err(bad()),
        }
    }

    /// One line for people (terminal-safe: names are escaped).
    pub fn describe(&self) -> String {
        let names = |l: &[String]| {
            l.iter()
                .map(|s| s.escape_default().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Self::Ids(ids) => format!("{} event_id(s)", ids.len()),
            Self::Range {
                since,
                until,
                event_types,
                aggregate_types,
                aggregate_ids,
            } => {
                let mut s = format!(
                    "created in [{}, {})",
                    since.to_rfc3339(),
                    until.to_rfc3339()
                );
                for (what, l) in [
                    ("event types", event_types),
                    ("aggregate types", aggregate_types),
                    ("aggregate ids", aggregate_ids),
                ] {
                    if !l.is_empty() {
                        s.push_str(&format!("; {what} {}", names(l)));
                    }
                }
                s
            }
        }
    }

    /// The SQL filter over the outbox table (alias `o`); `id_type` is the `event_id` column's
    /// type (the ids are cast to it, so its index serves the lookup).
    pub fn filter(&self, names: &ColumnNames, id_type: &str) -> Result<Filter, ReplayError> {
        let col = |n: &str| format!("o.{}", quote_ident(n));
        match self {
            // Without a created_at a row has no place in the replay order: not selected.
            Self::Ids(ids) => Ok(Filter {
                sql: format!(
                    "{} = ANY(CAST($1::text[] AS {id_type}[])) AND {} IS NOT NULL",
                    col(&names.event_id),
                    col(created_at(names)?)
                ),
                params: vec![Box::new(ids.clone())],
            }),
            Self::Range {
                since,
                until,
                event_types,
                aggregate_types,
                aggregate_ids,
            } => {
                let ts = col(created_at(names)?);
                let mut sql = format!("{ts} >= $1 AND {ts} < $2");
                let mut params: Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>> =
                    vec![Box::new(*since), Box::new(*until)];
                for (c, l) in [
                    (&names.event_type, event_types),
                    (&names.aggregate_type, aggregate_types),
                    (&names.aggregate_id, aggregate_ids),
                ] {
                    if !l.is_empty() {
                        params.push(Box::new(l.clone()));
                        sql.push_str(&format!(
                            " AND {}::text = ANY(${}::text[])",
                            col(c),
                            params.len()
                        ));
                    }
                }
                Ok(Filter { sql, params })
            }
        }
    }
}

/// The `created_at` column: a range selects by it.
pub fn created_at(names: &ColumnNames) -> Result<&str, ReplayError> {
    names.created_at.as_deref().ok_or_else(|| {
        ReplayError::Selection(
            "replay needs the outbox's created_at column (source.columns.created_at): a range \
             selects by it"
                .into(),
        )
    })
}

/// The `event_id` column's SQL type (`uuid` with the default table).
pub async fn event_id_type(cfg: &Config, sql: &Client) -> Result<String, ReplayError> {
    let names = cfg
        .source
        .columns
        .resolve()
        .map_err(crate::error::RelayError::from)?;
    let (rel, types) = table_reader::relation(cfg, sql).await?;
    rel.columns
        .iter()
        .position(|c| c.name == names.event_id)
        .map(|i| types[i].clone())
        .ok_or_else(|| {
            ReplayError::Selection(format!(
                "the outbox table has no event_id column {:?} (source.columns.event_id)",
                names.event_id
            ))
        })
}

/// What a selection holds now.
#[derive(Debug, Default)]
pub struct Summary {
    /// (event type, topic as the router names it, events), sorted.
    pub groups: Vec<(String, String, i64)>,
    pub total: i64,
    pub first: Option<DateTime<Utc>>,
    pub last: Option<DateTime<Utc>>,
    /// Ids of an id selection that are not in the table.
    pub not_found: Vec<String>,
    /// Selected event types the database's policy marks as having side effects
    /// (`replay.side_effect_types` of the admin's config, written by `outboxd init`).
    pub side_effects: Vec<String>,
    /// Selected event types outboxd does not deliver yet (`[shadow]`): refused.
    pub shadowed: Vec<String>,
}

impl Summary {
    /// `[[event_type, topic, count], …]`, as the audit row keeps it.
    pub fn groups_json(&self) -> Value {
        Value::Array(
            self.groups
                .iter()
                .map(|(t, topic, n)| json!([t, topic, n]))
                .collect(),
        )
    }

    /// Why a second person must approve it, by the database's policy; empty when it may run
    /// directly.
    pub fn approval_reasons(&self, policy: &Policy) -> Vec<String> {
        let mut why = Vec::new();
        // Ids not found count too, as the table's guard counts them: they may be written later.
        let missing = self.not_found.len() as u64;
        if self.total.max(0) as u64 + missing > policy.approval_over {
            why.push(format!(
                "{} events{}, over replay.approval_over = {} (the database's policy)",
                self.total,
                match missing {
                    0 => String::new(),
                    n => format!(" and {n} event_id(s) not found"),
                },
                policy.approval_over
            ));
        }
        for t in &self.side_effects {
            why.push(format!(
                "event type {} has side effects (replay.side_effect_types)",
                t.escape_default()
            ));
        }
        why
    }
}

/// Of these event types, the ones shadow mode keeps from real delivery (`shadow.enabled` and
/// not in `shadow.deliver_types`): the legacy path delivers them, so outboxd must not replay
/// them onto the real topics.
pub fn shadowed<'a>(cfg: &Config, types: impl Iterator<Item = &'a str>) -> Vec<String> {
    if !cfg.shadow.enabled {
        return Vec::new();
    }
    types
        .filter(|t| !cfg.shadow.deliver_types.iter().any(|d| d == t))
        .map(str::to_string)
        .collect()
}

/// Refuses a replay of types shadow mode does not deliver yet.
pub fn refuse_shadowed(shadowed: &[String]) -> Result<(), ReplayError> {
    if shadowed.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = shadowed
        .iter()
        .map(|t| t.escape_default().to_string())
        .collect();
    Err(ReplayError::Selection(format!(
        "event type(s) {} are in shadow mode (shadow.enabled, not in shadow.deliver_types): the \
         legacy path delivers them, not outboxd, so outboxd does not replay them; narrow the \
         selection (--event-type) or replay them through the legacy path",
        names.join(", ")
    )))
}

/// Counts what `sel` selects now: per event type and topic, the time span, missing ids, and
/// the types `policy` (the database's) marks as having side effects.
pub async fn summarize(
    cfg: &Config,
    sql: &Client,
    sel: &Selection,
    policy: &Policy,
) -> Result<Summary, ReplayError> {
    let names = cfg
        .source
        .columns
        .resolve()
        .map_err(crate::error::RelayError::from)?;
    let ts = quote_ident(created_at(&names)?);
    let filter = sel.filter(&names, &event_id_type(cfg, sql).await?)?;
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = filter
        .params
        .iter()
        .map(|p| p.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    let (schema, table) = cfg.table_name();
    let from = format!("{}.{} AS o", quote_ident(&schema), quote_ident(&table));
    let q = format!(
        "SELECT o.{}::text, o.{}::text, count(*), min(o.{ts}), max(o.{ts}) FROM {from} \
         WHERE {} GROUP BY 1, 2",
        quote_ident(&names.event_type),
        quote_ident(&names.aggregate_type),
        filter.sql
    );
    let template = TopicTemplate::parse(&cfg.sink.topic).map_err(crate::error::RelayError::from)?;
    let mut per: std::collections::BTreeMap<(String, String), i64> = Default::default();
    let mut s = Summary::default();
    let mut topic = String::new();
    for r in sql.query(&q, &params).await? {
        let event_type: Option<String> = r.get(0);
        let aggregate_type: Option<String> = r.get(1);
        let n: i64 = r.get(2);
        match (&event_type, &aggregate_type) {
            (Some(e), Some(a)) => template.render_for(a, e, &mut topic),
            // The live path parks such a row as unroutable; replay refuses it.
            _ => topic = "(unroutable: no event or aggregate type)".into(),
        }
        let event_type = event_type.unwrap_or_default();
        *per.entry((event_type, topic.clone())).or_default() += n;
        s.total += n;
        let (a, b): (Option<DateTime<Utc>>, Option<DateTime<Utc>>) = (r.get(3), r.get(4));
        if let Some(a) = a {
            s.first = Some(s.first.map_or(a, |f| f.min(a)));
        }
        if let Some(b) = b {
            s.last = Some(s.last.map_or(b, |l| l.max(b)));
        }
    }
    s.groups = per
        .into_iter()
        .map(|((t, topic), n)| (t, topic, n))
        .collect();
    let mut types: Vec<String> = s.groups.iter().map(|g| g.0.clone()).collect();
    types.dedup();
    s.side_effects = types
        .iter()
        .filter(|t| policy.has_side_effects(t))
        .cloned()
        .collect();
    s.shadowed = shadowed(cfg, types.iter().map(String::as_str));
    if let Selection::Ids(ids) = sel {
        let q = format!(
            "SELECT o.{}::text FROM {from} WHERE {}",
            quote_ident(&names.event_id),
            filter.sql
        );
        let found: std::collections::HashSet<String> = sql
            .query(&q, &params)
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        s.not_found = ids
            .iter()
            .filter(|i| !found.contains(*i))
            .cloned()
            .collect();
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_canonical_and_deduplicated() {
        let a = "0190A0B0-C0D0-7E0F-8000-000000000001";
        let sel = Selection::ids(
            vec![
                a.into(),
                " # a comment".into(),
                "".into(),
                "0190a0b0c0d07e0f8000000000000001".into(),
            ],
            true,
        )
        .unwrap();
        assert_eq!(
            sel,
            Selection::Ids(vec!["0190a0b0-c0d0-7e0f-8000-000000000001".into()])
        );
        let err = Selection::ids(vec!["nope\u{1b}[2J".into()], true).unwrap_err();
        assert!(err.to_string().contains("nope\\u{1b}[2J"), "{err}");
        assert!(Selection::ids(vec![], true).is_err());
    }

    #[test]
    fn a_selection_survives_the_audit_row() {
        let t = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        for sel in [
            Selection::Ids(vec!["0190a0b0-c0d0-7e0f-8000-000000000001".into()]),
            Selection::Range {
                since: t("2026-01-01T00:00:00.123456Z"),
                until: t("2026-01-02T00:00:00Z"),
                event_types: vec!["Paid".into()],
                aggregate_types: vec![],
                aggregate_ids: vec!["o-1".into(), "o-2".into()],
            },
        ] {
            assert_eq!(Selection::from_json(&sel.to_json()).unwrap(), sel);
        }
    }

    #[test]
    fn the_guards_spelling_of_a_range_is_read_back() {
        // The guard rewrites both ends as to_char(… AT TIME ZONE 'UTC',
        // 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'): always six fraction digits, Z.
        let v = json!({"by": "range", "since": "2026-01-01T00:00:00.000000Z",
                       "until": "2026-12-04T17:21:28.578351Z"});
        let Selection::Range { since, until, .. } = Selection::from_json(&v).unwrap() else {
            panic!("not a range")
        };
        assert_eq!(since.to_rfc3339(), "2026-01-01T00:00:00+00:00");
        assert_eq!(until.timestamp_subsec_micros(), 578_351);
    }

    #[test]
    fn approval_reasons_follow_the_policy() {
        let s = Summary {
            total: 5,
            side_effects: vec!["Paid".into()],
            ..Summary::default()
        };
        let strict = Policy {
            approval_over: 4,
            side_effect_types: vec!["Paid".into()],
        };
        let why = s.approval_reasons(&strict);
        assert_eq!(why.len(), 2, "{why:?}");
        assert!(why[0].contains("5 events, over replay.approval_over = 4"));
        let lax = Policy {
            approval_over: 5,
            side_effect_types: vec![],
        };
        let s = Summary {
            side_effects: vec![],
            ..s
        };
        assert!(s.approval_reasons(&lax).is_empty());
        let s = Summary {
            not_found: vec!["x".into()],
            ..s
        };
        assert_eq!(
            s.approval_reasons(&lax),
            ["5 events and 1 event_id(s) not found, over replay.approval_over = 5 (the database's \
              policy)"]
        );
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    fn cfg(source: &str) -> Config {
        Config::from_toml_and_env(
            &format!(
                "[sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n\
                 [source]\ndsn = \"postgres://u@h/db\"\n{source}"
            ),
            Vec::<(String, String)>::new(),
        )
        .unwrap()
    }

    #[test]
    fn a_stored_replay_runs_on_the_table_it_was_recorded_for() {
        let multi =
            cfg("[[source.tables]]\nname = \"a.outbox\"\n[[source.tables]]\nname = \"b.outbox\"\n");
        let a = multi.for_table("a.outbox").unwrap();
        assert!(a.tags_records());
        let stored = with_table(json!({"by": "ids", "ids": []}), &a);
        assert_eq!(recorded_table(&stored), Some("a.outbox"));
        check_table(&stored, &a).unwrap();
        let b = multi.for_table("b.outbox").unwrap();
        let e = check_table(&stored, &b).unwrap_err().to_string();
        assert!(e.contains("recorded for outbox table a.outbox"), "{e}");
        // Recorded by a one-table configuration: no table key, and not run as one of several.
        let one = cfg("table = \"a.outbox\"\n");
        let plain = with_table(json!({"by": "ids", "ids": []}), &one);
        assert_eq!(recorded_table(&plain), None);
        check_table(&plain, &one).unwrap();
        assert!(check_table(&plain, &a).is_err());
        assert!(multi.for_table("c.outbox").is_err());
    }
}
