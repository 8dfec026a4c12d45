//! `outboxd-demo tail`: prints the records of a topic — partition, offset, key, headers, value.
//!
//! Why not kcat or a console consumer: Debian's kcat is refused by tansu, and a consumer-group
//! join costs a rebalance (seconds). This reads by manual assignment of every partition
//! ([`outboxd_testkit::kafka::assign_all`]), commits nothing, joins no group, and so works the
//! same against tansu and a real Kafka (pass TLS/SASL settings as librdkafka properties).

use anyhow::{Context, Result};
use outboxd_testkit::kafka::{assign_all, StartAt};
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::{Headers, Message};
use rdkafka::ClientConfig;
use std::io::Write;
use std::time::{Duration, Instant};

/// What to read and how long.
#[derive(Clone, Debug)]
pub struct TailOptions {
    /// `host:port[,host:port…]`.
    pub bootstrap: String,
    pub topic: String,
    /// Extra librdkafka properties (`security.protocol`, `sasl.*`, `ssl.*`, …).
    pub properties: Vec<(String, String)>,
    /// Stop after this many records (`None`: no limit).
    pub max: Option<usize>,
    /// Start at the end (only records produced from now on) instead of the beginning.
    pub from_end: bool,
    /// Keep waiting for new records instead of stopping once the topic is quiet for `idle`.
    pub follow: bool,
    /// How long the topic must stay quiet before a non-following tail stops.
    pub idle: Duration,
}

impl TailOptions {
    pub fn new(bootstrap: &str, topic: &str) -> Self {
        Self {
            bootstrap: bootstrap.into(),
            topic: topic.into(),
            properties: vec![],
            max: None,
            from_end: false,
            follow: false,
            idle: Duration::from_secs(3),
        }
    }
}

/// Writes one line per record to `out`; returns how many were written.
pub fn tail(opts: &TailOptions, out: &mut dyn Write) -> Result<usize> {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &opts.bootstrap)
        // librdkafka wants a group.id to assign, but the group is never joined (no subscribe)
        // and nothing is committed to it.
        .set(
            "group.id",
            format!("outboxd-demo-tail-{}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    for (k, v) in &opts.properties {
        cc.set(k, v);
    }
    let consumer: BaseConsumer = cc.create().context("create the reader")?;
    let start = if opts.from_end {
        StartAt::End
    } else {
        StartAt::Beginning
    };
    let partitions = assign_all(&consumer, &opts.topic, start, Duration::from_secs(15))
        .with_context(|| format!("read the partitions of {}", opts.topic))?;
    if partitions == 0 {
        anyhow::bail!(
            "topic {} has no partitions (does it exist on {}?)",
            opts.topic,
            opts.bootstrap
        );
    }
    let mut n = 0;
    let mut last = Instant::now();
    while opts.max.is_none_or(|m| n < m) {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let headers = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| {
                                format!(
                                    "{}={}",
                                    printable(h.key.as_bytes()),
                                    printable(h.value.unwrap_or_default())
                                )
                            })
                            .collect::<Vec<_>>()
                            .join(" ")
                    })
                    .unwrap_or_default();
                writeln!(
                    out,
                    "{} [{}] @{} key={} headers: {}\n  value: {}",
                    m.topic(),
                    m.partition(),
                    m.offset(),
                    printable(m.key().unwrap_or_default()),
                    headers,
                    printable(m.payload().unwrap_or_default()),
                )?;
                out.flush()?;
                n += 1;
                last = Instant::now();
            }
            Some(Err(e)) => return Err(e).context("read"),
            None if !opts.follow && last.elapsed() >= opts.idle => break,
            None => {}
        }
    }
    Ok(n)
}

/// Text with control characters escaped: a record must not drive the reader's terminal.
fn printable(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .chars()
        .flat_map(|c| {
            let keep = !c.is_control();
            let esc: Vec<char> = if keep {
                vec![c]
            } else {
                c.escape_default().collect()
            };
            esc
        })
        .collect()
}
