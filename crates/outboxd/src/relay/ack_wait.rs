//! When the session's thread takes acknowledgements.
//!
//! Delivery reports arrive on librdkafka's threads, one batch per produce response: with one
//! request per partition, a gathered burst comes back as several. Waking the session's thread
//! for each costs a context switch apiece (on a virtual machine a cross-CPU wake-up is an
//! interrupt through the hypervisor) and buys nothing: the commit→ack time is taken when the
//! report arrives ([`crate::relay::kafka::Ack::at_us`]), and the confirmed position reaches
//! Postgres only every `source.status_interval_ms` anyway. So while the stream may be read,
//! the thread takes acknowledgements whenever it is awake for the stream, and wakes for them
//! alone only when they have waited [`ACK_WAIT`]. With the in-flight window full (reading
//! paused) it takes each as it comes: then they are what frees the window.

use std::pin::Pin;
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// The longest acknowledgements wait for the thread to be awake anyway.
pub const ACK_WAIT: Duration = Duration::from_millis(10);

/// See the module docs.
pub struct AckWait {
    timer: Pin<Box<Sleep>>,
    /// When the thread last looked at the acknowledgements, plus [`ACK_WAIT`].
    due: Instant,
}

impl Default for AckWait {
    fn default() -> Self {
        let due = Instant::now() + ACK_WAIT;
        Self {
            timer: Box::pin(tokio::time::sleep_until(due)),
            due,
        }
    }
}

impl AckWait {
    /// The thread has just taken whatever acknowledgements were waiting. Moves a deadline,
    /// not the timer: resetting a timer for every event of a backlog would cost more than the
    /// wake-ups saved.
    pub fn looked(&mut self) {
        self.due = Instant::now() + ACK_WAIT;
    }

    /// Resolves once the acknowledgements have waited [`ACK_WAIT`] since the thread last
    /// looked (cancel-safe: the state is a deadline and a timer).
    pub async fn due(&mut self) {
        loop {
            self.timer.as_mut().await;
            if Instant::now() >= self.due {
                self.timer.as_mut().reset(self.due + ACK_WAIT);
                return;
            }
            self.timer.as_mut().reset(self.due);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fires_only_once_the_thread_has_not_looked_for_the_wait() {
        let mut w = AckWait::default();
        tokio::time::sleep(ACK_WAIT / 2).await;
        w.looked();
        let start = Instant::now();
        w.due().await;
        assert!(start.elapsed() >= ACK_WAIT, "{:?}", start.elapsed());
        // Not looked at since: due again one wait later, not at once.
        let again = Instant::now();
        w.due().await;
        assert!(again.elapsed() >= ACK_WAIT / 2, "{:?}", again.elapsed());
    }
}
