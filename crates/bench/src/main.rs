//! `outboxd-bench run` — the whole benchmark in one invocation (see docs/benchmarks.md).

use anyhow::Context;
use clap::{Parser, Subcommand};
use outboxd_bench::{bare, bench, chart, poll};

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
    /// Re-render the Markdown and the chart of an earlier run from its JSON report.
    Render {
        #[arg(long)]
        json: std::path::PathBuf,
        #[arg(long)]
        markdown: Option<std::path::PathBuf>,
        #[arg(long)]
        chart: Option<std::path::PathBuf>,
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
                let md = report.markdown();
                println!("{md}");
                if let Some(p) = markdown {
                    std::fs::write(&p, &md).with_context(|| p.display().to_string())?;
                }
                if let Some(p) = chart_path {
                    std::fs::write(&p, chart::latency_svg(&report))
                        .with_context(|| p.display().to_string())?;
                }
                Ok(())
            }
            Cmd::Run(o) => {
                let command = std::env::args().collect::<Vec<_>>().join(" ");
                let (chart_path, json_path, md_path) =
                    (o.chart.clone(), o.json.clone(), o.markdown.clone());
                let report = bench::run(*o, command).await?;
                let md = report.markdown();
                println!("{md}");
                if let Some(p) = md_path {
                    std::fs::write(&p, &md).with_context(|| p.display().to_string())?;
                }
                if let Some(p) = json_path {
                    std::fs::write(&p, serde_json::to_string_pretty(&report)?)
                        .with_context(|| p.display().to_string())?;
                }
                if let Some(p) = chart_path {
                    std::fs::write(&p, chart::latency_svg(&report))
                        .with_context(|| p.display().to_string())?;
                }
                Ok(())
            }
        }
    })
}
