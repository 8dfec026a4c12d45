//! The rate cap of a replay: rows are handed to the producer at most `rate` per second on
//! average. A pause (backpressure, a slow page) may be made up for by a burst of at most
//! [`CATCH_UP`] worth of rows, never more: consumers are not flooded after a stall.

use std::time::Duration;
use tokio::time::Instant;

/// How far behind schedule the pacer may fall and still catch up.
const CATCH_UP: Duration = Duration::from_millis(200);

pub struct Pacer {
    interval: Duration,
    next: Option<Instant>,
}

impl Pacer {
    pub fn new(rate: u32) -> Self {
        Self {
            interval: Duration::from_secs(1) / rate.max(1),
            next: None,
        }
    }

    /// Waits until the next row may go.
    pub async fn wait(&mut self) {
        let now = Instant::now();
        let due = match self.next {
            None => now,
            Some(n) => n.max(now.checked_sub(CATCH_UP).unwrap_or(now)),
        };
        if due > now {
            tokio::time::sleep_until(due).await;
        }
        self.next = Some(due + self.interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lower bounds only: a loaded machine may be slower, never faster.
    #[tokio::test]
    async fn at_most_rate_per_second_and_no_big_burst_after_a_stall() {
        let mut p = Pacer::new(200);
        let start = Instant::now();
        for _ in 0..100 {
            p.wait().await;
        }
        // 100 rows at 200/s: the first goes at once, the last after 0.495 s.
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(490), "{took:?}");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t = Instant::now();
        for _ in 0..80 {
            p.wait().await;
        }
        // After a stall only CATCH_UP (40 rows) is made up for: 80 rows take ≥ 0.19 s.
        assert!(
            t.elapsed() >= Duration::from_millis(190),
            "{:?}",
            t.elapsed()
        );
    }
}
