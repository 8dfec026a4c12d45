//! Test 1 of the relay issue: exact records, rolled-back transactions never appear, a mixed
//! business + outbox transaction yields its events only after commit.

use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

fn ev(agg: &str, v: i64, payload: serde_json::Value) -> NewEvent {
    NewEvent {
        event_id: Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: agg.into(),
        version: v,
        event_type: "OrderPlaced".into(),
        payload,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_rows_arrive_exactly_and_rolled_back_rows_never() -> anyhow::Result<()> {
    let env = Env::start("basics").await?;
    create_topics(&env.bootstrap(), &["outbox.event.order"], 3).await?;
    let mut c = env.sql().await?;
    c.batch_execute("CREATE TABLE orders (id text primary key, total int)")
        .await?;

    let relay = Relay::start(env.config()?);

    // 1. committed, with extra headers and a created_at we control
    let e1 = ev(
        "o-1",
        1,
        serde_json::json!({"total": 42, "note": "ünïcødé"}),
    );
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version, payload, headers, created_at) \
         VALUES ($1, 'order', 'o-1', 1, 'OrderPlaced', 3, $2, '{\"traceparent\": \"00-abc-def-01\"}', '2026-01-02 03:04:05.678+00')",
        &[&e1.event_id, &e1.payload],
    ).await?;
    // 2. rolled back
    let rolled = ev("o-2", 1, serde_json::json!({"total": 1}));
    write_events(&mut c, std::slice::from_ref(&rolled), true).await?;
    // 3. business row + outbox row in one transaction, held open while we look
    let e3 = ev("o-3", 1, serde_json::json!({"total": 7}));
    let tx = c.transaction().await?;
    tx.execute("INSERT INTO orders VALUES ('o-3', 7)", &[])
        .await?;
    tx.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) VALUES ($1, 'order', 'o-3', 1, 'OrderPlaced', $2)",
        &[&e3.event_id, &e3.payload],
    ).await?;
    let before = read_topic(
        &env.bootstrap(),
        "outbox.event.order",
        1,
        Duration::from_secs(20),
    )?;
    assert!(
        before
            .iter()
            .all(|r| r.header("event_id") != e3.event_id.to_string()),
        "event of an uncommitted transaction is visible"
    );
    tx.commit().await?;

    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.order",
        2,
        Duration::from_secs(30),
    )?;
    let ids: Vec<&str> = recs.iter().map(|r| r.header("event_id")).collect();
    assert_eq!(recs.len(), 2, "got {ids:?}");
    assert!(
        !ids.contains(&rolled.event_id.to_string().as_str()),
        "rolled-back event delivered"
    );

    let r1 = recs
        .iter()
        .find(|r| r.header("event_id") == e1.event_id.to_string())
        .unwrap();
    assert_eq!(r1.key, b"o-1");
    // value = the payload as committed (jsonb text form)
    let stored: String = c
        .query_one(
            "SELECT payload::text FROM outbox WHERE event_id = $1",
            &[&e1.event_id],
        )
        .await?
        .get(0);
    assert_eq!(String::from_utf8(r1.value.clone())?, stored);
    assert_eq!(r1.header("event_type"), "OrderPlaced");
    assert_eq!(r1.header("aggregate_type"), "order");
    assert_eq!(r1.header("aggregate_id"), "o-1");
    assert_eq!(r1.header("aggregate_version"), "1");
    assert_eq!(r1.header("schema_version"), "3");
    assert_eq!(r1.header("traceparent"), "00-abc-def-01");
    assert_eq!(r1.timestamp, Some(1_767_323_045_678));
    assert!(recs
        .iter()
        .any(|r| r.header("event_id") == e3.event_id.to_string() && r.key == b"o-3"));

    // The slot is confirmed past both commits once they are acknowledged.
    let target = env.current_lsn().await?;
    eventually(Duration::from_secs(10), || async {
        Ok(env.confirmed_lsn().await? >= target)
    })
    .await?;
    relay.shutdown().await?;
    Ok(())
}
