//! OpenTelemetry over TLS (issue 43): the relay exports its publish spans to `https://` OTLP
//! receivers trusting the CA of `telemetry.certificate` — gRPC (tonic's server TLS) and
//! HTTP/protobuf (HTTP/1.1 by hand on tokio-rustls), both requiring a client certificate
//! (mutual TLS), both with gzip bodies — and a receiver signed by another CA is a named failure that never holds
//! delivery: the spans are dropped and counted, every record arrives.
//!
//! The receivers decode with the OpenTelemetry project's generated protocol code
//! (`opentelemetry-proto`); certificates come from `outboxd_tests::certs`.

use outboxd_tests::certs::Ca;
use outboxd_tests::otlp::{first_publish_continues, https_receiver, receiver_on, Received, Tls};
use outboxd_tests::testkit::free_port;
use outboxd_tests::*;
use std::path::PathBuf;
use std::time::Duration;
use uuid::Uuid;

const TOPIC: &str = "outbox.event.order";

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
    first_publish_continues(
        got,
        trace,
        "40f067aa0ba902b7",
        &id.to_string(),
        recs[0].header("traceparent"),
    )
    .await?;
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
    let _stop = receiver_on(port, got.clone(), Some(&server_tls(&ca)?));
    let trace = "8bf92f3577b34da6a3ce929d0e0e4736";
    one_span_arrives("otel_tls_grpc", "grpc", port, &ca, &got, trace).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_http_protobuf_with_mutual_tls_and_gzip() -> anyhow::Result<()> {
    let ca = Ca::new("outboxd OTLP test CA")?;
    let port = free_port();
    let got = Received::default();
    https_receiver(port, got.clone(), &server_tls(&ca)?).await?;
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
        "grpc" => Some(receiver_on(port, got.clone(), Some(&tls))),
        _ => {
            https_receiver(port, got.clone(), &tls).await?;
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
    assert!(
        got.publish_spans().is_empty(),
        "no span crossed an untrusted TLS"
    );
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
