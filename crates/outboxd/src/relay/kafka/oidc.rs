//! SASL/OAUTHBEARER tokens from an OpenID Connect provider (the client-credentials grant),
//! fetched by outboxd itself.
//!
//! librdkafka implements `sasl.oauthbearer.method = "oidc"` with libcurl, which the
//! self-contained build leaves out (a static libcurl does not link into librdkafka's build, and a
//! system one would tie the binary to the host's libcurl and its TLS library). So outboxd reads
//! the same properties librdkafka documents, keeps them away from librdkafka (which would refuse
//! them), requests each token over HTTPS (rustls, the system-independent Mozilla roots or
//! `https.ca.location`) and hands it to librdkafka with `rd_kafka_oauthbearer_set_token`,
//! refreshing at 80% of its lifetime. Extensions (`sasl.oauthbearer.extensions`, e.g. Confluent
//! Cloud's `logicalCluster` and `identityPoolId`) travel with the token.
//!
//! A refused token request is an authentication failure: transient, retried with backoff and
//! reported as class `auth` (credentials get rotated; the next attempt may succeed).

use crate::config::oidc::OidcConfig;
use base64::Engine as _;
use std::ffi::CString;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

impl OidcConfig {
    /// One token request (blocking; bounded by a 10 s timeout).
    pub fn fetch(&self) -> Result<Token, OidcError> {
        let mut tls = ureq::tls::TlsConfig::builder();
        if let Some(path) = &self.ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                OidcError::Setup(format!("https.ca.location = {path:?}: cannot read it: {e}"))
            })?;
            let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
                .filter_map(|i| match i {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            if certs.is_empty() {
                return Err(OidcError::Setup(format!(
                    "https.ca.location = {path:?} holds no PEM certificate"
                )));
            }
            tls = tls.root_certs(ureq::tls::RootCerts::Specific(Arc::new(certs)));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(10)))
            .http_status_as_error(false)
            .tls_config(tls.build())
            .build()
            .into();
        let basic = base64::engine::general_purpose::STANDARD
            .encode(format!("{}:{}", self.client_id, self.client_secret));
        let mut form = vec![("grant_type", "client_credentials")];
        if let Some(s) = &self.scope {
            form.push(("scope", s.as_str()));
        }
        let mut resp = agent
            .post(&self.endpoint)
            .header("Authorization", &format!("Basic {basic}"))
            .header("Accept", "application/json")
            .send_form(form)
            // ureq's errors name the URL and the transport problem, never the request headers.
            .map_err(|e| OidcError::Unreachable(format!("{}: {e}", self.endpoint)))?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_to_string()
            .map_err(|e| OidcError::BadResponse(format!("reading the response: {e}")))?;
        let doc: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        if !(200..300).contains(&status) {
            // OAuth2 error responses carry a code (invalid_client, unauthorized_client): safe to
            // show. The body itself is not shown; it may echo what was sent.
            let code = doc
                .get("error")
                .and_then(|e| e.as_str())
                .unwrap_or("no error code")
                .chars()
                .take(64)
                .collect();
            return Err(OidcError::Refused { status, code });
        }
        let token = doc
            .get("access_token")
            .and_then(|t| t.as_str())
            .filter(|t| !t.is_empty())
            .ok_or_else(|| OidcError::BadResponse("no access_token in the response".into()))?;
        let claims = jwt_claims(token);
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as i64;
        let expires_ms = claims
            .as_ref()
            .and_then(|c| c.get("exp"))
            .and_then(|e| e.as_f64())
            .map(|e| (e * 1000.0) as i64)
            .or_else(|| {
                doc.get("expires_in")
                    .and_then(|e| e.as_f64())
                    // Saturating: the token endpoint's numbers are input like any other.
                    .map(|s| now_ms.saturating_add((s * 1000.0) as i64))
            })
            .ok_or_else(|| {
                OidcError::BadResponse("the token has neither an exp claim nor expires_in".into())
            })?;
        if expires_ms <= now_ms {
            return Err(OidcError::BadResponse(
                "the token endpoint returned an expired token (check the clocks)".into(),
            ));
        }
        let principal = claims
            .as_ref()
            .and_then(|c| c.get("sub"))
            .and_then(|s| s.as_str())
            .unwrap_or(&self.client_id)
            .to_string();
        Ok(Token {
            value: token.to_string(),
            expires_ms,
            principal,
        })
    }
}

/// The payload of a JWT (`header.payload.signature`), when the token is one. Not verified:
/// the broker does that; outboxd only reads `exp` and `sub` as librdkafka does.
fn jwt_claims(token: &str) -> Option<serde_json::Value> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// A token and what librdkafka needs to know about it.
pub struct Token {
    pub value: String,
    /// When it expires, in milliseconds since the epoch.
    pub expires_ms: i64,
    pub principal: String,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Token(principal {:?}, expires {})",
            self.principal, self.expires_ms
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OidcError {
    /// The provider answered and said no (wrong client id or secret, unknown scope).
    #[error(
        "the OIDC token endpoint refused the client credentials (HTTP {status}, {code}): check \
         sasl.oauthbearer.client.id and sasl.oauthbearer.client.secret (or its .file) and \
         sasl.oauthbearer.scope"
    )]
    Refused { status: u16, code: String },
    #[error("the OIDC token endpoint is unreachable: {0}")]
    Unreachable(String),
    #[error("the OIDC token endpoint answered something unusable: {0}")]
    BadResponse(String),
    #[error("OIDC: {0}")]
    Setup(String),
}

/// A librdkafka client handle the refresher may use from its thread.
struct Handle(*mut rdkafka::bindings::rd_kafka_t);
// SAFETY: rd_kafka_oauthbearer_set_token{,_failure} are thread-safe (they take the SASL
// handle's lock), and the refresher is stopped and joined before the client is destroyed
// (see `Refresher`'s Drop and the field order in `producer::Producer`).
unsafe impl Send for Handle {}

/// Keeps librdkafka supplied with tokens: fetches one at once, then again at 80% of each
/// token's lifetime; failures are retried with backoff (1 s doubling to 30 s) and reported
/// through `on_failure`. Dropping it stops and joins the thread.
pub struct Refresher {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Refresher {
    /// # Safety
    /// `client` must stay valid until the returned value is dropped.
    pub unsafe fn start(
        cfg: OidcConfig,
        client: *mut rdkafka::bindings::rd_kafka_t,
        redactor: crate::config::secrets::Redactor,
        on_result: impl Fn(Result<(), String>) + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let handle = Handle(client);
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("outboxd-oidc".into())
            .spawn(move || {
                let handle = handle;
                let mut backoff = Duration::from_secs(1);
                loop {
                    let wait = match cfg.fetch() {
                        Ok(token) => match set_token(&handle, &token, &cfg.extensions) {
                            Ok(()) => {
                                tracing::info!(
                                    principal = %token.principal,
                                    expires_ms = token.expires_ms,
                                    "OAUTHBEARER token obtained from the OIDC token endpoint"
                                );
                                on_result(Ok(()));
                                backoff = Duration::from_secs(1);
                                refresh_after(token.expires_ms)
                            }
                            Err(e) => {
                                let e = redactor.scrub(&e);
                                tracing::warn!(error = %e, "librdkafka refused the OIDC token");
                                on_result(Err(e));
                                next_backoff(&mut backoff)
                            }
                        },
                        Err(e) => {
                            let msg = redactor.scrub(&e.to_string());
                            tracing::warn!(error = %msg, retry_in_s = backoff.as_secs(), "OIDC token request failed");
                            set_failure(&handle, &msg);
                            on_result(Err(msg));
                            next_backoff(&mut backoff)
                        }
                    };
                    let (lock, cv) = &*stop2;
                    let Ok(guard) = lock.lock() else { return };
                    let Ok((guard, _)) = cv.wait_timeout_while(guard, wait, |s| !*s) else {
                        return;
                    };
                    if *guard {
                        return;
                    }
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Refresher {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        if let Ok(mut s) = lock.lock() {
            *s = true;
        }
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn next_backoff(b: &mut Duration) -> Duration {
    let now = *b;
    *b = (*b * 2).min(Duration::from_secs(30));
    now
}

/// 80% of the remaining lifetime, at least 5 s (librdkafka refreshes at the same point).
fn refresh_after(expires_ms: i64) -> Duration {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64;
    let left = expires_ms.saturating_sub(now_ms).max(0) as u64;
    Duration::from_millis(left / 10 * 8).max(Duration::from_secs(5))
}

fn set_token(h: &Handle, t: &Token, extensions: &[(String, String)]) -> Result<(), String> {
    let nul = |s: &str| CString::new(s).map_err(|_| "a NUL byte in the token or an extension");
    let value = nul(&t.value)?;
    let principal = nul(&t.principal)?;
    let ext: Vec<CString> = extensions
        .iter()
        .flat_map(|(k, v)| [nul(k), nul(v)])
        .collect::<Result<_, _>>()?;
    let mut ptrs: Vec<*const std::ffi::c_char> = ext.iter().map(|c| c.as_ptr()).collect();
    let mut err = [0 as std::ffi::c_char; 512];
    // SAFETY: all strings are NUL-terminated and outlive the call; `ptrs` holds key/value
    // pairs as librdkafka expects; the handle is valid (see `Handle`).
    let code = unsafe {
        rdkafka::bindings::rd_kafka_oauthbearer_set_token(
            h.0,
            value.as_ptr(),
            t.expires_ms,
            principal.as_ptr(),
            if ptrs.is_empty() {
                std::ptr::null_mut()
            } else {
                ptrs.as_mut_ptr()
            },
            ptrs.len(),
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if code == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
        Ok(())
    } else {
        // SAFETY: librdkafka NUL-terminates errstr within its size.
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
        Err(msg.to_string_lossy().into_owned())
    }
}

fn set_failure(h: &Handle, msg: &str) {
    let Ok(c) = CString::new(msg.replace('\0', " ")) else {
        return;
    };
    // SAFETY: valid handle (see `Handle`), NUL-terminated message.
    unsafe {
        rdkafka::bindings::rd_kafka_oauthbearer_set_token_failure(h.0, c.as_ptr());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn far_expiries_do_not_overflow() {
        assert!(refresh_after(i64::MAX) > Duration::from_secs(86_400));
        assert_eq!(refresh_after(i64::MIN), Duration::from_secs(5));
    }

    fn kafka(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn reads_librdkafka_oidc_properties() {
        assert!(
            OidcConfig::from_kafka(&kafka(&[("sasl.mechanism", "PLAIN")]))
                .unwrap()
                .is_none()
        );
        let base = [
            ("sasl.mechanism", "OAUTHBEARER"),
            ("sasl.oauthbearer.method", "oidc"),
            ("sasl.oauthbearer.client.id", "relay"),
            ("sasl.oauthbearer.client.secret", "s3cr3t"),
            (
                "sasl.oauthbearer.token.endpoint.url",
                "https://idp/oauth2/token",
            ),
            (
                "sasl.oauthbearer.extensions",
                "logicalCluster=lkc-1,identityPoolId=pool-2",
            ),
        ];
        let c = OidcConfig::from_kafka(&kafka(&base)).unwrap().unwrap();
        assert_eq!(c.extensions.len(), 2);
        assert!(!format!("{c:?}").contains("s3cr3t"));
        let mut wrong_mech = kafka(&base);
        wrong_mech.insert("sasl.mechanism".into(), "PLAIN".into());
        assert!(OidcConfig::from_kafka(&wrong_mech)
            .unwrap_err()
            .contains("OAUTHBEARER"));
        let mut no_secret = kafka(&base);
        no_secret.remove("sasl.oauthbearer.client.secret");
        assert!(OidcConfig::from_kafka(&no_secret)
            .unwrap_err()
            .contains("client.secret"));
        let mut bad_ext = kafka(&base);
        bad_ext.insert("sasl.oauthbearer.extensions".into(), "novalue".into());
        assert!(OidcConfig::from_kafka(&bad_ext).is_err());
        let mut jwt_bearer = kafka(&base);
        jwt_bearer.insert(
            "sasl.oauthbearer.grant.type".into(),
            "urn:ietf:params:oauth:grant-type:jwt-bearer".into(),
        );
        assert!(OidcConfig::from_kafka(&jwt_bearer)
            .unwrap_err()
            .contains("not supported"));
    }

    #[test]
    fn reads_exp_and_sub_of_a_jwt() {
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let t = format!(
            "{}.{}.",
            b(r#"{"alg":"none"}"#),
            b(r#"{"sub":"svc","exp":4102444800}"#)
        );
        let c = jwt_claims(&t).unwrap();
        assert_eq!(c["sub"], "svc");
        assert!(jwt_claims("opaque-token").is_none());
    }
}
