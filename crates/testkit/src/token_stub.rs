//! A tiny OAuth 2.0 token endpoint (RFC 6749 client-credentials grant) for OAUTHBEARER/OIDC
//! tests: `POST /token` over plain HTTP/1.1 on 127.0.0.1.
//!
//! It checks `Authorization: Basic base64(client_id:client_secret)` and a form body with
//! `grant_type=client_credentials` (and an optional `scope`), and answers
//! `{"access_token": …, "token_type": "bearer", "expires_in": …}` with an unsigned,
//! JWT-shaped token (`b64url({"alg":"none"}).b64url({"sub": client_id, "iat", "exp", "jti",
//! "scope"}).`), or 401 `{"error":"invalid_client"}` for wrong credentials and 400
//! `{"error":"unsupported_grant_type"}` for another grant. Every request is recorded
//! ([`TokenStub::requests`]), every token too ([`TokenStub::issued`]).
//!
//! To make a [`crate::SaslProxy`] accept what the stub issues, start it with
//! [`TokenStub::start_for`] (or register [`crate::SaslProxy::token_allower`] with
//! [`TokenStub::on_issue`]): each token is allowed before the response is written, so a client
//! can use it at once. The HTTP is hand-written and minimal (one request per connection,
//! `Connection: close`, `Content-Length` bodies only). It runs on its own thread and runtime,
//! like [`crate::TlsProxy`].

use crate::SaslProxy;
use anyhow::{bail, Context, Result};
use base64::engine::general_purpose::{STANDARD as B64, URL_SAFE_NO_PAD as B64URL};
use base64::Engine as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One request the stub answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRequest {
    /// The user (client id) of the `Authorization: Basic` header, if any.
    pub basic_user: Option<String>,
    pub grant_type: Option<String>,
    pub scope: Option<String>,
    /// The HTTP status answered.
    pub status: u16,
}

type Hook = Arc<dyn Fn(&str) + Send + Sync>;

struct Shared {
    client_id: String,
    secret: Mutex<String>,
    expires_in: u64,
    issued: Mutex<Vec<String>>,
    requests: Mutex<Vec<TokenRequest>>,
    hooks: Mutex<Vec<Hook>>,
    outage: Mutex<Option<u16>>,
    seq: AtomicU64,
}

/// See the module docs. Dropping it stops accepting.
pub struct TokenStub {
    pub port: u16,
    shared: Arc<Shared>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl TokenStub {
    /// Serves `POST /token` on 127.0.0.1 (a free port) for this client; tokens live
    /// `expires_in_s` seconds (the `exp` claim and `expires_in`).
    pub fn start(client_id: &str, client_secret: &str, expires_in_s: u64) -> Result<Self> {
        let shared = Arc::new(Shared {
            client_id: client_id.to_string(),
            secret: Mutex::new(client_secret.to_string()),
            expires_in: expires_in_s,
            issued: Mutex::default(),
            requests: Mutex::default(),
            hooks: Mutex::default(),
            outage: Mutex::default(),
            seq: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let (port, stop) = crate::acceptor::spawn("token-stub", 0, move |sock| {
            let sh = sh.clone();
            async move {
                if let Err(e) = handle(sock, &sh).await {
                    eprintln!("token stub: {e:#}");
                }
            }
        })?;
        Ok(Self {
            port,
            shared,
            _stop: stop,
        })
    }

    /// [`TokenStub::start`], with every issued token allowed on `proxy` (OAUTHBEARER) before
    /// the client receives it.
    pub fn start_for(
        proxy: &SaslProxy,
        client_id: &str,
        client_secret: &str,
        expires_in_s: u64,
    ) -> Result<Self> {
        let stub = Self::start(client_id, client_secret, expires_in_s)?;
        stub.on_issue(proxy.token_allower());
        Ok(stub)
    }

    /// Calls `f` with every token issued from now on, before the response is written.
    pub fn on_issue(&self, f: impl Fn(&str) + Send + Sync + 'static) {
        self.shared.hooks.lock().unwrap().push(Arc::new(f));
    }

    /// `http://127.0.0.1:<port>/token`
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/token", self.port)
    }

    /// The tokens issued so far, in order.
    pub fn issued(&self) -> Vec<String> {
        self.shared.issued.lock().unwrap().clone()
    }

    /// Every request answered so far, in order.
    pub fn requests(&self) -> Vec<TokenRequest> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// Rotates the client secret: requests with the old one get 401 from now on.
    pub fn set_secret(&self, secret: &str) {
        *self.shared.secret.lock().unwrap() = secret.to_string();
    }

    /// `Some(status)`: answer every request with this status and
    /// `{"error":"temporarily_unavailable"}` (an identity provider outage); `None`: serve again.
    pub fn set_outage(&self, status: Option<u16>) {
        *self.shared.outage.lock().unwrap() = status;
    }
}

async fn handle(mut sock: TcpStream, sh: &Shared) -> Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > 64 * 1024 {
            bail!("request head over 64 KiB");
        }
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed before the end of the request head");
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let mut content_length = 0usize;
    let mut authorization = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            content_length = value.parse().context("Content-Length")?;
        } else if name.eq_ignore_ascii_case("authorization") {
            authorization = Some(value.to_string());
        }
    }
    if content_length > 1 << 20 {
        bail!("request body of {content_length} bytes");
    }
    let mut body = buf[head_end..].to_vec();
    while body.len() < content_length {
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed inside the request body");
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(content_length);

    let (status, json) = answer(sh, method, target, authorization.as_deref(), &body);
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Status",
    };
    let mut resp = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n\
         Cache-Control: no-store\r\nContent-Length: {}\r\nConnection: close\r\n",
        json.len()
    );
    if status == 401 {
        resp.push_str("WWW-Authenticate: Basic realm=\"token\"\r\n");
    }
    resp.push_str("\r\n");
    resp.push_str(&json);
    sock.write_all(resp.as_bytes()).await?;
    sock.shutdown().await?;
    Ok(())
}

/// (status, JSON body) for one request; records it (and the token).
fn answer(
    sh: &Shared,
    method: &str,
    target: &str,
    authorization: Option<&str>,
    body: &[u8],
) -> (u16, String) {
    let form = parse_form(&String::from_utf8_lossy(body));
    let field = |k: &str| form.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let (grant_type, scope) = (field("grant_type"), field("scope"));
    let basic = authorization.and_then(parse_basic);
    let mut req = TokenRequest {
        basic_user: basic.as_ref().map(|(u, _)| u.clone()),
        grant_type: grant_type.clone(),
        scope: scope.clone(),
        status: 0,
    };
    let path = target.split('?').next().unwrap_or_default();
    let secret = sh.secret.lock().unwrap().clone();
    let outage = *sh.outage.lock().unwrap();
    let (status, json) = if let Some(status) = outage {
        (status, r#"{"error":"temporarily_unavailable"}"#.to_string())
    } else if path != "/token" {
        (404, r#"{"error":"not_found"}"#.to_string())
    } else if method != "POST" {
        (405, r#"{"error":"invalid_request"}"#.to_string())
    } else if basic.as_ref() != Some(&(sh.client_id.clone(), secret)) {
        (401, r#"{"error":"invalid_client"}"#.to_string())
    } else if grant_type.as_deref() != Some("client_credentials") {
        (400, r#"{"error":"unsupported_grant_type"}"#.to_string())
    } else {
        let token = make_token(sh, scope.as_deref());
        sh.issued.lock().unwrap().push(token.clone());
        let hooks = sh.hooks.lock().unwrap().clone();
        for h in hooks {
            h(&token);
        }
        let json = serde_json::json!({
            "access_token": token,
            "token_type": "bearer",
            "expires_in": sh.expires_in,
        });
        (200, json.to_string())
    };
    req.status = status;
    sh.requests.lock().unwrap().push(req);
    (status, json)
}

/// An unsigned JWT-shaped token for the client (a `jti` keeps tokens of one second apart).
fn make_token(sh: &Shared, scope: Option<&str>) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let mut claims = serde_json::json!({
        "sub": sh.client_id,
        "iat": now,
        "exp": now + sh.expires_in,
        "jti": sh.seq.fetch_add(1, Ordering::SeqCst).to_string(),
    });
    if let Some(scope) = scope {
        claims["scope"] = scope.into();
    }
    format!(
        "{}.{}.",
        B64URL.encode(r#"{"alg":"none"}"#),
        B64URL.encode(claims.to_string())
    )
}

/// (user, password) of `Basic base64(user:password)`; both parts are also form-decoded, as
/// RFC 6749 section 2.3.1 asks clients to encode them (none of ours contain reserved
/// characters, so encoded or not they compare the same).
fn parse_basic(value: &str) -> Option<(String, String)> {
    let (scheme, b64) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = B64.decode(b64.trim()).ok()?;
    let raw = String::from_utf8(raw).ok()?;
    let (u, p) = raw.split_once(':')?;
    Some((url_decode(u), url_decode(p)))
}

/// `application/x-www-form-urlencoded` pairs, decoded.
fn parse_form(body: &str) -> Vec<(String, String)> {
    body.split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (url_decode(k), url_decode(v))
        })
        .collect()
}

/// Form decoding: `+` is a space, `%XX` a byte (invalid escapes stay as they are).
fn url_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sasl_proxy::mechanisms::jwt_sub;
    use std::io::{Read, Write};

    /// A blocking `POST /token` (status, body).
    fn post(stub: &TokenStub, basic: Option<(&str, &str)>, form: &str) -> (u16, String) {
        post_to(stub.port, basic, form)
    }

    fn post_to(port: u16, basic: Option<(&str, &str)>, form: &str) -> (u16, String) {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let auth = basic
            .map(|(u, p)| {
                format!(
                    "Authorization: Basic {}\r\n",
                    B64.encode(format!("{u}:{p}"))
                )
            })
            .unwrap_or_default();
        write!(
            s,
            "POST /token HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: \
             application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
            form.len()
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        let status = resp[9..12].parse().unwrap();
        let body = resp.split_once("\r\n\r\n").unwrap().1.to_string();
        (status, body)
    }

    #[test]
    fn url_decoding() {
        assert_eq!(url_decode("a+b%20c%2Fd%zz%"), "a b c/d%zz%");
        assert_eq!(
            parse_form("grant_type=client_credentials&scope=kafka%3Aproduce+x"),
            vec![
                ("grant_type".into(), "client_credentials".into()),
                ("scope".into(), "kafka:produce x".into())
            ]
        );
    }

    /// Issues JWT-shaped tokens for the right credentials, refuses others and a rotated-out
    /// secret, records everything, and allows each token on a SASL proxy.
    #[test]
    fn issues_refuses_rotates_and_records() {
        let proxy = SaslProxy::start(
            "127.0.0.1:9".parse().unwrap(),
            crate::SaslOptions::new(&["OAUTHBEARER"]),
        )
        .unwrap();
        let stub = TokenStub::start_for(&proxy, "relay", "s1", 300).unwrap();
        assert_eq!(stub.url(), format!("http://127.0.0.1:{}/token", stub.port));
        let (st, body) = post(
            &stub,
            Some(("relay", "s1")),
            "grant_type=client_credentials&scope=kafka%3Aproduce",
        );
        assert_eq!(st, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let token = v["access_token"].as_str().unwrap();
        assert_eq!(v["token_type"], "bearer");
        assert_eq!(v["expires_in"], 300);
        assert_eq!(jwt_sub(token).as_deref(), Some("relay"));
        let claims: serde_json::Value =
            serde_json::from_slice(&B64URL.decode(token.split('.').nth(1).unwrap()).unwrap())
                .unwrap();
        assert_eq!(claims["scope"], "kafka:produce");
        assert_eq!(
            claims["exp"].as_u64().unwrap() - claims["iat"].as_u64().unwrap(),
            300
        );
        assert_eq!(stub.issued(), vec![token.to_string()]);
        assert!(proxy.token_allowed(token));

        assert_eq!(
            post(
                &stub,
                Some(("relay", "s2")),
                "grant_type=client_credentials"
            ),
            (401, r#"{"error":"invalid_client"}"#.into())
        );
        assert_eq!(post(&stub, None, "grant_type=client_credentials").0, 401);
        assert_eq!(
            post(&stub, Some(("relay", "s1")), "grant_type=password").0,
            400
        );
        stub.set_secret("s2");
        assert_eq!(
            post(
                &stub,
                Some(("relay", "s1")),
                "grant_type=client_credentials"
            )
            .0,
            401
        );
        assert_eq!(
            post(
                &stub,
                Some(("relay", "s2")),
                "grant_type=client_credentials"
            )
            .0,
            200
        );
        stub.set_outage(Some(503));
        assert_eq!(
            post(
                &stub,
                Some(("relay", "s2")),
                "grant_type=client_credentials"
            )
            .0,
            503
        );
        assert_eq!(stub.issued().len(), 2);
        let reqs = stub.requests();
        let statuses: Vec<u16> = reqs.iter().map(|r| r.status).collect();
        assert_eq!(statuses, vec![200, 401, 401, 400, 401, 200, 503]);
        assert_eq!(
            reqs[0],
            TokenRequest {
                basic_user: Some("relay".into()),
                grant_type: Some("client_credentials".into()),
                scope: Some("kafka:produce".into()),
                status: 200,
            }
        );
        assert_eq!(reqs[2].basic_user, None);
    }

    /// End to end: librdkafka's OAUTHBEARER refresh callback (what a client fetching its own
    /// OIDC tokens does) gets a token from the stub, the proxy started with
    /// [`TokenStub::start_for`] accepts it and the token's `sub` is the principal.
    #[test]
    fn librdkafka_oauthbearer_with_stub_tokens() {
        use rdkafka::client::OAuthToken;
        use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ProducerContext};
        use rdkafka::ClientContext;
        use std::time::{Duration, Instant};

        struct Ctx {
            port: u16,
        }
        impl ClientContext for Ctx {
            const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;
            fn generate_oauth_token(
                &self,
                _: Option<&str>,
            ) -> std::result::Result<OAuthToken, Box<dyn std::error::Error>> {
                let (st, body) = post_to(
                    self.port,
                    Some(("relay", "s1")),
                    "grant_type=client_credentials",
                );
                if st != 200 {
                    return Err(format!("token endpoint: {st} {body}").into());
                }
                let v: serde_json::Value = serde_json::from_str(&body)?;
                let now_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as i64;
                Ok(OAuthToken {
                    token: v["access_token"].as_str().unwrap_or_default().to_string(),
                    principal_name: "relay".into(),
                    lifetime_ms: now_ms + v["expires_in"].as_i64().unwrap_or(60) * 1000,
                })
            }
        }
        impl ProducerContext for Ctx {
            type DeliveryOpaque = ();
            fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: ()) {}
        }

        let (broker, proxy) =
            crate::Broker::start_behind_sasl(crate::SaslOptions::new(&["OAUTHBEARER"])).unwrap();
        let stub = TokenStub::start_for(&proxy, "relay", "s1", 300).unwrap();
        let out = std::process::Command::new(crate::tansu_bin())
            .args(["topic", "create", "--partitions", "1", "--broker"])
            .arg(format!("tcp://127.0.0.1:{}", broker.port))
            .arg("t")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let p: BaseProducer<Ctx> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", broker.bootstrap())
            .set("security.protocol", "SASL_PLAINTEXT")
            .set("sasl.mechanism", "OAUTHBEARER")
            .set("message.timeout.ms", "5000")
            .create_with_context(Ctx { port: stub.port })
            .unwrap();
        // The refresh callback runs from poll: serve it before the blocking metadata call.
        let deadline = Instant::now() + Duration::from_secs(10);
        while stub.issued().is_empty() {
            assert!(Instant::now() < deadline, "no token requested");
            p.poll(Duration::from_millis(50));
        }
        p.client()
            .fetch_metadata(Some("t"), Duration::from_secs(5))
            .unwrap();
        p.send(BaseRecord::to("t").key("k").payload("v")).unwrap();
        p.flush(Duration::from_secs(5)).unwrap();
        assert!(proxy.principals().iter().all(|p| p == "relay"));
        assert!(proxy.successes() >= 1);
        assert_eq!(proxy.failures(), 0);
        assert_eq!(stub.requests()[0].basic_user.as_deref(), Some("relay"));
    }
}
