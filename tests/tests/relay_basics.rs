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
    env.confirmed_past_now(Duration::from_secs(10)).await?;
    relay.shutdown().await?;
    Ok(())
}

/// Live transactions are read in gulps (`relay::gulp`): the relay waits for the rest of an open
/// transaction and, between transactions, either gathers the ones committed within a window
/// (the adaptive pace, the default) or waits `relay.read_linger_ms` after each Commit (the fixed
/// pace). None may lose, split or reorder anything. Two writers commit small transactions back
/// to back, so every pause happens many times: adaptive with its default window and with the
/// longest allowed, fixed with the longest linger allowed and with none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_read_in_gulps_arrive_whole_and_in_order() -> anyhow::Result<()> {
    for (key, ms) in [
        ("", ""),
        ("OUTBOXD_RELAY_BATCH_WINDOW_MS", "100"),
        ("OUTBOXD_RELAY_READ_LINGER_MS", "100"),
        ("OUTBOXD_RELAY_READ_LINGER_MS", "0"),
    ] {
        let linger_ms = format!("{key}={ms}");
        let env = Env::start("gulps").await?;
        create_topics(&env.bootstrap(), &["outbox.event.order"], 3).await?;
        let overrides = [(key.to_string(), ms.to_string())]
            .into_iter()
            .filter(|(k, _)| !k.is_empty());
        let cfg = outboxd::Config::from_toml_and_env(&env.toml(), overrides)?;
        let (window, fixed) = (cfg.relay.batch_window_ms, cfg.relay.read_linger_ms);
        match key {
            "" => assert_eq!((window, fixed), (4, None)),
            "OUTBOXD_RELAY_BATCH_WINDOW_MS" => assert_eq!((window, fixed), (100, None)),
            _ => assert_eq!(fixed.map(|f| f.to_string()), Some(ms.to_string())),
        }
        let relay = Relay::start(cfg);
        let mut writers = Vec::new();
        for w in 0..2 {
            let mut c = env.sql().await?;
            writers.push(tokio::spawn(async move {
                let mut sent = Vec::new();
                for t in 0..40i64 {
                    // Five events per transaction, over five aggregates of this writer.
                    let evs: Vec<NewEvent> = (0..5)
                        .map(|i| ev(&format!("w{w}-a{i}"), t + 1, serde_json::json!({"t": t})))
                        .collect();
                    write_events(&mut c, &evs, false).await?;
                    sent.extend(evs);
                }
                anyhow::Ok(sent)
            }));
        }
        let mut sent = Vec::new();
        for w in writers {
            sent.extend(w.await??);
        }
        let recs = read_topic(
            &env.bootstrap(),
            "outbox.event.order",
            sent.len(),
            Duration::from_secs(60),
        )?;
        assert_eq!(
            recs.len(),
            sent.len(),
            "linger {linger_ms}: copies or losses"
        );
        // Per aggregate (one key, one partition) the versions arrive in commit order.
        let mut last = std::collections::HashMap::<Vec<u8>, i64>::new();
        for r in &recs {
            let v: i64 = r.header("aggregate_version").parse()?;
            let prev = last.insert(r.key.clone(), v).unwrap_or(0);
            assert_eq!(v, prev + 1, "linger {linger_ms}: {:?} out of order", r.key);
        }
        env.confirmed_past_now(Duration::from_secs(10)).await?;
        relay.shutdown().await?;
    }
    Ok(())
}
