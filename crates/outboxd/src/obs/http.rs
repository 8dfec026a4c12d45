//! The HTTP listener serving `/metrics`, `/healthz` and `/readyz`, and the status page (`/`,
//! `/status.json`: `obs::status`).
//!
//! **Off the delivery path** (issue 53). The relay runs on one thread (`cmd::main`); the
//! listener used to share it, so every page request (≈ 55 µs) was taken from delivery: 8 clients
//! looping on `/` made a 100,000-event backlog drain ~2.5× longer. The listener now runs on its
//! own thread with its own single-threaded runtime, at the lowest CPU priority (nice 19): when
//! the relay, Postgres and the broker want the cores, whatever clients make the listener do
//! waits. A probe costs microseconds, so it still answers within its timeout.
//!
//! Anyone who reaches the port can open connections, and every connection costs a file
//! descriptor the relay shares: it needs descriptors for each Postgres and broker (re)connection.
//! Unbounded, 120 idle sockets under `ulimit -n 64` took them all, Postgres reconnects failed
//! with "Too many open files", and the failing `accept` spun a core (issue 15). So the listener
//! may starve itself, never the relay:
//! - it serves at most [`connection_limit`] connections at once, split into budgets (`admit`)
//!   so that held connections never keep the probes out;
//! - a client has [`HEADER_READ_TIMEOUT`] to send each request header and a connection lives at
//!   most [`CONNECTION_DEADLINE`], so idle and slow-loris clients give their slot back;
//! - a failing `accept` (out of descriptors) backs off exponentially instead of retrying at once,
//!   and is logged at most every [`WARN_EVERY`].

use super::admit::{self, Budgets, Class, Prefixed, Ticket};
use super::status::serve::Page;
use super::Observed;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};

/// Most connections served at once. A Prometheus server and a few probes need a handful; 32
/// leaves room for several scrapers without letting the port hold many descriptors.
const MAX_CONNECTIONS: usize = 32;
/// Fewest connections served at once, however low the descriptor limit.
const MIN_CONNECTIONS: usize = 4;
/// Time a client has to send a request header — the first, and each next one on a kept-alive
/// connection. Scrapers and probes send theirs at once; an idle or slow-loris client is closed
/// (or evicted earlier by a newer connection, `admit`).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Lifetime of a connection, keep-alive included: a client that reads its response slowly or
/// trickles a request body cannot hold a slot longer. Scrapers reconnect transparently.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(30);
/// Lifetime of a probe's connection: one request already read, a one-line answer.
const PROBE_DEADLINE: Duration = Duration::from_secs(2);
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

/// What every connection of one listener shares.
struct Listener {
    prom: PrometheusHandle,
    observed: Arc<Observed>,
    page: Page,
    budgets: Budgets,
}

/// Serves `/metrics`, `/healthz`, `/readyz` and the status page until the process ends, on
/// a thread of its own. Binding is the only error: everything after it stays inside the
/// listener.
pub async fn serve(
    addr: std::net::SocketAddr,
    prom: PrometheusHandle,
    observed: Arc<Observed>,
) -> std::io::Result<()> {
    let socket = std::net::TcpListener::bind(addr)?;
    socket.set_nonblocking(true)?;
    let limit = connection_limit();
    tracing::debug!(%addr, limit, "metrics listener: connection limit");
    let shared = Arc::new(Listener {
        prom,
        observed,
        page: Page::default(),
        budgets: Budgets::split(limit),
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("outboxd-http".into())
        .spawn(move || {
            lower_priority();
            runtime.block_on(async move {
                match TcpListener::from_std(socket) {
                    Ok(listener) => accept_loop(listener, shared).await,
                    Err(e) => tracing::error!(error = %e, "metrics listener: cannot serve"),
                }
            })
        })?;
    Ok(())
}

/// The listener's thread yields the CPU to everything else of the process and the machine
/// (nice 19): its clients are never worth a delay of delivery. Lowering one's own priority
/// needs no privilege; should it fail anyway, the listener runs at normal priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid has no preconditions; setpriority on this thread's id changes only
        // this thread's nice value (Linux threads are scheduled entities of their own).
        let failed = unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS as _, tid, 19) != 0
        };
        if failed {
            tracing::debug!(error = %std::io::Error::last_os_error(), "metrics listener: cannot lower its priority");
        }
    }
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

/// Accepts connections and hands each to [`connection`], which reads its request head as a
/// pending connection (`admit`): when that stage is full, the oldest pending connection is
/// evicted. Accepting instead of leaving connections in the kernel's queue keeps the queue
/// drained, so a probe arriving during a flood is read at once instead of waiting behind
/// hundreds of queued sockets for their header timeouts.
async fn accept_loop(listener: TcpListener, shared: Arc<Listener>) {
    let mut backoff = AcceptBackoff::default();
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                if let Some(failures) = backoff.succeeded() {
                    tracing::info!(failures, "metrics listener: accepting connections again");
                }
                let (ticket, evicted) = shared.budgets.pending.enter();
                tokio::spawn(connection(stream, peer.ip(), ticket, shared.clone()));
                if evicted {
                    // Let the evicted connection close before the next accept: the
                    // descriptors held stay within the budget.
                    tokio::task::yield_now().await;
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

/// Serves one connection: its request head while pending (until evicted or
/// [`HEADER_READ_TIMEOUT`]), then in its class's budget — closed when that one is full.
async fn connection(mut stream: TcpStream, peer: IpAddr, ticket: Ticket, shared: Arc<Listener>) {
    let head = tokio::select! {
        _ = ticket.evicted() => return,
        r = tokio::time::timeout(HEADER_READ_TIMEOUT, admit::read_head(&mut stream)) => match r {
            Ok(Ok(head)) if !head.is_empty() => head,
            _ => return,
        },
    };
    drop(ticket);
    let class = admit::class_of(&head);
    let budget = match class {
        Class::Probe => &shared.budgets.probes,
        Class::Other => &shared.budgets.others,
    };
    let Ok(slot) = budget.clone().try_acquire_owned() else {
        return;
    };
    // A probe's connection serves the head read and nothing more: no body or next request of
    // the client can keep its slot.
    let io = Prefixed::new(head, stream, class == Class::Probe);
    let shared2 = shared.clone();
    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let shared = shared2.clone();
        async move { Ok::<_, std::convert::Infallible>(route(&req, &shared, peer)) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(class == Class::Other)
        // A probe's stream ends after its head (`Prefixed`): answer it all the same.
        .half_close(class == Class::Probe);
    let deadline = match class {
        Class::Probe => PROBE_DEADLINE,
        Class::Other => CONNECTION_DEADLINE,
    };
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), svc);
    let mut conn = std::pin::pin!(conn);
    if tokio::time::timeout(deadline, conn.as_mut()).await.is_err() {
        // Past the deadline: finish a response in progress, close an idle connection now.
        conn.as_mut().graceful_shutdown();
        let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
    }
    drop(slot);
}

fn route(
    req: &Request<hyper::body::Incoming>,
    shared: &Listener,
    peer: IpAddr,
) -> Response<Full<Bytes>> {
    let observed = &shared.observed;
    // The status page: `/`, `/status.json`, and every method but GET and HEAD refused.
    if let Some(r) = super::status::serve::respond(req, observed, &shared.page, peer) {
        return r;
    }
    let health = &observed.health;
    let (status, body) = match req.uri().path() {
        "/metrics" => (StatusCode::OK, shared.prom.render()),
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
