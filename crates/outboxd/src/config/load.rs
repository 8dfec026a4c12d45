//! Reading a configuration: the file (bounded), `OUTBOXD_<SECTION>_<KEY>` overrides from the
//! environment, secret files, the redactor that scrubs every secret from what follows, then
//! validation.

use super::{invalid, secrets, Config, ConfigError};
use std::path::Path;

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            secrets::read_bounded(path, MAX_CONFIG_FILE).map_err(|err| ConfigError::Read {
                path: path.display().to_string(),
                err,
            })?;
        Self::from_toml_and_env(&text, std::env::vars())
    }

    /// Parses `text`, applies `OUTBOXD_*` overrides from `env`, validates.
    pub fn from_toml_and_env(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut root: toml::Table = text
            .parse()
            .map_err(|e| invalid(crate::config::secrets::toml_syntax(text, &e)))?;
        let mut ignored_env = Vec::new();
        let mut otel_env = Vec::new();
        for (k, v) in env {
            if k.starts_with("OTEL_") {
                otel_env.push((k.clone(), v.clone()));
            }
            if let Some(rest) = k.strip_prefix("OUTBOXD_") {
                if !apply_override(&mut root, rest, v)? {
                    ignored_env.push(k);
                }
            }
        }
        // Typing errors echo the values they could not read: scrub the secrets among them.
        let raw = crate::config::secrets::of_table(&root);
        let mut cfg: Config = toml::Value::Table(root)
            .try_into()
            .map_err(|e: toml::de::Error| invalid(raw.scrub(e.message())))?;
        crate::config::secrets::load_files(&mut cfg)?;
        crate::config::status_token::load_file(&mut cfg.metrics)?;
        cfg.ignored_env = ignored_env;
        cfg.telemetry.fill_from_env(&otel_env);
        cfg.redactor = crate::config::secrets::Redactor::of(
            &cfg.sink.kafka,
            &cfg.source.dsn,
            cfg.source.password.as_deref(),
        );
        for k in [
            &cfg.parked.key,
            &cfg.parked.previous_key,
            &cfg.metrics.status_token,
        ]
        .into_iter()
        .flatten()
        {
            cfg.redactor.add(k);
        }
        // Export headers carry the receiver's API key; the endpoint may carry user info.
        for v in cfg.telemetry.secret_texts() {
            cfg.redactor.add(&v);
        }
        for dsn in [
            cfg.cleanup.dsn.as_deref(),
            cfg.source.replication_dsn.as_deref(),
        ]
        .into_iter()
        .flatten()
        {
            cfg.redactor.add_dsn(dsn);
        }
        cfg.validate().map_err(|e| match e {
            ConfigError::Invalid(m) => invalid(cfg.redactor.scrub(&m)),
            other => other,
        })?;
        cfg.fold_single_table();
        Ok(cfg)
    }
}

/// The largest configuration file read (a real one is a few KiB): `--config /dev/zero` is an
/// error, not a process that fills its memory.
const MAX_CONFIG_FILE: u64 = 4 << 20;

/// `OUTBOXD_*` variables that are not config overrides (CLI, tests, demo, dev tooling).
const NOT_CONFIG: [&str; 7] = [
    "CONFIG",
    "REPAIR_DSN",
    "FAILPOINTS",
    "PG_BIN",
    "TANSU",
    "DEMO_DSN",
    "DEMO_BOOTSTRAP",
];

/// Applies one `OUTBOXD_<SECTION>_<KEY>` override. Returns false for a name that is not one
/// (no known section): not ours, ignored. A known section with an unknown key is a typo and
/// fails when the configuration is read.
fn apply_override(root: &mut toml::Table, key: &str, value: String) -> Result<bool, ConfigError> {
    if NOT_CONFIG.contains(&key) {
        return Ok(true);
    }
    let lower = key.to_ascii_lowercase();
    let Some((section, rest)) = lower.split_once('_') else {
        return Ok(false);
    };
    if !SECTIONS.contains(&section) || rest.is_empty() {
        return Ok(false);
    }
    let table = sub_table(root, section)?;
    let (table, leaf) = if section == "sink" && rest.starts_with("kafka_") {
        (
            sub_table(table, "kafka")?,
            rest["kafka_".len()..].replace('_', "."),
        )
    } else if section == "sink" && rest.starts_with("cloudevents_") {
        (
            sub_table(table, "cloudevents")?,
            rest["cloudevents_".len()..].to_string(),
        )
    } else if section == "source" && (rest == "tables" || rest.starts_with("tables_")) {
        return Err(invalid(format!(
            "OUTBOXD_{key}: source.tables (a list of tables) cannot be set from the environment; \
             list them in the config file ([[source.tables]])"
        )));
    } else if section == "source" && rest.starts_with("columns_") {
        (
            sub_table(table, "columns")?,
            rest["columns_".len()..].to_string(),
        )
    } else {
        (table, rest.to_string())
    };
    table.insert(leaf, toml::Value::String(value));
    Ok(true)
}

/// The sections `OUTBOXD_<SECTION>_<KEY>` may name.
const SECTIONS: [&str; 14] = [
    "source",
    "sink",
    "relay",
    "log",
    "metrics",
    "policy",
    "validation",
    "heartbeat",
    "alerts",
    "cleanup",
    "shadow",
    "replay",
    "telemetry",
    "parked",
];

fn sub_table<'a>(t: &'a mut toml::Table, name: &str) -> Result<&'a mut toml::Table, ConfigError> {
    t.entry(name.to_string())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .ok_or_else(|| invalid(format!("`{name}` must be a table")))
}
