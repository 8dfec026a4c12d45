//! What the multi-table tests share (issue 30, R44): three outbox tables in two shapes,
//! `billing.outbox` and `shipping.outbox` (outboxd's) and `legacy.outbox` (Debezium's, read
//! with the Debezium preset), each to its own topic; writing rounds of events into them and
//! reading each table's topic back with per-aggregate order checked.

use crate::{create_topics, read_topic, Env, Record};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

pub const TABLES_SQL: &str = "
CREATE SCHEMA billing;
CREATE SCHEMA shipping;
CREATE SCHEMA legacy;
CREATE TABLE billing.outbox (LIKE public.outbox INCLUDING ALL);
CREATE TABLE shipping.outbox (LIKE public.outbox INCLUDING ALL);
CREATE TABLE legacy.outbox (
    id uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb
);";

/// The three tables, each to its own topics; `extra_billing` and `extra_legacy` are more
/// lines of those entries (e.g. `policy = { … }`; empty: none).
pub fn tables_toml(extra_billing: &str, extra_legacy: &str) -> String {
    format!(
        r#"
[[source.tables]]
name = "billing.outbox"
topic = "billing.{{aggregate_type}}"
{extra_billing}
[[source.tables]]
name = "shipping.outbox"
topic = "shipping.events"
[[source.tables]]
name = "legacy.outbox"
topic = "legacy.{{aggregate_type}}"
columns = {{ preset = "debezium" }}
{extra_legacy}
"#
    )
}

pub const TOPICS: [&str; 3] = ["billing.acct", "shipping.events", "legacy.acct"];

/// An environment with the three tables, configured with `extra` and the tables; `init` run
/// with that configuration (it extends the publication).
pub async fn three_tables(name: &str, extra: &str) -> anyhow::Result<(Env, Vec<String>)> {
    tables_env(name, extra, &tables_toml("", "")).await
}

/// An environment with the three tables created, configured with `extra` and the table list
/// `tables` (entries of `[[source.tables]]`, last in the file); `init` run with it.
pub async fn tables_env(
    name: &str,
    extra: &str,
    tables: &str,
) -> anyhow::Result<(Env, Vec<String>)> {
    let mut env = Env::start(name).await?;
    env.sql().await?.batch_execute(TABLES_SQL).await?;
    env.extra_toml = format!("{extra}\n{tables}");
    create_topics(&env.bootstrap(), &TOPICS, 2).await?;
    let done = outboxd::init(&env.config()?).await?;
    Ok((env, done))
}

/// Inserts one event into `table` (an outboxd-shaped one, or `legacy.outbox`).
pub async fn insert(
    tx: &tokio_postgres::Transaction<'_>,
    table: &str,
    aggregate: &str,
    version: i64,
    payload: serde_json::Value,
) -> anyhow::Result<Uuid> {
    let id = Uuid::now_v7();
    if table == "legacy.outbox" {
        tx.execute(
            "INSERT INTO legacy.outbox (id, aggregatetype, aggregateid, type, payload) \
             VALUES ($1, 'acct', $2, 'Deposited', $3)",
            &[&id, &aggregate, &payload],
        )
        .await?;
    } else {
        tx.execute(
            &format!(
                "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, \
                 aggregate_version, event_type, payload) VALUES ($1, 'acct', $2, $3, 'Deposited', $4)"
            ),
            &[&id, &aggregate, &version, &payload],
        )
        .await?;
    }
    Ok(id)
}

pub const TABLES: [&str; 3] = ["billing.outbox", "shipping.outbox", "legacy.outbox"];

/// Writes `rounds` transactions, each inserting into every table for aggregates `A` and `B`
/// (payload `{"v": n}`, n counting per table and aggregate). Returns the event ids per table.
pub async fn write_rounds(
    c: &mut tokio_postgres::Client,
    from: i64,
    rounds: i64,
) -> anyhow::Result<BTreeMap<&'static str, Vec<Uuid>>> {
    let mut ids: BTreeMap<&str, Vec<Uuid>> = BTreeMap::new();
    for v in from..from + rounds {
        let tx = c.transaction().await?;
        for table in TABLES {
            for agg in ["A", "B"] {
                let id = insert(&tx, table, agg, v, serde_json::json!({ "v": v })).await?;
                ids.entry(table).or_default().push(id);
            }
        }
        tx.commit().await?;
    }
    Ok(ids)
}

/// The topic each table's `acct` events go to.
pub fn topic_of(table: &str) -> &'static str {
    match table {
        "billing.outbox" => TOPICS[0],
        "shipping.outbox" => TOPICS[1],
        _ => TOPICS[2],
    }
}

/// The `v` of each aggregate's records in topic order, first copies only.
pub fn order(recs: &[Record]) -> BTreeMap<String, Vec<i64>> {
    let mut seen = HashSet::new();
    let mut m: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in recs {
        let id = match r.header("event_id") {
            "" => r.header("id"),
            id => id,
        };
        if seen.insert(id.to_string()) {
            let v: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
            m.entry(String::from_utf8_lossy(&r.key).into_owned())
                .or_default()
                .push(v["v"].as_i64().unwrap());
        }
    }
    m
}

/// Reads each table's topic until every id written to it is there; checks each record names
/// its table, and each aggregate's events arrive in the order written. Returns the records of
/// each table (duplicates included).
pub fn delivered(
    env: &Env,
    written: &BTreeMap<&'static str, Vec<Uuid>>,
) -> anyhow::Result<BTreeMap<&'static str, Vec<Record>>> {
    let mut out = BTreeMap::new();
    for (table, ids) in written {
        let mut recs = Vec::new();
        for _ in 0..30 {
            recs = read_topic(
                &env.bootstrap(),
                topic_of(table),
                ids.len(),
                Duration::from_secs(2),
            )?;
            let got: HashSet<String> = recs
                .iter()
                .map(|r| r.header("event_id").to_string())
                .collect();
            if ids.iter().all(|id| got.contains(&id.to_string())) {
                break;
            }
        }
        let got: HashSet<String> = recs
            .iter()
            .map(|r| r.header("event_id").to_string())
            .collect();
        let missing: Vec<&Uuid> = ids
            .iter()
            .filter(|id| !got.contains(&id.to_string()))
            .collect();
        assert!(missing.is_empty(), "{table}: missing {missing:?}");
        for r in &recs {
            assert_eq!(r.header("source_table"), *table, "{r:?}");
        }
        for (agg, vs) in order(&recs) {
            let mut sorted = vs.clone();
            sorted.sort();
            assert_eq!(vs, sorted, "{table} aggregate {agg} out of order");
        }
        out.insert(*table, recs);
    }
    Ok(out)
}
