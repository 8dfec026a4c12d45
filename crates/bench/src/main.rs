//! `outboxd-bench run` — the whole benchmark in one invocation (see docs/benchmarks.md);
//! `outboxd-bench tables` — many outbox tables through one relay against one relay per table;
//! `outboxd-bench standby` — the slot on a physical standby against the slot on the primary;
//! `outboxd-bench mqbridge` — outboxd against mq-bridge, commit → consumer at light load;
//! `outboxd-bench otel` — what OpenTelemetry trace export costs, backlog and live.

use anyhow::Context;
use clap::{Parser, Subcommand};
use outboxd_bench::{bare, bench, chart, mqbridge, otel, poll, standby, tables};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "outboxd-bench",
    about = "outboxd vs the single-slot ceiling vs a polling relay"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start Postgres and a broker, run every contestant, print the report.
    Run(Box<bench::Opts>),
    /// Many outbox tables through one relay against one relay per table (issue 30).
    Tables(Box<tables::Opts>),
    /// Decoding on a standby against on the primary: primary CPU and latency (issue 31).
    Standby(Box<standby::Opts>),
    /// outboxd against mq-bridge at light load, commit → consumer (issue 28).
    Mqbridge(Box<mqbridge::Opts>),
    /// Tracing off / all sampled / 1 % / receiver down: backlog rate, CPU, spans, commit→ack
    /// (issue 43).
    Otel(Box<otel::Opts>),
    /// Backlog rate of a bytea outbox (1 KiB binary payloads) against jsonb (issue 46).
    Bytea(Box<outboxd_bench::bytea::Opts>),
    /// Re-render the Markdown and the chart of an earlier run from its JSON report.
    Render {
        #[arg(long)]
        json: PathBuf,
        #[arg(long)]
        markdown: Option<PathBuf>,
        #[arg(long)]
        chart: Option<PathBuf>,
    },
    /// (internal) The bare replication reader used as a ceiling.
    #[command(hide = true)]
    BareReader(bare::BareArgs),
    /// (internal) The polling relay baseline.
    #[command(hide = true)]
    PollRelay(poll::PollArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The bare reader is the ceiling, so it gets the cheapest runtime: one thread, no
    // cross-thread wake-up per replication message. The bench itself uses two workers.
    let rt = match cli.cmd {
        Cmd::BareReader(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        _ => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
    };
    rt.block_on(async move {
        match cli.cmd {
            Cmd::BareReader(a) => bare::run(a).await,
            Cmd::PollRelay(a) => poll::run(a).await,
            Cmd::Render {
                json,
                markdown,
                chart: chart_path,
            } => {
                let report: outboxd_bench::report::Report = serde_json::from_slice(
                    &std::fs::read(&json).with_context(|| json.display().to_string())?,
                )?;
                let svg = chart_path.map(|p| (p, chart::latency_svg(&report)));
                write_out(&report.markdown(), markdown, None, svg)
            }
            Cmd::Bytea(o) => {
                println!("{}", outboxd_bench::bytea::run(*o).await?);
                Ok(())
            }
            Cmd::Tables(o) => {
                let out = o.out.clone();
                let report = tables::run(*o, command_line()).await?;
                emit(out, &report, report.markdown())
            }
            Cmd::Standby(o) => {
                let out = o.out.clone();
                let report = standby::run(*o, command_line()).await?;
                emit(out, &report, report.markdown())
            }
            Cmd::Otel(o) => {
                let out = o.out.clone();
                let report = otel::run(*o, command_line()).await?;
                emit(out, &report, report.markdown())
            }
            Cmd::Mqbridge(o) => {
                let out = o.out.clone();
                let report = mqbridge::run(*o, command_line()).await?;
                emit(out, &report, report.markdown())
            }
            Cmd::Run(o) => {
                let (chart_path, json_path, md_path) =
                    (o.chart.clone(), o.json.clone(), o.markdown.clone());
                let report = bench::run(*o, command_line()).await?;
                let json = json_of(json_path, &report)?;
                let svg = chart_path.map(|p| (p, chart::latency_svg(&report)));
                write_out(&report.markdown(), md_path, json, svg)
            }
        }
    })
}

/// The report as pretty JSON, when a path asks for it.
fn json_of(
    path: Option<PathBuf>,
    report: &impl serde::Serialize,
) -> anyhow::Result<Option<(PathBuf, String)>> {
    Ok(match path {
        Some(p) => Some((p, serde_json::to_string_pretty(report)?)),
        None => None,
    })
}

/// Prints a relay-process bench's report (`tables`, `standby`, `mqbridge`, `otel`) and writes its
/// JSON and Markdown where asked.
fn emit(out: tables::OutOpts, report: &impl serde::Serialize, md: String) -> anyhow::Result<()> {
    let json = json_of(out.json, report)?;
    write_out(&md, out.markdown, json, None)
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// Prints the Markdown and writes it, the JSON and the chart where asked.
fn write_out(
    md: &str,
    md_path: Option<PathBuf>,
    json: Option<(PathBuf, String)>,
    svg: Option<(PathBuf, String)>,
) -> anyhow::Result<()> {
    println!("{md}");
    let files = md_path.map(|p| (p, md.to_string())).into_iter();
    for (p, text) in files.chain(json).chain(svg) {
        std::fs::write(&p, text).with_context(|| p.display().to_string())?;
    }
    Ok(())
}
