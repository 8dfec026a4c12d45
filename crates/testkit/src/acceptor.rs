//! The thread every test server of this crate runs on (TLS proxy, SASL proxy, token endpoint):
//! its own current-thread runtime, so the server keeps answering whatever the test does with
//! its own runtime (blocks it, drops it, or has none).

use std::future::Future;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Binds `127.0.0.1:port` (0: pick one) and serves each accepted connection with `handle` on a
/// thread named `name-<port>`. Returns the port and a sender whose drop stops accepting (open
/// connections end with the thread's runtime).
pub(crate) fn spawn<F, Fut>(
    name: &str,
    port: u16,
    handle: F,
) -> std::io::Result<(u16, oneshot::Sender<()>)>
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let std_listener = std::net::TcpListener::bind(("127.0.0.1", port))?;
    std_listener.set_nonblocking(true)?;
    let port = std_listener.local_addr()?.port();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    std::thread::Builder::new()
        .name(format!("{name}-{port}"))
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("test server runtime");
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).expect("listener");
                let accept = async {
                    while let Ok((sock, _)) = listener.accept().await {
                        let _ = sock.set_nodelay(true);
                        tokio::spawn(handle(sock));
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stop_rx => {}
                }
            });
        })?;
    Ok((port, stop_tx))
}
