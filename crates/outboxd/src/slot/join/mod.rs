//! Tables that join the publication while outboxd relays it: `[[source.tables]]` `pattern`
//! entries (new tenants without a restart) and every late addition, exactly (R44, issue 30).
//!
//! # What Postgres does (measured on 15.18 with pgoutput and psql; `tests/tests/multi_table_pattern.rs`
//! passes on 14.23, 15.18, 17.10 and 18.4, `tests/tests/tenant_join.rs` on 14.23, 15.18 and 18.4)
//! - pgoutput decodes a table's inserts from the WAL position where the table joined the
//!   publication on: a row committed before is never streamed, and so is a row a transaction
//!   wrote *before* the join even when it commits after it (`ALTER PUBLICATION … ADD TABLE`
//!   takes only ShareUpdateExclusiveLock, so writers straddle it). The same transaction's
//!   later rows, and rows of transactions that began before the join but wrote the table after
//!   it, are streamed.
//! - Rows a transaction writes after adding the table in that same transaction are streamed;
//!   rows it wrote before adding it are not (`CREATE TABLE; INSERT; ALTER PUBLICATION … ADD`).
//! - An event trigger on `ddl_command_end` of `CREATE TABLE` that adds the table runs before
//!   any row can exist (the table is created by that very command): every row is streamed,
//!   including those of the creating transaction. The trigger's own `ALTER PUBLICATION` fires
//!   the publication guard (sql/080) too; its message says `ddl_command_end` with only
//!   `publication relation` objects, which [`crate::slot::publication::concerns`] takes for an
//!   addition (no gap) rather than a change that skipped rows.
//!
//! # Who adds a table
//! - `outboxd init` (as a superuser) installs [`trigger::joiner_sql`]: an event trigger that adds every
//!   table a pattern matches (and a listed table created later) to the publication in the
//!   transaction that creates it (or renames it into a match), SECURITY DEFINER so that the
//!   tenant's migration role needs no rights on the publication. It catches no error: an
//!   exception block is a subtransaction, and the publication row would then carry another
//!   transaction id than the table (measured), which the exactness check below relies on;
//!   as the superuser it adds any permanent table. Without a superuser there is no trigger; then
//! - `outboxd init` adds every matching table it finds (run it on a schedule, or in the
//!   tenant's provisioning), and
//! - each session start ([`resolve`]) and each state write of a streaming session
//!   ([`changed`]) adds the matching tables the publication lacks when the relay's role may (it
//!   owns the publication and the table), and otherwise leaves them out, with a warning, until
//!   someone adds them. Their rows wait in the table (unless the application deletes them: see
//!   the statistics check below, which then stops the relay rather than guess).
//!
//! # Exactness: what a table that joins late is owed
//! The slot's state row records which tables are taken care of (`joined_tables`, oids). At
//! each session start, before streaming, [`catch_up`] looks at every table of the session that
//! is not recorded yet:
//! - "born in the publication": its `pg_publication_rel` row was written by the transaction
//!   that created the table (its system columns' `pg_attribute` rows, never rewritten), its name
//!   and schema are still the creation's (its `pg_type` row is the creation's too: a `RENAME` or
//!   `SET SCHEMA` rewrites it, and the event trigger adds a table renamed or moved into a match
//!   in that same transaction, so the type row alone proves nothing — issue 39), and no row of
//!   the table was written by that transaction before the addition (`cmin` below the
//!   publication row's). Every row is in the stream: nothing owed. (A publication `FOR ALL
//!   TABLES` holds every table from its creation: the same for a pattern's table whose name is
//!   its creation's.) The catalog facts: [`owed`].
//! - a partition of a partitioned outbox (each member below the root is recorded too): owed
//!   nothing when it was created as one (`pg_inherits` written by its creation), the rows it
//!   held before otherwise (`ATTACH PARTITION`), read through the root (`tableoid`); see
//!   [`partitions`].
//! - otherwise its earlier rows were not streamed. Wait until every transaction that holds a
//!   write lock on the table now has ended (pg_locks: every straddler holds RowExclusiveLock
//!   since its first row), then read the whole table under one snapshot and republish every
//!   row through the session's stages (the recovery path: same router, parking, records), in
//!   per-aggregate version order. The session streams meanwhile and holds the table's
//!   streamed events until its rows are handed over (`crate::supervisor::joining`, issue 56;
//!   before, nothing streamed until every debt was paid). Before that, the table's
//!   statistics must show that no row was deleted from it ([`owed::proven_whole`], one settle
//!   for every table the session owes): an application that deletes its outbox rows
//!   (Debezium's insert-then-delete) leaves nothing to republish, and the relay stops naming
//!   the table and the fix instead of recording it as joined on a guess. The snapshot sees every row the
//!   stream lacks: those committed before the join, and the straddlers' (they committed
//!   before it was taken). It may see rows the stream also delivers (committed after the
//!   join, held meanwhile): duplicates with their own `event_id`, after the republished ones,
//!   so the first copies are in order. No lock is taken, so no write is blocked.
//! - then, once all of it is acknowledged, the table is recorded. A crash before that
//!   republishes it again (duplicates only).
//!
//! The first session that finds no record records the tables published then without
//! republishing them: what was streamed before this version stays as it was.
//!
//! While a session streams, a Relation message for a table a pattern matches that the session
//! does not read, or a state write finding one in the publication, ends the session
//! ([`RelayError::TablesChanged`], after its records in flight landed); the next one, a moment
//! later, resolves it and catches up as above. The stream has not confirmed past the table's
//! first row, so a table born in the publication is streamed from its first row, once.
//!
//! A table a pattern matched that was dropped (or left the publication) while the stream still
//! holds rows of it: its Relation message is read through the pattern's mapping
//! ([`crate::relay::outboxes::Outboxes::adopt`]), since the catalog no longer lists it (ending
//! the session would meet the same message again, forever). A drop the state write notices
//! ends the session as a change of tables, not of the publication (no recovery).
//!
//! The relay's role reads every row of a table that joins late: it needs SELECT on the
//! tenants' tables (until then the session retries, naming the grant).
//!
//! # Bounds
//! The tables of one relay (listed plus discovered) are at most [`MAX_TABLES`]: each is a
//! value of the `table` metric label. A session that would read more refuses to start, naming
//! the count.

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::kafka::{Ack, Producer};
use crate::relay::source;
use crate::relay::stages::Stages;
use crate::slot::publication;
use crate::slot::state as slot_state;
use owed::Owed;
use std::collections::BTreeMap;
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;

mod arrive;
mod owed;
pub(crate) mod partitions;
mod pay;

pub use arrive::{assess, newcomers, put_back};
pub use pay::{feed, record, settle, Debt};
mod trigger;

pub use trigger::install;

/// Most tables one relay reads (listed and discovered).
pub const MAX_TABLES: usize = 256;

/// outboxd's own tables (`outbox_parked*`, `outboxd_*`, over `c`, a `pg_class` row): never an
/// outbox, whatever a pattern matches (`%.outbox%` would match `outbox_parked`).
const OWN_TABLES: &str = "c.relname LIKE 'outbox\\_parked%' OR c.relname LIKE 'outboxd\\_%'";

/// One table a pattern matches now.
#[derive(Debug, Clone)]
pub struct Found {
    pub schema: String,
    pub table: String,
    /// The `[[source.tables]]` entry whose pattern matched.
    pub entry: usize,
    pub published: bool,
}

/// The tables the patterns match now, listed ones excepted. Err when a table matches two
/// patterns (which mapping applies would be a guess).
pub async fn discover(cfg: &Config, sql: &Client) -> Result<Vec<Found>, RelayError> {
    let listed: Vec<(String, String)> = cfg.tables().iter().map(OutboxTable::pair).collect();
    let mut found: BTreeMap<(String, String), Found> = BTreeMap::new();
    for (entry, p) in cfg.patterns() {
        let rows = sql
            .query(
                &format!(
                    "SELECT n.nspname::text, c.relname::text, {member} \
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition \
                   AND n.nspname LIKE $1 AND c.relname LIKE $2 \
                   AND NOT ({OWN_TABLES}) ORDER BY 1, 2",
                    member = publication::member_sql("$3", "c.oid")
                ),
                &[&p.schema, &p.table, &cfg.source.publication],
            )
            .await?;
        for r in rows {
            let key: (String, String) = (r.get(0), r.get(1));
            if listed.contains(&key) {
                continue;
            }
            if let Some(other) = found.get(&key) {
                return Err(RelayError::Setup(format!(
                    "{}.{} matches source.tables[{}].pattern and source.tables[{entry}].pattern \
                     = \"{p}\": which mapping and topic apply would be a guess. Narrow the \
                     patterns so that each table matches one, or list the table by name",
                    key.0, key.1, other.entry
                )));
            }
            found.insert(
                key.clone(),
                Found {
                    schema: key.0,
                    table: key.1,
                    entry,
                    published: r.get(2),
                },
            );
        }
    }
    Ok(found.into_values().collect())
}

/// The oid each of `tables` has now (`None`: it does not exist), in one statement: the identity
/// the session streams them under ([`changed`]), and what recovery asks about (slot::vouch).
pub async fn identities(
    sql: &Client,
    tables: &[OutboxTable],
) -> Result<Vec<Option<u32>>, RelayError> {
    let names: Vec<String> = tables.iter().map(partitions::qualified).collect();
    let rows = sql
        .query(
            "SELECT to_regclass(n)::oid FROM unnest($1::text[]) WITH ORDINALITY AS u(n, i) \
             ORDER BY i",
            &[&names],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A table of the session that is no longer the relation the session started with, by
/// identity (issue 56): its name resolves to another oid (dropped and created again under its
/// name), or to nothing (dropped). Either ends the session as a change of tables, not of the
/// publication: the old relation's rows are still in the slot (decoded under their name by the
/// next session) and must not become a "gap" read from the new, empty table — which used to
/// drop the slot holding them. The next session catches the new relation up like any table
/// that joins. `at_start`: [`identities`] when the session started.
async fn replaced(
    cfg: &Config,
    sql: &Client,
    at_start: &[Option<u32>],
) -> Result<Option<String>, RelayError> {
    let tables = cfg.tables();
    let now = identities(sql, &tables).await?;
    for ((t, then), now) in tables.iter().zip(at_start).zip(now) {
        // A pattern's table gone now is a change even when it was already gone at
        // `at_start`: it existed when the session resolved it, and a tenant renamed out
        // between that and `at_start` otherwise reads as unchanged, then as a publication
        // that lacks it (F7, seeds 7036 and 7056: a false halt of every table). A listed
        // table missing at both looks is one the session started without (dropped: it
        // streams the others, [`crate::relay::source`]).
        if *then == now && (now.is_some() || t.discovered.is_none()) {
            continue;
        }
        return Ok(Some(match now {
            // A pattern's tenant dropped: routine.
            None if t.discovered.is_some() => {
                format!("outbox table {} no longer exists", t.label())
            }
            None => format!(
                "outbox table {} no longer exists (dropped): its rows already in the slot are \
                 delivered and the other tables stream on; created again (outboxd init, or \
                 by DDL where init installed the join trigger) it is taken in",
                t.label()
            ),
            Some(o) => format!(
                "outbox table {} is another relation (oid {o}) than the one this session \
                 streamed (dropped and created again under its name?): the old one's rows in \
                 the slot are streamed and the new one is caught up as a table that joins",
                t.label()
            ),
        }));
    }
    Ok(None)
}

/// The configuration a session reads: the listed tables and every table a pattern matches that
/// is in the publication (added now when this role may). A configuration without patterns is
/// returned as it is.
pub async fn resolve(cfg: &Config, sql: &Client) -> Result<Config, RelayError> {
    let mut resolved = resolve_patterns(cfg, sql).await?;
    resolved.partitions = partitions::members(sql, &resolved.tables()).await?;
    resolved.left_partitions = partitions::remember(&resolved, sql).await?;
    Ok(resolved)
}

/// [`resolve`]'s tables.
async fn resolve_patterns(cfg: &Config, sql: &Client) -> Result<Config, RelayError> {
    if !cfg.has_patterns() {
        return Ok(cfg.clone());
    }
    let found = discover(cfg, sql).await?;
    if found.iter().any(|f| !f.published) {
        record_published(cfg, sql, &found).await;
    }
    let mut tables = Vec::new();
    for f in found {
        let label = format!("{}.{}", f.schema, f.table);
        if !f.published {
            if let Err(e) = publication::add_table(cfg, sql, &f.schema, &f.table).await {
                tracing::warn!(table = %label, publication = %cfg.source.publication, error = %RelayError::from(e), "a table the pattern matches is not in the publication and this role cannot add it: it is not relayed until it is added (outboxd init, or ALTER PUBLICATION … ADD TABLE); its rows wait in the table and are published when it joins");
                continue;
            }
            tracing::info!(table = %label, publication = %cfg.source.publication, "added a table the pattern matches to the publication");
        }
        tables.push((f.schema, f.table, f.entry));
    }
    let resolved = cfg.with_discovered(&tables);
    let n = resolved.tables().len();
    if n > MAX_TABLES {
        return Err(RelayError::Setup(format!(
            "the configuration's tables and patterns name {n} tables; at most {MAX_TABLES} go \
             through one relay (each is a metric label value): narrow the patterns and split \
             the tables across relays (each with its own slot and publication)"
        )));
    }
    Ok(resolved)
}

/// Before [`resolve`] adds tables: a state row that records no joined tables yet (written by an
/// older outboxd) records the ones published now, so that the tables this session adds are
/// caught up rather than taken for old members. Best effort: without a row (the slot's first
/// run, whose start publishes nothing already in a table) or a column, [`catch_up`] decides.
async fn record_published(cfg: &Config, sql: &Client, found: &[Found]) {
    if !matches!(slot_state::joined(sql, &cfg.source.slot).await, Ok(None)) {
        return;
    }
    let published: Vec<(String, String, usize)> = found
        .iter()
        .filter(|f| f.published)
        .map(|f| (f.schema.clone(), f.table.clone(), f.entry))
        .collect();
    let mut oids = Vec::new();
    for t in cfg.with_discovered(&published).tables() {
        if let Ok(Some(oid)) = oid_of(sql, &t).await {
            oids.push(oid);
        }
    }
    if let Err(e) = slot_state::add_joined(sql, &cfg.source.slot, &oids).await {
        tracing::debug!(error = %e, "joined tables not recorded before adding tables");
    }
}

/// While a session streams (with every state write): a table a pattern matches that the
/// session does not read, in the publication already (a Relation message may be far ahead in
/// the stream, or never come when the table gets no row) or added now when this role may.
/// `refused`: the tables this session could not add (said once each).
/// Or a table a pattern matched that no longer exists (a tenant dropped): ended too, rather
/// than found missing from the publication, which would be taken for a publication change.
/// Or a partition that joined a partitioned outbox table (listed or matched).
/// Says what changed.
pub async fn changed(
    cfg: &Config,
    sql: &Client,
    refused: &mut Vec<String>,
    at_start: &[Option<u32>],
    known: &[String],
) -> Result<Option<String>, RelayError> {
    if let Some(what) = partitions::attached(cfg, sql).await? {
        return Ok(Some(what));
    }
    if let Some(what) = replaced(cfg, sql, at_start).await? {
        return Ok(Some(what));
    }
    if !cfg.has_patterns() {
        return Ok(None);
    }
    for f in discover(cfg, sql).await? {
        let label = format!("{}.{}", f.schema, f.table);
        if known.contains(&label) {
            continue;
        }
        if f.published {
            return Ok(Some(format!("outbox table {label} joined the publication")));
        }
        if refused.contains(&label) {
            continue;
        }
        match publication::add_table(cfg, sql, &f.schema, &f.table).await {
            Ok(()) => return Ok(Some(format!("outbox table {label} joined the publication"))),
            Err(e) => {
                tracing::warn!(table = %label, error = %RelayError::from(e), "a table the pattern matches is not in the publication and this role cannot add it: not relayed until it is added (outboxd init, or ALTER PUBLICATION … ADD TABLE)");
                refused.push(label);
            }
        }
    }
    Ok(None)
}

/// For the commands that read the tables (`status`, `check`, `cleanup`, `replay`, `parked`):
/// the configuration with the tables the patterns match now that are in the publication (what
/// a session would read), adding none. Unchanged without patterns, or when the catalog cannot
/// be read (the command then reports the connection itself).
pub async fn view(cfg: &Config) -> Config {
    if !cfg.has_patterns() {
        return cfg.clone();
    }
    let found = async {
        let sql = source::sql_connect(cfg).await?;
        discover(cfg, &sql).await
    };
    match found.await {
        Ok(found) => {
            let published: Vec<(String, String, usize)> = found
                .into_iter()
                .filter(|f| f.published)
                .map(|f| (f.schema, f.table, f.entry))
                .collect();
            cfg.with_discovered(&published)
        }
        Err(e) => {
            tracing::warn!(error = %e, "the tables the patterns match could not be read");
            cfg.clone()
        }
    }
}

/// Where [`catch_up`] publishes: the session's stages, producer and acknowledgements.
pub struct Out<'a> {
    pub st: &'a mut Stages,
    pub producer: &'a Producer,
    pub acks: &'a mut mpsc::UnboundedReceiver<Ack>,
    pub shutdown: &'a mut watch::Receiver<bool>,
}

/// Steps of the module docs, before the session streams: records the tables owed nothing and
/// returns what the others are owed. The session streams on and pays them ([`settle`] off its
/// path, then [`feed`] and [`record`]), holding their streamed events meanwhile
/// ([`crate::relay::held`]).
pub async fn catch_up(cfg: &Config, sql: &Client) -> Result<Vec<Debt>, RelayError> {
    let slot = cfg.source.slot.clone();
    // A first session's state row exists only now: its partitions are recorded here.
    partitions::remember(cfg, sql).await?;
    let joined = match slot_state::joined(sql, &slot).await {
        Ok(j) => j,
        // A state table this role could not upgrade: without patterns, today's behaviour.
        Err(e) if !cfg.has_patterns() => {
            tracing::debug!(error = %e, "no joined_tables column: late joins not tracked");
            return Ok(Vec::new());
        }
        Err(e) => {
            return Err(RelayError::Setup(format!(
                "source.tables patterns need outboxd_slot_state.joined_tables ({e}): run \
                 `outboxd init --config FILE` as the admin role"
            )))
        }
    };
    let mut oids = Vec::new();
    for t in cfg.tables() {
        match oid_of(sql, &t).await? {
            Some(o) => oids.push((o, t)),
            // A listed table dropped: the session streams the others (relay::source).
            None if t.discovered.is_none() => {}
            None => {
                return Err(RelayError::TablesChanged(format!(
                    "outbox table {} no longer exists",
                    t.label()
                )))
            }
        }
    }
    let Some(joined) = joined else {
        let mut all: Vec<u32> = oids.iter().map(|(o, _)| *o).collect();
        all.extend(cfg.partitions.iter().map(|(o, _)| *o));
        slot_state::add_joined(sql, &slot, &all).await?;
        return Ok(Vec::new());
    };
    let via_root = partitions::via_root(cfg, sql).await?.unwrap_or(true);
    let mut debts = Vec::new();
    for (oid, t) in &oids {
        let members: Vec<u32> = cfg
            .partitions
            .iter()
            .filter(|(_, root)| *root == t.label())
            .map(|(o, _)| *o)
            .collect();
        if !joined.contains(oid) {
            // Retried (the GRANT can come while the relay waits), not a stop.
            let qualified = partitions::qualified(t);
            let discovered = t.discovered.is_some();
            let owed = owed::table(cfg, sql, *oid, &qualified, discovered, via_root)
                .await
                .map_err(|e| unreadable(t, e))?;
            if owed == Owed::EarlierRows {
                tracing::warn!(table = %t.label(), "the table joined the publication after it held rows: republishing every row it holds (duplicates of rows the stream also delivers carry the same event_id)");
                let mut rels = vec![*oid];
                rels.extend(&members);
                // Its partitions are read whole with it.
                debts.push(pay::Debt {
                    table: t.clone(),
                    done: rels.clone(),
                    rels,
                    filter: "TRUE".into(),
                });
                continue;
            }
            tracing::info!(table = %t.label(), "a table joined the publication when it was created: streamed from its first row");
            // Only the root is proven: a partition attached with rows it held before (even in
            // the creating transaction) is owed them, so each member is judged below (issue
            // 56: a pre-filled partition attached to a new tenant was never published).
            slot_state::add_joined(sql, &slot, &[*oid]).await?;
        }
        for m in members.iter().filter(|m| !joined.contains(m)) {
            let qualified = partitions::qualified(t);
            let owed = owed::partition(sql, *m, &qualified, via_root)
                .await
                .map_err(|e| unreadable(t, e))?;
            let leaves = partitions::leaves(sql, *m).await?;
            if owed == Owed::EarlierRows && !leaves.is_empty() {
                tracing::warn!(table = %t.label(), partition = m, "a partition joined the table after it held rows (ATTACH PARTITION): republishing every row it holds");
                let list: Vec<String> = leaves.iter().map(|l| format!("{l}::oid")).collect();
                let filter = format!("tableoid IN ({})", list.join(", "));
                let mut rels = vec![*m];
                rels.extend(&leaves);
                debts.push(pay::Debt {
                    table: t.clone(),
                    rels,
                    filter,
                    done: vec![*m],
                });
                continue;
            }
            slot_state::add_joined(sql, &slot, &[*m]).await?;
        }
    }
    Ok(debts)
}

/// A table that joined cannot be read: retried (the GRANT can come while the relay waits).
fn unreadable(t: &OutboxTable, e: RelayError) -> RelayError {
    RelayError::Postgres(format!(
        "reading {}, which joined the publication: {e}. The relay's role reads every \
         table it relays (GRANT SELECT ON it; for tables a pattern matches, ALTER \
         DEFAULT PRIVILEGES … GRANT SELECT ON TABLES TO the relay's role in the \
         tenants' schemas, see docs/operations.md)",
        t.label()
    ))
}

/// The table's oid, `None` when no table has its name.
async fn oid_of(sql: &Client, t: &OutboxTable) -> Result<Option<u32>, RelayError> {
    Ok(sql
        .query_one("SELECT to_regclass($1)::oid", &[&partitions::qualified(t)])
        .await?
        .get(0))
}
