//! The ground floor: the vocabulary several floors speak — the outbox table's column mapping
//! (`columns`), the topic template (`topic`), the router's errors and reserved header names
//! (`route`), the TLS settings of `[source]` (`tls`), LSNs as Postgres writes
//! them (`lsn`), a built record as plain data (`record`), what can be wrong with the replication
//! stream (`stream`: `DecodeError`, `ProtocolError`), identifiers quoted for SQL (`sql`), pgoutput's text of a bytea value decoded (`bytea`), the publication's messages and membership SQL
//! (`publication`). It imports nothing of the crate above it:
//! `config` parses into these types, `error` wraps their errors, the stages use them.

pub(crate) mod bytea;
pub(crate) mod cloudevents;
pub(crate) mod columns;
pub(crate) mod lsn;
pub(crate) mod publication;
pub(crate) mod record;
pub(crate) mod route;
pub(crate) mod shell;
pub(crate) mod sql;
pub(crate) mod stream;
pub(crate) mod tls;
pub(crate) mod topic;
