//! Issue 26, item 4: a fenced holder cannot append after the new holder. The active relay holds
//! records in librdkafka's queue (a long `linger.ms`) when it is frozen with SIGSTOP; a standby
//! fences it, takes the slot and delivers newer versions of the same aggregates; then the frozen
//! one is thawed. With `relay.broker_fencing` the standby's producer took over the frozen one's
//! `transactional.id` before sending anything, so the broker refuses what the thawed one's
//! librdkafka sends: per key, versions never go back on the topic and the last record is the
//! newest version (what a compacted topic keeps).

use outboxd_tests::reliability::*;
use outboxd_tests::*;
use std::collections::BTreeMap;
use std::time::Duration;

const TOPIC: &str = "outbox.event.acct";
const AGGREGATES: i64 = 30;

fn signal(p: &RelayProcess, sig: i32) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(p.child.id() as i32, sig) };
}

/// One committed transaction with version `v` of every aggregate; returns its LSN.
async fn write_version(env: &Env, v: i64) -> anyhow::Result<u64> {
    let mut c = env.sql().await?;
    let events: Vec<NewEvent> = (0..AGGREGATES)
        .map(|a| {
            let payload = serde_json::json!({ "v": v });
            NewEvent::new("acct", &format!("acct-{a}"), v, "Deposited", payload)
        })
        .collect();
    write_events_returning_lsn(&mut c, &events).await
}

/// Per partition, in offset order: (key, version). Fails on a key whose version goes back.
fn versions_never_go_back(records: &[Record]) -> Result<BTreeMap<Vec<u8>, i64>, String> {
    let mut by_partition: BTreeMap<i32, Vec<&Record>> = BTreeMap::new();
    for r in records {
        by_partition.entry(r.partition).or_default().push(r);
    }
    let mut last = BTreeMap::new();
    for (p, mut rs) in by_partition {
        rs.sort_by_key(|r| r.offset);
        for r in rs {
            let v: i64 = r.header("aggregate_version").parse().unwrap_or(-1);
            let prev = last.insert(r.key.clone(), v).unwrap_or(0);
            if v < prev {
                return Err(format!(
                    "partition {p}, key {}: version {v} at offset {} after version {prev}",
                    String::from_utf8_lossy(&r.key),
                    r.offset
                ));
            }
        }
    }
    Ok(last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thawed_holder_appends_nothing_after_the_new_holder() -> anyhow::Result<()> {
    let mut env = Env::start("fence_zombie").await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    if std::env::var_os("ZOMBIE_NO_BROKER_FENCING").is_none() {
        env.extra_toml = "broker_fencing = true".into();
    }
    // The first holder keeps its records in librdkafka's queue for 3 s before sending them.
    let lingering = env.dir.path().join("lingering.toml");
    std::fs::write(
        &lingering,
        env.toml()
            .replace("\"linger.ms\" = \"2\"", "\"linger.ms\" = \"3000\""),
    )?;
    let prompt = env.config_file()?;
    let sql = env.sql().await?;
    let mut relays = vec![RelayProcess::spawn(
        &lingering,
        env.dir.path().join("relay-0.log"),
    )?];
    wait_for_active(&sql, &env.slot, &relays, None, Duration::from_secs(30)).await?;
    relays.push(RelayProcess::spawn(
        &prompt,
        env.dir.path().join("relay-1.log"),
    )?);
    let v1 = write_version(&env, 1).await?;
    eventually(Duration::from_secs(30), || async {
        Ok(env.confirmed_lsn().await? > v1)
    })
    .await?;

    // Version 2 is read and handed to librdkafka, which lingers on it: freeze the holder then.
    let v2 = write_version(&env, 2).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&relays[0], libc::SIGSTOP);
    assert!(
        env.confirmed_lsn().await? <= v2,
        "version 2 was acknowledged before the freeze: nothing was queued"
    );
    let next = wait_for_active(
        &sql,
        &env.slot,
        &relays,
        Some(relays[0].child.id()),
        Duration::from_secs(30),
    )
    .await?;
    assert_eq!(next, 1);
    // The new holder delivers version 2 again, then version 3.
    let v3 = write_version(&env, 3).await?;
    eventually(Duration::from_secs(30), || async {
        Ok(env.confirmed_lsn().await? > v3)
    })
    .await?;

    // Thawed, the old holder's librdkafka sends what it queued at once.
    signal(&relays[0], libc::SIGCONT);
    let thawed = relays[0].log.clone();
    eventually(Duration::from_secs(30), || async {
        Ok(read_log(&thawed).contains("role=\"standby\""))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(4)).await;

    let records = read_topic(
        &env.bootstrap(),
        TOPIC,
        (AGGREGATES * 3) as usize,
        Duration::from_secs(20),
    )?;
    let last = versions_never_go_back(&records).map_err(|e| {
        anyhow::anyhow!(
            "{e}\n--- old holder:\n{}\n--- new holder:\n{}",
            read_log(&relays[0].log),
            read_log(&relays[1].log)
        )
    })?;
    assert_eq!(last.len(), AGGREGATES as usize);
    assert!(last.values().all(|v| *v == 3), "{last:?}");
    eprintln!("{} records; every key ends at version 3", records.len());
    for l in read_log(&relays[0].log)
        .lines()
        .filter(|l| l.contains("fence") || l.contains("transaction"))
        .take(3)
    {
        eprintln!("thawed: {}", &l[..l.len().min(300)]);
    }
    Ok(())
}
