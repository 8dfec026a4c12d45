//! The OIDC client-credentials settings of `[sink.kafka]` (SASL/OAUTHBEARER with
//! `sasl.oauthbearer.method = "oidc"`), read from librdkafka's own property names. Fetching and
//! refreshing the tokens: `crate::relay::kafka::oidc`.

use std::collections::BTreeMap;

/// The librdkafka properties outboxd handles instead of librdkafka (`crate::relay::kafka::oidc`).
pub const KEYS: &[&str] = &[
    "sasl.oauthbearer.method",
    "sasl.oauthbearer.client.id",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.token.endpoint.url",
    "sasl.oauthbearer.scope",
    "sasl.oauthbearer.extensions",
    "sasl.oauthbearer.grant.type",
    "https.ca.location",
];

/// Whether `key` is one of [`KEYS`] (never passed to librdkafka when OIDC is on).
pub fn is_oidc_key(key: &str) -> bool {
    KEYS.contains(&key)
}

/// The OIDC client-credentials settings of `[sink.kafka]`.
#[derive(Clone)]
pub struct OidcConfig {
    pub(crate) endpoint: String,
    pub(crate) client_id: String,
    pub(crate) client_secret: String,
    pub(crate) scope: Option<String>,
    pub(crate) extensions: Vec<(String, String)>,
    pub(crate) ca_file: Option<String>,
}

impl std::fmt::Debug for OidcConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OidcConfig")
            .field("endpoint", &self.endpoint)
            .field("client_id", &self.client_id)
            .field("client_secret", &super::secrets::REDACTED)
            .field("scope", &self.scope)
            .field("extensions", &self.extensions.len())
            .finish()
    }
}

impl OidcConfig {
    /// `None` unless `sasl.oauthbearer.method = "oidc"`; an error names the property to fix.
    pub fn from_kafka(kafka: &BTreeMap<String, String>) -> Result<Option<Self>, String> {
        let get = |k: &str| kafka.get(k).map(|v| v.trim().to_string());
        match get("sasl.oauthbearer.method").as_deref() {
            None | Some("default") => return Ok(None),
            Some(m) if m.eq_ignore_ascii_case("oidc") => {}
            Some(other) => {
                return Err(format!(
                "sink.kafka.\"sasl.oauthbearer.method\" = {other:?}: use \"oidc\" or \"default\""
            ))
            }
        }
        let mech = get("sasl.mechanism").or_else(|| get("sasl.mechanisms"));
        if !mech
            .as_deref()
            .is_some_and(|m| m.eq_ignore_ascii_case("OAUTHBEARER"))
        {
            return Err(
                "sink.kafka.\"sasl.oauthbearer.method\" = \"oidc\" needs \"sasl.mechanism\" = \"OAUTHBEARER\""
                    .into(),
            );
        }
        if let Some(g) = get("sasl.oauthbearer.grant.type") {
            if g != "client_credentials" {
                return Err(format!(
                    "sink.kafka.\"sasl.oauthbearer.grant.type\" = {g:?} is not supported: outboxd \
                     speaks the client_credentials grant"
                ));
            }
        }
        let need = |k: &str| {
            get(k).filter(|v| !v.is_empty()).ok_or_else(|| {
                format!("sink.kafka.\"{k}\" is required with sasl.oauthbearer.method = \"oidc\"")
            })
        };
        let endpoint = need("sasl.oauthbearer.token.endpoint.url")?;
        if !(endpoint.starts_with("https://") || endpoint.starts_with("http://")) {
            return Err(format!(
                "sink.kafka.\"sasl.oauthbearer.token.endpoint.url\" = {endpoint:?}: use an https:// URL"
            ));
        }
        let extensions = match get("sasl.oauthbearer.extensions") {
            None => Vec::new(),
            Some(s) => parse_extensions(&s)?,
        };
        Ok(Some(Self {
            endpoint,
            client_id: need("sasl.oauthbearer.client.id")?,
            client_secret: need("sasl.oauthbearer.client.secret")?,
            scope: get("sasl.oauthbearer.scope").filter(|s| !s.is_empty()),
            extensions,
            ca_file: get("https.ca.location").filter(|s| s != "probe"),
        }))
    }
}

/// `key=value,key2=value2`, as librdkafka reads `sasl.oauthbearer.extensions`.
fn parse_extensions(s: &str) -> Result<Vec<(String, String)>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').ok_or_else(|| {
                format!(
                    "sink.kafka.\"sasl.oauthbearer.extensions\": {p:?} is not key=value \
                     (use key=value,key2=value2)"
                )
            })?;
            let k = k.trim();
            if k.is_empty() || k == "auth" || !k.chars().all(|c| c.is_ascii_alphabetic()) {
                return Err(format!(
                    "sink.kafka.\"sasl.oauthbearer.extensions\": key {k:?} must be letters and not \"auth\""
                ));
            }
            Ok((k.to_string(), v.trim().to_string()))
        })
        .collect()
}
