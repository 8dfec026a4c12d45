//! Soak test (issue 4), on demand only:
//!
//! ```sh
//! SOAK_SECS=180 cargo nextest run -p outboxd-tests --test soak --run-ignored ignored-only --no-capture
//! ```
//!
//! Steady write load (random transactions, 15 % rolled back) through two relay instances (one
//! active, one standby) behind TCP fault proxies, with an inbox-library consumer; every 5–15 s a
//! random fault (shuffled rounds: each kind once per ten): broker path cut / refused /
//! blackholed / slowed, Postgres path cut / slowed / blackholed (healing), SIGKILL of the active
//! relay, Postgres crash (`-m immediate`), broker
//! killed and restarted empty. At the end the same checks as every reliability test (nothing
//! lost, nothing rolled back delivered, copies byte-identical, per-aggregate order of first
//! occurrences, effects exactly once) and a report: events, duplicates, slot lag, delivery
//! delay, relay RSS over time. Duration: `SOAK_SECS` (default 600; not `OUTBOXD_*`: the relay
//! processes inherit the environment and reject unknown `OUTBOXD_*` variables).

use outboxd_tests::reliability::*;
use outboxd_tests::testkit::Mode;
use outboxd_tests::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

const TOPIC: &str = "outbox.event.acct";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    BrokerCut,
    BrokerDown,
    BrokerBlackhole,
    BrokerLatency,
    PgCut,
    PgLatency,
    PgBlackhole,
    KillActiveRelay,
    PgCrash,
    BrokerRestart,
}

const FAULTS: [Fault; 10] = [
    Fault::BrokerCut,
    Fault::BrokerDown,
    Fault::BrokerBlackhole,
    Fault::BrokerLatency,
    Fault::PgCut,
    Fault::PgLatency,
    Fault::PgBlackhole,
    Fault::KillActiveRelay,
    Fault::PgCrash,
    Fault::BrokerRestart,
];

#[derive(Default)]
struct Samples {
    max_lag_bytes: u64,
    /// (seconds since start, RSS KiB of each running relay, slot lag bytes)
    timeline: Vec<(u64, Vec<u64>, u64)>,
    max_rss_kib: u64,
}

struct Fleet {
    relays: Vec<RelayProcess>,
    config: std::path::PathBuf,
    dir: std::path::PathBuf,
    spawned: usize,
}

impl Fleet {
    fn spawn(&mut self) -> anyhow::Result<RelayProcess> {
        self.spawned += 1;
        RelayProcess::spawn(
            &self.config,
            self.dir.join(format!("relay-{}.log", self.spawned)),
        )
    }

    fn pids(&self) -> Vec<u32> {
        self.relays.iter().map(|r| r.child.id()).collect()
    }
}

async fn caught_up(env: &Env) -> anyhow::Result<()> {
    let target = env.current_lsn().await?;
    eventually(Duration::from_secs(180), || async {
        Ok(env.confirmed_lsn().await.unwrap_or(0) >= target)
    })
    .await
}

fn create_topic_directly(broker_port: u16) -> anyhow::Result<()> {
    let out = std::process::Command::new(testkit::tansu_bin())
        .args(["topic", "create", "--partitions", "3", "--broker"])
        .arg(format!("tcp://127.0.0.1:{broker_port}"))
        .arg(TOPIC)
        .output()?;
    anyhow::ensure!(out.status.success(), "tansu topic create failed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak test: run on demand (SOAK_SECS, default 600); see docs/reliability.md"]
async fn soak_with_random_faults() -> anyhow::Result<()> {
    let secs: u64 = std::env::var("SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let t0 = Instant::now();
    let mut env = Env::start_with_proxies("soak").await?;
    env.extra_toml = "standby_poll_ms = 500".into();
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let mut reader = InboxReader::start(&env.bootstrap(), TOPIC, &inbox_dsn);
    let writer = Writer::start(
        env.pg.dsn(&env.db),
        Load {
            aggregates: 200,
            pause_ms: 5..30,
            ..Load::default()
        },
    );
    let mut fleet = Fleet {
        relays: Vec::new(),
        config: env.config_file()?,
        dir: env.dir.path().to_path_buf(),
        spawned: 0,
    };
    for _ in 0..2 {
        let r = fleet.spawn()?;
        fleet.relays.push(r);
    }

    // Sampler: slot lag and relay RSS every second.
    let samples = Arc::new(Mutex::new(Samples::default()));
    let pids = Arc::new(Mutex::new(fleet.pids()));
    let sampler = {
        let (samples, pids) = (samples.clone(), pids.clone());
        let dsn = env.pg.dsn(&env.db);
        let slot = env.slot.clone();
        let every = (secs / 15).max(10);
        tokio::spawn(async move {
            let mut last_point = 0;
            let mut steady = false;
            let mut c: Option<tokio_postgres::Client> = None;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if c.as_ref().is_none_or(|c| c.is_closed()) {
                    c = tokio_postgres::connect(&dsn, tokio_postgres::NoTls)
                        .await
                        .ok()
                        .map(|(c, conn)| {
                            tokio::spawn(conn);
                            c
                        });
                }
                let Some(cl) = c.as_ref() else { continue };
                let lag = cl
                    .query_one(
                        "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await
                    .ok()
                    .and_then(|r| r.get::<_, Option<i64>>(0))
                    .unwrap_or(0)
                    .max(0) as u64;
                let rss: Vec<u64> = pids
                    .lock()
                    .unwrap()
                    .iter()
                    .filter_map(|p| rss_kib(*p))
                    .collect();
                let mut s = samples.lock().unwrap();
                // Lag counts once the relay first caught up (setup WAL before it started is not lag).
                steady |= lag < 1 << 20;
                if steady {
                    s.max_lag_bytes = s.max_lag_bytes.max(lag);
                }
                s.max_rss_kib = s.max_rss_kib.max(rss.iter().copied().max().unwrap_or(0));
                let t = t0.elapsed().as_secs();
                if t >= last_point + every || last_point == 0 {
                    last_point = t.max(1);
                    s.timeline.push((t, rss, lag));
                }
            }
        })
    };

    let mut rng = rand::rngs::StdRng::from_entropy();
    let mut counts: BTreeMap<Fault, usize> = BTreeMap::new();
    let mut deck: Vec<Fault> = Vec::new();
    let mut takeovers = Vec::new();
    let deadline = t0 + Duration::from_secs(secs);
    let sql = env.sql().await?;
    let mut sql = Some(sql);
    while Instant::now() + Duration::from_secs(20) < deadline {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(5000..15000))).await;
        // Shuffled rounds: every kind of fault comes up once per ten.
        if deck.is_empty() {
            deck = FAULTS.to_vec();
            deck.shuffle(&mut rng);
        }
        let fault = deck.pop().unwrap();
        *counts.entry(fault).or_default() += 1;
        let at = t0.elapsed().as_secs();
        let bp = env.broker_proxy.as_ref().unwrap();
        let pp = env.pg_proxy.as_ref().unwrap();
        match fault {
            Fault::BrokerCut => bp.cut(),
            Fault::BrokerDown | Fault::BrokerBlackhole => {
                bp.set_mode(if fault == Fault::BrokerDown {
                    Mode::Down
                } else {
                    Mode::Blackhole
                });
                tokio::time::sleep(Duration::from_millis(rng.gen_range(3000..8000))).await;
                bp.set_mode(Mode::Pass);
            }
            Fault::BrokerLatency => {
                bp.set_latency(Duration::from_millis(rng.gen_range(50..300)));
                tokio::time::sleep(Duration::from_millis(rng.gen_range(5000..10000))).await;
                bp.set_latency(Duration::ZERO);
            }
            Fault::PgCut => pp.cut(),
            Fault::PgLatency => {
                pp.set_latency(Duration::from_millis(rng.gen_range(50..200)));
                tokio::time::sleep(Duration::from_secs(5)).await;
                pp.set_latency(Duration::ZERO);
            }
            Fault::PgBlackhole => {
                pp.set_mode(Mode::Blackhole);
                tokio::time::sleep(Duration::from_millis(rng.gen_range(3000..5000))).await;
                pp.set_mode(Mode::Pass);
            }
            Fault::KillActiveRelay => {
                if sql.as_ref().is_none_or(|c| c.is_closed()) {
                    sql = Some(connect_retry(&env.pg.dsn(&env.db)).await?);
                }
                let c = sql.as_ref().unwrap();
                let active = streaming_pids(c, &env.slot).await?;
                if let Some(i) = fleet
                    .relays
                    .iter()
                    .position(|r| active.first() == Some(&r.child.id()))
                {
                    let killed = Instant::now();
                    fleet.relays[i].sigkill();
                    let pid = fleet.relays[i].child.id();
                    let took = eventually(Duration::from_secs(60), || async {
                        let now = streaming_pids(c, &env.slot).await?;
                        Ok(now.first().is_some_and(|p| *p != pid))
                    })
                    .await
                    .map(|_| killed.elapsed());
                    takeovers.push(took?);
                    fleet.relays[i] = fleet.spawn()?;
                    *pids.lock().unwrap() = fleet.pids();
                }
            }
            Fault::PgCrash => {
                tokio::task::block_in_place(|| env.pg.restart())?;
            }
            Fault::BrokerRestart => {
                // The consumer must have read everything the doomed broker acknowledged
                // (memory storage): pause, drain, blackhole, resume, restart, recreate.
                writer.pause(true).await;
                caught_up(&env).await?;
                let ids: HashSet<Uuid> = writer.snapshot().committed.keys().copied().collect();
                reader.wait_applied(&ids, Duration::from_secs(120)).await?;
                reader.stop_reading().await?;
                let bp = env.broker_proxy.as_ref().unwrap();
                bp.set_mode(Mode::Blackhole);
                tokio::time::sleep(Duration::from_millis(300)).await;
                writer.pause(false).await;
                tokio::time::sleep(Duration::from_millis(rng.gen_range(1000..3000))).await;
                tokio::task::block_in_place(|| env.broker.restart())?;
                create_topic_directly(env.broker.port)?;
                env.broker_proxy.as_ref().unwrap().set_mode(Mode::Pass);
                reader.start_reading();
            }
        }
        eprintln!(
            "[{at:>4}s] {fault:?} ({} events committed so far)",
            writer.committed_events()
        );
        for r in fleet.relays.iter_mut() {
            assert!(
                r.child.try_wait()?.is_none(),
                "a relay exited by itself; log:\n{}",
                read_log(&r.log)
            );
        }
    }
    let remaining = deadline.saturating_duration_since(Instant::now());
    tokio::time::sleep(remaining).await;

    let wlog = writer.stop().await?;
    caught_up(&env).await?;
    sampler.abort();
    for r in fleet.relays.iter_mut() {
        let st = r.sigterm()?;
        assert!(st.success(), "graceful exit: {st}");
    }
    let ids = wlog.committed.keys().copied().collect();
    reader.wait_applied(&ids, Duration::from_secs(300)).await?;
    reader
        .wait_quiet(Duration::from_secs(2), Duration::from_secs(60))
        .await?;
    let (stats, records) = reader.stop().await?;
    let report = verify_delivery(&records, &wlog, "acct")?;
    verify_effects(&inbox_dsn, &wlog).await?;
    assert!(stats.fatal.is_none(), "{stats:?}");

    // Commit → first arrival at the consumer.
    let mut first: HashMap<&str, i64> = HashMap::new();
    for r in &records {
        if let (Some(id), Some(ts)) = (r.header("event_id"), r.timestamp) {
            first.entry(id).or_insert(r.received_ms - ts);
        }
    }
    let mut delays: Vec<i64> = first.into_values().collect();
    delays.sort_unstable();
    let pct = |p: f64| delays[((delays.len() as f64 - 1.0) * p) as usize];
    let s = samples.lock().unwrap();
    let dur = t0.elapsed();
    println!(
        "\n## soak report ({secs} s requested, {:.0} s run)",
        dur.as_secs_f64()
    );
    println!("| metric | value |\n|---|---|");
    println!("| events committed | {} |", wlog.committed.len());
    println!(
        "| events rolled back (never delivered) | {} |",
        wlog.rolled_back.len()
    );
    println!("| transactions committed | {} |", wlog.txs.len());
    println!(
        "| writer errors survived / commits of unknown outcome resolved | {} / {} |",
        wlog.errors, wlog.resolved_unknown
    );
    println!("| records read by the consumer | {} |", report.records);
    println!(
        "| duplicates (records − distinct) | {} ({:.1} %) |",
        report.duplicates,
        100.0 * report.duplicates as f64 / report.records.max(1) as f64
    );
    println!("| max copies of one event | {} |", report.max_copies);
    println!(
        "| inbox outcomes: applied / duplicate / held / stale | {} / {} / {} / {} |",
        stats.applied + stats.released,
        stats.duplicates,
        stats.held,
        stats.stale
    );
    println!("| lost | 0 (asserted) |");
    println!(
        "| max slot lag | {:.1} MiB |",
        s.max_lag_bytes as f64 / 1048576.0
    );
    println!(
        "| commit → consumer delay p50 / p99 / max | {} / {} / {} ms |",
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    println!(
        "| relay takeovers after SIGKILL | {:?} |",
        takeovers
            .iter()
            .map(|d| format!("{:.2}s", d.as_secs_f64()))
            .collect::<Vec<_>>()
    );
    println!(
        "| max relay RSS | {:.1} MiB |",
        s.max_rss_kib as f64 / 1024.0
    );
    println!("| faults | {counts:?} |");
    println!("\n| t (s) | relay RSS (MiB) | slot lag (KiB) |\n|---|---|---|");
    for (t, rss, lag) in &s.timeline {
        let rss: Vec<String> = rss
            .iter()
            .map(|k| format!("{:.1}", *k as f64 / 1024.0))
            .collect();
        println!("| {t} | {} | {} |", rss.join(", "), lag / 1024);
    }
    Ok(())
}
