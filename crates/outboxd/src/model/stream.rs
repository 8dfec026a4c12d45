//! What can be wrong with the replication stream itself, named where `error` can wrap it without
//! importing a stage: a message the decoder (`crate::relay::pgoutput`) cannot read, and an order
//! the ack tracker (`crate::relay::ack`) refuses.

use thiserror::Error;

/// A malformed or unsupported pgoutput message. Definite: retrying the same WAL yields the same
/// bytes, so the relay stops instead of confirming past it.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("pgoutput message truncated while reading {0}")]
    Truncated(&'static str),
    #[error("empty pgoutput message")]
    Empty,
    #[error("unexpected tuple marker {0:?} in {1} message")]
    BadTupleMarker(char, &'static str),
    #[error("unknown column kind {0:?} in tuple data")]
    BadColumnKind(char),
    #[error("binary column values are not supported (start replication without `binary`)")]
    BinaryColumn,
    #[error("non-UTF-8 name in relation message")]
    BadName,
}

/// The server broke the order of the replication protocol (a change or a Commit outside a
/// transaction, a Begin inside one): a broken or hostile server. Definite: the same WAL replays
/// the same order, and nothing in it can be positioned, so nothing past it may be confirmed.
#[derive(Debug, Clone, Copy, Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("an Insert arrived outside a transaction (no Begin before it)")]
    InsertWithoutBegin,
    #[error("a Commit arrived outside a transaction (no Begin before it)")]
    CommitWithoutBegin,
    #[error("a Begin arrived inside a transaction (no Commit before it)")]
    BeginBeforeCommit,
}
