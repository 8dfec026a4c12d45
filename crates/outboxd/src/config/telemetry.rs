//! `[telemetry]`: OpenTelemetry trace export (issue 43), configured the way every OpenTelemetry
//! component is. Each key mirrors a standard `OTEL_*` variable; a key the file (or an
//! `OUTBOXD_TELEMETRY_*` override) sets wins, an unset one is filled from the `OTEL_*`
//! variable. Off unless an endpoint is configured; `OTEL_SDK_DISABLED=true` turns it off anyway.

use super::{invalid, lenient, lenient_some, ConfigError};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`: the receiver's base address (HTTP appends `/v1/traces`).
    #[serde(default)]
    pub endpoint: Option<String>,
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: the traces address, used as is.
    #[serde(default)]
    pub traces_endpoint: Option<String>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`: `grpc` (default) or `http/protobuf`.
    #[serde(default)]
    pub protocol: Option<String>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS`: `key=value,key2=value2` (values URL-decoded).
    /// Secrets: they usually carry an API key; the redactor scrubs every value.
    #[serde(default)]
    pub headers: Option<String>,
    /// `OTEL_SERVICE_NAME` (default `outboxd`).
    #[serde(default)]
    pub service_name: Option<String>,
    /// `OTEL_RESOURCE_ATTRIBUTES`: `key=value,...`.
    #[serde(default)]
    pub resource_attributes: Option<String>,
    /// `OTEL_SDK_DISABLED`.
    #[serde(default, deserialize_with = "lenient_some")]
    pub disabled: Option<bool>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)CERTIFICATE`: PEM file of the CA that signed the receiver's
    /// certificate (gRPC over TLS).
    #[serde(default)]
    pub certificate: Option<String>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)CLIENT_CERTIFICATE` / `_CLIENT_KEY`: mutual TLS (gRPC).
    #[serde(default)]
    pub client_certificate: Option<String>,
    #[serde(default)]
    pub client_key: Option<String>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT` in ms (default 10000): one export's limit.
    #[serde(default, deserialize_with = "lenient_some")]
    pub timeout_ms: Option<u64>,
    /// `OTEL_BSP_MAX_QUEUE_SIZE` (default 2048): finished spans waiting for export; beyond it
    /// spans are dropped (and counted), never waited for.
    #[serde(default, deserialize_with = "lenient_some")]
    pub max_queue_size: Option<usize>,
    /// `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (default 512).
    #[serde(default, deserialize_with = "lenient_some")]
    pub max_export_batch_size: Option<usize>,
    /// `OTEL_BSP_SCHEDULE_DELAY` in ms (default 1000): the longest a span waits for its batch.
    #[serde(default, deserialize_with = "lenient_some")]
    pub schedule_delay_ms: Option<u64>,
    /// Rows without a `traceparent` get a root span with this probability (0: none, the
    /// default; 1: all). Rows with one follow its sampled flag (parent-based).
    #[serde(default, deserialize_with = "lenient")]
    pub root_sample_ratio: f64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            traces_endpoint: None,
            protocol: None,
            headers: None,
            service_name: None,
            resource_attributes: None,
            disabled: None,
            certificate: None,
            client_certificate: None,
            client_key: None,
            timeout_ms: None,
            max_queue_size: None,
            max_export_batch_size: None,
            schedule_delay_ms: None,
            root_sample_ratio: 0.0,
        }
    }
}

/// The OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    HttpProtobuf,
}

impl TelemetryConfig {
    /// Fills the keys left unset from the standard `OTEL_*` variables (signal-specific
    /// `OTEL_EXPORTER_OTLP_TRACES_*` before the general ones, as the specification says).
    pub fn fill_from_env(&mut self, env: &[(String, String)]) {
        let get = |names: &[&str]| {
            names.iter().find_map(|n| {
                env.iter()
                    .find(|(k, v)| k == n && !v.trim().is_empty())
                    .map(|(_, v)| v.trim().to_string())
            })
        };
        let fill = |slot: &mut Option<String>, names: &[&str]| {
            if slot.is_none() {
                *slot = get(names);
            }
        };
        fill(&mut self.endpoint, &["OTEL_EXPORTER_OTLP_ENDPOINT"]);
        fill(
            &mut self.traces_endpoint,
            &["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"],
        );
        let pair = |s: &str| {
            [
                format!("OTEL_EXPORTER_OTLP_TRACES_{s}"),
                format!("OTEL_EXPORTER_OTLP_{s}"),
            ]
        };
        for (slot, s) in [
            (&mut self.protocol, "PROTOCOL"),
            (&mut self.headers, "HEADERS"),
            (&mut self.certificate, "CERTIFICATE"),
            (&mut self.client_certificate, "CLIENT_CERTIFICATE"),
            (&mut self.client_key, "CLIENT_KEY"),
        ] {
            let [a, b] = pair(s);
            fill(slot, &[&a, &b]);
        }
        fill(&mut self.service_name, &["OTEL_SERVICE_NAME"]);
        fill(&mut self.resource_attributes, &["OTEL_RESOURCE_ATTRIBUTES"]);
        let num = |names: &[&str]| get(names).and_then(|v| v.parse().ok());
        if self.timeout_ms.is_none() {
            let [a, b] = pair("TIMEOUT");
            self.timeout_ms = num(&[&a, &b]);
        }
        if self.max_queue_size.is_none() {
            self.max_queue_size = num(&["OTEL_BSP_MAX_QUEUE_SIZE"]).map(|v: u64| v as usize);
        }
        if self.max_export_batch_size.is_none() {
            self.max_export_batch_size =
                num(&["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"]).map(|v: u64| v as usize);
        }
        if self.schedule_delay_ms.is_none() {
            self.schedule_delay_ms = num(&["OTEL_BSP_SCHEDULE_DELAY"]);
        }
        if let Some(d) = get(&["OTEL_SDK_DISABLED"]) {
            if d.eq_ignore_ascii_case("true") {
                self.disabled = Some(true);
            }
        }
    }

    /// Whether spans are exported at all: an endpoint is set and the SDK is not disabled.
    pub fn enabled(&self) -> bool {
        self.disabled != Some(true) && (self.endpoint.is_some() || self.traces_endpoint.is_some())
    }

    pub fn protocol(&self) -> Protocol {
        match self.protocol.as_deref().map(str::trim) {
            Some("http/protobuf") => Protocol::HttpProtobuf,
            _ => Protocol::Grpc,
        }
    }

    /// The traces address the exporter sends to.
    pub fn traces_url(&self) -> Option<String> {
        if let Some(t) = &self.traces_endpoint {
            return Some(t.clone());
        }
        let base = self.endpoint.as_deref()?;
        Some(match self.protocol() {
            Protocol::Grpc => base.to_string(),
            Protocol::HttpProtobuf => format!("{}/v1/traces", base.trim_end_matches('/')),
        })
    }

    /// The export headers as pairs (URL-decoded values).
    pub fn header_pairs(&self) -> Vec<(String, String)> {
        pairs(self.headers.as_deref().unwrap_or(""))
    }

    /// The resource attributes as pairs.
    pub fn resource_pairs(&self) -> Vec<(String, String)> {
        pairs(self.resource_attributes.as_deref().unwrap_or(""))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.root_sample_ratio) {
            return Err(invalid(format!(
                "telemetry.root_sample_ratio = {} is outside 0..=1: it is the probability that a \
                 row without a traceparent gets a root span (0: none, 1: all)",
                self.root_sample_ratio
            )));
        }
        if let Some(p) = self.protocol.as_deref().map(str::trim) {
            if !matches!(p, "grpc" | "http/protobuf") {
                return Err(invalid(format!(
                    "telemetry.protocol (OTEL_EXPORTER_OTLP_PROTOCOL) = {p:?} is not supported: \
                     use \"grpc\" or \"http/protobuf\""
                )));
            }
        }
        if !self.enabled() {
            return Ok(());
        }
        let url = self.traces_url().unwrap_or_default();
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(invalid(format!(
                "telemetry endpoint {url:?} is not an http:// or https:// address: set \
                 telemetry.endpoint (OTEL_EXPORTER_OTLP_ENDPOINT) to e.g. http://collector:4317"
            )));
        }
        if self.protocol() == Protocol::HttpProtobuf && url.starts_with("https://") {
            return Err(invalid(
                "telemetry: https with protocol http/protobuf is not built in; use protocol \
                 \"grpc\" (TLS with telemetry.certificate) or a collector on http://",
            ));
        }
        if url.starts_with("https://") && self.certificate.is_none() {
            return Err(invalid(
                "telemetry: an https:// endpoint needs telemetry.certificate \
                 (OTEL_EXPORTER_OTLP_CERTIFICATE), the PEM of the CA that signed the receiver's \
                 certificate: no root store is built in for the trace exporter",
            ));
        }
        for (k, v) in self.header_pairs() {
            if k.is_empty() || v.is_empty() {
                return Err(invalid(format!(
                    "telemetry.headers (OTEL_EXPORTER_OTLP_HEADERS): entry {k:?} has no \
                     key=value form; write key1=value1,key2=value2"
                )));
            }
        }
        if self.client_certificate.is_some() != self.client_key.is_some() {
            return Err(invalid(
                "telemetry.client_certificate and telemetry.client_key go together (mutual TLS): \
                 set both or neither",
            ));
        }
        if self.max_queue_size == Some(0) || self.max_export_batch_size == Some(0) {
            return Err(invalid(
                "telemetry.max_queue_size and max_export_batch_size must be at least 1",
            ));
        }
        Ok(())
    }
}

/// `k=v,k2=v2` with percent-decoded values (the OpenTelemetry list format).
fn pairs(s: &str) -> Vec<(String, String)> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (k.trim().to_string(), percent_decode(v.trim())),
            None => (p.trim().to_string(), String::new()),
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn off_without_an_endpoint_and_filled_from_otel_env() {
        let mut t = TelemetryConfig::default();
        assert!(!t.enabled());
        t.fill_from_env(&env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=a%20b,other=c"),
            ("OTEL_SERVICE_NAME", "relay-1"),
        ]));
        assert!(t.enabled());
        assert_eq!(t.traces_url().unwrap(), "http://c:4318/v1/traces");
        assert_eq!(
            t.header_pairs(),
            [
                ("x-api-key".into(), "a b".into()),
                ("other".into(), "c".into())
            ]
        );
        assert_eq!(t.service_name.as_deref(), Some("relay-1"));
        t.validate().unwrap();
        t.fill_from_env(&env(&[("OTEL_SDK_DISABLED", "true")]));
        assert!(!t.enabled());
    }

    #[test]
    fn the_file_wins_over_otel_env_and_bad_values_are_refused() {
        let mut t = TelemetryConfig {
            endpoint: Some("http://file:4317".into()),
            ..Default::default()
        };
        t.fill_from_env(&env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4317")]));
        assert_eq!(t.traces_url().unwrap(), "http://file:4317");
        t.root_sample_ratio = 1.5;
        assert!(t
            .validate()
            .unwrap_err()
            .to_string()
            .contains("root_sample_ratio"));
        t.root_sample_ratio = 0.5;
        t.protocol = Some("http/json".into());
        assert!(t
            .validate()
            .unwrap_err()
            .to_string()
            .contains("http/protobuf"));
        t.protocol = None;
        t.endpoint = Some("collector:4317".into());
        assert!(t.validate().unwrap_err().to_string().contains("http://"));
    }

    #[test]
    fn a_config_reads_otel_env_and_redacts_the_export_headers() {
        let base = "[source]\ndsn = \"postgres://u@h/db\"\n[sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n";
        let c = crate::Config::from_toml_and_env(
            base,
            env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    "x-api-key=very-secret-api-key",
                ),
                ("OUTBOXD_TELEMETRY_ROOT_SAMPLE_RATIO", "0.25"),
            ]),
        )
        .unwrap();
        assert!(c.telemetry.enabled());
        assert_eq!(c.telemetry.root_sample_ratio, 0.25);
        let shown = c
            .redactor
            .scrub("export failed: header x-api-key=very-secret-api-key");
        assert!(!shown.contains("very-secret-api-key"), "{shown}");
        let e = crate::Config::from_toml_and_env(
            &format!("{base}[telemetry]\nendpoint = \"https://c:4317\"\n"),
            Vec::<(String, String)>::new(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("telemetry.certificate"), "{e}");
    }
}
