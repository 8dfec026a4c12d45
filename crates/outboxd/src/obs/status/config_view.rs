//! The effective configuration as the status page shows it: built field by field (never the
//! `Debug` of `Config`), DSNs with their password replaced, every `[sink.kafka]` property
//! whose key names a secret replaced, secrets' presence shown as a flag, and the whole text
//! scrubbed by the configuration's `Redactor` at the end, so a secret that slipped into any
//! other value (a password pasted into a topic name) is replaced too.

use crate::config::secrets::{is_secret_key, redact_dsn, REDACTED};
use crate::config::Config;
use serde_json::{json, Map, Value};

/// The redacted view of `cfg`.
pub fn of(cfg: &Config) -> Value {
    let s = &cfg.source;
    let kafka: Map<String, Value> = cfg
        .sink
        .kafka
        .iter()
        .map(|(k, v)| {
            let shown = if is_secret_key(k) {
                REDACTED.to_string()
            } else {
                v.clone()
            };
            (k.clone(), Value::String(shown))
        })
        .collect();
    let view = json!({
        "source": {
            "dsn": redact_dsn(&s.dsn),
            "password": s.password.as_ref().map(|_| REDACTED),
            "replication_dsn": s.replication_dsn.as_deref().map(redact_dsn),
            "publication": s.publication,
            "slot": s.slot,
            "table": s.table,
            "tables": s.tables.len(),
            "relay_schema": s.relay_schema,
            "sslmode": s.sslmode.as_ref().map(|m| format!("{m:?}")),
            "on_slot_loss": format!("{:?}", s.on_slot_loss),
        },
        "sink": { "topic": cfg.sink.topic, "kafka": kafka },
        "relay": {
            "max_in_flight_events": cfg.relay.max_in_flight_events,
            "max_in_flight_bytes": cfg.relay.max_in_flight_bytes,
            "standby_poll_ms": cfg.relay.standby_poll_ms,
            "takeover_after_ms": cfg.relay.takeover_after_ms,
            "repair_interval_ms": cfg.relay.repair_interval_ms,
            "broker_fencing": cfg.relay.broker_fencing,
        },
        "heartbeat": {
            "interval_ms": cfg.heartbeat.interval_ms,
            "stall_timeout_ms": cfg.heartbeat.stall_timeout_ms,
        },
        "metrics": {
            "listen": cfg.metrics.listen,
            "status_token": cfg.metrics.status_token.as_ref().map(|_| REDACTED),
        },
        "parked": { "key": cfg.parked.key.as_ref().map(|_| REDACTED) },
        "shadow": { "enabled": cfg.shadow.enabled },
    });
    // Belt and braces: every known secret out of every value.
    let text = cfg.redactor.scrub(&view.to_string());
    serde_json::from_str(&text)
        .unwrap_or_else(|_| json!({ "error": "configuration view unavailable" }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_secret_is_shown() {
        let toml = r#"
[source]
dsn = "postgres://relay:Hunter2-db-pass@db:5432/app"
slot = "s1"
[sink]
topic = "t-Hunter2-db-pass"
[sink.kafka]
"bootstrap.servers" = "k:9092"
"sasl.password" = "kafka-secret-77"
[metrics]
listen = "127.0.0.1:9187"
status_token = "token-0123456789abcdef"
"#;
        let cfg = Config::from_toml_and_env(toml, Vec::<(String, String)>::new()).unwrap();
        let text = of(&cfg).to_string();
        for secret in [
            "Hunter2-db-pass",
            "kafka-secret-77",
            "token-0123456789abcdef",
        ] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(
            text.contains("k:9092") && text.contains("\"slot\":\"s1\""),
            "{text}"
        );
    }
}
