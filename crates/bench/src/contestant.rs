//! Who runs in the benchmark: the ceilings, outboxd (as it is, a variant, behind a plain or TLS
//! hop) and the polling relay. A leaf, so the world that hosts them and the contest that times
//! them both name it without naming each other.

use crate::kafka_hop::Hop;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Contestant {
    /// `pg_recvlogical … -f /dev/null`: Postgres' own client, nothing done to the rows.
    CeilingRecvlogical,
    /// A bare pgwire-replication reader that only receives and confirms.
    CeilingBare,
    /// The bare reader over TLS (`--ssl`): the ceiling of an encrypted stream. Not the
    /// reference ceiling; compare TLS variants with it.
    CeilingBareTls,
    Outboxd,
    /// outboxd with extra environment (`--variant-env`): a proposed fix, measured in the
    /// same run as the relay as it is.
    OutboxdVariant,
    /// outboxd writing CloudEvents, binary content mode (`--cloudevents binary`).
    OutboxdCeBinary,
    /// outboxd writing CloudEvents, structured content mode (`--cloudevents structured`).
    OutboxdCeStructured,
    /// outboxd whose broker is reached through a plain proxy ([`crate::kafka_hop`]): the
    /// reference of the TLS-to-Kafka comparison.
    OutboxdViaProxy,
    /// outboxd speaking TLS to the same proxy, which terminates it (`security.protocol = SSL`).
    OutboxdViaTls,
    Polling,
}

impl Contestant {
    pub fn label(self) -> &'static str {
        match self {
            Self::CeilingRecvlogical => "ceiling: pg_recvlogical",
            Self::CeilingBare => "ceiling: bare reader",
            Self::CeilingBareTls => "ceiling: bare reader over TLS",
            Self::Outboxd => "outboxd",
            Self::OutboxdVariant => "outboxd (variant)",
            Self::OutboxdCeBinary => "outboxd, CloudEvents binary",
            Self::OutboxdCeStructured => "outboxd, CloudEvents structured",
            Self::OutboxdViaProxy => "outboxd → proxy → broker",
            Self::OutboxdViaTls => "outboxd → TLS proxy → broker",
            Self::Polling => "polling (SKIP LOCKED)",
        }
    }

    /// Short name used in slot and topic names.
    pub fn tag(self) -> &'static str {
        match self {
            Self::CeilingRecvlogical => "rl",
            Self::CeilingBare => "bare",
            Self::CeilingBareTls => "baretls",
            Self::Outboxd => "ob",
            Self::OutboxdVariant => "obv",
            Self::OutboxdCeBinary => "obceb",
            Self::OutboxdCeStructured => "obces",
            Self::OutboxdViaProxy => "obpx",
            Self::OutboxdViaTls => "obtls",
            Self::Polling => "poll",
        }
    }

    /// The relay process (not a ceiling reader, not polling).
    pub fn is_outboxd(self) -> bool {
        matches!(
            self,
            Self::Outboxd
                | Self::OutboxdVariant
                | Self::OutboxdCeBinary
                | Self::OutboxdCeStructured
                | Self::OutboxdViaProxy
                | Self::OutboxdViaTls
        )
    }

    /// The CloudEvents content mode it writes (`None`: outboxd's plain records).
    pub fn cloudevents(self) -> Option<&'static str> {
        match self {
            Self::OutboxdCeBinary => Some("binary"),
            Self::OutboxdCeStructured => Some("structured"),
            _ => None,
        }
    }

    /// The contestant writing CloudEvents in `mode` (`binary` or `structured`).
    pub fn for_cloudevents(mode: &str) -> Option<Self> {
        match mode {
            "binary" => Some(Self::OutboxdCeBinary),
            "structured" => Some(Self::OutboxdCeStructured),
            _ => None,
        }
    }

    /// How it reaches the broker of the TLS-to-Kafka comparison (None: the main broker, direct).
    pub fn hop(self) -> Option<Hop> {
        match self {
            Self::OutboxdViaProxy => Some(Hop::Plain),
            Self::OutboxdViaTls => Some(Hop::Tls),
            _ => None,
        }
    }
}
