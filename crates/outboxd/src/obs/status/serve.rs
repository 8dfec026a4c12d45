//! The status page's side of the HTTP listener: read-only (GET and HEAD only, on every path:
//! anything else is 405 with `Allow`); for `/` and `/status.json` the gate (`gate`: rate limit,
//! `Host` check, loopback only without `metrics.status_token`, the token), a rendering cached
//! for [`FRESH`], and headers that keep a browser from running anything but the page's own
//! script. `/metrics` and the probes never pass the gate: scrapers and kubelets carry no token.

use super::gate;
use crate::obs::Observed;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a rendering is served again. The facts change every few seconds (the watch's
/// samples, the parked list every 5 s); a client looping on the page then costs a copy of
/// bytes, not a rendering.
const FRESH: Duration = Duration::from_secs(1);

/// One listener's page state: its rate limit and its cached renderings (the page, the JSON).
#[derive(Debug)]
pub struct Page {
    bucket: Mutex<gate::Bucket>,
    cache: Mutex<[Option<(Instant, Bytes)>; 2]>,
    csp: HeaderValue,
}

impl Default for Page {
    fn default() -> Self {
        Page {
            bucket: Mutex::default(),
            cache: Mutex::default(),
            csp: HeaderValue::from_str(&csp())
                .unwrap_or(HeaderValue::from_static("default-src 'none'")),
        }
    }
}

impl Page {
    /// The rendering of `json` (or the page), rendered again when older than [`FRESH`].
    fn body(&self, observed: &Observed, json: bool) -> Bytes {
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut cache[usize::from(json)];
        if let Some((at, body)) = slot {
            if now.saturating_duration_since(*at) < FRESH {
                return body.clone();
            }
        }
        let facts = observed.status.facts(observed);
        let body = Bytes::from(if json {
            serde_json::to_string_pretty(&facts).unwrap_or_default()
        } else {
            super::html::page(&facts)
        });
        *slot = Some((now, body.clone()));
        body
    }
}

/// The answer for `req` from `peer` when the status page owns it: a refused method (any
/// path), `/` or `/status.json`. `None`: another route serves it.
pub fn respond<B>(
    req: &Request<B>,
    observed: &Observed,
    page: &Page,
    peer: IpAddr,
) -> Option<Response<Full<Bytes>>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: this listener is read-only (GET, HEAD)\n".into(),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Some(r);
    }
    let path = req.uri().path();
    if path != "/" && path != "/status.json" {
        return None;
    }
    let taken = page
        .bucket
        .lock()
        .map_or(Ok(()), |mut b| b.take(Instant::now()));
    if let Err(wait) = taken {
        let secs = gate::retry_after(wait);
        let mut r = text(
            StatusCode::TOO_MANY_REQUESTS,
            format!("too many requests for the status page: retry in {secs} s\n"),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        return Some(r);
    }
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| h.to_str().unwrap_or("\u{0}"));
    if !gate::host_allowed(host, &observed.status.hosts()) {
        return Some(text(
            StatusCode::FORBIDDEN,
            "forbidden: the status page answers a Host that is an IP address, localhost or a \
             name of metrics.status_hosts\n"
                .into(),
        ));
    }
    match observed.status.token() {
        Some(token) if !authorized(req, &token) => {
            let mut r = text(
                StatusCode::UNAUTHORIZED,
                "unauthorized: send `Authorization: Bearer <metrics.status_token>` (or open /?token=<it>)\n".into(),
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"outboxd status\""),
            );
            return Some(r);
        }
        None if !gate::is_loopback(peer) => {
            return Some(text(
                StatusCode::FORBIDDEN,
                "forbidden: without metrics.status_token the status page answers only loopback \
                 clients (kubectl port-forward, ssh -L); set metrics.status_token to serve it \
                 to others\n"
                    .into(),
            ));
        }
        _ => {}
    }
    let json = path == "/status.json";
    let kind = if json {
        "application/json"
    } else {
        "text/html; charset=utf-8"
    };
    let mut r = Response::new(Full::new(page.body(observed, json)));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert(header::CONTENT_SECURITY_POLICY, page.csp.clone());
    Some(r)
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Only the page's own script (by its hash), its inline style, fetches to this origin. Hashed
/// once per listener ([`Page`]): no process-wide state (tests/tests/house.rs).
fn csp() -> String {
    use base64::Engine;
    use sha2::Digest;
    let hash = sha2::Sha256::digest(super::html::script().as_bytes());
    format!(
        "default-src 'none'; script-src 'sha256-{}'; style-src 'unsafe-inline'; \
         connect-src 'self'; img-src 'self'; frame-ancestors 'none'; base-uri 'none'",
        base64::engine::general_purpose::STANDARD.encode(hash)
    )
}

/// The request carries `token`: `Authorization: Bearer <token>`, or `?token=<token>` (for a
/// browser, which cannot add the header; the script repeats the query for `/status.json`).
fn authorized<B>(req: &Request<B>, token: &str) -> bool {
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let query = req
        .uri()
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|kv| kv.strip_prefix("token="));
    [header, query]
        .into_iter()
        .flatten()
        .any(|given| same(given.as_bytes(), token.as_bytes()))
}

/// Constant-time equality (for equal lengths): no early exit on the first differing byte, so
/// the response time does not tell how much of a guess was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn req(method: Method, uri: &str, auth: Option<&str>) -> Request<()> {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a);
        }
        b.body(()).unwrap()
    }

    fn with_host(host: &str) -> Request<()> {
        Request::builder()
            .uri("/status.json")
            .header(header::HOST, host)
            .body(())
            .unwrap()
    }

    fn config(metrics: &str) -> crate::config::Config {
        crate::config::Config::from_toml_and_env(
            &format!("[source]\ndsn = \"postgres://u@h/d\"\nslot = \"s\"\n[sink.kafka]\n\"bootstrap.servers\" = \"k:9092\"\n[metrics]\n{metrics}"),
            Vec::<(String, String)>::new(),
        )
        .unwrap()
    }

    #[test]
    fn methods_tokens_and_routes() {
        let o = Observed::default();
        let p = Page::default();
        let r = respond(&req(Method::POST, "/metrics", None), &o, &p, LOCAL).unwrap();
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(r.headers()[header::ALLOW], "GET, HEAD");
        assert!(respond(&req(Method::GET, "/metrics", None), &o, &p, LOCAL).is_none());
        let r = respond(&req(Method::GET, "/status.json", None), &o, &p, LOCAL).unwrap();
        assert_eq!(r.status(), StatusCode::OK);

        let mut cfg = config("status_token = \"abcdefghijklmnop1234\"\n");
        o.status.configure(&cfg);
        let code = |r: Request<()>| respond(&r, &o, &p, LOCAL).unwrap().status();
        assert_eq!(code(req(Method::GET, "/", None)), StatusCode::UNAUTHORIZED);
        assert_eq!(
            code(req(Method::GET, "/", Some("Bearer abcdefghijklmnop1235"))),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            code(req(Method::GET, "/", Some("Bearer abcdefghijklmnop1234"))),
            StatusCode::OK
        );
        assert_eq!(
            code(req(
                Method::HEAD,
                "/status.json?token=abcdefghijklmnop1234",
                None
            )),
            StatusCode::OK
        );
        // With the token, any client holding it.
        let outside: IpAddr = "10.0.0.7".parse().unwrap();
        let r = req(Method::GET, "/", Some("Bearer abcdefghijklmnop1234"));
        assert_eq!(
            respond(&r, &o, &p, outside).unwrap().status(),
            StatusCode::OK
        );
        assert!(
            respond(&req(Method::GET, "/healthz", None), &o, &p, outside).is_none(),
            "probes stay open"
        );
        cfg.metrics.status_token = None;
        o.status.configure(&cfg);
        assert_eq!(code(req(Method::GET, "/", None)), StatusCode::OK);
        // Without it, loopback only.
        let r = respond(&req(Method::GET, "/", None), &o, &p, outside).unwrap();
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
        assert!(same(b"abc", b"abc") && !same(b"abc", b"abd") && !same(b"ab", b"abc"));
    }

    #[test]
    fn foreign_hosts_are_refused_and_loops_limited() {
        let o = Observed::default();
        o.status.configure(&config(
            "status_hosts = \"outboxd.internal, other.internal\"\n",
        ));
        let p = Page::default();
        let code = |r: Request<()>| respond(&r, &o, &p, LOCAL).unwrap().status();
        assert_eq!(code(with_host("evil.example:9187")), StatusCode::FORBIDDEN);
        assert_eq!(code(with_host("other.internal:9187")), StatusCode::OK);
        assert_eq!(code(with_host("127.0.0.1:9187")), StatusCode::OK);
        let mut limited = None;
        for _ in 0..gate::BURST as usize {
            let r = respond(&with_host("localhost"), &o, &p, LOCAL).unwrap();
            if r.status() == StatusCode::TOO_MANY_REQUESTS {
                limited = Some(r);
                break;
            }
        }
        let r = limited.expect("limited within a burst");
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
