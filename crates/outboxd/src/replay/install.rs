//! Installing the replay audit (`sql/060_outboxd_replay.sql`) and its approval policy: `outboxd
//! init` creates or upgrades the audit table, the policy table and the guard and writes the
//! admin's `[replay]` policy ([`install`]); `outboxd replay` refuses to go on without them
//! ([`require_installed`]) and decides by the database's policy ([`policy`]), never by the
//! operator's config; `outboxd check` reports what is missing, disabled or different
//! ([`check_install`]).

use super::ReplayError;
use crate::config::replay::ReplayConfig;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::source::quote_ident;
use chrono::{DateTime, Utc};
use tokio_postgres::Client;

/// DDL of the audit table, the policy table and the guard (`sql/060_outboxd_replay.sql`).
pub const REPLAY_SQL: &str = include_str!("../../../../sql/060_outboxd_replay.sql");

/// What the guard's comment starts with when it is this version's (see [`install_state`]).
const GUARD_VERSION: &str = "outboxd replay guard v2";

/// The approval policy of one relay, as the database holds it (`outboxd_replay_policy`, written
/// by `outboxd init` from the admin's `[replay]`): what `outboxd replay` and the table's guard
/// decide by. An operator's own config does not change it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// More events than this need an approval by another role.
    pub approval_over: u64,
    /// Event types whose replay needs an approval, whatever its size.
    pub side_effect_types: Vec<String>,
}

impl Policy {
    /// Does consuming an event of this type again act on the world?
    pub fn has_side_effects(&self, event_type: &str) -> bool {
        self.side_effect_types.iter().any(|t| t == event_type)
    }
}

impl From<&ReplayConfig> for Policy {
    fn from(c: &ReplayConfig) -> Self {
        let mut side_effect_types = c.side_effect_types.clone();
        side_effect_types.sort();
        side_effect_types.dedup();
        Self {
            approval_over: c.approval_over,
            side_effect_types,
        }
    }
}

/// Creates or upgrades the audit table, the policy table and the guard (idempotent: the guard
/// function and trigger are replaced each time, so an older install gets this one), then writes
/// this config's `[replay]` policy for `cfg.source.slot`. Run by `outboxd init`, as the admin
/// role that is to own these tables (the owner of `outboxd_replay` can disable its guard).
pub async fn install(sql: &Client, cfg: &Config) -> Result<(), ReplayError> {
    let schema = crate::schema::current(sql).await?;
    let table = format!("{}.outboxd_replay", quote_ident(&schema));
    // A table created by someone else (an older `outboxd replay` run by an operator) is theirs:
    // replacing its guard would not take it from them.
    let owner: Option<(String, bool, String)> = sql
        .query_opt(
            "SELECT c.relowner::regrole::text, pg_has_role(current_user, c.relowner, 'USAGE'), \
               current_user::text \
             FROM pg_class c WHERE c.oid = to_regclass($1)",
            &[&table],
        )
        .await?
        .map(|r| (r.get(0), r.get(1), r.get(2)));
    if let Some((owner, false, me)) = owner {
        return Err(ReplayError::Relay(RelayError::Setup(format!(
            "{table} is owned by role {owner}, who can disable its guard: as a superuser, \
             ALTER TABLE {table} OWNER TO {me} (likewise outboxd_replay_policy and FUNCTION \
             outboxd_replay_guard()), then run `outboxd init` again",
            me = quote_ident(&me)
        ))));
    }
    sql.batch_execute(&crate::schema::qualified(REPLAY_SQL, &schema))
        .await
        .map_err(|e| {
            ReplayError::Relay(RelayError::Setup(format!(
                "cannot create or upgrade outboxd_replay and its guard ({}): run `outboxd init` \
                 as the admin role that owns them (sql/roles.sql)",
                RelayError::from(e)
            )))
        })?;
    let p = Policy::from(&cfg.replay);
    let over = i64::try_from(p.approval_over).unwrap_or(i64::MAX);
    sql.execute(
        "INSERT INTO outboxd_replay_policy AS p (slot, approval_over, side_effect_types) \
         VALUES ($1, $2, $3) \
         ON CONFLICT (slot) DO UPDATE SET approval_over = EXCLUDED.approval_over, \
           side_effect_types = EXCLUDED.side_effect_types, updated_by = current_user, \
           updated_at = now() \
         WHERE (p.approval_over, p.side_effect_types) \
           IS DISTINCT FROM (EXCLUDED.approval_over, EXCLUDED.side_effect_types)",
        &[&cfg.source.slot, &over, &p.side_effect_types],
    )
    .await?;
    Ok(())
}

/// What is installed, by schema-qualified names (a temporary table cannot stand in).
struct InstallState {
    table: bool,
    policy_table: bool,
    /// The guard function is this version's (its comment) and searches only pg_catalog.
    guard_current: bool,
    /// The trigger's `tgenabled` (`O`: fires; `D`: disabled), None when missing.
    trigger: Option<i8>,
    /// Owners of the audit table, the policy table and the guard function (those present).
    owners: Vec<(&'static str, String)>,
}

async fn install_state(sql: &Client) -> Result<InstallState, ReplayError> {
    let schema = quote_ident(&crate::schema::current(sql).await?);
    let r = sql
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, \
               coalesce((SELECT p.proconfig @> ARRAY['search_path=pg_catalog, pg_temp'] \
                           AND coalesce(obj_description(p.oid, 'pg_proc'), '') LIKE $4 || '%' \
                         FROM pg_proc p WHERE p.oid = to_regprocedure($3)), false), \
               (SELECT t.tgenabled::\"char\" FROM pg_trigger t WHERE t.tgrelid = to_regclass($1) \
                  AND t.tgname = 'outboxd_replay_guard' AND t.tgfoid = to_regprocedure($3)), \
               (SELECT relowner::regrole::text FROM pg_class WHERE oid = to_regclass($1)), \
               (SELECT relowner::regrole::text FROM pg_class WHERE oid = to_regclass($2)), \
               (SELECT proowner::regrole::text FROM pg_proc WHERE oid = to_regprocedure($3))",
            &[
                &format!("{schema}.outboxd_replay"),
                &format!("{schema}.outboxd_replay_policy"),
                &format!("{schema}.outboxd_replay_guard()"),
                &GUARD_VERSION,
            ],
        )
        .await?;
    let owners = [
        ("table outboxd_replay", r.get::<_, Option<String>>(4)),
        ("table outboxd_replay_policy", r.get(5)),
        ("function outboxd_replay_guard()", r.get(6)),
    ]
    .into_iter()
    .filter_map(|(what, o)| o.map(|o| (what, o)))
    .collect();
    Ok(InstallState {
        table: r.get(0),
        policy_table: r.get(1),
        guard_current: r.get(2),
        trigger: r.get(3),
        owners,
    })
}

/// Refuses to go on unless `outboxd init` installed the audit table, the policy table and this
/// version's guard. `outboxd replay` never creates them: whoever creates a table owns it, and
/// its owner can disable the guard.
pub async fn require_installed(sql: &Client) -> Result<(), ReplayError> {
    let s = install_state(sql).await?;
    match s.trigger {
        _ if !(s.table && s.policy_table && s.guard_current) => Err(ReplayError::NotInstalled),
        None => Err(ReplayError::NotInstalled),
        // `O`: fires (the default); `A`: fires always. `D` (disabled) or `R` (replica only).
        Some(e) if e == b'O' as i8 || e == b'A' as i8 => Ok(()),
        Some(_) => Err(ReplayError::GuardDisabled),
    }
}

/// Warnings for `outboxd check` (none when all is well): the install is missing or older than
/// this outboxd, the guard is disabled, its objects have different owners, or the database's
/// policy is not this config's `[replay]`.
pub async fn check_install(sql: &Client, cfg: &Config) -> Result<Vec<String>, ReplayError> {
    let s = install_state(sql).await?;
    let mut out = Vec::new();
    if !(s.table && s.policy_table && s.guard_current) {
        out.push(ReplayError::NotInstalled.to_string());
    }
    match s.trigger {
        None if s.table => out.push(
            "the trigger outboxd_replay_guard on outboxd_replay is missing: nothing enforces the \
             two-person rule; run `outboxd init` as the admin role"
                .into(),
        ),
        Some(e) if e != b'O' as i8 && e != b'A' as i8 => out.push(
            "the trigger outboxd_replay_guard on outboxd_replay is DISABLED (by its owner or a \
             superuser): nothing enforces the two-person rule; ALTER TABLE outboxd_replay \
             ENABLE TRIGGER outboxd_replay_guard, and review the rows changed meanwhile"
                .into(),
        ),
        _ => {}
    }
    let mut names: Vec<&str> = s.owners.iter().map(|(_, o)| o.as_str()).collect();
    names.sort();
    names.dedup();
    if names.len() > 1 {
        let list: Vec<String> = s.owners.iter().map(|(w, o)| format!("{w}: {o}")).collect();
        out.push(format!(
            "the replay audit's objects have different owners ({}): each owner can change or \
             disable what it owns; the admin role should own them all",
            list.join(", ")
        ));
    }
    if s.policy_table {
        let mine = Policy::from(&cfg.replay);
        match stored_policy(sql, &cfg.source.slot).await? {
            None => out.push(format!(
                "no replay policy for slot {} in outboxd_replay_policy: replays of this relay \
                 are refused; run `outboxd init` as the admin role",
                cfg.source.slot
            )),
            Some(db) if db != mine => out.push(format!(
                "the database's replay policy for slot {} (approval_over = {}, \
                 side_effect_types = {:?}) is not this config's [replay] (approval_over = {}, \
                 side_effect_types = {:?}): the database's policy applies; run init as the admin \
                 to change it",
                cfg.source.slot,
                db.approval_over,
                db.side_effect_types,
                mine.approval_over,
                mine.side_effect_types
            )),
            Some(_) => {}
        }
    }
    Ok(out)
}

async fn stored_policy(sql: &Client, slot: &str) -> Result<Option<Policy>, ReplayError> {
    Ok(sql
        .query_opt(
            "SELECT approval_over, side_effect_types FROM outboxd_replay_policy WHERE slot = $1",
            &[&slot],
        )
        .await?
        .map(|r| {
            let mut side_effect_types: Vec<String> = r.get(1);
            side_effect_types.sort();
            Policy {
                approval_over: u64::try_from(r.get::<_, i64>(0)).unwrap_or(0),
                side_effect_types,
            }
        }))
}

/// The database's approval policy for `slot` (what `outboxd init` wrote from the admin's
/// config). Without one, replays of the slot are refused (the guard refuses them too).
pub async fn policy(sql: &Client, slot: &str) -> Result<Policy, ReplayError> {
    stored_policy(sql, slot)
        .await?
        .ok_or_else(|| ReplayError::NoPolicy(slot.to_string()))
}

/// The database's clock: a range ends no later than this (the guard caps it too).
pub async fn now(sql: &Client) -> Result<DateTime<Utc>, ReplayError> {
    Ok(sql.query_one("SELECT now()", &[]).await?.get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_policy_compares_with_the_stored_one_in_order() {
        let c = ReplayConfig {
            side_effect_types: vec!["b".into(), "a".into(), "b".into()],
            approval_over: 7,
            ..ReplayConfig::default()
        };
        let p = Policy::from(&c);
        assert_eq!(p.side_effect_types, ["a", "b"]);
        assert!(p.has_side_effects("a") && !p.has_side_effects("c"));
    }

    #[test]
    fn the_guard_searches_only_pg_catalog_and_says_its_version() {
        let guard = &REPLAY_SQL[REPLAY_SQL
            .find("FUNCTION public.outboxd_replay_guard")
            .unwrap()..];
        assert!(guard.contains("SET search_path = pg_catalog, pg_temp"));
        assert!(REPLAY_SQL.contains(&format!("IS '{GUARD_VERSION}")));
    }
}
