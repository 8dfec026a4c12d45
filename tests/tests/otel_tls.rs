//! OpenTelemetry over TLS (issue 43): the relay exports its publish spans to `https://` OTLP
//! receivers trusting the CA of `telemetry.certificate` — gRPC (tonic's server TLS) and
//! HTTP/protobuf (HTTP/1.1 by hand on tokio-rustls), both requiring a client certificate
//! (mutual TLS), both with gzip bodies — and a receiver signed by another CA is a named failure that never holds
//! delivery: the spans are dropped and counted, every record arrives.
//!
//! The receivers decode with the OpenTelemetry project's generated protocol code
//! (`opentelemetry-proto`); certificates come from `outboxd_tests::certs`.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use outboxd_tests::certs::Ca;
use outboxd_tests::testkit::free_port;
use outboxd_tests::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use uuid::Uuid;

const TOPIC: &str = "outbox.event.order";

/// What a receiver got: the spans, and each request's body encoding (`identity` when none).
#[derive(Clone, Default)]
struct Received {
    spans: Arc<Mutex<Vec<Span>>>,
    encodings: Arc<Mutex<Vec<String>>>,
}

impl Received {
    fn add(&self, req: ExportTraceServiceRequest, encoding: &str) {
        let mut all = self.spans.lock().unwrap();
        for rs in req.resource_spans {
            for ss in rs.scope_spans {
                all.extend(ss.spans);
            }
        }
        self.encodings.lock().unwrap().push(encoding.to_string());
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    fn encodings(&self) -> Vec<String> {
        self.encodings.lock().unwrap().clone()
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
        self.add(req.into_inner(), &encoding);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The receiver's certificate and key, and the CA file the relay is told to trust.
struct Tls {
    cert: String,
    key: String,
    /// The CA that signed `cert`: what mutual TLS checks client certificates against.
    ca: String,
}

/// An OTLP/gRPC receiver over TLS on `port` (gzip accepted) that requires a client certificate
/// signed by `tls.ca`, until the sender is dropped.
fn grpc_receiver(port: u16, r: Received, tls: &Tls) -> tokio::sync::oneshot::Sender<()> {
    use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
    // tonic's server TLS takes the process's rustls provider, and this test binary has both
    // ring and aws-lc: pick ring (the relay's own TLS names its provider and needs none).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let config = ServerTlsConfig::new()
        .identity(Identity::from_pem(&tls.cert, &tls.key))
        .client_ca_root(Certificate::from_pem(&tls.ca));
    tokio::spawn(async move {
        Server::builder()
            .tls_config(config)
            .expect("server TLS")
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

/// An OTLP/HTTP (protobuf) receiver over TLS on `port` that requires a client certificate
/// signed by `tls.ca`: HTTP/1.1 by hand (a `Content-Length` body to `/v1/traces`, gzip or
/// not), the body decoded by the generated protocol code.
async fn http_receiver(port: u16, r: Received, tls: &Tls) -> anyhow::Result<()> {
    use prost::Message as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
                let Ok(mut sock) = acceptor.accept(sock).await else {
                    return;
                };
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
                            std::io::Read::read_to_end(
                                &mut flate2::read::GzDecoder::new(body),
                                &mut out,
                            )
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
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if sock.write_all(ok.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(())
}

fn attr(s: &Span, k: &str) -> Option<String> {
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

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// A row whose `traceparent` is sampled, in trace `trace`.
async fn insert_sampled(
    c: &tokio_postgres::Client,
    agg: &str,
    trace: &str,
) -> anyhow::Result<Uuid> {
    let id = Uuid::now_v7();
    let headers = format!(r#"{{"traceparent": "00-{trace}-40f067aa0ba902b7-01"}}"#);
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers) \
         VALUES ($1, 'order', $2, 1, 'OrderPlaced', '{\"n\": 1}', $3::text::jsonb)",
        &[&id, &agg, &headers],
    )
    .await?;
    Ok(id)
}

/// A server certificate for 127.0.0.1 signed by `ca`.
fn server_tls(ca: &Ca) -> anyhow::Result<Tls> {
    let (cert, key) = ca.server(&["127.0.0.1"])?;
    Ok(Tls {
        cert,
        key,
        ca: ca.cert.pem(),
    })
}

/// Writes `pem` into the test's directory; its path.
fn write(env: &Env, name: &str, pem: &str) -> anyhow::Result<PathBuf> {
    let path = env.dir.path().join(name);
    std::fs::write(&path, pem)?;
    Ok(path)
}

/// `[telemetry]` to `https://127.0.0.1:PORT` trusting the CA file `ca`, gzip on, no client
/// certificate.
fn telemetry_toml(port: u16, protocol: &str, ca: &std::path::Path) -> String {
    format!(
        "[telemetry]\nendpoint = \"https://127.0.0.1:{port}\"\nprotocol = \"{protocol}\"\n\
         certificate = \"{}\"\ncompression = \"gzip\"\nschedule_delay_ms = 200\n\
         timeout_ms = 2000\nheaders = \"x-api-key=otel-secret-key\"\n",
        ca.display()
    )
}

/// One sampled row through the in-process relay exporting over `protocol` with a client
/// certificate of `ca`: its span arrives at `got` gzip-compressed, child of the row's span, and
/// the record continues it.
async fn one_span_arrives(
    name: &str,
    protocol: &str,
    port: u16,
    ca: &Ca,
    got: &Received,
    trace: &str,
) -> anyhow::Result<()> {
    let mut env = Env::start(name).await?;
    let ca_file = write(&env, "ca.pem", &ca.cert.pem())?;
    let (client_cert, client_key) = ca.sign(rcgen::CertificateParams::new(vec![
        "outboxd-relay".to_string(),
    ])?)?;
    env.extra_toml = format!(
        "{}client_certificate = \"{}\"\nclient_key = \"{}\"\n",
        telemetry_toml(port, protocol, &ca_file),
        write(&env, "client.pem", &client_cert)?.display(),
        write(&env, "client.key", &client_key)?.display(),
    );
    create_topics(&env.bootstrap(), &[TOPIC], 1).await?;
    let relay = Relay::start(env.config()?);
    let c = env.sql().await?;
    let id = insert_sampled(&c, "t-1", trace).await?;
    let recs = read_topic(&env.bootstrap(), TOPIC, 1, Duration::from_secs(30))?;
    eventually(Duration::from_secs(20), || async {
        Ok(!got.spans().is_empty())
    })
    .await?;
    let s = &got.spans()[0];
    assert_eq!(hex(&s.trace_id), trace);
    assert_eq!(hex(&s.parent_span_id), "40f067aa0ba902b7");
    assert_eq!(attr(s, "messaging.message.id"), Some(id.to_string()));
    assert_eq!(
        recs[0].header("traceparent"),
        format!("00-{trace}-{}-01", hex(&s.span_id))
    );
    let encodings = got.encodings();
    assert!(encodings.iter().all(|e| e == "gzip"), "{encodings:?}");
    relay.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_grpc_with_mutual_tls_and_gzip() -> anyhow::Result<()> {
    let ca = Ca::new("outboxd OTLP test CA")?;
    let port = free_port();
    let got = Received::default();
    let _stop = grpc_receiver(port, got.clone(), &server_tls(&ca)?);
    let trace = "8bf92f3577b34da6a3ce929d0e0e4736";
    one_span_arrives("otel_tls_grpc", "grpc", port, &ca, &got, trace).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_http_protobuf_with_mutual_tls_and_gzip() -> anyhow::Result<()> {
    let ca = Ca::new("outboxd OTLP test CA")?;
    let port = free_port();
    let got = Received::default();
    http_receiver(port, got.clone(), &server_tls(&ca)?).await?;
    let trace = "9bf92f3577b34da6a3ce929d0e0e4736";
    one_span_arrives("otel_tls_http", "http/protobuf", port, &ca, &got, trace).await
}

/// The receiver's certificate is signed by another CA than `telemetry.certificate`: the relay
/// process delivers every record, counts the spans it could not export, and its log names the
/// cause (`named`).
async fn a_wrong_ca_never_holds_delivery(
    name: &str,
    protocol: &str,
    named: &[&str],
) -> anyhow::Result<()> {
    let theirs = Ca::new("the receiver's CA")?;
    let tls = server_tls(&theirs)?;
    let port = free_port();
    let got = Received::default();
    let _stop = match protocol {
        "grpc" => Some(grpc_receiver(port, got.clone(), &tls)),
        _ => {
            http_receiver(port, got.clone(), &tls).await?;
            None
        }
    };
    let maddr = format!("127.0.0.1:{}", free_port());
    let mut env = Env::start(name).await?;
    let ours = Ca::new("some other CA")?;
    let ca_file = write(&env, "ca.pem", &ours.cert.pem())?;
    env.extra_toml = format!(
        "{}[metrics]\nlisten = \"{maddr}\"\n",
        telemetry_toml(port, protocol, &ca_file)
    );
    create_topics(&env.bootstrap(), &[TOPIC], 1).await?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&env.config_file()?, log.clone())?;
    let c = env.sql().await?;
    for i in 0..10 {
        insert_sampled(&c, &format!("w-{i}"), "abf92f3577b34da6a3ce929d0e0e4736").await?;
    }
    let recs = read_topic(&env.bootstrap(), TOPIC, 10, Duration::from_secs(30))?;
    assert_eq!(recs.len(), 10, "delivery goes on");
    let dropped = || {
        http_get(&maddr, "/metrics")
            .1
            .lines()
            .find(|l| l.starts_with("outboxd_trace_spans_dropped_total"))
            .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    eventually(Duration::from_secs(30), || async { Ok(dropped() >= 10.0) }).await?;
    let text = std::fs::read_to_string(&log)?;
    let _ = relay.child.kill();
    let _ = relay.child.wait();
    assert!(got.spans().is_empty(), "no span crossed an untrusted TLS");
    for n in named {
        assert!(text.contains(n), "the log names {n:?}: {text}");
    }
    assert!(
        !text.contains("otel-secret-key"),
        "an export header in the log"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_over_grpc_drops_and_counts_spans_and_never_holds_delivery() -> anyhow::Result<()>
{
    a_wrong_ca_never_holds_delivery(
        "otel_tls_wrong_grpc",
        "grpc",
        &["trace export failed", "UnknownIssuer"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_over_http_drops_and_counts_spans_and_never_holds_delivery() -> anyhow::Result<()>
{
    a_wrong_ca_never_holds_delivery(
        "otel_tls_wrong_http",
        "http/protobuf",
        &[
            "trace export failed",
            "UnknownIssuer",
            "telemetry.certificate",
        ],
    )
    .await
}
