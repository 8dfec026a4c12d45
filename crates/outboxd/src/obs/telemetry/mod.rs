//! OpenTelemetry trace export (issue 43): one PRODUCER span per relayed event whose row carries
//! a sampled W3C `traceparent` (`span`), a few INTERNAL spans of the relay's own work
//! (`ops`), exported over OTLP (gRPC or HTTP/protobuf).
//!
//! The exporter never slows delivery: a finished span goes into a bounded queue with
//! `try_send` (a full queue drops it and counts it in `outboxd_trace_spans_dropped_total`),
//! and one thread of its own exports batches from that queue. A failed export (receiver down,
//! slow, refusing) drops its batch, counted the same way; the next batch tries again, so the
//! exporter reconnects by itself. One [`Traces`] per relay (it lives in the relay's
//! `Observed`, created by the first producer), shared by its sessions; nothing is global.

mod http_client;
pub mod ids;
pub mod ops;
pub(crate) mod span;

use crate::config::telemetry::{Protocol, TelemetryConfig};
use opentelemetry::trace::{Link, SpanKind, TraceId};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    Sampler, SamplingDecision, SamplingResult, SdkTracer, SdkTracerProvider, ShouldSample,
    SpanData, SpanExporter as _, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Mutex;
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

/// Publish spans (PRODUCER) follow their row: parent-based, rows without a trace sampled at
/// `root_sample_ratio`. The relay's own spans (INTERNAL, `ops`) are few and always kept.
#[derive(Debug, Clone)]
struct Sampling {
    publish: Sampler,
}

impl ShouldSample for Sampling {
    fn should_sample(
        &self,
        parent: Option<&Context>,
        trace: TraceId,
        name: &str,
        kind: &SpanKind,
        attrs: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        match kind {
            SpanKind::Internal => {
                Sampler::AlwaysOn.should_sample(parent, trace, name, kind, attrs, links)
            }
            _ => self
                .publish
                .should_sample(parent, trace, name, kind, attrs, links),
        }
    }
}

/// One relay's trace pipeline: the tracer, the export thread behind it, and the events whose
/// delivery failed (their next publish span gets an id of its own, [`ids::publish_span`]).
pub struct Traces {
    tracer: Option<SdkTracer>,
    provider: Option<SdkTracerProvider>,
    /// Fires when the export thread ended (after its last export).
    done: Mutex<Receiver<()>>,
    failed: Mutex<HashMap<String, u32>>,
    root_sample_ratio: f64,
    /// Where a span start puts the ids its span takes ([`ids`]).
    next: ids::Next,
}

impl std::fmt::Debug for Traces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Traces")
    }
}

/// Failed events remembered at most (a relay failing this many distinct events is halted or
/// parking them; past it, retries draw random span ids).
const FAILED_CAP: usize = 100_000;

impl Traces {
    /// The pipeline for `cfg` (`None` when telemetry is off). Errors name the setting.
    pub fn start(
        cfg: &TelemetryConfig,
        redactor: &crate::config::secrets::Redactor,
    ) -> Result<Option<Self>, String> {
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
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let thread_cfg = cfg.clone();
        let thread_redactor = redactor.clone();
        let thread_resource = resource.clone();
        std::thread::Builder::new()
            .name("outboxd-otlp".into())
            .spawn(move || {
                export_loop(thread_cfg, thread_redactor, thread_resource, rx, ready_tx);
                let _ = done_tx.send(());
            })
            .map_err(|e| format!("cannot start the trace export thread: {e}"))?;
        ready_rx
            .recv()
            .map_err(|_| "the trace export thread ended at start".to_string())??;
        tracing::info!(endpoint = %cfg.shown_endpoint(), protocol = ?cfg.protocol(), "exporting traces (OTLP)");
        if cfg.headers_in_plain_text() {
            tracing::warn!(
                endpoint = %cfg.shown_endpoint(),
                "telemetry.headers (an API key?) go to a plain-text http:// endpoint: anyone on \
                 the path can read them; use https://"
            );
        }
        let publish =
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.root_sample_ratio)));
        let next = ids::Next::default();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Queue { tx })
            .with_sampler(Sampling { publish })
            .with_id_generator(ids::Derived::new(next.clone()))
            .with_resource(resource)
            .build();
        use opentelemetry::trace::TracerProvider as _;
        Ok(Some(Self {
            tracer: Some(provider.tracer("outboxd")),
            provider: Some(provider),
            done: Mutex::new(done_rx),
            failed: Mutex::new(HashMap::new()),
            root_sample_ratio: cfg.root_sample_ratio,
            next,
        }))
    }

    fn tracer(&self) -> &SdkTracer {
        self.tracer.as_ref().expect("set until drop")
    }

    /// Builds one span with the given ids (`None`: random); every span start goes through
    /// here, so they take turns on the handover ([`ids::Next`]).
    fn build<T>(
        &self,
        span: Option<opentelemetry::trace::SpanId>,
        trace: Option<TraceId>,
        build: impl FnOnce(&SdkTracer) -> T,
    ) -> T {
        self.next.with_ids(span, trace, || build(self.tracer()))
    }

    /// How often this relay failed to deliver `event_id` (0: never, or it was delivered since).
    fn failures(&self, event_id: &str) -> u32 {
        self.failed
            .lock()
            .ok()
            .and_then(|f| f.get(event_id).copied())
            .unwrap_or(0)
    }

    /// Notes a failed (`true`) or a successful delivery of `event_id`.
    fn note(&self, event_id: &str, failed: bool) {
        let Ok(mut f) = self.failed.lock() else {
            return;
        };
        if !failed {
            f.remove(event_id);
        } else if let Some(n) = f.get_mut(event_id) {
            *n = n.saturating_add(1);
        } else if f.len() < FAILED_CAP {
            f.insert(event_id.to_string(), 1);
        }
    }

    /// Would a root span in `trace` be sampled (the same decision the SDK makes)?
    fn samples_root(&self, trace: TraceId) -> bool {
        let r = Sampler::TraceIdRatioBased(self.root_sample_ratio).should_sample(
            None,
            trace,
            "",
            &SpanKind::Producer,
            &[],
            &[],
        );
        matches!(r.decision, SamplingDecision::RecordAndSample)
    }
}

impl Drop for Traces {
    /// Lets the export thread ship what is queued (bounded: 2 s), so the last spans of a relay
    /// that stops cleanly are not lost.
    fn drop(&mut self) {
        self.tracer.take();
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
        if let Ok(done) = self.done.lock() {
            let _ = done.recv_timeout(Duration::from_secs(2));
        }
    }
}

fn build_exporter(cfg: &TelemetryConfig) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let url = cfg.traces_url().unwrap_or_default();
    let timeout = Duration::from_millis(cfg.timeout_ms.unwrap_or(10_000));
    let headers = cfg.header_pairs().map_err(|e| e.to_string())?;
    // The SDK has no explicit "none": left unset, it reads OTEL_EXPORTER_OTLP_(TRACES_)
    // COMPRESSION itself, so a file's `none` does not undo a process-wide `gzip` (documented).
    let gzip = cfg.gzip().then_some(opentelemetry_otlp::Compression::Gzip);
    let https = url.starts_with("https://");
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
            // The SDK adds OTEL_EXPORTER_OTLP_(TRACES_)HEADERS to the metadata itself; the
            // interceptor runs after it and sends exactly the configured headers.
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(url.clone())
                .with_timeout(timeout)
                .with_interceptor(move |mut req: tonic::Request<()>| {
                    *req.metadata_mut() = meta.clone();
                    Ok(req)
                });
            if https {
                b = b.with_tls_config(tls(cfg)?);
            }
            if let Some(c) = gzip {
                b = b.with_compression(c);
            }
            b.build()
        }
        Protocol::HttpProtobuf => {
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(url)
                .with_timeout(timeout)
                .with_http_client(http_client::HttpClient::new(cfg, timeout, headers)?);
            if let Some(c) = gzip {
                b = b.with_compression(c);
            }
            b.build()
        }
    };
    built.map_err(|e| format!("cannot build the OTLP trace exporter: {e}"))
}

/// gRPC over TLS: the CAs of `telemetry.certificate`, else the Mozilla roots (as for Postgres:
/// what public OTLP services chain to, and no dependency on the image's CA bundle).
fn tls(
    cfg: &TelemetryConfig,
) -> Result<opentelemetry_otlp::tonic_types::transport::ClientTlsConfig, String> {
    use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig, Identity};
    let mut t = ClientTlsConfig::new();
    t = match &cfg.certificate {
        Some(ca) => t.ca_certificate(Certificate::from_pem(read_tls_file("certificate", ca)?)),
        None => t.trust_anchors(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    };
    if let (Some(c), Some(k)) = (&cfg.client_certificate, &cfg.client_key) {
        t = t.identity(Identity::from_pem(
            read_tls_file("client_certificate", c)?,
            read_tls_file("client_key", k)?,
        ));
    }
    Ok(t)
}

/// A TLS file of `[telemetry]`; the error names the key (never the contents).
fn read_tls_file(key: &str, path: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("telemetry.{key} {path:?} cannot be read: {e}"))
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
