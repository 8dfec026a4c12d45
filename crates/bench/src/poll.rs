//! The polling baseline: what teams build instead of a WAL relay, written fairly.
//!
//! One worker (more would break per-aggregate order, which outboxd keeps) repeats: in one
//! transaction, `SELECT … FOR UPDATE SKIP LOCKED` a batch of unsent rows through a partial index,
//! produce every row (idempotent producer, `acks=all`, librdkafka's default linger), wait for every
//! acknowledgement, mark the batch sent, commit. Durability equals outboxd's: a row is marked sent
//! only after the broker acknowledged it.

use crate::procstat;
use anyhow::{bail, Context, Result};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args, Debug, Clone)]
pub struct PollArgs {
    #[arg(long)]
    pub dsn: String,
    #[arg(long)]
    pub bootstrap: String,
    #[arg(long)]
    pub topic: String,
    /// Rows per poll (and per transaction).
    #[arg(long, default_value_t = 500)]
    pub batch: i64,
    /// Sleep after a poll that found nothing.
    #[arg(long, default_value_t = 10)]
    pub idle_ms: u64,
    #[arg(long, default_value = "5")]
    pub linger_ms: String,
    /// Exit at the first empty poll after having sent something (throughput runs).
    #[arg(long)]
    pub exit_when_empty: bool,
    /// Print `L <version> <created_at→ack µs>` for every row (latency runs).
    #[arg(long)]
    pub report_latency: bool,
}

/// The last line the relay prints (`R {json}`).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct PollSummary {
    pub events: u64,
    /// From the first non-empty poll to the commit of the last batch.
    pub secs: f64,
    pub backend_cpu_s: f64,
}

const SELECT: &str = "SELECT id, event_id::text, aggregate_type, aggregate_id, \
    aggregate_version::text, event_type, schema_version::text, payload::text, headers::text, \
    (extract(epoch FROM created_at) * 1000000)::bigint \
    FROM outbox_poll WHERE sent_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";
const MARK: &str = "UPDATE outbox_poll SET sent_at = now() WHERE id = ANY($1)";

fn producer(a: &PollArgs) -> Result<FutureProducer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", &a.bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", &a.linger_ms)
        .set("message.timeout.ms", "0")
        .set("queue.buffering.max.messages", "1000000")
        .set("client.id", "polling-relay")
        .create()?)
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

pub async fn run(a: PollArgs) -> Result<()> {
    let (mut client, conn) = tokio_postgres::connect(&a.dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let backend_pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let backend_cpu0 = procstat::cpu_secs(backend_pid as u32).unwrap_or(0.0);
    if a.report_latency {
        // The bench charges this backend's CPU to the polling relay (see latency::PollingLive).
        println!("P {backend_pid}");
    }
    let select = client.prepare(SELECT).await?;
    let mark = client.prepare(MARK).await?;
    let producer = producer(&a)?;
    // SIGTERM is honoured between batches, also while a backlog is being worked off.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let s = stop.clone();
    tokio::spawn(async move {
        term.recv().await;
        s.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let stdout = std::io::stdout();
    let (mut events, mut first, mut last) = (0u64, None::<Instant>, Instant::now());
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let tx = client.transaction().await?;
        let rows = tx.query(&select, &[&a.batch]).await?;
        if rows.is_empty() {
            tx.commit().await?;
            if a.exit_when_empty && events > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(a.idle_ms)).await;
            continue;
        }
        first.get_or_insert_with(Instant::now);
        let mut pending = Vec::with_capacity(rows.len());
        for r in &rows {
            let get = |i: usize| -> &str { r.get(i) };
            let mut h = OwnedHeaders::new_with_capacity(6);
            for (k, i) in [
                ("event_id", 1),
                ("event_type", 5),
                ("aggregate_type", 2),
                ("aggregate_id", 3),
                ("aggregate_version", 4),
                ("schema_version", 6),
            ] {
                h = h.insert(Header {
                    key: k,
                    value: Some(get(i)),
                });
            }
            if let Some(extra) = r.get::<_, Option<&str>>(8) {
                let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(extra)?;
                for (k, v) in &map {
                    let v = v.as_str().map(str::to_string).unwrap_or(v.to_string());
                    h = h.insert(Header {
                        key: k,
                        value: Some(&v),
                    });
                }
            }
            let created_us: i64 = r.get(9);
            let mut rec = FutureRecord::to(&a.topic)
                .key(get(3))
                .payload(get(7))
                .headers(h)
                .timestamp(created_us / 1000);
            let fut = loop {
                match producer.send_result(rec) {
                    Ok(f) => break f,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        rec = back;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err((e, _)) => bail!("produce: {e}"),
                }
            };
            pending.push((fut, created_us));
        }
        let mut lat = String::new();
        for (i, (fut, created_us)) in pending.into_iter().enumerate() {
            match fut.await {
                Ok(Ok(_)) => {}
                Ok(Err((e, _))) => bail!("delivery failed: {e}"),
                Err(_) => bail!("delivery future cancelled"),
            }
            if a.report_latency {
                let v: &str = rows[i].get(4);
                lat.push_str(&format!("L {v} {}\n", now_us() - created_us));
            }
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        tx.execute(&mark, &[&ids]).await?;
        tx.commit().await.context("commit batch")?;
        last = Instant::now();
        events += rows.len() as u64;
        if !lat.is_empty() {
            stdout.lock().write_all(lat.as_bytes())?;
        }
    }
    let summary = PollSummary {
        events,
        secs: first.map_or(0.0, |f| (last - f).as_secs_f64()),
        backend_cpu_s: procstat::cpu_secs(backend_pid as u32).unwrap_or(0.0) - backend_cpu0,
    };
    let mut out = stdout.lock();
    writeln!(out, "R {}", serde_json::to_string(&summary)?)?;
    out.flush()?;
    Ok(())
}
