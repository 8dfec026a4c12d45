//! Reading a live replication stream in gulps instead of sips.
//!
//! A walsender that has caught up writes every pgoutput message with its own `send(2)`: Begin,
//! each Insert, Commit. A relay that is faster than its walsender (outboxd is, two to three
//! times) finds one message in the socket whenever it looks and pays a sleep and a wake-up of its
//! thread for each. Measured with `strace` at 45k events/s: one `recvfrom` of a single 274-byte
//! Insert and two `epoll_wait`s per message, about twelve wake-ups per transaction of ten
//! events. Downstream it is the same story: every read hands librdkafka a few records, and
//! every few records make a produce request. That is why a live event used to cost the relay
//! 2.5–3.5× the CPU of a backlog event (docs/benchmarks.md, "The live path").
//!
//! [`Gulp`] waits on purpose, at two points:
//!
//! * **Inside a transaction** ([`MID_TXN_PAUSE`]): after an event, when the transaction is
//!   still open and nothing more has been decoded, the rest of it is being sent right now. A
//!   short pause lets it arrive and be read in one go. This costs no latency that matters:
//!   nothing of the transaction can be confirmed before its Commit anyway.
//! * **Between transactions** (`relay.read_linger_ms`): after a Commit (or any other event
//!   outside a transaction: a keepalive, a heartbeat) with nothing more decoded, the next read
//!   waits this long, so transactions committed close together are read,
//!   produced and acknowledged together (the read-side twin of librdkafka's `linger.ms`). A
//!   transaction is delayed at most this long, and only when it follows the previous one that
//!   closely: after a quiet spell the next one is read at once.
//!
//! Both pauses block the thread, on purpose: the only other work on the relay's single-threaded
//! runtime is the replication client's reader (whose socket is what we are waiting for), the
//! acknowledgements (which queue up and are taken in one batch after the pause) and the metrics
//! endpoint; librdkafka runs on threads of its own. A timer would wake the thread for every
//! acknowledgement batch in between and has a granularity of a millisecond, which is twenty
//! times the mid-transaction pause. The pauses never apply while a backlog is read: then more
//! is always decoded already.

use pgwire_replication::{PgWireError, ReplicationClient, ReplicationEvent};
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

/// How long to wait for the rest of an open transaction. A caught-up walsender decodes and
/// sends a message every 5–10 µs, so a transaction of ten events is on its way within this.
pub const MID_TXN_PAUSE: Duration = Duration::from_micros(50);

type Received = Result<Option<ReplicationEvent>, PgWireError>;

/// A [`ReplicationClient`] with a one-event look-ahead and the two pauses.
pub struct Gulp<'a> {
    client: &'a mut ReplicationClient,
    peeked: Option<Received>,
    /// Pause after an event outside a transaction with nothing more decoded (zero: none).
    linger: Duration,
    pauses: u64,
    /// For the look-ahead poll (`Waker::noop` needs a newer Rust than the workspace's MSRV).
    noop: Waker,
}

struct Noop;

impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

impl<'a> Gulp<'a> {
    pub fn new(client: &'a mut ReplicationClient, linger: Duration) -> Self {
        Self {
            client,
            peeked: None,
            linger,
            pauses: 0,
            noop: Waker::from(Arc::new(Noop)),
        }
    }

    /// The next event (cancel-safe, like [`ReplicationClient::recv`]).
    pub async fn recv(&mut self) -> Received {
        match self.peeked.take() {
            Some(r) => r,
            None => self.client.recv().await,
        }
    }

    /// Call after handling an event: when nothing more has been decoded, pause for the rest of
    /// an open transaction, or for the next transactions after a Commit.
    pub fn settle(&mut self, mid_transaction: bool) {
        let pause = if mid_transaction {
            MID_TXN_PAUSE
        } else {
            self.linger
        };
        if pause.is_zero() || self.peeked.is_some() {
            return;
        }
        // One poll with a waker that is never used: the session's `select!` polls `recv` again,
        // registering its own waker, before the task can sleep. `recv` is cancel-safe.
        let mut cx = Context::from_waker(&self.noop);
        match std::pin::pin!(self.client.recv()).poll(&mut cx) {
            Poll::Ready(r) => self.peeked = Some(r),
            Poll::Pending => {
                self.pauses += 1;
                std::thread::sleep(pause);
            }
        }
    }

    /// Pauses taken so far (reported when the session ends).
    pub fn pauses(&self) -> u64 {
        self.pauses
    }

    /// The client, for status updates.
    pub fn client(&self) -> &ReplicationClient {
        self.client
    }
}
