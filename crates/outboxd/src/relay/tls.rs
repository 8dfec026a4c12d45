//! TLS to Postgres with libpq's `sslmode` meanings, for both connections a session opens: the
//! SQL one (tokio-postgres over rustls) and the replication stream (pgwire-replication, which
//! has its own rustls client). One setting drives both, so the stream can never end up less
//! protected than the SQL connection beside it.

use crate::model::tls::{SslMode, TlsError, TlsSettings};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::path::Path;
use std::sync::Arc;

/// The mode in force: `source.sslmode`, else the DSN's own `sslmode` (tokio-postgres knows
/// disable/prefer/require), else `prefer`.
pub fn mode(s: TlsSettings<'_>, dsn: &tokio_postgres::Config) -> SslMode {
    s.sslmode.unwrap_or(match dsn.get_ssl_mode() {
        tokio_postgres::config::SslMode::Disable => SslMode::Disable,
        tokio_postgres::config::SslMode::Require => SslMode::Require,
        _ => SslMode::Prefer,
    })
}

/// What to change when a connection failed for a TLS reason (from either client's message).
pub fn hint(error: &str) -> Option<&'static str> {
    let e = error.to_ascii_lowercase();
    Some(if e.contains("no encryption") {
        "no pg_hba.conf line admits this role without TLS: set source.sslmode \
         (\"verify-full\" with source.sslrootcert, or \"require\"), or add a host line for it"
    } else if e.contains("unknownissuer") || e.contains("unknown issuer") {
        "the server's certificate is not signed by a CA in source.sslrootcert (the Mozilla \
         roots when unset): point source.sslrootcert at the CA that signed it"
    } else if e.contains("notvalidforname") || e.contains("not valid for name") {
        "the server's certificate does not list the host in source.dsn: connect by a name it \
         lists (`host=<that name> hostaddr=<ip>` keeps connecting to the address)"
    } else if e.contains("does not support tls") || e.contains("sslrequest rejected") {
        "the server has ssl = off: enable TLS on the server, or lower source.sslmode"
    } else {
        return None;
    })
}

/// The connector for the SQL connection; `pg`'s own ssl mode is set to match.
pub fn sql_connector(
    s: TlsSettings<'_>,
    pg: &mut tokio_postgres::Config,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, TlsError> {
    let mode = mode(s, pg);
    pg.ssl_mode(match mode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(
        client_config(s, mode).map_err(TlsError)?,
    ))
}

/// The same policy for the replication stream; `name` is what the certificate must list
/// (the DSN's host, also when `hostaddr` says where to connect).
pub fn replication(
    s: TlsSettings<'_>,
    pg: &tokio_postgres::Config,
    name: &str,
) -> pgwire_replication::TlsConfig {
    use pgwire_replication::SslMode as P;
    pgwire_replication::TlsConfig {
        mode: match mode(s, pg) {
            SslMode::Disable => P::Disable,
            SslMode::Prefer => P::Prefer,
            SslMode::Require => P::Require,
            SslMode::VerifyCa | SslMode::VerifyFull => P::VerifyFull,
        },
        ca_pem_path: s.sslrootcert.map(Path::to_path_buf),
        // Given explicitly, so an IP literal is checked against the certificate's IP entries
        // (as libpq does) instead of being refused by the stream client.
        sni_hostname: Some(name.to_string()),
        client_cert_pem_path: s.sslcert.map(Path::to_path_buf),
        client_key_pem_path: s.sslkey.map(Path::to_path_buf),
    }
}

fn client_config(s: TlsSettings<'_>, mode: SslMode) -> Result<rustls::ClientConfig, String> {
    // An explicit provider: never depend on which one the process happened to install.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match mode {
        SslMode::Disable | SslMode::Prefer | SslMode::Require => {
            Arc::new(EncryptOnly(provider.clone()))
        }
        // verify-ca never gets here (refused by `validate`); verify as fully as we can.
        SslMode::VerifyCa | SslMode::VerifyFull => WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots(s.sslrootcert)?),
            provider.clone(),
        )
        .build()
        .map_err(|e| format!("TLS verifier: {e}"))?,
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    match (s.sslcert, s.sslkey) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("source.sslcert = {}: {e}", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| format!("source.sslkey = {}: {e}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("source.sslcert / source.sslkey: {e}"))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// What is wrong with a TLS server's certificate, as rustls sees it with the given CA file.
#[derive(Debug, PartialEq, Eq)]
pub enum CertProblem {
    /// Not signed by a CA in the file (or, without one, by a public CA).
    UnknownCa,
    /// Signed correctly, but for other names than the one connected to.
    WrongName,
}

/// librdkafka's OpenSSL reports a wrong CA and a wrong name alike ("certificate verify
/// failed"); `outboxd check` asks rustls, with the same CA file, which one it is. `None`: the
/// handshake succeeded or failed for another reason.
pub fn diagnose_server_cert(host: &str, port: u16, ca: Option<&Path>) -> Option<CertProblem> {
    use std::net::ToSocketAddrs;
    let roots = roots(ca).ok()?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).ok()?;
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
    let addr = (host, port).to_socket_addrs().ok()?.next()?;
    let timeout = std::time::Duration::from_secs(5);
    let mut sock = std::net::TcpStream::connect_timeout(&addr, timeout).ok()?;
    sock.set_read_timeout(Some(timeout)).ok()?;
    sock.set_write_timeout(Some(timeout)).ok()?;
    while conn.is_handshaking() {
        if let Err(e) = conn.complete_io(&mut sock) {
            use rustls::CertificateError as C;
            let inner = e.get_ref()?.downcast_ref::<rustls::Error>()?;
            return match inner {
                rustls::Error::InvalidCertificate(C::UnknownIssuer) => Some(CertProblem::UnknownCa),
                rustls::Error::InvalidCertificate(
                    C::NotValidForName | C::NotValidForNameContext { .. },
                ) => Some(CertProblem::WrongName),
                _ => None,
            };
        }
    }
    None
}

/// `sslrootcert`'s certificates, else the Mozilla roots (what public managed services chain to).
fn roots(path: Option<&Path>) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    let Some(path) = path else {
        store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        return Ok(store);
    };
    let bad = |e: &dyn std::fmt::Display| format!("source.sslrootcert = {}: {e}", path.display());
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(&e))? {
        store.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    if store.is_empty() {
        return Err(bad(&"no PEM certificate in the file"));
    }
    Ok(store)
}

/// `prefer` / `require`: whose certificate it is goes unchecked (as in libpq), but the
/// handshake must still be signed by the certificate's key.
#[derive(Debug)]
struct EncryptOnly(Arc<CryptoProvider>);

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algs = &self.0.signature_verification_algorithms;
        verify_tls12_signature(message, cert, dss, algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algs = &self.0.signature_verification_algorithms;
        verify_tls13_signature(message, cert, dss, algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    fn source(extra: &str) -> Result<Config, crate::config::ConfigError> {
        Config::from_toml_and_env(
            &format!(
                "[source]\ndsn = \"postgres://u@h/db?sslmode=require\"\n{extra}\n\
                 [sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n"
            ),
            vec![],
        )
    }

    #[test]
    fn mode_comes_from_the_config_then_the_dsn() {
        let c = source("").unwrap();
        let dsn: tokio_postgres::Config = c.source.dsn.parse().unwrap();
        assert_eq!(mode(c.source.tls(), &dsn), SslMode::Require);
        let c = source("sslmode = \"verify-full\"").unwrap();
        assert_eq!(mode(c.source.tls(), &dsn), SslMode::VerifyFull);
    }

    #[test]
    fn misplaced_settings_are_refused_with_the_reason() {
        let e = source("sslrootcert = \"/etc/hosts\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("verify-full"), "{e}");
        let e = source("sslmode = \"verify-ca\"").unwrap_err().to_string();
        assert!(e.contains("hostaddr"), "{e}");
        let e = source("sslmode = \"verify-full\"\nsslrootcert = \"/nonexistent/ca.pem\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such file"), "{e}");
        let e = source("sslcert = \"/etc/hosts\"").unwrap_err().to_string();
        assert!(e.contains("sslkey"), "{e}");
        assert!(source("sslmode = \"verify-everything\"").is_err());
    }

    #[test]
    fn tls_failures_get_the_fix() {
        for (err, fix) in [
            (
                "no pg_hba.conf entry for host, no encryption",
                "source.sslmode",
            ),
            (
                "invalid peer certificate: UnknownIssuer",
                "source.sslrootcert",
            ),
            ("invalid peer certificate: NotValidForName", "hostaddr"),
            ("server does not support TLS", "ssl = off"),
        ] {
            assert!(hint(err).is_some_and(|h| h.contains(fix)), "{err}");
        }
        assert_eq!(hint("connection refused"), None);
    }
}
