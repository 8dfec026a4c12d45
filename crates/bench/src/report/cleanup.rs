//! The cleanup comparison's section of the report (`crate::bench::cleanup`).

use super::{opt, LatencyPoint, Report};
use std::fmt::Write as _;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CleanupImpact {
    /// Old rows in the table when cleanup started.
    pub history_rows: i64,
    pub deleted: u64,
    pub cleanup_s: f64,
    pub batches: u64,
    /// The same load before cleanup, then while it ran.
    pub baseline: LatencyPoint,
    pub during: LatencyPoint,
}

impl Report {
    /// "What cleanup costs live delivery": the same load without and while cleanup deletes.
    pub(crate) fn cleanup_markdown(&self, w: &mut String) {
        let Some(c) = &self.cleanup else { return };
        let (a, b) = (&c.baseline, &c.during);
        let _ = writeln!(
            w,
            "#### What cleanup costs live delivery\n\n\
             One outboxd relay at {:.0} events/s{} (transaction size {}): one point as usual, then \
             the same load while `outboxd cleanup` deletes {} two-day-old, delivered rows from the \
             table the writers insert into, at its defaults (batches of 1,000, 20 ms apart). \
             Cleanup deleted {} rows in {} batches in {:.1} s ({:.0} rows/s); the point lasts \
             {:.1} s.\n",
            a.target_rate,
            a.fraction_of_ceiling.map_or(String::new(), |f| format!(
                " ({:.1}% of the ceiling)",
                f * 100.0
            )),
            self.latency_tx_size,
            c.history_rows,
            c.deleted,
            c.batches,
            c.cleanup_s,
            c.deleted as f64 / c.cleanup_s.max(1e-9),
            b.events as f64 / b.achieved_rate.max(1e-9),
        );
        let _ = writeln!(
            w,
            "| | without cleanup | during cleanup |\n|---|---|---|\n\
             | commit→ack p50 / p99 / max ms | {} | {} |\n\
             | relay CPU µs/event | {} | {} |\n\
             | walsender CPU µs/event | {} | {} |\n\
             | writers CPU µs/event | {} | {} |\n",
            a.latency.cells(),
            b.latency.cells(),
            opt(a.cpu.relay, 1),
            opt(b.cpu.relay, 1),
            opt(a.cpu.walsender, 1),
            opt(b.cpu.walsender, 1),
            opt(a.cpu.writers, 1),
            opt(b.cpu.writers, 1),
        );
    }
}
