//! OpenTelemetry trace export (issue 43): one PRODUCER span per relayed event whose row carries
//! a sampled W3C `traceparent` (`span`), exported over OTLP (gRPC or HTTP/protobuf).
//!
//! The exporter never slows delivery: a finished span goes into a bounded queue with
//! `try_send` (a full queue drops it and counts it in `outboxd_trace_spans_dropped_total`),
//! and one thread of its own exports batches from that queue. A failed export (receiver down,
//! slow, refusing) drops its batch, counted the same way; the next batch tries again, so the
//! exporter reconnects by itself. Spans are per producer (one per session); nothing is global.

pub(crate) mod span;

use crate::config::telemetry::{Protocol, TelemetryConfig};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    Sampler, SdkTracerProvider, SpanData, SpanExporter as _, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

pub use span::Telemetry;

/// Counts spans that never reached the receiver.
fn dropped(n: usize) {
    metrics::counter!(crate::obs::TRACE_SPANS_DROPPED).increment(n as u64);
}

/// Hands finished spans to the export thread without ever waiting.
#[derive(Debug)]
struct Queue {
    tx: SyncSender<SpanData>,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        match self.tx.try_send(span) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => dropped(1),
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Builds the tracer provider for `cfg` (`None` when telemetry is off). Errors name the setting.
pub(crate) fn provider(
    cfg: &TelemetryConfig,
    redactor: &crate::config::secrets::Redactor,
) -> Result<Option<SdkTracerProvider>, String> {
    if !cfg.enabled() {
        return Ok(None);
    }
    let mut attrs: Vec<KeyValue> = cfg
        .resource_pairs()
        .into_iter()
        .map(|(k, v)| KeyValue::new(k, v))
        .collect();
    attrs.push(KeyValue::new(
        "service.name",
        cfg.service_name.clone().unwrap_or_else(|| "outboxd".into()),
    ));
    let resource = Resource::builder_empty().with_attributes(attrs).build();
    let (tx, rx) = std::sync::mpsc::sync_channel(cfg.max_queue_size.unwrap_or(2048));
    let url = cfg.traces_url().unwrap_or_default();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread_cfg = cfg.clone();
    let thread_redactor = redactor.clone();
    let thread_resource = resource.clone();
    std::thread::Builder::new()
        .name("outboxd-otlp".into())
        .spawn(move || export_loop(thread_cfg, thread_redactor, thread_resource, rx, ready_tx))
        .map_err(|e| format!("cannot start the trace export thread: {e}"))?;
    ready_rx
        .recv()
        .map_err(|_| "the trace export thread ended at start".to_string())??;
    tracing::info!(endpoint = %url, protocol = ?cfg.protocol(), "exporting traces (OTLP)");
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.root_sample_ratio)));
    Ok(Some(
        SdkTracerProvider::builder()
            .with_span_processor(Queue { tx })
            .with_sampler(sampler)
            .with_resource(resource)
            .build(),
    ))
}

fn build_exporter(cfg: &TelemetryConfig) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let url = cfg.traces_url().unwrap_or_default();
    let timeout = Duration::from_millis(cfg.timeout_ms.unwrap_or(10_000));
    let headers = cfg.header_pairs();
    let built = match cfg.protocol() {
        Protocol::Grpc => {
            let mut meta = opentelemetry_otlp::tonic_types::metadata::MetadataMap::new();
            for (k, v) in &headers {
                let key = k
                    .parse::<tonic::metadata::MetadataKey<tonic::metadata::Ascii>>()
                    .map_err(|_| format!("telemetry.headers: {k:?} is not a gRPC metadata name"))?;
                let value = v
                    .parse()
                    .map_err(|_| format!("telemetry.headers: the value of {k:?} is not ASCII"))?;
                meta.insert(key, value);
            }
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(url.clone())
                .with_timeout(timeout)
                .with_metadata(meta);
            if url.starts_with("https://") || cfg.certificate.is_some() {
                b = b.with_tls_config(tls(cfg)?);
            }
            b.build()
        }
        Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(url)
            .with_timeout(timeout)
            .with_headers(headers.into_iter().collect())
            .build(),
    };
    built.map_err(|e| format!("cannot build the OTLP trace exporter: {e}"))
}

fn tls(
    cfg: &TelemetryConfig,
) -> Result<opentelemetry_otlp::tonic_types::transport::ClientTlsConfig, String> {
    use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig, Identity};
    let read = |what: &str, p: &str| {
        std::fs::read(p).map_err(|e| format!("telemetry.{what} {p:?} cannot be read: {e}"))
    };
    let mut t = ClientTlsConfig::new();
    if let Some(ca) = &cfg.certificate {
        t = t.ca_certificate(Certificate::from_pem(read("certificate", ca)?));
    }
    if let (Some(c), Some(k)) = (&cfg.client_certificate, &cfg.client_key) {
        t = t.identity(Identity::from_pem(
            read("client_certificate", c)?,
            read("client_key", k)?,
        ));
    }
    Ok(t)
}

/// The export thread: batches of up to `max_export_batch_size` spans, at least every
/// `schedule_delay_ms`; ends (after a last export) when the provider is gone.
fn export_loop(
    cfg: TelemetryConfig,
    redactor: crate::config::secrets::Redactor,
    resource: Resource,
    rx: Receiver<SpanData>,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot start the trace export runtime: {e}")));
            return;
        }
    };
    // tonic's channel is created in (and driven by) this thread's runtime.
    let exporter = {
        let _in = rt.enter();
        build_exporter(&cfg)
    };
    let mut exporter = match exporter {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    exporter.set_resource(&resource);
    let _ = ready.send(Ok(()));
    let max = cfg.max_export_batch_size.unwrap_or(512);
    let delay = Duration::from_millis(cfg.schedule_delay_ms.unwrap_or(1000));
    let mut failing = false;
    let mut open = true;
    while open {
        let mut batch = Vec::new();
        let deadline = Instant::now() + delay;
        while batch.len() < max {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(s) => batch.push(s),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        let n = batch.len();
        match rt.block_on(exporter.export(batch)) {
            Ok(()) => {
                if failing {
                    tracing::info!("trace export works again");
                }
                failing = false;
            }
            Err(e) => {
                dropped(n);
                if !failing {
                    tracing::warn!(
                        dropped = n,
                        "trace export failed (spans are dropped and counted in {} until the \
                         receiver answers; delivery is not affected): {}",
                        crate::obs::TRACE_SPANS_DROPPED,
                        redactor.scrub(&e.to_string())
                    );
                }
                failing = true;
            }
        }
    }
    let _ = exporter.shutdown();
}
