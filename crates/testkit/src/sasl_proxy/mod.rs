//! A Kafka-protocol-aware, SASL-terminating proxy in front of a tansu broker.
//!
//! tansu cannot authenticate anyone: the only storage engine of the build we use (memory,
//! "dynostore") keeps no SCRAM credentials. To test a Kafka client's SASL settings (PLAIN,
//! SCRAM-SHA-256/512, OAUTHBEARER, a wrong password, a mechanism the server does not enable, a
//! rotated password) this proxy plays the authenticating half of a Kafka listener and then gets
//! out of the way:
//!
//! - `ApiVersions` (key 18) goes to tansu and its answer back to the client. tansu 0.6.0
//!   advertises `SaslHandshake` (17) v0–1 and `SaslAuthenticate` (36) v0–2, so clients find the
//!   SASL requests there and nothing needs rewriting.
//! - `SaslHandshake` v0/v1 and `SaslAuthenticate` v0/v1 are answered here, with the error codes
//!   and messages a Kafka broker uses (33 `UNSUPPORTED_SASL_MECHANISM`, 58
//!   `SASL_AUTHENTICATION_FAILED`). A refused client gets its answer, then the connection closes.
//! - Any other request before authentication closes the connection, as Kafka does.
//! - Once authenticated, bytes flow both ways untouched (`copy_bidirectional`), so a password
//!   changed later ([`SaslProxy::set_user`]) affects new connections only, as in Kafka.
//!
//! Optionally it terminates TLS too ([`SaslOptions::tls`]): clients then speak `SASL_SSL`.
//! [`crate::Broker::start_behind_sasl`] starts a broker that advertises the proxy, so clients
//! never bypass it after the metadata round trip. It runs on its own thread and runtime, like
//! [`crate::TlsProxy`].
//!
//! Not supported (logged and closed): `SaslAuthenticate` v2+ (flexible; librdkafka 2.12 uses at
//! most v1), and raw, unframed SASL tokens after a `SaslHandshake` v0.

use crate::tls_proxy::tls_acceptor;
use anyhow::{bail, Context, Result};
use base64::engine::general_purpose::{STANDARD as B64, URL_SAFE_NO_PAD as B64URL};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256, Sha512};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The mechanisms [`SaslOptions::mechanisms`] may name.
pub const MECHANISMS: &[&str] = &["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"];

/// PBKDF2 iterations of the SCRAM credentials (Kafka's minimum and librdkafka's expectation).
pub const SCRAM_ITERATIONS: u32 = 4096;

const API_VERSIONS: i16 = 18;
const SASL_HANDSHAKE: i16 = 17;
const SASL_AUTHENTICATE: i16 = 36;
const UNSUPPORTED_SASL_MECHANISM: i16 = 33;
const ILLEGAL_SASL_STATE: i16 = 34;
const SASL_AUTHENTICATION_FAILED: i16 = 58;
/// Larger length prefixes are not Kafka frames (a TLS ClientHello on a plain listener reads as
/// about 369 MB).
const MAX_FRAME: usize = 100 << 20;

/// What the proxy offers.
#[derive(Clone, Debug, Default)]
pub struct SaslOptions {
    /// Mechanisms the proxy enables, e.g. `vec!["SCRAM-SHA-512".into()]`; any of
    /// [`MECHANISMS`]. The `SaslHandshake` answer lists them in this order.
    pub mechanisms: Vec<String>,
    /// Optional TLS termination (certificate chain PEM, key PEM), like [`crate::TlsProxy`]:
    /// clients speak TLS+SASL (`SASL_SSL`) to the proxy.
    pub tls: Option<(String, String)>,
}

impl SaslOptions {
    /// Plain TCP (`SASL_PLAINTEXT`) with these mechanisms.
    pub fn new(mechanisms: &[&str]) -> Self {
        Self {
            mechanisms: mechanisms.iter().map(|m| m.to_string()).collect(),
            tls: None,
        }
    }

    /// The same over TLS (`SASL_SSL`) with this certificate chain and key (PEM).
    pub fn with_tls(mut self, cert_pem: &str, key_pem: &str) -> Self {
        self.tls = Some((cert_pem.to_string(), key_pem.to_string()));
        self
    }
}

struct User {
    password: String,
    /// SCRAM salt, new with every password.
    salt: Vec<u8>,
    /// SCRAM salted passwords, by [`ScramHash`], computed on first use.
    salted: [Option<Vec<u8>>; 2],
}

#[derive(Default)]
struct Shared {
    mechanisms: Vec<String>,
    users: Mutex<HashMap<String, User>>,
    tokens: Mutex<HashSet<String>>,
    any_token: AtomicBool,
    successes: AtomicU64,
    failures: AtomicU64,
    principals: Mutex<Vec<String>>,
    extensions: Mutex<Vec<(String, String)>>,
    seen: Mutex<Vec<(i16, i16)>>,
}

/// See the module docs. Dropping it stops accepting (open connections end with the thread's
/// runtime).
pub struct SaslProxy {
    pub port: u16,
    shared: Arc<Shared>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl SaslProxy {
    /// Listens on 127.0.0.1 (a free port) and forwards authenticated connections to `upstream`
    /// in plain TCP. Fails on a mechanism outside [`MECHANISMS`] or a bad TLS certificate/key.
    pub fn start(upstream: SocketAddr, opts: SaslOptions) -> Result<Self> {
        for m in &opts.mechanisms {
            if !MECHANISMS.contains(&m.as_str()) {
                bail!("SASL mechanism {m:?} is not one of {MECHANISMS:?}");
            }
        }
        let acceptor = match &opts.tls {
            Some((cert, key)) => Some(tls_acceptor(cert, key)?),
            None => None,
        };
        let shared = Arc::new(Shared {
            mechanisms: opts.mechanisms.clone(),
            ..Shared::default()
        });
        let sh = shared.clone();
        let (port, stop) = crate::acceptor::spawn("sasl-proxy", 0, move |sock| {
            let (sh, acceptor) = (sh.clone(), acceptor.clone());
            async move {
                match acceptor {
                    // A failed TLS handshake just ends the connection.
                    Some(a) => {
                        if let Ok(tls) = a.accept(sock).await {
                            serve(tls, upstream, sh).await;
                        }
                    }
                    None => serve(sock, upstream, sh).await,
                }
            }
        })?;
        Ok(Self {
            port,
            shared,
            _stop: stop,
        })
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Adds `user`, or replaces its password (rotation: new connections need the new one,
    /// authenticated ones keep working). Valid for PLAIN and both SCRAMs (a fresh salt).
    pub fn set_user(&self, user: &str, password: &str) {
        let salt: [u8; 16] = rand::random();
        self.shared.users.lock().unwrap().insert(
            user.to_string(),
            User {
                password: password.to_string(),
                salt: salt.to_vec(),
                salted: [None, None],
            },
        );
    }

    /// Removes `user`: new connections as it fail.
    pub fn remove_user(&self, user: &str) {
        self.shared.users.lock().unwrap().remove(user);
    }

    /// OAUTHBEARER: accept this bearer token (compared whole).
    pub fn allow_token(&self, token: &str) {
        self.shared.tokens.lock().unwrap().insert(token.to_string());
    }

    /// OAUTHBEARER: accept any bearer token (e.g. librdkafka's unsecured JWTs, whose `iat`
    /// changes with every token).
    pub fn allow_any_token(&self) {
        self.shared.any_token.store(true, Ordering::SeqCst);
    }

    /// A callback that calls [`SaslProxy::allow_token`] on this proxy, for a token source
    /// such as [`crate::TokenStub::on_issue`].
    pub fn token_allower(&self) -> impl Fn(&str) + Send + Sync + 'static {
        let sh = self.shared.clone();
        move |t: &str| {
            sh.tokens.lock().unwrap().insert(t.to_string());
        }
    }

    #[cfg(test)]
    pub(crate) fn token_allowed(&self, token: &str) -> bool {
        self.shared.tokens.lock().unwrap().contains(token)
    }

    /// Completed authentications.
    pub fn successes(&self) -> u64 {
        self.shared.successes.load(Ordering::SeqCst)
    }

    /// Refused authentications: wrong credentials, an unknown user or token, a mechanism not
    /// enabled (counted before the answer is written).
    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::SeqCst)
    }

    /// Who authenticated, in order: the user name, or for OAUTHBEARER the token's `sub` when it
    /// is a JWT, else `"token"`.
    pub fn principals(&self) -> Vec<String> {
        self.shared.principals.lock().unwrap().clone()
    }

    /// OAUTHBEARER extensions (RFC 7628 key=value pairs other than `auth`) of the last
    /// successful OAUTHBEARER authentication, e.g. `("logicalCluster", "lkc-1")`.
    pub fn extensions(&self) -> Vec<(String, String)> {
        self.shared.extensions.lock().unwrap().clone()
    }

    /// The distinct (api_key, api_version) pairs clients sent before authenticating, in order
    /// of first appearance (to see which ApiVersions/SaslHandshake/SaslAuthenticate versions a
    /// client uses).
    pub fn seen_versions(&self) -> Vec<(i16, i16)> {
        self.shared.seen.lock().unwrap().clone()
    }
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut client: S,
    upstream: SocketAddr,
    sh: Arc<Shared>,
) {
    match authenticate(&mut client, upstream, &sh).await {
        Ok(Some(mut up)) => {
            let _ = up.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
        }
        Ok(None) => {
            let _ = client.shutdown().await;
        }
        Err(e) => {
            eprintln!("sasl proxy: closing a client connection: {e:#}");
            let _ = client.shutdown().await;
        }
    }
}

/// What one SASL step answers.
enum Step {
    /// Send these bytes and wait for the next SaslAuthenticate (SCRAM's server-first).
    Continue(Vec<u8>),
    /// Authenticated as this principal (send these bytes, then pass traffic).
    Done {
        bytes: Vec<u8>,
        principal: String,
        extensions: Option<Vec<(String, String)>>,
    },
    /// Refused with this message.
    Fail(String),
}

/// Runs the pre-authentication part of a connection: `Some(upstream)` once the client
/// authenticated, `None` when the connection is to be closed.
async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    client: &mut S,
    upstream: SocketAddr,
    sh: &Shared,
) -> Result<Option<TcpStream>> {
    let mut up = TcpStream::connect(upstream)
        .await
        .with_context(|| format!("connect to the broker at {upstream}"))?;
    let mut mechanism: Option<String> = None;
    let mut scram: Option<ScramFirst> = None;
    loop {
        let Some(frame) = read_frame(client).await? else {
            return Ok(None);
        };
        if frame.len() < 8 {
            bail!(
                "not a Kafka request (a {}-byte frame: {:02x?})",
                frame.len(),
                frame
            );
        }
        let key = i16::from_be_bytes([frame[0], frame[1]]);
        let version = i16::from_be_bytes([frame[2], frame[3]]);
        let corr = i32::from_be_bytes([frame[4], frame[5], frame[6], frame[7]]);
        {
            let mut seen = sh.seen.lock().unwrap();
            if !seen.contains(&(key, version)) {
                seen.push((key, version));
            }
        }
        match key {
            API_VERSIONS => {
                write_frame(&mut up, &frame).await?;
                let resp = read_frame(&mut up)
                    .await?
                    .context("the broker closed during ApiVersions")?;
                write_frame(client, &resp).await?;
            }
            SASL_HANDSHAKE => {
                if version > 1 {
                    bail!("SaslHandshake v{version} is not supported (v0/v1 only)");
                }
                let mut r = Reader::new(&frame[8..]);
                r.nullable_string().context("SaslHandshake client_id")?;
                let mech = r
                    .nullable_string()
                    .context("SaslHandshake mechanism")?
                    .unwrap_or_default();
                let ok = sh.mechanisms.contains(&mech);
                let mut out = corr.to_be_bytes().to_vec();
                let err = if ok { 0 } else { UNSUPPORTED_SASL_MECHANISM };
                out.extend(err.to_be_bytes());
                out.extend((sh.mechanisms.len() as i32).to_be_bytes());
                for m in &sh.mechanisms {
                    put_string(&mut out, Some(m));
                }
                if !ok {
                    sh.failures.fetch_add(1, Ordering::SeqCst);
                    write_frame(client, &out).await?;
                    return Ok(None);
                }
                write_frame(client, &out).await?;
                mechanism = Some(mech);
                scram = None;
            }
            SASL_AUTHENTICATE => {
                if version > 1 {
                    // v2 is flexible (KIP-482): compact strings and tagged fields.
                    eprintln!(
                        "sasl proxy: SaslAuthenticate v{version} (flexible) is NOT IMPLEMENTED \
                         (v0/v1 only): closing the connection"
                    );
                    return Ok(None);
                }
                let Some(mech) = mechanism.clone() else {
                    let msg = "SaslAuthenticate before SaslHandshake".to_string();
                    sh.failures.fetch_add(1, Ordering::SeqCst);
                    write_frame(
                        client,
                        &auth_response(corr, version, ILLEGAL_SASL_STATE, &msg),
                    )
                    .await?;
                    return Ok(None);
                };
                let mut r = Reader::new(&frame[8..]);
                r.nullable_string().context("SaslAuthenticate client_id")?;
                let bytes = r.bytes().context("SaslAuthenticate auth_bytes")?;
                let step = match mech.as_str() {
                    "PLAIN" => plain(sh, &bytes),
                    "OAUTHBEARER" => oauthbearer(sh, &bytes),
                    "SCRAM-SHA-256" | "SCRAM-SHA-512" => {
                        let hash = if mech == "SCRAM-SHA-256" {
                            ScramHash::Sha256
                        } else {
                            ScramHash::Sha512
                        };
                        match scram.take() {
                            None => {
                                let snonce = B64.encode(rand::random::<[u8; 18]>());
                                // PBKDF2 blocks this single-threaded proxy (a quarter second
                                // for SHA-512 in a debug build): once per password and hash.
                                let lookup = |u: &str| {
                                    let mut users = sh.users.lock().unwrap();
                                    let u = users.get_mut(u)?;
                                    let i = hash as usize;
                                    if u.salted[i].is_none() {
                                        u.salted[i] = Some(hash.salted_password(
                                            &u.password,
                                            &u.salt,
                                            SCRAM_ITERATIONS,
                                        ));
                                    }
                                    Some((u.salt.clone(), u.salted[i].clone().unwrap()))
                                };
                                match scram_first(
                                    hash,
                                    &String::from_utf8_lossy(&bytes),
                                    lookup,
                                    &snonce,
                                    SCRAM_ITERATIONS,
                                ) {
                                    Ok(first) => {
                                        let out = first.server_first.clone().into_bytes();
                                        scram = Some(first);
                                        Step::Continue(out)
                                    }
                                    Err(msg) => Step::Fail(msg),
                                }
                            }
                            Some(first) => {
                                match scram_final(&first, &String::from_utf8_lossy(&bytes)) {
                                    Ok(server_final) => Step::Done {
                                        bytes: server_final.into_bytes(),
                                        principal: first.user.clone(),
                                        extensions: None,
                                    },
                                    Err(msg) => Step::Fail(msg),
                                }
                            }
                        }
                    }
                    other => unreachable!("mechanism {other} was enabled"),
                };
                match step {
                    Step::Continue(b) => {
                        write_frame(client, &auth_ok(corr, version, &b)).await?;
                    }
                    Step::Done {
                        bytes,
                        principal,
                        extensions,
                    } => {
                        sh.successes.fetch_add(1, Ordering::SeqCst);
                        sh.principals.lock().unwrap().push(principal);
                        if let Some(ext) = extensions {
                            *sh.extensions.lock().unwrap() = ext;
                        }
                        write_frame(client, &auth_ok(corr, version, &bytes)).await?;
                        return Ok(Some(up));
                    }
                    Step::Fail(msg) => {
                        let msg = if msg.is_empty() {
                            format!(
                                "Authentication failed during authentication due to invalid \
                                 credentials with SASL mechanism {mech}"
                            )
                        } else {
                            msg
                        };
                        sh.failures.fetch_add(1, Ordering::SeqCst);
                        let out = auth_response(corr, version, SASL_AUTHENTICATION_FAILED, &msg);
                        write_frame(client, &out).await?;
                        return Ok(None);
                    }
                }
            }
            _ if !(0..=200).contains(&key) => {
                bail!(
                    "not a Kafka request (api_key {key}; first bytes {:02x?}): raw SASL tokens \
                     after a SaslHandshake v0 are not supported",
                    &frame[..frame.len().min(16)]
                );
            }
            _ => {
                // As Kafka: anything else before authentication closes the connection.
                eprintln!(
                    "sasl proxy: api_key {key} v{version} before authentication: closing the \
                     connection"
                );
                return Ok(None);
            }
        }
    }
}

/// A successful SaslAuthenticate response.
fn auth_ok(corr: i32, version: i16, bytes: &[u8]) -> Vec<u8> {
    let mut out = corr.to_be_bytes().to_vec();
    out.extend(0i16.to_be_bytes());
    put_string(&mut out, None);
    out.extend((bytes.len() as i32).to_be_bytes());
    out.extend(bytes);
    if version >= 1 {
        // session_lifetime_ms: 0, no re-authentication (KIP-368).
        out.extend(0i64.to_be_bytes());
    }
    out
}

/// A failed SaslAuthenticate response.
fn auth_response(corr: i32, version: i16, error: i16, msg: &str) -> Vec<u8> {
    let mut out = corr.to_be_bytes().to_vec();
    out.extend(error.to_be_bytes());
    put_string(&mut out, Some(msg));
    out.extend(0i32.to_be_bytes());
    if version >= 1 {
        out.extend(0i64.to_be_bytes());
    }
    out
}

fn put_string(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => {
            out.extend((s.len() as i16).to_be_bytes());
            out.extend(s.as_bytes());
        }
        None => out.extend((-1i16).to_be_bytes()),
    }
}

/// One length-prefixed frame; `None` at a clean end of stream.
async fn read_frame<S: AsyncRead + Unpin>(s: &mut S) -> Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let n = i32::from_be_bytes(len);
    if n < 0 || n as usize > MAX_FRAME {
        bail!(
            "not a Kafka frame (length prefix {len:02x?}): a TLS client on a plain listener, or \
             plain text on a TLS one?"
        );
    }
    let mut buf = vec![0u8; n as usize];
    s.read_exact(&mut buf).await?;
    Ok(Some(buf))
}

async fn write_frame<S: AsyncWrite + Unpin>(s: &mut S, body: &[u8]) -> Result<()> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend((body.len() as i32).to_be_bytes());
    out.extend(body);
    s.write_all(&out).await?;
    s.flush().await?;
    Ok(())
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8]) -> Self {
        Self { b }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            bail!("truncated ({} bytes left, {n} needed)", self.b.len());
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    fn nullable_string(&mut self) -> Result<Option<String>> {
        let n = i16::from_be_bytes(self.take(2)?.try_into().unwrap());
        if n < 0 {
            return Ok(None);
        }
        Ok(Some(
            String::from_utf8_lossy(self.take(n as usize)?).into_owned(),
        ))
    }

    fn bytes(&mut self) -> Result<Vec<u8>> {
        let n = i32::from_be_bytes(self.take(4)?.try_into().unwrap());
        if n < 0 {
            return Ok(vec![]);
        }
        Ok(self.take(n as usize)?.to_vec())
    }
}

pub(crate) mod mechanisms;
use mechanisms::*;

#[cfg(test)]
mod tests;
