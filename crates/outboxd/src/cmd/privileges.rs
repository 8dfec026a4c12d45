//! What `outboxd check` says about the role of `source.dsn`: each privilege the relay needs and
//! lacks, by name and with the GRANT that fixes it; each one it has beyond them (superuser,
//! owning the business table) as a warning; and a stream that is not guaranteed encrypted.
//!
//! The set mirrors `sql/roles.sql`'s relay role: REPLICATION; SELECT on the outbox table (slot
//! loss recovery reads it); its own tables in `source.relay_schema`; nothing else.

use super::check_line::CheckLine;
use crate::config::Config;
use crate::relay::source::quote_ident;
use tokio_postgres::Client;

/// outboxd's own tables and the privileges the relay uses on each.
const RELAY_TABLES: [(&str, &str); 4] = [
    ("outbox_parked", "SELECT"),
    ("outbox_parked_audit", "SELECT"),
    ("outboxd_status", "SELECT, INSERT, UPDATE"),
    ("outboxd_slot_state", "SELECT, INSERT, UPDATE"),
];

/// The columns of `outbox_parked` the relay inserts (sql/roles.sql grants exactly these): not
/// `id`, which the guard takes from the sequence, nor what the guard sets (issue 53).
const PARKED_RELAY_INSERTS: [&str; 19] = [
    "slot",
    "event_id",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "event_type",
    "topic",
    "record_key",
    "payload",
    "headers",
    "record_ts_ms",
    "commit_lsn",
    "state",
    "blocks_aggregate",
    "blocked_by",
    "error_class",
    "error_message",
    "integrity_tag",
    "source_relid",
];

/// The columns of `outbox_parked` the relay updates (sql/roles.sql grants exactly these).
const PARKED_RELAY_UPDATES: [&str; 7] = [
    "state",
    "attempts",
    "last_seen",
    "resolved_at",
    "error_class",
    "error_message",
    "retry_audit_id",
];

pub async fn check(cfg: &Config, sql: &Client) -> Vec<CheckLine> {
    match lines(cfg, sql).await {
        Ok(l) => l,
        Err(e) => vec![CheckLine::fail(
            "privileges",
            crate::error::RelayError::from(e).to_string(),
        )],
    }
}

async fn lines(cfg: &Config, sql: &Client) -> Result<Vec<CheckLine>, tokio_postgres::Error> {
    let mut out = Vec::new();
    let me = sql
        .query_one(
            "SELECT current_user::text, rolreplication, rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let (role, replication, superuser): (String, bool, bool) = (me.get(0), me.get(1), me.get(2));
    let role_q = quote_ident(&role);
    let mut missing = Vec::new();
    if !(replication || superuser) {
        missing.push(format!("ALTER ROLE {role_q} WITH REPLICATION;"));
    }
    for t in cfg.tables() {
        let outbox = format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name));
        if !can(sql, &outbox, "SELECT").await? {
            missing.push(format!(
                "GRANT USAGE ON SCHEMA {} TO {role_q}; GRANT SELECT ON {outbox} TO {role_q};",
                quote_ident(&t.schema)
            ));
        }
    }
    let rs = quote_ident(&cfg.source.relay_schema);
    for (t, privs) in RELAY_TABLES {
        let qualified = format!("{rs}.{t}");
        let exists: bool = sql
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
            .await?
            .get(0);
        if !exists {
            continue; // reported below: `init` creates it
        }
        let mut lacking = Vec::new();
        for p in privs.split(", ") {
            if !can(sql, &qualified, p).await? {
                lacking.push(p);
            }
        }
        if !lacking.is_empty() {
            missing.push(format!(
                "GRANT {} ON {qualified} TO {role_q};",
                lacking.join(", ")
            ));
        }
    }
    // The columns a relay changes when it releases or re-parks an event; the rest of a parked
    // row is frozen (sql/030's guard), and sql/roles.sql grants no more.
    let parked = format!("{rs}.outbox_parked");
    for (privilege, columns) in [
        ("INSERT", &PARKED_RELAY_INSERTS[..]),
        ("UPDATE", &PARKED_RELAY_UPDATES[..]),
    ] {
        let ok: bool = sql
            .query_one(
                "SELECT coalesce(bool_and(has_column_privilege(to_regclass($1), c, $3)), true) \
                 FROM unnest($2::text[]) c WHERE to_regclass($1) IS NOT NULL",
                &[&parked, &columns.to_vec(), &privilege],
            )
            .await?
            .get(0);
        if !ok {
            missing.push(format!(
                "GRANT {privilege} ({}) ON {parked} TO {role_q};",
                columns.join(", ")
            ));
        }
    }
    let seq = format!("{rs}.outbox_parked_id_seq");
    let seq_ok: bool = sql
        .query_one(
            "SELECT coalesce(has_sequence_privilege(to_regclass($1), 'USAGE'), true)",
            &[&seq],
        )
        .await?
        .get(0);
    if !seq_ok {
        missing.push(format!("GRANT USAGE ON SEQUENCE {seq} TO {role_q};"));
    }
    let absent: i64 = sql
        .query_one(
            "SELECT count(*) FROM unnest($1::text[]) t WHERE to_regclass(t) IS NULL",
            &[&RELAY_TABLES
                .iter()
                .map(|(t, _)| format!("{rs}.{t}"))
                .collect::<Vec<_>>()],
        )
        .await?
        .get(0);
    if absent > 0 {
        let create: bool = sql
            .query_one(
                "SELECT coalesce((SELECT has_schema_privilege(oid, 'CREATE') FROM pg_namespace WHERE nspname = $1), \
                        has_database_privilege(current_database(), 'CREATE'))",
                &[&cfg.source.relay_schema],
            )
            .await?
            .get(0);
        if !create {
            missing.push(format!(
                "{absent} of outboxd's tables do not exist in {rs} and this role may not create them: \
                 run `outboxd init` as an administrative role (sql/roles.sql)"
            ));
        }
    }
    if cfg.heartbeat.interval_ms > 0 {
        let emit: bool = sql
            .query_one(
                // By oid: PostgreSQL 17 added a fourth argument (flush), so no one signature
                // names the function on every version.
                "SELECT coalesce(bool_or(has_function_privilege(oid, 'EXECUTE')), false) \
                 FROM pg_proc WHERE proname = 'pg_logical_emit_message' \
                   AND pronamespace = 'pg_catalog'::regnamespace",
                &[],
            )
            .await?
            .get(0);
        if !emit {
            missing.push(format!(
                "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO {role_q}; \
                 (heartbeats; or set heartbeat.interval_ms = 0)"
            ));
        }
    }
    if missing.is_empty() {
        out.push(CheckLine::ok(
            "privileges",
            format!("role {role} has what the relay needs (sql/roles.sql)"),
        ));
    } else {
        for m in missing {
            out.push(CheckLine::fail("privileges", m));
        }
    }
    if superuser {
        out.push(CheckLine::warn(
            "privileges",
            format!(
                "role {role} is a superuser: the relay needs REPLICATION and the grants of \
                 sql/roles.sql only; a leaked relay credential should not own the database"
            ),
        ));
    }
    for t in cfg.tables() {
        let outbox = format!("{}.{}", quote_ident(&t.schema), quote_ident(&t.name));
        let owns: bool = sql
            .query_one(
                "SELECT coalesce((SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass($1)), false)",
                &[&outbox],
            )
            .await?
            .get(0);
        if owns && !superuser {
            out.push(CheckLine::warn(
                "privileges",
                format!(
                    "role {role} owns the business table {outbox}: the relay only reads it; let \
                     an administrative role own it (sql/roles.sql)"
                ),
            ));
        }
    }
    Ok(out)
}

/// The trust-boundary guards on outboxd's tables (sql/030, 050, 060): each one missing or
/// disabled, and each table the connecting role itself owns (an owner can disable a guard),
/// as a warning naming the fix. Superusers and owners can still do anything: these lines are
/// how an install that lost its guards is noticed.
pub async fn guards(cfg: &Config, sql: &Client) -> Vec<CheckLine> {
    match guard_lines(cfg, sql).await {
        Ok(l) => l,
        Err(e) => vec![CheckLine::fail("guards", e.to_string())],
    }
}

async fn guard_lines(
    cfg: &Config,
    sql: &Client,
) -> Result<Vec<CheckLine>, crate::error::RelayError> {
    let mut out = Vec::new();
    let mut gaps = Vec::new();
    if crate::slot::state::table_exists(sql).await?
        && !crate::slot::state::guard_installed(sql).await?
    {
        gaps.push("outboxd_slot_state (bounds on the delivery state)");
    }
    let parked: bool = sql
        .query_one("SELECT to_regclass('outbox_parked') IS NOT NULL", &[])
        .await?
        .get(0);
    if parked && !crate::poison::store::guards_installed(sql).await? {
        gaps.push("outbox_parked and outbox_parked_audit (frozen records, audited transitions)");
    }
    for g in &gaps {
        out.push(CheckLine::warn(
            "guards",
            format!(
                "{g}: the guard of this version is missing or disabled, so a leaked relay or \
                 repair credential can change what it protects: run `outboxd init` as the admin \
                 role (sql/roles.sql)"
            ),
        ));
    }
    let owned: Vec<String> = sql
        .query(
            "SELECT c.relname::text FROM pg_class c \
             WHERE c.oid = ANY(ARRAY[to_regclass('outbox_parked'), to_regclass('outbox_parked_audit'), \
                   to_regclass('outboxd_slot_state'), to_regclass('outboxd_replay')]) \
               AND pg_has_role(c.relowner, 'USAGE') \
               AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if !owned.is_empty() {
        let who: String = sql
            .query_one("SELECT current_user::text", &[])
            .await?
            .get(0);
        out.push(CheckLine::warn(
            "guards",
            format!(
                "role {} owns {} in {}: an owner can disable their guards; let the admin role \
                 own outboxd's tables and run the relay as outboxd_relay (sql/roles.sql)",
                quote_ident(&who),
                owned.join(", "),
                quote_ident(&cfg.source.relay_schema)
            ),
        ));
    }
    if gaps.is_empty() && owned.is_empty() {
        out.push(CheckLine::ok(
            "guards",
            "outboxd's tables are guarded (sql/030, 050) and owned by another role".to_string(),
        ));
    }
    Ok(out)
}

/// May this role use `privilege` on the table `object` (true when it does not exist)?
async fn can(sql: &Client, object: &str, privilege: &str) -> Result<bool, tokio_postgres::Error> {
    let r = sql
        .query_one(
            "SELECT coalesce(has_table_privilege(to_regclass($1), $2), true)",
            &[&object, &privilege],
        )
        .await?;
    Ok(r.get(0))
}

/// The stream and SQL connection to a remote host are not guaranteed encrypted below
/// `require`, and not authenticated below `verify-full`: a man in the middle can downgrade
/// `prefer` to cleartext.
pub fn encryption(cfg: &Config) -> Option<CheckLine> {
    use crate::model::tls::SslMode;
    let dsn: tokio_postgres::Config = cfg.source.dsn.parse().ok()?;
    let remote = dsn.get_hosts().iter().any(|h| match h {
        tokio_postgres::config::Host::Tcp(h) => {
            !(h == "localhost"
                || h.parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback()))
        }
        tokio_postgres::config::Host::Unix(_) => false,
    });
    if !remote {
        return None;
    }
    let mode = crate::relay::tls::mode(cfg.source.tls(), &dsn);
    let why = match mode {
        SslMode::VerifyFull => return None,
        SslMode::Disable => "is sent in cleartext (sslmode = disable)",
        SslMode::Prefer => {
            "may be sent in cleartext: sslmode = prefer lets anyone on the path downgrade it"
        }
        SslMode::Require | SslMode::VerifyCa => {
            "is encrypted, but the server is not verified: a man in the middle can read it"
        }
    };
    Some(CheckLine::warn(
        "encryption",
        format!(
            "the replication stream to a remote host {why}; set source.sslmode = \"verify-full\" \
             and source.sslrootcert (docs/configuration.md)"
        ),
    ))
}
