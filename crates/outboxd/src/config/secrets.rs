//! Secret values of the configuration: which keys hold them, loading them from files, and
//! scrubbing them out of every text that leaves the process.
//!
//! librdkafka repeats offending configuration values in its errors and logs, TOML and serde
//! errors echo the values they could not read, and a derived `Debug` prints every field. So the
//! secrets are collected once, when the configuration is read (from the file, the environment
//! and `*.file` references), and a [`Redactor`] replaces each of them wherever text is built
//! from something outboxd does not control: librdkafka's errors and log lines, configuration
//! errors, the source DSN.

use crate::config::{Config, ConfigError, SinkConfig, SourceConfig};
use std::collections::BTreeMap;

use crate::config::secret_names::LIBRDKAFKA_PATHS;
pub use crate::config::secret_names::{is_secret_key, REDACTED};

/// Replaces the secrets it knows, and any PEM private key block, in a text.
#[derive(Clone, Default)]
pub struct Redactor {
    secrets: Vec<String>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Redactor({} secrets)", self.secrets.len())
    }
}

impl Redactor {
    /// Remembers `value` as a secret, with the forms it takes in the texts outboxd builds:
    /// percent-encoded (URLs), escaped as in `Debug` and as in JSON (the status page's view is
    /// scrubbed as JSON text). Very short values are kept too (a 3-character password is still
    /// a password); the empty string is not a secret.
    pub fn add(&mut self, value: &str) {
        let v = value.trim();
        if v.is_empty() {
            return;
        }
        let json = serde_json::to_string(v).unwrap_or_default();
        let json = json
            .strip_prefix('"')
            .and_then(|j| j.strip_suffix('"'))
            .unwrap_or(v);
        for form in [
            v.to_string(),
            crate::config::dsn::percent_encode(v),
            v.escape_debug().to_string(),
            json.to_string(),
        ] {
            if !self.secrets.contains(&form) {
                self.secrets.push(form);
            }
        }
        // Longest first, so a secret containing another is replaced whole.
        self.secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    }

    /// Every secret of a DSN, as written and as meant.
    pub fn add_dsn(&mut self, dsn: &str) {
        for s in crate::config::dsn::secret_texts(dsn) {
            self.add(&s);
        }
    }

    /// The secrets of a `[sink.kafka]` map and of a DSN.
    pub fn of(kafka: &BTreeMap<String, String>, dsn: &str, password: Option<&str>) -> Self {
        let mut r = Self::default();
        for (k, v) in kafka {
            if is_secret_key(k) {
                r.add(v);
            }
        }
        if let Some(p) = password {
            r.add(p);
        }
        r.add_dsn(dsn);
        r
    }

    pub fn scrub(&self, text: &str) -> String {
        let mut out = scrub_pem(text);
        for s in &self.secrets {
            if out.contains(s.as_str()) {
                out = out.replace(s.as_str(), REDACTED);
            }
        }
        out
    }
}

/// The secrets of a raw configuration table, before it is typed: so that the errors typing
/// produces (which echo values) can be scrubbed.
pub fn of_table(root: &toml::Table) -> Redactor {
    let text = |v: &toml::Value| match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut r = Redactor::default();
    let section = |name: &str| root.get(name).and_then(toml::Value::as_table);
    if let Some(kafka) = section("sink")
        .and_then(|s| s.get("kafka"))
        .and_then(|k| k.as_table())
    {
        for (k, v) in kafka {
            if is_secret_key(k) {
                r.add(&text(v));
            }
        }
    }
    if let Some(dsn) = section("cleanup").and_then(|c| c.get("dsn")).map(text) {
        r.add_dsn(&dsn);
    }
    if let Some(parked) = section("parked") {
        for key in ["key", "previous_key"] {
            if let Some(k) = parked.get(key) {
                r.add(&text(k));
            }
        }
    }
    if let Some(src) = section("source") {
        if let Some(p) = src.get("password") {
            r.add(&text(p));
        }
        for key in ["dsn", "replication_dsn"] {
            if let Some(dsn) = src.get(key).map(text) {
                r.add_dsn(&dsn);
            }
        }
    }
    r
}

/// A TOML syntax error without the offending line (which may hold a secret): where it is and
/// what is wrong.
pub fn toml_syntax(text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!(
                "TOML syntax error at line {line}, column {col}: {}",
                e.message()
            )
        }
        None => format!("TOML syntax error: {}", e.message()),
    }
}

/// Secrets may live in files (Kubernetes and Docker secrets, Vault agent): `[sink.kafka]`
/// `"<secret property>.file" = "/path"` sets the property to the file's content, and
/// `source.password_file` sets `source.password`. One trailing newline is dropped.
pub fn load_files(cfg: &mut Config) -> Result<(), ConfigError> {
    let read = |key: &str, path: &str| {
        read_bounded(path.as_ref(), MAX_SECRET_FILE)
            .map(|s| {
                s.strip_suffix('\n')
                    .map(|t| t.strip_suffix('\r').unwrap_or(t))
                    .unwrap_or(&s)
                    .to_string()
            })
            .map_err(|e| ConfigError::Invalid(format!("{key} = {path:?}: cannot read it: {e}")))
    };
    let files: Vec<(String, String)> = cfg
        .sink
        .kafka
        .iter()
        .filter(|(k, _)| k.ends_with(".file") && !LIBRDKAFKA_PATHS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (key, path) in files {
        let base = key.trim_end_matches(".file").to_string();
        let shown = format!("sink.kafka.\"{key}\"");
        if !is_secret_key(&base) {
            return Err(ConfigError::Invalid(format!(
                "{shown}: only secret properties (passwords, keys, client secrets) are read from \
                 files; set \"{base}\" itself"
            )));
        }
        if cfg.sink.kafka.contains_key(&base) {
            return Err(ConfigError::Invalid(format!(
                "{shown} and sink.kafka.\"{base}\" are both set: keep one"
            )));
        }
        let value = read(&shown, &path)?;
        cfg.sink.kafka.remove(&key);
        cfg.sink.kafka.insert(base, value);
    }
    if let Some(path) = cfg.source.password_file.take() {
        if cfg.source.password.is_some() {
            return Err(ConfigError::Invalid(
                "source.password and source.password_file are both set: keep one".into(),
            ));
        }
        cfg.source.password = Some(read("source.password_file", &path.to_string_lossy())?);
    }
    cfg.parked.load_files(read)?;
    Ok(())
}

/// The largest secret file read: a certificate chain with its key is a few KiB.
const MAX_SECRET_FILE: u64 = 1 << 20;

/// Reads a text file of at most `limit` bytes. A path naming something that never ends
/// (`/dev/zero`, `/dev/urandom`) or a file far too large is an error, not a process that fills
/// its memory.
pub(super) fn read_bounded(path: &std::path::Path, limit: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {limit} bytes"),
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// A DSN with its secrets replaced where they are written (URL or key=value form,
/// [`crate::config::dsn::redact`]).
pub fn redact_dsn(dsn: &str) -> String {
    crate::config::dsn::redact(dsn)
}

impl std::fmt::Debug for SourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceConfig")
            .field("dsn", &redact_dsn(&self.dsn))
            .field("password", &self.password.as_ref().map(|_| REDACTED))
            .field("password_file", &self.password_file)
            .field(
                "replication_dsn",
                &self.replication_dsn.as_deref().map(redact_dsn),
            )
            .field("publication", &self.publication)
            .field("slot", &self.slot)
            .field("table", &self.table)
            .field("tables", &self.tables)
            .field("create_slot", &self.create_slot)
            .field("status_interval_ms", &self.status_interval_ms)
            .field("columns", &self.columns)
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
            .field("sslcert", &self.sslcert)
            .field("sslkey", &self.sslkey)
            .field("on_slot_loss", &self.on_slot_loss)
            .field("recovery_window", &self.recovery_window)
            .field("slot_create_timeout", &self.slot_create_timeout)
            .field("state_interval_ms", &self.state_interval_ms)
            .finish()
    }
}

impl std::fmt::Debug for SinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kafka: BTreeMap<&str, &str> = self
            .kafka
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str(),
                    if is_secret_key(k) {
                        REDACTED
                    } else {
                        v.as_str()
                    },
                )
            })
            .collect();
        f.debug_struct("SinkConfig")
            .field("topic", &self.topic)
            .field("kafka", &kafka)
            .finish()
    }
}

/// Any `-----BEGIN … PRIVATE KEY-----` … `-----END … -----` block becomes [`REDACTED`].
fn scrub_pem(text: &str) -> String {
    const BEGIN: &str = "-----BEGIN ";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(BEGIN) {
        let head = &rest[i..];
        let header_end = head[BEGIN.len()..].find("-----").map(|e| e + BEGIN.len());
        let is_key = header_end.is_some_and(|e| head[..e].contains("PRIVATE KEY"));
        if !is_key {
            out.push_str(&rest[..i + BEGIN.len()]);
            rest = &rest[i + BEGIN.len()..];
            continue;
        }
        out.push_str(&rest[..i]);
        out.push_str(REDACTED);
        rest = match head.find("-----END ") {
            Some(e) => {
                let after = &head[e + "-----END ".len()..];
                match after.find("-----") {
                    Some(x) => &after[x + 5..],
                    None => "",
                }
            }
            None => "",
        };
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_keys() {
        for k in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "ssl.key.pem",
            "sasl.oauthbearer.config",
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "sasl.oauthbearer.assertion.private.key.pem",
            "sasl.oauthbearer.client.credentials.client.secret",
            "sslpassword",
        ] {
            assert!(is_secret_key(k), "{k}");
        }
        for k in [
            "sasl.oauthbearer.assertion.private.key.file",
            "bootstrap.servers",
            "sasl.username",
            "ssl.ca.location",
            "ssl.certificate.pem",
        ] {
            assert!(!is_secret_key(k), "{k}");
        }
    }

    #[test]
    fn scrubs_values_dsn_passwords_and_private_keys() {
        let mut kafka = BTreeMap::new();
        kafka.insert("sasl.password".to_string(), "hunter2-kafka".to_string());
        kafka.insert("sasl.username".to_string(), "relay".to_string());
        let r = Redactor::of(&kafka, "postgres://u:pg-secret@h/db", Some("override-pw"));
        let s = r.scrub(
            "Invalid value \"hunter2-kafka\" for relay; pg-secret; override-pw \
             -----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY----- end \
             -----BEGIN CERTIFICATE-----",
        );
        assert_eq!(
            s,
            "Invalid value \"[redacted]\" for relay; [redacted]; [redacted] [redacted] end \
             -----BEGIN CERTIFICATE-----"
        );
        assert_eq!(
            crate::config::dsn::secret_texts("host=h user=u password=kv-pw"),
            ["kv-pw", "kv-pw"]
        );
    }
}

#[cfg(test)]
mod path_tests {
    /// librdkafka reads `sasl.oauthbearer.assertion.private.key.file` itself: a path, kept as
    /// written (not outboxd's "secret from a file" form, which would set a property that does
    /// not exist), and shown.
    #[test]
    fn librdkafkas_own_file_properties_pass_verbatim() {
        let key = "sasl.oauthbearer.assertion.private.key.file";
        let toml = format!(
            "[source]\ndsn = \"postgres://u@h/db\"\n[sink.kafka]\n\"bootstrap.servers\" = \
             \"b:9092\"\n\"{key}\" = \"/run/secrets/assertion.pem\"\n"
        );
        let c = crate::Config::from_toml_and_env(&toml, Vec::<(String, String)>::new()).unwrap();
        assert_eq!(c.sink.kafka[key], "/run/secrets/assertion.pem");
        assert!(format!("{:?}", c.sink).contains("/run/secrets/assertion.pem"));
    }
}
