//! The README's first command: the outbox protocol end to end on a fresh machine.
//!
//! Starts a throwaway Postgres (wal_level=logical) and a tansu broker unless
//! `OUTBOXD_DEMO_DSN` and `OUTBOXD_DEMO_BOOTSTRAP` point at existing ones, applies `sql/` through
//! `outboxd init`, runs the real `outboxd` binary, lets the example orders service
//! (`examples/orders`) place and pay orders in real transactions, and the example shipping service
//! (`examples/shipping`, inbox library) apply them exactly once — then replays the whole topic to
//! show duplicates absorbed, and tears everything down. On the way it prints what went over the
//! wire (topic, key, headers and value of the records, read with [`tail`]) and outboxd's own count
//! of published events (from its `/metrics`). outboxd's log lines are forwarded in order, prefixed
//! `outboxd |`, without colour. With [`DemoOptions::keep`] everything stays up until SIGTERM or
//! Ctrl-C, and how to connect is printed.

mod tail;
pub use tail::{tail, TailOptions};

use anyhow::{bail, Context, Result};
use outboxd_inbox::{consumer_config, ConsumerSettings, Inbox, InboxConsumer, RunStats};
use outboxd_testkit::{Broker, Postgres};
use rdkafka::consumer::{Consumer, StreamConsumer};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TOPIC: &str = "outbox.event.order";

/// How the demo ends.
#[derive(Clone, Copy, Debug, Default)]
pub struct DemoOptions {
    /// Leave Postgres, the broker and outboxd running until SIGTERM or SIGINT, printing how to
    /// connect, instead of tearing down.
    pub keep: bool,
}

/// Runs the whole demo with the `outboxd` binary at `outboxd_bin`; Err if any step misbehaves.
pub async fn run(outboxd_bin: &std::path::Path) -> Result<()> {
    run_with(outboxd_bin, DemoOptions::default()).await
}

/// [`run`], with options.
pub async fn run_with(outboxd_bin: &std::path::Path, opts: DemoOptions) -> Result<()> {
    let mut _servers = None;
    let (dsn, shipping_dsn, bootstrap) = match (
        std::env::var("OUTBOXD_DEMO_DSN"),
        std::env::var("OUTBOXD_DEMO_BOOTSTRAP"),
    ) {
        (Ok(d), Ok(b)) => {
            println!("using the configured Postgres and broker");
            (d.clone(), d, b)
        }
        _ => {
            println!("starting a throwaway Postgres 15 (wal_level=logical) and a tansu broker...");
            let pg = Postgres::start()?;
            let broker = Broker::start()?;
            pg.create_database("shop").await?;
            pg.create_database("shipping").await?;
            let r = (pg.dsn("shop"), pg.dsn("shipping"), broker.bootstrap());
            _servers = Some((pg, broker));
            r
        }
    };
    let run_id = std::process::id();
    // In testkit's per-process directory: removed at exit, or swept if the demo is killed.
    let dir = outboxd_testkit::tempdir("demo-")?;
    let config = dir.path().join("outboxd.toml");
    let metrics = format!("127.0.0.1:{}", outboxd_testkit::free_port());
    std::fs::write(
        &config,
        format!(
            "[source]\ndsn = \"{dsn}\"\nslot = \"outboxd_demo\"\n\n[sink]\ntopic = \"outbox.event.{{aggregate_type}}\"\n\n[sink.kafka]\n\"bootstrap.servers\" = \"{bootstrap}\"\n\"compression.type\" = \"lz4\"\n\n[metrics]\nlisten = \"{metrics}\"\n"
        ),
    )?;
    println!("config: {}", config.display());
    let mut init = Command::new(outboxd_bin);
    init.args(["init", "--config"]).arg(&config);
    if !forward_output(&mut init)?.wait()?.success() {
        bail!("outboxd init failed");
    }
    let mut run = Command::new(outboxd_bin);
    run.args(["run", "--config"]).arg(&config);
    let mut relay = forward_output(&mut run).context("start outboxd")?;
    println!("outboxd running (pid {})\n", relay.id());

    // --- the orders service: business row + event in one transaction ---
    let (mut shop, conn) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    shop.batch_execute(example_orders::SCHEMA).await?;
    let ids: Vec<String> = (1..=3).map(|i| format!("ord-{run_id}-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let event_id = outboxd_outbox::new_event_id();
        example_orders::place_order(
            &mut shop,
            event_id,
            id,
            ["alice", "bob", "carol"][i],
            1000 * (i as i64 + 1),
        )
        .await?;
        println!("orders: placed {id} (OrderPlaced {event_id})");
        if i == 0 {
            // The client retries the same command: same event_id, nothing written twice.
            let again = example_orders::place_order(&mut shop, event_id, id, "alice", 1000).await?;
            let n: i64 = shop
                .query_one("SELECT count(*) FROM outbox WHERE aggregate_id = $1", &[id])
                .await?
                .get(0);
            if again != event_id || n != 1 {
                bail!("a retried command was written twice");
            }
            println!("orders: client retried the command: same event_id, still one outbox row");
        }
    }
    for id in &ids[..2] {
        example_orders::pay_order(&mut shop, id, 1).await?;
        println!("orders: paid {id} (OrderPaid, version 2)");
    }
    match example_orders::pay_order(&mut shop, &ids[0], 1).await {
        Err(e) => println!(
            "orders: paying {} again at version 1 is a conflict, nothing committed: {e}",
            ids[0]
        ),
        Ok(_) => bail!("a stale command committed"),
    }

    // --- the shipping service: applies each event exactly once ---
    let (ship_db, conn) = tokio_postgres::connect(&shipping_dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    ship_db.batch_execute(example_shipping::SCHEMA).await?;
    outboxd_inbox::migrate(&ship_db).await?;
    let expected = [
        ("ready to ship", 2),
        ("ready to ship", 2),
        ("awaiting payment", 1),
    ];
    let stats = consume(
        &bootstrap,
        &shipping_dsn,
        &format!("shipping-{run_id}"),
        &ids,
        &expected,
    )
    .await?;
    println!(
        "\nshipping: {} records -> {} applied, {} duplicates",
        stats.records, stats.applied, stats.duplicates
    );
    print_shipments(&ship_db, &ids).await?;

    // --- what went over the wire ---
    println!(
        "\nthe first records on {TOPIC} ({} tail {TOPIC} --bootstrap {bootstrap}):",
        outboxd_bin.display()
    );
    let tail_opts = TailOptions {
        max: Some(3),
        idle: Duration::from_secs(2),
        ..TailOptions::new(&bootstrap, TOPIC)
    };
    let shown = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        tail(&tail_opts, &mut out).map(|n| (n, out))
    })
    .await??;
    print!("{}", String::from_utf8_lossy(&shown.1));
    if shown.0 == 0 {
        bail!("tail printed no record of {TOPIC}");
    }
    match published_count(&metrics).await {
        Ok(n) => println!("outboxd's own count (/metrics outboxd_events_published_total): {n}"),
        Err(e) => bail!("read outboxd's metrics at {metrics}: {e:#}"),
    }

    // --- a replay of the whole topic (new consumer group): every record is a duplicate ---
    println!("\nreplaying the topic from the beginning with a new consumer group...");
    let replay = consume(
        &bootstrap,
        &shipping_dsn,
        &format!("shipping-replay-{run_id}"),
        &ids,
        &expected,
    )
    .await?;
    println!(
        "shipping: {} records -> {} applied, {} duplicates (no effect twice)",
        replay.records, replay.applied, replay.duplicates
    );
    print_shipments(&ship_db, &ids).await?;

    if stats.applied != 5 || replay.applied != 0 {
        bail!("expected 5 effects and none on replay");
    }
    if opts.keep {
        println!(
            "\ndemo ok; kept running (demo pid {run_id}):\n  \
             Postgres:  psql '{dsn}'   (shipping: '{shipping_dsn}')\n  \
             broker:    {bootstrap}   read it: {bin} tail {TOPIC} --bootstrap {bootstrap} --follow\n  \
             outboxd:   pid {}, config {}, metrics http://{metrics}/metrics\n             \
             {bin} status --config {}\n\
             to stop: kill {run_id}   (or Ctrl-C in the foreground)",
            relay.id(),
            config.display(),
            config.display(),
            bin = outboxd_bin.display(),
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(relay.id() as i32, libc::SIGTERM) };
    let st = relay.wait()?;
    println!("\noutboxd stopped on SIGTERM ({st})");
    drop(dir);
    println!("demo ok: tearing down Postgres and the broker");
    Ok(())
}

/// Spawns `cmd` with its stdout and stderr forwarded line by line to ours, prefixed
/// `outboxd | `, so its log lines stay whole and in order with the demo's own output (and
/// `NO_COLOR` keeps colour codes out even when the demo runs on a terminal).
fn forward_output(cmd: &mut Command) -> Result<std::process::Child> {
    use std::io::BufRead;
    let mut child = cmd
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let out = child
        .stdout
        .take()
        .map(|o| Box::new(o) as Box<dyn std::io::Read + Send>);
    let err = child
        .stderr
        .take()
        .map(|e| Box::new(e) as Box<dyn std::io::Read + Send>);
    for stream in [out, err].into_iter().flatten() {
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stream)
                .lines()
                .map_while(Result::ok)
            {
                println!("  outboxd | {line}");
            }
        });
    }
    Ok(child)
}

/// outboxd's own count of published events: the sum of `outboxd_events_published_total` on its
/// `/metrics` endpoint at `addr`.
async fn published_count(addr: &str) -> Result<u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut body)).await??;
    let mut sum = 0.0;
    let mut seen = false;
    for l in body.lines() {
        if l.starts_with("outboxd_events_published_total") {
            if let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
                sum += v;
                seen = true;
            }
        }
    }
    if !seen {
        bail!("no outboxd_events_published_total in the response");
    }
    Ok(sum as u64)
}

/// Runs the shipping consumer until the shipments reach the expected state (or 60 s pass).
async fn consume(
    bootstrap: &str,
    db_dsn: &str,
    group: &str,
    ids: &[String],
    expected: &[(&str, i32)],
) -> Result<RunStats> {
    let (db, conn) = tokio_postgres::connect(db_dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let (probe, conn) = tokio_postgres::connect(db_dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let kafka: StreamConsumer = consumer_config(bootstrap, group)
        .set("session.timeout.ms", "6000")
        .create()?;
    kafka.subscribe(&[TOPIC])?;
    let mut consumer = InboxConsumer::new(
        Inbox::new(example_shipping::Shipping),
        db,
        kafka,
        ConsumerSettings::default(),
    );
    let ids = ids.to_vec();
    let expected: Vec<(String, i32)> = expected.iter().map(|(s, n)| (s.to_string(), *n)).collect();
    let done = async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        // Give a replay time to read everything, even though the state is already reached.
        tokio::time::sleep(Duration::from_secs(4)).await;
        while Instant::now() < deadline {
            let mut ok = true;
            for (id, (status, updates)) in ids.iter().zip(&expected) {
                let row = probe
                    .query_opt(
                        "SELECT status, updates FROM shipments WHERE order_id = $1",
                        &[id],
                    )
                    .await
                    .ok()
                    .flatten();
                ok &= row.is_some_and(|r| {
                    r.get::<_, String>(0) == *status && r.get::<_, i32>(1) == *updates
                });
            }
            if ok {
                tokio::time::sleep(Duration::from_secs(1)).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    Ok(consumer.run(done).await?)
}

async fn print_shipments(db: &tokio_postgres::Client, ids: &[String]) -> Result<()> {
    for r in db
        .query("SELECT order_id, customer, status, updates FROM shipments WHERE order_id = ANY($1) ORDER BY order_id", &[&ids])
        .await?
    {
        println!(
            "  shipment {:<16} {:<6} {:<17} updates={}",
            r.get::<_, String>(0),
            r.get::<_, Option<String>>(1).unwrap_or_default(),
            r.get::<_, String>(2),
            r.get::<_, i32>(3)
        );
    }
    Ok(())
}
