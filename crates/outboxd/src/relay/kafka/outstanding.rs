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
//! and a record it refuses is counted back at once. With `relay.broker_fencing` the Kafka
//! transaction reads the same count (`txn`): a commit is due once every record handed over is
//! reported on. Were the count ever wrong, only when a wait ends would be: both waits are
//! bounded, and nothing is confirmed from it (acknowledgements are).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

#[derive(Default)]
struct Count {
    /// Records handed over (counted before the hand-over, so a report never comes before its
    /// record is counted; a refused one is counted back), and the reports of them.
    handed: AtomicU64,
    reported: AtomicU64,
    /// Someone is (about to be) waiting: only then does a report take the lock.
    waiting: AtomicBool,
    lock: Mutex<()>,
    all_reported: Condvar,
}

/// See the module docs: shared by the producer (which counts), the pace and the Kafka
/// transaction (which wait).
#[derive(Clone, Default)]
pub struct Outstanding(Arc<Count>);

impl Outstanding {
    /// A record is about to be handed to librdkafka.
    pub(super) fn handing(&self) {
        self.0.handed.fetch_add(1, SeqCst);
    }

    /// librdkafka refused the record at the hand-over: it will get no report.
    pub(super) fn refused(&self) {
        self.0.handed.fetch_sub(1, SeqCst);
    }

    /// A record was reported on. Returns whether that leaves nothing outstanding.
    pub(super) fn reported(&self) -> bool {
        let c = &self.0;
        let all_in = c.reported.fetch_add(1, SeqCst) + 1 >= c.handed.load(SeqCst);
        if all_in && c.waiting.load(SeqCst) {
            // Taking the lock orders this after the waiter's check (it holds the lock from
            // its check until it sleeps), so the notification cannot fall between the two.
            drop(c.lock.lock().unwrap_or_else(|e| e.into_inner()));
            c.all_reported.notify_all();
        }
        all_in
    }

    /// Records handed over so far.
    pub(super) fn handed(&self) -> u64 {
        self.0.handed.load(SeqCst)
    }

    /// Is every record handed over so far reported on?
    pub fn all_reported(&self) -> bool {
        let c = &self.0;
        c.reported.load(SeqCst) >= c.handed.load(SeqCst)
    }

    /// Waits until every record handed over has been reported on, or `deadline`.
    pub fn wait_reported(&self, deadline: Instant) {
        let c = &self.0;
        c.waiting.store(true, SeqCst);
        let mut g = c.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !self.all_reported() {
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
                    let _ = o.reported();
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
        assert!(o.all_reported());
        reporter.join().unwrap();
    }

    #[test]
    fn gives_up_at_the_deadline() {
        let o = Outstanding::default();
        o.handing();
        let start = Instant::now();
        o.wait_reported(start + Duration::from_millis(30));
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert!(!o.all_reported());
    }
}
