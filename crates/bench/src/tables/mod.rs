//! `outboxd-bench tables` — many outbox tables through one slot (issue 30): the same load
//! spread over N tables, relayed once by one relay listing every table (`[[source.tables]]`:
//! one slot, one publication, one walsender) and once by N one-table relays (N slots, N
//! publications, N walsenders, each decoding the whole WAL).
//!
//! Per N and run: both arrangements are `init`ed (their slots exist before any row), warmed
//! up and paused; one backlog is loaded (transaction j into table j mod N), so both drain the
//! very same rows; each is then resumed in turn (the order alternates between runs) and timed
//! until every one of its slots confirmed the end. Then each arrangement gets a paced live load
//! on fresh slots, measured until every slot confirmed the last commit. Each table has its own
//! topics (as services do; no two relays share a partition; `--shared-topics`: one topic per
//! arrangement, its relays appending into the same partitions); every run's topics are read
//! back until quiet: every event must be there.

pub mod fleet;
pub mod report;

use crate::bench::{log, sibling, verify_timeout, WARM_ROWS};
use crate::verify::{verify_topics, Verified};
use crate::world::{RowOpts, Shape, World, AGG_TYPE};
use anyhow::{bail, Result};
use fleet::{Fleet, FleetCfg, Mode};
use report::{ModeRun, TablesReport};
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    /// Table counts N: each is relayed by one relay over N tables and by N one-table relays.
    #[arg(long, value_delimiter = ',', default_value = "1,3,10")]
    pub counts: Vec<usize>,
    /// Events per backlog, spread evenly over the N tables (the same total for every N).
    #[arg(long, default_value_t = 100_000)]
    pub events: u64,
    /// Rows per transaction (each transaction writes into one table).
    #[arg(long, default_value_t = 10)]
    pub tx_size: usize,
    #[command(flatten)]
    pub rows: RowOpts,
    /// Runs per N; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Events/s of the paced live load, spread over the N tables (0: backlog only).
    #[arg(long, default_value_t = 5_000.0)]
    pub live_rate: f64,
    /// Seconds of the live load. Longer than the 15 s between the running-transactions
    /// records that let a slot's `restart_lsn` move, so the WAL held at the end is a steady
    /// state, not everything since the slot was made.
    #[arg(long, default_value_t = 20.0)]
    pub live_secs: f64,
    /// Writer connections of the live load.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Every relay's `status_interval_ms` (bounds stopwatch overshoot).
    #[arg(long, default_value_t = 10)]
    pub status_ms: u64,
    /// Every table of an arrangement writes to one topic (the arrangement's N relays then
    /// append into the same partitions at once) instead of each table to its own: the shape in
    /// which an early run once missed records (docs/benchmarks.md).
    #[arg(long)]
    pub shared_topics: bool,
    #[command(flatten)]
    pub out: OutOpts,
}

/// The relay binary and the report files of the relay-process benches (`tables`, `standby`).
#[derive(clap::Args, Debug, Clone)]
pub struct OutOpts {
    /// Relay binary (default: `outboxd-bench-relay` next to this binary).
    #[arg(long)]
    pub relay_bin: Option<std::path::PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Write the results as Markdown here (always printed to stdout).
    #[arg(long)]
    pub markdown: Option<std::path::PathBuf>,
}

impl OutOpts {
    /// The relay binary to spawn.
    pub fn relay_bin(&self) -> Result<std::path::PathBuf> {
        match &self.relay_bin {
            Some(p) => Ok(p.clone()),
            None => sibling("outboxd-bench-relay"),
        }
    }
}

impl Opts {
    fn shape(&self) -> Shape {
        self.rows.shape(self.tx_size)
    }
}

/// Both arrangements, in run `r`'s order: neither always goes first.
fn order(r: usize) -> [Mode; 2] {
    in_turn(r, [Mode::OneRelay, Mode::RelayPerTable])
}

/// Two arrangements in run `r`'s order (as given in odd runs, swapped in even ones).
pub(crate) fn in_turn<T>(r: usize, [a, b]: [T; 2]) -> [T; 2] {
    if r % 2 == 1 {
        [a, b]
    } else {
        [b, a]
    }
}

/// Where one phase of one run of an arrangement writes: each table to its own topic (no two
/// relays ever share a partition), or with `shared` every table to one.
#[derive(Debug, Clone, Copy)]
struct Topics {
    n: usize,
    r: usize,
    phase: &'static str,
    mode: Mode,
    shared: bool,
}

impl Topics {
    /// Table i's topic.
    fn topic(self, i: usize) -> String {
        let Topics {
            n, r, phase, mode, ..
        } = self;
        let table = if self.shared {
            "all".to_string()
        } else {
            format!("t{i}")
        };
        format!("mt.n{n}.r{r}.{phase}.{mode:?}.{table}.{AGG_TYPE}").to_lowercase()
    }

    /// Every table's topic, each once.
    fn all(self) -> Vec<String> {
        let mut all: Vec<String> = (1..=self.n).map(|i| self.topic(i)).collect();
        all.dedup();
        all
    }

    /// The topic template of table i (`[sink] topic` or its `[[source.tables]] topic`).
    fn template(self) -> impl Fn(usize) -> String {
        move |i| self.topic(i).replace(AGG_TYPE, "{aggregate_type}")
    }
}

pub async fn run(o: Opts, command: String) -> Result<TablesReport> {
    if o.counts.is_empty() || o.counts.contains(&0) || o.runs == 0 || o.events == 0 {
        bail!("--counts (each ≥ 1), --runs and --events must be non-empty/positive");
    }
    let fc = FleetCfg {
        relay_bin: o.out.relay_bin()?,
        status_ms: o.status_ms,
        on_standby: false,
    };
    let machine = crate::procstat::machine();
    let started = chrono::Local::now();
    log("starting postgres and broker");
    let mut w = World::start(false).await?;
    let mut report = TablesReport {
        command,
        started_at: started.to_rfc3339(),
        machine,
        postgres: w.server_version().await?,
        events: o.events,
        tx_size: o.tx_size,
        payload_bytes: o.rows.payload_bytes,
        aggregates: o.rows.aggregates,
        partitions: o.rows.partitions,
        status_ms: o.status_ms,
        runs: o.runs,
        live_rate: o.live_rate,
        live_secs: o.live_secs,
        writers: o.writers,
        shared_topics: o.shared_topics,
        backlog: vec![],
        live: vec![],
        finished_in_s: 0.0,
    };
    let t_all = Instant::now();
    for &n in &o.counts {
        for r in 1..=o.runs {
            report.backlog.extend(backlog(&mut w, &o, &fc, n, r).await?);
            if o.live_rate > 0.0 {
                for mode in order(r) {
                    report.live.push(live(&mut w, &o, &fc, n, r, mode).await?);
                }
            }
        }
    }
    report.finished_in_s = t_all.elapsed().as_secs_f64();
    Ok(report)
}

/// One backlog, drained by each arrangement in turn.
async fn backlog(
    w: &mut World,
    o: &Opts,
    fc: &FleetCfg,
    n: usize,
    r: usize,
) -> Result<Vec<ModeRun>> {
    let tables = fleet::tables(n);
    let modes = order(r);
    let at = |mode| Topics {
        n,
        r,
        phase: "backlog",
        mode,
        shared: o.shared_topics,
    };
    let mut specs = vec![];
    for mode in modes {
        w.create_topics(&at(mode).all(), o.rows.partitions).await?;
        let tag = format!("mt_n{n}_r{r}");
        specs.push(fleet::prepare(w, fc, n, mode, &tag, at(mode).template()).await?);
    }
    let (warm_first, warm_lsn) = w.load_into(&tables, WARM_ROWS, o.shape()).await?;
    let mut fleets = vec![];
    for s in &specs {
        let mut f = Fleet::start(w, fc, s, warm_lsn).await?;
        f.pause();
        fleets.push(f);
    }
    log(format!("N={n} run {r}: loading {} events", o.events));
    let t = Instant::now();
    let (_, end_lsn) = w.load_into(&tables, o.events as usize, o.shape()).await?;
    log(format!("loaded in {:.1} s", t.elapsed().as_secs_f64()));
    let mut out = vec![];
    for (mode, mut f) in modes.into_iter().zip(fleets) {
        let relays = f.relays();
        let m = f.drain(w, end_lsn, o.events).await?;
        f.stop(w).await?;
        let total = o.events + WARM_ROWS as u64;
        let v = verified(w, &at(mode).all(), warm_first, total, true)?;
        let run = ModeRun {
            tables: n,
            mode,
            run: r,
            relays,
            events: o.events,
            rate: o.events as f64 / m.secs,
            measured: m,
            writer_cpu_s: None,
            verified: v,
        };
        log(line("backlog", &run));
        out.push(run);
    }
    Ok(out)
}

/// A paced live load through one arrangement, on fresh slots.
async fn live(
    w: &mut World,
    o: &Opts,
    fc: &FleetCfg,
    n: usize,
    r: usize,
    mode: Mode,
) -> Result<ModeRun> {
    let tables = fleet::tables(n);
    let at = Topics {
        n,
        r,
        phase: "live",
        mode,
        shared: o.shared_topics,
    };
    let t = at.all();
    w.create_topics(&t, o.rows.partitions).await?;
    let tag = format!("mt_n{n}_r{r}_live");
    let specs = fleet::prepare(w, fc, n, mode, &tag, at.template()).await?;
    let (warm_first, warm_lsn) = w.load_into(&tables, WARM_ROWS, o.shape()).await?;
    let f = Fleet::start(w, fc, &specs, warm_lsn).await?;
    let relays = f.relays();
    let (m, written) = f
        .live(w, &tables, (o.live_rate, o.live_secs), o.shape(), o.writers)
        .await?;
    f.stop(w).await?;
    let total = written.events + WARM_ROWS as u64;
    // Concurrent writers commit an aggregate's versions out of order: completeness only.
    let v = verified(w, &t, warm_first, total, false)?;
    let run = ModeRun {
        tables: n,
        mode,
        run: r,
        relays,
        events: written.events,
        rate: written.achieved_rate,
        measured: m,
        writer_cpu_s: Some(written.writer_cpu_s),
        verified: v,
    };
    log(line("live", &run));
    Ok(run)
}

/// Reads `topics` back: versions `first..first+n` all there (and, with `ordered`, each
/// aggregate's in commit order), else the run fails.
pub(crate) fn verified(
    w: &World,
    topics: &[String],
    first: i64,
    n: u64,
    ordered: bool,
) -> Result<Verified> {
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let v = verify_topics(&w.bootstrap(), &names, first, n, verify_timeout(n))?;
    if v.distinct != v.expected || (ordered && !v.ok()) {
        bail!("{} failed verification: {v:?}", names.join(", "));
    }
    Ok(v)
}

fn line(phase: &str, r: &ModeRun) -> String {
    let per = |c: Option<f64>| c.map_or(f64::NAN, |c| c * 1e6 / r.events.max(1) as f64);
    format!(
        "N={} run {} {phase} {:<9} ({} relays): {:>8.0} ev/s, walsender {:.1} µs/ev, relay {:.1} µs/ev, \
         WAL behind max {:.1} MiB, RSS {:.1} MiB",
        r.tables,
        r.run,
        r.mode.label(),
        r.relays,
        r.rate,
        per(r.measured.walsender_cpu_s),
        per(r.measured.relay_cpu_s),
        r.measured.wal.behind_max as f64 / 1048576.0,
        r.measured.peak_rss_kib as f64 / 1024.0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each table has its own topic, or with `--shared-topics` every table of an arrangement
    /// writes to one; phases, runs and arrangements never share one.
    #[test]
    fn topics_per_table_or_shared() {
        let at = |mode, shared| Topics {
            n: 3,
            r: 1,
            phase: "backlog",
            mode,
            shared,
        };
        let own = at(Mode::RelayPerTable, false).all();
        assert_eq!(own.len(), 3, "{own:?}");
        let shared = at(Mode::RelayPerTable, true).all();
        assert_eq!(shared.len(), 1, "{shared:?}");
        assert_ne!(shared, at(Mode::OneRelay, true).all());
        assert!(own.iter().all(|t| !shared.contains(t)));
        assert_eq!(
            at(Mode::OneRelay, true).template()(2),
            format!("mt.n3.r1.backlog.onerelay.all.{{aggregate_type}}")
        );
    }
}
