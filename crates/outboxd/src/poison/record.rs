//! The record of a poison event as it would have been produced: what parking stores, what a
//! repair republishes. A leaf: routing and the producer build it without knowing the store.

/// Everything needed to publish the event later exactly as it would have been published.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParkedRecord {
    pub event_id: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<i64>,
    pub event_type: Option<String>,
    pub topic: Option<String>,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// The Kafka headers in order; `None` is a header without a value (a NULL placed column).
    pub headers: Vec<(String, Option<String>)>,
    pub timestamp_ms: Option<i64>,
}
