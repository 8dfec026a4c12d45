//! The park reason of a record the producer or broker refused for its size: librdkafka says
//! only "Message size too large"; the operator needs the record's size, the limits that apply
//! and what to do (binary payloads — Avro blobs, images — meet this first).

use crate::poison::record::ParkedRecord;

/// `message` with the record's size and the fix, for a size refusal; as it is otherwise.
pub fn explain(class: &str, message: String, record: &ParkedRecord) -> String {
    if class != "too_large" {
        return message;
    }
    let payload = record.payload.as_ref().map_or(0, Vec::len);
    let headers: usize = record
        .headers
        .iter()
        .map(|(k, v)| k.len() + v.as_ref().map_or(0, String::len))
        .sum();
    let total = payload + headers + record.key.as_ref().map_or(0, Vec::len);
    format!(
        "{message} — the record is about {total} bytes (payload {payload}); the limits are \
         [sink.kafka] \"message.max.bytes\" (librdkafka's default 1000000) and the topic's \
         max.message.bytes (the broker's message.max.bytes): raise both, or keep the large \
         payload out of the outbox (store it elsewhere and publish a reference), then \
         `outboxd parked retry` it (with --payload FILE for a smaller payload) or discard it"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_refusal_names_the_size_and_the_limits() {
        let r = ParkedRecord {
            key: Some(b"a".to_vec()),
            payload: Some(vec![0; 1_500_000]),
            headers: vec![("event_id".into(), Some("e".into()))],
            ..ParkedRecord::default()
        };
        let m = explain("too_large", "MessageSizeTooLarge".into(), &r);
        assert!(m.contains("1500010 bytes (payload 1500000)"), "{m}");
        assert!(
            m.contains("message.max.bytes") && m.contains("parked retry"),
            "{m}"
        );
        assert_eq!(explain("invalid_record", "x".into(), &r), "x");
    }
}
