//! The `outboxd` command line: `run`, `init`, `check`.

pub(crate) mod admin;
pub(crate) mod alerts;
pub(crate) mod check;
pub(crate) mod check_jobs;
pub(crate) mod check_line;
pub(crate) mod manual;
pub(crate) mod parked;
pub(crate) mod privileges;
pub(crate) mod probe;
pub(crate) mod recover;
pub(crate) mod replay;
pub(crate) mod shadow;
pub(crate) mod status;
pub mod tail;

use crate::config::{Config, LogFormat};
use anyhow::Context;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use tokio::sync::watch;

#[derive(Parser, Debug)]
#[command(
    name = "outboxd",
    version,
    about = "Transactional outbox relay: Postgres WAL → Kafka"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Stream committed outbox rows to Kafka until SIGTERM/SIGINT.
    Run(ConfigArg),
    /// Create the outbox table, publication and slot when missing (idempotent).
    Init(ConfigArg),
    /// Validate config, connectivity, wal_level, publication, slot, privileges and the broker.
    Check(ConfigArg),
    /// Slot, active relay, lag, oldest pending age, errors, heartbeat age, parked events.
    Status {
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON (for scripts and monitoring) instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Print Prometheus alerting rules generated from the `[alerts]` section.
    Alerts(ConfigArg),
    /// Republish what a lost replication slot never streamed, from the outbox table.
    ///
    /// Without --since: the gap outboxd detected (slot dropped, invalidated, failover, restore),
    /// as `run` does by itself under on_slot_loss = "recover". With --since: every outbox row
    /// created since then (e.g. after restoring into a new cluster). Stop the relay first.
    Recover {
        #[command(flatten)]
        config: ConfigArg,
        /// Republish rows created at or after this time (RFC 3339, e.g. 2026-12-03T10:00:00Z).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Print the range and counts per event type; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete delivered outbox rows older than cleanup.retention, in small batches.
    ///
    /// Never a row that may be undelivered (every slot's delivery mark in outboxd_slot_state)
    /// or inside source.recovery_window; on a partitioned outbox, drops whole partitions.
    /// For cron; `cleanup.every` runs the same inside `outboxd run`.
    Cleanup {
        #[command(flatten)]
        config: ConfigArg,
        /// Print the cutoff and how many rows would go; delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Connect as this role (needs DELETE on the outbox table) instead of cleanup.dsn or
        /// source.dsn.
        #[arg(long = "dsn", env = "OUTBOXD_CLEANUP_DSN", hide_env_values = true)]
        dsn: Option<String>,
    },
    /// Shadow mode (shadow.enabled): what the comparison with the legacy path found.
    Shadow {
        #[command(flatten)]
        config: ConfigArg,
        #[command(subcommand)]
        cmd: crate::cmd::shadow::ShadowCmd,
    },
    /// Republish chosen events with their original event_ids (dry run unless --execute).
    ///
    /// Select exact event ids (arguments or --ids-file) or a range --since T --until T,
    /// narrowed by --event-type, --aggregate-type, --aggregate-id. Without --execute it prints
    /// counts per event type and topic, the time span, ids not found, warnings and the consumer
    /// groups of each topic with their lag; nothing is sent. Large or side-effecting replays need `replay request`, `replay approve` by
    /// another database role, and `replay run`. Every executed replay is audited.
    Replay {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        args: Box<crate::cmd::replay::ReplayArgs>,
    },
    /// Inspect and repair parked (poison) events.
    Parked {
        #[command(flatten)]
        config: ConfigArg,
        #[command(subcommand)]
        cmd: crate::cmd::parked::ParkedCmd,
    },
    /// Print a topic's records (partition, offset, key, headers, value); reads only, joins no
    /// consumer group, commits nothing.
    Tail(crate::cmd::tail::TailArgs),
    /// Ask a running relay whether it serves or stands by ready to take over (exit 0) or not
    /// (exit 1): for container and Kubernetes probes.
    Probe(crate::cmd::probe::ProbeArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page, or write one per command into a directory.
    Man(crate::cmd::manual::ManArgs),
}

#[derive(clap::Args, Debug)]
pub struct ConfigArg {
    /// TOML config file; every key can be overridden by `OUTBOXD_<SECTION>_<KEY>`.
    /// Global: goes before or after a subcommand (`parked list --config F`).
    #[arg(long, short, env = "OUTBOXD_CONFIG", global = true)]
    pub config: Option<PathBuf>,
}

/// `default` applies unless `RUST_LOG` is set.
fn init_logging(format: LogFormat, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only for a person at a terminal (and never with NO_COLOR, no-color.org): files,
    // pipes and log collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
    }
}

/// Entry point of the binary (also used by the test crate's copy of the binary).
pub fn main() -> ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    let version: &'static str = Box::leak(long_version().into_boxed_str());
    let matches = Cli::command().long_version(version).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Commands that need no config and no runtime.
    let cli = match cli.cmd {
        Cmd::Tail(args) => return report(crate::cmd::tail::main(args).map(|_| ExitCode::SUCCESS)),
        Cmd::Probe(args) => return crate::cmd::probe::main(&args),
        Cmd::Completions { shell } => {
            crate::cmd::manual::completions(shell);
            return ExitCode::SUCCESS;
        }
        Cmd::Man(args) => {
            return report(crate::cmd::manual::man(&args).map(|_| ExitCode::SUCCESS));
        }
        cmd => Cli { cmd },
    };
    // One thread: the replication client's worker task and the pipeline hand every event over
    // without a thread switch (measured: half the CPU per event of a two-worker runtime, see
    // docs/benchmarks.md). librdkafka keeps its own threads.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    report(rt.block_on(dispatch(cli)))
}

fn report(r: anyhow::Result<ExitCode>) -> ExitCode {
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outboxd: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// `outboxd --version`: the version, librdkafka's, and what it was built with (TLS, SASL
/// mechanisms, OIDC), so an operator can tell before connecting whether a cluster is reachable.
fn long_version() -> String {
    let (_, librdkafka) = rdkafka::util::get_rdkafka_version();
    format!(
        "{}\nlibrdkafka {librdkafka}\nbuilt-in: {}",
        env!("CARGO_PKG_VERSION"),
        builtin_features()
    )
}

/// librdkafka's `builtin.features` (e.g. `ssl,sasl_plain,sasl_scram,sasl_oauthbearer,…`).
pub fn builtin_features() -> String {
    rdkafka::ClientConfig::new()
        .create_native_config()
        .and_then(|c| c.get("builtin.features"))
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let path = match &cli.cmd {
        Cmd::Run(a) | Cmd::Init(a) | Cmd::Check(a) | Cmd::Alerts(a) => a.config.clone(),
        Cmd::Status { config, .. } => config.config.clone(),
        Cmd::Parked { config, .. } => config.config.clone(),
        Cmd::Recover { config, .. } => config.config.clone(),
        Cmd::Cleanup { config, .. } => config.config.clone(),
        Cmd::Shadow { config, .. } => config.config.clone(),
        Cmd::Replay { config, .. } => config.config.clone(),
        Cmd::Tail(_) | Cmd::Probe(_) | Cmd::Completions { .. } | Cmd::Man(_) => None,
    };
    let path = path.context("a config file is needed: --config FILE (or env OUTBOXD_CONFIG)")?;
    // Read errors name the file themselves; the others get it as context.
    let cfg = match Config::load(&path) {
        Err(e @ crate::config::ConfigError::Read { .. }) => return Err(e.into()),
        r => r.with_context(|| format!("config {}", path.display()))?,
    };
    // `check` prints its own table: the clients it tries (librdkafka, the replication client)
    // would repeat each failure the table names, many times over.
    let default_filter = match cli.cmd {
        Cmd::Check(_) => "info,librdkafka=off,pgwire_replication=off",
        _ => "info",
    };
    init_logging(cfg.log.format, default_filter);
    for name in &cfg.ignored_env {
        tracing::warn!(
            variable = %name,
            "ignored: not an OUTBOXD_<SECTION>_<KEY> override (no such section)"
        );
    }
    // Errors built by libraries may repeat a secret of the configuration.
    command(cli, &cfg)
        .await
        .map_err(|e| anyhow::anyhow!(cfg.redactor.scrub(&format!("{e:#}"))))
}

async fn command(cli: Cli, cfg: &Config) -> anyhow::Result<ExitCode> {
    let cfg = match cli.cmd {
        Cmd::Status { .. }
        | Cmd::Replay { .. }
        | Cmd::Cleanup { .. }
        | Cmd::Check(_)
        | Cmd::Parked { .. } => crate::slot::join::view(cfg).await,
        _ => cfg.clone(),
    };
    match cli.cmd {
        Cmd::Run(_) => {
            // This relay's health and counts: served on /readyz, reported in the status row.
            let observed = std::sync::Arc::new(crate::obs::Observed::default());
            if let Some(addr) = &cfg.metrics.listen {
                let addr: std::net::SocketAddr = addr.parse()?;
                let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
                    .set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Full(
                            crate::obs::COMMIT_TO_ACK.into(),
                        ),
                        // Millisecond steps where a relay at light load lives (a produce
                        // round trip to the broker plus the batching wait), then the
                        // alerting range: a quantile is only as sharp as its buckets.
                        &[
                            0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025,
                            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                        ],
                    )?
                    .build_recorder();
                let handle = recorder.handle();
                metrics::set_global_recorder(recorder).context("install metrics recorder")?;
                crate::obs::describe();
                crate::obs::serve(addr, handle, observed.clone())
                    .await
                    .with_context(|| format!("serve metrics on {addr}"))?;
                tracing::info!(%addr, "serving /metrics, /healthz, /readyz and the status page (/, /status.json)");
            }
            let (tx, rx) = watch::channel(false);
            tokio::spawn(async move {
                wait_for_signal().await;
                tracing::info!("shutdown requested: draining in-flight events");
                let _ = tx.send(true);
                wait_for_signal().await;
                tracing::warn!("second signal: exiting without draining");
                std::process::exit(130);
            });
            // A definite error ends the relay: say what to do about it.
            crate::run_observed(cfg, rx, observed)
                .await
                .map_err(|e| anyhow::anyhow!("{e}\n  fix: {}", e.policy().fix))?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Status { json, .. } => {
            let v = crate::cmd::status::collect(&cfg).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", crate::cmd::status::render(&v));
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Alerts(_) => {
            print!("{}", crate::cmd::alerts::rules(&cfg.alerts));
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Parked { cmd, .. } => {
            println!("{}", crate::cmd::parked::run(&cfg, cmd).await?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Replay { args, .. } => {
            let (out, code) = crate::cmd::replay::main(&cfg, *args).await?;
            print!("{out}");
            Ok(code)
        }
        Cmd::Recover { since, dry_run, .. } => {
            print!("{}", crate::cmd::recover::run(&cfg, since, dry_run).await?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Shadow { cmd, .. } => {
            print!("{}", crate::cmd::shadow::run(&cfg, cmd).await?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cleanup { dry_run, dsn, .. } => {
            let sql = crate::cleanup::connect(&cfg, dsn.as_deref()).await?;
            print!(
                "{}",
                crate::cleanup::run_once(&cfg, &sql, dry_run, None).await?
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Init(_) => {
            for l in crate::cmd::admin::init(&cfg).await? {
                println!("ok  {l}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Tail(_) | Cmd::Probe(_) | Cmd::Completions { .. } | Cmd::Man(_) => {
            unreachable!("handled before the config is read")
        }
        Cmd::Check(_) => {
            let lines = crate::cmd::check::check(&cfg).await;
            let failed = lines.iter().filter(|l| !l.ok).count();
            for l in &lines {
                println!(
                    "{}  {:<32} {}",
                    match (l.ok, l.warn) {
                        (false, _) => "FAIL",
                        (true, true) => "WARN",
                        (true, false) => "ok  ",
                    },
                    l.what,
                    l.detail
                );
            }
            Ok(if failed == 0 {
                ExitCode::SUCCESS
            } else {
                eprintln!("outboxd check: {failed} problem(s)");
                ExitCode::FAILURE
            })
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    /// Every argument of every command says what it is for in `--help`.
    #[test]
    fn every_argument_has_help() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_about().is_none() {
                    missing.push(format!("{path} {} (no about)", sub.get_name()));
                }
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&super::Cli::command(), "outboxd", &mut missing);
        assert!(missing.is_empty(), "without help: {missing:?}");
    }
}
