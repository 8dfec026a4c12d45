//! `[telemetry]`: OpenTelemetry trace export (issue 43), configured the way every OpenTelemetry
//! component is. Each key mirrors a standard `OTEL_*` variable; a key the file (or an
//! `OUTBOXD_TELEMETRY_*` override) sets wins, an unset one is filled from the `OTEL_*`
//! variable. Off unless an endpoint is configured; `OTEL_SDK_DISABLED=true` turns it off anyway.

use super::otlp_headers as headers;
use super::{invalid, lenient, lenient_some, ConfigError};
use serde::Deserialize;

/// `Debug` (below) shows the header names, never their values, and the endpoints without
/// their user info.
#[derive(Clone, Deserialize)]
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
    /// `OTEL_EXPORTER_OTLP_(TRACES_)CERTIFICATE`: PEM file of the CA(s) that signed the
    /// receiver's certificate (both protocols). Unset, an `https://` receiver is checked against
    /// the Mozilla roots, as `source.sslrootcert` is: what public OTLP services chain to.
    #[serde(default)]
    pub certificate: Option<String>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)CLIENT_CERTIFICATE` / `_CLIENT_KEY`: mutual TLS (PEM files).
    #[serde(default)]
    pub client_certificate: Option<String>,
    #[serde(default)]
    pub client_key: Option<String>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)INSECURE`: decides the transport of a gRPC endpoint written
    /// without a scheme (`collector:4317`): `true` plain text, else TLS (the specification's
    /// rule). An `http://` or `https://` endpoint says it itself; HTTP/protobuf needs a scheme.
    #[serde(default, deserialize_with = "lenient_some")]
    pub insecure: Option<bool>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)COMPRESSION`: `gzip` or `none` (the default).
    #[serde(default)]
    pub compression: Option<String>,
    /// `OTEL_*` values [`Self::fill_from_env`] could not read, refused by [`Self::validate`]
    /// naming the variable (a typo must not silently mean "plain text").
    #[serde(skip)]
    pub env_errors: Vec<String>,
    /// The header names the `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS` variables hold: the SDK reads
    /// those variables itself and adds them to every export, so the exporter takes them off
    /// again (the file's `headers` win, as every other key of the file does).
    #[serde(skip)]
    pub env_header_names: Vec<String>,
    /// `OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT` in ms (default 10000): one export's limit.
    #[serde(default, deserialize_with = "lenient_some")]
    pub timeout_ms: Option<u64>,
    /// `OTEL_BSP_MAX_QUEUE_SIZE` (default 65536, not the specification's 2048: that overflowed
    /// a backlog): finished spans waiting for export; beyond it spans are dropped (and
    /// counted), never waited for.
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
            insecure: None,
            compression: None,
            env_errors: Vec::new(),
            env_header_names: Vec::new(),
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
        for name in pair_names("HEADERS") {
            if let Some((_, v)) = env.iter().find(|(k, _)| *k == name) {
                self.env_header_names.extend(headers::names(v));
            }
        }
        fill(&mut self.endpoint, &["OTEL_EXPORTER_OTLP_ENDPOINT"]);
        fill(
            &mut self.traces_endpoint,
            &["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"],
        );
        let pair = pair_names;
        for (slot, s) in [
            (&mut self.protocol, "PROTOCOL"),
            (&mut self.headers, "HEADERS"),
            (&mut self.certificate, "CERTIFICATE"),
            (&mut self.client_certificate, "CLIENT_CERTIFICATE"),
            (&mut self.client_key, "CLIENT_KEY"),
            (&mut self.compression, "COMPRESSION"),
        ] {
            let [a, b] = pair(s);
            fill(slot, &[&a, &b]);
        }
        if self.insecure.is_none() {
            let [a, b] = pair("INSECURE");
            let found = [&a, &b]
                .into_iter()
                .find_map(|n| get(&[n.as_str()]).map(|v| (n.clone(), v)));
            if let Some((name, v)) = found {
                match v.to_ascii_lowercase().as_str() {
                    "true" => self.insecure = Some(true),
                    "false" => self.insecure = Some(false),
                    _ => self.env_errors.push(format!(
                        "{name} = {v:?} is not a boolean: use \"true\" (plain text for a gRPC \
                         endpoint without a scheme) or \"false\""
                    )),
                }
            }
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

    /// The traces address the exporter sends to. A gRPC address without a scheme gets
    /// `https://`, or `http://` with `insecure = true` (the OTLP exporter specification).
    pub fn traces_url(&self) -> Option<String> {
        let url = match (&self.traces_endpoint, self.endpoint.as_deref()) {
            (Some(t), _) => t.clone(),
            (None, Some(base)) if self.protocol() == Protocol::HttpProtobuf => {
                format!("{}/v1/traces", base.trim_end_matches('/'))
            }
            (None, Some(base)) => base.to_string(),
            (None, None) => return None,
        };
        let has_scheme = url
            .split_once("://")
            .is_some_and(|(scheme, _)| !scheme.contains(['/', '?', '#']));
        Some(match self.protocol() {
            Protocol::Grpc if !has_scheme => {
                let scheme = if self.insecure == Some(true) {
                    "http"
                } else {
                    "https"
                };
                format!("{scheme}://{url}")
            }
            _ => url,
        })
    }

    /// Whether export bodies are gzip-compressed (`compression = "gzip"`).
    pub fn gzip(&self) -> bool {
        self.compression
            .as_deref()
            .is_some_and(|c| c.trim().eq_ignore_ascii_case("gzip"))
    }

    /// The export headers as pairs (URL-decoded values); an error names the header, never
    /// its value.
    pub fn header_pairs(&self) -> Result<Vec<(String, String)>, headers::HeaderError> {
        headers::parse(self.headers.as_deref().unwrap_or(""))
    }

    /// The resource attributes as pairs.
    pub fn resource_pairs(&self) -> Vec<(String, String)> {
        headers::lenient_pairs(self.resource_attributes.as_deref().unwrap_or(""))
    }

    /// The traces address as logs and views show it: without user info (a credential).
    pub fn shown_endpoint(&self) -> String {
        headers::without_user_info(&self.traces_url().unwrap_or_default())
    }

    /// Headers (an API key) would travel in plain text: export on, an `http://` endpoint and
    /// headers set. The relay warns once at start.
    pub fn headers_in_plain_text(&self) -> bool {
        self.enabled()
            && self.traces_url().is_some_and(|u| u.starts_with("http://"))
            && self.header_pairs().is_ok_and(|h| !h.is_empty())
    }

    /// Every secret of this section as written and as meant, for the redactor: header values
    /// (even of a list that does not parse) and the endpoints' user-info passwords.
    pub fn secret_texts(&self) -> Vec<String> {
        let mut out = headers::secret_texts(self.headers.as_deref().unwrap_or(""));
        for url in [&self.endpoint, &self.traces_endpoint]
            .into_iter()
            .flatten()
        {
            out.extend(headers::url_password_texts(url));
        }
        out
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
        if let Some(e) = self.env_errors.first() {
            return Err(invalid(format!("telemetry: {e}")));
        }
        if let Some(c) = self.compression.as_deref().map(str::trim) {
            if !(c.eq_ignore_ascii_case("gzip") || c.eq_ignore_ascii_case("none")) {
                return Err(invalid(format!(
                    "telemetry.compression (OTEL_EXPORTER_OTLP_COMPRESSION) = {c:?} is not \
                     supported: use \"gzip\" or \"none\""
                )));
            }
        }
        let url = self.traces_url().unwrap_or_default();
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(invalid(format!(
                "telemetry endpoint {url:?} is not an http:// or https:// address: set \
                 telemetry.endpoint (OTEL_EXPORTER_OTLP_ENDPOINT) to e.g. http://collector:4318 \
                 (protocol http/protobuf needs the scheme; a gRPC address without one means TLS, \
                 or plain text with telemetry.insecure = true)"
            )));
        }
        let tls_files = [
            ("certificate", &self.certificate),
            ("client_certificate", &self.client_certificate),
        ];
        if let (false, Some((key, _))) = (
            url.starts_with("https://"),
            tls_files.iter().find(|(_, v)| v.is_some()),
        ) {
            return Err(invalid(format!(
                "telemetry.{key} is set but the endpoint {url:?} is plain text (http://): the \
                 spans would travel unencrypted; use an https:// endpoint, or drop the \
                 certificate settings"
            )));
        }
        self.header_pairs().map_err(|e| invalid(e.to_string()))?;
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

/// `OTEL_EXPORTER_OTLP_TRACES_<s>` before `OTEL_EXPORTER_OTLP_<s>` (the specification's order).
fn pair_names(s: &str) -> [String; 2] {
    [
        format!("OTEL_EXPORTER_OTLP_TRACES_{s}"),
        format!("OTEL_EXPORTER_OTLP_{s}"),
    ]
}

impl std::fmt::Debug for TelemetryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let url = |u: &Option<String>| u.as_deref().map(headers::without_user_info);
        let names = self.headers.as_deref().map(headers::names);
        f.debug_struct("TelemetryConfig")
            .field("endpoint", &url(&self.endpoint))
            .field("traces_endpoint", &url(&self.traces_endpoint))
            .field("protocol", &self.protocol)
            .field("headers (names; values redacted)", &names)
            .field("service_name", &self.service_name)
            .field("resource_attributes", &self.resource_attributes)
            .field("disabled", &self.disabled)
            .field("certificate", &self.certificate)
            .field("client_certificate", &self.client_certificate)
            .field("client_key", &self.client_key)
            .field("insecure", &self.insecure)
            .field("compression", &self.compression)
            .field("env_errors", &self.env_errors)
            .field("env_header_names", &self.env_header_names)
            .field("timeout_ms", &self.timeout_ms)
            .field("max_queue_size", &self.max_queue_size)
            .field("max_export_batch_size", &self.max_export_batch_size)
            .field("schedule_delay_ms", &self.schedule_delay_ms)
            .field("root_sample_ratio", &self.root_sample_ratio)
            .finish()
    }
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
            t.header_pairs().unwrap(),
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
        t.protocol = Some("http/protobuf".into());
        t.endpoint = Some("collector:4318".into());
        assert!(t.validate().unwrap_err().to_string().contains("http://"));
    }

    #[test]
    fn insecure_and_compression_mirror_otel_env_and_the_file_wins() {
        let mut t = TelemetryConfig {
            endpoint: Some("collector:4317".into()),
            ..Default::default()
        };
        // The specification's rule: a gRPC address without a scheme is TLS unless insecure.
        assert_eq!(t.traces_url().unwrap(), "https://collector:4317");
        t.fill_from_env(&env(&[
            ("OTEL_EXPORTER_OTLP_INSECURE", "false"),
            ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "TRUE"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
        ]));
        assert_eq!(t.insecure, Some(true), "the traces variable comes first");
        assert_eq!(t.traces_url().unwrap(), "http://collector:4317");
        assert!(t.gzip());
        t.validate().unwrap();
        // A scheme decides by itself: insecure does not turn https into plain text.
        t.endpoint = Some("https://collector:4317".into());
        assert_eq!(t.traces_url().unwrap(), "https://collector:4317");

        let mut f = TelemetryConfig {
            endpoint: Some("collector:4317".into()),
            insecure: Some(false),
            compression: Some("none".into()),
            ..Default::default()
        };
        f.fill_from_env(&env(&[
            ("OTEL_EXPORTER_OTLP_INSECURE", "true"),
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip"),
        ]));
        assert_eq!(f.traces_url().unwrap(), "https://collector:4317");
        assert!(!f.gzip(), "the file's none wins");
        f.validate().unwrap();
    }

    #[test]
    fn bad_insecure_or_compression_values_are_refused_naming_the_setting() {
        let on = || TelemetryConfig {
            endpoint: Some("http://c:4317".into()),
            ..Default::default()
        };
        let mut t = on();
        t.fill_from_env(&env(&[("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "yes")]));
        assert_eq!(t.insecure, None);
        let e = t.validate().unwrap_err().to_string();
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_TRACES_INSECURE") && e.contains("\"yes\""),
            "{e}"
        );
        let mut t = on();
        t.fill_from_env(&env(&[("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd")]));
        let e = t.validate().unwrap_err().to_string();
        assert!(
            e.contains("telemetry.compression")
                && e.contains("OTEL_EXPORTER_OTLP_COMPRESSION")
                && e.contains("\"gzip\" or \"none\""),
            "{e}"
        );
        // Telemetry off: an unrelated component's OTEL_* settings do not stop the relay.
        let mut off = TelemetryConfig::default();
        off.fill_from_env(&env(&[
            ("OTEL_EXPORTER_OTLP_INSECURE", "yes"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd"),
        ]));
        off.validate().unwrap();
    }

    #[test]
    fn https_works_for_both_protocols_and_tls_files_need_it() {
        let mut t = TelemetryConfig {
            endpoint: Some("https://api.honeycomb.io".into()),
            protocol: Some("http/protobuf".into()),
            ..Default::default()
        };
        // No certificate: the Mozilla roots (a public receiver).
        t.validate().unwrap();
        assert_eq!(
            t.traces_url().unwrap(),
            "https://api.honeycomb.io/v1/traces"
        );
        t.fill_from_env(&env(&[
            (
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
                "/tls/client.pem",
            ),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/tls/client.key"),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/tls/ca.pem"),
        ]));
        assert_eq!(t.client_certificate.as_deref(), Some("/tls/client.pem"));
        assert_eq!(t.client_key.as_deref(), Some("/tls/client.key"));
        t.validate().unwrap();
        t.endpoint = Some("http://collector:4318".into());
        let e = t.validate().unwrap_err().to_string();
        assert!(
            e.contains("telemetry.certificate") && e.contains("https://"),
            "{e}"
        );
        t.certificate = None;
        let e = t.validate().unwrap_err().to_string();
        assert!(e.contains("telemetry.client_certificate"), "{e}");
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
            &format!("{base}[telemetry]\nendpoint = \"c:4317\"\ncompression = \"brotli\"\n"),
            Vec::<(String, String)>::new(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("telemetry.compression"), "{e}");
        // The OUTBOXD_TELEMETRY_* override is a file setting: it wins over OTEL_*.
        let c = crate::Config::from_toml_and_env(
            &format!("{base}[telemetry]\nendpoint = \"c:4317\"\n"),
            env(&[
                ("OUTBOXD_TELEMETRY_INSECURE", "true"),
                ("OTEL_EXPORTER_OTLP_INSECURE", "false"),
            ]),
        )
        .unwrap();
        assert_eq!(c.telemetry.traces_url().unwrap(), "http://c:4317");
    }

    /// Issue 53: `x=key%2é` panicked on every configuration load (tracing on or off) and the
    /// panic printed the value. Now: tracing on, a configuration error naming the header's key
    /// only; tracing off, the relay starts (another component's OTEL_* settings do not stop
    /// it). Either way the value is a secret the redactor knows.
    #[test]
    fn a_malformed_otel_header_is_an_error_naming_the_key_and_never_a_panic() {
        let base = "[source]\ndsn = \"postgres://u@h/db\"\n[sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n";
        let bad = ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=key%2é-Mk4");
        let off = crate::Config::from_toml_and_env(base, env(&[bad])).unwrap();
        assert!(!off.telemetry.enabled());
        assert!(!off.redactor.scrub("key%2é-Mk4").contains("Mk4"));
        let e = crate::Config::from_toml_and_env(
            base,
            env(&[bad, ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4317")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("\"x-api-key\"") && e.contains("percent-encoding") && !e.contains("Mk4"),
            "{e}"
        );
    }

    /// The documented precedence: a key the file sets wins over its OTEL_* variable, headers
    /// included. The SDK reads the variables itself, so the exporter learns which names they
    /// hold (and takes them off every request).
    #[test]
    fn the_files_headers_win_over_otel_env() {
        let mut t = TelemetryConfig {
            endpoint: Some("https://c:4318".into()),
            headers: Some("x-api-key=from-file".into()),
            ..Default::default()
        };
        t.fill_from_env(&env(&[
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "x-api-key=from-env,x-env-only=1",
            ),
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "X-Traces=2"),
        ]));
        assert_eq!(
            t.header_pairs().unwrap(),
            [("x-api-key".into(), "from-file".into())]
        );
        assert_eq!(t.env_header_names, ["x-traces", "x-api-key", "x-env-only"]);
        let shown = format!("{t:?}");
        assert!(
            !shown.contains("from-file") && shown.contains("x-api-key"),
            "{shown}"
        );
    }

    #[test]
    fn plain_text_headers_are_noticed_and_the_endpoint_is_shown_without_user_info() {
        let t = TelemetryConfig {
            endpoint: Some("http://otel:pw-Mk5@c:4318".into()),
            protocol: Some("http/protobuf".into()),
            headers: Some("x-api-key=k".into()),
            ..Default::default()
        };
        assert!(t.headers_in_plain_text());
        assert_eq!(t.shown_endpoint(), "http://c:4318/v1/traces");
        assert!(t.secret_texts().contains(&"pw-Mk5".to_string()));
        assert!(!format!("{t:?}").contains("Mk5"));
        let tls = TelemetryConfig {
            endpoint: Some("https://c:4318".into()),
            ..t.clone()
        };
        assert!(!tls.headers_in_plain_text());
        let none = TelemetryConfig { headers: None, ..t };
        assert!(!none.headers_in_plain_text());
    }
}
