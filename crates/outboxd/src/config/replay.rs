//! `[replay]`: what `outboxd replay` needs to know that a command line should not decide alone
//! (R38, R41): which event types act on the world when consumed again, how large a replay may be
//! before a second person must approve it, and the default rate cap.
//!
//! The approval policy (`side_effect_types`, `approval_over`) is the admin's: `outboxd init`
//! writes it from its config into the database (`outboxd_replay_policy`, per slot), and
//! `outboxd replay` and the audit table's guard decide by that row. An operator's own config
//! (or `OUTBOXD_REPLAY_*`) does not change it; `outboxd check` says when they differ.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayConfig {
    /// Event types whose consumers act on the world (send an email, capture a payment): a
    /// replay touching one is warned about and needs an approval, whatever its size. Takes
    /// effect when `outboxd init` writes it into the database (the admin's config only).
    #[serde(default)]
    pub side_effect_types: Vec<String>,
    /// A replay of more events than this needs `replay request` + `replay approve` by another
    /// database role; up to it, `replay --execute` runs directly (still audited). Takes effect
    /// when `outboxd init` writes it into the database (the admin's config only).
    #[serde(default = "d_approval_over", deserialize_with = "super::lenient")]
    pub approval_over: u64,
    /// Default rate cap of a replay in events per second (`--rate` overrides it).
    #[serde(default = "d_rate", deserialize_with = "super::lenient")]
    pub rate: u32,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            side_effect_types: Vec::new(),
            approval_over: d_approval_over(),
            rate: d_rate(),
        }
    }
}

fn d_approval_over() -> u64 {
    1_000
}

fn d_rate() -> u32 {
    100
}
