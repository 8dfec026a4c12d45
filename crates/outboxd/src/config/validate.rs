//! Checks of a parsed configuration that serde cannot express: each error names the setting and
//! the fix, before anything connects.

use super::tables::Pattern;
use super::{invalid, Config, ConfigError};
use std::str::FromStr;
use std::time::Duration;

/// The longest interval setting (366 days, like `source.recovery_window`).
const MAX_INTERVAL_MS: u64 = 366 * 86_400 * 1000;
/// Longest `relay.read_linger_ms`: the pause blocks the relay's thread (shutdown, metrics).
const MAX_READ_LINGER_MS: u64 = 100;
/// The smallest `relay.takeover_after_ms` other than 0: two missed beats (the holder beats
/// every second, `slot::fence::BEAT_EVERY`).
const MIN_TAKEOVER_MS: u64 = 2_000;
/// Most `[[source.tables]]` entries: each is a value of the `table` metric label, which must
/// stay bounded.
const MAX_TABLES: usize = 256;

/// `key = name`: `table` or `schema.table`, plain identifiers (spliced into DDL and queries).
fn table_name(key: &str, name: &str) -> Result<(), ConfigError> {
    if name.split('.').count() > 2 || !name.split('.').all(plain_ident) {
        return Err(invalid(format!(
            "{key} = {name:?}: use `table` or `schema.table`, each a plain SQL identifier \
             ([A-Za-z_][A-Za-z0-9_$]*, at most 63 bytes); names are used exactly as written \
             (case-sensitive, as if double-quoted)"
        )));
    }
    Ok(())
}

impl Config {
    /// `[[source.tables]]`: not with `source.table`, at least one, each name valid and listed
    /// once, each override valid.
    fn validate_tables(&self) -> Result<(), ConfigError> {
        let s = &self.source;
        if s.tables.is_empty() {
            return Ok(());
        }
        if let Some(t) = &s.table {
            return Err(invalid(format!(
                "source.table = {t:?} and [[source.tables]] are both set: `source.table` is the \
                 one-table shorthand of `source.tables`; list {t:?} as a [[source.tables]] entry \
                 and remove source.table"
            )));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, t) in s.tables.iter().enumerate() {
            let what = match (&t.pattern, t.name.is_empty()) {
                (Some(p), true) => {
                    Pattern::parse(p).map_err(|e| invalid(format!("source.tables[{i}].{e}")))?;
                    if !seen.insert((format!("pattern {p}"), String::new())) {
                        return Err(invalid(format!(
                            "source.tables[{i}].pattern = {p:?}: the pattern is given twice"
                        )));
                    }
                    p.clone()
                }
                (Some(p), false) => {
                    return Err(invalid(format!(
                        "source.tables[{i}]: name = {:?} and pattern = {p:?} are both set: an \
                         entry is one table (name) or every table a pattern matches (pattern)",
                        t.name
                    )))
                }
                (None, _) => {
                    let key = format!("source.tables[{i}].name");
                    table_name(&key, &t.name)?;
                    if !seen.insert(super::tables::split(&t.name)) {
                        return Err(invalid(format!(
                            "{key} = {:?}: the table is listed twice; list each outbox table once",
                            t.name
                        )));
                    }
                    t.name.clone()
                }
            };
            if let Some(c) = &t.columns {
                c.resolve()
                    .map_err(|e| invalid(format!("source.tables[{i}] ({what}): {}", e.0)))?;
            }
            if let Some(topic) = &t.topic {
                let probe = super::tables::topic_for(topic, "s", "t");
                crate::model::topic::TopicTemplate::parse(&probe).map_err(|e| {
                    invalid(format!(
                        "source.tables[{i}] ({what}): topic: {} ({{schema}} and {{table}} are \
                         the table's names)",
                        e.0
                    ))
                })?;
            }
            self.validate_table_policy(i, t)?;
        }
        self.refuse_ambiguous()?;
        if s.tables.len() > MAX_TABLES {
            return Err(invalid(format!(
                "source.tables lists {} tables; at most {MAX_TABLES} go through one relay (each \
                 is a metric label value): split them across relays",
                s.tables.len()
            )));
        }
        Ok(())
    }

    /// A table's `policy` and `validation` overrides: nothing ambiguous about which setting
    /// applies to an event type, and no schema demanded without a directory to find it in.
    fn validate_table_policy(
        &self,
        i: usize,
        t: &super::tables::TableEntry,
    ) -> Result<(), ConfigError> {
        let what = t.pattern.as_deref().unwrap_or(&t.name);
        if let Some((event_type, key, ours, theirs)) =
            t.policy.as_ref().and_then(|p| p.conflicts(&self.policy))
        {
            return Err(invalid(format!(
                "source.tables[{i}] ({}): policy.{key} = {ours:?} contradicts \
                 [policy.event_types.{event_type}] {key} = {theirs:?}, and nothing says which \
                 applies to {event_type} events of this table: add \
                 [source.tables.policy.event_types.{event_type}] with the {key} this table \
                 wants (a table's entry replaces the top-level one; see docs/configuration.md, \
                 \"Several outbox tables\")",
                what
            )));
        }
        if let Some(v) = &t.validation {
            if v.require_schema == Some(true) && v.merged(&self.validation).schema_dir.is_none() {
                return Err(invalid(format!(
                    "source.tables[{i}] ({}): validation.require_schema = true but neither the \
                     table nor [validation] sets schema_dir: set the directory its schemas are \
                     in (validation = {{ schema_dir = \"…\", require_schema = true }})",
                    what
                )));
            }
        }
        Ok(())
    }

    /// A listed table that a pattern matches too is read as listed; that is ambiguous (and
    /// refused) when the pattern would read it otherwise (another column mapping or topic).
    fn refuse_ambiguous(&self) -> Result<(), ConfigError> {
        let patterns = self.patterns();
        for t in self.tables() {
            for (i, p) in &patterns {
                if !p.matches(&t.schema, &t.name) {
                    continue;
                }
                let entry = &self.source.tables[*i];
                let columns = entry.columns.as_ref().unwrap_or(&self.source.columns);
                let topic = match &entry.topic {
                    Some(own) => super::tables::topic_for(own, &t.schema, &t.name),
                    None => self.sink.topic.clone(),
                };
                if *columns != t.columns || topic != t.topic {
                    return Err(invalid(format!(
                        "{} is listed by name and matches source.tables[{i}].pattern = \"{p}\" \
                         with another {}: which applies would be a guess. Give the listed entry \
                         the pattern's settings, or rename the table or narrow the pattern so \
                         that it no longer matches",
                        t.label(),
                        if *columns != t.columns {
                            "column mapping"
                        } else {
                            "topic"
                        }
                    )));
                }
            }
        }
        Ok(())
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.source;
        // The stream opens where replication_dsn points, else where dsn does: that one needs TCP.
        let stream_key = match &s.replication_dsn {
            Some(r) => {
                parse_dsn("source.dsn", &s.dsn)?;
                (r, "source.replication_dsn")
            }
            None => (&s.dsn, "source.dsn"),
        };
        let dsn = parse_dsn(stream_key.1, stream_key.0)?;
        if let Some(tokio_postgres::config::Host::Unix(dir)) = dsn.get_hosts().first() {
            // The replication client speaks TCP only (and Postgres offers no TLS on sockets).
            return Err(invalid(format!(
                "{} connects through the Unix socket in {}: the replication stream needs \
                 TCP; use host=127.0.0.1 (or the server's address)",
                stream_key.1,
                dir.display()
            )));
        }
        for (v, key) in [
            (&s.slot, "source.slot"),
            (&s.publication, "source.publication"),
        ] {
            let ok = !v.is_empty()
                && v.len() <= 63
                && v.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !ok {
                return Err(invalid(format!(
                    "{key} = {v:?}: use 1-63 characters of a-z, 0-9 and _"
                )));
            }
        }
        // The names are spliced into DDL, queries and the connection's search_path (a name
        // cannot be a bind parameter): only plain identifiers, quoted wherever they are used.
        if let Some(table) = &s.table {
            table_name("source.table", table)?;
        }
        self.validate_tables()?;
        if !plain_ident(&s.relay_schema) {
            return Err(invalid(format!(
                "source.relay_schema = {:?}: use a plain SQL identifier ([A-Za-z_][A-Za-z0-9_$]*, \
                 at most 63 bytes), used exactly as written",
                s.relay_schema
            )));
        }
        s.columns.resolve()?;
        crate::model::tls::validate(s.tls()).map_err(invalid)?;
        crate::model::topic::TopicTemplate::parse(&self.sink.topic)?;
        for t in self.tables() {
            let dir = t.validation.schema_dir.as_deref();
            super::cloudevents::for_table(self, &t.schema, &t.name, dir, &t.cloudevents)
                .map_err(|e| invalid(format!("{} (table {})", e.0, t.label())))?;
        }
        // A pattern's override is resolved for each table it matches; check its templates now
        // with stand-in names, so a typo fails at startup and not when a tenant joins.
        if self.sink.format == super::cloudevents::Format::Cloudevents {
            for t in &self.source.tables {
                if let (Some(p), Some(o)) = (&t.pattern, &t.cloudevents) {
                    o.merged(&self.sink.cloudevents)
                        .resolve("database", "schema", "table", None)
                        .map_err(|e| invalid(format!("{} (pattern {p})", e.0)))?;
                }
            }
        }
        if !self.sink.kafka.contains_key("bootstrap.servers") {
            return Err(invalid(
                "sink.kafka.\"bootstrap.servers\" is required (or env OUTBOXD_SINK_KAFKA_BOOTSTRAP_SERVERS)",
            ));
        }
        super::oidc::OidcConfig::from_kafka(&self.sink.kafka).map_err(invalid)?;
        // The delivery guarantee, under every name librdkafka accepts for it (`acks` has the
        // alias `request.required.acks`): only the safe values, whatever the spelling.
        for (k, safe) in [
            ("enable.idempotence", &["true"][..]),
            ("acks", &["all", "-1"][..]),
            ("request.required.acks", &["all", "-1"][..]),
        ] {
            if let Some(v) = self.sink.kafka.get(k) {
                if !safe.contains(&v.trim().to_ascii_lowercase().as_str()) {
                    return Err(invalid(format!(
                        "sink.kafka.\"{k}\" = \"{v}\" would allow lost or reordered events; outboxd requires enable.idempotence=true and acks=all (leave both unset)"
                    )));
                }
            }
        }
        // Intervals become deadlines (`Instant + interval`, doubled backoffs): beyond a year
        // they would overflow, and no interval that long is meant.
        for (ms, key) in [
            (s.status_interval_ms, "source.status_interval_ms"),
            (s.state_interval_ms, "source.state_interval_ms"),
            (self.relay.shutdown_timeout_ms, "relay.shutdown_timeout_ms"),
            (self.relay.max_backoff_ms, "relay.max_backoff_ms"),
            (self.relay.standby_poll_ms, "relay.standby_poll_ms"),
            (self.relay.takeover_after_ms, "relay.takeover_after_ms"),
            (self.relay.repair_interval_ms, "relay.repair_interval_ms"),
            (self.heartbeat.interval_ms, "heartbeat.interval_ms"),
            (
                self.heartbeat.stall_timeout_ms,
                "heartbeat.stall_timeout_ms",
            ),
        ] {
            if ms > MAX_INTERVAL_MS {
                return Err(invalid(format!(
                    "{key} = {ms} is over a year: use at most {MAX_INTERVAL_MS} (milliseconds)"
                )));
            }
        }
        self.alerts.validate().map_err(invalid)?;
        self.parked.validate().map_err(invalid)?;
        self.telemetry.validate()?;
        let hb = &self.heartbeat;
        if hb.interval_ms > 0 && hb.stall_timeout_ms < 2 * hb.interval_ms {
            return Err(invalid(
                "heartbeat.stall_timeout_ms must be at least twice heartbeat.interval_ms",
            ));
        }
        let takeover = self.relay.takeover_after_ms;
        if takeover > 0 && takeover < MIN_TAKEOVER_MS {
            return Err(invalid(format!(
                "relay.takeover_after_ms = {takeover} would fence a healthy relay that missed a \
                 beat or two: use 0 (never fence) or at least {} (the liveness signal is written \
                 every second)",
                MIN_TAKEOVER_MS
            )));
        }
        if let Some(ms) = self
            .relay
            .read_linger_ms
            .filter(|ms| *ms > MAX_READ_LINGER_MS)
        {
            return Err(invalid(format!(
                "relay.read_linger_ms = {ms} would stall the relay for too long at a time: use at \
                 most {MAX_READ_LINGER_MS} (milliseconds; 0 reads every transaction at once), or \
                 leave it unset for the adaptive pace (relay.batch_window_ms)"
            )));
        }
        if self.relay.batch_window_ms > MAX_READ_LINGER_MS {
            return Err(invalid(format!(
                "relay.batch_window_ms = {} would stall the relay for too long at a time: use at \
                 most {MAX_READ_LINGER_MS} (milliseconds; 0 never waits)",
                self.relay.batch_window_ms
            )));
        }
        if self.relay.repair_interval_ms == 0 {
            return Err(invalid("relay.repair_interval_ms must be positive"));
        }
        if self.relay.max_in_flight_events == 0 || self.relay.max_in_flight_bytes == 0 {
            return Err(invalid("relay.max_in_flight_* must be positive"));
        }
        if let Some(l) = &self.metrics.listen {
            l.parse::<std::net::SocketAddr>()
                .map_err(|e| invalid(format!("metrics.listen = {l:?}: {e}")))?;
        }
        if s.status_interval_ms == 0 {
            return Err(invalid("source.status_interval_ms must be positive"));
        }
        if s.recovery_window > Duration::from_secs(366 * 86_400) {
            return Err(invalid(
                "source.recovery_window is over a year: use at most \"366d\" (it bounds how far \
                 back a recovery reads the outbox)",
            ));
        }
        if s.slot_create_timeout < Duration::from_secs(1)
            || s.slot_create_timeout > Duration::from_secs(366 * 86_400)
        {
            return Err(invalid(
                "source.slot_create_timeout must be between 1 s and a year (\"366d\"): it bounds \
                 how long a slot's creation waits for older transactions before the session \
                 names them and retries",
            ));
        }
        if s.state_interval_ms == 0 {
            return Err(invalid("source.state_interval_ms must be positive"));
        }
        if self.replay.rate == 0 || self.replay.rate > i32::MAX as u32 {
            return Err(invalid(
                "replay.rate must be a positive number of events per second",
            ));
        }
        self.validate_cleanup()?;
        self.shadow.validate().map_err(invalid)
    }

    fn validate_cleanup(&self) -> Result<(), ConfigError> {
        let c = &self.cleanup;
        let window = self.source.recovery_window;
        if let Some(r) = c.retention {
            // A lost slot's gap is republished from the table: rows the window may need stay.
            if r < window {
                return Err(invalid(format!(
                    "cleanup.retention ({}) is shorter than source.recovery_window ({}): a lost \
                     slot's gap is republished from rows created within that window, so they \
                     must still be there; use a retention of at least {}",
                    humantime::format_duration(r),
                    humantime::format_duration(window),
                    humantime::format_duration(window)
                )));
            }
        }
        if c.every.is_some() && c.retention.is_none() {
            return Err(invalid(
                "cleanup.every is set but cleanup.retention is not: say how long rows are kept \
                 (e.g. retention = \"7d\")",
            ));
        }
        if c.batch_size == 0 || c.batch_size > 100_000 {
            return Err(invalid(
                "cleanup.batch_size must be 1..=100000 (default 1000)",
            ));
        }
        if c.max_rows_per_run == 0 {
            return Err(invalid("cleanup.max_rows_per_run must be positive"));
        }
        if let Some(dsn) = &c.dsn {
            parse_dsn("cleanup.dsn", dsn)?;
        }
        Ok(())
    }
}

/// `[A-Za-z_][A-Za-z0-9_$]*`, at most 63 bytes: safe to quote and splice.
fn plain_ident(p: &str) -> bool {
    p.len() <= 63
        && p.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
}

/// A DSN the relay connects with, or the reason it cannot be read (never the DSN itself: it may
/// hold a password).
fn parse_dsn(key: &str, dsn: &str) -> Result<tokio_postgres::Config, ConfigError> {
    tokio_postgres::Config::from_str(dsn)
        .map_err(|e| invalid(format!("{key} is not a valid Postgres DSN: {e}")))
}
