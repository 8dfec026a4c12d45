//! Running a plan against one test world (Postgres, tansu, the relay as a process), the ledger
//! of every row written, and the oracle that reads every topic back at the end.

use super::plan::{agg_id, Kind, Model, Planned, Route, Rows, Sig, St, Step};
use outboxd_tests::reliability::{exit_signal, read_log};
use outboxd_tests::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// The Debezium outbox table (as tests/tests/silent_loss.rs creates it).
const DBZ_TABLE: &str = "CREATE TABLE public.dbz_outbox (id uuid PRIMARY KEY, \
     aggregatetype varchar(255) NOT NULL, aggregateid varchar(255) NOT NULL, \
     type varchar(255) NOT NULL, payload jsonb)";

// Bounds keep a failing seed within nextest's 5 minutes (.config/nextest.toml); a passing one
// needs a fraction (a join's catch-up waits 11 s for the statistics, a few sessions in a row).
/// How long a `Settle` step (or a leave) waits for the slot.
const SETTLE: Duration = Duration::from_secs(60);
/// How long the end waits for the slot (30 s once a finding ended the sequence), then for the
/// topics.
const FINAL_SETTLE: Duration = Duration::from_secs(100);
const FINAL_READ: Duration = Duration::from_secs(45);

fn tables_toml(dbz: bool) -> String {
    let mut s = String::from("[[source.tables]]\nname = \"public.outbox\"\n");
    if dbz {
        s.push_str(
            "[[source.tables]]\nname = \"public.dbz_outbox\"\ncolumns = { preset = \"debezium\" }\n",
        );
    }
    s.push_str("[[source.tables]]\npattern = \"tenant_%.outbox\"\ntopic = \"tenants.{schema}\"\n");
    s
}

/// What a written row is owed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Committed while its table was relayed: must arrive.
    Relayed,
    /// Committed while its table was pending: must arrive once the table joined.
    Held,
    /// Committed after its table left the pattern: not expected (not checked).
    Unrelayed,
    /// Rolled back: must never arrive.
    RolledBack,
}

#[derive(Debug, Clone)]
struct Row {
    id: String,
    table: usize,
    agg: String,
    version: i64,
    xid: u64,
    class: Class,
    step: usize,
}

/// A halt the oracle accepts (the sequence ends there).
#[derive(Debug, Clone)]
pub enum Halt {
    /// Rows of the Debezium table were in the lost slot's gap: nothing can republish them.
    Expected(String),
    /// The relay could not prove the gap although nothing of it was lost; its documented
    /// conservative rule (statistics without a witness row) explains it. Reported, not failed.
    Conservative(String),
}

/// One sequence's result.
#[derive(Debug, Default)]
pub struct Outcome {
    pub seed: u64,
    pub dbz: bool,
    pub planned: usize,
    pub run: usize,
    pub committed: usize,
    pub rolled_back: usize,
    pub required: usize,
    pub records: usize,
    pub halt: Option<Halt>,
    /// Failures: losses, order, rolled-back rows delivered, false halts, crashes, stalls.
    pub findings: Vec<String>,
    /// Observations that do not fail the sequence.
    pub notes: Vec<String>,
    pub elapsed: Duration,
    /// Where the relay's log was kept, and its last lines (failing sequences).
    pub log_copy: Option<PathBuf>,
    pub log_tail: String,
}

struct Run {
    env: Env,
    c: tokio_postgres::Client,
    model: Model,
    config: PathBuf,
    log: PathBuf,
    relay: Option<RelayProcess>,
    /// Length of the (stripped) log when the relay was last spawned.
    log_from: usize,
    rows: Vec<Row>,
    /// The first transaction id of the last lost slot's gap (the state row's `recovering_xid`
    /// or `delivered_xid`, read before the relay started after the drop).
    gap_from: Option<u64>,
    /// The sequence ended before its last step (the relay exited by itself, or a finding).
    ended: bool,
    /// The relay exited by itself (a halt, a crash): the end does not start it again.
    dead: bool,
    settle_leaves: bool,
    out: Outcome,
}

/// Runs `plan` (the seed's, maybe cut short) and checks the result. Errors are failures of
/// the world (SQL, broker), reported with the step.
/// `settle_leaves`: a leave first waits until the slot caught up and the rows the table held
/// when it joined were delivered (known findings F1, F2).
pub async fn run(
    seed: u64,
    dbz: bool,
    plan: &[Planned],
    settle_leaves: bool,
) -> anyhow::Result<Outcome> {
    let t0 = Instant::now();
    let mut r = setup(seed, dbz, plan).await?;
    r.settle_leaves = settle_leaves;
    r.out.planned = plan.len();
    for (i, p) in plan.iter().enumerate() {
        r.out.run = i + 1;
        r.step(i, &p.step)
            .await
            .map_err(|e| anyhow::anyhow!("step {i} ({:?}): {e:#}", p.step))?;
        if i == 0 && !r.ended {
            // The first delivery, and a state row with a delivered_xid (a slot lost before it
            // would halt by design: nothing proves the gap).
            r.settle(SETTLE, "the first delivery").await?;
            if !r.ended {
                r.env.mark_recorded().await?;
            }
        }
        if r.ended {
            break;
        }
        tokio::time::sleep(Duration::from_millis(p.pause_ms)).await;
        if r.check_exit(&format!("after step {i}"))? || r.ended {
            break;
        }
    }
    r.finish().await?;
    r.out.elapsed = t0.elapsed();
    if !r.out.findings.is_empty() {
        let keep = std::env::temp_dir().join(format!("outboxd-seq-{seed}.log"));
        if std::fs::copy(&r.log, &keep).is_ok() {
            r.out.log_copy = Some(keep);
        }
    }
    Ok(std::mem::take(&mut r.out))
}

async fn setup(seed: u64, dbz: bool, plan: &[Planned]) -> anyhow::Result<Run> {
    let mut env = Env::start(&format!("seq{seed}")).await?;
    let c = env.sql().await?;
    if dbz {
        c.batch_execute(DBZ_TABLE).await?;
    }
    env.extra_toml = tables_toml(dbz);
    // As a superuser: the event trigger that adds a table created (or renamed, moved) into
    // the pattern in its own transaction.
    let done = outboxd::init(&env.config()?).await?;
    anyhow::ensure!(
        done.iter()
            .any(|l| l.contains("event trigger outboxd_join_outbox_pub installed")),
        "init did not install the event trigger: {done:?}"
    );
    // Every topic the plan can reach.
    let mut m = Model::new(dbz);
    for p in plan {
        m.apply(&p.step);
    }
    let topics: HashSet<String> = m.tables.iter().map(|t| t.topic()).collect();
    let topics: Vec<String> = topics.into_iter().collect();
    create_topics(&env.bootstrap(), &topics, 2).await?;
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let mut r = Run {
        c,
        model: Model::new(dbz),
        config,
        log,
        relay: None,
        log_from: 0,
        rows: Vec::new(),
        gap_from: None,
        ended: false,
        dead: false,
        settle_leaves: true,
        out: Outcome {
            seed,
            dbz,
            ..Default::default()
        },
        env,
    };
    r.spawn()?;
    Ok(r)
}

/// `n` rows into `qualified` (outboxd's columns), in `tx`. Returns (event_id, aggregate, version).
async fn insert(
    tx: &tokio_postgres::Transaction<'_>,
    qualified: &str,
    table: usize,
    aggregate_type: &str,
    rows: &Rows,
) -> anyhow::Result<Vec<(String, String, i64)>> {
    if rows.is_empty() {
        return Ok(vec![]);
    }
    let stmt = tx
        .prepare(&format!(
            "INSERT INTO {qualified} (event_id, aggregate_type, aggregate_id, aggregate_version, \
             event_type, payload) VALUES ($1::text::uuid, $2, $3, $4, 'Deposited', \
             jsonb_build_object('v', $4::bigint))"
        ))
        .await?;
    let mut out = Vec::new();
    for &(a, v) in rows {
        let id = uuid::Uuid::now_v7().to_string();
        let agg = agg_id(table, a);
        tx.execute(&stmt, &[&id, &aggregate_type, &agg, &v]).await?;
        out.push((id, agg, v));
    }
    Ok(out)
}

async fn xid(tx: &tokio_postgres::Transaction<'_>) -> anyhow::Result<u64> {
    let s: String = tx
        .query_one("SELECT pg_current_xact_id()::text", &[])
        .await?
        .get(0);
    Ok(s.parse()?)
}

impl Run {
    fn record(
        &mut self,
        step: usize,
        table: usize,
        xid: u64,
        class: Class,
        ids: Vec<(String, String, i64)>,
    ) {
        for (id, agg, version) in ids {
            self.rows.push(Row {
                id,
                table,
                agg,
                version,
                xid,
                class,
                step,
            });
        }
    }

    fn class_of(&self, table: usize, rollback: bool) -> Class {
        if rollback {
            return Class::RolledBack;
        }
        match self.model.tables[table].state {
            St::Relayed => Class::Relayed,
            St::Pending => Class::Held,
            St::Left => Class::Unrelayed,
        }
    }

    fn aggregate_type(&self, table: usize) -> &'static str {
        match self.model.tables[table].kind {
            Kind::Public => "pub",
            _ => "acct",
        }
    }

    async fn step(&mut self, i: usize, step: &Step) -> anyhow::Result<()> {
        match step {
            Step::Insert {
                table,
                rows,
                rollback,
            } => {
                let class = self.class_of(*table, *rollback);
                let q = self.model.tables[*table].qualified();
                let at = self.aggregate_type(*table);
                let tx = self.c.transaction().await?;
                let x = xid(&tx).await?;
                let ids = insert(&tx, &q, *table, at, rows).await?;
                if *rollback {
                    tx.rollback().await?;
                } else {
                    tx.commit().await?;
                }
                self.record(i, *table, x, class, ids);
            }
            Step::DbzInsert { rows } => {
                let t = self.model.dbz_table().expect("dbz table");
                for &(a, v) in rows {
                    let tx = self.c.transaction().await?;
                    let x = xid(&tx).await?;
                    let id = uuid::Uuid::now_v7().to_string();
                    let agg = agg_id(t, a);
                    tx.execute(
                        "INSERT INTO public.dbz_outbox VALUES ($1::text::uuid, 'order', $2, \
                         'OrderPlaced', jsonb_build_object('v', $3::bigint))",
                        &[&id, &agg, &v],
                    )
                    .await?;
                    tx.execute(
                        "DELETE FROM public.dbz_outbox WHERE id = $1::text::uuid",
                        &[&id],
                    )
                    .await?;
                    tx.commit().await?;
                    self.record(i, t, x, Class::Relayed, vec![(id, agg, v)]);
                }
            }
            Step::CreateTenant {
                table,
                schema,
                rows,
            } => {
                let tx = self.c.transaction().await?;
                let x = xid(&tx).await?;
                tx.batch_execute(&format!(
                    "CREATE SCHEMA {schema}; \
                     CREATE TABLE {schema}.outbox (LIKE public.outbox INCLUDING ALL)"
                ))
                .await?;
                let ids = insert(&tx, &format!("{schema}.outbox"), *table, "acct", rows).await?;
                tx.commit().await?;
                self.record(i, *table, x, Class::Relayed, ids);
            }
            Step::Prepare {
                table,
                route,
                tenant,
                rows,
            } => {
                let (schema, name) = match route {
                    Route::Rename => (tenant.clone(), "outbox_new"),
                    Route::Move => (super::plan::staging(tenant), "outbox"),
                };
                let tx = self.c.transaction().await?;
                let x = xid(&tx).await?;
                tx.batch_execute(&format!(
                    "CREATE SCHEMA {schema}; \
                     CREATE TABLE {schema}.{name} (LIKE public.outbox INCLUDING ALL)"
                ))
                .await?;
                let ids = insert(&tx, &format!("{schema}.{name}"), *table, "acct", rows).await?;
                tx.commit().await?;
                self.record(i, *table, x, Class::Held, ids);
            }
            Step::Join {
                table,
                before,
                after,
            } => {
                let t = &self.model.tables[*table];
                let (from, tenant) = (t.qualified(), t.tenant.clone().expect("tenant"));
                let ddl = if t.name == "outbox_new" {
                    format!("ALTER TABLE {from} RENAME TO outbox")
                } else {
                    format!("CREATE SCHEMA {tenant}; ALTER TABLE {from} SET SCHEMA {tenant}")
                };
                let tx = self.c.transaction().await?;
                let x = xid(&tx).await?;
                let held = insert(&tx, &from, *table, "acct", before).await?;
                tx.batch_execute(&ddl).await?;
                let streamed =
                    insert(&tx, &format!("{tenant}.outbox"), *table, "acct", after).await?;
                tx.commit().await?;
                self.record(i, *table, x, Class::Held, held);
                self.record(i, *table, x, Class::Relayed, streamed);
            }
            Step::Leave { table } => {
                if self.settle_leaves {
                    self.settle(SETTLE, "the slot before a leave").await?;
                    if self.ended {
                        return Ok(());
                    }
                    self.held_delivered(*table).await?;
                    if self.ended {
                        return Ok(());
                    }
                }
                let q = self.model.tables[*table].qualified();
                self.c
                    .batch_execute(&format!("ALTER TABLE {q} RENAME TO outbox_old"))
                    .await?;
            }
            Step::Restart(sig) => {
                if !self.stop(*sig)? {
                    self.start().await?;
                }
            }
            Step::Stop(sig) => {
                self.stop(*sig)?;
            }
            Step::DropSlot => {
                // A relay killed during a recovery may not have created its new slot yet.
                let exists = self
                    .c
                    .query_opt(
                        "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                        &[&self.env.slot],
                    )
                    .await?
                    .is_some();
                if exists {
                    self.env.drop_slot().await?;
                } else {
                    self.out
                        .notes
                        .push(format!("step {i}: the slot was already gone"));
                }
            }
            Step::Start => self.start().await?,
            Step::Settle => self.settle(SETTLE, "a settle step").await?,
            Step::PubDrop { table } => {
                let q = self.model.tables[*table].qualified();
                // Already out (the relay has not put it back since an earlier drop): nothing.
                let published: bool = self
                    .c
                    .query_one(
                        "SELECT EXISTS (SELECT 1 FROM pg_publication_tables \
                         WHERE pubname = 'outbox_pub' AND schemaname || '.' || tablename = $1)",
                        &[&q],
                    )
                    .await?
                    .get(0);
                if published {
                    self.c
                        .batch_execute(&format!("ALTER PUBLICATION outbox_pub DROP TABLE {q}"))
                        .await?;
                }
            }
            Step::PayloadType { json } => {
                let ty = if *json { "json" } else { "jsonb" };
                self.c
                    .batch_execute(&format!(
                        "ALTER TABLE public.outbox ALTER COLUMN payload TYPE {ty} USING payload::{ty}"
                    ))
                    .await?;
            }
        }
        self.model.apply(step);
        Ok(())
    }

    /// Known findings F1 and F2 (see the top comment): the rows a table held when it joined
    /// are republished only once a session picks the table up, and a lost slot's gap only from
    /// the tables that match when the recovery runs; a table that leaves the pattern before
    /// loses them. With `settle_leaves` (unless `OUTBOXD_SEQ_LEAVE_UNSETTLED` is set) a leave first waits until the
    /// slot caught up and the rows it held are on the topic (the relay runs: the generator
    /// leaves only then).
    async fn held_delivered(&mut self, table: usize) -> anyhow::Result<()> {
        let held: HashSet<String> = self
            .rows
            .iter()
            .filter(|r| r.table == table && r.class == Class::Held)
            .map(|r| r.id.clone())
            .collect();
        if held.is_empty() || self.relay.is_none() {
            return Ok(());
        }
        let topic = self.model.tables[table].topic();
        let bootstrap = self.env.bootstrap();
        let deadline = Instant::now() + SETTLE;
        loop {
            let recs = tokio::task::block_in_place(|| {
                read_topic(&bootstrap, &topic, held.len(), Duration::from_secs(3))
            })?;
            let got: HashSet<&str> = recs.iter().map(|r| r.header("event_id")).collect();
            let left = held.iter().filter(|id| !got.contains(id.as_str())).count();
            if left == 0 {
                return Ok(());
            }
            if self.check_exit("waiting for a joined table's rows before it leaves")? {
                return Ok(());
            }
            if Instant::now() > deadline {
                let f = format!(
                    "LOSS: {left} of the {} rows {} held when it joined were not delivered \
                     within {SETTLE:?} (the relay running)",
                    held.len(),
                    self.model.tables[table].qualified()
                );
                self.finding(f);
                return Ok(());
            }
        }
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        self.log_from = read_log(&self.log).len();
        self.relay = Some(RelayProcess::spawn(&self.config, self.log.clone())?);
        Ok(())
    }

    /// The relay's log since its last start.
    fn log_since(&self) -> String {
        let text = read_log(&self.log);
        text.get(self.log_from..).unwrap_or(&text).to_string()
    }

    fn log_tail(&self, n: usize) -> String {
        let text = self.log_since();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    async fn start(&mut self) -> anyhow::Result<()> {
        let r = self
            .c
            .query_opt(
                "SELECT delivered_xid::text, recovering_xid::text FROM outboxd_slot_state \
                 WHERE slot_name = $1",
                &[&self.env.slot],
            )
            .await?;
        let (delivered, recovering): (Option<String>, Option<String>) =
            r.map_or((None, None), |r| (r.get(0), r.get(1)));
        if self.model.dropped || recovering.is_some() {
            self.gap_from = recovering.or(delivered).and_then(|s| s.parse().ok());
        }
        self.spawn()
    }

    /// Signals the relay. True when the sequence ends (the relay had exited by itself, or
    /// SIGTERM did not end it cleanly).
    fn stop(&mut self, sig: Sig) -> anyhow::Result<bool> {
        if self.check_exit("before a stop")? {
            return Ok(true);
        }
        let Some(mut relay) = self.relay.take() else {
            return Ok(false);
        };
        match sig {
            Sig::Kill => relay.sigkill(),
            Sig::Term => match tokio::task::block_in_place(|| relay.sigterm()) {
                Ok(st) if st.success() => {}
                // SIGTERM before the relay installed its handler (a restart right after a
                // start): the default action, as good as a SIGKILL.
                Ok(st) if exit_signal(&st) == Some(libc::SIGTERM) => {
                    self.out
                        .notes
                        .push("SIGTERM ended a relay that had just started (by the signal)".into());
                }
                Ok(st) => {
                    self.exited(st, "on SIGTERM");
                    return Ok(true);
                }
                Err(e) => {
                    self.finding(format!("{e}; log:\n{}", self.log_tail(40)));
                    return Ok(true);
                }
            },
        }
        Ok(false)
    }

    fn finding(&mut self, f: String) {
        self.out.findings.push(f);
        self.ended = true;
    }

    /// When the relay has exited by itself: classifies the exit and ends the sequence. True
    /// when it has (now or before).
    fn check_exit(&mut self, ctx: &str) -> anyhow::Result<bool> {
        if let Some(relay) = self.relay.as_mut() {
            if let Some(st) = relay.child.try_wait()? {
                self.relay = None;
                self.exited(st, ctx);
            }
        }
        Ok(self.dead)
    }

    /// The relay exited with `st` without being asked to (or not cleanly on SIGTERM).
    fn exited(&mut self, st: ExitStatus, ctx: &str) {
        self.ended = true;
        self.dead = true;
        let text = self.log_since();
        // A tenant that joined and left the pattern while the slot was lost: the relay cannot
        // know its rows' mapping any more and stops naming it (issue 56, F2) — loud, not a
        // loss, though the rows still exist in the renamed table.
        if !st.success()
            && self.gap_from.is_some()
            && text.contains("joined the publication during the gap")
            && self.model.tables.iter().any(|t| t.state == St::Left)
        {
            self.out.halt = Some(Halt::Expected(format!(
                "a table that joined and left the pattern during the gap is named ({ctx}, {st})"
            )));
            return;
        }
        let Some(pos) = text.find("cannot vouch for the gap") else {
            let f = format!(
                "the relay exited by itself ({ctx}): {st}; log:\n{}",
                self.log_tail(40)
            );
            self.finding(f);
            return;
        };
        let line = text[..pos]
            .rfind('\n')
            .map_or(&text[..], |s| &text[s + 1..])
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        let named = text[..pos]
            .rfind("the outbox table ")
            .map(|s| text[s + "the outbox table ".len()..pos].trim().to_string())
            .unwrap_or_default();
        if st.success() {
            self.finding(format!("the relay halted with exit 0 ({ctx}): {line}"));
            return;
        }
        let Some(gap) = self.gap_from else {
            self.finding(format!(
                "the relay halted ({ctx}, {st}) on a gap no slot drop made: {line}"
            ));
            return;
        };
        let Some(ti) = self
            .model
            .tables
            .iter()
            .position(|t| t.qualified() == named)
        else {
            self.finding(format!(
                "the relay halted ({ctx}) naming an unknown table: {line}"
            ));
            return;
        };
        let of = |c: Class| {
            self.rows
                .iter()
                .filter(move |r| r.table == ti && r.class == c)
        };
        let in_gap = of(Class::Relayed).filter(|r| r.xid >= gap).count();
        if self.model.tables[ti].kind == Kind::Dbz {
            self.out.halt = Some(if in_gap > 0 {
                Halt::Expected(format!(
                    "{named}: {in_gap} rows in the gap (xid >= {gap}), halted ({ctx}, {st})"
                ))
            } else {
                Halt::Conservative(format!(
                    "{named} cannot vouch though none of its rows is in the gap (xid >= {gap}): \
                     it deletes every row, so no witness and deletes in its statistics ({ctx})"
                ))
            });
            return;
        }
        let rolled = of(Class::RolledBack).count();
        let witness = of(Class::Relayed)
            .chain(of(Class::Held))
            .filter(|r| r.xid < gap)
            .count();
        if rolled > 0 && witness == 0 {
            self.out.halt = Some(Halt::Conservative(format!(
                "{named} cannot vouch: {rolled} rolled-back rows count as inserts and no row of it \
                 precedes the gap (xid >= {gap}); nothing of it was lost ({ctx})"
            )));
        } else {
            self.finding(format!(
                "false halt ({ctx}, {st}): {named} holds every row it was written ({rolled} \
                 rolled back, {witness} before the gap at xid {gap}), yet: {line}"
            ));
        }
    }

    /// Waits until the slot confirmed everything written before the call ([`Run::settled`]),
    /// the relay exits, or `timeout` (a finding: no progress).
    async fn settle(&mut self, timeout: Duration, what: &str) -> anyhow::Result<()> {
        if self.relay.is_none() {
            return Ok(());
        }
        let target = self.lsn("pg_current_wal_lsn()").await?;
        let deadline = Instant::now() + timeout;
        loop {
            if self.check_exit(&format!("waiting for {what}"))? {
                return Ok(());
            }
            if self.settled(target).await? {
                return Ok(());
            }
            if Instant::now() > deadline {
                let f = format!(
                    "the slot did not confirm {target:X} within {timeout:?} ({what}); log:\n{}",
                    self.log_tail(30)
                );
                self.finding(f);
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn lsn(&self, expr: &str) -> anyhow::Result<u64> {
        let v: i64 = self
            .c
            .query_one(&format!("SELECT ({expr} - '0/0')::bigint"), &[])
            .await?
            .get(0);
        Ok(v as u64)
    }

    /// The slot confirmed `target`, no slot-loss recovery is under way (a recovery's new slot
    /// starts past the gap it has yet to republish) and a session streams (not one setting up,
    /// which may still be catching a joined table up).
    async fn settled(&self, target: u64) -> anyhow::Result<bool> {
        let r = self
            .c
            .query_opt(
                "SELECT (s.confirmed_flush_lsn - '0/0')::bigint >= $2 AND s.active \
                    AND NOT EXISTS (SELECT 1 FROM outboxd_slot_state o \
                                    WHERE o.slot_name = s.slot_name::text \
                                      AND o.recovering_xid IS NOT NULL) \
                 FROM pg_replication_slots s WHERE s.slot_name = $1",
                &[&self.env.slot, &(target as i64)],
            )
            .await?;
        Ok(r.and_then(|r| r.get::<_, Option<bool>>(0)).unwrap_or(false))
    }

    /// The end: the relay catches up, every topic is read back and checked, the relay stops.
    async fn finish(&mut self) -> anyhow::Result<()> {
        // Diagnosis: does a start after a crash (not a halt the oracle accepts) lose more?
        if self.dead
            && self.out.halt.is_none()
            && std::env::var_os("OUTBOXD_SEQ_RESTART_AFTER_EXIT").is_some()
        {
            self.dead = false;
            self.out
                .notes
                .push("the relay was started again after it exited".into());
        }
        if !self.dead {
            if self.relay.is_none() {
                self.start().await?;
            }
            let bound = if self.ended {
                Duration::from_secs(30)
            } else {
                FINAL_SETTLE
            };
            self.settle(bound, "the end").await?;
        }
        self.oracle().await?;
        if let Some(mut relay) = self.relay.take() {
            match tokio::task::block_in_place(|| relay.sigterm()) {
                Ok(st) if st.success() => {}
                Ok(st) => {
                    let f = format!("SIGTERM at the end: {st}; log:\n{}", self.log_tail(30));
                    self.out.findings.push(f);
                }
                Err(e) => self.out.findings.push(format!("SIGTERM at the end: {e}")),
            }
        }
        Ok(())
    }

    /// Whether row `r` must be on its topic. After a halt: only what the relay had recorded
    /// as delivered (transactions before the gap) of relayed tables; rows a joining table
    /// held are then not checked.
    fn required(&self, r: &Row) -> bool {
        match (&self.out.halt, r.class) {
            (None, Class::Relayed) => true,
            (None, Class::Held) => self.model.tables[r.table].state != St::Pending,
            (Some(_), Class::Relayed) => self.gap_from.is_some_and(|g| r.xid < g),
            _ => false,
        }
    }

    async fn oracle(&mut self) -> anyhow::Result<()> {
        let tables = self.model.tables.clone();
        let required: Vec<&Row> = self.rows.iter().filter(|r| self.required(r)).collect();
        let mut want: BTreeMap<String, usize> = tables.iter().map(|t| (t.topic(), 0)).collect();
        for r in &required {
            *want.entry(tables[r.table].topic()).or_default() += 1;
        }
        let id_of = |rec: &Record| {
            let e = rec.header("event_id");
            if e.is_empty() {
                rec.header("id").to_string()
            } else {
                e.to_string()
            }
        };
        let bootstrap = self.env.bootstrap();
        let deadline = Instant::now() + FINAL_READ;
        let (records, missing) = loop {
            let mut records = Vec::new();
            for (topic, n) in &want {
                let recs = tokio::task::block_in_place(|| {
                    read_topic(&bootstrap, topic, *n, Duration::from_secs(6))
                })?;
                records.extend(recs);
            }
            let seen: HashSet<(String, String)> = records
                .iter()
                .map(|r| (r.topic.clone(), id_of(r)))
                .collect();
            let missing: Vec<&Row> = required
                .iter()
                .copied()
                .filter(|r| !seen.contains(&(tables[r.table].topic(), r.id.clone())))
                .collect();
            if missing.is_empty() || Instant::now() > deadline {
                break (records, missing);
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        };
        let mut findings = Vec::new();
        if !missing.is_empty() {
            let anywhere: HashMap<String, String> = records
                .iter()
                .map(|r| (id_of(r), r.topic.clone()))
                .collect();
            let list: Vec<String> = missing
                .iter()
                .take(25)
                .map(|r| {
                    format!(
                        "{} {} v{} (step {}, {:?}, xid {}){}",
                        tables[r.table].source_table(),
                        r.agg,
                        r.version,
                        r.step,
                        r.class,
                        r.xid,
                        anywhere
                            .get(&r.id)
                            .map_or(String::new(), |t| format!(", found on {t}"))
                    )
                })
                .collect();
            findings.push(format!(
                "LOSS: {} of {} required rows missing:\n    {}",
                missing.len(),
                required.len(),
                list.join("\n    ")
            ));
        }
        let by_id: HashMap<&str, &Row> = self.rows.iter().map(|r| (r.id.as_str(), r)).collect();
        let mut sorted = records.clone();
        sorted.sort_by(|a, b| {
            (&a.topic, a.partition, a.offset).cmp(&(&b.topic, b.partition, b.offset))
        });
        let mut first: HashSet<String> = HashSet::new();
        let mut last: HashMap<(String, String), (i64, usize)> = HashMap::new();
        let (mut rolled, mut unknown, mut wrong, mut order, mut after_leaving) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0usize);
        for rec in &sorted {
            let id = id_of(rec);
            let Some(row) = by_id.get(id.as_str()) else {
                unknown.push(format!(
                    "{} {id} key {}",
                    rec.topic,
                    String::from_utf8_lossy(&rec.key)
                ));
                continue;
            };
            let t = &tables[row.table];
            match row.class {
                Class::RolledBack => {
                    rolled.push(format!("{} v{} (step {})", row.agg, row.version, row.step));
                    continue;
                }
                Class::Unrelayed => {
                    after_leaving += 1;
                    continue;
                }
                Class::Relayed | Class::Held => {}
            }
            let key = String::from_utf8_lossy(&rec.key).into_owned();
            let version_ok =
                t.kind == Kind::Dbz || rec.header("aggregate_version") == row.version.to_string();
            if rec.topic != t.topic()
                || rec.header("source_table") != t.source_table()
                || key != row.agg
                || !version_ok
            {
                wrong.push(format!(
                    "{} v{} (step {}) on {} source_table {:?} key {key} aggregate_version {:?}",
                    row.agg,
                    row.version,
                    row.step,
                    rec.topic,
                    rec.header("source_table"),
                    rec.header("aggregate_version")
                ));
            }
            if !first.insert(id.clone()) {
                continue;
            }
            let k = (rec.topic.clone(), row.agg.clone());
            if let Some(&(v, s)) = last.get(&k) {
                if row.version <= v {
                    order.push(format!(
                        "{}: v{} (step {}) first arrived after v{v} (step {s})",
                        row.agg, row.version, row.step
                    ));
                }
            }
            last.insert(k, (row.version, row.step));
        }
        let mut add = |what: &str, v: Vec<String>| {
            if !v.is_empty() {
                let n = v.len();
                let shown: Vec<String> = v.into_iter().take(15).collect();
                findings.push(format!("{what} ({n}):\n    {}", shown.join("\n    ")));
            }
        };
        add("ROLLED-BACK rows delivered", rolled);
        add("ORDER: first occurrences out of version order", order);
        add(
            "records with a wrong topic, source_table, key or version",
            wrong,
        );
        add("records of rows never written", unknown);
        if after_leaving > 0 {
            self.out.notes.push(format!(
                "{after_leaving} records of rows written after their table left the pattern"
            ));
        }
        self.out.committed = self
            .rows
            .iter()
            .filter(|r| r.class != Class::RolledBack)
            .count();
        self.out.rolled_back = self.rows.len() - self.out.committed;
        self.out.required = required.len();
        self.out.records = records.len();
        self.out.findings.extend(findings);
        if !self.out.findings.is_empty() {
            self.out.log_tail = self.log_tail(40);
        }
        Ok(())
    }
}
