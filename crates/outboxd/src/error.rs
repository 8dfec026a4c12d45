//! The relay's error type, split the way Materialize splits source errors: *transient* errors
//! (network, server restarts, slot held by another instance, broker outages) end the current
//! session, which restarts from the slot's confirmed LSN after a bounded backoff; *definite*
//! errors (bad config, wrong server setup, a malformed or unroutable row) cannot be fixed by
//! retrying and stop the process with a message that names the fix.

use crate::config::ConfigError;
use crate::model::route::RouteError;
use crate::model::stream::{DecodeError, ProtocolError};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RelayError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The database is not set up for outboxd; the message says how to fix it.
    #[error("{0}")]
    Setup(String),
    #[error("postgres: {0}")]
    Postgres(String),
    #[error("replication stream: {0}")]
    Replication(String),
    /// Another process streams from the slot; this instance stands by.
    #[error("replication slot {slot:?} is active for PID {pid}: standing by")]
    SlotBusy { slot: String, pid: String },
    /// This instance was silent (frozen, paused, partitioned) for longer than
    /// `relay.takeover_after_ms` and a standby took the slot: the session ends before it
    /// produces anything more, and the instance stands by.
    #[error("replication slot {slot:?} was taken over by another instance while this one stood still (its session loop for {silent_ms} ms; its walsender {walsender} is gone): standing by")]
    Fenced {
        slot: String,
        walsender: i32,
        silent_ms: u64,
    },
    #[error("kafka producer: {0}")]
    Kafka(String),
    /// The server refused to stream from an invalidated slot. Transient: the next session
    /// sees the invalidation in `pg_replication_slots` and applies `source.on_slot_loss`.
    #[error("replication slot invalidated: {0}")]
    SlotInvalidated(String),
    /// The relay's publication changed under the stream (an event trigger's message, the
    /// walsender's "publication does not exist", or the table found outside it): what the stream
    /// skipped is republished from the table by the next session (`crate::slot::publication`).
    #[error("the publication changed under the stream ({0}): the next session republishes what it may have skipped, from the outbox table")]
    PublicationChanged(String),
    /// The tables a `[[source.tables]]` pattern matches changed while the session streamed (one
    /// joined the publication, one was dropped): the next session reads them as they are,
    /// after republishing what a joining table held before it joined (`crate::slot::join`).
    #[error("{0}: the next session reads the outbox tables as they are now")]
    TablesChanged(String),
    /// The slot lost events and outboxd may not, or cannot, recover them by itself
    /// (`on_slot_loss = "halt"`, rows already gone, nothing bounds the gap). The message names
    /// the gap and the command that recovers it.
    #[error("{0}")]
    SlotLost(String),
    /// The broker did not acknowledge an event. Never skipped: the session restarts from the
    /// last confirmed LSN and produces the same record again.
    #[error("delivery of event {event_id} failed ({code}): {message}")]
    Delivery {
        event_id: String,
        code: String,
        message: String,
    },
    /// A poison event under `on_poison = "halt"`: nothing past it is confirmed; the relay keeps
    /// retrying it (maximum backoff) and reports not-ready until an operator fixes the cause.
    #[error("halted at event {event_id} ({class}): {message} — fix the cause (see docs/operations.md); nothing past it is confirmed")]
    Halted {
        event_id: String,
        class: String,
        message: String,
    },
    #[error("malformed replication message: {0}")]
    Decode(#[from] DecodeError),
    /// Well-formed messages in an order the protocol does not allow (an Insert before Begin).
    #[error("replication stream out of order: {0}")]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Route(#[from] RouteError),
}

impl RelayError {
    /// The one place an error is classified: its bounded label, what the supervisor does next,
    /// and what an operator does about it. Exhaustive on purpose: a new variant does not
    /// compile until it is classified here. (Messages add the specifics: the setting, the
    /// command, the gap.)
    pub fn policy(&self) -> Policy {
        use Retry::*;
        let (class, retry, fix) = match self {
            Self::Config(_) => (
                "config",
                Stop,
                "correct the named setting and start again; `outboxd check --config FILE` validates the file without streaming",
            ),
            Self::Setup(_) => (
                "setup",
                Stop,
                "do what the message names (usually `outboxd init --config FILE` or a server setting), then start again",
            ),
            Self::Postgres(_) => (
                "postgres",
                Backoff,
                "none if Postgres comes back; if it persists, check that the server is reachable and source.dsn's role can log in",
            ),
            Self::Replication(_) => (
                "replication",
                Backoff,
                "none if the server comes back; if it persists, check the network to Postgres and wal_sender_timeout",
            ),
            Self::SlotBusy { .. } => (
                "slot_busy",
                StandBy,
                "none: another instance streams from the slot; this one takes over when it stops",
            ),
            Self::Fenced { .. } => (
                "fenced",
                StandBy,
                "none: this instance stopped (SIGSTOP, VM pause, partition) for longer than relay.takeover_after_ms and another took over; find out why it stopped",
            ),
            Self::Kafka(_) => (
                "kafka",
                Backoff,
                "check that the brokers are reachable and the [sink.kafka] settings; `outboxd check` names the failing one",
            ),
            Self::SlotInvalidated(_) => (
                "slot_invalidated",
                Backoff,
                "none: the next session applies source.on_slot_loss (docs/operations.md, \"Slot loss\")",
            ),
            Self::PublicationChanged(_) => (
                "publication_changed",
                Backoff,
                "none if the table is (back) in the publication: the next session replaces the slot and republishes the gap from the table; otherwise ALTER PUBLICATION … ADD TABLE (outboxd check names it)",
            ),
            Self::TablesChanged(_) => (
                "tables_changed",
                Backoff,
                "none: the next session relays a new table (and republishes the rows it held before it joined)",
            ),
            Self::SlotLost(_) => (
                "slot_lost",
                Stop,
                "run the `outboxd recover` command the message names (docs/operations.md, \"Slot loss\")",
            ),
            Self::Delivery { .. } => (
                "delivery",
                Backoff,
                "none if the broker recovers; if it persists, check the topic exists and the broker accepts the record",
            ),
            Self::Halted { .. } => (
                "halted",
                Halt,
                "repair the event: `outboxd parked list`, then `parked retry` or `parked discard` (docs/operations.md)",
            ),
            Self::Decode(_) => (
                "decode",
                Stop,
                "the server sent a message outboxd cannot read: report it with this log line and the Postgres version",
            ),
            Self::Protocol(_) => (
                "protocol",
                Stop,
                "the server sent messages out of protocol order: check what sits between outboxd and Postgres (proxy, pooler), report it with this log line and the Postgres version",
            ),
            Self::Route(_) => (
                "route",
                Stop,
                "fix the column mapping ([source.columns]) or the topic template the message names",
            ),
        };
        Policy { class, retry, fix }
    }

    /// Transient errors restart the session; definite ones stop the relay.
    pub fn is_transient(&self) -> bool {
        self.policy().retry != Retry::Stop
    }

    /// A bounded label for metrics and logs.
    pub fn class(&self) -> &'static str {
        self.policy().class
    }
}

/// What the supervisor does after a session ended with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Transient: a new session from the slot's confirmed LSN after a jittered, doubling backoff.
    Backoff,
    /// Another instance streams: stand by and poll at `relay.standby_poll_ms`, ready to take over.
    StandBy,
    /// Halted at a poison event (`on_poison = "halt"`): retry at the maximum backoff, not ready,
    /// until an operator fixes the cause.
    Halt,
    /// Definite: retrying cannot help; the relay stops with the message.
    Stop,
}

/// An error's classification: see [`RelayError::policy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub class: &'static str,
    pub retry: Retry,
    /// What an operator does about it, in one line (logs, `outboxd run`'s exit message).
    pub fix: &'static str,
}

impl From<crate::model::tls::TlsError> for RelayError {
    fn from(e: crate::model::tls::TlsError) -> Self {
        Self::Setup(e.0)
    }
}

impl From<crate::model::route::SettingError> for RelayError {
    fn from(e: crate::model::route::SettingError) -> Self {
        Self::Config(e.into())
    }
}

impl From<tokio_postgres::Error> for RelayError {
    fn from(e: tokio_postgres::Error) -> Self {
        // The Display of a tokio-postgres error omits the server message; include it.
        match e.as_db_error() {
            // A missing privilege does not heal by retrying: a setup error naming the fix.
            Some(db) if db.code() == &tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE => {
                Self::Setup(format!(
                    "{}: {} — the role of source.dsn lacks a privilege the relay needs: grant \
                     what sql/roles.sql grants the relay role (`outboxd check` names each one)",
                    db.code().code(),
                    db.message()
                ))
            }
            Some(db) => Self::Postgres(format!("{}: {}", db.code().code(), db.message())),
            // Nor the cause of a client-side failure (e.g. which certificate check failed).
            None => {
                let mut msg = e.to_string();
                let mut cause = std::error::Error::source(&e);
                while let Some(c) = cause {
                    msg = format!("{msg}: {c}");
                    cause = c.source();
                }
                Self::Postgres(msg)
            }
        }
    }
}

/// The SQLSTATE of a server error as pgwire-replication formats it ("… (SQLSTATE 55006)"):
/// the client exposes the code only inside its message.
fn sqlstate(msg: &str) -> Option<&str> {
    let i = msg.rfind("(SQLSTATE ")?;
    msg[i + 10..].split(')').next()
}

impl From<pgwire_replication::PgWireError> for RelayError {
    fn from(e: pgwire_replication::PgWireError) -> Self {
        let server = matches!(e, pgwire_replication::PgWireError::Server(_));
        let msg = e.to_string();
        let code = if server { sqlstate(&msg) } else { None };
        // 55006 object_in_use: "replication slot \"x\" is active for PID 123".
        if code == Some("55006") {
            let pid: String = msg
                .find("for PID ")
                .map(|i| {
                    msg[i + 8..]
                        .chars()
                        .take_while(char::is_ascii_digit)
                        .collect()
                })
                .unwrap_or_default();
            let slot = msg
                .split('"')
                .nth(1)
                .map(str::to_string)
                .unwrap_or_default();
            return Self::SlotBusy { slot, pid };
        }
        // 55000 object_not_in_prerequisite_state at START_REPLICATION: "can no longer get
        // changes from replication slot", "This slot has been invalidated because ...".
        if code == Some("55000")
            && (msg.contains("can no longer get changes from replication slot")
                || msg.contains("has been invalidated"))
        {
            return Self::SlotInvalidated(msg);
        }
        // 42704 undefined_object from pgoutput: the publication was dropped (and perhaps
        // created again, which a slot cannot decode past either).
        if code == Some("42704") && msg.contains("publication") {
            return Self::PublicationChanged(msg);
        }
        Self::Replication(msg)
    }
}

impl From<rdkafka::error::KafkaError> for RelayError {
    fn from(e: rdkafka::error::KafkaError) -> Self {
        Self::Kafka(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgwire_replication::PgWireError;

    #[test]
    fn one_policy_per_error() {
        let busy = RelayError::SlotBusy {
            slot: "s".into(),
            pid: "1".into(),
        };
        assert_eq!(busy.policy().retry, Retry::StandBy);
        let halted = RelayError::Halted {
            event_id: "e".into(),
            class: "too_large".into(),
            message: "m".into(),
        };
        assert_eq!(halted.policy().retry, Retry::Halt);
        assert!(halted.is_transient());
        assert_eq!(
            RelayError::Kafka("down".into()).policy().retry,
            Retry::Backoff
        );
        let definite = RelayError::Setup("wal_level".into());
        assert_eq!(definite.policy().retry, Retry::Stop);
        assert!(!definite.is_transient());
        assert_eq!(definite.class(), "setup");
    }

    #[test]
    fn slot_busy_and_invalidated_by_sqlstate() {
        let busy = PgWireError::Server(
            "replication slot \"s1\" is active for PID 4242 (SQLSTATE 55006)".into(),
        );
        match RelayError::from(busy) {
            RelayError::SlotBusy { slot, pid } => {
                assert_eq!((slot.as_str(), pid.as_str()), ("s1", "4242"))
            }
            e => panic!("{e:?}"),
        }
        let gone = PgWireError::Server(
            "can no longer get changes from replication slot \"s1\" (SQLSTATE 55000)".into(),
        );
        assert!(matches!(
            RelayError::from(gone),
            RelayError::SlotInvalidated(_)
        ));
        // The same words without the code (a protocol message) are not a busy slot.
        let text = PgWireError::Protocol("slot \"s1\" is active for PID 1".into());
        assert!(matches!(RelayError::from(text), RelayError::Replication(_)));
    }
}
