//! A Kafka record as plain data: what the stages built (handed to shadow mode's comparator) or
//! what another path published, compared field by field.

/// One record, as outboxd built it or as the legacy path published it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rec {
    pub event_id: String,
    pub event_type: String,
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    /// In order; a header may have no value.
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}
