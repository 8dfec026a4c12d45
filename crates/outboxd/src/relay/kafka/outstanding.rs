//! Records handed to librdkafka and not yet reported on: what the adaptive pace waits for.
//!
//! A gathered window (`relay::gulp`) normally ends after `relay.batch_window_ms`. When the
//! previous window's records are still out by then, the broker is slower than the window (a
//! busy broker, a machine short of CPU): the relay then waits for their reports, up to a bound,
//! and sends what arrived meanwhile as one batch. That is the natural batch of a pipelined
//! producer, and it is what keeps a saturated machine from paying for more, smaller requests
//! just when it can least afford them.
//!
//! The wait sleeps until the delivery report that leaves nothing outstanding wakes it, once.
//! (Asking librdkafka every 250 µs, as before, cost a wake-up of the relay's thread per look,
//! and it looks most when the machine is shortest of CPU.) The count is exact because every
//! record librdkafka accepts gets exactly one delivery report — delivered, failed or purged —
//! and a record it refuses is counted back at once. Were it ever wrong, only the wait would be:
//! it is bounded, and nothing is confirmed from this count.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

#[derive(Default)]
struct Count {
    /// Accepted minus reported (may dip below zero for a moment: a report can overtake the
    /// increment that follows a successful hand-over).
    out: AtomicI64,
    /// Someone is (about to be) waiting: only then does a report take the lock.
    waiting: AtomicBool,
    lock: Mutex<()>,
    all_reported: Condvar,
}

/// See the module docs: shared by the producer (which counts) and the pace (which waits).
#[derive(Clone, Default)]
pub struct Outstanding(Arc<Count>);

impl Outstanding {
    /// A record is being handed to librdkafka.
    pub(super) fn handing(&self) {
        self.0.out.fetch_add(1, SeqCst);
    }

    /// A record was reported on, or refused at the hand-over.
    pub(super) fn reported(&self) {
        let c = &self.0;
        if c.out.fetch_sub(1, SeqCst) <= 1 && c.waiting.load(SeqCst) {
            // Taking the lock orders this after the waiter's check (it holds the lock from
            // its check until it sleeps), so the notification cannot fall between the two.
            drop(c.lock.lock().unwrap_or_else(|e| e.into_inner()));
            c.all_reported.notify_all();
        }
    }

    /// How many records are out.
    #[cfg(test)]
    fn count(&self) -> i64 {
        self.0.out.load(SeqCst)
    }

    /// Waits until every record handed over has been reported on, or `deadline`.
    pub fn wait_reported(&self, deadline: Instant) {
        let c = &self.0;
        c.waiting.store(true, SeqCst);
        let mut g = c.lock.lock().unwrap_or_else(|e| e.into_inner());
        while c.out.load(SeqCst) > 0 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            g = match c.all_reported.wait_timeout(g, left) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        drop(g);
        c.waiting.store(false, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn returns_at_once_with_nothing_out() {
        let o = Outstanding::default();
        let start = Instant::now();
        o.wait_reported(start + Duration::from_secs(5));
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn wakes_on_the_last_report_not_at_the_deadline() {
        let o = Outstanding::default();
        for _ in 0..3 {
            o.handing();
        }
        let reporter = {
            let o = o.clone();
            std::thread::spawn(move || {
                for _ in 0..3 {
                    std::thread::sleep(Duration::from_millis(20));
                    o.reported();
                }
            })
        };
        let start = Instant::now();
        o.wait_reported(start + Duration::from_secs(10));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(o.count(), 0);
        reporter.join().unwrap();
    }

    #[test]
    fn gives_up_at_the_deadline() {
        let o = Outstanding::default();
        o.handing();
        let start = Instant::now();
        o.wait_reported(start + Duration::from_millis(30));
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert_eq!(o.count(), 1);
    }
}
