//! A TCP fault proxy between the relay and a server: pass traffic, cut every connection,
//! refuse new ones, blackhole (accept and hold bytes without answering, no RST), or add latency.
//!
//! It runs on its own thread and runtime so it keeps working whatever the test does with its own.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward bytes (after `latency`).
    Pass,
    /// Close existing connections and refuse new ones (accept, then close at once).
    Down,
    /// Keep connections open but forward nothing: the peer sees silence, not an error.
    Blackhole,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    mode: Mode,
    latency: Duration,
    /// Bumped by `cut()`: connections opened before the bump close.
    generation: u64,
}

/// See the module docs. Dropping it stops the proxy.
pub struct Proxy {
    pub port: u16,
    tx: watch::Sender<State>,
    state: Arc<Mutex<State>>,
    _thread: std::thread::JoinHandle<()>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Proxy {
    /// Listens on `port` (0: pick one) and forwards to `upstream`.
    pub fn start(port: u16, upstream: SocketAddr) -> std::io::Result<Self> {
        let std_listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
        std_listener.set_nonblocking(true)?;
        let port = std_listener.local_addr()?.port();
        let init = State {
            mode: Mode::Pass,
            latency: Duration::ZERO,
            generation: 0,
        };
        let (tx, rx) = watch::channel(init);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{port}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(std_listener).expect("listener");
                    tokio::select! {
                        _ = accept_loop(listener, upstream, rx) => {}
                        _ = stop_rx => {}
                    }
                });
            })?;
        Ok(Self {
            port,
            tx,
            state: Arc::new(Mutex::new(init)),
            _thread: thread,
            _stop: stop_tx,
        })
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        let mut s = self.state.lock().unwrap();
        f(&mut s);
        let _ = self.tx.send(*s);
    }

    pub fn set_mode(&self, mode: Mode) {
        self.update(|s| {
            if mode == Mode::Down {
                s.generation += 1;
            }
            s.mode = mode;
        });
    }

    pub fn set_latency(&self, latency: Duration) {
        self.update(|s| s.latency = latency);
    }

    /// Close every open connection (new ones are accepted as the mode says).
    pub fn cut(&self) {
        self.update(|s| s.generation += 1);
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, rx: watch::Receiver<State>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let st = *rx.borrow();
        if st.mode == Mode::Down {
            drop(client);
            continue;
        }
        let rx = rx.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let gen = st.generation;
            tokio::select! {
                _ = pump(cr, sw, rx.clone()) => {}
                _ = pump(sr, cw, rx.clone()) => {}
                _ = cut_watch(rx, gen) => {}
            }
        });
    }
}

async fn cut_watch(mut rx: watch::Receiver<State>, gen: u64) {
    loop {
        if rx.borrow().generation != gen {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut rx: watch::Receiver<State>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // While blackholed, read nothing: the sender's buffers fill and it sees silence.
        while rx.borrow().mode == Mode::Blackhole {
            if rx.changed().await.is_err() {
                return;
            }
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let st = *rx.borrow();
        if !st.latency.is_zero() {
            tokio::time::sleep(st.latency).await;
        }
        while rx.borrow().mode == Mode::Blackhole {
            if rx.changed().await.is_err() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
