//! An OTLP trace receiver on the OpenTelemetry project's generated protocol code
//! (`opentelemetry-proto`: its tonic gRPC server, and its messages decoding an HTTP/protobuf
//! body), for the tests of outboxd's trace export (tests/otel*.rs). Nothing here decodes the
//! protocol by hand: a span outboxd encoded wrongly fails to decode.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::sync::{Arc, Mutex};

/// Every span the receiver got, in arrival order.
#[derive(Clone, Default)]
pub struct Received(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut all = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            for ss in rs.scope_spans {
                all.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Received {
    pub fn spans(&self) -> Vec<Span> {
        self.0.lock().unwrap().clone()
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

/// An OTLP/gRPC receiver on `port` until the returned sender is dropped or fired.
pub fn receiver(port: u16, r: Received) -> tokio::sync::oneshot::Sender<()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(r))
            .serve_with_shutdown(([127, 0, 0, 1], port).into(), async {
                let _ = rx.await;
            })
            .await
            .expect("OTLP receiver");
    });
    tx
}

/// An OTLP/HTTP (protobuf) receiver on `port`: HTTP/1.1 by hand (the exporter sends a
/// `Content-Length` body to `/v1/traces`), the body decoded by the generated protocol code.
pub async fn http_receiver(port: u16, r: Received) -> anyhow::Result<()> {
    use prost::Message as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = l.accept().await {
            let r = r.clone();
            tokio::spawn(async move {
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
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 8192];
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let req =
                        ExportTraceServiceRequest::decode(&buf[head_end..head_end + len]).unwrap();
                    {
                        let mut all = r.0.lock().unwrap();
                        for rs in req.resource_spans {
                            for ss in rs.scope_spans {
                                all.extend(ss.spans);
                            }
                        }
                    }
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
