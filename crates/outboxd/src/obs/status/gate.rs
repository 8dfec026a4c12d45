//! Who may load the status page, and how often (issue 53). The page shows the relay's
//! configuration (redacted) and its parked events: more than a scraper or a kubelet needs.
//! - **Loopback only without a token.** Without `metrics.status_token`, `/` and `/status.json`
//!   answer only clients connecting from loopback (`kubectl port-forward`, `ssh -L`, a shell on
//!   the host); the shipped configurations listen on `0.0.0.0` for Prometheus and the probes,
//!   which keep answering everyone. With a token, anyone holding it.
//! - **`Host` check** against DNS rebinding: a page a browser can reach on localhost could be read
//!   by any web site whose name the attacker points at 127.0.0.1; that browser sends the
//!   attacker's name as `Host`. Accepted: IP literals, `localhost`, and the names of
//!   `metrics.status_hosts`; a request without `Host` (HTTP/1.0 tools) too, since browsers
//!   always send one.
//! - **Rate limit**: a token bucket of [`RATE`] requests a second (bursts of [`BURST`]) for the
//!   whole listener, counting every request for the page or its JSON; over it, 429 with
//!   `Retry-After`. The page refreshes itself every 5 s; a client looping on it gets refusals
//!   that cost next to nothing.

use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Page and JSON requests per second, across all clients.
pub const RATE: f64 = 10.0;
/// Requests allowed at once after a quiet spell.
pub const BURST: f64 = 20.0;

/// The page's token bucket.
#[derive(Debug)]
pub struct Bucket {
    tokens: f64,
    at: Option<Instant>,
}

impl Default for Bucket {
    fn default() -> Self {
        Bucket {
            tokens: BURST,
            at: None,
        }
    }
}

impl Bucket {
    /// Takes one request's token at `now`; `Err(wait)`: none left, the next one in `wait`.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        if let Some(at) = self.at {
            let refill = now.saturating_duration_since(at).as_secs_f64() * RATE;
            self.tokens = (self.tokens + refill).min(BURST);
        }
        self.at = Some(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / RATE))
        }
    }
}

/// `Retry-After` for a wait: whole seconds, at least 1.
pub fn retry_after(wait: Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}

/// Whether the `Host` header `host` (absent: `None`) names this listener acceptably: an IP
/// literal, `localhost`, or one of `names` (case-insensitive), any port.
pub fn host_allowed(host: Option<&str>, names: &[String]) -> bool {
    let Some(host) = host else {
        return true;
    };
    let host = host.trim();
    if let Some(v6) = host.strip_prefix('[') {
        return v6
            .split_once(']')
            .is_some_and(|(ip, _)| ip.parse::<std::net::Ipv6Addr>().is_ok());
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || names.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// A client on this machine: 127.0.0.0/8, ::1, or an IPv4-mapped loopback address (a dual-stack
/// listener's view of 127.0.0.1).
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_allows_bursts_then_the_rate() {
        let mut b = Bucket::default();
        let t0 = Instant::now();
        let ok = (0..30).filter(|_| b.take(t0).is_ok()).count();
        assert_eq!(ok, BURST as usize);
        let wait = b.take(t0).unwrap_err();
        assert!(wait <= Duration::from_millis(100), "{wait:?}");
        assert_eq!(retry_after(wait), 1);
        // A second later, RATE more.
        let t1 = t0 + Duration::from_secs(1);
        let ok = (0..30).filter(|_| b.take(t1).is_ok()).count();
        assert_eq!(ok, RATE as usize);
    }

    #[test]
    fn hosts_ip_literals_localhost_and_configured_names() {
        let names = vec!["outboxd.internal".to_string()];
        for ok in [
            None,
            Some("127.0.0.1"),
            Some("127.0.0.1:9187"),
            Some("10.1.2.3:9187"),
            Some("[::1]:9187"),
            Some("[fd00::2]"),
            Some("localhost:9187"),
            Some("LOCALHOST"),
            Some("localhost."),
            Some("outboxd.internal:9187"),
            Some("OUTBOXD.internal"),
        ] {
            assert!(host_allowed(ok, &names), "{ok:?}");
        }
        for bad in [
            Some("evil.example"),
            Some("evil.example:9187"),
            Some("localhost.evil.example"),
            Some("127.0.0.1.nip.io"),
            Some("[not-an-ip]:1"),
            Some(""),
            Some("outboxd.internal.evil"),
        ] {
            assert!(!host_allowed(bad, &names), "{bad:?}");
        }
    }

    #[test]
    fn loopback_clients() {
        for ip in ["127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"] {
            assert!(is_loopback(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "10.0.0.1",
            "192.0.2.2",
            "fd00::2",
            "::ffff:10.0.0.1",
            "0.0.0.0",
        ] {
            assert!(!is_loopback(ip.parse().unwrap()), "{ip}");
        }
    }
}
