//! The Kafka loop against a real broker (tansu) and a real Postgres: relay-format records,
//! duplicates absorbed, offsets committed only after processing, and a conflict or a malformed
//! record stops the loop without committing past it.

mod common;

use std::time::Duration;

use anyhow::{Context, Result};
use common::*;
use outboxd_inbox::{
    consumer_config, ConflictKind, ConsumerSettings, EnvelopeError, Inbox, InboxConsumer,
    InboxError, Ordering,
};
use outboxd_testkit::{Broker, Postgres};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Offset;
use serde_json::json;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

async fn create_topic(bootstrap: &str, topic: &str) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let res = admin
        .create_topics(
            &[NewTopic::new(topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await?;
    for r in res {
        r.map_err(|(t, e)| anyhow::anyhow!("create topic {t}: {e}"))?;
    }
    Ok(())
}

/// Produces a record exactly as the relay does (key, value, timestamp, string headers).
async fn send(
    p: &FutureProducer,
    topic: &str,
    event_id: Option<Uuid>,
    order_id: &str,
    version: i64,
    status: &str,
) -> Result<()> {
    let payload = serde_json::to_string(&json!({ "status": status }))?;
    let id = event_id.map(|u| u.to_string());
    let version = version.to_string();
    let mut headers = OwnedHeaders::new();
    let mut pairs: Vec<(&str, &str)> = vec![
        ("event_type", "OrderStatusChanged"),
        ("aggregate_type", "order"),
        ("aggregate_id", order_id),
        ("aggregate_version", &version),
        ("schema_version", "1"),
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
    ];
    if let Some(id) = id.as_deref() {
        pairs.insert(0, ("event_id", id));
    }
    for (k, v) in pairs {
        headers = headers.insert(Header {
            key: k,
            value: Some(v),
        });
    }
    let record = FutureRecord::to(topic)
        .key(order_id)
        .payload(&payload)
        .timestamp(chrono::Utc::now().timestamp_millis())
        .headers(headers);
    p.send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("produce: {e}"))?;
    Ok(())
}

struct Setup {
    pg: Postgres,
    broker: Broker,
    producer: FutureProducer,
    topic: String,
    db: String,
    /// A separate connection for assertions.
    check: tokio_postgres::Client,
}

async fn setup(prefix: &str) -> Result<Setup> {
    let pg = Postgres::start()?;
    let broker = Broker::start()?;
    let (c, db) = consumer_db(&pg, prefix).await?;
    let topic = format!("outbox.event.order-{prefix}");
    create_topic(&broker.bootstrap(), &topic).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("message.timeout.ms", "10000")
        .create()?;
    Ok(Setup {
        pg,
        broker,
        producer,
        topic,
        db,
        check: c,
    })
}

async fn consumer_for(
    s: &Setup,
    pg: &Postgres,
    handler: std::sync::Arc<Projection>,
) -> Result<InboxConsumer<std::sync::Arc<Projection>>> {
    let kafka: StreamConsumer = consumer_config(&s.broker.bootstrap(), "shipping")
        .set("session.timeout.ms", "6000")
        .create()?;
    kafka.subscribe(&[&s.topic])?;
    let db = pg.connect(&s.db).await?;
    Ok(InboxConsumer::new(
        Inbox::new(handler),
        db,
        kafka,
        ConsumerSettings {
            sweep_every: Duration::from_millis(200),
            ..Default::default()
        },
    ))
}

/// Resolves once `sql` (a count) reaches `n`, polling a separate connection.
async fn until_count(c: &tokio_postgres::Client, sql: &str, n: i64) {
    loop {
        if count(c, sql).await.unwrap_or(0) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn committed_offset<C: rdkafka::consumer::ConsumerContext>(
    kafka: &StreamConsumer<C>,
) -> Result<Offset> {
    let tpl = kafka.committed(Duration::from_secs(10))?;
    Ok(tpl.elements().first().context("no partition")?.offset())
}

#[tokio::test]
async fn duplicates_absorbed_and_a_conflict_stops_before_its_offset() -> Result<()> {
    let s = setup("dupconf").await?;
    let handler = Projection::ordered("shipping", Duration::from_secs(3600));
    let e1 = Uuid::now_v7();
    for _ in 0..5 {
        send(&s.producer, &s.topic, Some(e1), "o-1", 1, "placed").await?;
    }
    let (e2, e3) = (Uuid::now_v7(), Uuid::now_v7());
    // Out of order on the wire: 3 before 2 (held, then released in order).
    send(&s.producer, &s.topic, Some(e3), "o-1", 3, "shipped").await?;
    send(&s.producer, &s.topic, Some(e2), "o-1", 2, "paid").await?;

    let mut consumer = consumer_for(&s, &s.pg, handler.clone()).await?;
    let stats = tokio::time::timeout(
        WAIT,
        consumer.run(until_count(&s.check, "SELECT count(*) FROM apply_log", 3)),
    )
    .await??;
    assert_eq!(stats.applied, 2);
    assert_eq!(stats.duplicates, 4);
    assert_eq!(stats.held, 1);
    assert_eq!(
        applied(&s.check, "o-1").await?,
        vec![(e1, 1), (e2, 2), (e3, 3)],
        "one business effect per event, in version order"
    );
    // The last record (e2) made the count reach 3, and its offset is committed before the loop
    // looks at the shutdown signal again.
    assert_eq!(committed_offset(consumer.kafka()).await?, Offset::Offset(7));

    // A conflicting event (same aggregate and version, another id) stops the loop.
    send(
        &s.producer,
        &s.topic,
        Some(Uuid::now_v7()),
        "o-1",
        2,
        "cancelled",
    )
    .await?;
    let err = tokio::time::timeout(WAIT, consumer.run(std::future::pending()))
        .await?
        .unwrap_err();
    assert!(
        matches!(
            &err,
            InboxError::Conflict { kind: ConflictKind::VersionTaken { existing_event_id }, .. }
                if *existing_event_id == e2
        ),
        "{err:?}"
    );
    assert_eq!(
        committed_offset(consumer.kafka()).await?,
        Offset::Offset(7),
        "never committed past the conflict"
    );
    assert_eq!(applied(&s.check, "o-1").await?.len(), 3, "no effect");
    let status: String = s
        .check
        .query_one("SELECT status FROM shipment WHERE order_id = 'o-1'", &[])
        .await?
        .get(0);
    assert_eq!(status, "shipped");
    Ok(())
}

#[tokio::test]
async fn record_without_event_id_stops_the_loop_uncommitted() -> Result<()> {
    let s = setup("malformed").await?;
    let handler = Projection::new("shipping", Ordering::Unordered);
    send(
        &s.producer,
        &s.topic,
        Some(Uuid::now_v7()),
        "o-1",
        1,
        "placed",
    )
    .await?;
    send(&s.producer, &s.topic, None, "o-1", 2, "paid").await?;
    let mut consumer = consumer_for(&s, &s.pg, handler).await?;
    let err = tokio::time::timeout(WAIT, consumer.run(std::future::pending()))
        .await?
        .unwrap_err();
    match &err {
        InboxError::Malformed { source_at, source } => {
            assert_eq!(source, &EnvelopeError::MissingHeader("event_id"));
            assert_eq!(source_at.as_ref().map(|s| s.offset), Some(1));
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(applied(&s.check, "o-1").await?.len(), 1);
    assert_eq!(
        committed_offset(consumer.kafka()).await?,
        Offset::Offset(1),
        "the malformed record at offset 1 is not committed past"
    );
    Ok(())
}
