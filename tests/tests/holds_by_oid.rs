//! Holds and heads keyed by the table's oid (issue 56, R53): a tenant renamed or moved within
//! a pattern while a head of its aggregate is parked keeps its holds, in order, and its head is
//! released from the table wherever it is now; two tenants that swap names never swap holds.
//!
//! Each test runs with `pattern = "tenant_%.outbox"`, every tenant to one topic of one
//! partition (so the order of an aggregate's records across a rename is the topic's order), and
//! a broker that refuses records over 20,000 bytes: a big payload is poison (`too_large`),
//! parked, and retried with a small corrected payload.

use outboxd_tests::*;
use std::time::{Duration, Instant};

const PATTERN_TOML: &str = r#"
[[source.tables]]
pattern = "tenant_%.outbox"
topic = "tenants.events"
"#;

const TOPIC: &str = "tenants.events";

/// Version `v` of aggregate `agg` into `table` (`big`: a payload the broker refuses); its
/// event id.
async fn write(
    c: &tokio_postgres::Client,
    table: &str,
    agg: &str,
    v: i64,
    big: bool,
) -> anyhow::Result<String> {
    let blob = if big {
        "x".repeat(30_000)
    } else {
        String::new()
    };
    let row = c
        .query_one(
            &format!(
                "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, aggregate_version, \
                 event_type, payload) VALUES (gen_random_uuid(), 'acct', $1, $2, 'Deposited', \
                 jsonb_build_object('v', $2::bigint, 'blob', $3::text)) RETURNING event_id::text"
            ),
            &[&agg, &v, &blob],
        )
        .await?;
    Ok(row.get(0))
}

/// `(event_id, state, error_class)` of every parked row, oldest first.
async fn parked(c: &tokio_postgres::Client) -> anyhow::Result<Vec<(String, String, String)>> {
    Ok(c.query(
        "SELECT event_id, state, error_class FROM outbox_parked ORDER BY id",
        &[],
    )
    .await?
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect())
}

async fn wait_parked(c: &tokio_postgres::Client, n: usize) -> anyhow::Result<()> {
    eventually(Duration::from_secs(30), || async {
        Ok(parked(c).await?.len() >= n)
    })
    .await
}

/// The event ids on the topic, in its order (one partition). Off the runtime's worker.
fn on_topic(env: &Env, min: usize) -> anyhow::Result<Vec<String>> {
    tokio::task::block_in_place(|| {
        let recs = read_topic(&env.bootstrap(), TOPIC, min, Duration::from_secs(3))?;
        Ok(recs
            .iter()
            .map(|r| r.header("event_id").to_string())
            .collect())
    })
}

/// Waits until every id of `want` is on the topic (up to 40 s); the topic's ids, in order.
fn wait_on_topic(env: &Env, want: &[&String]) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let got = on_topic(env, want.len())?;
        if want.iter().all(|w| got.contains(w)) || Instant::now() > deadline {
            return Ok(got);
        }
    }
}

/// `ids` appear on the topic in this order, each exactly once.
fn in_order(got: &[String], ids: &[&String]) {
    let seen: Vec<&String> = got.iter().filter(|g| ids.contains(g)).collect();
    assert_eq!(seen, ids, "on the topic: {got:?}");
}

/// A pattern environment with `tenants` created, `init` run as a superuser (the event
/// trigger installed) and a relay streaming them.
async fn streaming(
    name: &str,
    tenants: &[&str],
) -> anyhow::Result<(Env, tokio_postgres::Client, Relay)> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("outboxd=info")
        .try_init();
    let mut env = Env::start(name).await?;
    env.extra_toml = PATTERN_TOML.into();
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    create_topics(&env.bootstrap(), &[TOPIC.to_string()], 1).await?;
    let c = env.sql().await?;
    for t in tenants {
        c.batch_execute(&format!(
            "CREATE SCHEMA {t}; CREATE TABLE {t}.outbox (LIKE public.outbox INCLUDING ALL)"
        ))
        .await?;
    }
    outboxd::init(&env.config()?).await?;
    let relay = Relay::start(env.config()?);
    let first = write(&c, &format!("{}.outbox", tenants[0]), "warmup", 1, false).await?;
    wait_on_topic(&env, &[&first])?;
    Ok((env, c, relay))
}

/// `outboxd parked retry <id>` with a small corrected payload.
fn retry(env: &Env, id: &str, v: i64) -> anyhow::Result<()> {
    let p = env.dir.path().join(format!("fix-{id}.json"));
    std::fs::write(&p, format!("{{\"v\": {v}}}"))?;
    let config = env.config_file()?;
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "retry",
            id,
            "--payload",
            &p.display().to_string(),
            "--reason",
            "fixed",
        ],
        &config,
    );
    assert_eq!(code, 0, "{out}");
    Ok(())
}

/// Aggregate A's v1 in tenant_a is parked, v2 and v3 held behind it; then tenant_a's table
/// moves to schema tenant_c (still matched) and v4 is written there. v4 is held behind v1 (it
/// does not overtake it), and the retry of v1 releases v1..v4 in order, v1 read from the
/// table where it is now. Before: v4 went out first, and v1 stayed parked as `unknown_table`
/// (its record named tenant_a.outbox, which no longer exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_moved_within_the_pattern_keeps_its_holds() -> anyhow::Result<()> {
    let (env, c, relay) = streaming("oid_move", &["tenant_a", "tenant_b"]).await?;
    let v1 = write(&c, "tenant_a.outbox", "A", 1, true).await?;
    wait_parked(&c, 1).await?;
    let v2 = write(&c, "tenant_a.outbox", "A", 2, false).await?;
    let v3 = write(&c, "tenant_a.outbox", "A", 3, false).await?;
    wait_parked(&c, 3).await?;
    // Another tenant's A is not held.
    let b1 = write(&c, "tenant_b.outbox", "A", 1, false).await?;
    wait_on_topic(&env, &[&b1])?;

    c.batch_execute("CREATE SCHEMA tenant_c; ALTER TABLE tenant_a.outbox SET SCHEMA tenant_c")
        .await?;
    let v4 = write(&c, "tenant_c.outbox", "A", 4, false).await?;
    let b2 = write(&c, "tenant_b.outbox", "A", 2, false).await?;
    let got = wait_on_topic(&env, &[&b2])?;
    assert!(
        !got.contains(&v4),
        "v4 overtook the parked v1: {got:?}, parked {:?}",
        parked(&c).await?
    );
    wait_parked(&c, 4).await?;
    let states = parked(&c).await?;
    assert_eq!(
        states
            .iter()
            .map(|(id, s, _)| (id.clone(), s.clone()))
            .collect::<Vec<_>>(),
        [
            (v1.clone(), "parked".to_string()),
            (v2.clone(), "blocked".into()),
            (v3.clone(), "blocked".into()),
            (v4.clone(), "blocked".into()),
        ]
    );

    retry(&env, &v1, 1)?;
    let got = wait_on_topic(&env, &[&v1, &v2, &v3, &v4])?;
    in_order(&got, &[&v1, &v2, &v3, &v4]);
    let states = parked(&c).await?;
    assert!(
        states.iter().all(|(_, s, _)| s == "delivered"),
        "{states:?}"
    );
    let recs = tokio::task::block_in_place(|| {
        read_topic(&env.bootstrap(), TOPIC, got.len(), Duration::from_secs(2))
    })?;
    let v1_rec = recs.iter().find(|r| r.header("event_id") == v1).unwrap();
    assert_eq!(v1_rec.header("source_table"), "tenant_c.outbox");
    assert!(!relay.is_finished(), "the relay kept running");
    relay.shutdown().await?;
    Ok(())
}

/// tenant_a and tenant_b each have a parked head of aggregate A and a version held behind
/// it; then they swap names in one transaction. New versions written under the new names
/// wait behind their own table's head, not the other's; retrying one table's head releases
/// that table's versions in order (read from its rows, wherever they are now) and the other
/// table's stay held until its own head is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_swapping_names_never_swap_holds() -> anyhow::Result<()> {
    let (env, c, relay) = streaming("oid_swap", &["tenant_a", "tenant_b"]).await?;
    // x: the table named tenant_a at first; y: tenant_b.
    let x1 = write(&c, "tenant_a.outbox", "A", 1, true).await?;
    let y1 = write(&c, "tenant_b.outbox", "A", 1, true).await?;
    wait_parked(&c, 2).await?;
    let x2 = write(&c, "tenant_a.outbox", "A", 2, false).await?;
    let y2 = write(&c, "tenant_b.outbox", "A", 2, false).await?;
    wait_parked(&c, 4).await?;

    c.batch_execute(
        "BEGIN; CREATE SCHEMA tenant_tmp; \
         ALTER TABLE tenant_a.outbox SET SCHEMA tenant_tmp; \
         ALTER TABLE tenant_b.outbox SET SCHEMA tenant_a; \
         ALTER TABLE tenant_tmp.outbox SET SCHEMA tenant_b; COMMIT",
    )
    .await?;
    let x3 = write(&c, "tenant_b.outbox", "A", 3, false).await?;
    let y3 = write(&c, "tenant_a.outbox", "A", 3, false).await?;
    wait_parked(&c, 6).await?;
    let states = parked(&c).await?;
    let state = |id: &String| {
        states
            .iter()
            .find(|(e, _, _)| e == id)
            .map(|(_, s, _)| s.clone())
    };
    assert_eq!(state(&x3).as_deref(), Some("blocked"), "{states:?}");
    assert_eq!(state(&y3).as_deref(), Some("blocked"), "{states:?}");

    // x's head: x's versions go out, in order; y's stay held.
    retry(&env, &x1, 1)?;
    let got = wait_on_topic(&env, &[&x1, &x2, &x3])?;
    in_order(&got, &[&x1, &x2, &x3]);
    for y in [&y1, &y2, &y3] {
        assert!(!got.contains(y), "{y} went out behind x's head: {got:?}");
    }
    let recs = tokio::task::block_in_place(|| {
        read_topic(&env.bootstrap(), TOPIC, got.len(), Duration::from_secs(2))
    })?;
    let table = |id: &String| {
        recs.iter()
            .find(|r| r.header("event_id") == *id)
            .map(|r| r.header("source_table").to_string())
    };
    assert_eq!(table(&x1).as_deref(), Some("tenant_b.outbox"));
    assert_eq!(table(&x3).as_deref(), Some("tenant_b.outbox"));

    retry(&env, &y1, 1)?;
    let got = wait_on_topic(&env, &[&y1, &y2, &y3])?;
    in_order(&got, &[&y1, &y2, &y3]);
    let states = parked(&c).await?;
    assert!(
        states.iter().all(|(_, s, _)| s == "delivered"),
        "{states:?}"
    );
    assert!(!relay.is_finished(), "the relay kept running");
    relay.shutdown().await?;
    Ok(())
}

/// The same move while the relay is stopped: the next session finds the table under its new
/// name, reads its holds by oid from the parked store, holds v3 behind v1 and releases v1..v3
/// in order from the table's new name; `parked list` names the table as it is now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_moved_while_the_relay_is_stopped_keeps_its_holds() -> anyhow::Result<()> {
    let (env, c, relay) = streaming("oid_restart", &["tenant_a", "tenant_b"]).await?;
    let v1 = write(&c, "tenant_a.outbox", "A", 1, true).await?;
    wait_parked(&c, 1).await?;
    let v2 = write(&c, "tenant_a.outbox", "A", 2, false).await?;
    wait_parked(&c, 2).await?;
    env.confirmed_past_now(Duration::from_secs(10)).await?;
    relay.shutdown().await?;

    c.batch_execute("CREATE SCHEMA tenant_c; ALTER TABLE tenant_a.outbox SET SCHEMA tenant_c")
        .await?;
    let relay = Relay::start(env.config()?);
    let v3 = write(&c, "tenant_c.outbox", "A", 3, false).await?;
    let b1 = write(&c, "tenant_b.outbox", "A", 1, false).await?;
    let got = wait_on_topic(&env, &[&b1])?;
    assert!(!got.contains(&v3), "v3 overtook the parked v1: {got:?}");
    wait_parked(&c, 3).await?;
    let (code, list) = outboxd_cli(&["parked", "list"], &env.config_file()?);
    assert_eq!(code, 0, "{list}");
    assert!(
        list.contains("tenant_c.outbox") && !list.contains("tenant_a.outbox"),
        "{list}"
    );

    retry(&env, &v1, 1)?;
    let got = wait_on_topic(&env, &[&v1, &v2, &v3])?;
    in_order(&got, &[&v1, &v2, &v3]);
    let states = parked(&c).await?;
    assert!(
        states.iter().all(|(_, s, _)| s == "delivered"),
        "{states:?}"
    );
    assert!(!relay.is_finished(), "the relay kept running");
    relay.shutdown().await?;
    Ok(())
}
