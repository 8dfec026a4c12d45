//! Test 3 of the relay issue: while events are being written, a real relay process is SIGKILLed
//! at random moments (at least 5 times) and restarted. Afterwards every committed `event_id` is on
//! the topic with identical bytes, no rolled-back one is, and duplicates are the only difference.

use outboxd_tests::*;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_moments_loses_nothing() -> anyhow::Result<()> {
    let env = Env::start("crash").await?;
    let topic = "outbox.event.cart";
    create_topics(&env.bootstrap(), &[topic], 3).await?;
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");

    // Writer: random transactions until told to stop.
    let mut c = env.sql().await?;
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let writer = tokio::spawn(async move {
        let mut rng = rand::rngs::StdRng::from_entropy();
        let mut committed: HashMap<String, serde_json::Value> = HashMap::new();
        let mut rolled_back = HashSet::new();
        let mut version: HashMap<String, i64> = HashMap::new();
        while !*stop_rx.borrow_and_update() {
            let rollback = rng.gen_bool(0.15);
            let mut batch = Vec::new();
            let mut v2 = version.clone();
            for _ in 0..rng.gen_range(1..30) {
                let agg = format!("cart-{}", rng.gen_range(0..50));
                let v = v2.entry(agg.clone()).or_insert(0);
                *v += 1;
                batch.push(NewEvent {
                    event_id: Uuid::now_v7(),
                    aggregate_type: "cart".into(),
                    aggregate_id: agg,
                    version: *v,
                    event_type: "ItemAdded".into(),
                    payload: serde_json::json!({"sku": rng.gen_range(0..1_000_000), "pad": "x".repeat(rng.gen_range(0..500))}),
                });
            }
            write_events(&mut c, &batch, rollback).await?;
            for e in batch {
                if rollback {
                    rolled_back.insert(e.event_id.to_string());
                } else {
                    committed.insert(e.event_id.to_string(), e.payload);
                }
            }
            if !rollback {
                version = v2;
            }
            tokio::time::sleep(Duration::from_millis(rng.gen_range(0..5))).await;
        }
        anyhow::Ok((committed, rolled_back))
    });

    let mut rng = rand::thread_rng();
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..1500))).await;
        relay.sigkill();
        relay = RelayProcess::spawn(&config, log.clone())?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_tx.send(true)?;
    let (committed, rolled_back) = writer.await??;
    // Let the last successor catch up, then stop it gracefully.
    eventually(Duration::from_secs(60), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await?;
    let status = relay.sigterm()?;
    assert!(status.success(), "graceful shutdown exit status {status}");

    let recs = read_topic(
        &env.bootstrap(),
        topic,
        committed.len(),
        Duration::from_secs(120),
    )?;
    let mut first_bytes: HashMap<&str, (&[u8], &[u8], String)> = HashMap::new();
    let mut dups = 0;
    for r in &recs {
        let id = r.header("event_id");
        assert!(
            !rolled_back.contains(id),
            "rolled-back event {id} delivered"
        );
        let payload = committed.get(id).expect("unknown event on the topic");
        assert_eq!(
            &serde_json::from_slice::<serde_json::Value>(&r.value)?,
            payload
        );
        let fields = (
            r.key.as_slice(),
            r.value.as_slice(),
            format!("{:?}", r.headers),
        );
        match first_bytes.get(id) {
            Some(prev) => {
                dups += 1;
                assert_eq!(
                    *prev, fields,
                    "a duplicate of {id} differs from the first copy"
                );
            }
            None => {
                first_bytes.insert(id, fields);
            }
        }
    }
    let missing: Vec<&String> = committed
        .keys()
        .filter(|k| !first_bytes.contains_key(k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{} committed events missing, e.g. {:?}",
        missing.len(),
        missing.first()
    );
    eprintln!(
        "{} committed, {} records, {dups} duplicates",
        committed.len(),
        recs.len()
    );
    Ok(())
}
