//! Joining at scale (issue 56, R53): 20 tenants moved into the pattern by `SET SCHEMA`, 100 rows
//! each, within ~10 s, while another tenant streams ~100 events/s. Measured from outside: every
//! row's arrival on its topic (a reader polling live) against its commit. On demand (a
//! measurement, not a property):
//! `cargo nextest run -p outboxd-tests --test join_scale --run-ignored only --no-capture`;
//! the figures go to docs/benchmarks.md ("Joining at scale").

use outboxd_tests::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TENANTS: usize = 20;
const ROWS: i64 = 100;

/// Arrival time of every `event_id` seen on `topics` (read live from the beginning).
type Arrivals = Arc<Mutex<HashMap<String, Instant>>>;

fn reader(bootstrap: String, topic: String, expect: usize, arrivals: Arrivals) {
    std::thread::spawn(move || {
        let _ = scan_topic(&bootstrap, &topic, expect, Duration::from_secs(240), |m| {
            use rdkafka::message::{Headers, Message};
            let now = Instant::now();
            if let Some(h) = m.headers() {
                for hd in h.iter() {
                    if hd.key == "event_id" {
                        let id = String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned();
                        arrivals.lock().unwrap().entry(id).or_insert(now);
                    }
                }
            }
        });
    });
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: joining at scale (docs/benchmarks.md)"]
async fn twenty_tenants_join_while_another_streams() -> anyhow::Result<()> {
    let mut env = Env::start("join_scale").await?;
    env.extra_toml =
        "[[source.tables]]\npattern = \"tenant_%.outbox\"\ntopic = \"tenants.{schema}\"\n".into();
    let mut topics: Vec<String> = (0..TENANTS)
        .map(|i| format!("tenants.tenant_{i:02}"))
        .collect();
    topics.push("tenants.tenant_live".into());
    create_topics(&env.bootstrap(), &topics, 1).await?;
    let c = env.sql().await?;
    c.batch_execute(
        "CREATE SCHEMA tenant_live; \
         CREATE TABLE tenant_live.outbox (LIKE public.outbox INCLUDING ALL)",
    )
    .await?;
    outboxd::init(&env.config()?).await?;
    let relay = Relay::start(env.config()?);
    let arrivals: Arrivals = Arc::default();
    // The live tenant: 20 transactions of 5 rows a second for 45 s.
    let live_n = 45 * 20 * 5;
    reader(
        env.bootstrap(),
        "tenants.tenant_live".into(),
        live_n,
        arrivals.clone(),
    );
    for i in 0..TENANTS {
        reader(
            env.bootstrap(),
            format!("tenants.tenant_{i:02}"),
            ROWS as usize,
            arrivals.clone(),
        );
    }
    let writer_sql = env.sql().await?;
    let writer = tokio::spawn(async move {
        let mut commits: Vec<(String, Instant)> = Vec::new();
        let mut v = 0i64;
        let start = Instant::now();
        for tick in 0..(45 * 20) {
            let due = start + Duration::from_millis(50 * tick);
            tokio::time::sleep_until(due.into()).await;
            let rows = writer_sql
                .query(
                    "INSERT INTO tenant_live.outbox (event_id, aggregate_type, aggregate_id, \
                     aggregate_version, event_type, payload) SELECT gen_random_uuid(), 'acct', \
                     'L' || (g % 10), $1::bigint + g, 'Deposited', '{}' \
                     FROM generate_series(1, 5) g RETURNING event_id::text",
                    &[&v],
                )
                .await?;
            let at = Instant::now();
            v += 5;
            commits.extend(rows.iter().map(|r| (r.get::<_, String>(0), at)));
        }
        anyhow::Ok(commits)
    });
    // Let the live stream settle, then 20 tenants join within ~10 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut tenant_ids: Vec<Vec<String>> = Vec::new();
    let first_join = Instant::now();
    let mut last_join = first_join;
    for i in 0..TENANTS {
        let (stage, tenant) = (format!("staging_{i:02}"), format!("tenant_{i:02}"));
        c.batch_execute(&format!(
            "CREATE SCHEMA {stage}; CREATE TABLE {stage}.outbox (LIKE public.outbox INCLUDING ALL)"
        ))
        .await?;
        let ids: Vec<String> = c
            .query(
                &format!(
                    "INSERT INTO {stage}.outbox (event_id, aggregate_type, aggregate_id, \
                     aggregate_version, event_type, payload) SELECT gen_random_uuid(), 'acct', \
                     'T', g, 'Deposited', '{{}}' FROM generate_series(1, {ROWS}) g \
                     RETURNING event_id::text"
                ),
                &[],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        c.batch_execute(&format!(
            "CREATE SCHEMA {tenant}; ALTER TABLE {stage}.outbox SET SCHEMA {tenant}"
        ))
        .await?;
        last_join = Instant::now();
        tenant_ids.push(ids);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let commits = writer.await??;
    // Every row delivered (up to 3 minutes after the last join).
    let deadline = last_join + Duration::from_secs(180);
    let all_tenant: Vec<&String> = tenant_ids.iter().flatten().collect();
    loop {
        let missing = {
            let a = arrivals.lock().unwrap();
            all_tenant
                .iter()
                .filter(|id| !a.contains_key(id.as_str()))
                .count()
                + commits.iter().filter(|(id, _)| !a.contains_key(id)).count()
        };
        if missing == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{missing} rows never arrived");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    relay.shutdown().await?;
    let a = arrivals.lock().unwrap();
    let last_tenant = all_tenant.iter().map(|id| a[id.as_str()]).max().unwrap();
    let window = |from: Instant, to: Instant| {
        let mut d: Vec<Duration> = commits
            .iter()
            .filter(|(_, t)| *t >= from && *t <= to)
            .map(|(id, t)| a[id].saturating_duration_since(*t))
            .collect();
        d.sort();
        d
    };
    let before = window(first_join - Duration::from_secs(5), first_join);
    let during = window(first_join, last_join + Duration::from_secs(30));
    eprintln!(
        "joining at scale: {TENANTS} tenants x {ROWS} rows joined within {:.1} s; every row \
         delivered; last tenant row {:.1} s after the last join; live tenant commit->arrival \
         before the joins p50 {:?} p99 {:?} ({} events); from the first join to 30 s after the \
         last p50 {:?} p99 {:?} max {:?} ({} events)",
        (last_join - first_join).as_secs_f64(),
        last_tenant
            .saturating_duration_since(last_join)
            .as_secs_f64(),
        pct(&before, 0.5),
        pct(&before, 0.99),
        before.len(),
        pct(&during, 0.5),
        pct(&during, 0.99),
        during.last().copied().unwrap_or_default(),
        during.len()
    );
    Ok(())
}
