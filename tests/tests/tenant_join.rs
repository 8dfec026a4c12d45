//! Tenants that join a `pattern` by the routes issue 39 found lossy (R46): a table renamed or
//! moved into a match, a partitioned outbox, a partition attached while streaming, and a
//! delete-after-insert tenant that joins late without the event trigger. Each sequence runs
//! with `pattern = "tenant_%.outbox"` and the event trigger installed by a superuser `init`
//! while a relay streams another tenant, and is measured from outside: the distinct
//! `event_id`s on the tenant's topic (duplicates allowed, loss not).
//! The design and the catalog facts behind it: crates/outboxd/src/slot/join.rs.

use outboxd_tests::*;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Every `tenant_*` schema's `outbox`, each tenant to its own topic.
const PATTERN_TOML: &str = r#"
[[source.tables]]
pattern = "tenant_%.outbox"
topic = "tenants.{schema}"
"#;

/// `n` rows of aggregate `agg` (versions `from..from+n`) into `table`, in one statement.
/// Returns their event ids.
async fn rows(
    c: &impl tokio_postgres::GenericClient,
    table: &str,
    agg: &str,
    aggregate_type: &str,
    from: i64,
    n: i64,
) -> anyhow::Result<Vec<String>> {
    let q = format!(
        "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, aggregate_version, \
         event_type, payload) SELECT gen_random_uuid(), $1, $2, g, 'Deposited', \
         jsonb_build_object('v', g) FROM generate_series($3::bigint, $4::bigint) g \
         RETURNING event_id::text"
    );
    let out = c
        .query(&q, &[&aggregate_type, &agg, &from, &(from + n - 1)])
        .await?;
    Ok(out.iter().map(|r| r.get(0)).collect())
}

/// The ids of `want` that are not on `topic` after up to 40 s of reading; asserts every record
/// there names `table` in `source_table`.
fn missing(env: &Env, topic: &str, table: &str, want: &[String]) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let recs = read_topic(&env.bootstrap(), topic, want.len(), Duration::from_secs(2))?;
        for r in &recs {
            assert_eq!(r.header("source_table"), table, "{r:?}");
        }
        let got: HashSet<&str> = recs.iter().map(|r| r.header("event_id")).collect();
        let left: Vec<String> = want
            .iter()
            .filter(|id| !got.contains(id.as_str()))
            .cloned()
            .collect();
        if left.is_empty() || Instant::now() > deadline {
            return Ok(left);
        }
    }
}

/// Asserts every id of `want` arrived on `topic` (from `table`), naming how many did not.
fn all_delivered(env: &Env, topic: &str, table: &str, want: &[String]) -> anyhow::Result<()> {
    let left = missing(env, topic, table, want)?;
    assert!(
        left.is_empty(),
        "{table}: {} of {} delivered ({} missing)",
        want.len() - left.len(),
        want.len(),
        left.len()
    );
    Ok(())
}

/// A pattern environment with `tenant_a` created, `init` run as a superuser (the event trigger
/// installed) and a relay streaming it: events flow on `tenant_a` while each test's tenant
/// joins.
async fn streaming(
    name: &str,
    tenants: &[&str],
) -> anyhow::Result<(Env, tokio_postgres::Client, Relay)> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("outboxd=info")
        .try_init();
    let mut env = Env::start(name).await?;
    env.extra_toml = PATTERN_TOML.into();
    let mut topics: Vec<String> = tenants.iter().map(|t| format!("tenants.{t}")).collect();
    topics.push("tenants.tenant_a".into());
    create_topics(&env.bootstrap(), &topics, 2).await?;
    let c = env.sql().await?;
    c.batch_execute(
        "CREATE SCHEMA tenant_a; CREATE TABLE tenant_a.outbox (LIKE public.outbox INCLUDING ALL)",
    )
    .await?;
    let done = outboxd::init(&env.config()?).await?;
    assert!(
        done.iter()
            .any(|l| l.contains("event trigger outboxd_join_outbox_pub installed")),
        "{done:?}"
    );
    let relay = Relay::start(env.config()?);
    let a = rows(&c, "tenant_a.outbox", "A", "acct", 1, 5).await?;
    all_delivered(&env, "tenants.tenant_a", "tenant_a.outbox", &a)?;
    Ok((env, c, relay))
}

/// Events keep flowing on `tenant_a` (from version `from`) and all arrive.
async fn tenant_a_flows(env: &Env, c: &tokio_postgres::Client, from: i64) -> anyhow::Result<()> {
    let a = rows(c, "tenant_a.outbox", "A", "acct", from, 5).await?;
    all_delivered(env, "tenants.tenant_a", "tenant_a.outbox", &a)
}

/// `CREATE TABLE tenant_b.outbox_new`, 300 rows, `RENAME TO outbox`, 100 rows: the rename's
/// transaction rewrites the table's type row and adds it to the publication (the trigger),
/// so the type row no longer says the rows predate the join. Before: 100/400 delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_renamed_into_the_pattern_delivers_the_rows_it_held() -> anyhow::Result<()> {
    let (env, c, relay) = streaming("join_rename", &["tenant_b"]).await?;
    c.batch_execute(
        "CREATE SCHEMA tenant_b; \
         CREATE TABLE tenant_b.outbox_new (LIKE public.outbox INCLUDING ALL)",
    )
    .await?;
    let mut ids = rows(&c, "tenant_b.outbox_new", "B", "acct", 1, 300).await?;
    c.batch_execute("ALTER TABLE tenant_b.outbox_new RENAME TO outbox")
        .await?;
    ids.extend(rows(&c, "tenant_b.outbox", "B", "acct", 301, 100).await?);
    all_delivered(&env, "tenants.tenant_b", "tenant_b.outbox", &ids)?;
    tenant_a_flows(&env, &c, 6).await?;
    assert!(!relay.is_finished(), "the relay kept running");
    relay.shutdown().await?;
    Ok(())
}

/// A table in schema `staging`, 300 rows, `SET SCHEMA tenant_c`. Before: 0/300 delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_moved_into_the_pattern_delivers_the_rows_it_held() -> anyhow::Result<()> {
    let (env, c, relay) = streaming("join_move", &["tenant_c"]).await?;
    c.batch_execute(
        "CREATE SCHEMA staging; CREATE SCHEMA tenant_c; \
         CREATE TABLE staging.outbox (LIKE public.outbox INCLUDING ALL)",
    )
    .await?;
    let ids = rows(&c, "staging.outbox", "C", "acct", 1, 300).await?;
    c.batch_execute("ALTER TABLE staging.outbox SET SCHEMA tenant_c")
        .await?;
    all_delivered(&env, "tenants.tenant_c", "tenant_c.outbox", &ids)?;
    tenant_a_flows(&env, &c, 6).await?;
    assert!(!relay.is_finished(), "the relay kept running");
    relay.shutdown().await?;
    Ok(())
}
