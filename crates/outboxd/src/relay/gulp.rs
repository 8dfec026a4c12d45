//! Reading a live replication stream in gulps instead of sips.
//!
//! A walsender that has caught up writes every pgoutput message with its own `send(2)`: Begin,
//! each Insert, Commit. A relay that is faster than its walsender (outboxd is, two to three
//! times) finds one message in the socket whenever it looks and pays a sleep and a wake-up of its
//! thread for each. Measured with `strace` at 45k events/s: one `recvfrom` of a single 274-byte
//! Insert and two `epoll_wait`s per message, about twelve wake-ups per transaction of ten
//! events. Downstream it is the same story: every read hands librdkafka a few records, and
//! every few records make a produce request (one per partition: librdkafka never puts two
//! partitions in one request), each with its own response, delivery report and wake-ups.
//!
//! [`Gulp`] waits on purpose, at two points:
//!
//! * **Inside a transaction** ([`MID_TXN_PAUSE`]): after an event, when the transaction is
//!   still open and nothing more has been decoded, the rest of it is being sent right now. A
//!   short pause lets it arrive and be read in one go. This costs no latency that matters:
//!   nothing of the transaction can be confirmed before its Commit anyway.
//! * **Between transactions**, by [`Pace`]:
//!   - *adaptive* (the default, `relay.batch_window_ms`): batching only when there is something
//!     to batch with. When a transaction arrives after a quiet moment (the last look found
//!     nothing decoded) and transactions have lately been committed less than a window apart
//!     (an average over the commit times the stream carries), the relay waits one window before
//!     reading it: the transactions committed meanwhile are read, produced and acknowledged with
//!     it, in one produce request per partition. From [`CROWDED`] transactions per window on,
//!     the relay does not go quiet at all: having handled what was decoded, it waits the next
//!     window right away, while its thread is awake anyway, instead of sleeping on the socket,
//!     being woken by the next transaction and only then waiting (one wake-up per window instead
//!     of two: at 25 % of the ceiling the relay's CPU per event fell by a third; below that load
//!     the on-arrival window measured a little faster, see docs/benchmarks.md). At a light load
//!     nothing waits at all (the next transaction is not due within the window, so waiting would
//!     only delay this one); under a backlog more is always decoded already. When the previous
//!     window's records are still out at the end of a window (a busy broker, a machine short of
//!     CPU), the window stretches until they are reported on, to at most four windows: the
//!     natural batch of a pipelined producer, so a saturated machine does not pay for more,
//!     smaller requests.
//!   - *fixed* (`relay.read_linger_ms` set): after a Commit with nothing more decoded, the next
//!     read waits that long, whatever the load (the behaviour before the adaptive pace).
//!
//! Both pauses block the thread, on purpose: the only other work on the relay's single-threaded
//! runtime is the replication client's reader (whose socket is what we are waiting for), the
//! acknowledgements (which queue up and are taken in one batch after the pause; each carries the
//! time its delivery report arrived, so the commit→ack histogram does not count the pause) and
//! the metrics endpoint; librdkafka runs on threads of its own. A timer would wake the thread for
//! every acknowledgement batch in between and has a granularity of a millisecond, which is twenty
//! times the mid-transaction pause.

use crate::relay::kafka::outstanding::Outstanding;
use pgwire_replication::{PgWireError, ReplicationClient, ReplicationEvent};
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

/// How long to wait for the rest of an open transaction. A caught-up walsender decodes and
/// sends a message every 5–10 µs, so a transaction of ten events is on its way within this.
pub const MID_TXN_PAUSE: Duration = Duration::from_micros(50);

type Received = Result<Option<ReplicationEvent>, PgWireError>;

/// How transactions are gathered between the stream and the producer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// `relay.read_linger_ms` set: after a Commit with nothing more decoded, wait this long.
    Fixed(Duration),
    /// The default: a transaction that arrives after a quiet moment waits up to `window` for
    /// others only while transactions have lately been committed less than `window` apart.
    Adaptive { window: Duration },
}

impl Pace {
    /// The pace `[relay]` asks for.
    pub fn of(relay: &crate::config::RelayConfig) -> Self {
        let ms = Duration::from_millis;
        match relay.read_linger_ms {
            Some(linger) => Self::Fixed(ms(linger)),
            None => Self::Adaptive {
                window: ms(relay.batch_window_ms),
            },
        }
    }
}

/// Weight of the newest gap in the average (1/8: a change of load shows within ~10 transactions).
const GAP_WEIGHT: f64 = 1.0 / 8.0;

/// A gap longer than this many windows counts as this long: one quiet minute must not keep the
/// relay from batching once the load is back (within ~10 transactions, not hundreds).
const GAP_CAP_WINDOWS: u32 = 4;

/// The recent commit rate, from the commit times the stream carries (the server's clock: no
/// skew against the relay's, and not distorted by when the relay happened to read).
#[derive(Debug, Default, Clone, Copy)]
struct Rate {
    last_commit_us: Option<i64>,
    /// Average gap between commits (µs); `None` until two have been seen.
    gap_us: Option<f64>,
}

impl Rate {
    fn commit_at(&mut self, commit_us: i64, cap: Duration) {
        if let Some(last) = self.last_commit_us {
            let gap = (commit_us.saturating_sub(last).max(0) as f64).min(cap.as_micros() as f64);
            self.gap_us = Some(match self.gap_us {
                Some(avg) => avg + GAP_WEIGHT * (gap - avg),
                None => gap,
            });
        }
        self.last_commit_us = Some(commit_us);
    }

    /// Is another transaction expected within `window`?
    fn busy(&self, window: Duration) -> bool {
        self.gap_us.is_some_and(|g| g < window.as_micros() as f64)
    }

    /// Are [`CROWDED`] or more transactions expected within `window`?
    fn crowded(&self, window: Duration) -> bool {
        self.busy(window / CROWDED)
    }
}

/// The [`Rate`] of the transactions the relay is sent something of.
#[derive(Debug, Default)]
struct Commits {
    rate: Rate,
    /// The rate before the open transaction's Begin, while nothing of it has been seen: an
    /// empty transaction (Postgres < 15 streams Begin and Commit of transactions that touch no
    /// published table) is taken back out at its Commit, so other tables' traffic does not
    /// make a lone outbox transaction wait a window.
    before_begin: Option<Rate>,
}

impl Commits {
    /// A Begin: counted at once (its gap decides whether it waits).
    fn begin(&mut self, commit_us: i64, cap: Duration) {
        self.before_begin = Some(self.rate);
        self.rate.commit_at(commit_us, cap);
    }

    /// Something of the open transaction arrived: it stays counted.
    fn change(&mut self) {
        self.before_begin = None;
    }

    /// A Commit: an empty transaction is taken back out.
    fn commit(&mut self) {
        if let Some(before) = self.before_begin.take() {
            self.rate = before;
        }
    }

    fn busy(&self, window: Duration) -> bool {
        self.rate.busy(window)
    }

    fn crowded(&self, window: Duration) -> bool {
        self.rate.crowded(window)
    }
}

/// From this many transactions per window on, the relay gathers the next window right after
/// handling one, instead of idling until the next transaction arrives (`Gulp::settle`).
const CROWDED: u32 = 5;

/// A window whose predecessor's records are still out is stretched until they are reported
/// on, to at most this many windows in all (`crate::relay::kafka::outstanding`).
const STRETCH_WINDOWS: u32 = 4;

/// A [`ReplicationClient`] with a one-event look-ahead and the pauses.
pub struct Gulp<'a> {
    client: &'a mut ReplicationClient,
    outstanding: Outstanding,
    peeked: Option<Received>,
    pace: Pace,
    rate: Commits,
    /// The last look found nothing decoded after a transaction (the adaptive window applies
    /// to the next one that arrives).
    quiet: bool,
    /// A window just ended: what it gathered is in the socket already, not on its way, so
    /// the next look that finds nothing decoded lets the reader run instead of pausing.
    gathered: bool,
    pauses: u64,
    /// For the look-ahead poll (`Waker::noop` needs a newer Rust than the workspace's MSRV).
    noop: Waker,
}

struct Noop;

impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

impl<'a> Gulp<'a> {
    pub fn new(client: &'a mut ReplicationClient, pace: Pace, outstanding: Outstanding) -> Self {
        Self {
            client,
            outstanding,
            peeked: None,
            pace,
            rate: Commits::default(),
            quiet: false,
            gathered: false,
            pauses: 0,
            noop: Waker::from(Arc::new(Noop)),
        }
    }

    /// The next event (cancel-safe, like [`ReplicationClient::recv`]: nothing is awaited after
    /// an event is taken).
    pub async fn recv(&mut self) -> Received {
        if let Some(r) = self.peeked.take() {
            self.observe(&r);
            return r;
        }
        let r = self.client.recv().await;
        self.observe(&r);
        if std::mem::take(&mut self.quiet) {
            if let (Pace::Adaptive { window }, Ok(Some(ReplicationEvent::Begin { .. }))) =
                (self.pace, &r)
            {
                if self.rate.busy(window) {
                    // The first transaction after a quiet moment, with others due within the
                    // window: let them arrive and go out together (one produce request per
                    // partition instead of one per transaction).
                    self.gather(window);
                }
            }
        }
        r
    }

    fn observe(&mut self, r: &Received) {
        let Pace::Adaptive { window } = self.pace else {
            return;
        };
        match r {
            Ok(Some(ReplicationEvent::Begin {
                commit_time_micros, ..
            })) => self
                .rate
                .begin(*commit_time_micros, window * GAP_CAP_WINDOWS),
            Ok(Some(ReplicationEvent::XLogData { .. })) => self.rate.change(),
            Ok(Some(ReplicationEvent::Commit { .. })) => self.rate.commit(),
            _ => {}
        }
    }

    /// Call after handling an event: when nothing more has been decoded, pause for the rest of
    /// an open transaction, or (fixed pace) for the next transactions after a Commit, or
    /// (adaptive pace, transactions due within the window) for the window's transactions.
    pub fn settle(&mut self, mid_transaction: bool) {
        if self.peeked.is_some() || self.look() {
            return;
        }
        let gathered = std::mem::take(&mut self.gathered);
        match (mid_transaction, self.pace) {
            (true, _) => {
                if !gathered {
                    self.pause(MID_TXN_PAUSE);
                }
            }
            (false, Pace::Fixed(linger)) => {
                self.quiet = true;
                if !linger.is_zero() && !gathered {
                    self.pause(linger);
                }
            }
            (false, Pace::Adaptive { window }) => {
                if self.rate.crowded(window) {
                    // Many are due within the window: gather them now, while the thread is
                    // awake anyway, rather than sleep on the socket, be woken by the first
                    // transaction and then wait a window for the rest (one wake-up per window
                    // instead of two).
                    self.gather(window);
                    if self.look() {
                        return;
                    }
                }
                // Nothing came (the load stopped, or is light): the next transaction to
                // arrive decides (`recv`).
                self.quiet = true;
            }
        }
    }

    /// Waits one window, stretched while the previous records are still out.
    fn gather(&mut self, window: Duration) {
        let stretch_to = Instant::now() + window * STRETCH_WINDOWS;
        self.pause(window);
        self.outstanding.wait_reported(stretch_to);
        self.gathered = true;
    }

    /// One poll of the stream with a waker that is never used (the session's `select!` polls
    /// `recv` again, registering its own waker, before the task can sleep; `recv` is
    /// cancel-safe): has something been decoded already? If so it is kept for `recv`.
    fn look(&mut self) -> bool {
        let mut cx = Context::from_waker(&self.noop);
        match std::pin::pin!(self.client.recv()).poll(&mut cx) {
            Poll::Ready(r) => {
                self.peeked = Some(r);
                true
            }
            Poll::Pending => false,
        }
    }

    fn pause(&mut self, d: Duration) {
        self.pauses += 1;
        std::thread::sleep(d);
    }

    /// Has the reader caught up with the stream (the last look after a transaction found
    /// nothing decoded, and nothing has arrived since)?
    pub fn caught_up(&self) -> bool {
        self.quiet && self.peeked.is_none()
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

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_millis(4);

    fn rate_after(gaps_us: &[i64]) -> Rate {
        let mut r = Rate::default();
        let mut t = 1_000_000_000;
        r.commit_at(t, WINDOW * GAP_CAP_WINDOWS);
        for g in gaps_us {
            t += g;
            r.commit_at(t, WINDOW * GAP_CAP_WINDOWS);
        }
        r
    }

    #[test]
    fn one_transaction_says_nothing_about_the_load() {
        assert!(!rate_after(&[]).busy(WINDOW));
    }

    #[test]
    fn commits_closer_than_the_window_are_busy_farther_ones_are_not() {
        // 10% of this machine's ceiling: a transaction every 1.4 ms.
        assert!(rate_after(&[1_400; 20]).busy(WINDOW));
        // 1%: every 14 ms; waiting would only delay each one.
        assert!(!rate_after(&[14_000; 20]).busy(WINDOW));
        // A window of zero never waits.
        assert!(!rate_after(&[10; 20]).busy(Duration::ZERO));
    }

    #[test]
    fn only_a_crowded_window_is_gathered_right_after_the_last() {
        // 10% of this machine's ceiling, transactions of ten: ~3 per window, gathered when
        // the first arrives.
        let ten = rate_after(&[1_200; 20]);
        assert!(ten.busy(WINDOW) && !ten.crowded(WINDOW));
        // 25%: ~8 per window, gathered one after the other.
        assert!(rate_after(&[480; 20]).crowded(WINDOW));
    }

    #[test]
    fn empty_transactions_do_not_count() {
        // Postgres < 15: other tables' transactions arrive as empty Begin/Commit pairs, a
        // thousand a second; outbox transactions once a second must not look busy.
        let cap = WINDOW * GAP_CAP_WINDOWS;
        let mut c = Commits::default();
        let mut t = 1_000_000_000;
        for i in 0..5_000 {
            t += 1_000;
            c.begin(t, cap);
            if i % 1_000 == 0 {
                c.change();
            }
            c.commit();
        }
        assert!(!c.busy(WINDOW));
        // The same with every transaction carrying changes is busy.
        let mut c = Commits::default();
        for _ in 0..50 {
            t += 1_000;
            c.begin(t, cap);
            c.change();
            c.commit();
        }
        assert!(c.busy(WINDOW) && !c.crowded(WINDOW));
    }

    #[test]
    fn a_stopped_load_stops_the_waiting_and_a_resumed_one_restarts_it_quickly() {
        // Busy, then the load stops: quiet minutes count as capped gaps, and after two of them
        // a transaction no longer waits (at most two transactions waited for nothing).
        let mut gaps = vec![1_000; 50];
        gaps.push(60_000_000);
        gaps.push(60_000_000);
        assert!(!rate_after(&gaps).busy(WINDOW));
        // Busy again: within a dozen transactions.
        let before = gaps.len();
        while !rate_after(&gaps).busy(WINDOW) {
            gaps.push(1_000);
        }
        assert!(gaps.len() - before <= 12, "{}", gaps.len() - before);
    }

    #[test]
    fn clocks_going_backwards_count_as_no_gap() {
        let mut r = Rate::default();
        r.commit_at(10_000_000, WINDOW * GAP_CAP_WINDOWS);
        r.commit_at(9_000_000, WINDOW * GAP_CAP_WINDOWS);
        r.commit_at(i64::MIN, WINDOW * GAP_CAP_WINDOWS);
        r.commit_at(i64::MAX, WINDOW * GAP_CAP_WINDOWS);
        assert!(r.gap_us.is_some_and(|g| g.is_finite()));
    }

    #[test]
    fn the_configuration_picks_the_pace() {
        let mut relay = crate::config::RelayConfig::default();
        assert_eq!(Pace::of(&relay), Pace::Adaptive { window: WINDOW });
        relay.read_linger_ms = Some(0);
        assert_eq!(Pace::of(&relay), Pace::Fixed(Duration::ZERO));
    }
}
