//! A plain HTTP GET against the relay's metrics listener (`/metrics`, `/healthz`, `/readyz`).

use std::io::{Read, Write};
use std::time::Duration;

/// GET `path` from `addr`: (status, body); `(0, "")` when nothing answers.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    get(addr, path, "HTTP/1.1")
}

/// [`http_get`] as HTTP/1.0, so the server never chunks the body (Prometheus's API does for
/// HTTP/1.1 once a body is large).
pub fn http_get_10(addr: &str, path: &str) -> (u16, String) {
    get(addr, path, "HTTP/1.0")
}

fn get(addr: &str, path: &str, version: &str) -> (u16, String) {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(
        s,
        "GET {path} {version}\r\nHost: x\r\nConnection: close\r\n\r\n"
    );
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}
