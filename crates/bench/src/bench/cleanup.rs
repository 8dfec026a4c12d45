//! What cleanup costs live delivery (issue 20): one outboxd relay at one live load, measured
//! without and then with `outboxd cleanup` deleting a backlog of old, delivered rows from the
//! table the writers insert into, at cleanup's defaults (batches of 1,000 rows, 20 ms apart).

use super::live::{finish_relay, relay_point, start_relay, Load};
use super::{log, Opts};
use crate::contest::{Contestant, RunCfg};
use crate::report::cleanup::CleanupImpact;
use crate::world::World;
use anyhow::{bail, Context, Result};
use std::process::Stdio;

pub async fn cleanup_points(
    w: &mut World,
    o: &Opts,
    cfg: &RunCfg,
    load: Load,
) -> Result<CleanupImpact> {
    let kind = Contestant::Outboxd;
    // History first, before the slot exists: never streamed, two days old, delivered.
    let sql = w.sql().await?;
    let rows = o.cleanup_rows as i64;
    sql.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                             event_type, payload, created_at) \
         SELECT gen_random_uuid(), 'history', 'h-' || (g % 1000), g, 'Old', \
                jsonb_build_object('pad', repeat('x', $2)), now() - interval '2 days' \
         FROM generate_series(1, $1::bigint) g",
        &[&rows, &(o.rows.payload_bytes as i32)],
    )
    .await?;
    sql.batch_execute("VACUUM ANALYZE outbox").await?;
    let plan = o.live_plan();
    let mut s = start_relay(w, &plan, cfg, kind, Some("_cleanup".into())).await?;
    // The relay writes its delivery mark every source.state_interval_ms (1 s); cleanup
    // deletes nothing before it.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let (baseline, written) = relay_point(w, &plan, &s.run(kind), load).await?;
    s.total += written.events;

    log(format!(
        "cleanup: deleting {rows} old rows during the next point"
    ));
    let child = tokio::process::Command::new(&cfg.relay_bin)
        .arg("cleanup")
        .arg("--config")
        .arg(&s.config)
        .env("OUTBOXD_CLEANUP_RETENTION", "1d")
        .env("OUTBOXD_CLEANUP_MAX_ROWS_PER_RUN", rows.max(1).to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start outboxd cleanup")?;
    let (during, written) = relay_point(w, &plan, &s.run(kind), load).await?;
    s.total += written.events;
    let out = child.wait_with_output().await?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "outboxd cleanup failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (deleted, batches, cleanup_s) =
        parse(&text).with_context(|| format!("cleanup said: {text}"))?;
    log(format!(
        "cleanup: {deleted} rows in {batches} batches, {cleanup_s:.1} s"
    ));
    let mut pts = [baseline, during];
    finish_relay(w, kind, s, &mut pts, &mut []).await?;
    sql.batch_execute("DELETE FROM outbox WHERE aggregate_type = 'history'")
        .await?;
    let [baseline, during] = pts;
    Ok(CleanupImpact {
        history_rows: rows,
        deleted,
        cleanup_s,
        batches,
        baseline,
        during,
    })
}

/// "deleted         N row(s) in B batch(es), S s".
fn parse(out: &str) -> Option<(u64, u64, f64)> {
    let line = out.lines().find(|l| l.starts_with("deleted"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    Some((
        words.get(1)?.parse().ok()?,
        words.get(4)?.parse().ok()?,
        words.get(6)?.parse().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_cleanup_summary() {
        assert_eq!(
            super::parse("cutoff x\ndeleted         300000 row(s) in 301 batch(es), 21.4 s\n"),
            Some((300_000, 301, 21.4))
        );
    }
}
