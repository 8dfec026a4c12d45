//! Admission to the metrics listener (issue 53): who gets a connection slot, so that no client
//! can fail the health probes.
//!
//! One budget for every connection let 32 held connections (idle, or a header never finished)
//! take every slot: `outboxd probe` and the kubelet's `/healthz` were accepted and dropped, 24 of
//! 24 times, and Kubernetes restarted both replicas. A connection is known only once its request
//! head arrived, so a connection lives in three budgets, one after the other:
//! - **pending** until its whole request head (up to the blank line) arrived. When this budget is
//!   full, a new connection evicts the *oldest* pending one instead of being refused: a probe
//!   sends its head at once and is past this stage in microseconds, while a held connection
//!   only waits to be evicted. Holding connections cannot keep a probe out; only opening them
//!   faster than a probe writes one line can.
//! - **probes** (`/healthz`, `/readyz`): their own small budget. The head is already read, the
//!   answer is a line, the connection closes after it (no keep-alive): a probe holds its slot
//!   for microseconds, so a client cannot keep these slots either.
//! - **others** (`/metrics`, the status page): the rest, with keep-alive and the listener's
//!   timeouts (`http`). Full, a new request of this kind is closed; the probes are unaffected.

use hyper::body::{Buf, Bytes};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, Semaphore};

/// The largest request head read before the request is classified; hyper refuses larger ones
/// anyway. A longer head is classified as "other" and left to hyper.
const HEAD_MAX: usize = 8 * 1024;

/// The three budgets of one listener.
#[derive(Debug)]
pub(super) struct Budgets {
    pub pending: Arc<Pending>,
    pub probes: Arc<Semaphore>,
    pub others: Arc<Semaphore>,
}

impl Budgets {
    /// Splits `total` connections: half pending, an eighth (at least one) probes, the rest
    /// (at least one) others.
    pub fn split(total: usize) -> Self {
        let pending = (total / 2).max(1);
        let probes = (total / 8).max(1);
        let others = total.saturating_sub(pending + probes).max(1);
        Budgets {
            pending: Arc::new(Pending::new(pending)),
            probes: Arc::new(Semaphore::new(probes)),
            others: Arc::new(Semaphore::new(others)),
        }
    }
}

/// Connections whose request head has not arrived yet, oldest first.
#[derive(Debug)]
pub(super) struct Pending {
    cap: usize,
    next: AtomicU64,
    queue: Mutex<VecDeque<(u64, Arc<Notify>)>>,
}

/// A pending connection's place; leaving the stage (or being dropped) gives it back.
#[derive(Debug)]
pub(super) struct Ticket {
    id: u64,
    evict: Arc<Notify>,
    pending: Arc<Pending>,
}

impl Pending {
    fn new(cap: usize) -> Self {
        Pending {
            cap,
            next: AtomicU64::new(0),
            queue: Mutex::new(VecDeque::new()),
        }
    }

    /// A new connection's place. When the stage is full, the oldest pending connection is told
    /// to close (`true`: one was evicted; the caller lets it run before accepting more, so the
    /// descriptors held stay within the budget).
    pub fn enter(self: &Arc<Self>) -> (Ticket, bool) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let evict = Arc::new(Notify::new());
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let mut evicted = false;
        while q.len() >= self.cap {
            if let Some((_, oldest)) = q.pop_front() {
                oldest.notify_one();
                evicted = true;
            }
        }
        q.push_back((id, evict.clone()));
        let ticket = Ticket {
            id,
            evict,
            pending: self.clone(),
        };
        (ticket, evicted)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.queue.lock().map(|q| q.len()).unwrap_or(0)
    }
}

impl Ticket {
    /// Resolves when a newer connection took this one's place.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut q = self.pending.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.retain(|(id, _)| *id != self.id);
    }
}

/// What a request asks for, as far as admission cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    /// `/healthz` or `/readyz`: answered at once from memory.
    Probe,
    Other,
}

/// The class of a request from its head's first line (`GET /healthz HTTP/1.1`).
pub(super) fn class_of(head: &[u8]) -> Class {
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or(&[]);
    let mut parts = line.split(|&b| b == b' ');
    let target = parts.nth(1).unwrap_or(&[]);
    let path = target.split(|&b| b == b'?').next().unwrap_or(&[]);
    match path {
        b"/healthz" | b"/readyz" => Class::Probe,
        _ => Class::Other,
    }
}

/// Reads from `s` until the request head ended (a blank line), [`HEAD_MAX`] bytes arrived or
/// the client closed; everything read is returned, to be served from.
pub(super) async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Ok(head);
        }
        let scan_from = head.len().saturating_sub(3);
        head.extend_from_slice(&buf[..n]);
        if head[scan_from..].windows(4).any(|w| w == b"\r\n\r\n") || head.len() >= HEAD_MAX {
            return Ok(head);
        }
    }
}

/// A stream that first yields bytes already read from it (the request head), then reads on —
/// or, with `head_only`, ends there (writes still go to the client).
#[derive(Debug)]
pub(super) struct Prefixed<S> {
    head: Bytes,
    head_only: bool,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(head: Vec<u8>, inner: S, head_only: bool) -> Self {
        Prefixed {
            head: Bytes::from(head),
            head_only,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.head.has_remaining() {
            let n = self.head.len().min(buf.remaining());
            buf.put_slice(&self.head[..n]);
            self.head.advance(n);
            return Poll::Ready(Ok(()));
        }
        if self.head_only {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_split_and_never_vanish() {
        let sizes = |total| {
            let b = Budgets::split(total);
            let (probes, others) = (b.probes.available_permits(), b.others.available_permits());
            (b.pending.cap, probes, others)
        };
        assert_eq!(sizes(32), (16, 4, 12));
        assert_eq!(sizes(16), (8, 2, 6));
        assert_eq!(sizes(4), (2, 1, 1));
    }

    #[tokio::test]
    async fn a_full_pending_stage_evicts_its_oldest() {
        let p = Arc::new(Pending::new(2));
        let (a, e1) = p.enter();
        let (_b, e2) = p.enter();
        assert!(!e1 && !e2);
        let (c, e3) = p.enter();
        assert!(e3, "the third evicts one");
        assert_eq!(p.len(), 2);
        // The oldest was told; the notification waits for it.
        tokio::time::timeout(std::time::Duration::from_secs(1), a.evicted())
            .await
            .expect("a evicted");
        drop(c);
        assert_eq!(p.len(), 1, "a ticket leaves when dropped");
        drop(a);
        assert_eq!(p.len(), 1, "an evicted ticket was gone already");
    }

    #[test]
    fn probes_are_known_by_their_path() {
        assert_eq!(class_of(b"GET /healthz HTTP/1.1\r\n\r\n"), Class::Probe);
        assert_eq!(class_of(b"GET /readyz?x=1 HTTP/1.0\r\n\r\n"), Class::Probe);
        assert_eq!(class_of(b"GET / HTTP/1.1\r\n\r\n"), Class::Other);
        assert_eq!(class_of(b"GET /metrics HTTP/1.1\r\n\r\n"), Class::Other);
        assert_eq!(class_of(b"GET /healthzz HTTP/1.1\r\n"), Class::Other);
        assert_eq!(class_of(b""), Class::Other);
    }

    #[tokio::test]
    async fn the_head_is_read_whole_and_served_again() {
        let (mut client, server) = tokio::io::duplex(64);
        client
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nrest")
            .await
            .unwrap();
        drop(client);
        let mut server = server;
        let head = read_head(&mut server).await.unwrap();
        assert!(head.ends_with(b"\r\n\r\n") || head.ends_with(b"rest"));
        let mut p = Prefixed::new(head, server, false);
        let mut all = String::new();
        p.read_to_string(&mut all).await.unwrap();
        assert_eq!(all, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nrest");

        // head_only: the head, then the end, whatever else the client sends.
        let (mut client, mut server) = tokio::io::duplex(64);
        client
            .write_all(b"GET /readyz HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let head = read_head(&mut server).await.unwrap();
        client.write_all(b"more").await.unwrap();
        let mut p = Prefixed::new(head, server, true);
        let mut all = String::new();
        p.read_to_string(&mut all).await.unwrap();
        assert_eq!(all, "GET /readyz HTTP/1.1\r\n\r\n");
    }

    use tokio::io::AsyncWriteExt;
}
