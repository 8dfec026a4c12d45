//! A TLS-terminating proxy in front of a plain TCP server (the tansu broker speaks TLS only
//! through its rough CLI): clients speak TLS to the proxy, which forwards the plain bytes.
//! Tests use it to prove a client's TLS settings: a private CA, a name the certificate lists or
//! not. It runs on its own thread and runtime.

use anyhow::{Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpStream;

/// See the module docs. Dropping it stops accepting (open connections end with the thread's
/// runtime).
pub struct TlsProxy {
    pub port: u16,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl TlsProxy {
    /// Listens on `port` (0: pick one) with the PEM certificate chain and key, forwards to
    /// `upstream` in plain TCP.
    pub fn start(port: u16, upstream: SocketAddr, cert_pem: &str, key_pem: &str) -> Result<Self> {
        let acceptor = tls_acceptor(cert_pem, key_pem)?;
        let (port, stop) = crate::acceptor::spawn("tls-proxy", port, move |sock| {
            let acceptor = acceptor.clone();
            async move {
                // A failed handshake (wrong CA or name on the client side) just ends the
                // connection, as a real TLS listener does.
                let Ok(mut tls) = acceptor.accept(sock).await else {
                    return;
                };
                let Ok(mut up) = TcpStream::connect(upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            }
        })?;
        Ok(Self { port, _stop: stop })
    }
}

/// A rustls server configuration for a PEM certificate chain and key (also the SASL proxy's).
pub(crate) fn tls_acceptor(cert_pem: &str, key_pem: &str) -> Result<tokio_rustls::TlsAcceptor> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .context("certificate PEM")?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).context("key PEM")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
