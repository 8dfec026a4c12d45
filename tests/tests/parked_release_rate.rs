//! Benchmark (issue 55, `#[ignore]`): how fast the relay releases parked and held events.
//!
//! 1. One poison with `PARKED_BENCH_ROWS - 1` (default 9,999) events of its aggregate held
//!    behind it, every row tagged (`[parked] key`): one `parked retry` of the poison, then the
//!    time until every row is delivered, in version order on the topic.
//! 2. The same number of parked heads, one per aggregate: `parked retry --all` (one
//!    transaction) and the time until every row is delivered.
//!
//! `PARKED_BENCH_SECS` (default 600) caps each wait: a slower release reports the rate of what
//! it delivered by then. Run:
//! `cargo nextest run -p outboxd-tests --test parked_release_rate --run-ignored only --no-capture`
//! (figures in docs/benchmarks.md, "Parked releases").

use outboxd_tests::*;
use std::time::{Duration, Instant};

const ACCT: &str = "outbox.event.acct";
const KEY: &str = "test-only-parked-integrity-key-0123456789abcdef";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `amount` must be an integer (`strict`) or anything.
fn schema(dir: &std::path::Path, strict: bool) -> anyhow::Result<()> {
    let amount = if strict {
        r#"{"type": "integer"}"#
    } else {
        "{}"
    };
    std::fs::create_dir_all(dir.join("Deposited"))?;
    std::fs::write(
        dir.join("Deposited").join("1.json"),
        format!(
            r#"{{"type": "object", "required": ["amount"], "properties": {{"amount": {amount}}}}}"#
        ),
    )?;
    Ok(())
}

fn relay(env: &Env) -> anyhow::Result<Relay> {
    Ok(Relay::start(outboxd::Config::from_toml_and_env(
        &env.toml(),
        [("OUTBOXD_PARKED_KEY".to_string(), KEY.to_string())],
    )?))
}

async fn count(c: &tokio_postgres::Client, state: &str) -> anyhow::Result<i64> {
    Ok(c.query_one(
        "SELECT count(*) FROM outbox_parked WHERE state = $1",
        &[&state],
    )
    .await?
    .get(0))
}

/// Waits until `want` more rows are delivered than `before`; returns (delivered, elapsed).
async fn released(
    c: &tokio_postgres::Client,
    before: i64,
    want: i64,
    cap: Duration,
) -> anyhow::Result<(i64, Duration)> {
    let t = Instant::now();
    loop {
        let n = count(c, "delivered").await? - before;
        if n >= want || t.elapsed() >= cap {
            return Ok((n, t.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn rate(n: i64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// The candidates of a release batch (crates/outboxd/src/poison/store/release.rs,
/// `candidates_sql`, one table: no `source_table` header), for EXPLAIN.
const RELEASE: &str = "SELECT p.id, \
    (SELECT h.id FROM outbox_parked h \
      WHERE h.slot = p.slot AND h.aggregate_type = p.aggregate_type \
        AND h.aggregate_id = p.aggregate_id AND h.id < p.id AND h.blocks_aggregate \
        AND h.state IN ('parked', 'blocked', 'retry') \
        AND (h.state IN ('parked', 'retry') OR p.state = 'blocked') \
      ORDER BY h.id DESC LIMIT 1), \
    octet_length(p.payload) \
 FROM outbox_parked p \
 LEFT JOIN outbox_parked_audit a ON p.state = 'retry' AND a.id = p.retry_audit_id \
      AND a.slot = p.slot AND a.event_id = p.event_id AND a.action = 'retry' \
 WHERE p.slot = $1 AND p.state IN ('blocked', 'retry') AND (p.state = 'blocked' OR a.id IS NOT NULL) \
   AND NOT EXISTS (SELECT 1 FROM outbox_parked x \
       WHERE x.slot = p.slot AND x.aggregate_type = p.aggregate_type \
         AND x.aggregate_id = p.aggregate_id AND x.id < p.id AND x.blocks_aggregate \
         AND x.state IN ('parked', 'retry') \
         AND (x.state = 'parked' OR NOT EXISTS (SELECT 1 FROM outbox_parked_audit xa \
              WHERE xa.id = x.retry_audit_id AND xa.slot = x.slot \
                AND xa.event_id = x.event_id AND xa.action = 'retry')) OFFSET 0) \
 ORDER BY p.id LIMIT 1000";

async fn explain(c: &tokio_postgres::Client, what: &str, sql: &str) -> anyhow::Result<()> {
    let plan: Vec<String> = c
        .query(&format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"), &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    eprintln!("-- {what}\n{}", plan.join("\n"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: docs/benchmarks.md, Parked releases"]
async fn release_rate_with_ten_thousand_open_rows() -> anyhow::Result<()> {
    let rows = env_or("PARKED_BENCH_ROWS", 10_000) as i64;
    let cap = Duration::from_secs(env_or("PARKED_BENCH_SECS", 600));
    let mut env = Env::start("parked_rate").await?;
    let schemas = env.dir.path().join("schemas");
    schema(&schemas, true)?;
    env.extra_toml = format!(
        "repair_interval_ms = 200\n[validation]\nschema_dir = \"{}\"\n",
        schemas.display()
    );
    create_topics(&env.bootstrap(), &[ACCT], 1).await?;
    let r = relay(&env)?;
    let mut c = env.sql().await?;

    // 1. One poison (a string amount), every later event of its aggregate held behind it.
    let t = Instant::now();
    let poison = NewEvent::new(
        "acct",
        "A",
        1,
        "Deposited",
        serde_json::json!({"amount": "1"}),
    );
    let poison_id = poison.event_id.to_string();
    write_events(&mut c, &[poison], false).await?;
    let mut v = 2;
    while v <= rows {
        let chunk: Vec<NewEvent> = (v..=(v + 999).min(rows))
            .map(|v| {
                NewEvent::new(
                    "acct",
                    "A",
                    v,
                    "Deposited",
                    serde_json::json!({"amount": v}),
                )
            })
            .collect();
        v += chunk.len() as i64;
        write_events(&mut c, &chunk, false).await?;
    }
    env.caught_up(Duration::from_secs(600)).await?;
    eventually(Duration::from_secs(600), || async {
        Ok(count(&c, "blocked").await? == rows - 1)
    })
    .await?;
    eprintln!(
        "parked 1 poison + {} held (tagged) in {:?}",
        rows - 1,
        t.elapsed()
    );
    let release_sql = RELEASE.replace("$1", &format!("'{}'", env.slot));
    explain(&c, "next releases, 10,000 open", &release_sql).await?;

    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"amount": 1}"#)?;
    let cfg = env.config_file()?;
    let args = [
        "parked",
        "retry",
        &poison_id,
        "--payload",
        fixed.to_str().unwrap_or_default(),
        "--reason",
        "bench",
    ];
    let (code, out) = outboxd_cli(&args, &cfg);
    assert_eq!(code, 0, "{out}");
    let (n, took) = released(&c, 0, rows, cap).await?;
    eprintln!(
        "BENCH chain: released {n} of {rows} (1 retried poison + held) in {took:.2?}: {:.0} events/s",
        rate(n, took)
    );
    if n == rows {
        let recs = read_topic(
            &env.bootstrap(),
            ACCT,
            rows as usize,
            Duration::from_secs(120),
        )?;
        let versions: Vec<i64> = recs
            .iter()
            .map(|r| r.header("aggregate_version").parse().unwrap_or(-1))
            .collect();
        assert_eq!(versions, (1..=rows).collect::<Vec<_>>(), "in version order");
    }
    explain(&c, "next releases, all delivered", &release_sql).await?;
    r.shutdown().await?;

    // 2. As many parked heads, one per aggregate: one `retry --all`.
    let r = relay(&env)?;
    let before = count(&c, "delivered").await?;
    let t = Instant::now();
    let mut a = 0;
    while a < rows {
        let chunk: Vec<NewEvent> = (a..(a + 1000).min(rows))
            .map(|a| {
                NewEvent::new(
                    "acct",
                    &format!("H{a}"),
                    1,
                    "Deposited",
                    serde_json::json!({"amount": "x"}),
                )
            })
            .collect();
        a += chunk.len() as i64;
        write_events(&mut c, &chunk, false).await?;
    }
    env.caught_up(Duration::from_secs(600)).await?;
    eventually(Duration::from_secs(600), || async {
        Ok(count(&c, "parked").await? == rows)
    })
    .await?;
    eprintln!("parked {rows} heads in {:?}", t.elapsed());
    r.shutdown().await?;
    schema(&schemas, false)?;
    let r = relay(&env)?;
    let t = Instant::now();
    let (code, out) = outboxd_cli(&["parked", "retry", "--all", "--reason", "bench"], &cfg);
    assert_eq!(code, 0, "{out}");
    eprintln!(
        "BENCH retry --all of {rows} parked heads: {:.2?}",
        t.elapsed()
    );
    explain(&c, "next releases, every head retried", &release_sql).await?;
    let (n, took) = released(&c, before, rows, cap).await?;
    eprintln!(
        "BENCH heads: released {n} of {rows} after retry --all in {took:.2?}: {:.0} events/s",
        rate(n, took)
    );
    r.shutdown().await?;
    Ok(())
}
