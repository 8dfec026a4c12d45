//! The status page's side of the HTTP listener: read-only (GET and HEAD only, on every path:
//! anything else is 405 with `Allow`), the optional bearer token for `/` and `/status.json`
//! (never for `/metrics` and the probes, which keep their behaviour), and headers that keep a
//! browser from running anything but the page's own script.

use crate::obs::Observed;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};

/// The answer for `req` when the status page owns it: a refused method (any path), `/` or
/// `/status.json`. `None`: another route serves it.
pub fn respond<B>(req: &Request<B>, observed: &Observed) -> Option<Response<Full<Bytes>>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: this listener is read-only (GET, HEAD)\n",
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Some(r);
    }
    let path = req.uri().path();
    if path != "/" && path != "/status.json" {
        return None;
    }
    if let Some(token) = observed.status.token() {
        if !authorized(req, &token) {
            let mut r = text(
                StatusCode::UNAUTHORIZED,
                "unauthorized: send `Authorization: Bearer <metrics.status_token>` (or open /?token=<it>)\n",
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"outboxd status\""),
            );
            return Some(r);
        }
    }
    let facts = observed.status.facts(observed);
    let (body, kind) = if path == "/" {
        (super::html::page(&facts), "text/html; charset=utf-8")
    } else {
        (
            serde_json::to_string_pretty(&facts).unwrap_or_default(),
            "application/json",
        )
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
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
    if let Ok(csp) = HeaderValue::from_str(&csp()) {
        h.insert(header::CONTENT_SECURITY_POLICY, csp);
    }
    Some(r)
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Only the page's own script (by its hash), its inline style, fetches to this origin. Hashed
/// per response (a few KiB): no process-wide state (tests/tests/house.rs).
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

    fn req(method: Method, uri: &str, auth: Option<&str>) -> Request<()> {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn methods_tokens_and_routes() {
        let o = Observed::default();
        let r = respond(&req(Method::POST, "/metrics", None), &o).unwrap();
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(r.headers()[header::ALLOW], "GET, HEAD");
        assert!(respond(&req(Method::GET, "/metrics", None), &o).is_none());
        let r = respond(&req(Method::GET, "/status.json", None), &o).unwrap();
        assert_eq!(r.status(), StatusCode::OK);

        let mut cfg = crate::config::Config::from_toml_and_env(
            "[source]\ndsn = \"postgres://u@h/d\"\nslot = \"s\"\n[sink.kafka]\n\"bootstrap.servers\" = \"k:9092\"\n[metrics]\nstatus_token = \"abcdefghijklmnop1234\"\n",
            Vec::<(String, String)>::new(),
        )
        .unwrap();
        o.status.configure(&cfg);
        let code = |r: Request<()>| respond(&r, &o).unwrap().status();
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
        assert!(
            respond(&req(Method::GET, "/healthz", None), &o).is_none(),
            "probes stay open"
        );
        cfg.metrics.status_token = None;
        o.status.configure(&cfg);
        assert_eq!(code(req(Method::GET, "/", None)), StatusCode::OK);
        assert!(same(b"abc", b"abc") && !same(b"abc", b"abd") && !same(b"ab", b"abc"));
    }
}
