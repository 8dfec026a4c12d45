//! Test 2 of the relay issue: 20,000 events over 500 aggregates in transactions of random size
//! (1–200, some rolled back): every committed event arrives exactly as written, nothing rolled
//! back does, and per-aggregate versions are strictly increasing on one partition.

use outboxd_tests::*;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_events_in_random_transactions() -> anyhow::Result<()> {
    let env = Env::start("bulk").await?;
    let topic = "outbox.event.account";
    create_topics(&env.bootstrap(), &[topic], 4).await?;
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;

    let seed: u64 = rand::thread_rng().gen();
    eprintln!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut next_version: HashMap<String, i64> = HashMap::new();
    let mut committed: HashMap<String, (String, i64, serde_json::Value)> = HashMap::new();
    let mut rolled_back: HashSet<String> = HashSet::new();
    let target = 20_000;
    while committed.len() < target {
        let size = rng.gen_range(1..=200).min(target - committed.len());
        let rollback = rng.gen_bool(0.1);
        let mut batch = Vec::with_capacity(size);
        let mut versions = next_version.clone();
        for _ in 0..size {
            let agg = format!("acc-{}", rng.gen_range(0..500));
            let v = versions.entry(agg.clone()).or_insert(0);
            *v += 1;
            batch.push(NewEvent {
                event_id: Uuid::now_v7(),
                aggregate_type: "account".into(),
                aggregate_id: agg,
                version: *v,
                event_type: "Deposited".into(),
                payload: serde_json::json!({"amount": rng.gen_range(1..1000), "n": committed.len()}),
            });
        }
        write_events(&mut c, &batch, rollback).await?;
        for e in batch {
            if rollback {
                rolled_back.insert(e.event_id.to_string());
            } else {
                committed.insert(
                    e.event_id.to_string(),
                    (e.aggregate_id, e.version, e.payload),
                );
            }
        }
        if !rollback {
            next_version = versions;
        }
    }

    let recs = read_topic(&env.bootstrap(), topic, target, Duration::from_secs(120))?;
    let mut seen = HashSet::new();
    let mut last: BTreeMap<String, (i32, i64)> = BTreeMap::new();
    for r in &recs {
        let id = r.header("event_id").to_string();
        assert!(
            !rolled_back.contains(&id),
            "rolled-back event {id} delivered"
        );
        let (agg, version, payload) = committed.get(&id).expect("unknown event on topic");
        assert_eq!(r.key, agg.as_bytes());
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&r.value)?,
            *payload
        );
        let v: i64 = r.header("aggregate_version").parse()?;
        assert_eq!(v, *version);
        if seen.insert(id) {
            if let Some((p, prev)) = last.get(agg) {
                assert_eq!(*p, r.partition, "aggregate {agg} spread over partitions");
                assert!(v > *prev, "aggregate {agg}: version {v} after {prev}");
            }
            last.insert(agg.clone(), (r.partition, v));
        }
    }
    let missing = committed.len() - seen.len();
    assert_eq!(missing, 0, "{missing} committed events missing");
    relay.shutdown().await?;
    Ok(())
}
