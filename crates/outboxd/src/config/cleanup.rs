//! `[cleanup]`: deleting delivered outbox rows (the work itself: `crate::cleanup`).

use serde::Deserialize;
use std::time::Duration;

/// `[cleanup]`. `Debug` (below) shows `dsn` with its secrets redacted.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CleanupConfig {
    /// Keep rows at least this long (audit retention); unset: cleanup is off.
    #[serde(default, deserialize_with = "super::opt_duration_secs")]
    pub retention: Option<Duration>,
    /// Rows per DELETE (each its own transaction).
    #[serde(default = "d_batch", deserialize_with = "super::lenient")]
    pub batch_size: u32,
    /// Rows one run deletes at most; the next run continues.
    #[serde(default = "d_cap", deserialize_with = "super::lenient")]
    pub max_rows_per_run: u64,
    /// Pause between batches, so cleanup never saturates the database.
    #[serde(default = "d_pause", deserialize_with = "super::lenient")]
    pub pause_ms: u64,
    /// Run inside `outboxd run` this often; unset: only `outboxd cleanup` deletes.
    #[serde(default, deserialize_with = "super::opt_duration_secs")]
    pub every: Option<Duration>,
    /// Connect as this role (DELETE on the outbox table) instead of source.dsn's: the relay's
    /// own role needs no DELETE. Env `OUTBOXD_CLEANUP_DSN`.
    #[serde(default)]
    pub dsn: Option<String>,
    /// pgoutput slots of this database that are not outboxd relays' (a subscription, Debezium):
    /// any other slot without delivery state blocks cleanup, since cleanup cannot know what it
    /// still needs.
    #[serde(default)]
    pub ignore_slots: Vec<String>,
}

impl Default for CleanupConfig {
    fn default() -> Self {
        Self {
            retention: None,
            batch_size: d_batch(),
            max_rows_per_run: d_cap(),
            pause_ms: d_pause(),
            every: None,
            dsn: None,
            ignore_slots: Vec::new(),
        }
    }
}

impl std::fmt::Debug for CleanupConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CleanupConfig")
            .field("retention", &self.retention)
            .field("batch_size", &self.batch_size)
            .field("max_rows_per_run", &self.max_rows_per_run)
            .field("pause_ms", &self.pause_ms)
            .field("every", &self.every)
            .field("dsn", &self.dsn.as_deref().map(super::dsn::redact))
            .field("ignore_slots", &self.ignore_slots)
            .finish()
    }
}

fn d_batch() -> u32 {
    1_000
}
fn d_cap() -> u64 {
    100_000
}
fn d_pause() -> u64 {
    20
}
