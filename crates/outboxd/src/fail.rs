//! Crash hooks for the crash-window tests (R30): with the `failpoints` feature, a point named in
//! `OUTBOXD_FAILPOINTS` (`name` or `name@n` = on the n-th hit, comma-separated) aborts the
//! process on the spot — no unwinding, no flushing, like a SIGKILL. Without the feature every
//! hook compiles to nothing.

#[cfg(feature = "failpoints")]
mod imp {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    fn points() -> &'static HashMap<String, (u64, AtomicU64)> {
        static P: OnceLock<HashMap<String, (u64, AtomicU64)>> = OnceLock::new();
        P.get_or_init(|| {
            std::env::var("OUTBOXD_FAILPOINTS")
                .unwrap_or_default()
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|s| match s.split_once('@') {
                    Some((n, at)) => (n.to_string(), (at.parse().unwrap_or(1), AtomicU64::new(0))),
                    None => (s.to_string(), (1, AtomicU64::new(0))),
                })
                .collect()
        })
    }

    pub fn hit(name: &str) {
        if let Some((at, count)) = points().get(name) {
            if count.fetch_add(1, Ordering::SeqCst) + 1 == *at {
                eprintln!("failpoint {name}@{at}: aborting");
                std::process::abort();
            }
        }
    }
}

#[cfg(feature = "failpoints")]
pub use imp::hit;

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) {}
