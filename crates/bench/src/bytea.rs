//! `outboxd-bench bytea` (issue 46): the backlog drain rate of a bytea outbox with 1 KiB binary
//! payloads against the same rows with a jsonb payload of the same size, in one run. Each run
//! loads one backlog per table behind a fresh slot (transactions of `--tx-size` rows), starts
//! outboxd on it and times the drain until the slot's confirmed LSN passes the backlog's last
//! commit (start-up included, the same for both); the two tables take turns going first.

use crate::contest::{relay_toml, RelaySource};
use crate::contestant::Contestant;
use crate::world::{current_lsn, slot_state, World};
use anyhow::{Context, Result};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    /// Events per backlog.
    #[arg(long, default_value_t = 100_000)]
    pub events: usize,
    /// Runs per table (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Rows per transaction.
    #[arg(long, default_value_t = 10)]
    pub tx_size: usize,
    /// Write the Markdown report here too.
    #[arg(long)]
    pub markdown: Option<std::path::PathBuf>,
}

/// The two tables: the payload column's type and the SQL of a row's payload (1 KiB either way:
/// 1,024 bytes of hex-decoded md5s, or a JSON object whose text is 1,024 bytes).
const TABLES: [(&str, &str, &str); 2] = [
    (
        "bench_bytea",
        "bytea",
        "decode(repeat(md5(i::text), 32), 'hex')",
    ),
    (
        "bench_jsonb",
        "jsonb",
        "jsonb_build_object('d', repeat(md5(i::text), 31) || left(md5(i::text), 15))",
    ),
];

const PUBLICATION: &str = "bytea_bench_pub";

pub async fn run(o: Opts) -> Result<String> {
    let w = World::start(false).await?;
    let c = w.sql().await?;
    for (t, ty, _) in TABLES {
        c.batch_execute(&format!(
            "CREATE TABLE {t} (LIKE outbox INCLUDING ALL); \
             ALTER TABLE {t} ALTER COLUMN payload TYPE {ty} USING NULL; \
             ALTER TABLE {t} SET (autovacuum_enabled = false)"
        ))
        .await?;
    }
    c.batch_execute(&format!(
        "CREATE PUBLICATION {PUBLICATION} FOR TABLE {}, {}",
        TABLES[0].0, TABLES[1].0
    ))
    .await?;
    let sink = w.sink(Contestant::Outboxd)?;
    let mut rates: Vec<(&str, Vec<f64>, usize)> = TABLES.iter().map(|t| (t.0, vec![], 0)).collect();
    for run in 0..o.runs {
        let order: Vec<usize> = if run % 2 == 0 { vec![0, 1] } else { vec![1, 0] };
        for i in order {
            let (table, _, payload) = TABLES[i];
            let slot = format!("{table}_{run}");
            c.batch_execute(&format!("TRUNCATE {table}")).await?;
            w.create_slot(&slot).await?;
            let n = o.events;
            let tx = o.tx_size.max(1);
            c.batch_execute(&format!(
                "DO $$ BEGIN FOR t IN 0..{last} LOOP \
                   INSERT INTO {table} (event_id, aggregate_type, aggregate_id, \
                     aggregate_version, event_type, payload) \
                   SELECT gen_random_uuid(), 'bench', 'a-' || (i % 100), i, 'Happened', {payload} \
                   FROM generate_series(t * {tx} + 1, least((t + 1) * {tx}, {n})) i; \
                   COMMIT; END LOOP; END $$",
                last = n.div_ceil(tx) - 1
            ))
            .await
            .with_context(|| format!("load {table}"))?;
            let bytes: i64 = c
                .query_one(
                    &format!("SELECT sum(pg_column_size(payload))::bigint FROM {table}"),
                    &[],
                )
                .await?
                .get(0);
            let end = current_lsn(&c).await?;
            let topic = format!("bench.{table}.{run}");
            w.create_topics(std::slice::from_ref(&topic), 3).await?;
            let src = RelaySource {
                tables: vec![format!("public.{table}")],
                publication: PUBLICATION.into(),
                ..RelaySource::bench(&slot)
            };
            let toml = relay_toml(&w, &sink, &src, &topic, 100);
            let cfg = outboxd::Config::from_toml_and_env(&toml, Vec::<(String, String)>::new())?;
            let (stop, rx) = tokio::sync::watch::channel(false);
            let t0 = Instant::now();
            let relay = tokio::spawn(outboxd::run(cfg, rx));
            loop {
                if slot_state(&c, &slot).await?.1 >= end {
                    break;
                }
                anyhow::ensure!(!relay.is_finished(), "the relay stopped on {table}");
                anyhow::ensure!(t0.elapsed() < Duration::from_secs(600), "{table}: no drain");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let secs = t0.elapsed().as_secs_f64();
            let _ = stop.send(true);
            relay.await??;
            w.drop_slot(&slot).await?;
            let rate = n as f64 / secs;
            eprintln!("bytea bench: {table} run {run}: {n} events in {secs:.2} s = {rate:.0}/s");
            rates[i].1.push(rate);
            rates[i].2 = (bytes / n as i64) as usize;
        }
    }
    let md = markdown(&o, &rates);
    if let Some(p) = &o.markdown {
        std::fs::write(p, &md)?;
    }
    Ok(md)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn markdown(o: &Opts, rates: &[(&str, Vec<f64>, usize)]) -> String {
    let mut s = format!(
        "| payload column | stored bytes per payload | backlog events/s (median of {}) | runs |\n|---|---|---|---|\n",
        o.runs
    );
    for (t, r, b) in rates {
        let runs: Vec<String> = r.iter().map(|x| format!("{x:.0}")).collect();
        s += &format!("| {t} | {b} | {:.0} | {} |\n", median(r), runs.join(" / "));
    }
    let (bin, json) = (median(&rates[0].1), median(&rates[1].1));
    s += &format!(
        "\nbytea / jsonb: **{:.0}%** ({} events per backlog, {} per transaction, 1,024-byte payloads)\n",
        100.0 * bin / json,
        o.events,
        o.tx_size
    );
    s
}
