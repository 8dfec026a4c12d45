//! What the observers read of a session, handed down by the relay instead of imported from it:
//! the server the slot lives on ([`SlotServer`], implemented by the relay's `SlotHost`) and the
//! events sent but not yet acknowledged ([`Pending`], implemented by the relay's `InFlight`).

use crate::error::RelayError;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use tokio_postgres::Client;

/// The future a [`SlotServer`] query hands back (boxed: the status row and the watch take the
/// server as a trait object).
pub type Answer<'a, T> = Pin<Box<dyn Future<Output = Result<T, RelayError>> + Send + 'a>>;

/// The slot's server as the status row and the watch need it; the meanings are those of the
/// relay's `SlotHost` (`crate::relay::slot_host`), which documents them.
pub trait SlotServer: Sync {
    /// The connection on which the slot's views and functions are queried.
    fn sql<'a>(&'a self, primary: &'a Client) -> &'a Client;
    /// Whether the slot lives on another server than outboxd's tables.
    fn is_separate(&self) -> bool;
    /// Whether walsender `pid` holds `slot` now, asked of the slot's server.
    fn holds<'a>(&'a self, primary: &'a Client, slot: &'a str, pid: i32) -> Answer<'a, bool>;
    /// The SQL condition "walsender `$pid` holds slot `$slot`" for a statement on the primary.
    fn holder_clause<'a>(&self, same_server: &'a str) -> &'a str;
    /// An error (the session ends) when the slot's server, a standby, no longer follows the
    /// primary.
    fn still_follows<'a>(&'a self, primary: &'a Client) -> Answer<'a, ()>;
}

/// The events sent and not yet acknowledged, as the watch reports them.
pub trait Pending: Sync {
    /// The LSN confirmed so far.
    fn confirmed(&self) -> u64;
    /// How many events wait for their acknowledgement.
    fn events(&self) -> usize;
    /// Their bytes.
    fn bytes(&self) -> usize;
    /// Per label (event type), the commit time (µs since the unix epoch) of the oldest.
    fn oldest_pending(&self) -> HashMap<String, i64>;
}
