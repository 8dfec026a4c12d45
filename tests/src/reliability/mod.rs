//! Shared machinery of the reliability tests (crash windows, faults, high availability, soak):
//! a writer that knows exactly what committed, an inbox-library consumer with its own business
//! table, and the delivery checks every one of those tests makes.
//!
//! - [`Writer`] (`writer.rs`): random transactions (some rolled back) on its own connection;
//!   survives a crashing Postgres and records, per committed transaction, an upper bound of
//!   its commit LSN (for "the slot never passed an undelivered event" checks).
//! - [`InboxReader`] (`inbox_reader.rs`): reads a topic from the beginning (manual assignment)
//!   on a thread, keeps every record's bytes, and applies each record through
//!   [`outboxd_inbox::Inbox::process`] to a business table (`account`, `movement`; [`Balances`]
//!   in `balances.rs`) in its own database. The table has no unique constraint of its own: only
//!   the inbox can dedupe.
//! - [`verify_delivery`], [`verify_effects`], [`check_slot_invariant`] (`verify.rs`): the
//!   assertions.
//! - [`read_log`], [`wait_exit`], [`exit_signal`], [`rss_kib`], [`streaming_pids`]: watching a
//!   relay process (they live with [`crate::RelayProcess`] in `relay.rs`).

mod balances;
mod inbox_reader;
mod verify;
pub mod world;
mod writer;

pub use balances::{consumer_db, Balances, BUSINESS_SQL};
pub use inbox_reader::{InboxReader, InboxStats, Raw, RawContent};
pub use verify::{
    check_slot_against_broker, check_slot_invariant, delivered_beyond_slot, drain_and_verify,
    verify_delivery, verify_effects, DeliveryReport,
};
pub use writer::{connect_retry, CommittedTx, Load, WriteLog, Writer, Written};

pub use crate::relay::{
    exit_signal, read_log, rss_kib, streaming_pids, strip_ansi, wait_exit, wait_for_active,
};
