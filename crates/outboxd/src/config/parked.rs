//! `[parked]`: the relay's integrity key for what it parks and holds, and the bounds of that
//! store (issue 40, R47).
//!
//! Every parked or held row the relay writes carries an HMAC-SHA256 tag under this key
//! (`poison::integrity`), checked before the row is released: a row written or altered
//! through the database alone, by any role that lacks the key, is refused. The key is the
//! relay's secret, never the database's: `key` (usually from `OUTBOXD_PARKED_KEY`) or
//! `key_file` (a mounted secret), like `source.password`/`password_file`. `previous_key`
//! (or `previous_key_file`) is accepted for verification only, so a key rotates without
//! refusing what the old key sealed.

use serde::Deserialize;

/// The shortest key accepted: an HMAC key should carry at least the hash's 256 bits; 32
/// characters of a random string (`openssl rand -base64 32` gives 44) are enough.
pub const MIN_KEY_LEN: usize = 32;

/// `Debug` (below) hides the keys.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParkedConfig {
    /// The integrity key (a secret; prefer `OUTBOXD_PARKED_KEY` or `key_file`).
    #[serde(default)]
    pub key: Option<String>,
    /// A file holding the key; read at start-up (one trailing newline dropped).
    #[serde(default)]
    pub key_file: Option<std::path::PathBuf>,
    /// The key before a rotation: rows it sealed still verify; new rows get `key`'s tag.
    #[serde(default)]
    pub previous_key: Option<String>,
    #[serde(default)]
    pub previous_key_file: Option<std::path::PathBuf>,
    /// With a key: also release rows that carry no tag (parked before the key was configured),
    /// by today's checks (the outbox row vouches for a held event, the operator's audit row
    /// for a retry). Off by default: with a key, an untagged row is one the relay did not write.
    #[serde(default, deserialize_with = "super::lenient")]
    pub accept_untagged: bool,
    /// The largest record (key + value + headers) the relay parks or holds; a larger poison
    /// event halts the relay (the slot keeps it) instead of filling the database.
    #[serde(default = "d_max_record", deserialize_with = "super::lenient")]
    pub max_record_bytes: u64,
    /// The most the open (parked, held, retrying) records of this slot may hold in all; past
    /// it the relay halts at the next event it would park or hold, until some are resolved.
    #[serde(default = "d_max_open", deserialize_with = "super::lenient")]
    pub max_open_bytes: u64,
}

impl Default for ParkedConfig {
    fn default() -> Self {
        Self {
            key: None,
            key_file: None,
            previous_key: None,
            previous_key_file: None,
            accept_untagged: false,
            max_record_bytes: d_max_record(),
            max_open_bytes: d_max_open(),
        }
    }
}

fn d_max_record() -> u64 {
    16 << 20
}

fn d_max_open() -> u64 {
    1 << 30
}

impl std::fmt::Debug for ParkedConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |k: &Option<String>| k.as_ref().map(|_| super::secrets::REDACTED);
        f.debug_struct("ParkedConfig")
            .field("key", &hidden(&self.key))
            .field("key_file", &self.key_file)
            .field("previous_key", &hidden(&self.previous_key))
            .field("previous_key_file", &self.previous_key_file)
            .field("accept_untagged", &self.accept_untagged)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("max_open_bytes", &self.max_open_bytes)
            .finish()
    }
}

impl ParkedConfig {
    /// Reads `key_file`/`previous_key_file` into the keys (called with the other secret files).
    pub(super) fn load_files(
        &mut self,
        read: impl Fn(&str, &str) -> Result<String, super::ConfigError>,
    ) -> Result<(), super::ConfigError> {
        for (key, file, name) in [
            (&mut self.key, self.key_file.take(), "parked.key"),
            (
                &mut self.previous_key,
                self.previous_key_file.take(),
                "parked.previous_key",
            ),
        ] {
            let Some(path) = file else { continue };
            if key.is_some() {
                return Err(super::ConfigError::Invalid(format!(
                    "{name} and {name}_file are both set: keep one"
                )));
            }
            *key = Some(read(&format!("{name}_file"), &path.to_string_lossy())?);
        }
        Ok(())
    }

    /// Keys too short to be a secret are refused with the fix.
    pub(super) fn validate(&self) -> Result<(), String> {
        for (name, k) in [("key", &self.key), ("previous_key", &self.previous_key)] {
            if k.as_deref().is_some_and(|k| k.trim().len() < MIN_KEY_LEN) {
                return Err(format!(
                    "parked.{name} is shorter than {MIN_KEY_LEN} characters: use a random \
                     secret, e.g. `openssl rand -base64 32` into the file parked.{name}_file names"
                ));
            }
        }
        if self.previous_key.is_some() && self.key.is_none() {
            return Err(
                "parked.previous_key is set without parked.key: a rotation keeps the \
                        old key as previous_key and sets the new one as key"
                    .into(),
            );
        }
        if self.max_record_bytes == 0 || self.max_open_bytes < self.max_record_bytes {
            return Err(format!(
                "parked.max_open_bytes ({}) must be at least parked.max_record_bytes ({}), \
                 and both above 0",
                self.max_open_bytes, self.max_record_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    const BASE: &str =
        "[source]\ndsn = \"postgres://u@h/db\"\n[sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n";
    const KEY: &str = "a-test-key-of-more-than-32-characters-x";

    fn load(env: &[(&str, &str)]) -> Result<Config, String> {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        Config::from_toml_and_env(BASE, env).map_err(|e| e.to_string())
    }

    #[test]
    fn the_key_comes_from_the_environment_or_a_file_and_never_shows() {
        let c = load(&[("OUTBOXD_PARKED_KEY", KEY)]).unwrap();
        assert_eq!(c.parked.key.as_deref(), Some(KEY));
        assert!(!format!("{c:?}").contains(KEY));
        assert!(c
            .redactor
            .scrub(&format!("x {KEY} y"))
            .contains("[redacted]"));
        let file = std::env::temp_dir().join(format!("outboxd-parked-key-{}", std::process::id()));
        std::fs::write(&file, format!("{KEY}\n")).unwrap();
        let path = file.to_string_lossy().into_owned();
        let c = load(&[("OUTBOXD_PARKED_KEY_FILE", &path)]).unwrap();
        assert_eq!(c.parked.key.as_deref(), Some(KEY), "one newline dropped");
        let e = load(&[("OUTBOXD_PARKED_KEY", "tiny-k3y")]).unwrap_err();
        assert!(
            e.contains("shorter than 32") && !e.contains("short\""),
            "{e}"
        );
        let e = load(&[("OUTBOXD_PARKED_PREVIOUS_KEY", KEY)]).unwrap_err();
        assert!(e.contains("without parked.key"), "{e}");
        let e = load(&[
            ("OUTBOXD_PARKED_KEY", KEY),
            ("OUTBOXD_PARKED_KEY_FILE", &path),
        ])
        .unwrap_err();
        assert!(e.contains("both set"), "{e}");
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn check_warns_without_a_key_and_during_a_rotation() {
        let line = |env: &[(&str, &str)]| crate::cmd::parked::integrity_line(&load(env).unwrap());
        let none = line(&[]);
        assert!(
            none.warn && none.detail.contains("OUTBOXD_PARKED_KEY"),
            "{none:?}"
        );
        let ok = line(&[("OUTBOXD_PARKED_KEY", KEY)]);
        assert!(ok.ok && !ok.warn, "{ok:?}");
        let rotating = line(&[
            ("OUTBOXD_PARKED_KEY", KEY),
            (
                "OUTBOXD_PARKED_PREVIOUS_KEY",
                "an-older-key-of-more-than-32-characters",
            ),
        ]);
        assert!(
            rotating.warn && rotating.detail.contains("previous_key"),
            "{rotating:?}"
        );
    }
}
