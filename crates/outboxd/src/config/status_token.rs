//! `[metrics] status_token`: the bearer token of the status page (`/`, `/status.json`), from
//! the file, `OUTBOXD_METRICS_STATUS_TOKEN` or `status_token_file` (a mounted secret). The
//! page shows the relay's configuration and parked events: on a listener reachable by more
//! than the operators, it is protected; `/metrics` and the probes never are (scrapers and
//! kubelets carry no token).

use crate::config::{ConfigError, MetricsConfig};

/// Fewest characters of a token: a short one is guessed by anyone who can reach the port.
pub const MIN_TOKEN_LEN: usize = 16;

/// The largest `status_token_file` read (issue 53): a token is a few dozen bytes; a path to
/// something that never ends (`/dev/zero`) or a huge file is an error, not a process that
/// fills its memory at start.
const MAX_TOKEN_FILE: u64 = 4096;

impl std::fmt::Debug for MetricsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsConfig")
            .field("listen", &self.listen)
            .field(
                "status_token",
                &self
                    .status_token
                    .as_ref()
                    .map(|_| crate::config::secrets::REDACTED),
            )
            .field("status_token_file", &self.status_token_file)
            .field("status_hosts", &self.status_hosts)
            .finish()
    }
}

/// `metrics.status_hosts`: a TOML list, or one string of names separated by commas or spaces
/// (`OUTBOXD_METRICS_STATUS_HOSTS`; environment overrides are strings).
pub fn hosts<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Either {
        S(String),
        L(Vec<String>),
    }
    let names = match <Either as serde::Deserialize>::deserialize(d)? {
        Either::S(s) => s
            .split(|c: char| c == ',' || c.is_whitespace())
            .map(str::to_string)
            .collect(),
        Either::L(l) => l,
    };
    Ok(names
        .into_iter()
        .map(|n| n.trim().trim_end_matches('.').to_string())
        .filter(|n| !n.is_empty())
        .collect())
}

/// Reads `status_token_file` into `status_token` (one trailing newline dropped) and checks the
/// token: both set, empty or short is a start-up error naming the fix.
pub fn load_file(m: &mut MetricsConfig) -> Result<(), ConfigError> {
    if let Some(path) = m.status_token_file.take() {
        if m.status_token.is_some() {
            return Err(ConfigError::Invalid(
                "metrics.status_token and metrics.status_token_file are both set: keep one".into(),
            ));
        }
        let text = crate::config::secrets::read_bounded(&path, MAX_TOKEN_FILE).map_err(|e| {
            ConfigError::Invalid(format!(
                "metrics.status_token_file = {path:?}: cannot read it: {e} (a token file holds \
                 one token, at most {MAX_TOKEN_FILE} bytes)"
            ))
        })?;
        let t = text.strip_suffix('\n').unwrap_or(&text);
        m.status_token = Some(t.strip_suffix('\r').unwrap_or(t).to_string());
    }
    if let Some(t) = &m.status_token {
        if t.trim().len() < MIN_TOKEN_LEN || t.chars().any(|c| c.is_whitespace()) {
            return Err(ConfigError::Invalid(format!(
                "metrics.status_token: use at least {MIN_TOKEN_LEN} characters without spaces \
                 (e.g. `openssl rand -hex 24`), or remove it to leave the status page open"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_checked_read_from_its_file_and_never_printed() {
        let mut m = MetricsConfig {
            status_token: Some("short".into()),
            ..Default::default()
        };
        assert!(load_file(&mut m).unwrap_err().to_string().contains("16"));
        let dir = std::env::temp_dir().join(format!("status-token-{}", std::process::id()));
        std::fs::write(&dir, "0123456789abcdef0123\n").unwrap();
        let mut m = MetricsConfig {
            status_token_file: Some(dir.clone()),
            ..Default::default()
        };
        load_file(&mut m).unwrap();
        assert_eq!(m.status_token.as_deref(), Some("0123456789abcdef0123"));
        assert!(!format!("{m:?}").contains("0123456789"));
        m.status_token_file = Some(dir.clone());
        assert!(load_file(&mut m)
            .unwrap_err()
            .to_string()
            .contains("keep one"));
        // Issue 53: read with a size limit, a clear error past it.
        std::fs::write(&dir, "a".repeat(4097)).unwrap();
        let mut big = MetricsConfig {
            status_token_file: Some(dir.clone()),
            ..Default::default()
        };
        let e = load_file(&mut big).unwrap_err().to_string();
        assert!(e.contains("larger than 4096 bytes"), "{e}");
        let mut endless = MetricsConfig {
            status_token_file: Some("/dev/zero".into()),
            ..Default::default()
        };
        let e = load_file(&mut endless).unwrap_err().to_string();
        assert!(e.contains("larger than 4096 bytes"), "{e}");
        let _ = std::fs::remove_file(dir);
    }

    #[test]
    fn the_token_comes_from_the_environment_and_is_redacted() {
        let toml = "[source]\ndsn = \"postgres://u@h/d\"\nslot = \"s\"\n\
                    [sink.kafka]\n\"bootstrap.servers\" = \"k:9092\"\n";
        let env = [(
            "OUTBOXD_METRICS_STATUS_TOKEN".to_string(),
            "env-token-0123456789".to_string(),
        )];
        let cfg = crate::config::Config::from_toml_and_env(toml, env).unwrap();
        assert_eq!(
            cfg.metrics.status_token.as_deref(),
            Some("env-token-0123456789")
        );
        assert!(!cfg
            .redactor
            .scrub("x env-token-0123456789")
            .contains("env-token"));
        assert!(!format!("{cfg:?}").contains("env-token"));
        let short = [(
            "OUTBOXD_METRICS_STATUS_TOKEN".to_string(),
            "abc".to_string(),
        )];
        let e = crate::config::Config::from_toml_and_env(toml, short).unwrap_err();
        assert!(e.to_string().contains("metrics.status_token"), "{e}");
    }
}
