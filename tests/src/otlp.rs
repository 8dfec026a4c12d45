//! An OTLP trace receiver on the OpenTelemetry project's generated protocol code
//! (`opentelemetry-proto`: its tonic gRPC server, and its messages decoding an HTTP/protobuf
//! body), for the tests of outboxd's trace export (tests/otel*.rs), in plain text or over
//! (mutual) TLS. Nothing here decodes the protocol by hand: a span outboxd encoded wrongly fails
//! to decode.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a receiver got: every span in arrival order, and each request's body encoding
/// (`identity` when none).
#[derive(Clone, Default)]
pub struct Received {
    spans: Arc<Mutex<Vec<Span>>>,
    encodings: Arc<Mutex<Vec<String>>>,
    /// The `x-…` headers of every request (name lowercased), in arrival order.
    x_headers: Arc<Mutex<Vec<(String, String)>>>,
}

impl Received {
    fn header(&self, name: &str, value: &str) {
        let name = name.to_ascii_lowercase();
        if name.starts_with("x-") {
            self.x_headers
                .lock()
                .unwrap()
                .push((name, value.trim().to_string()));
        }
    }

    /// The `x-…` headers of every request so far (names lowercased; over HTTP the receiver
    /// lowercases values too).
    pub fn x_headers(&self) -> Vec<(String, String)> {
        self.x_headers.lock().unwrap().clone()
    }

    fn add(&self, req: ExportTraceServiceRequest, encoding: &str) {
        let mut all = self.spans.lock().unwrap();
        for rs in req.resource_spans {
            for ss in rs.scope_spans {
                all.extend(ss.spans);
            }
        }
        self.encodings.lock().unwrap().push(encoding.to_string());
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Each export request's body encoding, in arrival order.
    pub fn encodings(&self) -> Vec<String> {
        self.encodings.lock().unwrap().clone()
    }

    /// The publish spans (kind PRODUCER), without the relay's own (`outboxd session start`…).
    pub fn publish_spans(&self) -> Vec<Span> {
        let producer = opentelemetry_proto::tonic::trace::v1::span::SpanKind::Producer as i32;
        self.spans()
            .into_iter()
            .filter(|s| s.kind == producer)
            .collect()
    }

    /// The spans named `name`.
    pub fn named(&self, name: &str) -> Vec<Span> {
        self.spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let encoding = req
            .metadata()
            .get("grpc-encoding")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("identity")
            .to_string();
        for kv in req.metadata().iter() {
            if let tonic::metadata::KeyAndValueRef::Ascii(k, v) = kv {
                self.header(k.as_str(), v.to_str().unwrap_or_default());
            }
        }
        self.add(req.into_inner(), &encoding);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A receiver's certificate and key, and the CA that signed it (what mutual TLS checks client
/// certificates against).
pub struct Tls {
    pub cert: String,
    pub key: String,
    pub ca: String,
}

/// An OTLP/gRPC receiver on `port` (gzip accepted; over TLS requiring a client certificate
/// signed by `tls.ca` when `tls` is given) until the returned sender is dropped or fired.
pub fn receiver_on(port: u16, r: Received, tls: Option<&Tls>) -> tokio::sync::oneshot::Sender<()> {
    use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let mut server = Server::builder();
    if let Some(tls) = tls {
        // tonic's server TLS takes the process's rustls provider, and test binaries have both
        // ring and aws-lc: pick ring (the relay's own TLS names its provider and needs none).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let config = ServerTlsConfig::new()
            .identity(Identity::from_pem(&tls.cert, &tls.key))
            .client_ca_root(Certificate::from_pem(&tls.ca));
        server = server.tls_config(config).expect("server TLS");
    }
    tokio::spawn(async move {
        server
            .add_service(
                TraceServiceServer::new(r)
                    .accept_compressed(tonic::codec::CompressionEncoding::Gzip),
            )
            .serve_with_shutdown(([127, 0, 0, 1], port).into(), async {
                let _ = rx.await;
            })
            .await
            .expect("OTLP/gRPC receiver");
    });
    tx
}

/// A plain-text OTLP/gRPC receiver on `port` ([`receiver_on`]).
pub fn receiver(port: u16, r: Received) -> tokio::sync::oneshot::Sender<()> {
    receiver_on(port, r, None)
}

/// A plain-text OTLP/HTTP (protobuf) receiver on `port` ([`serve_http`]).
pub async fn http_receiver(port: u16, r: Received) -> anyhow::Result<()> {
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    tokio::spawn(async move {
        while let Ok((sock, _)) = l.accept().await {
            tokio::spawn(serve_http(sock, r.clone()));
        }
    });
    Ok(())
}

/// An OTLP/HTTP (protobuf) receiver over TLS on `port` that requires a client certificate
/// signed by `tls.ca` ([`serve_http`] on tokio-rustls).
pub async fn https_receiver(port: u16, r: Received, tls: &Tls) -> anyhow::Result<()> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(tls.ca.as_bytes())?)?;
    let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(clients)
        .with_single_cert(
            CertificateDer::pem_slice_iter(tls.cert.as_bytes()).collect::<Result<_, _>>()?,
            PrivateKeyDer::from_pem_slice(tls.key.as_bytes())?,
        )?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    tokio::spawn(async move {
        while let Ok((sock, _)) = l.accept().await {
            let (r, acceptor) = (r.clone(), acceptor.clone());
            tokio::spawn(async move {
                // A refused handshake (wrong CA on the relay's side) just ends the connection.
                if let Ok(sock) = acceptor.accept(sock).await {
                    serve_http(sock, r).await;
                }
            });
        }
    });
    Ok(())
}

/// One connection of an OTLP/HTTP receiver: HTTP/1.1 by hand (the exporter sends a
/// `Content-Length` body to `/v1/traces`, gzip or not), each body decoded by the generated
/// protocol code, answered 200.
pub async fn serve_http(mut sock: impl AsyncRead + AsyncWrite + Unpin, r: Received) {
    use prost::Message as _;
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 8192];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        assert!(head.starts_with("post /v1/traces "), "{head}");
        let field = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
        };
        let len: usize = field("content-length:")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let encoding = field("content-encoding:").unwrap_or("identity".into());
        for (k, v) in head.lines().filter_map(|l| l.split_once(':')) {
            r.header(k, v);
        }
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 8192];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = &buf[head_end..head_end + len];
        let body = match encoding.as_str() {
            "gzip" => {
                let mut out = Vec::new();
                std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(body), &mut out)
                    .expect("a gzip body");
                out
            }
            _ => body.to_vec(),
        };
        r.add(
            ExportTraceServiceRequest::decode(body.as_slice()).unwrap(),
            &encoding,
        );
        buf.drain(..head_end + len);
        let ok =
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
        if sock.write_all(ok.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The value of attribute `k` of `s`, as text.
pub fn attr(s: &Span, k: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|a| a.key == k)
        .and_then(|a| a.value.as_ref()?.value.as_ref())
        .map(|v| match v {
            Value::StringValue(s) => s.clone(),
            Value::IntValue(i) => i.to_string(),
            other => format!("{other:?}"),
        })
}

/// Bytes (a trace or span id) as lowercase hex, as a `traceparent` writes them.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// Waits (up to 20 s) for the first publish span and checks it is `event_id`'s, a child of
/// `parent` in `trace`, and that `record_traceparent` (the record's header) continues it.
pub async fn first_publish_continues(
    got: &Received,
    trace: &str,
    parent: &str,
    event_id: &str,
    record_traceparent: &str,
) -> anyhow::Result<Span> {
    crate::eventually(std::time::Duration::from_secs(20), || async {
        Ok(!got.publish_spans().is_empty())
    })
    .await?;
    let s = got.publish_spans().remove(0);
    assert_eq!(hex(&s.trace_id), trace);
    assert_eq!(hex(&s.parent_span_id), parent);
    assert_eq!(attr(&s, "messaging.message.id").as_deref(), Some(event_id));
    assert_eq!(
        record_traceparent,
        format!("00-{trace}-{}-01", hex(&s.span_id))
    );
    Ok(s)
}
