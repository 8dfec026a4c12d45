//! Memory does not grow with transaction size: a single 1,000,000-row transaction streams through
//! a real relay process whose peak RSS stays bounded (asserted on memory, never on time).

use outboxd_tests::*;
use rdkafka::message::{Headers, Message};
use std::time::Duration;

fn peak_rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn million_row_transaction_with_bounded_rss() -> anyhow::Result<()> {
    const ROWS: i64 = 1_000_000;
    let env = Env::start("bigtxn").await?;
    create_topics(&env.bootstrap(), &["outbox.event.big"], 3).await?;
    let mut relay = RelayProcess::spawn(&env.config_file()?, env.dir.path().join("relay.log"))?;
    let c = env.sql().await?;
    c.batch_execute(&format!(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
         SELECT gen_random_uuid(), 'big', 'agg-' || (i % 1000), i, 'Big', \
                jsonb_build_object('i', i, 'pad', repeat('p', 100)) \
         FROM generate_series(1, {ROWS}) AS i"
    ))
    .await?;
    let end = env.current_lsn().await?;
    eventually(Duration::from_secs(600), || async {
        Ok(env.confirmed_lsn().await? >= end)
    })
    .await?;
    let rss_mib = peak_rss_kib(relay.child.id()) / 1024;
    let status = relay.sigterm()?;
    assert!(status.success());

    // Every row is on the topic, once per version (read back, counted without keeping them).
    let mut versions = vec![false; ROWS as usize + 1];
    scan_topic(
        &env.bootstrap(),
        "outbox.event.big",
        ROWS as usize,
        Duration::from_secs(600),
        |m| {
            let v = m
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "aggregate_version"))
                .and_then(|h| {
                    std::str::from_utf8(h.value.unwrap_or_default())
                        .ok()?
                        .parse::<usize>()
                        .ok()
                })
                .unwrap_or(0);
            versions[v] = true;
        },
    )?;
    let missing = versions[1..].iter().filter(|seen| !**seen).count();
    assert_eq!(
        missing, 0,
        "{missing} of {ROWS} rows missing from the topic"
    );
    eprintln!("1M-row transaction: relay peak RSS {rss_mib} MiB");
    assert!(
        rss_mib < 64,
        "relay peak RSS {rss_mib} MiB grows with transaction size"
    );
    Ok(())
}
