//! librdkafka's logs and error callbacks, quieted. With a broker down, librdkafka reports the
//! same connection failure many times a second (measured: 196 lines in 5 s, each twice, once as
//! a log line and once as an error callback). The gate passes the first report of each kind
//! and then at most one per [`WINDOW`], saying how many it held back.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one line per kind of message in this window.
pub const WINDOW: Duration = Duration::from_secs(30);
/// Kinds remembered at once (then forgotten, so a hostile flood cannot grow it).
const MAX_KINDS: usize = 256;

/// See the module docs.
#[derive(Debug, Default)]
pub struct Gate {
    seen: Mutex<HashMap<String, (Instant, u64)>>,
}

impl Gate {
    /// `Some(held back since the last line)` when a message of this kind may be logged now.
    /// Messages differing only in numbers (ports, counts, durations) are one kind.
    pub fn pass(&self, msg: &str) -> Option<u64> {
        let kind: String = msg.chars().filter(|c| !c.is_ascii_digit()).collect();
        let Ok(mut seen) = self.seen.lock() else {
            return Some(0);
        };
        if seen.len() >= MAX_KINDS && !seen.contains_key(&kind) {
            seen.clear();
        }
        let now = Instant::now();
        match seen.get_mut(&kind) {
            Some((at, held)) if now.duration_since(*at) < WINDOW => {
                *held += 1;
                None
            }
            Some((at, held)) => {
                *at = now;
                Some(std::mem::take(held))
            }
            None => {
                seen.insert(kind, (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_are_held_back_and_numbers_do_not_make_a_new_kind() {
        let g = Gate::default();
        assert_eq!(
            g.pass("Connect to 127.0.0.1:9092 failed (after 0ms)"),
            Some(0)
        );
        assert_eq!(
            g.pass("Connect to 127.0.0.1:9092 failed (after 12ms)"),
            None
        );
        assert_eq!(g.pass("Connect to 127.0.0.1:9093 failed (after 3ms)"), None);
        assert_eq!(g.pass("Authentication failed"), Some(0));
    }
}
