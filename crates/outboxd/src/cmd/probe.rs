//! `outboxd probe`: a health probe for orchestrators, run inside the relay's container (the image
//! has no shell, no curl): asks the running relay's `/readyz` or `/healthz` and exits 0 or 1.
//!
//! `/readyz` answers 200 only on the instance that streams; a standby answers
//! `503 not ready: standby: …`. For an active/standby pair the orchestrator's question is
//! different — "is this instance serving, or ready to take over?" — so `probe ready` accepts
//! both, and fails for everything else (halted at a poison event, replication not streaming
//! because Postgres is unreachable, the broker refusing the relay, no answer at all). Use
//! `probe active` to ask whether this instance is the one streaming.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

/// What to ask.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Question {
    /// Serving, or a standby ready to take over (`/readyz` 200, or 503 naming the standby).
    Ready,
    /// Streaming from the slot (`/readyz` 200).
    Active,
    /// The process answers at all (`/healthz`).
    Live,
}

/// `outboxd probe`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// What to ask.
    #[arg(value_enum, default_value = "ready")]
    pub question: Question,
    /// The relay's metrics listener (`metrics.listen`); an unspecified address (0.0.0.0, [::])
    /// is asked on loopback.
    #[arg(long, env = "OUTBOXD_METRICS_LISTEN", default_value = "127.0.0.1:9187")]
    pub addr: String,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 3)]
    pub timeout: u64,
}

/// Asks, prints the answer's first line, exits 0 (yes) or 1 (no, or no answer).
pub fn main(args: &ProbeArgs) -> ExitCode {
    let path = match args.question {
        Question::Live => "/healthz",
        Question::Ready | Question::Active => "/readyz",
    };
    match get(&args.addr, path, Duration::from_secs(args.timeout.max(1))) {
        Ok((status, body)) => {
            let line = body.lines().next().unwrap_or_default();
            println!("{status} {line}");
            if verdict(args.question, status, &body) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            println!("no answer from {} ({path}): {e}", args.addr);
            ExitCode::FAILURE
        }
    }
}

/// Whether an answer `status`/`body` of the relay means yes to `q`.
pub fn verdict(q: Question, status: u16, body: &str) -> bool {
    match q {
        Question::Live | Question::Active => status == 200,
        Question::Ready => {
            status == 200 || (status == 503 && body.starts_with("not ready: standby"))
        }
    }
}

/// The address to connect to: an unspecified listen address means "every interface", of which
/// loopback is one.
fn target(addr: &str) -> std::io::Result<SocketAddr> {
    let mut a = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("{addr} resolves to nothing")))?;
    if a.ip().is_unspecified() {
        a.set_ip(match a {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    Ok(a)
}

/// A plain HTTP/1.0 GET: status code and body.
fn get(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&target(addr)?, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut raw = Vec::new();
    s.take(64 * 1024).read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {head:?}")))?;
    Ok((status, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standby_is_ready_but_not_active_and_a_broken_relay_is_neither() {
        // What /readyz answers a standby (obs/http.rs: "not ready: {reason}").
        let h = crate::obs::Health::default();
        h.standby.store(true, std::sync::atomic::Ordering::Relaxed);
        let standby = format!("not ready: {}\n", h.not_ready().unwrap());
        let standby = standby.as_str();
        assert!(verdict(Question::Ready, 200, "ready\n"));
        assert!(verdict(Question::Ready, 503, standby));
        assert!(!verdict(Question::Active, 503, standby));
        for broken in [
            "not ready: halted at a poison event\n",
            "not ready: replication not streaming (starting or reconnecting)\n",
            "not ready: broker unreachable\n",
        ] {
            assert!(!verdict(Question::Ready, 503, broken), "{broken}");
        }
    }

    #[test]
    fn an_unspecified_listen_address_is_asked_on_loopback() {
        assert_eq!(
            target("0.0.0.0:9187").unwrap().to_string(),
            "127.0.0.1:9187"
        );
        assert_eq!(target("[::]:9187").unwrap().to_string(), "[::1]:9187");
        assert_eq!(target("127.0.0.2:1").unwrap().to_string(), "127.0.0.2:1");
    }
}
