//! Consumers built from `[sink.kafka]`'s connection settings, for the parts of outboxd that read
//! rather than produce: shadow mode's legacy consumer and replay's consumer-group lookup. They
//! take the connection (bootstrap, TLS, SASL) without the producer-only properties, and log
//! through `tracing` with the configuration's secrets scrubbed.

use crate::config::Config;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::ConsumerContext;
use rdkafka::ClientContext;

/// Producer-only librdkafka properties of `[sink.kafka]`, left out of a consumer's config
/// (librdkafka warns about each one otherwise).
const PRODUCER_ONLY: &[&str] = &[
    "acks",
    "request.required.acks",
    "enable.idempotence",
    "linger.ms",
    "queue.buffering.max.ms",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
    "batch.num.messages",
    "batch.size",
    "compression.type",
    "compression.codec",
    "compression.level",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "message.send.max.retries",
    "retries",
    "retry.backoff.ms",
    "retry.backoff.max.ms",
    "request.timeout.ms",
    "partitioner",
    "sticky.partitioning.linger.ms",
    "transactional.id",
    "transaction.timeout.ms",
    "enable.gapless.guarantee",
    "max.in.flight.requests.per.connection",
    "max.in.flight",
];

/// Consumer-group identity: set by the caller, never taken from `[sink.kafka]`.
const GROUP_KEYS: &[&str] = &["group.id", "group.instance.id", "client.id"];

/// A consumer configuration from `[sink.kafka]`: its connection settings, no producer-only
/// properties, `group.id` and `client.id` as given, nothing committed automatically. `Err` says
/// why it cannot be built (OIDC tokens are fetched by outboxd for its producer only).
pub fn config(cfg: &Config, group_id: &str, client_id: &str) -> Result<ClientConfig, String> {
    let kafka = &cfg.sink.kafka;
    if kafka
        .get("sasl.oauthbearer.method")
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("oidc"))
    {
        return Err(
            "sasl.oauthbearer.method = \"oidc\": outboxd fetches OIDC tokens for its producer \
             only, not for consumers"
                .into(),
        );
    }
    let mut cc = ClientConfig::new();
    for (k, v) in kafka {
        if !PRODUCER_ONLY.contains(&k.as_str()) && !GROUP_KEYS.contains(&k.as_str()) {
            cc.set(k, v);
        }
    }
    super::client::probe_ca(kafka, &mut cc);
    cc.set("group.id", group_id)
        .set("client.id", client_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set_log_level(RDKafkaLogLevel::Warning);
    Ok(cc)
}

/// Logs librdkafka's reports through `tracing`, prefixed with `who`, with the configuration's
/// secrets scrubbed.
pub struct Ctx {
    redactor: crate::config::secrets::Redactor,
    who: &'static str,
    /// Warnings and errors at `warn` (else everything at `debug`: for a caller that reports
    /// the failure itself).
    loud: bool,
    /// The newest warning or error librdkafka reported on its own (connection refused, TLS,
    /// SASL), scrubbed.
    last_error: std::sync::Mutex<Option<String>>,
}

impl Ctx {
    pub fn new(cfg: &Config, who: &'static str) -> Self {
        Self {
            redactor: cfg.redactor.clone(),
            who,
            loud: true,
            last_error: Default::default(),
        }
    }

    /// The newest error librdkafka reported on its own, to say why a request timed out.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|e| e.clone())
    }

    /// Everything at `debug`.
    pub fn quiet(cfg: &Config, who: &'static str) -> Self {
        Self {
            loud: false,
            ..Self::new(cfg, who)
        }
    }
}

impl ClientContext for Ctx {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        let msg = self.redactor.scrub(msg);
        let who = self.who;
        match level {
            RDKafkaLogLevel::Debug | RDKafkaLogLevel::Info | RDKafkaLogLevel::Notice => {
                tracing::debug!(target: "librdkafka", fac, "{who}: {msg}")
            }
            _ => {
                if self.loud {
                    tracing::warn!(target: "librdkafka", fac, "{who}: {msg}");
                } else {
                    tracing::debug!(target: "librdkafka", fac, "{who}: {msg}");
                }
                if let Ok(mut last) = self.last_error.lock() {
                    *last = Some(msg);
                }
            }
        }
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        let error = self.redactor.scrub(&error.to_string());
        let reason = self.redactor.scrub(reason);
        if let Ok(mut last) = self.last_error.lock() {
            // Without librdkafka's "[thrd:…]: " prefix.
            let short = match reason.split_once("]: ") {
                Some((thread, rest)) if thread.starts_with("[thrd:") => rest,
                _ => reason.as_str(),
            };
            *last = Some(short.to_string());
        }
        if self.loud {
            tracing::warn!(target: "librdkafka", error = %error, "{}: {reason}", self.who);
        } else {
            tracing::debug!(target: "librdkafka", error = %error, "{}: {reason}", self.who);
        }
    }
}

impl ConsumerContext for Ctx {}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(kafka: &str) -> Config {
        Config::from_toml_and_env(
            &format!(
                "[source]\ndsn = \"postgres://u@h/d\"\nslot = \"s\"\n[sink.kafka]\n\
                 \"bootstrap.servers\" = \"k:9092\"\n{kafka}\n"
            ),
            Vec::<(String, String)>::new(),
        )
        .unwrap()
    }

    #[test]
    fn connection_settings_without_producer_keys_or_group_identity() {
        let c = cfg(
            "\"linger.ms\" = \"5\"\n\"security.protocol\" = \"SASL_SSL\"\n\
             \"group.id\" = \"theirs\"\n\"acks\" = \"all\"",
        );
        let cc = config(&c, "g", "outboxd-x").unwrap();
        assert_eq!(cc.get("bootstrap.servers"), Some("k:9092"));
        assert_eq!(cc.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(cc.get("ssl.ca.location"), Some("probe"));
        assert_eq!(cc.get("group.id"), Some("g"));
        assert_eq!(cc.get("client.id"), Some("outboxd-x"));
        assert_eq!(cc.get("enable.auto.commit"), Some("false"));
        assert_eq!((cc.get("linger.ms"), cc.get("acks")), (None, None));
        let oidc = cfg(
            "\"security.protocol\" = \"SASL_SSL\"\n\"sasl.mechanism\" = \"OAUTHBEARER\"\n\
             \"sasl.oauthbearer.method\" = \"oidc\"\n\"sasl.oauthbearer.client.id\" = \"c\"\n\
             \"sasl.oauthbearer.client.secret\" = \"s\"\n\
             \"sasl.oauthbearer.token.endpoint.url\" = \"https://idp/token\"",
        );
        assert!(config(&oidc, "g", "c").unwrap_err().contains("oidc"));
    }
}
