//! The HTTP listener serving `/metrics`, `/healthz` and `/readyz`, and the status page (`/`,
//! `/status.json`: `obs::status`).
//!
//! Anyone who reaches the port can open connections, and every connection costs a file
//! descriptor the relay shares: it needs descriptors for each Postgres and broker (re)connection.
//! Unbounded, 120 idle sockets under `ulimit -n 64` took them all, Postgres reconnects failed
//! with "Too many open files", and the failing `accept` spun a core (issue 15). So the listener
//! may starve itself, never the relay:
//! - it serves at most [`connection_limit`] connections at once and closes the ones beyond;
//! - a client has [`HEADER_READ_TIMEOUT`] to send each request header and a connection lives at
//!   most [`CONNECTION_DEADLINE`], so idle and slow-loris clients give their slot back;
//! - a failing `accept` (out of descriptors) backs off exponentially instead of retrying at once,
//!   and is logged at most every [`WARN_EVERY`].

use super::Observed;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Most connections served at once. A Prometheus server and a few probes need a handful; 32
/// leaves room for several scrapers without letting the port hold many descriptors.
const MAX_CONNECTIONS: usize = 32;
/// Fewest connections served at once, however low the descriptor limit.
const MIN_CONNECTIONS: usize = 4;
/// Time a client has to send a request header — the first, and each next one on a kept-alive
/// connection. Scrapers and probes send theirs at once; an idle or slow-loris client is closed.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Lifetime of a connection, keep-alive included: a client that reads its response slowly or
/// trickles a request body cannot hold a slot longer. Scrapers reconnect transparently.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(30);
/// At the deadline a response in progress may still finish (graceful close) for this long.
const CLOSE_GRACE: Duration = Duration::from_secs(5);
/// First wait after a failed `accept`; doubles on each further failure up to
/// [`ACCEPT_BACKOFF_MAX`] and starts over after a success. Out of descriptors, `accept` fails
/// at once and the listener stays readable: without a wait the loop spins a core.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one warning about failing `accept`s per this interval: the failures come by the
/// hundred and must not flood the log (nor fill a disk while descriptors are short).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Serves `/metrics`, `/healthz` and `/readyz` until the process ends. Binding is the only
/// error: everything after it stays inside the listener.
pub async fn serve(
    addr: std::net::SocketAddr,
    prom: PrometheusHandle,
    observed: Arc<Observed>,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    let limit = connection_limit();
    tracing::debug!(%addr, limit, "metrics listener: connection limit");
    tokio::spawn(accept_loop(listener, limit, prom, observed));
    Ok(())
}

/// Connections served at once: a quarter of the process's descriptor limit, within
/// [`MIN_CONNECTIONS`]..=[`MAX_CONNECTIONS`]. Under `ulimit -n 64` the listener holds at most
/// 16 (+1 for the listener, +1 briefly for one it closes), leaving the relay the rest.
fn connection_limit() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        libc::RLIM_INFINITY
    };
    usize::try_from(soft / 4)
        .unwrap_or(MAX_CONNECTIONS)
        .clamp(MIN_CONNECTIONS, MAX_CONNECTIONS)
}

/// Accepts connections and serves each in its own task while a slot is free.
///
/// A connection beyond the limit is accepted and closed at once rather than left in the
/// kernel's queue: closing costs its descriptor only for that moment, and keeps the queue
/// drained, so a probe arriving after a flood meets a prompt refusal (and later a free slot)
/// instead of waiting behind hundreds of queued sockets for their header timeouts.
async fn accept_loop(
    listener: TcpListener,
    limit: usize,
    prom: PrometheusHandle,
    observed: Arc<Observed>,
) {
    let slots = Arc::new(Semaphore::new(limit));
    let mut backoff = AcceptBackoff::default();
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                if let Some(failures) = backoff.succeeded() {
                    tracing::info!(failures, "metrics listener: accepting connections again");
                }
                match slots.clone().try_acquire_owned() {
                    Ok(slot) => {
                        tokio::spawn(connection(stream, slot, prom.clone(), observed.clone()));
                    }
                    Err(_) => drop(stream),
                }
            }
            Err(e) => {
                let (wait, warn) = backoff.failed(Instant::now());
                if let Some(failures) = warn {
                    tracing::warn!(
                        error = %e,
                        failures,
                        retry_in_ms = wait.as_millis() as u64,
                        "metrics listener: accepting a connection failed (out of file \
                         descriptors?); backing off — the relay is not affected, /metrics and \
                         the probes may not answer meanwhile"
                    );
                }
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// Serves one connection, holding `slot` until it ends.
async fn connection(
    stream: TcpStream,
    slot: OwnedSemaphorePermit,
    prom: PrometheusHandle,
    observed: Arc<Observed>,
) {
    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let (prom, observed) = (prom.clone(), observed.clone());
        async move { Ok::<_, std::convert::Infallible>(route(&req, &prom, &observed)) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    let mut conn = std::pin::pin!(conn);
    if tokio::time::timeout(CONNECTION_DEADLINE, conn.as_mut())
        .await
        .is_err()
    {
        // Past the deadline: finish a response in progress, close an idle connection now.
        conn.as_mut().graceful_shutdown();
        let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
    }
    drop(slot);
}

fn route(
    req: &Request<hyper::body::Incoming>,
    prom: &PrometheusHandle,
    observed: &Observed,
) -> Response<Full<Bytes>> {
    // The status page: `/`, `/status.json`, and every method but GET and HEAD refused.
    if let Some(r) = super::status::serve::respond(req, observed) {
        return r;
    }
    let health = &observed.health;
    let (status, body) = match req.uri().path() {
        "/metrics" => (StatusCode::OK, prom.render()),
        "/healthz" => (StatusCode::OK, "ok\n".to_string()),
        "/readyz" => match health.not_ready() {
            None => (StatusCode::OK, "ready\n".to_string()),
            Some(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        _ => (StatusCode::NOT_FOUND, "not found\n".to_string()),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

/// The wait after failed `accept`s and when to say so.
#[derive(Debug, Default)]
struct AcceptBackoff {
    /// The last wait; zero after a success.
    wait: Duration,
    /// Failures since the last warning.
    unreported: u64,
    /// Failures since the last success.
    streak: u64,
    last_warning: Option<Instant>,
    /// A warning was logged since the last success (so the recovery is worth a line too).
    warned: bool,
}

impl AcceptBackoff {
    /// One more failure at `now`: the wait before the next `accept`, and `Some(failures)` when
    /// a warning is due, counting the failures it reports.
    fn failed(&mut self, now: Instant) -> (Duration, Option<u64>) {
        self.wait = (self.wait * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
        self.unreported += 1;
        self.streak += 1;
        let due = match self.last_warning {
            None => true,
            Some(t) => now.saturating_duration_since(t) >= WARN_EVERY,
        };
        if !due {
            return (self.wait, None);
        }
        self.last_warning = Some(now);
        self.warned = true;
        (self.wait, Some(std::mem::take(&mut self.unreported)))
    }

    /// A connection was accepted: the next failure waits the least again. `Some(failures)` of
    /// the streak when it was warned about, so its end is logged once too.
    fn succeeded(&mut self) -> Option<u64> {
        self.wait = Duration::ZERO;
        self.unreported = 0;
        let streak = std::mem::take(&mut self.streak);
        std::mem::take(&mut self.warned).then_some(streak)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_failures_back_off_and_warn_rarely() {
        let mut b = AcceptBackoff::default();
        let t0 = Instant::now();
        let mut waits = Vec::new();
        let mut warnings = 0;
        for i in 0..20 {
            let (wait, warn) = b.failed(t0 + Duration::from_millis(i * 100));
            waits.push(wait.as_millis());
            warnings += u64::from(warn.is_some());
        }
        assert_eq!(waits[..8], [10, 20, 40, 80, 160, 320, 640, 1000]);
        assert!(waits[8..].iter().all(|&w| w == 1000), "{waits:?}");
        assert_eq!(warnings, 1, "one warning within {WARN_EVERY:?}");
        // The next warning reports the failures in between.
        assert_eq!(b.failed(t0 + WARN_EVERY).1, Some(20));
        // Success: the recovery is logged once, and the next failure waits the least again.
        assert_eq!(b.succeeded(), Some(21));
        assert_eq!(b.succeeded(), None);
        let (wait, warn) = b.failed(t0 + WARN_EVERY + Duration::from_secs(1));
        assert_eq!(
            (wait, warn),
            (ACCEPT_BACKOFF_MIN, None),
            "still rate-limited"
        );
        assert_eq!(b.succeeded(), None, "an unreported streak ends silently");
    }

    #[test]
    fn the_connection_limit_is_bounded() {
        let n = connection_limit();
        assert!((MIN_CONNECTIONS..=MAX_CONNECTIONS).contains(&n), "{n}");
    }
}
