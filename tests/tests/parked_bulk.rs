//! Bulk repairs (issue 40): `outboxd parked retry|discard` by `--aggregate`, `--type`,
//! `--table` or `--all`, with `--dry-run`, on a few thousand parked and held events: one
//! decision per set, every event audited, the held ones following their heads in order.

use outboxd_tests::*;
use std::time::{Duration, Instant};

const ACCT: &str = "outbox.event.acct";
const KEY: &str = "test-only-parked-integrity-key-0123456789abcdef";
/// Aggregates of `Deposited` (A…) and `Withdrawn` (W…) events, and events of each: every
/// first one parked, the rest held behind it.
const AGGREGATES: usize = 5;
const WITHDRAWN: usize = 25;
const PER: i64 = 100;

/// Events whose `amount` must be an integer (`strict`) or anything.
fn schema(dir: &std::path::Path, strict: bool) -> anyhow::Result<()> {
    let amount = if strict {
        r#"{"type": "integer"}"#
    } else {
        "{}"
    };
    for t in ["Deposited", "Withdrawn"] {
        std::fs::create_dir_all(dir.join(t))?;
        std::fs::write(
            dir.join(t).join("1.json"),
            format!(
                r#"{{"type": "object", "required": ["amount"], "properties": {{"amount": {amount}}}}}"#
            ),
        )?;
    }
    Ok(())
}

fn relay(env: &Env) -> anyhow::Result<Relay> {
    Ok(Relay::start(outboxd::Config::from_toml_and_env(
        &env.toml(),
        [("OUTBOXD_PARKED_KEY".to_string(), KEY.to_string())],
    )?))
}

async fn states(c: &tokio_postgres::Client) -> anyhow::Result<Vec<(String, i64)>> {
    Ok(c.query(
        "SELECT state, count(*) FROM outbox_parked GROUP BY 1 ORDER BY 1",
        &[],
    )
    .await?
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect())
}

fn cli(args: &[&str], cfg: &std::path::Path) -> (String, Duration) {
    let t = Instant::now();
    let (code, out) = outboxd_cli(args, cfg);
    assert_eq!(code, 0, "{args:?}: {out}");
    (out, t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_retry_and_discard_with_dry_run_on_three_thousand_parked_events() -> anyhow::Result<()>
{
    let mut env = Env::start("parked_bulk").await?;
    let schemas = env.dir.path().join("schemas");
    schema(&schemas, true)?;
    // (Still in [relay]: the relay picks repairs up every 200 ms.)
    env.extra_toml = format!(
        "repair_interval_ms = 200\n[validation]\nschema_dir = \"{}\"\n",
        schemas.display()
    );
    create_topics(&env.bootstrap(), &[ACCT], 1).await?;
    let r = relay(&env)?;
    let mut c = env.sql().await?;
    let t = Instant::now();
    let aggregates = (0..AGGREGATES)
        .map(|a| (format!("A{a}"), "Deposited"))
        .chain((0..WITHDRAWN).map(|a| (format!("W{a}"), "Withdrawn")));
    for (agg, event_type) in aggregates {
        let events: Vec<NewEvent> = (1..=PER)
            .map(|v| {
                // A string amount: invalid until the schema is fixed.
                let amount = serde_json::json!({"amount": format!("{v}")});
                NewEvent::new("acct", &agg, v, event_type, amount)
            })
            .collect();
        write_events(&mut c, &events, false).await?;
    }
    env.caught_up(Duration::from_secs(120)).await?;
    let heads = (AGGREGATES + WITHDRAWN) as i64;
    let total = heads * PER;
    let parked = [("blocked".into(), total - heads), ("parked".into(), heads)];
    eventually(Duration::from_secs(60), || async {
        Ok(states(&c).await? == parked)
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}: {:?}", r.is_finished()))?;
    eprintln!("parked {total} events (tagged) in {:?}", t.elapsed());

    let cfg = env.config_file()?;
    // Dry runs: what would go, in which order; nothing changes.
    let (out, took) = cli(&["parked", "retry", "--all", "--dry-run"], &cfg);
    eprintln!("retry --all --dry-run over {total} rows: {took:?}");
    let want = format!(
        "retry would take {heads} event(s), then the {} held behind them follow in order",
        total - heads
    );
    assert!(out.contains(&want), "{out}");
    let first = out.lines().nth(1).unwrap_or_default();
    assert!(
        first.contains("acct/A0 v1") && first.contains("+99 held behind it"),
        "{first}"
    );
    let (out, _) = cli(
        &[
            "parked",
            "retry",
            "--type",
            "Deposited",
            "--aggregate",
            "A3",
            "--dry-run",
        ],
        &cfg,
    );
    assert!(out.contains("retry would take 1 event(s)"), "{out}");
    let (out, took) = cli(
        &["parked", "discard", "--type", "Withdrawn", "--dry-run"],
        &cfg,
    );
    eprintln!(
        "discard --type --dry-run ({} rows): {took:?}",
        WITHDRAWN as i64 * PER
    );
    assert!(
        out.contains(&format!(
            "discard would take {} event(s)",
            WITHDRAWN as i64 * PER
        )),
        "{out}"
    );
    let (out, _) = cli(
        &["parked", "retry", "--table", "public.outbox", "--dry-run"],
        &cfg,
    );
    assert!(
        out.contains(&format!("would take {heads} event(s)")),
        "{out}"
    );
    let (code, out) = outboxd_cli(
        &["parked", "retry", "--table", "public.nope", "--dry-run"],
        &cfg,
    );
    assert!(
        code != 0 && out.contains("not an outbox table of this config"),
        "{out}"
    );
    let (code, out) = outboxd_cli(&["parked", "retry", "--reason", "x"], &cfg);
    assert!(code != 0 && out.contains("--all"), "{out}");
    assert_eq!(states(&c).await?.len(), 2, "a dry run changes nothing");

    // One discard takes every Withdrawn event (heads and held), one an aggregate: one
    // transaction each, every event audited.
    let (out, took) = cli(
        &[
            "parked",
            "discard",
            "--type",
            "Withdrawn",
            "--reason",
            "test data",
        ],
        &cfg,
    );
    eprintln!("discard --type ({} rows): {took:?}", WITHDRAWN as i64 * PER);
    assert!(
        out.contains(&format!("discard of {} event(s)", WITHDRAWN as i64 * PER)),
        "{out}"
    );
    let (out, _) = cli(
        &[
            "parked",
            "discard",
            "--aggregate",
            "A4",
            "--reason",
            "test data",
        ],
        &cfg,
    );
    assert!(out.contains("discard of 100 event(s)"), "{out}");

    // The schema is fixed; one retry of the rest releases every aggregate in order.
    r.shutdown().await?;
    schema(&schemas, false)?;
    let r = relay(&env)?;
    let t = Instant::now();
    let (out, took) = cli(
        &[
            "parked",
            "retry",
            "--all",
            "--reason",
            "schema fixed",
            "--wait",
        ],
        &cfg,
    );
    eprintln!("retry --all --wait ({} heads): {took:?}", AGGREGATES - 1);
    assert!(
        out.contains(&format!("retry of {} event(s)", AGGREGATES - 1)),
        "{out}"
    );
    // --wait followed the release of the 4 aggregates to the end.
    assert!(out.contains("released 400 event(s) in"), "{out}");
    let n = (AGGREGATES - 1) * PER as usize;
    let discarded = (WITHDRAWN + 1) as i64 * PER;
    let done = eventually(Duration::from_secs(120), || async {
        Ok(states(&c).await?
            == [
                ("delivered".into(), n as i64),
                ("discarded".into(), discarded),
            ])
    })
    .await;
    if let Err(e) = done {
        let why: Vec<(String, String, i64)> = c
            .query(
                "SELECT state, error_class, count(*) FROM outbox_parked GROUP BY 1, 2",
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        anyhow::bail!("{e}: {why:?} after {:?}", t.elapsed());
    }
    eprintln!("released {n} events after one retry in {:?}", t.elapsed());
    let recs = read_topic(&env.bootstrap(), ACCT, n, Duration::from_secs(60))?;
    let mut by_agg: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
    for rec in &recs {
        by_agg
            .entry(rec.header("aggregate_id").to_string())
            .or_default()
            .push(rec.header("aggregate_version").parse()?);
    }
    assert_eq!(
        by_agg.keys().collect::<Vec<_>>(),
        ["A0", "A1", "A2", "A3"],
        "nothing discarded is published"
    );
    for (agg, versions) in &by_agg {
        assert_eq!(versions, &(1..=PER).collect::<Vec<_>>(), "{agg}");
    }
    let audited: i64 = c
        .query_one("SELECT count(*) FROM outbox_parked_audit", &[])
        .await?
        .get(0);
    assert_eq!(
        audited,
        (AGGREGATES - 1) as i64 * PER + discarded,
        "one audit row per event a decision released or discarded (the 4 heads retried and \
         the 396 held behind them, every discarded one)"
    );
    r.shutdown().await?;
    Ok(())
}
