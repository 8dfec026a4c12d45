//! The README's first command: a full local round trip on a fresh machine.
//!
//! Starts a throwaway Postgres (wal_level=logical) and a tansu broker unless
//! `OUTBOXD_DEMO_DSN` and `OUTBOXD_DEMO_BOOTSTRAP` point at existing ones, applies `sql/` through
//! `outboxd init`, runs the real `outboxd` binary, writes orders and their events in real
//! transactions (one rolled back), prints what arrives on the topic, and tears everything down.

use anyhow::{bail, Context, Result};
use outboxd_testkit::{Broker, Postgres};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() -> Result<()> {
    let outboxd_bin = std::env::args()
        .nth(1)
        .context("usage: outboxd-demo <path to the outboxd binary>")?;
    let mut _servers = None;
    let (dsn, bootstrap) = match (
        std::env::var("OUTBOXD_DEMO_DSN"),
        std::env::var("OUTBOXD_DEMO_BOOTSTRAP"),
    ) {
        (Ok(d), Ok(b)) => {
            println!("using the configured Postgres and broker");
            (d, b)
        }
        _ => {
            println!("starting a throwaway Postgres 15 (wal_level=logical) and a tansu broker...");
            let pg = Postgres::start()?;
            let broker = Broker::start()?;
            pg.create_database("shop").await?;
            let r = (pg.dsn("shop"), broker.bootstrap());
            _servers = Some((pg, broker));
            r
        }
    };
    let dir = std::env::temp_dir().join(format!("outboxd-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("outboxd.toml");
    std::fs::write(
        &config,
        format!(
            "[source]\ndsn = \"{dsn}\"\nslot = \"outboxd_demo\"\n\n[sink]\ntopic = \"outbox.event.{{aggregate_type}}\"\n\n[sink.kafka]\n\"bootstrap.servers\" = \"{bootstrap}\"\n\"compression.type\" = \"lz4\"\n"
        ),
    )?;
    println!("config: {}", config.display());

    let status = Command::new(&outboxd_bin)
        .arg("init")
        .arg("--config")
        .arg(&config)
        .status()?;
    if !status.success() {
        bail!("outboxd init failed");
    }
    let mut relay = Command::new(&outboxd_bin)
        .arg("run")
        .arg("--config")
        .arg(&config)
        .stdin(Stdio::null())
        .spawn()
        .context("start outboxd")?;
    println!("outboxd running (pid {})", relay.id());

    let (mut db, conn) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    db.batch_execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, customer text, total_cents bigint, status text, version bigint)")
        .await?;
    let orders = [
        ("ord-1001", "alice", 4200),
        ("ord-1002", "bob", 1999),
        ("ord-1003", "carol", 500),
    ];
    for (i, (id, customer, total)) in orders.iter().enumerate() {
        // The business row and its event in ONE transaction (R1).
        let tx = db.transaction().await?;
        tx.execute(
            "INSERT INTO orders VALUES ($1, $2, $3, 'placed', 1) ON CONFLICT (id) DO NOTHING",
            &[id, customer, &(*total as i64)],
        )
        .await?;
        let payload = serde_json::json!({"order_id": id, "total_cents": total, "currency": "EUR"});
        tx.execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers) \
             VALUES ($1, 'order', $2, 1, 'OrderPlaced', $3, '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}')",
            &[&uuid::Uuid::now_v7(), id, &payload],
        )
        .await?;
        if i == 2 {
            tx.rollback().await?;
            println!("wrote {id} + OrderPlaced, then ROLLED BACK (must never be published)");
        } else {
            tx.commit().await?;
            println!("wrote {id} + OrderPlaced in one transaction, committed");
        }
    }

    println!("\nreading outbox.event.order from the broker:");
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("group.id", "outboxd-demo")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let partitions = loop {
        let md = consumer.fetch_metadata(Some("outbox.event.order"), Duration::from_secs(5))?;
        let n = md
            .topics()
            .first()
            .map(|t| t.partitions().len())
            .unwrap_or(0);
        if n > 0 || Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for p in 0..partitions as i32 {
        tpl.add_partition_offset("outbox.event.order", p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut got = 0;
    while got < 2 && Instant::now() < deadline {
        if let Some(m) = consumer.poll(Duration::from_millis(200)) {
            let m = m?;
            got += 1;
            println!(
                "  partition {} offset {}  key={}",
                m.partition(),
                m.offset(),
                String::from_utf8_lossy(m.key().unwrap_or_default())
            );
            if let Some(h) = m.headers() {
                for hd in h.iter() {
                    println!(
                        "    {} = {}",
                        hd.key,
                        String::from_utf8_lossy(hd.value.unwrap_or_default())
                    );
                }
            }
            println!(
                "    value: {}",
                String::from_utf8_lossy(m.payload().unwrap_or_default())
            );
        }
    }

    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(relay.id() as i32, libc::SIGTERM) };
    let st = relay.wait()?;
    println!("\noutboxd stopped on SIGTERM ({st}); {got} of 2 committed events arrived, the rolled-back one did not");
    let _ = std::fs::remove_dir_all(&dir);
    if got != 2 {
        bail!("expected 2 events, got {got}");
    }
    println!("demo ok: tearing down Postgres and the broker");
    Ok(())
}
