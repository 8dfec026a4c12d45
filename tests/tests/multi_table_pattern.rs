//! New tenants without a restart (issue 30, R44): a `[[source.tables]]` entry with `pattern`
//! relays every table it matches, including tables that appear while the relay runs, and
//! what a table held before it joined the publication is republished, exactly
//! (crates/outboxd/src/slot/join.rs has the design and the measurements behind it).

use outboxd_tests::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

/// Every `tenant_*` schema's `outbox`, each tenant to its own topic.
const PATTERN_TOML: &str = r#"
[[source.tables]]
pattern = "tenant_%.outbox"
topic = "tenants.{schema}"
"#;

/// Inserts `n` events of aggregate `agg` (versions `from..`, payload `{"v": version}`) into
/// `table` on `c` (a client or a transaction). Returns their ids in order.
async fn insert(
    c: &impl tokio_postgres::GenericClient,
    table: &str,
    agg: &str,
    from: i64,
    n: i64,
) -> anyhow::Result<Vec<Uuid>> {
    let mut ids = Vec::new();
    for v in from..from + n {
        let id = Uuid::now_v7();
        c.execute(
            &format!(
                "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, aggregate_version, \
                 event_type, payload) VALUES ($1, 'acct', $2, $3, 'Deposited', \
                 jsonb_build_object('v', $3::bigint))"
            ),
            &[&id, &agg, &v],
        )
        .await?;
        ids.push(id);
    }
    Ok(ids)
}

/// Reads `topic` until every id of `ids` is there (30 s at most). Asserts every record names
/// `table` in `source_table`, and each aggregate's first copies arrive in version order.
/// Returns how many copies of each id arrived.
fn delivered(
    env: &Env,
    topic: &str,
    table: &str,
    ids: &[Uuid],
) -> anyhow::Result<HashMap<String, usize>> {
    let mut recs = Vec::new();
    for _ in 0..15 {
        recs = read_topic(&env.bootstrap(), topic, ids.len(), Duration::from_secs(2))?;
        let got: HashSet<&str> = recs.iter().map(|r| r.header("event_id")).collect();
        if ids.iter().all(|id| got.contains(id.to_string().as_str())) {
            break;
        }
    }
    let mut copies: HashMap<String, usize> = HashMap::new();
    let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &recs {
        assert_eq!(r.header("source_table"), table, "{r:?}");
        let n = copies.entry(r.header("event_id").to_string()).or_default();
        *n += 1;
        if *n == 1 {
            let v: serde_json::Value = serde_json::from_slice(&r.value)?;
            order
                .entry(String::from_utf8_lossy(&r.key).into_owned())
                .or_default()
                .push(v["v"].as_i64().unwrap());
        }
    }
    let missing: Vec<&Uuid> = ids
        .iter()
        .filter(|id| !copies.contains_key(&id.to_string()))
        .collect();
    assert!(missing.is_empty(), "{table}: missing {missing:?}");
    for (agg, vs) in order {
        let mut sorted = vs.clone();
        sorted.sort();
        assert_eq!(vs, sorted, "{table} aggregate {agg} out of order");
    }
    Ok(copies)
}

async fn pattern_env(name: &str, tenants: &[&str]) -> anyhow::Result<Env> {
    let mut env = Env::start(name).await?;
    env.extra_toml = PATTERN_TOML.into();
    let topics: Vec<String> = tenants.iter().map(|t| format!("tenants.{t}")).collect();
    create_topics(&env.bootstrap(), &topics, 2).await?;
    Ok(env)
}

/// [`pattern_env`] with `tenant_a` created, `init` run (the event trigger installed) and a
/// relay streaming it: two events of aggregate `A` delivered (their ids returned).
async fn streaming_tenant_a(
    name: &str,
    tenants: &[&str],
) -> anyhow::Result<(Env, tokio_postgres::Client, Relay, Vec<Uuid>)> {
    let env = pattern_env(name, tenants).await?;
    let c = env.sql().await?;
    c.batch_execute(&tenant_sql("tenant_a")).await?;
    outboxd::init(&env.config()?).await?;
    let relay = Relay::start(env.config()?);
    let a = insert(&c, "tenant_a.outbox", "A", 1, 2).await?;
    delivered(&env, "tenants.tenant_a", "tenant_a.outbox", &a)?;
    Ok((env, c, relay, a))
}

fn tenant_sql(schema: &str) -> String {
    format!(
        "CREATE SCHEMA {schema}; CREATE TABLE {schema}.outbox (LIKE public.outbox INCLUDING ALL);"
    )
}

/// The issue's pattern test: `init` (a superuser here) installs the event trigger; a tenant
/// created while the relay runs, with rows written in the creating transaction and right
/// after, is relayed without a restart — every event once, per aggregate in order; a tenant
/// that existed at start is relayed too. `status` and `check` show the discovered tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_created_while_running_is_relayed_once_from_its_first_row() -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("outboxd=info")
        .try_init();
    let env = pattern_env("pattern_new", &["tenant_a", "tenant_b"]).await?;
    let mut c = env.sql().await?;
    c.batch_execute(&tenant_sql("tenant_a")).await?;
    let done = outboxd::init(&env.config()?).await?;
    assert!(
        done.iter()
            .any(|l| l.contains("event trigger outboxd_join_outbox_pub installed")),
        "{done:?}"
    );
    assert!(
        done.iter()
            .any(|l| l.contains("extended with tenant_a.outbox")),
        "{done:?}"
    );
    let relay = Relay::start(env.config()?);
    let a = insert(&c, "tenant_a.outbox", "A", 1, 5).await?;
    delivered(&env, "tenants.tenant_a", "tenant_a.outbox", &a)?;

    // The new tenant: schema, table and its first events in one transaction, more after.
    let tx = c.transaction().await?;
    tx.batch_execute(&tenant_sql("tenant_b")).await?;
    let mut b = insert(&tx, "tenant_b.outbox", "B", 1, 3).await?;
    tx.commit().await?;
    b.extend(insert(&c, "tenant_b.outbox", "B", 4, 3).await?);
    let mut a2 = a.clone();
    a2.extend(insert(&c, "tenant_a.outbox", "A", 6, 2).await?);
    let copies = delivered(&env, "tenants.tenant_b", "tenant_b.outbox", &b)?;
    assert!(copies.values().all(|n| *n == 1), "duplicates: {copies:?}");
    let copies = delivered(&env, "tenants.tenant_a", "tenant_a.outbox", &a2)?;
    assert!(copies.values().all(|n| *n == 1), "duplicates: {copies:?}");
    assert!(!relay.is_finished(), "the relay kept running");

    let (code, out) = outboxd_cli(&["status", "--json"], &env.config_file()?);
    assert_eq!(code, 0, "{out}");
    for t in ["tenant_a.outbox", "tenant_b.outbox"] {
        assert!(out.contains(&format!("\"table\": \"{t}\"")), "{out}");
    }
    assert!(out.contains("\"pattern\": \"tenant_%.outbox\""), "{out}");
    let (_, out) = outboxd_cli(&["check"], &env.config_file()?);
    assert!(
        out.contains("tenant_a.outbox") && out.contains("tenant_b.outbox"),
        "{out}"
    );
    assert!(
        out.contains("2 table(s) matched and published; event trigger outboxd_join_outbox_pub"),
        "{out}"
    );
    // Replay takes a matched table like a listed one: its mapping, its topic.
    relay.shutdown().await?;
    let id = b[0].to_string();
    let cfg = env.config_file()?;
    let args = [
        id.as_str(),
        "--table",
        "tenant_b.outbox",
        "--execute",
        "--reason",
        "r",
    ];
    let out = outboxd_tests::replay::replay(&cfg, &args, true);
    assert!(out.contains("finished"), "{out}");
    let copies = delivered(&env, "tenants.tenant_b", "tenant_b.outbox", &b)?;
    assert_eq!(copies[&id], 2, "the original and the replayed copy");
    Ok(())
}

/// A table that held rows before it matched and joined: a schema renamed into the pattern
/// (no trigger fires for that), then added to the publication (by hand, or by the running
/// relay) while a writer's transaction straddles the addition (one row before it, one after,
/// commit after). pgoutput
/// streams only the row after; the relay republishes every row the table held — the
/// straddler's first row included — before it streams the table, so nothing is lost and the
/// first copies are in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_that_held_rows_before_it_joined_has_them_republished() -> anyhow::Result<()> {
    let (env, c, relay, _) = streaming_tenant_a("pattern_late", &["tenant_a", "tenant_c"]).await?;

    c.batch_execute(&tenant_sql("staging_c")).await?;
    let mut ids = insert(&c, "staging_c.outbox", "C", 1, 4).await?;
    let mut w = env.sql().await?;
    let straddler = w.transaction().await?;
    ids.extend(insert(&straddler, "staging_c.outbox", "C", 5, 1).await?);
    c.batch_execute("ALTER SCHEMA staging_c RENAME TO tenant_c")
        .await?;
    // By hand, unless the running relay (a superuser here) was quicker.
    if let Err(e) = c
        .batch_execute("ALTER PUBLICATION outbox_pub ADD TABLE tenant_c.outbox")
        .await
    {
        assert!(e.to_string().contains("already member"), "{e}");
    }
    ids.extend(insert(&straddler, "tenant_c.outbox", "C", 6, 1).await?);
    // Open while the relay notices the table (each state write) and catches up: its snapshot
    // must wait for this writer, or row 5 is neither in it nor in the stream.
    tokio::time::sleep(Duration::from_secs(3)).await;
    straddler.commit().await?;
    ids.extend(insert(&c, "tenant_c.outbox", "C", 7, 3).await?);
    let copies = delivered(&env, "tenants.tenant_c", "tenant_c.outbox", &ids)?;
    assert_eq!(copies.len(), ids.len(), "{copies:?}");
    // Later rows still stream once the table is known.
    let more = insert(&c, "tenant_c.outbox", "C", 10, 2).await?;
    let copies = delivered(&env, "tenants.tenant_c", "tenant_c.outbox", &more)?;
    assert!(
        more.iter().all(|id| copies[&id.to_string()] == 1),
        "{copies:?}"
    );
    assert!(!relay.is_finished(), "the relay kept running");
    relay.shutdown().await?;
    Ok(())
}

/// A listed table that matches a pattern with another mapping is refused, naming both.
#[test]
fn a_listed_table_a_pattern_maps_otherwise_is_refused() {
    let toml = format!(
        "[source]\ndsn = \"postgres://u@h/db\"\n[sink.kafka]\n\"bootstrap.servers\" = \"b:9092\"\n\
         {PATTERN_TOML}\n[[source.tables]]\nname = \"tenant_x.outbox\"\ntopic = \"x\"\n"
    );
    let err = outboxd::Config::from_toml_and_env(&toml, Vec::<(String, String)>::new())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tenant_x.outbox is listed by name and matches"),
        "{err}"
    );
}

/// A listed table that joins the publication after the relay has run on the slot (listed in
/// a new configuration, added by `init`) has the rows it held before republished by the next
/// session, before its stream: nothing it held is lost (before, they were the operator's to
/// replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_table_that_joins_later_has_its_earlier_rows_republished() -> anyhow::Result<()> {
    let mut env = Env::start("pattern_listed").await?;
    create_topics(&env.bootstrap(), &["billing.events"], 2).await?;
    let c = env.sql().await?;
    // The relay runs on the slot with its first configuration (public.outbox alone).
    let relay = Relay::start(env.config()?);
    env.deliver("warmup", 2, &env.dir.path().join("log"))
        .await?;
    relay.shutdown().await?;

    c.batch_execute(&tenant_sql("billing")).await?;
    let mut ids = insert(&c, "billing.outbox", "B", 1, 3).await?;
    env.extra_toml = "[[source.tables]]\nname = \"public.outbox\"\n\
                      [[source.tables]]\nname = \"billing.outbox\"\ntopic = \"billing.events\"\n"
        .into();
    let done = outboxd::init(&env.config()?).await?;
    assert!(
        done.iter()
            .any(|l| l.contains("extended with billing.outbox")),
        "{done:?}"
    );
    let relay = Relay::start(env.config()?);
    ids.extend(insert(&c, "billing.outbox", "B", 4, 2).await?);
    delivered(&env, "billing.events", "billing.outbox", &ids)?;
    relay.shutdown().await?;
    Ok(())
}

/// Without the event trigger's help (a schema renamed into the pattern fires none) and with no
/// row written after: the running relay notices the matching table within a state interval,
/// adds it to the publication (its role may, here) and republishes what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_matching_table_outside_the_publication_is_added_by_the_running_relay(
) -> anyhow::Result<()> {
    let env = pattern_env("pattern_added", &["tenant_d"]).await?;
    let c = env.sql().await?;
    outboxd::init(&env.config()?).await?;
    let relay = Relay::start(env.config()?);
    env.deliver("warmup", 1, &env.dir.path().join("log"))
        .await?;
    c.batch_execute(&tenant_sql("staging_d")).await?;
    let ids = insert(&c, "staging_d.outbox", "D", 1, 4).await?;
    c.batch_execute("ALTER SCHEMA staging_d RENAME TO tenant_d")
        .await?;
    let copies = delivered(&env, "tenants.tenant_d", "tenant_d.outbox", &ids)?;
    assert!(copies.values().all(|n| *n == 1), "{copies:?}");
    let published: bool = c
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = 'outbox_pub' \
             AND schemaname = 'tenant_d')",
            &[],
        )
        .await?
        .get(0);
    assert!(published);
    relay.shutdown().await?;
    Ok(())
}

/// A tenant dropped (`DROP SCHEMA … CASCADE`): rows it committed that the stream still holds are
/// relayed through the pattern's mapping (the table left the publication with the drop), the
/// relay does not restart in a loop on its Relation message, and a drop while streaming is no
/// publication change (no slot replacement, no recovery).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_tenant_keeps_its_streamed_rows_and_costs_no_recovery() -> anyhow::Result<()> {
    let env = pattern_env("pattern_drop", &["tenant_a", "tenant_e", "tenant_f"]).await?;
    let c = env.sql().await?;
    c.batch_execute(&tenant_sql("tenant_a")).await?;
    c.batch_execute(&tenant_sql("tenant_e")).await?;
    outboxd::init(&env.config()?).await?;
    let relay = Relay::start(env.config()?);
    let mut a = insert(&c, "tenant_a.outbox", "A", 1, 2).await?;
    delivered(&env, "tenants.tenant_a", "tenant_a.outbox", &a)?;
    relay.shutdown().await?;

    // Written while the relay is down, then the tenant is dropped.
    let e = insert(&c, "tenant_e.outbox", "E", 1, 3).await?;
    c.batch_execute("DROP SCHEMA tenant_e CASCADE").await?;
    a.extend(insert(&c, "tenant_a.outbox", "A", 3, 2).await?);
    let relay = Relay::start(env.config()?);
    delivered(&env, "tenants.tenant_e", "tenant_e.outbox", &e)?;
    delivered(&env, "tenants.tenant_a", "tenant_a.outbox", &a)?;

    // Created and dropped while the relay streams.
    c.batch_execute(&tenant_sql("tenant_f")).await?;
    let f = insert(&c, "tenant_f.outbox", "F", 1, 2).await?;
    delivered(&env, "tenants.tenant_f", "tenant_f.outbox", &f)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    c.batch_execute("DROP SCHEMA tenant_f CASCADE").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    a.extend(insert(&c, "tenant_a.outbox", "A", 5, 2).await?);
    let copies = delivered(&env, "tenants.tenant_a", "tenant_a.outbox", &a)?;
    assert!(
        a[4..].iter().all(|id| copies[&id.to_string()] == 1),
        "{copies:?}"
    );
    let recoveries: i64 = c
        .query_one(
            "SELECT recoveries FROM outboxd_slot_state WHERE slot_name = $1",
            &[&env.slot],
        )
        .await?
        .get(0);
    assert_eq!(recoveries, 0, "a dropped tenant is no publication change");
    assert!(!relay.is_finished(), "the relay kept running");
    relay.shutdown().await?;
    Ok(())
}

/// After an upgrade (a state row that records no joined tables yet), a session that adds a
/// matching table to the publication itself first records the tables published before, so the
/// added one's earlier rows are republished rather than taken for an old member's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_upgrade_a_table_the_relay_adds_is_still_caught_up() -> anyhow::Result<()> {
    let (env, c, relay, _) =
        streaming_tenant_a("pattern_upgrade", &["tenant_a", "tenant_g"]).await?;
    relay.shutdown().await?;

    c.execute(
        "UPDATE outboxd_slot_state SET joined_tables = NULL WHERE slot_name = $1",
        &[&env.slot],
    )
    .await?;
    c.batch_execute(&tenant_sql("staging_g")).await?;
    let g = insert(&c, "staging_g.outbox", "G", 1, 3).await?;
    c.batch_execute("ALTER SCHEMA staging_g RENAME TO tenant_g")
        .await?;
    let relay = Relay::start(env.config()?);
    delivered(&env, "tenants.tenant_g", "tenant_g.outbox", &g)?;
    relay.shutdown().await?;
    Ok(())
}
