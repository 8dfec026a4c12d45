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
    let (status, _, body) = http_exchange(
        addr,
        &format!("GET {path} {version}\r\nHost: x\r\nConnection: close\r\n\r\n"),
    );
    (status, body)
}

/// Sends `request` (a whole raw HTTP/1.x request) to `addr` and reads until the server closes:
/// (status, lower-cased head, body); `(0, "", "")` when nothing answers.
pub fn http_exchange(addr: &str, request: &str) -> (u16, String, String) {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new(), String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(request.as_bytes());
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    (status, head.to_ascii_lowercase(), body.to_string())
}
