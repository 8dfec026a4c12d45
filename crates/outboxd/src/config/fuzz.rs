//! Fuzz harness of the configuration loader (issue 15): any TOML text and any `OUTBOXD_*`
//! environment give a configuration or an error naming the problem — never a panic or a hang.
//!
//! Texts are built from the real schema (every section and key, values of every TOML type and
//! of hostile size, files that never end) and then possibly cut or corrupted at any byte, so
//! both the typing and the syntax-error paths are reached. Proptest's default of 256 cases per
//! property suits CI; `PROPTEST_CASES=100000` runs long (docs/development.md, "Fuzzing").

use super::Config;
use proptest::prelude::*;

/// `(section, key)` of every setting (`sink.kafka` keys are librdkafka's: a sample).
const KEYS: &[(&str, &str)] = &[
    ("source", "dsn"),
    ("source", "password"),
    ("source", "password_file"),
    ("source", "publication"),
    ("source", "slot"),
    ("source", "table"),
    ("source", "tables"),
    ("source", "create_slot"),
    ("source", "status_interval_ms"),
    ("source", "sslmode"),
    ("source", "sslrootcert"),
    ("source", "sslcert"),
    ("source", "sslkey"),
    ("source", "on_slot_loss"),
    ("source", "recovery_window"),
    ("source", "slot_create_timeout"),
    ("source", "state_interval_ms"),
    ("source.columns", "preset"),
    ("source.columns", "event_id"),
    ("source.columns", "headers"),
    ("source.columns", "payload"),
    ("source.columns", "additional"),
    ("sink", "topic"),
    ("sink.kafka", "\"bootstrap.servers\""),
    ("sink.kafka", "acks"),
    ("sink.kafka", "\"enable.idempotence\""),
    ("sink.kafka", "\"sasl.password\""),
    ("sink.kafka", "\"sasl.password.file\""),
    ("sink.kafka", "\"ssl.key.pem.file\""),
    ("sink.kafka", "\"compression.type.file\""),
    ("sink.kafka", "\"sasl.mechanism\""),
    ("sink.kafka", "\"sasl.oauthbearer.method\""),
    ("sink.kafka", "\"sasl.oauthbearer.token.endpoint.url\""),
    ("sink.kafka", "\"sasl.oauthbearer.client.id\""),
    ("sink.kafka", "\"sasl.oauthbearer.extensions\""),
    ("relay", "max_in_flight_events"),
    ("relay", "max_in_flight_bytes"),
    ("relay", "shutdown_timeout_ms"),
    ("relay", "max_backoff_ms"),
    ("relay", "standby_poll_ms"),
    ("relay", "takeover_after_ms"),
    ("relay", "repair_interval_ms"),
    ("relay", "read_linger_ms"),
    ("relay", "batch_window_ms"),
    ("relay", "broker_fencing"),
    ("log", "format"),
    ("metrics", "listen"),
    ("policy", "ordering"),
    ("policy", "on_poison"),
    ("policy.event_types.Paid", "on_poison"),
    ("validation", "schema_dir"),
    ("heartbeat", "interval_ms"),
    ("heartbeat", "stall_timeout_ms"),
    ("alerts", "slot_lag_bytes"),
    ("alerts", "heartbeat_stale_seconds"),
    ("alerts.delivery_budget_seconds", "default"),
    ("replay", "side_effect_types"),
    ("replay", "approval_over"),
    ("replay", "rate"),
    ("nope", "x"),
];

/// A TOML value literal of any type, including hostile numbers (as TOML integers and as the
/// strings environment overrides are) and the paths of files that never end or cannot be read.
fn literal() -> impl Strategy<Value = String> {
    let string = |s: String| toml::Value::String(s).to_string();
    let number = prop_oneof![
        any::<u64>(),
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(i64::MAX as u64),
        Just(0),
        Just(1),
        0u64..100_000,
    ];
    prop_oneof![
        3 => ".{0,24}".prop_map(string),
        2 => prop_oneof![
            Just("postgres://u:p@127.0.0.1:5432/app".to_string()),
            Just("host=/run/postgresql".to_string()),
            Just("127.0.0.1:9092".to_string()),
            Just("0.0.0.0:9187".to_string()),
            Just("debezium".to_string()),
            Just("halt".to_string()),
            Just("oidc".to_string()),
            Just("OAUTHBEARER".to_string()),
            Just("verify-full".to_string()),
            Just("10m".to_string()),
            Just("/dev/zero".to_string()),
            Just("/dev/urandom".to_string()),
            Just("/".to_string()),
            Just("/nonexistent/secret".to_string()),
            Just("tenant_id:header,type:header:eventType".to_string()),
            Just("x:partition".to_string()),
        ]
        .prop_map(string),
        // Within i64: a TOML integer; any u64 as a string (what `lenient` reads).
        4 => number.prop_map(|n| match n <= i64::MAX as u64 && n % 2 == 0 {
            true => n.to_string(),
            false => format!("\"{n}\""),
        }),
        1 => prop_oneof![Just(i64::MIN), Just(-1), any::<i64>()].prop_map(|n| n.to_string()),
        1 => any::<f64>().prop_map(|f| toml::Value::Float(f).to_string()),
        1 => any::<bool>().prop_map(|b| b.to_string()),
        1 => proptest::collection::vec(".{0,4}", 0..4).prop_map(|v| format!("{v:?}")),
        1 => Just("{ a = 1, b = \"x\" }".to_string()),
        1 => prop_oneof![
            Just("[{ name = \"a.outbox\" }, { name = \"b.outbox\", topic = \"b.{event_type}\" }]"),
            Just("[{ name = \"a.outbox\", columns = { preset = \"debezium\" } }, { name = \"a.outbox\" }]"),
            Just("[{ name = \"x\", nope = 1 }]"),
            Just("[]"),
        ]
        .prop_map(str::to_string),
        1 => Just("1979-05-27T07:32:00Z".to_string()),
    ]
}

/// A configuration text: mostly a valid base with settings of the schema (any values, each
/// table once, as TOML wants), sometimes with a raw junk line.
fn toml_text() -> impl Strategy<Value = String> {
    let settings = proptest::collection::vec((proptest::sample::select(KEYS), literal()), 0..8);
    let junk = proptest::option::weighted(0.1, ".{0,40}");
    (proptest::bool::weighted(0.9), settings, junk).prop_map(|(base, settings, junk)| {
        let mut tables: std::collections::BTreeMap<&str, std::collections::BTreeMap<&str, String>> =
            Default::default();
        if base {
            let source = tables.entry("source").or_default();
            source.insert("dsn", "\"postgres://u@127.0.0.1:5432/app\"".into());
            let kafka = tables.entry("sink.kafka").or_default();
            kafka.insert("\"bootstrap.servers\"", "\"127.0.0.1:9092\"".into());
        }
        for ((section, key), v) in settings {
            tables.entry(section).or_default().insert(key, v);
        }
        let mut t = String::new();
        for (section, keys) in tables {
            t.push_str(&format!("[{section}]\n"));
            for (k, v) in keys {
                t.push_str(&format!("{k} = {v}\n"));
            }
        }
        if let Some(j) = junk {
            t.push_str(&j);
        }
        t
    })
}

/// A text cut or corrupted at any byte (inside a multi-byte character too).
fn corrupted() -> impl Strategy<Value = String> {
    (toml_text(), any::<usize>(), ".{0,3}", any::<bool>()).prop_map(|(t, i, junk, cut)| {
        let mut b = t.into_bytes();
        let at = i % (b.len() + 1);
        if cut {
            b.truncate(at);
        }
        b.splice(at..at, junk.into_bytes());
        String::from_utf8_lossy(&b).into_owned()
    })
}

/// `OUTBOXD_*` variables naming real settings, near misses, and strangers.
fn env() -> impl Strategy<Value = Vec<(String, String)>> {
    let name = prop_oneof![
        4 => proptest::sample::select(KEYS).prop_map(|(section, key)| {
            let s = section.replace('.', "_").to_ascii_uppercase();
            let k = key.trim_matches('"').replace('.', "_").to_ascii_uppercase();
            format!("OUTBOXD_{s}_{k}")
        }),
        1 => "OUTBOXD_[A-Z_]{0,24}",
        1 => "[A-Za-z_]{0,12}",
        1 => Just("OUTBOXD_SOURCE_".to_string()),
        1 => Just("OUTBOXD_SINK_KAFKA_".to_string()),
        1 => Just("OUTBOXD_SOURCE_COLUMNS_".to_string()),
    ];
    let value = prop_oneof![
        3 => ".{0,24}",
        2 => any::<u64>().prop_map(|n| n.to_string()),
        1 => Just(u64::MAX.to_string()),
        1 => Just("true".to_string()),
    ];
    proptest::collection::vec((name, value), 0..4)
}

/// The harness reaches past parsing: a fair share of what it generates loads, so the checks
/// of a parsed configuration (`validate`) are fuzzed too, not only the syntax errors.
#[test]
fn the_generator_reaches_validation() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = (toml_text(), env());
    let ok = (0..400)
        .filter(|_| {
            let (text, env) = strategy.new_tree(&mut runner).unwrap().current();
            Config::from_toml_and_env(&text, env).is_ok()
        })
        .count();
    assert!(ok >= 20, "only {ok} of 400 generated configurations load");
}

proptest! {
    #[test]
    fn any_text_and_env_load_or_fail(text in toml_text(), env in env()) {
        if let Ok(cfg) = Config::from_toml_and_env(&text, env) {
            // What loads can run: every deadline the relay computes from it fits an Instant.
            let now = std::time::Instant::now();
            for ms in [
                cfg.source.status_interval_ms,
                cfg.source.state_interval_ms,
                cfg.relay.shutdown_timeout_ms,
                cfg.relay.max_backoff_ms,
                cfg.relay.standby_poll_ms,
                cfg.relay.takeover_after_ms,
                cfg.relay.repair_interval_ms,
                cfg.relay.read_linger_ms.unwrap_or(0),
                cfg.relay.batch_window_ms,
                cfg.heartbeat.interval_ms,
                cfg.heartbeat.stall_timeout_ms,
            ] {
                let twice = std::time::Duration::from_millis(ms) * 2;
                prop_assert!(now.checked_add(twice).is_some(), "{}", ms);
            }
        }
    }

    #[test]
    fn corrupted_text_loads_or_fails(text in corrupted()) {
        let _ = Config::from_toml_and_env(&text, Vec::<(String, String)>::new());
    }
}

const BASE: &str = "[source]\ndsn = \"postgres://u@127.0.0.1:5432/app\"\n\
                    [sink.kafka]\n\"bootstrap.servers\" = \"127.0.0.1:9092\"\n";

fn load_with(env: &[(&str, &str)]) -> Result<Config, String> {
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    Config::from_toml_and_env(BASE, env).map_err(|e| e.to_string())
}

/// Found by the harness: `2 * heartbeat.interval_ms` overflowed (a panic in the check itself).
#[test]
fn huge_intervals_are_refused_not_overflowed() {
    let e = load_with(&[("OUTBOXD_HEARTBEAT_INTERVAL_MS", "9223372036854775808")]).unwrap_err();
    assert!(
        e.contains("heartbeat.interval_ms") && e.contains("over a year"),
        "{e}"
    );
    for key in [
        "OUTBOXD_SOURCE_STATUS_INTERVAL_MS",
        "OUTBOXD_SOURCE_STATE_INTERVAL_MS",
        "OUTBOXD_RELAY_SHUTDOWN_TIMEOUT_MS",
        "OUTBOXD_RELAY_MAX_BACKOFF_MS",
        "OUTBOXD_RELAY_STANDBY_POLL_MS",
        "OUTBOXD_RELAY_REPAIR_INTERVAL_MS",
        "OUTBOXD_HEARTBEAT_STALL_TIMEOUT_MS",
    ] {
        let e = load_with(&[(key, &u64::MAX.to_string())]).unwrap_err();
        assert!(e.contains("over a year"), "{key}: {e}");
    }
    let year = (366u64 * 86_400 * 1000).to_string();
    load_with(&[("OUTBOXD_RELAY_MAX_BACKOFF_MS", &year)]).unwrap();
}

/// A secret or configuration file that never ends is an error, not a process filling memory.
#[test]
fn endless_files_are_refused() {
    for path in ["/dev/zero", "/dev/urandom"] {
        let e = load_with(&[("OUTBOXD_SOURCE_PASSWORD_FILE", path)]).unwrap_err();
        assert!(e.contains("larger than"), "{e}");
        let e = load_with(&[("OUTBOXD_SINK_KAFKA_SASL_PASSWORD_FILE", path)]).unwrap_err();
        assert!(e.contains("larger than"), "{e}");
        let e = Config::load(std::path::Path::new(path))
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than"), "{e}");
    }
}
