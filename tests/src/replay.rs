//! Helpers of the replay tests (tests/tests/replay.rs, replay_runs.rs, trust_replay.rs): reading
//! records raw, writing events, running `outboxd replay`, reading its audit row, the operators'
//! roles and the admin's init.

use crate::*;
use std::collections::HashMap;
use std::time::Duration;

pub const ACCT: &str = "outbox.event.acct";
pub const ORDER: &str = "outbox.event.order";

/// A record as read back, headers in their order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Raw {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub timestamp: Option<i64>,
}

impl Raw {
    /// A header's value as text ("" when absent).
    pub fn header(&self, name: &str) -> String {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default()
    }

    pub fn event_id(&self) -> String {
        self.header("event_id")
    }
}

pub fn raw_records(env: &Env, topic: &str, min: usize) -> anyhow::Result<Vec<Raw>> {
    use rdkafka::message::{Headers, Message};
    let mut out = Vec::new();
    scan_topic(&env.bootstrap(), topic, min, Duration::from_secs(30), |m| {
        out.push(Raw {
            key: m.key().unwrap_or_default().to_vec(),
            value: m.payload().unwrap_or_default().to_vec(),
            headers: m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec()))
                        .collect()
                })
                .unwrap_or_default(),
            timestamp: m.timestamp().to_millis(),
        })
    })?;
    Ok(out)
}

pub fn by_id(recs: &[Raw]) -> HashMap<String, Vec<Raw>> {
    let mut m: HashMap<String, Vec<Raw>> = HashMap::new();
    for r in recs {
        m.entry(r.event_id()).or_default().push(r.clone());
    }
    m
}

pub fn events(agg_type: &str, agg: &str, n: i64, event_type: &str) -> Vec<NewEvent> {
    events_from(agg_type, agg, 1, n, event_type)
}

/// `n` events of one aggregate, versions `first..first + n`.
pub fn events_from(
    agg_type: &str,
    agg: &str,
    first: i64,
    n: i64,
    event_type: &str,
) -> Vec<NewEvent> {
    (first..first + n)
        .map(|v| {
            NewEvent::new(
                agg_type,
                agg,
                v,
                event_type,
                serde_json::json!({"v": v, "agg": agg}),
            )
        })
        .collect()
}

/// The relay delivers everything written so far, then stops.
pub async fn deliver_live(env: &Env) -> anyhow::Result<()> {
    let relay = Relay::start(env.config()?);
    env.caught_up(Duration::from_secs(60)).await?;
    relay.shutdown().await
}

pub async fn db_now(c: &tokio_postgres::Client) -> anyhow::Result<String> {
    // Wall clock, not now(): created_at is the writing transaction's start time.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let t: String = c
        .query_one(
            "SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            &[],
        )
        .await?
        .get(0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(t)
}

/// `outboxd replay ARGS… --config F`, asserting the exit code; returns the output.
pub fn replay(cfg: &std::path::Path, args: &[&str], ok: bool) -> String {
    let mut all = vec!["replay"];
    all.extend_from_slice(args);
    let (code, out) = outboxd_cli(&all, cfg);
    assert_eq!(code == 0, ok, "outboxd {all:?} exited {code}:\n{out}");
    out
}

/// The audit row: (state, requested_by, approved_by, reason, events, sent, run_by, selection).
pub async fn audit(
    c: &tokio_postgres::Client,
    id: i64,
) -> anyhow::Result<(
    String,
    String,
    Option<String>,
    String,
    i64,
    i64,
    Option<String>,
    serde_json::Value,
)> {
    let r = c
        .query_one(
            "SELECT state, requested_by, approved_by, reason, events, sent, run_by, selection, \
               started_at IS NOT NULL AND (state <> 'finished' OR finished_at IS NOT NULL) \
             FROM outboxd_replay WHERE id = $1",
            &[&id],
        )
        .await?;
    assert!(r.get::<_, bool>(8), "started_at/finished_at not recorded");
    Ok((
        r.get(0),
        r.get(1),
        r.get(2),
        r.get(3),
        r.get(4),
        r.get(5),
        r.get(6),
        r.get(7),
    ))
}

/// Creates the roles of sql/roles.sql and two operators in the replay group (alice, bob);
/// returns their DSNs.
pub async fn operators(env: &Env) -> anyhow::Result<(String, String)> {
    let c = env.sql().await?;
    let roles = include_str!("../../sql/roles.sql");
    let (create, grants) = roles.split_once("-- ---- 2.").expect("two blocks");
    c.batch_execute(create).await?;
    c.batch_execute(&format!("--{grants}")).await?;
    c.batch_execute(
        "CREATE ROLE alice LOGIN PASSWORD 'alice-pw' IN ROLE outboxd_replay; \
         CREATE ROLE bob LOGIN PASSWORD 'bob-pw' IN ROLE outboxd_replay",
    )
    .await?;
    let dsn = |who: &str| {
        env.pg.dsn(&env.db).replace(
            &format!("postgres:{}", testkit::PG_PASSWORD),
            &format!("{who}:{who}-pw"),
        )
    };
    Ok((dsn("alice"), dsn("bob")))
}

/// `outboxd init` by the admin (the env's superuser) with the env's config as it is now: writes
/// its `[replay]` approval policy into the database (`Env::start` ran init with the default one).
pub async fn init_as_admin(env: &Env) -> anyhow::Result<()> {
    outboxd::init(&env.config()?).await?;
    Ok(())
}

/// A connection as `dsn`'s role (an operator typing SQL by hand).
pub async fn connect(dsn: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (c, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(c)
}

// ---- the replay trust tests (tests/tests/trust_replay.rs) ---------------------------------

/// The admin's policy, written into the database by `outboxd init`.
pub const ADMIN_POLICY: &str =
    "[replay]\napproval_over = 4\nside_effect_types = [\"EmailRequested\"]\n";

/// A world with the admin's policy installed, the topic, and the operators alice and bob.
pub async fn trust_world(name: &str) -> anyhow::Result<(Env, std::path::PathBuf, String, String)> {
    let mut env = Env::start(name).await?;
    env.extra_toml = ADMIN_POLICY.into();
    init_as_admin(&env).await?;
    create_topics(&env.bootstrap(), &[ACCT], 3).await?;
    let cfg = env.config_file()?;
    let (alice, bob) = operators(&env).await?;
    Ok((env, cfg, alice, bob))
}

/// `n` events of aggregate `agg`, written in a range of their own: (events, since, until).
pub async fn written_range(
    c: &mut tokio_postgres::Client,
    agg: &str,
    n: i64,
) -> anyhow::Result<(Vec<NewEvent>, String, String)> {
    let since = db_now(c).await?;
    let evs = events("acct", agg, n, "Deposited");
    write_events(c, &evs, false).await?;
    let until = db_now(c).await?;
    Ok((evs, since, until))
}

/// `replay request` of `[since, until)` as `who`.
pub fn request_as(cfg: &std::path::Path, who: &str, since: &str, until: &str) -> String {
    replay(
        cfg,
        &[
            "request", "--since", since, "--until", until, "--reason", "r", "--dsn", who,
        ],
        true,
    )
}

/// A range selection as the audit row stores it.
pub fn range(since: &str, until: &str) -> serde_json::Value {
    serde_json::json!({"by": "range", "since": since, "until": until,
           "event_types": [], "aggregate_types": [], "aggregate_ids": []})
}

/// An audit row as a member writes it by hand, claiming it needs no approval.
pub async fn insert_by_hand(
    c: &tokio_postgres::Client,
    slot: &str,
    state: &str,
    selection: serde_json::Value,
    events: i64,
    summary: serde_json::Value,
) -> Result<i64, tokio_postgres::Error> {
    Ok(c.query_one(
        "INSERT INTO outboxd_replay (slot, state, selection, events, summary, needs_approval, \
           reason, rate) VALUES ($1, $2, $3, $4, $5, false, 'by hand', 100000) RETURNING id",
        &[&slot, &state, &selection, &events, &summary],
    )
    .await?
    .get(0))
}

/// The database's message of a refused statement.
pub fn db_message(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_string())
}

/// `sql` (with the replay id as $1) is refused by the guard, saying `says`.
pub async fn refused_by_guard(c: &tokio_postgres::Client, sql: &str, id: i64, says: &str) {
    let err = c
        .execute(sql, &[&id])
        .await
        .expect_err(&format!("the guard let through: {sql}"));
    assert!(db_message(&err).contains(says), "{sql}: {err:?}");
}

/// The replay's state.
pub async fn replay_state(c: &tokio_postgres::Client, id: i64) -> anyhow::Result<String> {
    Ok(
        c.query_one("SELECT state FROM outboxd_replay WHERE id = $1", &[&id])
            .await?
            .get(0),
    )
}

/// Nothing reached the replay topic.
pub fn nothing_on_the_topic(env: &Env) -> anyhow::Result<()> {
    assert_eq!(
        raw_records(env, ACCT, 0)?.len(),
        0,
        "a record reached the topic"
    );
    Ok(())
}
