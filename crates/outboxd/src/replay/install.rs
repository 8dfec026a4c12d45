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

/// Creates or upgrades the audit table, the policy table and the guard, then writes this
/// config's `[replay]` policy for `cfg.source.slot`. Run by `outboxd init`, as the admin role
/// that is to own these tables (the owner of `outboxd_replay` can disable its guard).
/// Idempotent: a role that owns them replaces the guard function and trigger each time (an
/// older install gets this one); any other role (init re-run by the relay's role) finds them
/// current and changes nothing, or is told to run init as their owner. The policy is written
/// only by a role that may write it; otherwise the database's policy stays (check says so).
pub async fn install(sql: &Client, cfg: &Config) -> Result<(), ReplayError> {
    let schema = crate::schema::current(sql).await?;
    let s = install_state(sql, Some(&outbox(cfg))).await?;
    let foreign = s.foreign();
    if !foreign.is_empty() {
        return Err(ReplayError::Relay(RelayError::Setup(format!(
            "{}: neither a superuser nor the outbox table's owner (the admin), so it can disable \
             or replace the replay guard (an older `outboxd replay` created the table as \
             whoever ran it first). As a superuser: ALTER TABLE outboxd_replay OWNER TO the \
             admin role (likewise outboxd_replay_policy and FUNCTION outboxd_replay_guard()), \
             review the replays recorded meanwhile, then run `outboxd init` again",
            foreign.join(", ")
        ))));
    }
    if s.owned_by_me || !s.current() {
        if let (false, Some((_, owner, _))) = (s.owned_by_me, s.owners.first()) {
            let table = format!("{}.outboxd_replay", quote_ident(&schema));
            return Err(ReplayError::Relay(RelayError::Setup(format!(
                "{table} and its guard (owned by role {owner}) are missing parts or predate this \
                 outboxd: run `outboxd init` as their owner, the admin role (sql/roles.sql)"
            ))));
        }
        sql.batch_execute(&crate::schema::qualified(REPLAY_SQL, &schema))
            .await
            .map_err(|e| {
                ReplayError::Relay(RelayError::Setup(format!(
                    "cannot create or upgrade outboxd_replay and its guard ({}): run `outboxd \
                     init` as the admin role that owns them (sql/roles.sql)",
                    RelayError::from(e)
                )))
            })?;
    }
    let mine = Policy::from(&cfg.replay);
    if stored_policy(sql, &cfg.source.slot).await?.as_ref() == Some(&mine) {
        return Ok(());
    }
    let may_write: bool = sql
        .query_one(
            "SELECT has_table_privilege('outboxd_replay_policy', 'INSERT') \
               AND has_table_privilege('outboxd_replay_policy', 'UPDATE')",
            &[],
        )
        .await?
        .get(0);
    if !may_write {
        tracing::warn!(
            slot = %cfg.source.slot,
            "this role may not write the replay policy (outboxd_replay_policy): the database's \
             policy applies; run init as the admin to change it"
        );
        return Ok(());
    }
    let over = i64::try_from(mine.approval_over).unwrap_or(i64::MAX);
    sql.execute(
        "INSERT INTO outboxd_replay_policy AS p (slot, approval_over, side_effect_types) \
         VALUES ($1, $2, $3) \
         ON CONFLICT (slot) DO UPDATE SET approval_over = EXCLUDED.approval_over, \
           side_effect_types = EXCLUDED.side_effect_types, updated_by = current_user, \
           updated_at = now()",
        &[&cfg.source.slot, &over, &mine.side_effect_types],
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
    /// The owners of the audit table, the policy table and the guard function (those present):
    /// (what, owner, whether the owner is a superuser or the outbox table's owner, the admin).
    owners: Vec<(String, String, bool)>,
    /// The connection's role is (a member of) the owner of each of them that is present.
    owned_by_me: bool,
}

impl InstallState {
    /// Everything `outboxd replay` needs is there, this version's (enabled or not).
    fn current(&self) -> bool {
        self.table && self.policy_table && self.guard_current && self.trigger.is_some()
    }

    /// Objects owned by a role that is neither a superuser nor the outbox table's owner (an
    /// operator who created the table with an older `outboxd replay`, say): it can disable or
    /// replace the guard.
    fn foreign(&self) -> Vec<String> {
        let odd = self.owners.iter().filter(|o| !o.2);
        odd.map(|(what, owner, _)| format!("{what} is owned by role {owner}"))
            .collect()
    }
}

/// `outbox`: the outbox table's name (`schema.table`, quoted), whose owner is the admin (None,
/// or no such table: owners are not judged).
async fn install_state(sql: &Client, outbox: Option<&str>) -> Result<InstallState, ReplayError> {
    let schema = quote_ident(&crate::schema::current(sql).await?);
    let (table, policy, guard) = (
        format!("{schema}.outboxd_replay"),
        format!("{schema}.outboxd_replay_policy"),
        format!("{schema}.outboxd_replay_guard()"),
    );
    let r = sql
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, \
               coalesce((SELECT p.proconfig @> ARRAY['search_path=pg_catalog, pg_temp'] \
                           AND coalesce(obj_description(p.oid, 'pg_proc'), '') LIKE $4 || '%' \
                         FROM pg_proc p WHERE p.oid = to_regprocedure($3)), false), \
               (SELECT t.tgenabled::\"char\" FROM pg_trigger t WHERE t.tgrelid = to_regclass($1) \
                  AND t.tgname = 'outboxd_replay_guard' AND t.tgfoid = to_regprocedure($3))",
            &[&table, &policy, &guard, &GUARD_VERSION],
        )
        .await?;
    let owners = sql
        .query(
            "SELECT x.what, x.o::regrole::text, \
               r.rolsuper OR coalesce(x.o = (SELECT relowner FROM pg_class \
                                             WHERE oid = to_regclass($4)), \
                                      to_regclass($4) IS NULL), \
               pg_has_role(current_user, x.o, 'USAGE') \
             FROM (VALUES \
               (1, 'table outboxd_replay', (SELECT relowner FROM pg_class \
                                            WHERE oid = to_regclass($1))), \
               (2, 'table outboxd_replay_policy', (SELECT relowner FROM pg_class \
                                                   WHERE oid = to_regclass($2))), \
               (3, 'function outboxd_replay_guard()', (SELECT proowner FROM pg_proc \
                                                       WHERE oid = to_regprocedure($3)))) \
               AS x(n, what, o) JOIN pg_roles r ON r.oid = x.o ORDER BY x.n",
            &[&table, &policy, &guard, &outbox],
        )
        .await?;
    Ok(InstallState {
        table: r.get(0),
        policy_table: r.get(1),
        guard_current: r.get(2),
        trigger: r.get(3),
        owned_by_me: owners.iter().all(|o| o.get::<_, bool>(3)),
        owners: owners
            .iter()
            .map(|o| {
                (
                    o.get(0),
                    o.get(1),
                    o.get::<_, Option<bool>>(2).unwrap_or(false),
                )
            })
            .collect(),
    })
}

/// The outbox table's quoted name (its owner is the admin).
fn outbox(cfg: &Config) -> String {
    let (schema, table) = cfg.table_name();
    format!("{}.{}", quote_ident(&schema), quote_ident(&table))
}

/// Refuses to go on unless `outboxd init` installed the audit table, the policy table and this
/// version's guard. `outboxd replay` never creates them: whoever creates a table owns it, and
/// its owner can disable the guard.
pub async fn require_installed(sql: &Client) -> Result<(), ReplayError> {
    let s = install_state(sql, None).await?;
    if !s.current() {
        return Err(ReplayError::NotInstalled);
    }
    match s.trigger {
        // `O`: fires (the default); `A`: fires always. `D` (disabled) or `R` (replica only).
        Some(e) if e == b'O' as i8 || e == b'A' as i8 => Ok(()),
        _ => Err(ReplayError::GuardDisabled),
    }
}

/// Warnings for `outboxd check` (none when all is well): the install is missing or older than
/// this outboxd, the guard is disabled, one of its objects is owned by a role that is neither a
/// superuser nor the admin (the outbox table's owner), or the database's policy is not this
/// config's `[replay]`.
pub async fn check_install(sql: &Client, cfg: &Config) -> Result<Vec<String>, ReplayError> {
    let s = install_state(sql, Some(&outbox(cfg))).await?;
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
    for f in s.foreign() {
        out.push(format!(
            "{f}, neither a superuser nor the outbox table's owner (the admin): it can disable \
             or replace the replay guard; as a superuser ALTER … OWNER TO the admin role and run \
             `outboxd init` again"
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
