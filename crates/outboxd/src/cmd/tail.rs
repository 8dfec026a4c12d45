//! `outboxd tail TOPIC`: prints a topic's records — partition, offset, key, headers, value — for
//! an operator checking what the relay published.
//!
//! Read-only: every partition is assigned by hand (no consumer-group join, so no rebalance of
//! anyone's group and no wait for one), and nothing is committed. With `--config` the connection
//! settings of `[sink.kafka]` are used (TLS, SASL, their `.file` secrets), without the
//! producer-only properties; `--bootstrap` and `-X key=value` add to or replace them.

use crate::config::Config;
use anyhow::{Context, Result};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `outboxd tail`'s arguments.
#[derive(clap::Args, Debug)]
pub struct TailArgs {
    /// The topic to read.
    pub topic: String,
    /// Broker address `host:port[,host:port…]` (default: `bootstrap.servers` of the config).
    #[arg(long, short)]
    pub bootstrap: Option<String>,
    /// Take the connection settings (TLS, SASL) from this config's `[sink.kafka]`.
    #[arg(long, short, env = "OUTBOXD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Extra librdkafka property `key=value` (repeatable), e.g. `-X security.protocol=SSL`.
    #[arg(short = 'X', value_parser = parse_kv)]
    pub property: Vec<(String, String)>,
    /// Stop after this many records.
    #[arg(long, short = 'n')]
    pub max: Option<usize>,
    /// Start at the end of each partition: only records produced from now on.
    #[arg(long)]
    pub from_end: bool,
    /// Keep waiting for new records (until Ctrl-C) instead of stopping once the topic is quiet.
    #[arg(long, short)]
    pub follow: bool,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

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

/// `outboxd tail`: prints the records, then how many on stderr.
pub fn main(args: TailArgs) -> Result<()> {
    let mut properties = Vec::new();
    let mut bootstrap = args.bootstrap.clone();
    if let Some(path) = &args.config {
        let cfg = Config::load(path).with_context(|| format!("config {}", path.display()))?;
        let cc = crate::relay::kafka::consumer::config(&cfg, "outboxd-tail", "outboxd-tail")
            .map_err(anyhow::Error::msg)?;
        for (k, v) in cc.config_map() {
            match k {
                "bootstrap.servers" => bootstrap = bootstrap.or(Some(v.to_string())),
                "group.id" | "client.id" | "enable.auto.commit" | "enable.auto.offset.store" => {}
                _ => properties.push((k.to_string(), v.to_string())),
            }
        }
    }
    let bootstrap =
        bootstrap.context("a broker is needed: --bootstrap HOST:PORT or --config FILE")?;
    properties.extend(args.property);
    let opts = TailOptions {
        properties,
        max: args.max,
        from_end: args.from_end,
        follow: args.follow,
        ..TailOptions::new(&bootstrap, &args.topic)
    };
    let n = tail(&opts, &mut std::io::stdout().lock())?;
    eprintln!("{n} records");
    Ok(())
}

/// Writes one line per record to `out`; returns how many were written.
pub fn tail(opts: &TailOptions, out: &mut dyn Write) -> Result<usize> {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &opts.bootstrap)
        // librdkafka wants a group.id to assign, but the group is never joined (no subscribe)
        // and nothing is committed to it.
        .set("group.id", format!("outboxd-tail-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    for (k, v) in &opts.properties {
        cc.set(k, v);
    }
    let consumer: BaseConsumer = cc.create().context("create the reader")?;
    let partitions = assign_every_partition(&consumer, &opts.topic, opts.from_end)
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
                let headers: Vec<String> = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| {
                                let value = printable(h.value.unwrap_or_default());
                                format!("{}={value}", printable(h.key.as_bytes()))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                writeln!(
                    out,
                    "{} [{}] @{} key={} headers: {}\n  value: {}",
                    m.topic(),
                    m.partition(),
                    m.offset(),
                    printable(m.key().unwrap_or_default()),
                    headers.join(" "),
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

/// Assigns every partition of `topic` (from its start, or its end), waiting up to 15 s for the
/// broker's metadata to list some (a broker may still be starting); returns how many.
fn assign_every_partition(consumer: &BaseConsumer, topic: &str, from_end: bool) -> Result<usize> {
    let deadline = Instant::now() + Duration::from_secs(15);
    let partitions = loop {
        let listed = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .map(|md| md.topics().first().map_or(0, |t| t.partitions().len()));
        match listed {
            Ok(n) if n > 0 => break n,
            Ok(_) if Instant::now() >= deadline => return Ok(0),
            Err(e) if Instant::now() >= deadline => return Err(e.into()),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        let offset = if from_end {
            let (_, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(5))?;
            Offset::Offset(high)
        } else {
            Offset::Beginning
        };
        tpl.add_partition_offset(topic, p, offset)?;
    }
    consumer.assign(&tpl)?;
    Ok(partitions)
}

/// Text with control characters escaped: a record must not drive the reader's terminal.
fn printable(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .chars()
        .flat_map(|c| {
            let esc: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            esc
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(super::printable(b"a\x1b[2Jb\n"), "a\\u{1b}[2Jb\\n");
    }
}
