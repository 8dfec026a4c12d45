//! Hostile secrets (issue 53, R54): every secret a configuration can hold, written encoded,
//! quoted and with unicode, each carrying a marker, through every view reachable in-process —
//! the status page's configuration (HTML and JSON), its last errors, `Debug` of the whole
//! configuration, configuration errors, the redactor over a driver's error and the OTLP
//! endpoint as logged. The marker, and its percent-encoded form, must appear nowhere.
//! (`outboxd check`, the relay's log lines: tests/tests/secrets.rs.)

use super::facts::{Facts, LastError};
use crate::config::dsn::percent_encode;
use crate::config::Config;

const MARK: &str = "Qx9HoStIlE";

/// The n-th secret: the marker among characters that need encoding, quoting or escaping.
fn secret(n: u32) -> String {
    format!("{MARK}{n}/é@'\"%&:?#= ü\\;")
}

/// Every byte `%XX`, letters included: the marker itself does not show as written.
fn all_encoded(s: &str) -> String {
    s.bytes().map(|b| format!("%{b:02X}")).collect()
}

/// A key=value DSN value, single-quoted with `\` escapes.
fn kv_quote(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// The hostile configuration as its file writes it, and every secret value in it.
fn hostile_toml() -> (String, Vec<String>) {
    let mut source = toml::Table::new();
    let url = format!(
        "postgres://relay:{}@db1:5432,db2:5433/app?password={}&application_name=page",
        percent_encode(&secret(1)),
        all_encoded(&secret(2)),
    );
    source.insert("dsn".into(), url.into());
    source.insert(
        "replication_dsn".into(),
        format!(
            "host=standby user=relay password={} dbname=app",
            kv_quote(&secret(3))
        )
        .into(),
    );
    source.insert("password".into(), secret(4).into());
    let mut kafka = toml::Table::new();
    kafka.insert("bootstrap.servers".into(), "k:9092".into());
    for (i, key) in [
        "sasl.password",
        "ssl.key.password",
        "ssl.keystore.password",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "sasl.oauthbearer.assertion.private.key.pem",
    ]
    .iter()
    .enumerate()
    {
        kafka.insert((*key).into(), secret(10 + i as u32).into());
    }
    let mut sink = toml::Table::new();
    sink.insert("kafka".into(), kafka.into());
    let mut cleanup = toml::Table::new();
    cleanup.insert(
        "dsn".into(),
        format!(
            "postgresql://cleaner@db1/app?password={}",
            percent_encode(&secret(5))
        )
        .into(),
    );
    let mut telemetry = toml::Table::new();
    telemetry.insert(
        "endpoint".into(),
        format!("https://otel:{}@collector:4318", percent_encode(&secret(6))).into(),
    );
    telemetry.insert(
        "headers".into(),
        format!(
            "x-api-key={},x-other={}",
            percent_encode(&secret(7)),
            all_encoded(&secret(8))
        )
        .into(),
    );
    let mut metrics = toml::Table::new();
    metrics.insert("listen".into(), "127.0.0.1:0".into());
    let token = format!("{MARK}-token-é'\"%");
    metrics.insert("status_token".into(), token.clone().into());
    let mut parked = toml::Table::new();
    let parked_key = format!("{}-integrity-key-0123456789", secret(9));
    parked.insert("key".into(), parked_key.clone().into());
    let mut root = toml::Table::new();
    for (k, v) in [
        ("source", source),
        ("sink", sink),
        ("cleanup", cleanup),
        ("telemetry", telemetry),
        ("metrics", metrics),
        ("parked", parked),
    ] {
        root.insert(k.into(), v.into());
    }
    let mut values: Vec<String> = (1..=15).filter(|n| *n != 9).map(secret).collect();
    values.push(parked_key);
    values.push(token);
    (toml::to_string(&root).unwrap(), values)
}

fn hostile_config() -> Config {
    Config::from_toml_and_env(&hostile_toml().0, Vec::<(String, String)>::new())
        .unwrap_or_else(|e| panic!("the hostile configuration is valid: {e}"))
}

#[track_caller]
fn assert_clean(what: &str, text: &str) {
    for form in [MARK.to_string(), all_encoded(MARK)] {
        assert!(
            !text.contains(&form),
            "{what} shows a secret ({form}):\n{text}"
        );
    }
}

#[test]
fn no_view_shows_an_encoded_quoted_or_unicode_secret() {
    let cfg = hostile_config();
    let config = super::config_view::of(&cfg);
    assert!(config.get("error").is_none(), "the view is built: {config}");
    assert_eq!(
        config["source"]["dsn"],
        "postgres://relay:[redacted]@db1:5432,db2:5433/app?password=[redacted]&application_name=page"
    );
    assert_eq!(
        config["source"]["replication_dsn"],
        "host=standby user=relay password=[redacted] dbname=app"
    );
    assert_clean("the configuration view", &config.to_string());

    // A driver's or librdkafka's error quoting secrets as meant, percent-encoded and escaped.
    let (_, values) = hostile_toml();
    let leak = |s: &str| {
        format!(
            "{s} {} {:?} {} | ",
            percent_encode(s),
            s,
            serde_json::to_string(s).unwrap()
        )
    };
    let leaked: String = values.iter().map(|s| leak(s)).collect();
    assert_clean("a scrubbed error", &cfg.redactor.scrub(&leaked));
    // No secret of the configuration: shown as is (the check can fail).
    let other = format!("{MARK}-not-configured");
    assert!(cfg.redactor.scrub(&leak(&other)).contains(&other));
    // The DSN secrets as written, whatever their encoding.
    let raw = format!(
        "{} {} {} {}",
        cfg.source.dsn,
        all_encoded(&secret(2)),
        cfg.telemetry.endpoint.as_deref().unwrap(),
        cfg.telemetry.headers.as_deref().unwrap()
    );
    assert_clean("a scrubbed DSN", &cfg.redactor.scrub(&raw));

    let facts = Facts {
        config,
        errors: super::facts::Errors {
            last: vec![LastError {
                message: cfg.redactor.scrub(&leaked),
                ..Default::default()
            }],
            ..Default::default()
        },
        ..Default::default()
    };
    assert_clean("/status.json", &serde_json::to_string(&facts).unwrap());
    assert_clean("the status page", &super::html::page(&facts));

    assert_clean("Config Debug", &format!("{cfg:?}"));
    assert_clean("Config Debug (pretty)", &format!("{cfg:#?}"));
    assert_clean("TelemetryConfig Debug", &format!("{:?}", cfg.telemetry));
    assert_clean("CleanupConfig Debug", &format!("{:?}", cfg.cleanup));
    assert_clean(
        "the OTLP endpoint as logged",
        &cfg.telemetry.shown_endpoint(),
    );
    assert_eq!(cfg.telemetry.shown_endpoint(), "https://collector:4318");
}

#[test]
fn configuration_errors_never_show_a_hostile_secret() {
    // A type error on every secret-bearing key echoes the value it could not read.
    let (good, _) = hostile_toml();
    for key in [
        "password",
        "status_token",
        "key",
        "dsn",
        "headers",
        "sasl.password",
    ] {
        let bad = good
            .lines()
            .map(|l| {
                if l.starts_with(&format!("{key} = ")) || l.starts_with(&format!("\"{key}\" = ")) {
                    let (k, v) = l.split_once(" = ").unwrap();
                    format!("{k} = [{v}]")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        assert_ne!(bad, good, "{key}");
        let e = Config::from_toml_and_env(&bad, Vec::<(String, String)>::new())
            .map(|_| format!("{key} accepted an array"))
            .unwrap_or_else(|e| e.to_string());
        assert_clean(&format!("the error of a bad {key}"), &e);
    }
    // A TOML syntax error on a secret's line (a control character no TOML string may hold).
    let broken = good.replacen(&format!("{MARK}1"), &format!("{MARK}1\u{1}"), 1);
    let e = Config::from_toml_and_env(&broken, Vec::<(String, String)>::new()).unwrap_err();
    assert_clean("a TOML syntax error", &e.to_string());
}
