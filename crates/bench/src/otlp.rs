//! The `otel` bench's OTLP/gRPC trace receiver: the OpenTelemetry project's generated tonic
//! server (`opentelemetry-proto`, as in tests/tests/otel.rs), in the bench's own process. It
//! counts the spans it is sent and keeps nothing else: the bench needs how many of the relay's
//! spans arrived, not what they say (tests/tests/otel.rs checks that).

use anyhow::{bail, Result};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Spans received so far.
#[derive(Clone, Default)]
struct Count(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for Count {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let n: usize = req
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|rs| &rs.scope_spans)
            .map(|ss| ss.spans.len())
            .sum();
        self.0.fetch_add(n as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running receiver on 127.0.0.1; it stops when dropped.
pub struct Receiver {
    pub port: u16,
    count: Count,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Receiver {
    /// Starts the receiver on a free port and waits until it accepts connections.
    pub async fn start() -> Result<Self> {
        let port = outboxd_testkit::free_port();
        let count = Count::default();
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let svc = TraceServiceServer::new(count.clone());
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_shutdown(([127, 0, 0, 1], port).into(), async {
                    let _ = rx.await;
                })
                .await
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if server.is_finished() {
                bail!("OTLP receiver on port {port} stopped: {:?}", server.await);
            }
            if Instant::now() > deadline {
                bail!("OTLP receiver on port {port} not listening after 10 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(Self {
            port,
            count,
            _stop: stop,
        })
    }

    /// Spans received since the start.
    pub fn spans(&self) -> u64 {
        self.count.0.load(Ordering::Relaxed)
    }
}

/// A port nothing listens on: the endpoint of a receiver that is down (connections refused).
pub fn closed_port() -> u16 {
    outboxd_testkit::free_port()
}
