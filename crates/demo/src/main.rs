//! `outboxd-demo [--keep] <path to outboxd>`: the README demo (see the library docs;
//! `scripts/demo.sh` runs it). `outboxd-demo tail <topic>`: print a topic's records.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(about = "outboxd end to end on a fresh machine, and a topic reader")]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// Leave Postgres, the broker and outboxd running after the demo, until SIGTERM or Ctrl-C.
    #[arg(long)]
    keep: bool,
    /// The outboxd binary to run.
    outboxd: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the records of a topic (partition, offset, key, headers, value), read by manual
    /// assignment of every partition: no consumer group, nothing committed.
    Tail {
        topic: String,
        /// Broker address(es).
        #[arg(long, env = "OUTBOXD_DEMO_BOOTSTRAP", default_value = "127.0.0.1:9092")]
        bootstrap: String,
        /// A librdkafka property, e.g. `-X security.protocol=SASL_SSL` (repeatable).
        #[arg(short = 'X', value_parser = parse_kv)]
        property: Vec<(String, String)>,
        /// Stop after N records.
        #[arg(short = 'n', long)]
        max: Option<usize>,
        /// Only records produced from now on.
        #[arg(long)]
        from_end: bool,
        /// Keep waiting for records (otherwise stop once the topic is quiet for 3 s).
        #[arg(short, long)]
        follow: bool,
    },
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::Tail {
            topic,
            bootstrap,
            property,
            max,
            from_end,
            follow,
        }) => {
            let opts = outboxd_demo::TailOptions {
                properties: property,
                max,
                from_end,
                follow,
                idle: Duration::from_secs(3),
                ..outboxd_demo::TailOptions::new(&bootstrap, &topic)
            };
            let n = tokio::task::spawn_blocking(move || {
                outboxd_demo::tail(&opts, &mut std::io::stdout().lock())
            })
            .await??;
            eprintln!("{n} records");
            Ok(())
        }
        None => {
            let bin = cli.outboxd.ok_or_else(|| {
                anyhow::anyhow!("usage: outboxd-demo [--keep] <path to the outboxd binary>")
            })?;
            outboxd_demo::run_with(&bin, outboxd_demo::DemoOptions { keep: cli.keep }).await
        }
    }
}
