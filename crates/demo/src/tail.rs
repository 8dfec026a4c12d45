//! `outboxd-demo tail`: the reader of `outboxd tail` (crates/outboxd/src/cmd/tail.rs) — every
//! partition assigned by hand, no group joined, nothing committed.

pub use outboxd::cmd::tail::{tail, TailOptions};
