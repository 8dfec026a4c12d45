//! The loss windows of issue 26: sequences real deployments produce around a lost slot, which
//! used to leave its gap silently incomplete. Each test loses the slot while the relay is down,
//! does what a deployment does next, and checks that every committed event reaches the topic,
//! in per-aggregate order.
//!
//! - a deploy step runs `outboxd init` between the loss and the restart (init recreated the slot,
//!   and the relay streamed from its new position: 1,000 of 1,000 lost);
//! - rows written during the loss carry a `created_at` hours in the past (an application's event
//!   time, a backfill): the time window missed all of them;
//! - a transaction opened before the loss commits after it, having run longer than
//!   `source.recovery_window`;
//! - a table without `created_at` or versions (Debezium's): no recovery at all before; now by
//!   transaction id, two transactions on one aggregate in the order of their writes, not of
//!   their starts.

use outboxd_tests::reliability::read_log;
use outboxd_tests::*;
use std::path::PathBuf;
use std::time::Duration;
use tokio_postgres::Client;

const TOPIC: &str = "outbox.event.acct";
const WAIT: Duration = Duration::from_secs(120);

/// A relay delivered events and stopped; then its slot was dropped.
struct Lost {
    env: Env,
    config: PathBuf,
    log: PathBuf,
    c: Client,
}

impl Lost {
    fn relay(&self) -> anyhow::Result<RelayProcess> {
        RelayProcess::spawn(&self.config, self.log.clone())
    }

    fn slot_exists_sql(&self) -> &'static str {
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)"
    }

    async fn slot_exists(&self) -> anyhow::Result<bool> {
        Ok(self
            .c
            .query_one(self.slot_exists_sql(), &[&self.env.slot])
            .await?
            .get(0))
    }
}

fn deposits(agg: &str, versions: std::ops::RangeInclusive<i64>) -> Vec<NewEvent> {
    versions
        .map(|v| NewEvent::new("acct", agg, v, "Deposited", serde_json::json!({ "v": v })))
        .collect()
}

/// A relay running on a world whose config is `config_toml` (the env's TOML, rewritten by the
/// caller), after `outboxd init`.
struct Running {
    lost: Lost,
    relay: RelayProcess,
}

async fn running(env: Env, config_toml: String, topic: &str) -> anyhow::Result<Running> {
    create_topics(&env.bootstrap(), &[topic], 3).await?;
    let config = env.dir.path().join("outboxd.toml");
    std::fs::write(&config, config_toml)?;
    let log = env.dir.path().join("relay.log");
    let (code, out) = outboxd_cli(&["init"], &config);
    assert_eq!(code, 0, "{out}");
    let c = env.sql().await?;
    let relay = RelayProcess::spawn(&config, log.clone())?;
    Ok(Running {
        lost: Lost {
            env,
            config,
            log,
            c,
        },
        relay,
    })
}

impl Running {
    /// Waits until what was written is delivered and the state row recorded it, stops the relay
    /// and drops the slot.
    async fn lose(mut self) -> anyhow::Result<Lost> {
        let l = &self.lost;
        l.env.caught_up(WAIT).await?;
        tokio::time::sleep(Duration::from_millis(2500)).await; // the state row records the marks
        assert!(self.relay.sigterm()?.success(), "{}", read_log(&l.log));
        l.env.drop_slot().await?;
        Ok(self.lost)
    }
}

/// The default table: aggregate `a-1` delivered up to version `n`.
async fn default_lost(name: &str, n: i64) -> anyhow::Result<Lost> {
    let env = Env::start(name).await?;
    let toml = env.toml();
    let mut r = running(env, toml, TOPIC).await?;
    write_events(&mut r.lost.c, &deposits("a-1", 1..=n), false).await?;
    r.lose().await
}

/// Reads `topic` until `n` distinct values of `of` (per record, `None`: not counted) were seen
/// or [`WAIT`] passed; returns them in the order of their first copies.
async fn first_copies<T: PartialEq>(
    bootstrap: &str,
    topic: &str,
    n: usize,
    of: impl Fn(&Record) -> Option<T>,
) -> anyhow::Result<Vec<T>> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let mut firsts = Vec::new();
        for r in read_topic(bootstrap, topic, n, Duration::from_secs(10))? {
            if let Some(v) = of(&r).filter(|v| !firsts.contains(v)) {
                firsts.push(v);
            }
        }
        if firsts.len() >= n || std::time::Instant::now() > deadline {
            return Ok(firsts);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Asserts that the first copies of `agg`'s versions on the topic are exactly `want`, in order.
async fn assert_versions(
    bootstrap: &str,
    topic: &str,
    agg: &str,
    want: std::ops::RangeInclusive<i64>,
    log: &std::path::Path,
) -> anyhow::Result<()> {
    let firsts = first_copies(bootstrap, topic, want.clone().count(), |r| {
        (r.key == agg.as_bytes()).then(|| r.header("aggregate_version").parse::<i64>().ok())?
    })
    .await?;
    let want: Vec<i64> = want.collect();
    assert!(
        firsts == want,
        "first copies of {agg}: {} of {} versions, in order: {}\n{}",
        firsts.len(),
        want.len(),
        firsts.windows(2).all(|w| w[0] < w[1]),
        read_log(log)
    );
    Ok(())
}

/// The first reproduction: slot dropped, a deploy step runs `outboxd init` (as an init
/// container does on every rollout), then `outboxd run`. init must not create the slot over the
/// loss; run recovers the gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_between_the_loss_and_the_restart_keeps_the_gap() -> anyhow::Result<()> {
    let mut l = default_lost("lw_init", 10).await?;
    for chunk in 0..10 {
        let from = 11 + chunk * 100;
        write_events(&mut l.c, &deposits("a-1", from..=from + 99), false).await?;
    }
    for _ in 0..2 {
        let (code, out) = outboxd_cli(&["init"], &l.config);
        assert_eq!(code, 0, "init fails the deploy: {out}");
        assert!(out.contains("NOT created"), "{out}");
        assert!(out.contains("outboxd run"), "names the way forward: {out}");
        assert!(!l.slot_exists().await?, "init created a slot over the loss");
    }
    let mut relay = l.relay()?;
    assert_versions(&l.env.bootstrap(), TOPIC, "a-1", 1..=1010, &l.log).await?;
    assert!(relay.sigterm()?.success());
    let text = read_log(&l.log);
    assert!(text.contains("recovery finished"), "{text}");
    Ok(())
}

/// Rows written during the loss whose `created_at` the application set two hours back (event
/// time, a backfill): the gap is found by transaction id, so their age does not matter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_created_hours_in_the_past_during_the_loss() -> anyhow::Result<()> {
    let l = default_lost("lw_past", 10).await?;
    l.c.batch_execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                             event_type, payload, created_at) \
         SELECT gen_random_uuid(), 'acct', 'a-1', g, 'Deposited', jsonb_build_object('v', g), \
                now() - interval '2 hours' \
         FROM generate_series(11, 1010) g",
    )
    .await?;
    let mut relay = l.relay()?;
    assert_versions(&l.env.bootstrap(), TOPIC, "a-1", 1..=1010, &l.log).await?;
    assert!(relay.sigterm()?.success());
    Ok(())
}

/// A transaction opened before the loss, held open longer than `recovery_window` while the relay
/// delivered other events, and committed after the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_open_across_the_loss_longer_than_the_window() -> anyhow::Result<()> {
    let env = Env::start("lw_long").await?;
    let toml = env
        .toml()
        .replace("[source]\n", "[source]\nrecovery_window = 1\n");
    let mut long = env.sql().await?;
    let tx = long.transaction().await?;
    outboxd_tests::insert_events(&tx, &deposits("long-1", 1..=1)).await?;
    let mut r = running(env, toml, TOPIC).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    write_events(&mut r.lost.c, &deposits("a-1", 1..=10), false).await?;
    let mut l = r.lose().await?;
    tx.commit().await?;
    write_events(&mut l.c, &deposits("a-1", 11..=20), false).await?;
    let mut relay = l.relay()?;
    assert_versions(&l.env.bootstrap(), TOPIC, "a-1", 1..=20, &l.log).await?;
    assert_versions(&l.env.bootstrap(), TOPIC, "long-1", 1..=1, &l.log).await?;
    assert!(relay.sigterm()?.success());
    Ok(())
}

/// Debezium's table (no created_at, no version): two transactions on one aggregate, the one that
/// started first writing second. Recovered in the order of their writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_table_recovered_in_write_order() -> anyhow::Result<()> {
    let mut env = Env::start("lw_dbz").await?;
    env.slot = format!("{}_dbz", env.slot);
    env.sql()
        .await?
        .batch_execute(include_str!("../golden/debezium/table.sql"))
        .await?;
    let toml = env
        .toml()
        .replace(
            "[source]\n",
            "[source]\ntable = \"public.outboxevent\"\npublication = \"dbz_pub\"\n",
        )
        .replace(
            "[relay]\n",
            "[source.columns]\npreset = \"debezium\"\n[relay]\n",
        );
    let insert = "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) \
                  VALUES (gen_random_uuid(), 'acct', 'd-1', 'E', jsonb_build_object('n', $1::int))";
    let topic = "outbox.event.acct";
    let r = running(env, toml, topic).await?;
    r.lost.c.execute(insert, &[&0i32]).await?;
    let l = r.lose().await?;
    let mut first = l.env.sql().await?;
    let t1 = first.transaction().await?;
    t1.batch_execute("SELECT 1").await?; // started: its now() is fixed
    tokio::time::sleep(Duration::from_millis(100)).await;
    l.c.execute(insert, &[&1i32]).await?;
    t1.execute(insert, &[&2i32]).await?;
    t1.commit().await?;
    let mut relay = l.relay()?;
    let order = first_copies(&l.env.bootstrap(), topic, 3, |r| {
        let v: serde_json::Value = serde_json::from_slice(&r.value).ok()?;
        v["n"].as_i64()
    })
    .await?;
    assert_eq!(
        order,
        vec![0, 1, 2],
        "first copies in write order\n{}",
        read_log(&l.log)
    );
    assert!(relay.sigterm()?.success());
    Ok(())
}
