//! The OTLP/HTTP client: reqwest on rustls (ring), with the trust and identity of
//! `[telemetry]`, its failures logged with the cause, and exactly the configured headers on
//! every request (issue 53: the file's `headers` win over `OTEL_EXPORTER_OTLP_HEADERS`).

use super::read_tls_file;
use crate::config::telemetry::TelemetryConfig;
use std::time::Duration;

/// The rustls settings of the OTLP/HTTP client: the same trust and identity as [`tls`], on ring
/// chosen explicitly (aws-lc is in the build too, so no process-wide default exists).
fn http_tls(cfg: &TelemetryConfig) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = |key: &str, path: &str| {
        CertificateDer::pem_slice_iter(&read_tls_file(key, path)?)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("telemetry.{key} {path:?}: {e}"))
    };
    let mut roots = rustls::RootCertStore::empty();
    match &cfg.certificate {
        Some(ca) => {
            for cert in certs("certificate", ca)? {
                roots
                    .add(cert)
                    .map_err(|e| format!("telemetry.certificate {ca:?}: {e}"))?;
            }
            if roots.is_empty() {
                return Err(format!(
                    "telemetry.certificate {ca:?} holds no PEM certificate"
                ));
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("telemetry TLS: {e}"))?
        .with_root_certificates(roots);
    let mut config = match (&cfg.client_certificate, &cfg.client_key) {
        (Some(c), Some(k)) => {
            let key = PrivateKeyDer::from_pem_slice(&read_tls_file("client_key", k)?)
                .map_err(|e| format!("telemetry.client_key {k:?}: {e}"))?;
            builder
                .with_client_auth_cert(certs("client_certificate", c)?, key)
                .map_err(|e| format!("telemetry.client_certificate / client_key: {e}"))?
        }
        _ => builder.with_no_client_auth(),
    };
    // The client speaks HTTP/1.1 only (reqwest without http2).
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The OTLP/HTTP client: reqwest on [`http_tls`]. The exporter reports any failure to send as
/// "network error" (debug-logged only), so a wrong CA would be a mystery: this client logs the
/// cause itself (once per change, source chain, no URL) with what to fix.
/// It also sets the export headers on each request: the SDK adds
/// `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS` from the process environment to every request, so the
/// names those variables hold are taken off and exactly the configured headers sent (the
/// file's `headers` win, as documented).
pub(super) struct HttpClient {
    inner: reqwest::Client,
    last_error: std::sync::Mutex<Option<String>>,
    headers: Vec<(hyper::header::HeaderName, hyper::header::HeaderValue)>,
    from_env: Vec<hyper::header::HeaderName>,
}

/// Never prints the header values.
impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HttpClient({} headers)", self.headers.len())
    }
}

impl HttpClient {
    pub(super) fn new(
        cfg: &TelemetryConfig,
        timeout: Duration,
        headers: Vec<(String, String)>,
    ) -> Result<Self, String> {
        let inner = reqwest::Client::builder()
            .tls_backend_preconfigured(http_tls(cfg)?)
            .timeout(timeout)
            .build()
            .map_err(|e| format!("cannot build the OTLP/HTTP client: {e}"))?;
        let headers = headers
            .into_iter()
            .map(|(k, v)| {
                let name = hyper::header::HeaderName::try_from(k.as_str())
                    .map_err(|_| format!("telemetry.headers: {k:?} is not an HTTP header name"))?;
                let value = hyper::header::HeaderValue::try_from(v).map_err(|_| {
                    format!(
                        "telemetry.headers: the value of {k:?} is not a valid HTTP header value"
                    )
                })?;
                Ok((name, value))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let from_env = cfg
            .env_header_names
            .iter()
            .filter_map(|n| hyper::header::HeaderName::try_from(n.as_str()).ok())
            .collect();
        Ok(Self {
            inner,
            last_error: std::sync::Mutex::new(None),
            headers,
            from_env,
        })
    }

    /// The failure and its causes, without the request's URL.
    fn describe(e: &reqwest::Error) -> String {
        let mut out = if e.is_timeout() {
            "timed out (telemetry.timeout_ms)".to_string()
        } else {
            "cannot send".to_string()
        };
        let mut next = std::error::Error::source(e);
        while let Some(cause) = next {
            out.push_str(": ");
            out.push_str(&cause.to_string());
            next = cause.source();
        }
        let l = out.to_ascii_lowercase();
        if l.contains("unknownissuer") || l.contains("unknown issuer") {
            out.push_str(
                " (the receiver's certificate is not signed by a CA in telemetry.certificate, \
                 or by a public CA when it is unset: point telemetry.certificate at the CA \
                 that signed it)",
            );
        } else if l.contains("notvalidforname") || l.contains("not valid for name") {
            out.push_str(
                " (the receiver's certificate does not list the endpoint's host: use a name \
                 it lists in telemetry.endpoint)",
            );
        } else if l.contains("certificaterequired") || l.contains("certificate required") {
            out.push_str(
                " (the receiver wants a client certificate: set telemetry.client_certificate \
                 and telemetry.client_key)",
            );
        }
        out
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for HttpClient {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<opentelemetry_http::Bytes>,
    ) -> Result<
        opentelemetry_http::Response<opentelemetry_http::Bytes>,
        opentelemetry_http::HttpError,
    > {
        let mut request = request;
        for name in &self.from_env {
            request.headers_mut().remove(name);
        }
        for (k, v) in &self.headers {
            request.headers_mut().insert(k.clone(), v.clone());
        }
        let result = self.inner.send_bytes(request).await;
        let now = match &result {
            Ok(_) => None,
            Err(e) => Some(match e.downcast_ref::<reqwest::Error>() {
                Some(e) => Self::describe(e),
                None => e.to_string(),
            }),
        };
        let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(now) = &now {
            if last.as_ref() != Some(now) {
                tracing::warn!("trace export over OTLP/HTTP {now}");
            }
        }
        *last = now;
        result
    }
}
