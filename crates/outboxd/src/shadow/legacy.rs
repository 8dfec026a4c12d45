//! Reading the legacy path's records: a consumer on `shadow.legacy_topics`, assigned to every
//! partition at its end (no consumer group to join: comparing starts at once and commits
//! nothing), and the event id and type taken from where `shadow.legacy_event_*` says.

use crate::config::shadow::Locator;
use crate::config::Config;
use crate::error::RelayError;
use crate::model::record::Rec;
use crate::relay::kafka::consumer::{self as kafka_consumer, Ctx};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use std::time::Duration;

/// A consumer at the end of every partition of the legacy topics.
pub fn consumer(cfg: &Config) -> Result<StreamConsumer<Ctx>, RelayError> {
    let setup = |e: String| {
        RelayError::Setup(format!(
            "shadow: cannot create the legacy consumer from [sink.kafka]: {}",
            cfg.redactor.scrub(&e)
        ))
    };
    let consumer: StreamConsumer<Ctx> = kafka_consumer::config(
        cfg,
        &format!("outboxd-shadow-{}", cfg.source.slot),
        "outboxd-shadow",
    )
    .map_err(setup)?
    .create_with_context(Ctx::new(cfg, "shadow consumer"))
    .map_err(|e| setup(e.to_string()))?;
    let mut tpl = TopicPartitionList::new();
    for topic in &cfg.shadow.legacy_topics {
        let md = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .map_err(|e| {
                RelayError::Kafka(format!(
                    "shadow: metadata of legacy topic {topic:?}: {}",
                    cfg.redactor.scrub(&e.to_string())
                ))
            })?;
        let parts = md
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .map(|t| t.partitions().len())
            .unwrap_or(0);
        if parts == 0 {
            return Err(RelayError::Setup(format!(
                "shadow.legacy_topics: topic {topic:?} does not exist (or has no partitions)"
            )));
        }
        for p in 0..parts as i32 {
            tpl.add_partition_offset(topic, p, Offset::End)
                .map_err(|e| RelayError::Kafka(e.to_string()))?;
        }
    }
    consumer
        .assign(&tpl)
        .map_err(|e| RelayError::Kafka(format!("shadow: assign legacy topics: {e}")))?;
    Ok(consumer)
}

/// The legacy record as a comparable [`Rec`]; `None` when its event id cannot be found (it is
/// counted, never logged with content).
pub fn to_rec(m: &BorrowedMessage<'_>, id: &Locator, ty: Option<&Locator>) -> Option<Rec> {
    let headers: Vec<(String, Option<Vec<u8>>)> = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default();
    let json = std::cell::OnceCell::new();
    let locate = |l: &Locator| -> Option<String> {
        match l {
            Locator::Key => m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
            Locator::Header(h) => headers
                .iter()
                .find(|(k, _)| k == h)
                .and_then(|(_, v)| v.as_deref())
                .map(|v| String::from_utf8_lossy(v).into_owned()),
            Locator::Json(p) => json
                .get_or_init(|| {
                    m.payload()
                        .and_then(|v| serde_json::from_slice::<serde_json::Value>(v).ok())
                })
                .as_ref()
                .and_then(|v| v.pointer(p))
                .map(|v| match v {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                }),
        }
    };
    let event_id = locate(id)?;
    let event_type = ty.and_then(locate).unwrap_or_else(|| "unknown".into());
    Some(Rec {
        event_id,
        event_type,
        topic: m.topic().to_string(),
        key: m.key().map(<[u8]>::to_vec),
        value: m.payload().map(<[u8]>::to_vec),
        headers,
    })
}
