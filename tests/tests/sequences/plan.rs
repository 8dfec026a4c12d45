//! The generator: a model of the tables and of the relay's lifecycle, and the seeded steps drawn
//! from it. The whole plan is drawn before anything runs, so a seed is a fixed list of steps
//! (printed with every failure) and replays exactly.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fmt;

/// Aggregates per table.
pub const AGGS: u8 = 3;
/// Tenants (created, or prepared to join) per sequence at most.
const MAX_TENANTS: usize = 6;
/// Seeds from here on draw the second generation's actions too (publication drops, payload
/// type changes); seeds below replay exactly as they did before those existed.
pub const V2_FROM: u64 = 10_000;

/// What a table is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `public.outbox`, listed, default mapping, topic `outbox.event.pub`.
    Public,
    /// `public.dbz_outbox`, listed, Debezium preset, every row deleted in its transaction.
    Dbz,
    /// A table of the pattern `tenant_%.outbox` (or on its way into it), topic `tenants.{schema}`.
    Tenant,
}

/// Where a table stands towards the relayed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum St {
    /// Listed, or matched by the pattern.
    Relayed,
    /// Created outside the pattern (`tenant_x.outbox_new`, `staging_x.outbox`), to join later.
    Pending,
    /// Renamed out of the pattern (`tenant_x.outbox_old`).
    Left,
}

/// How a pending table joins the pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `tenant_x.outbox_new`, then `ALTER TABLE … RENAME TO outbox`.
    Rename,
    /// `staging_x.outbox`, then `CREATE SCHEMA tenant_x; ALTER TABLE … SET SCHEMA tenant_x`.
    Move,
}

#[derive(Debug, Clone)]
pub struct Tbl {
    pub kind: Kind,
    pub schema: String,
    pub name: String,
    pub state: St,
    /// The tenant schema a tenant table is in or joins (its topic is `tenants.{tenant}`).
    pub tenant: Option<String>,
    /// Per aggregate: the last committed version.
    pub versions: Vec<i64>,
    /// Rows committed so far.
    pub committed: usize,
    /// In the publication from its creation on (listed at start, or `CREATE TABLE` in the
    /// pattern): the relay owes it nothing from before it joined, so no statistics check.
    pub born: bool,
}

impl Tbl {
    fn new(kind: Kind, schema: &str, name: &str, state: St, tenant: Option<&str>) -> Self {
        Self {
            kind,
            schema: schema.into(),
            name: name.into(),
            state,
            tenant: tenant.map(Into::into),
            versions: vec![0; AGGS as usize],
            committed: 0,
            born: state == St::Relayed,
        }
    }

    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }

    /// The topic its rows go to while it is relayed.
    pub fn topic(&self) -> String {
        match self.kind {
            Kind::Public => "outbox.event.pub".into(),
            Kind::Dbz => "outbox.event.order".into(),
            Kind::Tenant => format!("tenants.{}", self.tenant.as_deref().unwrap_or("?")),
        }
    }

    /// The `source_table` header of its records.
    pub fn source_table(&self) -> String {
        match self.kind {
            Kind::Public => "public.outbox".into(),
            Kind::Dbz => "public.dbz_outbox".into(),
            Kind::Tenant => format!("{}.outbox", self.tenant.as_deref().unwrap_or("?")),
        }
    }

    fn bump(&mut self, rows: &Rows) {
        for &(a, v) in rows {
            let cur = &mut self.versions[a as usize];
            *cur = (*cur).max(v);
        }
        self.committed += rows.len();
    }

    /// `n` rows on this table's aggregates, each the next version of its aggregate.
    fn next_rows(&self, rng: &mut StdRng, n: usize) -> Rows {
        let mut next = self.versions.clone();
        (0..n)
            .map(|_| {
                let a = rng.gen_range(0..AGGS);
                next[a as usize] += 1;
                (a, next[a as usize])
            })
            .collect()
    }
}

/// Rows of one transaction: (aggregate, version).
pub type Rows = Vec<(u8, i64)>;

/// The aggregate id of aggregate `a` of table `t`.
pub fn agg_id(t: usize, a: u8) -> String {
    format!("t{t}-a{a}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sig {
    Kill,
    Term,
}

#[derive(Debug, Clone)]
pub enum Step {
    /// One transaction of rows into a table (relayed, pending or left), committed or rolled back.
    Insert {
        table: usize,
        rows: Rows,
        rollback: bool,
    },
    /// Rows into the Debezium table, each inserted and deleted in its own transaction.
    DbzInsert {
        rows: Rows,
    },
    /// `CREATE SCHEMA s; CREATE TABLE s.outbox (LIKE public.outbox INCLUDING ALL)` and `rows`, in
    /// one transaction (the event trigger adds it to the publication).
    CreateTenant {
        table: usize,
        schema: String,
        rows: Rows,
    },
    /// A table outside the pattern, with `rows`, that joins later ([`Step::Join`]).
    Prepare {
        table: usize,
        route: Route,
        tenant: String,
        rows: Rows,
    },
    /// The pending table joins (rename or move), in one transaction with `before` rows written
    /// before the DDL and `after` rows after it.
    Join {
        table: usize,
        before: Rows,
        after: Rows,
    },
    /// `ALTER TABLE tenant_x.outbox RENAME TO outbox_old`: out of the pattern.
    Leave {
        table: usize,
    },
    /// Signal the relay and start it again at once.
    Restart(Sig),
    /// Signal the relay; it stays down until [`Step::Start`].
    Stop(Sig),
    /// Drop the slot (the relay is down).
    DropSlot,
    Start,
    /// Wait until the slot confirmed everything written so far.
    Settle,
    /// `ALTER PUBLICATION outbox_pub DROP TABLE` of a relayed tenant (an operator's edit, a
    /// migration tool's): it still matches the pattern, so its rows stay required; the relay
    /// puts it back and owes the rows committed meanwhile (second generation).
    PubDrop {
        table: usize,
    },
    /// `ALTER TABLE public.outbox ALTER payload TYPE json` (or back to `jsonb`): a rewrite of
    /// the listed table under the stream (second generation).
    PayloadType {
        json: bool,
    },
}

#[derive(Debug, Clone)]
pub struct Planned {
    pub step: Step,
    pub pause_ms: u64,
}

fn rows_text(rows: &Rows) -> String {
    let v: Vec<String> = rows.iter().map(|(a, v)| format!("a{a}v{v}")).collect();
    format!("[{}]", v.join(" "))
}

impl Step {
    /// One line, naming tables as they are named when the step runs (`m`: the model before it).
    pub fn describe(&self, m: &Model) -> String {
        let name = |t: usize| {
            m.tables
                .get(t)
                .map_or_else(|| format!("t{t}"), |x| format!("t{t} {}", x.qualified()))
        };
        match self {
            Step::Insert {
                table,
                rows,
                rollback,
            } => format!(
                "insert {} {}{}",
                name(*table),
                rows_text(rows),
                if *rollback { " ROLLBACK" } else { "" }
            ),
            Step::DbzInsert { rows } => {
                format!("dbz insert+delete {} (one txn each)", rows_text(rows))
            }
            Step::CreateTenant {
                table,
                schema,
                rows,
            } => {
                format!(
                    "create tenant t{table} {schema}.outbox with {}",
                    rows_text(rows)
                )
            }
            Step::Prepare {
                table,
                route,
                tenant,
                rows,
            } => {
                let at = match route {
                    Route::Rename => format!("{tenant}.outbox_new"),
                    Route::Move => format!("{}.outbox", staging(tenant)),
                };
                format!(
                    "prepare t{table} {at} ({route:?} into {tenant}) with {}",
                    rows_text(rows)
                )
            }
            Step::Join {
                table,
                before,
                after,
            } => format!(
                "join {} → pattern, rows before DDL {}, after {}",
                name(*table),
                rows_text(before),
                rows_text(after)
            ),
            Step::Leave { table } => format!("leave {} → outbox_old", name(*table)),
            Step::Restart(s) => format!("restart relay ({s:?})"),
            Step::Stop(s) => format!("stop relay ({s:?})"),
            Step::DropSlot => "drop slot".into(),
            Step::Start => "start relay".into(),
            Step::Settle => "settle (wait until the slot caught up)".into(),
            Step::PubDrop { table } => {
                format!("ALTER PUBLICATION … DROP TABLE {}", name(*table))
            }
            Step::PayloadType { json } => format!(
                "ALTER TABLE public.outbox ALTER payload TYPE {}",
                if *json { "json" } else { "jsonb" }
            ),
        }
    }
}

/// `tenant_3` → `staging_3`.
pub fn staging(tenant: &str) -> String {
    tenant.replacen("tenant_", "staging_", 1)
}

/// The tables and the relay's lifecycle, as the steps leave them.
#[derive(Debug, Clone)]
pub struct Model {
    pub dbz: bool,
    pub tables: Vec<Tbl>,
    pub running: bool,
    /// The slot was dropped since the last start.
    pub dropped: bool,
    tenants: usize,
    /// Draw the second generation's actions ([`V2_FROM`]).
    v2: bool,
    /// `public.outbox.payload` is `json` now (else `jsonb`).
    pub payload_json: bool,
}

impl Model {
    pub fn new(dbz: bool) -> Self {
        let mut tables = vec![Tbl::new(
            Kind::Public,
            "public",
            "outbox",
            St::Relayed,
            None,
        )];
        if dbz {
            tables.push(Tbl::new(
                Kind::Dbz,
                "public",
                "dbz_outbox",
                St::Relayed,
                None,
            ));
        }
        Self {
            dbz,
            tables,
            running: true,
            dropped: false,
            tenants: 0,
            v2: false,
            payload_json: false,
        }
    }

    /// Index of the Debezium table.
    pub fn dbz_table(&self) -> Option<usize> {
        self.tables.iter().position(|t| t.kind == Kind::Dbz)
    }

    pub fn apply(&mut self, step: &Step) {
        match step {
            Step::Insert {
                table,
                rows,
                rollback,
            } => {
                if !rollback {
                    self.tables[*table].bump(rows);
                }
            }
            Step::DbzInsert { rows } => {
                let t = self.dbz_table().expect("dbz table");
                self.tables[t].bump(rows);
            }
            Step::CreateTenant {
                table,
                schema,
                rows,
            } => {
                assert_eq!(*table, self.tables.len());
                let mut t = Tbl::new(Kind::Tenant, schema, "outbox", St::Relayed, Some(schema));
                t.bump(rows);
                self.tables.push(t);
            }
            Step::Prepare {
                table,
                route,
                tenant,
                rows,
            } => {
                assert_eq!(*table, self.tables.len());
                let mut t = match route {
                    Route::Rename => Tbl::new(
                        Kind::Tenant,
                        tenant,
                        "outbox_new",
                        St::Pending,
                        Some(tenant),
                    ),
                    Route::Move => Tbl::new(
                        Kind::Tenant,
                        &staging(tenant),
                        "outbox",
                        St::Pending,
                        Some(tenant),
                    ),
                };
                t.bump(rows);
                self.tables.push(t);
            }
            Step::Join {
                table,
                before,
                after,
            } => {
                let t = &mut self.tables[*table];
                t.bump(before);
                t.schema = t.tenant.clone().expect("tenant");
                t.name = "outbox".into();
                t.state = St::Relayed;
                t.bump(after);
            }
            Step::Leave { table } => {
                let t = &mut self.tables[*table];
                t.name = "outbox_old".into();
                t.state = St::Left;
            }
            Step::PubDrop { table } => {
                // It joins again later, owed rows: no longer "born" (see rollback_targets).
                self.tables[*table].born = false;
            }
            Step::PayloadType { json } => self.payload_json = *json,
            Step::Restart(_) | Step::Settle => {}
            Step::Stop(_) => self.running = false,
            Step::DropSlot => self.dropped = true,
            Step::Start => {
                self.running = true;
                self.dropped = false;
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum A {
    Insert,
    Rollback,
    Dbz,
    Create,
    Prepare,
    Join,
    Leave,
    Restart,
    Stop,
    Drop,
    Start,
    Settle,
    PubDrop,
    PayloadType,
}

/// The weights of the actions the model allows now (see the file's top comment).
fn weights(m: &Model) -> Vec<(A, u32)> {
    let mut w = vec![(A::Insert, 30)];
    if !rollback_targets(m).is_empty() {
        w.push((A::Rollback, 6));
    }
    if m.dbz {
        w.push((A::Dbz, if m.running { 8 } else { 12 }));
    }
    if m.tenants < MAX_TENANTS {
        w.push((A::Create, 5));
        w.push((A::Prepare, 5));
    }
    if m.tables.iter().any(|t| t.state == St::Pending) {
        w.push((A::Join, 8));
    }
    // While the relay runs: the leave waits until the rows the table held when it joined
    // were delivered (known finding F1, see sequences.rs).
    if m.running
        && m.tables
            .iter()
            .any(|t| t.kind == Kind::Tenant && t.state == St::Relayed)
    {
        w.push((A::Leave, 2));
    }
    if m.v2 {
        if m.tables
            .iter()
            .any(|t| t.kind == Kind::Tenant && t.state == St::Relayed)
        {
            w.push((A::PubDrop, 3));
        }
        w.push((A::PayloadType, 2));
    }
    if m.running {
        w.push((A::Restart, 6));
        w.push((A::Stop, 4));
        w.push((A::Settle, 3));
    } else {
        w.push((A::Start, 20));
        if !m.dropped {
            w.push((A::Drop, 10));
        }
    }
    w
}

/// Tables a rolled-back transaction may write: relayed since their creation and already
/// holding a committed row (a rolled-back insert counts in the table's statistics, which the
/// relay reads when a table joins late or a lost slot's gap has no witness row: see the top
/// comment).
fn rollback_targets(m: &Model) -> Vec<usize> {
    (0..m.tables.len())
        .filter(|&i| {
            let t = &m.tables[i];
            t.kind != Kind::Dbz && t.state == St::Relayed && t.born && t.committed > 0
        })
        .collect()
}

fn pick<T: Copy>(rng: &mut StdRng, w: &[(T, u32)]) -> T {
    let total: u32 = w.iter().map(|(_, n)| n).sum();
    let mut x = rng.gen_range(0..total);
    for (a, n) in w {
        if x < *n {
            return *a;
        }
        x -= n;
    }
    unreachable!()
}

fn some_rows(rng: &mut StdRng, t: &Tbl, lo: usize, hi: usize) -> Rows {
    let n = rng.gen_range(lo..=hi);
    t.next_rows(rng, n)
}

/// The sequence of seed `seed`: whether it has the Debezium table, and its steps. Step 0 is
/// always one row into `public.outbox` (the run waits for its delivery before going on).
pub fn generate(seed: u64) -> (bool, Vec<Planned>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let dbz = rng.gen_bool(0.4);
    let n: usize = rng.gen_range(25..=40);
    let mut m = Model::new(dbz);
    m.v2 = seed >= V2_FROM;
    let mut plan = Vec::with_capacity(n + 1);
    let first = Step::Insert {
        table: 0,
        rows: vec![(0, 1)],
        rollback: false,
    };
    m.apply(&first);
    plan.push(Planned {
        step: first,
        pause_ms: 0,
    });
    for _ in 1..n {
        let step = draw(&mut rng, &mut m);
        m.apply(&step);
        let pause_ms = rng.gen_range(0..=300);
        plan.push(Planned { step, pause_ms });
    }
    if !m.running {
        plan.push(Planned {
            step: Step::Start,
            pause_ms: 0,
        });
    }
    (dbz, plan)
}

fn draw(rng: &mut StdRng, m: &mut Model) -> Step {
    let sig = |rng: &mut StdRng| {
        if rng.gen_bool(0.5) {
            Sig::Kill
        } else {
            Sig::Term
        }
    };
    match pick(rng, &weights(m)) {
        A::Insert => {
            // Relayed and pending tables weigh 3, tables that left the pattern 1.
            let cands: Vec<(usize, u32)> = m
                .tables
                .iter()
                .enumerate()
                .filter(|(_, t)| t.kind != Kind::Dbz)
                .map(|(i, t)| (i, if t.state == St::Left { 1 } else { 3 }))
                .collect();
            let table = pick(rng, &cands);
            let rows = some_rows(rng, &m.tables[table], 1, 5);
            Step::Insert {
                table,
                rows,
                rollback: false,
            }
        }
        A::Rollback => {
            let c = rollback_targets(m);
            let table = c[rng.gen_range(0..c.len())];
            let rows = some_rows(rng, &m.tables[table], 1, 3);
            Step::Insert {
                table,
                rows,
                rollback: true,
            }
        }
        A::Dbz => {
            let t = &m.tables[m.dbz_table().unwrap()];
            Step::DbzInsert {
                rows: some_rows(rng, t, 1, 3),
            }
        }
        A::Create => {
            m.tenants += 1;
            let schema = format!("tenant_{}", m.tenants);
            let table = m.tables.len();
            let probe = Tbl::new(Kind::Tenant, &schema, "outbox", St::Relayed, Some(&schema));
            let rows = if rng.gen_bool(0.5) {
                vec![]
            } else {
                some_rows(rng, &probe, 1, 5)
            };
            Step::CreateTenant {
                table,
                schema,
                rows,
            }
        }
        A::Prepare => {
            m.tenants += 1;
            let tenant = format!("tenant_{}", m.tenants);
            let route = if rng.gen_bool(0.5) {
                Route::Rename
            } else {
                Route::Move
            };
            let probe = Tbl::new(Kind::Tenant, &tenant, "x", St::Pending, Some(&tenant));
            let rows = some_rows(rng, &probe, 0, 5);
            Step::Prepare {
                table: m.tables.len(),
                route,
                tenant,
                rows,
            }
        }
        A::Join => {
            let c: Vec<usize> = (0..m.tables.len())
                .filter(|&i| m.tables[i].state == St::Pending)
                .collect();
            let table = c[rng.gen_range(0..c.len())];
            let mut t = m.tables[table].clone();
            let before = if rng.gen_bool(0.3) {
                some_rows(rng, &t, 1, 2)
            } else {
                vec![]
            };
            t.bump(&before);
            let after = if rng.gen_bool(0.3) {
                some_rows(rng, &t, 1, 3)
            } else {
                vec![]
            };
            Step::Join {
                table,
                before,
                after,
            }
        }
        A::Leave => {
            let c: Vec<usize> = (0..m.tables.len())
                .filter(|&i| m.tables[i].kind == Kind::Tenant && m.tables[i].state == St::Relayed)
                .collect();
            Step::Leave {
                table: c[rng.gen_range(0..c.len())],
            }
        }
        A::Restart => Step::Restart(sig(rng)),
        A::Stop => Step::Stop(sig(rng)),
        A::Drop => Step::DropSlot,
        A::Start => Step::Start,
        A::Settle => Step::Settle,
        A::PubDrop => {
            let c: Vec<usize> = (0..m.tables.len())
                .filter(|&i| m.tables[i].kind == Kind::Tenant && m.tables[i].state == St::Relayed)
                .collect();
            Step::PubDrop {
                table: c[rng.gen_range(0..c.len())],
            }
        }
        A::PayloadType => Step::PayloadType {
            json: !m.payload_json,
        },
    }
}

/// The plan as numbered lines, each with its pause; steps from `stopped_at` on are marked as
/// not run.
pub fn listing(dbz: bool, plan: &[Planned], stopped_at: Option<usize>) -> String {
    let mut m = Model::new(dbz);
    let mut out = String::new();
    for (i, p) in plan.iter().enumerate() {
        let mark = match stopped_at {
            Some(s) if i >= s => "  (not run)",
            _ => "",
        };
        out.push_str(&format!(
            "  {i:>2}: {} +{}ms{mark}\n",
            p.step.describe(&m),
            p.pause_ms
        ));
        m.apply(&p.step);
    }
    out
}

impl fmt::Display for Sig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}
