//! The `aggregate_version` of a record in either of outboxd's formats: the `aggregate_version`
//! header (`[sink] format = "outbox"`), or a CloudEvent's `aggregateversion` extension — the
//! `ce_aggregateversion` header in binary mode, the envelope's attribute in structured mode
//! (issue 42; the bench's `--cloudevents` variant).

use rdkafka::message::{Headers, Message};

/// The record's aggregate version, whatever its format (`None`: it carries none).
pub fn aggregate_version<M: Message>(m: &M) -> Option<i64> {
    let header = |name: &str| {
        m.headers()
            .and_then(|h| h.iter().find(|h| h.key == name))
            .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse::<i64>().ok())
    };
    header("aggregate_version")
        .or_else(|| header("ce_aggregateversion"))
        .or_else(|| {
            #[derive(serde::Deserialize)]
            struct Envelope<'a> {
                #[serde(borrow)]
                aggregateversion: &'a str,
            }
            let e: Envelope = serde_json::from_slice(m.payload()?).ok()?;
            e.aggregateversion.parse().ok()
        })
}
