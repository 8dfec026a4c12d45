//! Poison-event policy: which failures retrying cannot fix, and what to do with them per event
//! type (R15–R17).
//!
//! - *Transient* failures (broker down, timeouts, throttling, leader changes, unknown outcome)
//!   are retried — inside librdkafka with the same producer sequence, or by restarting the
//!   session from the slot — and never parked.
//! - *Deterministic* failures (too large, invalid record, schema-invalid payload, a required
//!   field NULL, not authorised for the topic) are parked or halt the relay, per event type.
//!
//! The `[policy]` section itself (per-type ordering and park-or-halt) is `crate::config::policy`.

use rdkafka::types::RDKafkaErrorCode;

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
    fn classification() {
        assert!(is_deterministic(RDKafkaErrorCode::MessageSizeTooLarge));
        assert!(is_deterministic(RDKafkaErrorCode::TopicAuthorizationFailed));
        assert!(!is_deterministic(RDKafkaErrorCode::NotLeaderForPartition));
        assert!(!is_deterministic(RDKafkaErrorCode::RequestTimedOut));
        assert!(!is_deterministic(RDKafkaErrorCode::ThrottlingQuotaExceeded));
        assert_eq!(class_of(RDKafkaErrorCode::MessageSizeTooLarge), "too_large");
    }
}
