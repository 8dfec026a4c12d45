//! Configuration: a TOML file, every key overridable by `OUTBOXD_<SECTION>_<KEY>` environment
//! variables (secrets such as the DSN or its password usually come from the environment).
//!
//! `[sink.kafka]` is passed verbatim to librdkafka; its env form maps `_` to `.`
//! (`OUTBOXD_SINK_KAFKA_BOOTSTRAP_SERVERS` → `bootstrap.servers`).

pub(crate) mod alerts;
pub(crate) mod cleanup;
pub(crate) mod cloudevents;
pub(crate) mod dsn;
mod load;
pub(crate) mod oidc;
pub(crate) mod otlp_headers;
pub(crate) mod parked;
pub(crate) mod policy;
pub(crate) mod replay;
pub(crate) mod secret_names;
pub(crate) mod secrets;
pub(crate) mod shadow;
pub(crate) mod status_token;
pub(crate) mod table_set;
pub(crate) mod tables;
pub(crate) mod telemetry;
mod validate;

use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    /// Not a `#[source]`: the reason is in the message, and a source would print it twice
    /// in an error chain.
    #[error("cannot read config file {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl From<crate::model::route::SettingError> for ConfigError {
    fn from(e: crate::model::route::SettingError) -> Self {
        Self::Invalid(e.0)
    }
}

fn invalid(msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(msg.into())
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub source: SourceConfig,
    /// Every secret of this configuration, to scrub from errors and logs (see `config::secrets`).
    #[serde(skip)]
    pub redactor: crate::config::secrets::Redactor,
    /// `OUTBOXD_*` environment variables that are not overrides (no known section), ignored:
    /// logged as warnings once logging is set up. Orchestrators inject such names (Kubernetes
    /// sets `OUTBOXD_PORT=tcp://…` for a Service named `outboxd`).
    #[serde(skip)]
    pub ignored_env: Vec<String>,
    /// One table of a multi-table configuration ([`Config::for_table`]): its records still
    /// carry the `source_table` header, like the relay's.
    #[serde(skip)]
    pub tagged_table: bool,
    /// The partitions (every member below the root, by oid) of the partitioned outbox tables a
    /// session reads, each with its root's `schema.table`: a publication without
    /// `publish_via_partition_root` streams rows under the partition's name, which the live path
    /// maps to the root's mapping (filled by `crate::slot::join::resolve`).
    #[serde(skip)]
    pub partitions: Vec<(u32, String)>,
    /// Tables that were such partitions and left (detached, dropped) while rows of theirs may
    /// still be ahead of the slot: still read as their root's until the slot passed the moment
    /// they were seen gone (`crate::slot::join::partitions::remember`).
    #[serde(skip)]
    pub left_partitions: Vec<(u32, String)>,
    #[serde(default)]
    pub sink: SinkConfig,
    #[serde(default)]
    pub relay: RelayConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Poison-event policy: `ordering` and `on_poison`, per event type.
    #[serde(default)]
    pub policy: policy::PolicyConfig,
    #[serde(default)]
    pub validation: ValidationConfig,
    #[serde(default)]
    pub heartbeat: HeartbeatConfig,
    #[serde(default)]
    pub alerts: alerts::AlertsConfig,
    /// Deleting delivered outbox rows (`outboxd cleanup`, or a loop in `run`).
    #[serde(default)]
    pub cleanup: cleanup::CleanupConfig,
    /// Shadow mode for migrating off "publish inside the transaction" (R35).
    #[serde(default)]
    pub shadow: shadow::ShadowConfig,
    /// Operator replays (`outboxd replay`, R38): side-effecting types, approval size, rate.
    #[serde(default)]
    pub replay: replay::ReplayConfig,
    /// The integrity key of parked and held rows and the bounds of that store (issue 40).
    #[serde(default)]
    pub parked: parked::ParkedConfig,
    /// OpenTelemetry trace export (issue 43): `OTEL_*` variables fill what it leaves unset.
    #[serde(default)]
    pub telemetry: telemetry::TelemetryConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatConfig {
    /// Emit `pg_logical_emit_message` on the source this often; 0 disables heartbeats.
    #[serde(default = "d_hb_ms", deserialize_with = "lenient")]
    pub interval_ms: u64,
    /// With heartbeats on: a stream that delivers nothing for this long while the relay is
    /// reading is treated as dead and the session restarts (a blackholed connection).
    #[serde(default = "d_stall_ms", deserialize_with = "lenient")]
    pub stall_timeout_ms: u64,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        Self {
            interval_ms: d_hb_ms(),
            stall_timeout_ms: d_stall_ms(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ValidationConfig {
    /// Directory of JSON Schemas, `<dir>/<event_type>/<schema_version>.json`; unset: no validation.
    #[serde(default)]
    pub schema_dir: Option<std::path::PathBuf>,
    /// An event whose type and version have no schema file is poison (`schema_invalid`)
    /// instead of passing unvalidated.
    #[serde(default, deserialize_with = "lenient")]
    pub require_schema: bool,
}

/// `Debug` (in `config::status_token`) hides the status page's token.
#[derive(Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address of the Prometheus endpoint (`/metrics`), e.g. "0.0.0.0:9187"; unset: disabled.
    #[serde(default)]
    pub listen: Option<String>,
    /// Bearer token protecting the status page (`/`, `/status.json`); unset: open.
    #[serde(default)]
    pub status_token: Option<String>,
    /// A file holding `status_token` (a mounted secret); read at start-up.
    #[serde(default)]
    pub status_token_file: Option<std::path::PathBuf>,
    /// Names the status page answers as `Host` besides IP literals and `localhost` (against
    /// DNS rebinding); a list, or comma-separated from the environment.
    #[serde(default, deserialize_with = "status_token::hosts")]
    pub status_hosts: Vec<String>,
}

/// `Debug` (in `config::secrets`) hides the DSN's password and `password`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// libpq-style URL or key=value DSN of the source database.
    pub dsn: String,
    /// Overrides the DSN's password (keep the DSN in the file, the password in the env).
    #[serde(default)]
    pub password: Option<String>,
    /// A file holding the password (a mounted secret); read at start-up.
    #[serde(default)]
    pub password_file: Option<std::path::PathBuf>,
    /// Where the replication stream and the slot live: a physical standby (Postgres 16+), so
    /// the primary does not pay for decoding (R45). `dsn` stays the SQL connection for
    /// outboxd's own tables and the outbox reads of recovery and replay, on the primary.
    /// Unset: the stream and the slot live where `dsn` points. Same role, password and TLS
    /// settings as `dsn` (a physical standby has the primary's roles).
    #[serde(default)]
    pub replication_dsn: Option<String>,
    #[serde(default = "d_publication")]
    pub publication: String,
    #[serde(default = "d_slot")]
    pub slot: String,
    /// Schema-qualified outbox table (`public.outbox` when neither this nor `tables` is set):
    /// the one-table shorthand of `tables`.
    #[serde(default)]
    pub table: Option<String>,
    /// Several outbox tables through this slot and publication (`[[source.tables]]`), each
    /// with its own column mapping and topic template (see [`tables`]).
    #[serde(default)]
    pub tables: Vec<tables::TableEntry>,
    /// Schema of outboxd's own tables (`outbox_parked`, `outbox_parked_audit`,
    /// `outboxd_status`, `outboxd_slot_state`). The relay's SQL connections search only it
    /// (after `pg_catalog`), so no other schema on a `search_path` can shadow them.
    #[serde(default = "d_relay_schema")]
    pub relay_schema: String,
    /// Create the slot at start-up when missing (`outboxd init` always creates it).
    #[serde(default = "d_true", deserialize_with = "lenient")]
    pub create_slot: bool,
    /// Standby status interval; capped at `wal_sender_timeout / 2` at run time.
    #[serde(default = "d_status_ms", deserialize_with = "lenient")]
    pub status_interval_ms: u64,
    #[serde(default)]
    pub columns: crate::model::columns::Columns,
    /// TLS to Postgres (libpq's meanings): disable | prefer | require | verify-ca | verify-full.
    /// Unset: the DSN's `sslmode`, else `prefer`.
    #[serde(default)]
    pub sslmode: Option<crate::model::tls::SslMode>,
    /// CA certificates (PEM) that must sign the server's certificate (verify-ca/verify-full);
    /// unset: the Mozilla roots.
    #[serde(default)]
    pub sslrootcert: Option<std::path::PathBuf>,
    /// Client certificate chain and key (PEM) when the server asks for one (`cert` auth).
    #[serde(default)]
    pub sslcert: Option<std::path::PathBuf>,
    #[serde(default)]
    pub sslkey: Option<std::path::PathBuf>,
    /// What to do when the slot is gone, invalidated or belongs to another history (failover,
    /// restore, `max_slot_wal_keep_size`, an operator's DROP): `recover` republishes the gap
    /// from the outbox table, `halt` exits naming the gap and the command that recovers it.
    #[serde(default)]
    pub on_slot_loss: SlotLossPolicy,
    /// How far before the delivery mark a recovery starts reading the outbox (`created_at` is
    /// the writer's transaction start, which precedes its commit by the transaction's length).
    /// Seconds, or a duration such as "10m".
    #[serde(default = "d_recovery_window", deserialize_with = "duration_secs")]
    pub recovery_window: Duration,
    /// How long the creation of a slot (a slot-loss recovery's, the first start's) may wait
    /// for the transactions open when it began (a prepared transaction left behind waits
    /// forever) before the session gives up naming them and retries (`relay::blockers`).
    /// Seconds, or a duration such as "5m".
    #[serde(default = "d_slot_create_timeout", deserialize_with = "duration_secs")]
    pub slot_create_timeout: Duration,
    /// How often the acknowledged position and delivery mark are written to
    /// `outboxd_slot_state` (what a Postgres crash may replay is bounded by it).
    #[serde(default = "d_state_ms", deserialize_with = "lenient")]
    pub state_interval_ms: u64,
}

/// `source.on_slot_loss`.
impl SourceConfig {
    /// The TLS settings, for the SQL connection and the stream alike.
    pub fn tls(&self) -> crate::model::tls::TlsSettings<'_> {
        crate::model::tls::TlsSettings {
            sslmode: self.sslmode,
            sslrootcert: self.sslrootcert.as_deref(),
            sslcert: self.sslcert.as_deref(),
            sslkey: self.sslkey.as_deref(),
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum SlotLossPolicy {
    #[default]
    Recover,
    Halt,
}

/// `Debug` (in `config::secrets`) hides the values of secret librdkafka properties.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// Topic template; `{aggregate_type}` and `{event_type}` are substituted.
    #[serde(default = "d_topic")]
    pub topic: String,
    /// librdkafka properties, verbatim.
    #[serde(default)]
    pub kafka: BTreeMap<String, String>,
    /// `outbox` (default: today's records) or `cloudevents` (issue 42).
    #[serde(default)]
    pub format: cloudevents::Format,
    /// `[sink.cloudevents]`: used with `format = "cloudevents"`.
    #[serde(default)]
    pub cloudevents: cloudevents::CloudEventsConfig,
}

impl Default for SinkConfig {
    fn default() -> Self {
        Self {
            topic: d_topic(),
            kafka: BTreeMap::new(),
            format: Default::default(),
            cloudevents: Default::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// Upper bound on events between the oldest unacknowledged one and the newest produced.
    #[serde(default = "d_max_events", deserialize_with = "lenient")]
    pub max_in_flight_events: usize,
    /// Upper bound on the bytes (key + value + headers) of unacknowledged events.
    #[serde(default = "d_max_bytes", deserialize_with = "lenient")]
    pub max_in_flight_bytes: usize,
    /// How long SIGTERM waits for in-flight events before confirming what was acknowledged.
    #[serde(default = "d_shutdown_ms", deserialize_with = "lenient")]
    pub shutdown_timeout_ms: u64,
    /// Largest backoff between session restarts (transient failures, slot held elsewhere).
    #[serde(default = "d_backoff_ms", deserialize_with = "lenient")]
    pub max_backoff_ms: u64,
    /// How often a standby instance tries to take the slot over (bounds failover time).
    #[serde(default = "d_standby_ms", deserialize_with = "lenient")]
    pub standby_poll_ms: u64,
    /// A standby fences the active instance (terminates its walsender and takes the slot) when
    /// its liveness signal is older than this (server clock) and the slot's confirmed position
    /// stands still: a frozen or partitioned holder is otherwise noticed only after Postgres's
    /// `wal_sender_timeout` (60 s by default). 0 never fences.
    #[serde(default = "d_takeover_ms", deserialize_with = "lenient")]
    pub takeover_after_ms: u64,
    /// How often the relay looks for operator repairs of parked events.
    #[serde(default = "d_repair_ms", deserialize_with = "lenient")]
    pub repair_interval_ms: u64,
    /// The most a live transaction waits (ms) to be read, produced and acknowledged together
    /// with the ones committed right after it; it waits only while transactions have lately
    /// been committed less than this apart, so a light load is read at once (`relay::gulp`,
    /// the adaptive pace). 0: never wait.
    #[serde(default = "d_batch_window_ms", deserialize_with = "lenient")]
    pub batch_window_ms: u64,
    /// A fixed pace instead of the adaptive one: after a transaction, when nothing more has
    /// arrived, wait this long (ms) before reading again, whatever the load. Unset: adaptive
    /// (`batch_window_ms`).
    #[serde(default, deserialize_with = "lenient_some")]
    pub read_linger_ms: Option<u64>,
    /// Fence at the broker: produce in Kafka transactions under a `transactional.id` derived
    /// from the database and the slot, so the next holder's producer fences this one's at the
    /// broker and nothing a frozen holder still has queued lands after the new holder's records
    /// (`relay::kafka::txn`). Consumers must read `read_committed`. Off: no transactions.
    #[serde(default, deserialize_with = "lenient")]
    pub broker_fencing: bool,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            max_in_flight_events: d_max_events(),
            max_in_flight_bytes: d_max_bytes(),
            shutdown_timeout_ms: d_shutdown_ms(),
            max_backoff_ms: d_backoff_ms(),
            repair_interval_ms: d_repair_ms(),
            standby_poll_ms: d_standby_ms(),
            takeover_after_ms: d_takeover_ms(),
            batch_window_ms: d_batch_window_ms(),
            read_linger_ms: None,
            broker_fencing: false,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    #[serde(default)]
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

fn d_publication() -> String {
    "outbox_pub".into()
}
fn d_slot() -> String {
    "outboxd".into()
}
fn d_relay_schema() -> String {
    "public".into()
}
fn d_true() -> bool {
    true
}
/// How often, at most, the confirmed LSN goes to the server while it moves (the replication
/// client sends an update as soon as it moves, rate-limited to this; idle it sends one only
/// every 10 s or on the server's keepalive request). What a crash replays is what the broker
/// acknowledged since the last update: 100 ms keeps that to about a tenth of a second of
/// traffic (docs/benchmarks.md, "Duplicates per crash").
fn d_status_ms() -> u64 {
    100
}
fn d_state_ms() -> u64 {
    1000
}
fn d_recovery_window() -> Duration {
    Duration::from_secs(600)
}
fn d_slot_create_timeout() -> Duration {
    Duration::from_secs(300)
}

/// [`duration_secs`], optional.
pub(crate) fn opt_duration_secs<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Duration>, D::Error> {
    duration_secs(d).map(Some)
}

/// A duration as whole seconds (TOML integer or string) or a humantime string ("10m", "90s").
fn duration_secs<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        N(u64),
        S(String),
    }
    match Either::deserialize(d)? {
        Either::N(n) => Ok(Duration::from_secs(n)),
        Either::S(s) => match s.trim().parse::<u64>() {
            Ok(n) => Ok(Duration::from_secs(n)),
            Err(_) => humantime::parse_duration(s.trim()).map_err(|e| {
                serde::de::Error::custom(format!("{e}: use seconds or a duration such as \"10m\""))
            }),
        },
    }
}
fn d_topic() -> String {
    "outbox.event.{aggregate_type}".into()
}
fn d_max_events() -> usize {
    // librdkafka holds ~600 B per queued message beyond its payload: 20k keeps peak RSS well
    // under 64 MiB even when starting on a backlog (docs/benchmarks.md).
    20_000
}
fn d_max_bytes() -> usize {
    32 << 20
}
fn d_shutdown_ms() -> u64 {
    10_000
}
fn d_backoff_ms() -> u64 {
    5_000
}
fn d_hb_ms() -> u64 {
    5_000
}
fn d_stall_ms() -> u64 {
    20_000
}
fn d_standby_ms() -> u64 {
    1_000
}
/// Three missed liveness beats (one a second): takeover lands within about 5 s.
fn d_takeover_ms() -> u64 {
    3_000
}
fn d_repair_ms() -> u64 {
    1_000
}

fn d_batch_window_ms() -> u64 {
    4
}

/// Accepts a native TOML value or a string (environment overrides are always strings).
pub(crate) fn lenient<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr + Deserialize<'de>,
    T::Err: std::fmt::Display,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either<T> {
        S(String),
        T(T),
    }
    match Either::<T>::deserialize(d)? {
        Either::S(s) => s.parse().map_err(serde::de::Error::custom),
        Either::T(t) => Ok(t),
    }
}

/// [`lenient`] for an optional key: present means `Some`.
pub(crate) fn lenient_some<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr + Deserialize<'de>,
    T::Err: std::fmt::Display,
{
    lenient(d).map(Some)
}

impl Config {
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.relay.shutdown_timeout_ms)
    }
}

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::columns::{Columns, Preset};

    const BASE: &str = r#"
[source]
dsn = "postgres://u@127.0.0.1:5432/app"
[sink.kafka]
"bootstrap.servers" = "127.0.0.1:9092"
"#;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// BASE with one `[relay]` key set.
    fn with_relay(key: &str, value: &str) -> Result<Config, ConfigError> {
        Config::from_toml_and_env(
            &format!("{BASE}[relay]\n{key} = {value}\n"),
            Vec::<(String, String)>::new(),
        )
    }

    #[test]
    fn replication_dsn_is_checked_and_never_shown() {
        let with = |dsn: &str| {
            Config::from_toml_and_env(BASE, env(&[("OUTBOXD_SOURCE_REPLICATION_DSN", dsn)]))
        };
        let c = with("postgres://u:standby-secret@10.0.0.2:5432/app").unwrap();
        assert_eq!(
            c.source.replication_dsn.as_deref(),
            Some("postgres://u:standby-secret@10.0.0.2:5432/app")
        );
        let shown = format!("{:?}", c.source);
        assert!(shown.contains("replication_dsn"), "{shown}");
        assert!(!shown.contains("standby-secret"), "{shown}");
        assert!(c.redactor.scrub("x standby-secret y").contains("x "));
        assert!(!c
            .redactor
            .scrub("x standby-secret y")
            .contains("standby-secret"));
        // The stream needs TCP: a socket directory is refused for replication_dsn, not dsn.
        let e = with("host=/var/run/postgresql dbname=app")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("source.replication_dsn connects through the Unix socket"),
            "{e}"
        );
        let e = with("postgres://u:sec ret@[bad").unwrap_err().to_string();
        assert!(
            e.contains("source.replication_dsn is not a valid Postgres DSN"),
            "{e}"
        );
        assert!(!e.contains("sec ret"), "{e}");
        let unix_dsn = BASE.replace(
            "postgres://u@127.0.0.1:5432/app",
            "host=/var/run/postgresql dbname=app",
        );
        let c = Config::from_toml_and_env(
            &unix_dsn,
            env(&[("OUTBOXD_SOURCE_REPLICATION_DSN", "host=10.0.0.2 dbname=app")]),
        );
        assert!(c.is_ok(), "SQL over a socket, the stream over TCP: {c:?}");
    }

    #[test]
    fn takeover_after_is_off_or_at_least_two_beats() {
        let with = |ms: &str| with_relay("takeover_after_ms", ms);
        assert_eq!(with("0").unwrap().relay.takeover_after_ms, 0);
        assert_eq!(with("2000").unwrap().relay.takeover_after_ms, 2000);
        let e = with("500").unwrap_err().to_string();
        assert!(e.contains("relay.takeover_after_ms"), "{e}");
        let d = Config::from_toml_and_env(BASE, Vec::<(String, String)>::new()).unwrap();
        assert_eq!(d.relay.takeover_after_ms, 3000);
    }

    #[test]
    fn the_pace_is_adaptive_by_default_and_both_knobs_are_bounded() {
        let d = Config::from_toml_and_env(BASE, Vec::<(String, String)>::new()).unwrap();
        assert_eq!((d.relay.batch_window_ms, d.relay.read_linger_ms), (4, None));
        for key in ["read_linger_ms", "batch_window_ms"] {
            let with = |ms: &str| with_relay(key, ms);
            assert!(with("0").is_ok() && with("100").is_ok(), "{key}");
            let e = with("101").unwrap_err().to_string();
            assert!(
                e.contains(&format!("relay.{key}")) && e.contains("at most 100"),
                "{e}"
            );
        }
        assert_eq!(
            with_relay("read_linger_ms", "0")
                .unwrap()
                .relay
                .read_linger_ms,
            Some(0)
        );
        let e = Config::from_toml_and_env(BASE, env(&[("OUTBOXD_RELAY_READ_LINGER_MS", "1000")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("relay.read_linger_ms"), "{e}");
        let w = Config::from_toml_and_env(BASE, env(&[("OUTBOXD_RELAY_BATCH_WINDOW_MS", "7")]));
        assert_eq!(w.unwrap().relay.batch_window_ms, 7);
    }

    #[test]
    fn recovery_window_takes_seconds_or_durations_and_is_bounded() {
        let base = "[source]\ndsn = \"postgres://u@h/db\"\n";
        let kafka = "[sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n";
        let with = |w: &str| {
            Config::from_toml_and_env(
                &format!("{base}recovery_window = {w}\n{kafka}"),
                Vec::<(String, String)>::new(),
            )
        };
        assert_eq!(
            with("90").unwrap().source.recovery_window,
            Duration::from_secs(90)
        );
        assert_eq!(
            with("\"10m\"").unwrap().source.recovery_window,
            Duration::from_secs(600)
        );
        let e = with("\"2y\"").unwrap_err().to_string();
        assert!(e.contains("over a year"), "{e}");
        let e = with("\"soon\"").unwrap_err().to_string();
        assert!(e.contains("10m"), "{e}");
    }

    #[test]
    fn unix_socket_dsn_is_refused_with_the_fix() {
        let e = Config::from_toml_and_env(
            &BASE.replace(
                "postgres://u@127.0.0.1:5432/app",
                "host=/run/postgresql dbname=app",
            ),
            vec![],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("host=127.0.0.1"), "{e}");
    }

    #[test]
    fn defaults() {
        let c = Config::from_toml_and_env(BASE, vec![]).unwrap();
        assert_eq!(c.source.slot, "outboxd");
        assert_eq!(c.source.publication, "outbox_pub");
        assert_eq!(c.sink.topic, "outbox.event.{aggregate_type}");
        assert_eq!(c.table_name(), ("public".into(), "outbox".into()));
        assert!(c.source.create_slot);
    }

    #[test]
    fn env_overrides_every_section() {
        let c = Config::from_toml_and_env(
            BASE,
            env(&[
                ("OUTBOXD_SOURCE_SLOT", "s2"),
                ("OUTBOXD_SOURCE_CREATE_SLOT", "false"),
                ("OUTBOXD_SINK_KAFKA_BOOTSTRAP_SERVERS", "h:1"),
                ("OUTBOXD_SINK_KAFKA_COMPRESSION_TYPE", "zstd"),
                ("OUTBOXD_RELAY_MAX_IN_FLIGHT_EVENTS", "7"),
                ("OUTBOXD_SOURCE_COLUMNS_PRESET", "debezium"),
                ("OUTBOXD_HEARTBEAT_INTERVAL_MS", "0"),
                ("OUTBOXD_POLICY_ON_POISON", "halt"),
                ("HOME", "/root"),
                ("OUTBOXD_CONFIG", "/etc/outboxd.toml"),
                ("OUTBOXD_FAILPOINTS", "produced@3"),
            ]),
        )
        .unwrap();
        assert_eq!(c.source.slot, "s2");
        assert!(!c.source.create_slot);
        assert_eq!(c.sink.kafka["bootstrap.servers"], "h:1");
        assert_eq!(c.sink.kafka["compression.type"], "zstd");
        assert_eq!(c.relay.max_in_flight_events, 7);
        assert_eq!(c.source.columns.preset, Preset::Debezium);
        assert_eq!(c.heartbeat.interval_ms, 0);
        assert_eq!(c.policy.on_poison, crate::config::policy::OnPoison::Halt);
    }

    #[test]
    fn debezium_preset_reads_debezium_columns() {
        let n = Columns {
            preset: Preset::Debezium,
            ..Columns::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(n.event_id, "id");
        assert_eq!(n.aggregate_type, "aggregatetype");
        assert_eq!(n.aggregate_id, "aggregateid");
        assert_eq!(n.event_type, "type");
        assert_eq!(n.aggregate_version, None);
    }

    #[test]
    fn bad_input_names_the_problem() {
        let e = |t: &str, envs: &[(&str, &str)]| {
            Config::from_toml_and_env(t, env(envs))
                .unwrap_err()
                .to_string()
        };
        assert!(e("[source]\n", &[]).contains("dsn"));
        assert!(e(BASE, &[("OUTBOXD_SOURCE_SLOT", "Bad-Slot")]).contains("source.slot"));
        assert!(e(BASE, &[("OUTBOXD_SINK_KAFKA_ACKS", "1")]).contains("acks=all"));
        // librdkafka's alias of acks, and other spellings, are held to the same rule.
        let alias = format!("{BASE}\"request.required.acks\" = \"1\"\n");
        assert!(e(&alias, &[]).contains("request.required.acks"));
        let upper = format!("{BASE}\"enable.idempotence\" = \"False\"\n");
        assert!(e(&upper, &[]).contains("enable.idempotence"));
        let fine = format!("{BASE}\"request.required.acks\" = \"-1\"\n");
        Config::from_toml_and_env(&fine, env(&[])).unwrap();
        assert!(e(BASE, &[("OUTBOXD_SINK_TOPIC", "x.{nope}")]).contains("{nope}"));
        // Not ours (Kubernetes service links, other tools): ignored and reported, not fatal.
        let c = Config::from_toml_and_env(
            BASE,
            env(&[
                ("OUTBOXD_PORT", "tcp://10.0.0.1:9090"),
                ("OUTBOXD_NOPE_X", "1"),
            ]),
        )
        .unwrap();
        assert_eq!(c.ignored_env, ["OUTBOXD_PORT", "OUTBOXD_NOPE_X"]);
        // A known section with an unknown key is a typo.
        assert!(e(BASE, &[("OUTBOXD_RELAY_MAX_INFLIGHT", "1")]).contains("max_inflight"));
        assert!(e(&format!("{BASE}\n[relay]\nbogus = 1\n"), &[]).contains("bogus"));
        assert!(e(BASE, &[("OUTBOXD_RELAY_MAX_IN_FLIGHT_EVENTS", "lots")]).contains("invalid"));
        let no_broker = "[source]\ndsn = \"postgres://u@h/db\"\n";
        assert!(e(no_broker, &[]).contains("bootstrap.servers"));
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;
    use crate::model::columns::Preset;

    const BASE: &str = "[sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n\
                        [source]\ndsn = \"postgres://u@h/db\"\n";

    fn load(extra: &str) -> Result<Config, ConfigError> {
        Config::from_toml_and_env(&format!("{BASE}{extra}"), Vec::<(String, String)>::new())
    }

    const THREE: &str = r#"
[source.columns]
created_at = "created_at"
[[source.tables]]
name = "billing.outbox"
[[source.tables]]
name = "shipping.outbox"
topic = "shipping.{event_type}"
[[source.tables]]
name = "legacy"
columns = { preset = "debezium" }
"#;

    #[test]
    fn tables_take_their_overrides_or_the_shared_settings() {
        let c = load(THREE).unwrap();
        assert!(c.is_multi_table());
        let t = c.tables();
        assert_eq!(
            t.iter().map(|t| t.label()).collect::<Vec<_>>(),
            ["billing.outbox", "shipping.outbox", "public.legacy"]
        );
        assert_eq!(t[0].topic, "outbox.event.{aggregate_type}");
        assert_eq!(t[0].columns.created_at.as_deref(), Some("created_at"));
        assert_eq!(t[1].topic, "shipping.{event_type}");
        assert_eq!(t[2].columns.preset, Preset::Debezium);
        let e = c.one_table("replay").unwrap_err();
        assert!(e.contains("replay") && e.contains("public.legacy"), "{e}");
    }

    #[test]
    fn the_shorthand_is_one_table() {
        let c = load("table = \"app.events\"\n").unwrap();
        assert!(!c.is_multi_table());
        assert_eq!(c.tables().len(), 1);
        assert_eq!(c.tables()[0].label(), "app.events");
        c.one_table("replay").unwrap();
        // One entry written longhand reads exactly like the shorthand.
        let c = load(
            "[[source.tables]]\nname = \"app.events\"\ntopic = \"t\"\n\
             columns = { preset = \"debezium\" }\n",
        )
        .unwrap();
        assert!(!c.is_multi_table());
        assert_eq!(c.table_name(), ("app".into(), "events".into()));
        assert_eq!(c.sink.topic, "t");
        assert_eq!(c.source.columns.preset, Preset::Debezium);
    }

    #[test]
    fn bad_table_lists_are_refused_with_the_reason() {
        let e = |t: &str| load(t).unwrap_err().to_string();
        let both = format!("table = \"a.outbox\"\n{THREE}");
        assert!(e(&both).contains("both set"), "{}", e(&both));
        let twice = "[[source.tables]]\nname = \"a.o\"\n[[source.tables]]\nname = \"a.o\"\n";
        assert!(e(twice).contains("listed twice"), "{}", e(twice));
        let bad = "[[source.tables]]\nname = \"a.b.c\"\n";
        assert!(e(bad).contains("source.tables[0].name"), "{}", e(bad));
        let topic =
            "[[source.tables]]\nname = \"a\"\n[[source.tables]]\nname = \"b\"\ntopic = \"{x}\"\n";
        assert!(
            e(topic).contains("source.tables[1] (b): topic"),
            "{}",
            e(topic)
        );
        let cols = "[[source.tables]]\nname = \"a\"\ncolumns = { event_id = \"\" }\n";
        assert!(e(cols).contains("source.tables[0] (a)"), "{}", e(cols));
        let unknown = "[[source.tables]]\nname = \"a\"\ntopics = \"x\"\n";
        assert!(e(unknown).contains("topics"), "{}", e(unknown));
        let env = Config::from_toml_and_env(
            BASE,
            vec![("OUTBOXD_SOURCE_TABLES".to_string(), "a,b".to_string())],
        )
        .unwrap_err()
        .to_string();
        assert!(env.contains("config file"), "{env}");
    }
}

#[cfg(test)]
mod table_policy_tests {
    use super::*;
    use crate::config::policy::{OnPoison, Ordering};

    fn load(extra: &str) -> Result<Config, ConfigError> {
        Config::from_toml_and_env(
            &format!(
                "[sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n\
                 [source]\ndsn = \"postgres://u@h/db\"\n{extra}"
            ),
            Vec::<(String, String)>::new(),
        )
    }

    const TWO: &str = r#"
[policy]
on_poison = "park"
[policy.event_types.Ledger]
on_poison = "halt"
[validation]
schema_dir = "schemas"
[[source.tables]]
name = "a.outbox"
[source.tables.policy]
ordering = "none"
[source.tables.policy.event_types.Ledger]
ordering = "aggregate"
[source.tables.validation]
schema_dir = "a-schemas"
require_schema = true
[[source.tables]]
name = "b.outbox"
"#;

    #[test]
    fn each_table_has_its_policy_and_schemas_merged_with_the_top_level() {
        let c = load(TWO).unwrap();
        let t = c.tables();
        let (a, b) = (&t[0], &t[1]);
        assert_eq!(a.policy.for_type("X").ordering, Ordering::None);
        // A's own Ledger entry replaces the top-level one whole: on_poison from A's defaults.
        assert_eq!(a.policy.for_type("Ledger").ordering, Ordering::Aggregate);
        assert_eq!(a.policy.for_type("Ledger").on_poison, OnPoison::Park);
        assert_eq!(
            a.validation.schema_dir.as_deref(),
            Some(std::path::Path::new("a-schemas"))
        );
        assert!(a.validation.require_schema);
        // B sets nothing: the top-level policy and schemas.
        assert_eq!(b.policy, c.policy);
        assert_eq!(b.validation, c.validation);
        assert_eq!(b.policy.for_type("Ledger").on_poison, OnPoison::Halt);
        // replay's one-table view of A carries A's.
        let one = c.for_table("a.outbox").unwrap();
        assert_eq!(one.policy, a.policy);
        assert_eq!(one.validation, a.validation);
    }

    #[test]
    fn one_entry_folds_its_policy_and_schemas_like_its_columns() {
        let c = load(
            "[policy]\nordering = \"none\"\n[[source.tables]]\nname = \"app.events\"\n\
             policy = { on_poison = \"halt\" }\nvalidation = { schema_dir = \"s\" }\n",
        )
        .unwrap();
        assert!(!c.is_multi_table());
        assert_eq!(c.policy.on_poison, OnPoison::Halt);
        assert_eq!(c.policy.ordering, Ordering::None);
        assert_eq!(
            c.validation.schema_dir.as_deref(),
            Some(std::path::Path::new("s"))
        );
        assert_eq!(c.tables()[0].policy, c.policy);
    }

    #[test]
    fn ambiguous_or_contradictory_table_policies_are_refused_with_the_fix() {
        let e = |t: &str| load(t).unwrap_err().to_string();
        // A's default on_poison against the top-level Ledger entry's: which applies to Ledger?
        let ambiguous = r#"
[policy.event_types.Ledger]
on_poison = "halt"
[[source.tables]]
name = "a.outbox"
policy = { on_poison = "park" }
[[source.tables]]
name = "b.outbox"
"#;
        let m = e(ambiguous);
        assert!(
            m.contains("source.tables[0] (a.outbox)")
                && m.contains("policy.on_poison = \"park\"")
                && m.contains("[policy.event_types.Ledger] on_poison = \"halt\"")
                && m.contains("[source.tables.policy.event_types.Ledger]"),
            "{m}"
        );
        // Saying it for Ledger in the table settles it.
        load(&ambiguous.replace(
            "policy = { on_poison = \"park\" }",
            "policy = { on_poison = \"park\", event_types = { Ledger = { on_poison = \"halt\" } } }",
        ))
        .unwrap();
        // The same value is no contradiction.
        load(&ambiguous.replace("\"park\"", "\"halt\"")).unwrap();
        let no_dir = "[[source.tables]]\nname = \"a\"\nvalidation = { require_schema = true }\n\
                      [[source.tables]]\nname = \"b\"\n";
        let m = e(no_dir);
        assert!(
            m.contains("source.tables[0] (a)") && m.contains("schema_dir"),
            "{m}"
        );
        let typo = "[[source.tables]]\nname = \"a\"\npolicy = { on_poision = \"halt\" }\n";
        assert!(e(typo).contains("on_poision"), "{}", e(typo));
        let bad = "[[source.tables]]\nname = \"a\"\npolicy = { ordering = \"table\" }\n";
        assert!(e(bad).contains("table"), "{}", e(bad));
    }
}

#[cfg(test)]
mod example_tests {
    /// The annotated example in docs/ must stay a valid config.
    #[test]
    fn documented_example_parses() {
        let text = include_str!("../../../../docs/examples/outboxd.toml");
        super::Config::from_toml_and_env(text, Vec::<(String, String)>::new()).unwrap();
    }
}
