//! Benchmark (docs/benchmarks.md, "Duplicates per crash"): how many events a SIGKILLed relay
//! replays under a steady live load, with the default configuration and with the old default
//! status interval (1 s). A crash replays what the broker acknowledged but Postgres had not
//! been told yet, so the figure follows how promptly the confirmed LSN reaches the server.
//! Run: `cargo nextest run -p outboxd-tests --test crash_duplicates --run-ignored only
//! --no-capture`.

use outboxd_tests::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

const KILLS: usize = 5;
/// Events per second written while the relay is killed and restarted.
const RATE: u64 = 1_000;

/// Writes `RATE` events/s in transactions of 10 until `stop`, on its own connection.
async fn paced_writer(
    c: tokio_postgres::Client,
    agg_type: &'static str,
    stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<u64> {
    let started = Instant::now();
    let mut n: u64 = 0;
    while !*stop.borrow() {
        let due = started + Duration::from_micros(n * 1_000_000 / RATE);
        tokio::time::sleep_until(due.into()).await;
        c.execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                                 event_type, payload) \
             SELECT gen_random_uuid(), $1, 'd-' || g, $2::bigint + 1, 'Deposited', \
                    jsonb_build_object('n', g) \
             FROM generate_series(0, 9) g",
            &[&agg_type, &((n / 10) as i64)],
        )
        .await?;
        n += 10;
    }
    Ok(n)
}

/// Duplicates per SIGKILL with `status_interval_ms` (None: the default).
async fn duplicates_per_kill(name: &str, status_ms: Option<u64>) -> anyhow::Result<f64> {
    let env = Env::start(name).await?;
    let toml = match status_ms {
        Some(ms) => env.toml().replace(
            "status_interval_ms = 200",
            &format!("status_interval_ms = {ms}"),
        ),
        None => env.toml().replace("status_interval_ms = 200\n", ""),
    };
    let cfg = env.dir.path().join("dups.toml");
    std::fs::write(&cfg, toml)?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&cfg, log.clone())?;
    let (stop, rx) = tokio::sync::watch::channel(false);
    let agg: &'static str = "dups";
    let writer = tokio::spawn(paced_writer(env.sql().await?, agg, rx));
    tokio::time::sleep(Duration::from_secs(3)).await;
    for _ in 0..KILLS {
        relay.sigkill();
        relay = RelayProcess::spawn(&cfg, log.clone())?;
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let _ = stop.send(true);
    let written = writer.await??;
    env.caught_up(Duration::from_secs(60)).await?;
    let mut seen: HashMap<Vec<u8>, u32> = HashMap::new();
    let total = scan_topic(
        &env.bootstrap(),
        &format!("outbox.event.{agg}"),
        written as usize,
        Duration::from_secs(60),
        |m| {
            use rdkafka::message::{Headers, Message};
            let id = m
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "event_id"))
                .and_then(|h| h.value)
                .unwrap_or_default()
                .to_vec();
            *seen.entry(id).or_default() += 1;
        },
    )?;
    relay.sigterm()?;
    assert_eq!(seen.len() as u64, written, "every event on the topic");
    let dups = total as u64 - written;
    let per_kill = dups as f64 / KILLS as f64;
    println!(
        "{name}: status_interval_ms {}: {written} events written at {RATE}/s, {KILLS} SIGKILLs, \
         {dups} duplicates = {per_kill:.0} per kill",
        status_ms.map_or("default".to_string(), |m| m.to_string())
    );
    Ok(per_kill)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark, see docs/benchmarks.md"]
async fn duplicates_per_sigkill_at_1000_events_per_second() -> anyhow::Result<()> {
    let default = duplicates_per_kill("dups_default", None).await?;
    let old = duplicates_per_kill("dups_1000ms", Some(1000)).await?;
    println!("per kill: default {default:.0}, status_interval_ms = 1000: {old:.0}");
    Ok(())
}
