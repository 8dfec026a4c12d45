//! The broker hop of the TLS-to-Kafka comparison: a second tansu broker reachable only through
//! one proxy on a thread of the bench process. The proxy takes plain and TLS clients on the same
//! port (a TLS record starts with byte 0x16, a Kafka request with the high byte of its length,
//! 0 below 16 MiB) and forwards the plain bytes to the broker with the same code either way: same
//! broker, same hop, same socket options and buffers, so outboxd → proxy → broker and
//! outboxd → TLS proxy → broker differ in TLS alone. (testkit's `Proxy` and `TlsProxy` are two
//! different forwarders, Nagle off in one and on in the other, which a benchmark would measure
//! along with TLS.) tansu's own TLS listener is not usable, so TLS ends at the proxy, as it would
//! at a broker's TLS listener.
//!
//! The proxy's CPU is its thread's (`/proc/self/task/<tid>/stat`): counted in neither the relay's
//! nor the broker's figures but reported on its own.

use crate::procstat;
use anyhow::{bail, Result};
use outboxd_testkit::Broker;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};

/// Forwarding buffer per direction (testkit's proxy uses the same).
const BUF: usize = 64 * 1024;

/// How a relay reaches the hop's broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hop {
    Plain,
    Tls,
}

/// See the module docs. Dropping it stops the proxy and the broker.
pub struct KafkaHop {
    pub broker: Broker,
    pub broker_pid: Option<u32>,
    /// The proxy's port, which the broker advertises.
    pub port: u16,
    /// PEM of the CA that signed the proxy's certificate (for `ssl.ca.location`).
    pub ca_path: PathBuf,
    tid: Arc<AtomicU32>,
    cipher: Arc<Mutex<Option<String>>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl KafkaHop {
    /// Starts the broker and the proxy; the CA certificate is written into `dir`.
    pub fn start(dir: &Path) -> Result<Self> {
        let (ca_pem, config) = tls_config()?;
        let ca_path = dir.join("kafka-ca.pem");
        std::fs::write(&ca_path, ca_pem)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        // Our listener first, then a broker that advertises it.
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let broker = Broker::start_advertising(port)?;
        let upstream: SocketAddr = ([127, 0, 0, 1], broker.port).into();
        let tid = Arc::new(AtomicU32::new(0));
        let cipher = Arc::new(Mutex::new(None));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (t, c) = (tid.clone(), cipher.clone());
        std::thread::Builder::new()
            .name("kafka-hop".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                t.store(
                    unsafe { libc::syscall(libc::SYS_gettid) } as u32,
                    Ordering::SeqCst,
                );
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("kafka hop runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("listener");
                    let accept = async {
                        while let Ok((sock, _)) = listener.accept().await {
                            tokio::spawn(serve(sock, upstream, acceptor.clone(), c.clone()));
                        }
                    };
                    tokio::select! {
                        _ = accept => {}
                        _ = stop_rx => {}
                    }
                });
            })?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while tid.load(Ordering::SeqCst) == 0 {
            if Instant::now() > deadline {
                bail!("kafka hop thread did not start");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let broker_pid = procstat::find_pid_by_cmdline(&format!(
            "--listener-url tcp://127.0.0.1:{} ",
            broker.port
        ));
        Ok(Self {
            broker,
            broker_pid,
            port,
            ca_path,
            tid,
            cipher,
            _stop: stop_tx,
        })
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The proxy thread's id (for its CPU).
    pub fn proxy_tid(&self) -> u32 {
        self.tid.load(Ordering::SeqCst)
    }

    /// Protocol version and cipher suite of the last TLS connection, e.g. "TLSv1_3
    /// TLS13_AES_256_GCM_SHA384".
    pub fn negotiated(&self) -> Option<String> {
        self.cipher.lock().ok()?.clone()
    }
}

/// A throwaway CA and a certificate it signed for 127.0.0.1 and localhost: (CA PEM, the
/// proxy's rustls config).
fn tls_config() -> Result<(String, rustls::ServerConfig)> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(DnType::CommonName, "outboxd bench CA");
    let ca_key = KeyPair::generate()?;
    let ca = p.self_signed(&ca_key)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?
        .signed_by(&key, &ca, &ca_key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )?;
    Ok((ca.pem(), config))
}

/// Binds 127.0.0.1:`port` as soon as its previous listener (on another thread) has let go.
/// One client connection: TLS or plain by its first byte, then the same forwarding.
async fn serve(
    sock: TcpStream,
    upstream: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    cipher: Arc<Mutex<Option<String>>>,
) {
    let mut first = [0u8; 1];
    let tls = match sock.peek(&mut first).await {
        Ok(1) => first[0] == 0x16,
        _ => return,
    };
    let Ok(mut up) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = sock.set_nodelay(true);
    let _ = up.set_nodelay(true);
    if tls {
        // A failed handshake just ends the connection, as at a real TLS listener.
        let Ok(mut s) = acceptor.accept(sock).await else {
            return;
        };
        let (_, conn) = s.get_ref();
        if let (Some(v), Some(cs), Ok(mut c)) = (
            conn.protocol_version(),
            conn.negotiated_cipher_suite(),
            cipher.lock(),
        ) {
            *c = Some(format!("{v:?} {:?}", cs.suite()));
        }
        let _ = tokio::io::copy_bidirectional_with_sizes(&mut s, &mut up, BUF, BUF).await;
    } else {
        let mut sock = sock;
        let _ = tokio::io::copy_bidirectional_with_sizes(&mut sock, &mut up, BUF, BUF).await;
    }
}
