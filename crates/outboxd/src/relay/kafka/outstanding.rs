//! Records handed to librdkafka and not yet reported on: what the adaptive pace waits for.
//!
//! A gathered window (`relay::gulp`) normally ends after `relay.batch_window_ms`. When the
//! previous window's records are still out by then, the broker is slower than the window (a
//! busy broker, a machine short of CPU): the relay then waits for their reports, up to a bound,
//! and sends what arrived meanwhile as one batch. That is the natural batch of a pipelined
//! producer, and it is what keeps a saturated machine from paying for more, smaller requests
//! just when it can least afford them.

use super::Ctx;
use rdkafka::producer::{Producer as _, ThreadedProducer};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the wait looks again: a fraction of a local broker's round trip.
const LOOK_EVERY: Duration = Duration::from_micros(250);

/// See the module docs: the producer, asked how much it still holds.
#[derive(Clone)]
pub struct Outstanding(Arc<ThreadedProducer<Ctx>>);

impl Outstanding {
    pub(super) fn of(p: Arc<ThreadedProducer<Ctx>>) -> Self {
        Self(p)
    }

    /// Waits until librdkafka holds nothing (no record queued, in flight or unreported), or
    /// `deadline`. Looks every [`LOOK_EVERY`]: librdkafka offers no
    /// signal for it, and a condition variable fed from the delivery reports would have to
    /// count every record handed over exactly, refusals and purges included.
    pub fn wait_reported(&self, deadline: Instant) {
        while self.0.in_flight_count() > 0 && Instant::now() + LOOK_EVERY <= deadline {
            std::thread::sleep(LOOK_EVERY);
        }
    }
}
