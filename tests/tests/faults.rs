//! Faults of the world (issue 4): TCP fault proxies between the relay and Postgres and between
//! the relay and the broker (cut connections, refuse, blackhole, latency), Postgres crashed with
//! `-m immediate` mid-stream, the broker killed and restarted, and broker-side storage and
//! authorisation errors (librdkafka mock cluster).
//!
//! Under load from a writer that commits random transactions (some rolled back), with an
//! inbox-library consumer applying every record to its own business table. After each scenario:
//! every committed event delivered, none rolled back, copies byte-identical, first occurrences in
//! per-aggregate order, each effect exactly once in the consumer's table. During faults:
//! the slot's confirmed LSN never reaches a transaction committed while the broker was
//! unreachable; and once, with the relay killed in the middle of a blackhole, every transaction
//! at or before the confirmed LSN is checked to be on the broker.

use anyhow::Context;
use outboxd_tests::reliability::world::{world, World};
use outboxd_tests::reliability::*;
use outboxd_tests::testkit::Mode;
use outboxd_tests::*;
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

const TOPIC: &str = "outbox.event.acct";

/// Lets a proxy mode change take effect on connections already open (the proxy runs on its
/// own thread) before events written "during the fault" are counted as such.
const SETTLE: Duration = Duration::from_millis(300);

const CAUGHT_UP: Duration = Duration::from_secs(90);

fn assert_alive(relay: &mut RelayProcess, what: &str) {
    let st = relay.child.try_wait().expect("try_wait");
    assert!(
        st.is_none(),
        "the relay exited during {what} ({st:?}); it must recover by itself; log:\n{}",
        read_log(&relay.log)
    );
}

/// Transactions committed from `from` on could not reach the broker: the slot's confirmed LSN
/// must stay below each one's (upper bound of the) commit LSN.
async fn assert_slot_held(
    env: &Env,
    writer: &Writer,
    from: usize,
    what: &str,
) -> anyhow::Result<usize> {
    let confirmed = env.confirmed_lsn().await?;
    let log = writer.snapshot();
    let during = &log.txs[from.min(log.txs.len())..];
    for tx in during {
        assert!(
            confirmed < tx.lsn_after,
            "{what}: the slot ({confirmed:X}) passed a transaction committed while the broker was unreachable ({:X})",
            tx.lsn_after
        );
    }
    Ok(during.len())
}

async fn finish(
    env: &Env,
    writer: Writer,
    reader: InboxReader,
    inbox_dsn: &str,
    relay: &mut RelayProcess,
) -> anyhow::Result<(WriteLog, DeliveryReport, InboxStats)> {
    let wlog = writer.stop().await?;
    env.caught_up(CAUGHT_UP).await?;
    let st = relay.sigterm()?;
    assert!(st.success(), "graceful exit: {st}");
    let (stats, report) = drain_and_verify(reader, &wlog, "acct", inbox_dsn).await?;
    if stats.db_retries == 0 {
        assert_eq!(stats.duplicates as usize, report.duplicates, "{stats:?}");
    } else {
        // A consumer transaction whose COMMIT answer was lost is retried and then found done:
        // one more "duplicate" than the topic holds, never one less.
        assert!(stats.duplicates as usize >= report.duplicates, "{stats:?}");
    }
    Ok((wlog, report, stats))
}

/// Broker path: cuts, refused connections, latency and blackholes while events flow. One relay
/// process rides them all out without restarting; the slot never reaches a transaction written
/// during an outage; finally the relay is SIGKILLed inside a blackhole and the broker is
/// checked to hold every transaction at or before the confirmed LSN.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_path_cut_refuse_blackhole_latency_under_load() -> anyhow::Result<()> {
    let t0 = Instant::now();
    let World {
        env,
        inbox_dsn,
        reader,
        writer,
        config,
        log,
    } = world(Env::start_with_proxies("f_broker").await?).await?;
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    let proxy = env.broker_proxy.as_ref().unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Connections cut, three times in a row.
    for _ in 0..3 {
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    env.caught_up(CAUGHT_UP).await?;
    assert_alive(&mut relay, "cuts");

    // Outages: refused, then blackholed (no RST, silence).
    for mode in [Mode::Down, Mode::Blackhole] {
        proxy.set_mode(mode);
        tokio::time::sleep(SETTLE).await;
        let from = writer.snapshot().txs.len();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let n = assert_slot_held(&env, &writer, from, &format!("{mode:?}")).await?;
        assert!(
            n > 0,
            "no transaction was written during the {mode:?} outage"
        );
        proxy.set_mode(Mode::Pass);
        env.caught_up(CAUGHT_UP).await?;
        assert_alive(&mut relay, &format!("{mode:?}"));
    }

    // Latency on every packet.
    proxy.set_latency(Duration::from_millis(150));
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set_latency(Duration::ZERO);
    env.caught_up(CAUGHT_UP).await?;
    assert_alive(&mut relay, "latency");

    // Killed inside a blackhole: with no relay left to deliver anything, the broker must hold
    // every transaction the slot confirmed.
    proxy.set_mode(Mode::Blackhole);
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.sigkill();
    let confirmed = env.confirmed_lsn().await?;
    let snapshot = writer.snapshot();
    proxy.set_mode(Mode::Pass);
    let (covered, _) = check_slot_against_broker(&env.bootstrap(), TOPIC, &snapshot, confirmed)?;
    assert!(covered > 0);
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let (wlog, report, _) = finish(&env, writer, reader, &inbox_dsn, &mut relay).await?;
    eprintln!(
        "broker path: {} committed, {} records, {} duplicates, slot check covered {covered} transactions; {:?}",
        wlog.committed.len(),
        report.records,
        report.duplicates,
        t0.elapsed()
    );
    Ok(())
}

/// Postgres path (replication and SQL connections of the relay): cut three times, latency,
/// and a 5 s blackhole that then heals. The relay restarts its session by itself each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_path_cut_latency_and_healing_blackhole() -> anyhow::Result<()> {
    let t0 = Instant::now();
    let env = Env::start_with_proxies("f_pgpath").await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let reader = InboxReader::start(&env.bootstrap(), TOPIC, &inbox_dsn);
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    let config = env.config_file()?;
    let mut relay = RelayProcess::spawn(&config, env.dir.path().join("relay.log"))?;
    let proxy = env.pg_proxy.as_ref().unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;

    for _ in 0..3 {
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    env.caught_up(CAUGHT_UP).await?;
    assert_alive(&mut relay, "cuts of the Postgres connections");

    proxy.set_latency(Duration::from_millis(100));
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.set_latency(Duration::ZERO);
    env.caught_up(CAUGHT_UP).await?;
    assert_alive(&mut relay, "Postgres latency");

    proxy.set_mode(Mode::Blackhole);
    tokio::time::sleep(Duration::from_secs(5)).await;
    proxy.set_mode(Mode::Pass);
    env.caught_up(CAUGHT_UP).await?;
    assert_alive(&mut relay, "a healing Postgres blackhole");

    let (wlog, report, _) = finish(&env, writer, reader, &inbox_dsn, &mut relay).await?;
    eprintln!(
        "postgres path: {} committed, {} records, {} duplicates; {:?}",
        wlog.committed.len(),
        report.records,
        report.duplicates,
        t0.elapsed()
    );
    Ok(())
}

/// Postgres crashed (`pg_ctl -m immediate`: SIGQUIT to the postmaster) twice mid-stream and
/// restarted on the same port. The slot may fall back to its last checkpointed position (so
/// more is replayed); the relay reconnects by itself; the writer and the consumer (whose
/// database lives in the same cluster) ride it out too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_immediate_mid_stream() -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut env = Env::start("f_pgcrash").await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let reader = InboxReader::start(&env.bootstrap(), TOPIC, &inbox_dsn);
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    let config = env.config_file()?;
    let mut relay = RelayProcess::spawn(&config, env.dir.path().join("relay.log"))?;
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        tokio::task::block_in_place(|| env.pg.restart())?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_alive(&mut relay, "Postgres crashes");
    let (wlog, report, stats) = finish(&env, writer, reader, &inbox_dsn, &mut relay).await?;
    assert!(wlog.errors > 0, "the crashes did not interrupt the writer");
    eprintln!(
        "postgres crash: {} committed ({} commits of unknown outcome resolved), {} records, {} duplicates, consumer retries {}; {:?}",
        wlog.committed.len(),
        wlog.resolved_unknown,
        report.records,
        report.duplicates,
        stats.db_retries,
        t0.elapsed()
    );
    Ok(())
}

/// The broker is SIGKILLed and restarted empty (tansu memory storage) while the relay holds
/// produced but unacknowledged events: they must reach the new broker. The consumer read
/// everything the old broker acknowledged before it died (the writer pauses until it has, then
/// resumes behind a blackhole so nothing more is acknowledged by the doomed broker), and reads
/// the new broker from its beginning: together, every committed event exactly once in effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_killed_and_restarted_with_events_in_flight() -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut env = Env::start_with_proxies("f_brokerkill").await?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let mut reader = InboxReader::start(&env.bootstrap(), TOPIC, &inbox_dsn);
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    let config = env.config_file()?;
    let mut relay = RelayProcess::spawn(&config, env.dir.path().join("relay.log"))?;
    for round in 0..2 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        writer.pause(true).await;
        env.caught_up(CAUGHT_UP).await?;
        let seen: HashSet<Uuid> = writer.snapshot().committed.keys().copied().collect();
        reader.wait_applied(&seen, Duration::from_secs(60)).await?;
        // The consumer stops before the broker is replaced and starts afresh after (see
        // InboxReader::start_reading: a librdkafka client living through it can crash).
        reader.stop_reading().await?;

        let proxy = env.broker_proxy.as_ref().unwrap();
        proxy.set_mode(Mode::Blackhole);
        tokio::time::sleep(SETTLE).await;
        let from = writer.snapshot().txs.len();
        writer.pause(false).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let in_flight = writer.snapshot().txs.len() - from;
        assert!(in_flight > 0);
        tokio::task::block_in_place(|| env.broker.restart())?;
        // The broker advertises the (blackholed) proxy: the CLI talks to its own port.
        create_topic_on_port(env.broker.port, TOPIC)?;
        assert_slot_held(&env, &writer, from, "broker restart").await?;
        env.broker_proxy.as_ref().unwrap().set_mode(Mode::Pass);
        reader.start_reading();
        eprintln!("round {round}: broker restarted with {in_flight} transactions unacknowledged");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_alive(&mut relay, "a broker restart");
    }
    let (wlog, report, _) = finish(&env, writer, reader, &inbox_dsn, &mut relay).await?;
    eprintln!(
        "broker restart: {} committed, {} records, {} duplicates; {:?}",
        wlog.committed.len(),
        report.records,
        report.duplicates,
        t0.elapsed()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// A blackhole of the relay's *existing* Postgres connections (new ones pass): a silently dead
// path, e.g. a NAT or firewall that dropped its state. Only client-side liveness detection
// (heartbeats with a stall timeout) can recover from it.

/// A TCP proxy whose `freeze()` stops forwarding on every connection open at that moment
/// (both directions, sockets kept open: the peers see silence, no FIN, no RST); connections
/// opened later pass normally.
struct FreezeProxy {
    port: u16,
    next_id: Arc<AtomicU64>,
    frozen_before: Arc<AtomicU64>,
}

impl FreezeProxy {
    async fn start(upstream: u16) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let frozen_before = Arc::new(AtomicU64::new(0));
        let next_id = Arc::new(AtomicU64::new(1));
        let (fb, ids) = (frozen_before.clone(), next_id.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let id = ids.fetch_add(1, AtomicOrdering::SeqCst);
                let fb = fb.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(
                        freeze_pump(cr, sw, id, fb.clone()),
                        freeze_pump(sr, cw, id, fb)
                    );
                });
            }
        });
        Ok(Self {
            port,
            next_id,
            frozen_before,
        })
    }

    /// Silences every connection open now; later ones pass.
    fn freeze(&self) {
        self.frozen_before.store(
            self.next_id.load(AtomicOrdering::SeqCst),
            AtomicOrdering::SeqCst,
        );
    }
}

async fn freeze_pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    id: u64,
    frozen_before: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let frozen = || id < frozen_before.load(AtomicOrdering::SeqCst);
    loop {
        if frozen() {
            // Hold both sockets open forever, forwarding nothing.
            let _keep = (&from, &to);
            std::future::pending::<()>().await;
        }
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = async {
                while !frozen() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            } => continue,
        };
        if frozen() {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The relay's existing Postgres connections (replication and SQL) go silent while new
/// connections work. The server ends its walsender after `wal_sender_timeout` (5 s here),
/// releasing the slot; the relay must notice the silence by itself (heartbeats every 1 s, stall
/// timeout 4 s; every SQL await of the session is bounded), reconnect, and deliver what was
/// written meanwhile. (This test found the unbounded teardown wait that used to hang forever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_blackhole_of_live_connections_is_detected() -> anyhow::Result<()> {
    let pg = testkit::Postgres::start_with(testkit::PgOptions {
        settings: vec![("wal_sender_timeout".into(), "5s".into())],
        ..Default::default()
    })?;
    let broker = testkit::Broker::start()?;
    let mut env = Env::with(pg, broker, "f_pgfreeze").await?;
    env.extra_toml = "[heartbeat]\ninterval_ms = 1000\nstall_timeout_ms = 4000\n".into();
    let freeze = FreezeProxy::start(env.pg.port).await?;
    // Route only the relay through the freezing proxy (the Env proxy field rewrites the DSN).
    let plain = env.toml();
    let dsn = env.pg.dsn(&env.db);
    let frozen_dsn = dsn.replace(&format!(":{}/", env.pg.port), &format!(":{}/", freeze.port));
    let config = env.dir.path().join("outboxd-freeze.toml");
    std::fs::write(&config, plain.replace(&dsn, &frozen_dsn))?;
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let reader = InboxReader::start(&env.bootstrap(), TOPIC, &inbox_dsn);
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    let mut relay = RelayProcess::spawn(&config, env.dir.path().join("relay.log"))?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    env.caught_up(CAUGHT_UP).await?;

    freeze.freeze();
    let frozen_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let wlog_ids: HashSet<Uuid> = writer.snapshot().committed.keys().copied().collect();
    let r = reader
        .wait_applied(&wlog_ids, Duration::from_secs(60))
        .await;
    assert!(
        r.is_ok(),
        "events written after the freeze were not delivered within 60 s: {r:?}\nrelay log:\n{}",
        read_log(&relay.log)
    );
    eprintln!(
        "recovered from a silent Postgres path after {:?}",
        frozen_at.elapsed()
    );
    assert_alive(&mut relay, "a silent Postgres path");
    let (wlog, report, _) = finish(&env, writer, reader, &inbox_dsn, &mut relay).await?;
    eprintln!(
        "postgres freeze: {} committed, {} records, {} duplicates",
        wlog.committed.len(),
        report.records,
        report.duplicates
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Broker-side storage and permission errors, injected per Produce request by librdkafka's mock
// cluster (tansu cannot fail on demand). tests/tests/broker_errors.rs covers the other codes
// (leader changes, timeouts, throttling, NOT_ENOUGH_REPLICAS, INVALID_RECORD, fenced producer).

const MOCK_TOPIC: &str = "outbox.event.acct";

fn ev(agg: &str, v: i64) -> NewEvent {
    NewEvent::new(
        "acct",
        agg,
        v,
        "Deposited",
        serde_json::json!({"amount": v}),
    )
}

/// Commits `e` in its own transaction; returns an LSN at or after its commit.
async fn commit(c: &mut tokio_postgres::Client, e: &NewEvent) -> anyhow::Result<u64> {
    write_events(c, std::slice::from_ref(e), false).await?;
    let r = c
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[])
        .await?;
    Ok(r.get::<_, i64>(0) as u64)
}

/// Event ids on the mock cluster's topic (reads for `wait`, or until `want` are seen).
fn on_topic(bootstrap: &str, want: usize, wait: Duration) -> anyhow::Result<HashSet<String>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("check-{}", Uuid::new_v4()))
        .create()?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(MOCK_TOPIC, 0, rdkafka::Offset::Beginning)?;
    consumer.assign(&tpl)?;
    let mut ids = HashSet::new();
    let deadline = Instant::now() + wait;
    while ids.len() < want && Instant::now() < deadline {
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            let m = m?;
            if let Some(v) = m
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "event_id"))
                .and_then(|h| h.value)
            {
                ids.insert(String::from_utf8_lossy(v).into_owned());
            }
        }
    }
    Ok(ids)
}

async fn parked(env: &Env) -> anyhow::Result<Vec<(String, String, String)>> {
    Ok(env
        .sql()
        .await?
        .query(
            "SELECT event_id, error_class, state FROM outbox_parked ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

async fn mock_setup(
    name: &str,
    extra_toml: &str,
) -> anyhow::Result<(
    Env,
    MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    outboxd::Config,
)> {
    let mut env = Env::start(name).await?;
    env.extra_toml = extra_toml.into();
    // Retry quickly so a test sees many attempts against the failing broker.
    env.kafka_toml = "\"retry.backoff.max.ms\" = \"200\"".into();
    let mock = MockCluster::new(1)?;
    mock.create_topic(MOCK_TOPIC, 1, 1)?;
    let toml = env
        .toml()
        .replace(&env.bootstrap(), &mock.bootstrap_servers());
    let cfg = outboxd::Config::from_toml_and_env(&toml, Vec::<(String, String)>::new())?;
    Ok((env, mock, cfg))
}

/// A full disk on the broker (KAFKA_STORAGE_ERROR on every Produce, for seconds): the event is
/// retried with the same record, never parked, never dropped, and the slot does not pass it
/// until the broker stores it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_storage_error_holds_the_slot_and_never_parks() -> anyhow::Result<()> {
    let (env, mock, cfg) = mock_setup("f_storage", "").await?;
    let bootstrap = mock.bootstrap_servers();
    let relay = Relay::start(cfg);
    let mut c = env.sql().await?;
    let warm = ev("A", 1);
    commit(&mut c, &warm).await?;
    assert_eq!(on_topic(&bootstrap, 1, Duration::from_secs(30))?.len(), 1);
    env.caught_up(CAUGHT_UP).await?;

    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_KAFKA_STORAGE_ERROR; 2000],
    );
    let stuck = [ev("A", 2), ev("B", 1)];
    let mut lsns = Vec::new();
    for e in &stuck {
        lsns.push(commit(&mut c, e).await?);
    }
    // It surfaces: the relay's status row (`outboxd status`, written every 5 s) shows the
    // events pending and ageing.
    let c2 = env.sql().await?;
    eventually(Duration::from_secs(20), || async {
        let row = c2
            .query_opt(
                "SELECT pending_events, oldest_pending_age_s FROM outboxd_status WHERE slot = $1",
                &[&env.slot],
            )
            .await?;
        Ok(row.is_some_and(|r| {
            r.get::<_, Option<i64>>(0).unwrap_or(0) >= 2
                && r.get::<_, Option<f64>>(1).unwrap_or(0.0) >= 1.0
        }))
    })
    .await
    .context("the storage outage must show in outboxd_status (pending events, oldest age)")?;
    let confirmed = env.confirmed_lsn().await?;
    assert!(
        confirmed < lsns[0],
        "the slot passed an event the broker could not store"
    );
    assert!(
        parked(&env).await?.is_empty(),
        "a storage error parked an event"
    );
    assert!(!relay.is_finished(), "the relay stopped on a storage error");
    let seen = on_topic(&bootstrap, 3, Duration::from_secs(1))?;
    assert!(!seen.contains(&stuck[0].event_id.to_string()));

    mock.clear_request_errors(RDKafkaApiKey::Produce);
    let seen = on_topic(&bootstrap, 3, Duration::from_secs(60))?;
    let want: HashSet<String> = [&warm, &stuck[0], &stuck[1]]
        .iter()
        .map(|e| e.event_id.to_string())
        .collect();
    assert_eq!(seen, want, "every event delivered once the disk has room");
    env.caught_up(CAUGHT_UP).await?;
    assert!(parked(&env).await?.is_empty());
    relay.shutdown().await?;
    Ok(())
}

/// Not authorised for the topic (TOPIC_AUTHORIZATION_FAILED): deterministic. With the default
/// policy the event is parked (class `not_authorized`) before the slot passes it, and a later
/// event of the same aggregate is blocked behind it. Authorisation is per topic: librdkafka may
/// refuse the topic's next records locally for a while, so other aggregates' events are either
/// delivered or parked too — never dropped. After the operator's repair (`outboxd parked
/// retry`) every event is on the topic with its original `event_id`, the aggregate in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_authorization_failure_is_parked_before_the_slot_passes_it() -> anyhow::Result<()> {
    let (env, mock, cfg) = mock_setup("f_authz_park", "repair_interval_ms = 200").await?;
    let bootstrap = mock.bootstrap_servers();
    let config = env.dir.path().join("mock.toml");
    std::fs::write(
        &config,
        env.toml()
            .replace(&env.bootstrap(), &mock.bootstrap_servers()),
    )?;
    let relay = Relay::start(cfg);
    let mut c = env.sql().await?;
    let first = ev("A", 1);
    commit(&mut c, &first).await?;
    assert_eq!(on_topic(&bootstrap, 1, Duration::from_secs(30))?.len(), 1);
    env.caught_up(CAUGHT_UP).await?;

    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED],
    );
    let denied = ev("A", 2);
    let lsn = commit(&mut c, &denied).await?;
    eventually(Duration::from_secs(30), || async {
        Ok(env.confirmed_lsn().await? >= lsn)
    })
    .await?;
    // The slot passed it, so it must be parked by now (parking commits before confirming).
    let p = parked(&env).await?;
    assert_eq!(
        p,
        [(
            denied.event_id.to_string(),
            "not_authorized".to_string(),
            "parked".to_string()
        )]
    );
    let follower = ev("A", 3);
    let other = ev("B", 1);
    commit(&mut c, &follower).await?;
    commit(&mut c, &other).await?;
    env.caught_up(CAUGHT_UP).await?;
    let p = parked(&env).await?;
    let seen = on_topic(&bootstrap, 2, Duration::from_secs(3))?;
    assert!(!seen.contains(&denied.event_id.to_string()));
    assert!(
        p.iter()
            .any(|(id, _, st)| *id == follower.event_id.to_string() && st == "blocked"),
        "the same aggregate's next event waits behind the parked one: {p:?}"
    );
    assert!(!seen.contains(&follower.event_id.to_string()));
    let other_parked = p.iter().any(|(id, _, _)| *id == other.event_id.to_string());
    assert!(
        seen.contains(&other.event_id.to_string()) != other_parked,
        "another aggregate's event is delivered or parked, exactly one of them"
    );
    eprintln!(
        "B/1 after the authorisation failure: {}",
        if other_parked {
            "parked (refused locally by librdkafka)"
        } else {
            "delivered"
        }
    );

    // Repair: permission granted, the operator retries the parked heads (same event_id).
    for (id, _, st) in parked(&env).await? {
        if st == "parked" {
            let (code, out) = outboxd_cli(
                &[
                    "parked",
                    "retry",
                    &id,
                    "--reason",
                    "ACL fixed",
                    "--operator",
                    "test",
                ],
                &config,
            );
            assert_eq!(code, 0, "{out}");
        }
    }
    let all: HashSet<String> = [&first, &denied, &follower, &other]
        .iter()
        .map(|e| e.event_id.to_string())
        .collect();
    let seen = on_topic(&bootstrap, all.len(), Duration::from_secs(60))?;
    assert_eq!(seen, all, "everything delivered after the repair");
    let recs = read_topic(&bootstrap, MOCK_TOPIC, 4, Duration::from_secs(30))?;
    let a: Vec<&str> = recs
        .iter()
        .filter(|r| r.key == b"A")
        .map(|r| r.header("aggregate_version"))
        .collect();
    assert_eq!(a, ["1", "2", "3"], "aggregate A in order, each once");
    relay.shutdown().await?;
    Ok(())
}

/// The same error under `on_poison = "halt"`: the relay stops at the event, the slot holds,
/// nothing is parked or dropped; once the permission is granted it continues by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_authorization_failure_halts_when_the_policy_says_so() -> anyhow::Result<()> {
    let (env, mock, cfg) = mock_setup("f_authz_halt", "[policy]\non_poison = \"halt\"\n").await?;
    let bootstrap = mock.bootstrap_servers();
    let relay = Relay::start(cfg);
    let mut c = env.sql().await?;
    commit(&mut c, &ev("A", 1)).await?;
    assert_eq!(on_topic(&bootstrap, 1, Duration::from_secs(30))?.len(), 1);
    env.caught_up(CAUGHT_UP).await?;

    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 2000],
    );
    let denied = ev("A", 2);
    let other = ev("B", 1);
    let lsn = commit(&mut c, &denied).await?;
    commit(&mut c, &other).await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        env.confirmed_lsn().await? < lsn,
        "a halted relay must not confirm past the failing event"
    );
    assert!(parked(&env).await?.is_empty(), "halt must not park");
    assert!(!relay.is_finished(), "halt keeps the relay running");

    mock.clear_request_errors(RDKafkaApiKey::Produce);
    let seen = on_topic(&bootstrap, 3, Duration::from_secs(60))?;
    assert!(seen.contains(&denied.event_id.to_string()));
    assert!(seen.contains(&other.event_id.to_string()));
    env.caught_up(CAUGHT_UP).await?;
    relay.shutdown().await?;
    Ok(())
}
