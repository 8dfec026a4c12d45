//! OpenTelemetry trace export (issue 43): one PRODUCER span per relayed event whose row carries
//! a sampled W3C `traceparent` (`span`), a few INTERNAL spans of the relay's own work
//! (`ops`), exported over OTLP (gRPC or HTTP/protobuf).
//!
//! The exporter never slows delivery: a finished span goes into a bounded queue with
//! `try_send` (a full queue drops it and counts it in `outboxd_trace_spans_dropped_total`),
//! and one thread of its own exports batches from that queue. A publish span travels as a
//! fixed-size record ([`record`]); the export thread turns it into OTLP. The thread sleeps until
//! a batch is queued or the schedule delay passed (it is woken once per batch, not per span).
//! A failed export (receiver down, slow, refusing) drops its batch, counted the same way; the
//! next batch tries again, so the exporter reconnects by itself. One [`Traces`] per relay (it lives in the relay's
//! `Observed`, created by the first producer), shared by its sessions; nothing is global.

mod http_client;
pub mod ids;
pub mod ops;
mod record;
pub(crate) mod span;

use crate::config::telemetry::{Protocol, TelemetryConfig};
use opentelemetry::trace::{SpanId, SpanKind, TraceId};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    IdGenerator as _, RandomIdGenerator, Sampler, SamplingDecision, SdkTracer, SdkTracerProvider,
    ShouldSample, SpanData, SpanExporter as _, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::{Duration, Instant};

pub use span::Telemetry;

/// Counts spans that never reached the receiver.
fn dropped(n: usize) {
    metrics::counter!(crate::obs::TRACE_SPANS_DROPPED).increment(n as u64);
}

/// Spans the export queue holds by default (`max_queue_size`): 2.5 s of spans at 26k events/s,
/// 0.5 s at the ~130k events/s a backlog drains at (queued items are pointers: ~1.5 MB).
const DEFAULT_QUEUE: usize = 65_536;

/// What the queue carries: a publish span's record, or a span of the relay's own work (built
/// by the SDK, `ops`).
enum Item {
    Publish(Box<record::Record>),
    Sdk(Box<SpanData>),
}

/// Hands finished spans to the export thread without ever waiting; wakes it once a batch is
/// queued (waking it per span would cost a context switch per span).
#[derive(Debug, Clone)]
struct Handoff {
    tx: SyncSender<Item>,
    queued: Arc<AtomicUsize>,
    batch: usize,
    exporter: Thread,
}

impl Handoff {
    fn send(&self, item: Item) {
        match self.tx.try_send(item) {
            Ok(()) => {
                if self.queued.fetch_add(1, Ordering::Relaxed) + 1 >= self.batch {
                    self.exporter.unpark();
                }
            }
            Err(_) => dropped(1),
        }
    }
}

impl std::fmt::Debug for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Item")
    }
}

/// The relay's own spans (`ops`), from the SDK into the same queue.
#[derive(Debug)]
struct Queue(Handoff);

impl SpanProcessor for Queue {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        self.0.send(Item::Sdk(Box::new(span)));
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// One relay's trace pipeline: the queue to the export thread, the SDK tracer of the relay's
/// own spans, and the events whose delivery failed (their next publish span gets an id of its
/// own, [`ids::publish_span`]).
pub struct Traces {
    handoff: Option<Handoff>,
    tracer: Option<SdkTracer>,
    provider: Option<SdkTracerProvider>,
    /// Fires when the export thread ended (after its last export).
    done: Mutex<Receiver<()>>,
    failed: Mutex<HashMap<String, u32>>,
    /// How many events `failed` holds: while none, no span start or end takes its lock.
    failing: AtomicUsize,
    root: Sampler,
    random: RandomIdGenerator,
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
        let (tx, rx) = std::sync::mpsc::sync_channel(cfg.max_queue_size.unwrap_or(DEFAULT_QUEUE));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let thread_cfg = cfg.clone();
        let thread_redactor = redactor.clone();
        let thread_resource = resource.clone();
        let queued = Arc::new(AtomicUsize::new(0));
        let thread_queued = queued.clone();
        let exporter = std::thread::Builder::new()
            .name("outboxd-otlp".into())
            .spawn(move || {
                let q = (rx, thread_queued);
                export_loop(thread_cfg, thread_redactor, thread_resource, q, ready_tx);
                let _ = done_tx.send(());
            })
            .map_err(|e| format!("cannot start the trace export thread: {e}"))?;
        let handoff = Handoff {
            tx,
            queued,
            batch: cfg.max_export_batch_size.unwrap_or(512),
            exporter: exporter.thread().clone(),
        };
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
        // The SDK builds only the relay's own spans (INTERNAL, a handful per session: always
        // sampled); publish spans are sampled in `span` (parent-based, roots by `root`).
        let provider = SdkTracerProvider::builder()
            .with_span_processor(Queue(handoff.clone()))
            .with_sampler(Sampler::AlwaysOn)
            .with_resource(resource)
            .build();
        use opentelemetry::trace::TracerProvider as _;
        Ok(Some(Self {
            handoff: Some(handoff),
            tracer: Some(provider.tracer("outboxd")),
            provider: Some(provider),
            done: Mutex::new(done_rx),
            failed: Mutex::new(HashMap::new()),
            failing: AtomicUsize::new(0),
            root: Sampler::TraceIdRatioBased(cfg.root_sample_ratio),
            random: RandomIdGenerator::default(),
        }))
    }

    fn tracer(&self) -> &SdkTracer {
        self.tracer.as_ref().expect("set until drop")
    }

    /// Queues a finished span for export (dropped and counted when the queue is full).
    fn send(&self, item: Item) {
        match &self.handoff {
            Some(h) => h.send(item),
            None => dropped(1),
        }
    }

    fn random_span_id(&self) -> SpanId {
        self.random.new_span_id()
    }

    /// How often this relay failed to deliver `event_id` (0: never, or it was delivered since).
    fn failures(&self, event_id: &str) -> u32 {
        if self.failing.load(Ordering::Acquire) == 0 {
            return 0;
        }
        self.failed
            .lock()
            .ok()
            .and_then(|f| f.get(event_id).copied())
            .unwrap_or(0)
    }

    /// Notes a failed (`true`) or a successful delivery of `event_id`.
    fn note(&self, event_id: &str, failed: bool) {
        if !failed && self.failing.load(Ordering::Acquire) == 0 {
            return;
        }
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
        self.failing.store(f.len(), Ordering::Release);
    }

    /// Would a root span in `trace` be sampled (the same decision the SDK makes)?
    fn samples_root(&self, trace: TraceId) -> bool {
        let r = self
            .root
            .should_sample(None, trace, "", &SpanKind::Producer, &[], &[]);
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
        // The last sender gone, the woken thread exports what is queued and ends.
        if let Some(h) = self.handoff.take() {
            let exporter = h.exporter.clone();
            drop(h);
            exporter.unpark();
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
    (rx, queued): (Receiver<Item>, Arc<AtomicUsize>),
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
    let scope = opentelemetry::InstrumentationScope::builder("outboxd").build();
    let mut failing = false;
    // While exports fail, one attempt per schedule delay: the batches between are dropped
    // (counted) without being encoded.
    let mut tried = Instant::now();
    let mut open = true;
    while open {
        let mut batch = Vec::with_capacity(max.min(4096));
        let deadline = Instant::now() + delay;
        // Sleeps until a batch is queued (the sender wakes it) or the delay passed.
        loop {
            while batch.len() < max {
                match rx.try_recv() {
                    Ok(item) => batch.push(item),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
                queued.fetch_sub(1, Ordering::Relaxed);
            }
            let now = Instant::now();
            if batch.len() >= max || !open || now >= deadline {
                break;
            }
            std::thread::park_timeout(deadline - now);
        }
        if batch.is_empty() {
            continue;
        }
        let n = batch.len();
        if failing && tried.elapsed() < delay && open {
            dropped(n);
            continue;
        }
        tried = Instant::now();
        let batch = batch
            .into_iter()
            .map(|item| match item {
                Item::Publish(r) => r.into_span_data(&scope),
                Item::Sdk(s) => *s,
            })
            .collect();
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
