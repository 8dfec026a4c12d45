//! The librdkafka configuration of every client outboxd creates (producer, consumers of the
//! checks): the defaults it picks, the user's `[sink.kafka]` properties, and the two the
//! delivery guarantee needs, which no setting overrides.

use crate::config::Config;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};

/// The librdkafka properties outboxd insists on or defaults, merged with the user's.
pub fn client_config(cfg: &Config) -> ClientConfig {
    let mut cc = ClientConfig::new();
    // Defaults the user may override. linger.ms 1 (librdkafka's is 5): the relay gathers live
    // transactions itself, and only when there are others to gather (relay::gulp); librdkafka's
    // linger only has to cover handing such a burst over, so it goes out as one request per
    // partition (docs/benchmarks.md, "Adaptive batching").
    cc.set("linger.ms", "1")
        .set("message.timeout.ms", "0")
        .set("retry.backoff.ms", "100")
        .set("retry.backoff.max.ms", "2000")
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .set("statistics.interval.ms", "5000")
        .set("client.id", "outboxd");
    // OpenSSL is built in (vendored): its compiled-in CA directory is not the system's, so
    // public CAs (Confluent Cloud, MSK) are found by librdkafka's probe of the usual bundle
    // paths unless the user names a CA.
    let kafka = &cfg.sink.kafka;
    probe_ca(kafka, &mut cc);
    // With `sasl.oauthbearer.method = "oidc"` outboxd fetches the tokens (crate::relay::kafka::oidc):
    // librdkafka, built without libcurl, would refuse those properties.
    let oidc = kafka
        .get("sasl.oauthbearer.method")
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("oidc"));
    for (k, v) in kafka {
        // The guarantee's own keys are set below, once: passing an alias as well would let
        // librdkafka apply the two in hash-map order (validation allows only safe values).
        let enforced = matches!(
            k.as_str(),
            "enable.idempotence" | "acks" | "request.required.acks"
        );
        let ours = oidc && crate::config::oidc::is_oidc_key(k);
        if !(enforced || ours) {
            cc.set(k, v);
        }
    }
    // Required for the delivery guarantee (config validation rejects contrary settings):
    cc.set("enable.idempotence", "true").set("acks", "all");
    cc.set_log_level(RDKafkaLogLevel::Warning);
    cc
}

/// Over TLS without a CA of the user's, librdkafka probes the usual bundle paths: the vendored
/// OpenSSL's compiled-in CA directory is not the system's (producer and consumers alike).
pub(super) fn probe_ca(kafka: &std::collections::BTreeMap<String, String>, cc: &mut ClientConfig) {
    let tls = kafka
        .get("security.protocol")
        .is_some_and(|p| p.to_ascii_lowercase().contains("ssl"));
    if tls
        && !["ssl.ca.location", "ssl.ca.pem", "ssl.ca.certificate.stores"]
            .iter()
            .any(|k| kafka.contains_key(*k))
    {
        cc.set("ssl.ca.location", "probe");
    }
}
