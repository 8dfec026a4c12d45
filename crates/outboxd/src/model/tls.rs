//! The TLS settings of `[source]` (libpq's `sslmode` and the certificate files) and their
//! config-time checks; the clients that use them: `crate::relay::tls`.

use serde::Deserialize;
use std::path::Path;
use thiserror::Error;

/// A TLS setting that cannot work (an unreadable certificate, a refused combination); the
/// message names the setting.
#[derive(Debug, Clone, Error)]
#[error("{0}")]
pub struct TlsError(pub String);

/// The TLS settings of `[source]`, borrowed from the configuration.
#[derive(Debug, Clone, Copy, Default)]
pub struct TlsSettings<'a> {
    pub sslmode: Option<SslMode>,
    pub sslrootcert: Option<&'a Path>,
    pub sslcert: Option<&'a Path>,
    pub sslkey: Option<&'a Path>,
}

/// libpq's `sslmode`. `prefer` (libpq's default) and `require` encrypt without checking who
/// answers; `verify-full` (chain and host name) stops a man in the middle. `verify-ca` is
/// refused at config time: the replication client (pgwire-replication 0.5.0) fails its
/// host-name exemption under the rustls we link, and a stream less verified than the SQL
/// connection beside it would be a silent downgrade. `hostaddr` covers its use case.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// Config-time checks, so `outboxd check` names the mistake before anything connects.
pub fn validate(s: TlsSettings<'_>) -> Result<(), String> {
    if s.sslmode == Some(SslMode::VerifyCa) {
        return Err(
            "source.sslmode = \"verify-ca\" is not supported (the replication stream \
                    cannot skip the host-name check): use \"verify-full\" and connect by a name \
                    the certificate lists; `host=<that name> hostaddr=<ip>` in source.dsn keeps \
                    connecting to the address"
                .into(),
        );
    }
    if s.sslrootcert.is_some() && s.sslmode != Some(SslMode::VerifyFull) {
        return Err(
            "source.sslrootcert is only used with source.sslmode = \"verify-full\": \
                    set it (require/prefer do not check the certificate)"
                .into(),
        );
    }
    if s.sslcert.is_some() != s.sslkey.is_some() {
        return Err(
            "source.sslcert and source.sslkey come together (client certificate and its key)"
                .into(),
        );
    }
    for (key, p) in [
        ("source.sslrootcert", &s.sslrootcert),
        ("source.sslcert", &s.sslcert),
        ("source.sslkey", &s.sslkey),
    ] {
        if let Some(p) = p {
            if !p.is_file() {
                return Err(format!("{key} = {}: no such file", p.display()));
            }
        }
    }
    Ok(())
}
