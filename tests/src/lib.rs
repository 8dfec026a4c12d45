//! Shared harness of the end-to-end tests: a private Postgres + broker per test, the relay run
//! in-process (through `outboxd::run`) or as a real process that can be SIGKILLed, and a reader
//! that reads topics back from the beginning.
//!
//! Tests import from the crate root (`use outboxd_tests::*;`) and from [`reliability`]; the
//! private modules below only group the code.
//!
//! # Layout
//! - `env.rs`: [`Env`], one test's world (cluster, database, broker, slot, config file);
//!   [`Relay`], a relay running in this process.
//! - `relay.rs`: [`RelayProcess`], a real `outboxd` process ([`relay_bin`]); the CLI
//!   ([`outboxd_cli`], [`check_fails_naming`]); reading a relay's log and watching its process,
//!   waiting for the one active instance (exported from [`reliability`]).
//! - `kafka.rs`: topics ([`create_topics`], [`create_topic_on_port`]) and reading them back
//!   ([`read_topic`], [`scan_topic`]: every partition by manual assignment, no group join;
//!   [`reader_config`]).
//! - `outbox.rs`: [`NewEvent`], [`write_events`], [`write_events_returning_lsn`]: outbox rows
//!   written in real transactions.
//! - `wait.rs`: [`eventually`]; `http.rs`: [`http_get`], [`http_exchange`] against the metrics
//!   listener.
//! - [`certs`]: a private certificate authority for TLS tests.
//! - [`deploy`]: the deployment files as their tools read them, and a container's command and
//!   environment run as a process here.
//! - [`reliability`]: the writer, inbox consumer and delivery checks of the reliability tests.
//! - [`replay`]: what the replay tests share (raw records, events, the `replay` command, audit).
//! - [`multi`]: what the multi-table tests share (three tables, rounds of events, reading each
//!   table's topic back in per-aggregate order).
//! - [`otlp`]: an OTLP trace receiver (gRPC and HTTP/protobuf) on `opentelemetry-proto`.
//! - [`testkit`] (`outboxd_testkit`) and [`outboxd`], re-exported for the tests.

mod env;
mod http;
mod kafka;
mod outbox;
mod relay;
mod wait;

pub mod certs;
pub mod deploy;
pub mod multi;
pub mod otlp;
pub mod reliability;
pub mod replay;

pub use env::{Env, Relay};
pub use http::{http_exchange, http_get, http_get_10};
pub use kafka::{
    create_topic_on_port, create_topics, read_topic, reader_config, scan_topic, Record,
};
pub use outbox::{insert_events, write_events, write_events_returning_lsn, NewEvent};
pub use relay::{check_fails_naming, outboxd_cli, relay_bin, RelayProcess};
pub use wait::eventually;

pub use outboxd;
pub use outboxd_testkit as testkit;
