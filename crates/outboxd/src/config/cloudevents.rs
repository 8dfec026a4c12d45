//! `[sink] format` and `[sink.cloudevents]` (issue 42): records as CloudEvents 1.0 per the
//! Kafka protocol binding, for consumers built on a CloudEvents SDK. The default format,
//! `outbox`, leaves every record exactly as before (the Debezium drop-in stays byte-identical).

use crate::model::cloudevents::{check_uri_reference, CloudEvents, Mode, Template, Var};
use crate::model::route::SettingError;
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// What a record looks like on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// outboxd's own records: the payload as the value, the event's fields as headers.
    #[default]
    Outbox,
    /// CloudEvents 1.0 (`[sink.cloudevents]`).
    Cloudevents,
}

/// `[sink.cloudevents]`: the content mode and the attribute templates. Every table uses them;
/// `{database}`, `{schema}` and `{table}` make them per table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudEventsConfig {
    #[serde(default)]
    pub mode: Mode,
    /// The `type` attribute; `{aggregate_type}`, `{event_type}`, `{database}`, `{schema}`,
    /// `{table}` are substituted.
    #[serde(default = "d_type", rename = "type")]
    pub type_: String,
    /// The `source` attribute, a URI-reference; `{database}`, `{schema}`, `{table}`.
    #[serde(default = "d_source")]
    pub source: String,
    /// The `dataschema` attribute of events whose JSON Schema is registered (a file
    /// `<schema_dir>/<event_type>/<schema_version>.json`); `{event_type}`, `{schema_version}`
    /// and the table's placeholders. Unset: `file://` + that schema file's path.
    #[serde(default)]
    pub dataschema: Option<String>,
}

fn d_type() -> String {
    "{event_type}".into()
}

fn d_source() -> String {
    "/outboxd/{database}/{schema}/{table}".into()
}

impl Default for CloudEventsConfig {
    fn default() -> Self {
        Self {
            mode: Mode::default(),
            type_: d_type(),
            source: d_source(),
            dataschema: None,
        }
    }
}

const TYPE_VARS: &[(&str, Var)] = &[
    ("aggregate_type", Var::AggregateType),
    ("event_type", Var::EventType),
];
const SCHEMA_VARS: &[(&str, Var)] = &[
    ("event_type", Var::EventType),
    ("schema_version", Var::SchemaVersion),
];

impl CloudEventsConfig {
    /// The settings of table `schema.table` in database `database`; `schema_dir` is the
    /// table's `[validation] schema_dir` (its files are the registered schemas).
    pub fn resolve(
        &self,
        database: &str,
        schema: &str,
        table: &str,
        schema_dir: Option<&std::path::Path>,
    ) -> Result<CloudEvents, SettingError> {
        let fixed = [("database", database), ("schema", schema), ("table", table)];
        let source = Template::parse("source", &self.source, &[], &fixed)?
            .render(|_| None)
            .unwrap_or_default();
        check_uri_reference("source", &source)?;
        let dir = schema_dir.map(|d| d.to_string_lossy().trim_end_matches('/').to_string());
        let dataschema = match (&self.dataschema, &dir) {
            (Some(t), _) => Some(Template::parse("dataschema", t, SCHEMA_VARS, &fixed)?),
            (None, Some(d)) => Some(Template(vec![
                crate::model::cloudevents::Part::Lit(format!("file://{d}/")),
                crate::model::cloudevents::Part::Var(Var::EventType),
                crate::model::cloudevents::Part::Lit("/".into()),
                crate::model::cloudevents::Part::Var(Var::SchemaVersion),
                crate::model::cloudevents::Part::Lit(".json".into()),
            ])),
            (None, None) => None,
        };
        Ok(CloudEvents {
            mode: self.mode,
            type_: Template::parse("type", &self.type_, TYPE_VARS, &fixed)?,
            source,
            dataschema,
            registered: schema_dir.map(registered).unwrap_or_default(),
        })
    }
}

/// The (event type, schema version) pairs with a schema file: `<dir>/<type>/<version>.json`.
/// An unreadable directory registers nothing (validation reports it on its own).
fn registered(dir: &std::path::Path) -> HashMap<String, HashSet<String>> {
    let mut out: HashMap<String, HashSet<String>> = HashMap::new();
    let Ok(types) = std::fs::read_dir(dir) else {
        return out;
    };
    for t in types.flatten() {
        let Ok(files) = std::fs::read_dir(t.path()) else {
            continue;
        };
        let ty = t.file_name().to_string_lossy().into_owned();
        for f in files.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if let Some(v) = name.strip_suffix(".json") {
                out.entry(ty.clone()).or_default().insert(v.to_string());
            }
        }
    }
    out
}

/// The database a DSN names, for `{database}` (libpq's default: the user's name).
pub fn database_of(dsn: &str) -> String {
    use std::str::FromStr;
    let Ok(c) = tokio_postgres::Config::from_str(dsn) else {
        return "postgres".into();
    };
    c.get_dbname()
        .or(c.get_user())
        .unwrap_or("postgres")
        .to_string()
}

/// What the router needs of table `schema.table` (`ce`: `[sink.cloudevents]` with the table's
/// overrides; `schema_dir`: its `[validation] schema_dir`): `None` with the default format.
pub fn for_table(
    cfg: &super::Config,
    schema: &str,
    table: &str,
    schema_dir: Option<&std::path::Path>,
    ce: &CloudEventsConfig,
) -> Result<Option<Arc<CloudEvents>>, SettingError> {
    if cfg.sink.format != Format::Cloudevents {
        return Ok(None);
    }
    let db = database_of(&cfg.source.dsn);
    ce.resolve(&db, schema, table, schema_dir)
        .map(|c| Some(Arc::new(c)))
}

/// `[source.tables.cloudevents]`: a table's own `type`, `source` or `dataschema` template; each
/// key set replaces `[sink.cloudevents]`'s for this table (the mode is the sink's: one format
/// per relay).
#[derive(Debug, Clone, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CloudEventsOverride {
    #[serde(default, rename = "type")]
    pub type_: Option<String>,
    #[serde(default)]
    pub source: Option<String>,
    #[serde(default)]
    pub dataschema: Option<String>,
}

impl CloudEventsOverride {
    /// `base` with the keys this override sets replaced.
    pub fn merged(&self, base: &CloudEventsConfig) -> CloudEventsConfig {
        CloudEventsConfig {
            mode: base.mode,
            type_: self.type_.clone().unwrap_or_else(|| base.type_.clone()),
            source: self.source.clone().unwrap_or_else(|| base.source.clone()),
            dataschema: self.dataschema.clone().or_else(|| base.dataschema.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_name_database_and_table() {
        let c = CloudEventsConfig::default()
            .resolve("app", "public", "outbox", None)
            .unwrap();
        assert_eq!(c.source, "/outboxd/app/public/outbox");
        assert_eq!(c.mode, Mode::Binary);
        assert!(c.dataschema.is_none());
    }

    #[test]
    fn bad_templates_are_refused_with_the_setting_named() {
        let c = CloudEventsConfig {
            type_: "com.acme.{aggregate}".into(),
            ..Default::default()
        };
        let e = c.resolve("app", "public", "outbox", None).unwrap_err();
        assert!(e.0.contains("sink.cloudevents.type"), "{e}");
        let c = CloudEventsConfig {
            source: "/my source".into(),
            ..Default::default()
        };
        let e = c.resolve("app", "public", "outbox", None).unwrap_err();
        assert!(e.0.contains("not a URI-reference"), "{e}");
    }

    #[test]
    fn database_from_either_dsn_form() {
        assert_eq!(database_of("postgres://u@h:5432/shop"), "shop");
        assert_eq!(database_of("host=/tmp dbname=app user=x"), "app");
        assert_eq!(database_of("host=/tmp user=x"), "x");
    }

    #[test]
    fn a_table_overrides_type_and_source_and_keeps_them_on_every_path() {
        use crate::config::Config;
        let text = r#"
[source]
dsn = "postgres://u@h/shop"
[sink]
format = "cloudevents"
[sink.cloudevents]
type = "com.acme.{event_type}"
[sink.kafka]
"bootstrap.servers" = "b:9092"
[[source.tables]]
name = "orders.outbox"
[source.tables.cloudevents]
type = "com.acme.orders.{event_type}"
source = "urn:acme:orders"
[[source.tables]]
name = "billing.outbox"
[[source.tables]]
pattern = "tenant_%.outbox"
[source.tables.cloudevents]
source = "/tenants/{schema}"
"#;
        let cfg = Config::from_toml_and_env(text, Vec::<(String, String)>::new()).unwrap();
        let ty = |c: &CloudEvents| {
            c.type_
                .render(|v| matches!(v, Var::EventType).then(|| "Placed".to_string()))
                .unwrap()
        };
        let of = |cfg: &Config, label: &str| {
            let t = cfg
                .tables()
                .into_iter()
                .find(|t| t.label() == label)
                .unwrap();
            t.columns.cloudevents.clone().expect("a CloudEvents table")
        };
        let orders = of(&cfg, "orders.outbox");
        assert_eq!(
            (ty(&orders).as_str(), orders.source.as_str()),
            ("com.acme.orders.Placed", "urn:acme:orders")
        );
        let billing = of(&cfg, "billing.outbox");
        assert_eq!(
            (ty(&billing).as_str(), billing.source.as_str()),
            ("com.acme.Placed", "/outboxd/shop/billing/outbox")
        );
        // A table a pattern matched gets the pattern's override; replay's one-table view keeps it.
        let found = cfg.with_discovered(&[("tenant_a".into(), "outbox".into(), 2)]);
        let tenant = of(&found, "tenant_a.outbox");
        assert_eq!(
            (ty(&tenant).as_str(), tenant.source.as_str()),
            ("com.acme.Placed", "/tenants/tenant_a")
        );
        let one = cfg.for_table("orders.outbox").unwrap();
        assert_eq!(of(&one, "orders.outbox").source, "urn:acme:orders");
        // A bad override is refused at startup, naming the table.
        let bad = text.replace("urn:acme:orders", "not a uri");
        let e = Config::from_toml_and_env(&bad, Vec::<(String, String)>::new()).unwrap_err();
        assert!(e.to_string().contains("orders.outbox"), "{e}");
        let bad = text.replace("source = \"urn:acme:orders\"", "mode = \"structured\"");
        let e = Config::from_toml_and_env(&bad, Vec::<(String, String)>::new()).unwrap_err();
        assert!(e.to_string().contains("mode"), "{e}");
    }
}
