//! Poison-event policy: which failures retrying cannot fix, and what to do with them per event
//! type (R15–R17).
//!
//! - *Transient* failures (broker down, timeouts, throttling, leader changes, unknown outcome)
//!   are retried — inside librdkafka with the same producer sequence, or by restarting the
//!   session from the slot — and never parked.
//! - *Deterministic* failures (too large, invalid record, schema-invalid payload, a required
//!   field NULL, not authorised for the topic) are parked or halt the relay, per event type.

use rdkafka::types::RDKafkaErrorCode;
use serde::Deserialize;
use std::collections::BTreeMap;

/// May later events of the same aggregate overtake a parked one?
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// No: they are parked behind it, in order, until it is retried or discarded (strict
    /// sequences such as balances).
    #[default]
    Aggregate,
    /// Yes: later events continue (independent notifications).
    None,
}

/// What a deterministic failure does.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnPoison {
    /// Write the event to `outbox_parked` and continue as `ordering` says.
    #[default]
    Park,
    /// Stop: nothing past the event is confirmed, readiness fails, the relay retries it with
    /// the maximum backoff until an operator fixes the cause.
    Halt,
}

/// What a row whose payload is NULL becomes.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NullPayload {
    /// A record with a null value: on a compacted topic a tombstone that deletes the key
    /// (what Debezium's EventRouter sends; the Debezium preset's default).
    Tombstone,
    /// A deterministic failure (`invalid_event`), parked or halting as `on_poison` says (the
    /// default of the outboxd preset).
    Park,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct TypePolicy {
    #[serde(default)]
    pub ordering: Option<Ordering>,
    #[serde(default)]
    pub on_poison: Option<OnPoison>,
    #[serde(default)]
    pub on_null_payload: Option<NullPayload>,
}

/// `[policy]`: defaults plus per-event-type overrides in `[policy.event_types.<type>]`.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    #[serde(default)]
    pub ordering: Ordering,
    #[serde(default)]
    pub on_poison: OnPoison,
    /// Unset: `tombstone` with the Debezium preset, `park` otherwise.
    #[serde(default)]
    pub on_null_payload: Option<NullPayload>,
    #[serde(default)]
    pub event_types: BTreeMap<String, TypePolicy>,
}

/// The policy that applies to one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effective {
    pub ordering: Ordering,
    pub on_poison: OnPoison,
}

impl PolicyConfig {
    /// What a NULL payload of `event_type` becomes; `preset` is the preset's default.
    pub fn null_payload(&self, event_type: &str, preset: NullPayload) -> NullPayload {
        self.event_types
            .get(event_type)
            .and_then(|t| t.on_null_payload)
            .or(self.on_null_payload)
            .unwrap_or(preset)
    }

    pub fn for_type(&self, event_type: &str) -> Effective {
        let t = self.event_types.get(event_type);
        Effective {
            ordering: t.and_then(|t| t.ordering).unwrap_or(self.ordering),
            on_poison: t.and_then(|t| t.on_poison).unwrap_or(self.on_poison),
        }
    }
}

/// Error codes (local or from the broker) that retrying the same record cannot fix.
pub fn is_deterministic(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::InvalidTopic
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::PolicyViolation
            | C::InvalidArgument
            | C::BadMessage
            | C::UnsupportedForMessageFormat
    )
}

/// A bounded label for a failure (metrics, `outbox_parked.error_class`).
pub fn class_of(code: RDKafkaErrorCode) -> &'static str {
    use RDKafkaErrorCode as C;
    match code {
        C::MessageSizeTooLarge | C::InvalidMessageSize => "too_large",
        C::InvalidMessage | C::InvalidRecord | C::BadMessage | C::UnsupportedForMessageFormat => {
            "invalid_record"
        }
        C::InvalidTopic => "invalid_topic",
        C::TopicAuthorizationFailed | C::ClusterAuthorizationFailed => "not_authorized",
        C::PolicyViolation => "policy_violation",
        C::InvalidArgument => "invalid_argument",
        C::MessageTimedOut | C::RequestTimedOut => "timeout",
        C::ThrottlingQuotaExceeded => "throttled",
        C::NotLeaderForPartition | C::LeaderNotAvailable => "leader_change",
        C::BrokerTransportFailure | C::AllBrokersDown => "broker_unavailable",
        C::Fatal => "fatal",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_type_overrides_fall_back_to_defaults() {
        let p: PolicyConfig = toml::from_str(
            r#"
ordering = "aggregate"
[event_types.EmailRequested]
ordering = "none"
[event_types.BalanceChanged]
on_poison = "halt"
"#,
        )
        .unwrap();
        assert_eq!(
            p.for_type("EmailRequested"),
            Effective {
                ordering: Ordering::None,
                on_poison: OnPoison::Park
            }
        );
        assert_eq!(p.for_type("BalanceChanged").on_poison, OnPoison::Halt);
        assert_eq!(p.for_type("BalanceChanged").ordering, Ordering::Aggregate);
        assert_eq!(p.for_type("Other"), p.for_type("Another"));
    }

    #[test]
    fn null_payload_policy_per_type_then_global_then_preset() {
        let p: PolicyConfig =
            toml::from_str("[event_types.Deleted]\non_null_payload = \"tombstone\"\n").unwrap();
        assert_eq!(
            p.null_payload("Deleted", NullPayload::Park),
            NullPayload::Tombstone
        );
        assert_eq!(
            p.null_payload("Other", NullPayload::Park),
            NullPayload::Park
        );
        assert_eq!(
            p.null_payload("Other", NullPayload::Tombstone),
            NullPayload::Tombstone
        );
        let p: PolicyConfig = toml::from_str("on_null_payload = \"park\"\n").unwrap();
        assert_eq!(
            p.null_payload("Other", NullPayload::Tombstone),
            NullPayload::Park
        );
    }

    #[test]
    fn classification() {
        assert!(is_deterministic(RDKafkaErrorCode::MessageSizeTooLarge));
        assert!(is_deterministic(RDKafkaErrorCode::TopicAuthorizationFailed));
        assert!(!is_deterministic(RDKafkaErrorCode::NotLeaderForPartition));
        assert!(!is_deterministic(RDKafkaErrorCode::RequestTimedOut));
        assert!(!is_deterministic(RDKafkaErrorCode::ThrottlingQuotaExceeded));
        assert_eq!(class_of(RDKafkaErrorCode::MessageSizeTooLarge), "too_large");
    }
}
