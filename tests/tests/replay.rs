//! Replay (R38, issue 20): `outboxd replay` republishes chosen outbox rows with their original
//! `event_id`s through the live path's router and producer.
//!
//! - by ids: the dry run sends nothing and reports counts, topics and missing ids; the executed
//!   replay's records equal the live relay's byte for byte (key, value, headers in order,
//!   timestamp); the audit row records who, why, what and the result;
//! - by time range and filters: exactly the selected events, nothing else; types that shadow
//!   mode does not deliver yet are refused;
//! - approval: too large or side-effecting → `--execute` refused naming `replay request`; the
//!   requesting role cannot approve (the command and the table's guard both refuse); another
//!   role can, and `run` executes;
//! - resume: a replay process SIGKILLed mid-run continues at its cursor: every event arrives,
//!   nothing acknowledged before the cursor is sent again;
//! - SIGTERM: the run stops after its in-flight events are acknowledged and recorded
//!   (`interrupted`); `replay run` finishes the rest without re-sending any;
//! - poison: an event the live path would park stops the replay, nothing is parked;
//! - rate cap: a replay at N events/s takes at least about its count / N seconds;
//! - consumers: an inbox consumer absorbs a replay (each effect once) while the relay streams;
//!   the dry run, `replay request` and `replay show` name the consumer groups with committed
//!   offsets on each target topic and their lag, and say "unknown" (and why) without a broker.

use anyhow::Context;
use outboxd_tests::*;
use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ACCT: &str = "outbox.event.acct";
const ORDER: &str = "outbox.event.order";

/// A record as read back, headers in their order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Raw {
    key: Vec<u8>,
    value: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
    timestamp: Option<i64>,
}

impl Raw {
    fn event_id(&self) -> String {
        self.headers
            .iter()
            .find(|(k, _)| k == "event_id")
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default()
    }
}

fn raw_records(env: &Env, topic: &str, min: usize) -> anyhow::Result<Vec<Raw>> {
    use rdkafka::message::{Headers, Message};
    let mut out = Vec::new();
    scan_topic(&env.bootstrap(), topic, min, Duration::from_secs(30), |m| {
        out.push(Raw {
            key: m.key().unwrap_or_default().to_vec(),
            value: m.payload().unwrap_or_default().to_vec(),
            headers: m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| (h.key.to_string(), h.value.unwrap_or_default().to_vec()))
                        .collect()
                })
                .unwrap_or_default(),
            timestamp: m.timestamp().to_millis(),
        })
    })?;
    Ok(out)
}

fn by_id(recs: &[Raw]) -> HashMap<String, Vec<Raw>> {
    let mut m: HashMap<String, Vec<Raw>> = HashMap::new();
    for r in recs {
        m.entry(r.event_id()).or_default().push(r.clone());
    }
    m
}

fn events(agg_type: &str, agg: &str, n: i64, event_type: &str) -> Vec<NewEvent> {
    events_from(agg_type, agg, 1, n, event_type)
}

/// `n` events of one aggregate, versions `first..first + n`.
fn events_from(agg_type: &str, agg: &str, first: i64, n: i64, event_type: &str) -> Vec<NewEvent> {
    (first..first + n)
        .map(|v| {
            NewEvent::new(
                agg_type,
                agg,
                v,
                event_type,
                serde_json::json!({"v": v, "agg": agg}),
            )
        })
        .collect()
}

/// The relay delivers everything written so far, then stops.
async fn deliver_live(env: &Env) -> anyhow::Result<()> {
    let relay = Relay::start(env.config()?);
    env.caught_up(Duration::from_secs(60)).await?;
    relay.shutdown().await
}

async fn db_now(c: &tokio_postgres::Client) -> anyhow::Result<String> {
    // Wall clock, not now(): created_at is the writing transaction's start time.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let t: String = c
        .query_one(
            "SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            &[],
        )
        .await?
        .get(0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(t)
}

/// `outboxd replay ARGS… --config F`, asserting the exit code; returns the output.
fn replay(cfg: &std::path::Path, args: &[&str], ok: bool) -> String {
    let mut all = vec!["replay"];
    all.extend_from_slice(args);
    let (code, out) = outboxd_cli(&all, cfg);
    assert_eq!(code == 0, ok, "outboxd {all:?} exited {code}:\n{out}");
    out
}

/// The audit row: (state, requested_by, approved_by, reason, events, sent, run_by, selection).
async fn audit(
    c: &tokio_postgres::Client,
    id: i64,
) -> anyhow::Result<(
    String,
    String,
    Option<String>,
    String,
    i64,
    i64,
    Option<String>,
    serde_json::Value,
)> {
    let r = c
        .query_one(
            "SELECT state, requested_by, approved_by, reason, events, sent, run_by, selection, \
               started_at IS NOT NULL AND (state <> 'finished' OR finished_at IS NOT NULL) \
             FROM outboxd_replay WHERE id = $1",
            &[&id],
        )
        .await?;
    assert!(r.get::<_, bool>(8), "started_at/finished_at not recorded");
    Ok((
        r.get(0),
        r.get(1),
        r.get(2),
        r.get(3),
        r.get(4),
        r.get(5),
        r.get(6),
        r.get(7),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_by_ids_dry_run_sends_nothing_execute_is_byte_identical() -> anyhow::Result<()> {
    let env = Env::start("rp_ids").await?;
    create_topics(&env.bootstrap(), &[ACCT, ORDER], 3).await?;
    let cfg = env.config_file()?;
    let mut c = env.sql().await?;
    let acct = events("acct", "a-1", 5, "Deposited");
    let order = events("order", "o-1", 2, "Paid");
    // One with row headers, so the headers' order is part of the comparison.
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
           event_type, payload, headers) VALUES ($1, 'acct', 'a-1', 2, 'Deposited', $2, \
           '{\"traceparent\": \"00-abc\", \"tenant\": \"t1\"}')",
        &[&acct[1].event_id, &acct[1].payload],
    )
    .await?;
    let others: Vec<NewEvent> = acct.iter().filter(|e| e.version != 2).cloned().collect();
    write_events(&mut c, &others, false).await?;
    write_events(&mut c, &order, false).await?;
    deliver_live(&env).await?;
    let live_acct = raw_records(&env, ACCT, 5)?;
    let live_order = raw_records(&env, ORDER, 2)?;
    assert_eq!((live_acct.len(), live_order.len()), (5, 2));

    let missing = uuid::Uuid::now_v7().to_string();
    let picked = [
        acct[1].event_id.to_string(),
        acct[3].event_id.to_string(),
        order[0].event_id.to_string(),
    ];
    let ids_file = env.dir.path().join("ids.txt");
    std::fs::write(
        &ids_file,
        format!(
            "# from the consumer's error log\n{}\n\n{missing}\n",
            picked[2]
        ),
    )?;
    let file = ids_file.to_str().unwrap();
    let dry = replay(&cfg, &[&picked[0], &picked[1], "--ids-file", file], true);
    assert!(dry.contains("dry run: nothing was sent"), "{dry}");
    assert!(dry.contains("events:     3 to republish"), "{dry}");
    let rows: Vec<&str> = dry.lines().filter(|l| l.starts_with("  ")).collect();
    assert!(
        rows.iter()
            .any(|l| l.contains("Deposited") && l.contains(" 2  ") && l.ends_with(ACCT)),
        "{dry}"
    );
    assert!(
        rows.iter()
            .any(|l| l.contains("Paid") && l.contains(" 1  ") && l.ends_with(ORDER)),
        "{dry}"
    );
    assert!(
        dry.contains(&format!(
            "not found:  1 event_id(s) not in the outbox table: {missing}"
        )),
        "{dry}"
    );
    assert!(dry.contains("approval:   not needed"), "{dry}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        raw_records(&env, ACCT, 5)?.len(),
        5,
        "the dry run sent something"
    );
    let audited: i64 = c
        .query_one("SELECT count(*) FROM outboxd_replay", &[])
        .await?
        .get(0);
    assert_eq!(audited, 0, "a dry run is not a replay");

    // Executing needs a reason.
    let out = replay(&cfg, &[&picked[0], "--execute"], false);
    assert!(out.contains("--reason"), "{out}");
    let out = replay(
        &cfg,
        &[
            &picked[0],
            &picked[1],
            "--ids-file",
            file,
            "--execute",
            "--reason",
            "consumer bug #12",
            "--operator",
            "carol",
        ],
        true,
    );
    assert!(out.contains("replay 1 finished: 3 event(s) sent"), "{out}");
    let acct_after = raw_records(&env, ACCT, 7)?;
    let order_after = raw_records(&env, ORDER, 3)?;
    assert_eq!((acct_after.len(), order_after.len()), (7, 3));
    let (live, after) = (
        by_id(&[live_acct, live_order].concat()),
        by_id(&[acct_after, order_after].concat()),
    );
    for id in &picked {
        let copies = &after[id];
        assert_eq!(copies.len(), 2, "{id}: {copies:?}");
        assert_eq!(copies[0], live[id][0], "{id}: not the live record");
        assert_eq!(copies[1], copies[0], "{id}: the replayed record differs");
    }
    let with_headers = &after[&picked[0]][1];
    let names: Vec<&str> = with_headers
        .headers
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    assert!(
        names.contains(&"traceparent") && names.contains(&"event_id"),
        "{names:?}"
    );
    for (id, copies) in &after {
        if !picked.contains(id) {
            assert_eq!(copies.len(), 1, "{id} was not selected but sent again");
        }
    }
    let (state, by, approved, reason, n, sent, run_by, sel) = audit(&c, 1).await?;
    assert_eq!(
        (
            state.as_str(),
            by.as_str(),
            approved,
            reason.as_str(),
            n,
            sent
        ),
        ("finished", "postgres", None, "consumer bug #12", 3, 3)
    );
    assert_eq!(run_by.as_deref(), Some("postgres"));
    assert_eq!(sel["by"], "ids");
    assert_eq!(sel["ids"].as_array().map(Vec::len), Some(4), "{sel}");
    let show = replay(&cfg, &["show", "1"], true);
    assert!(
        show.contains("operator carol") && show.contains("approval:      not needed"),
        "{show}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_by_time_range_and_filters_selects_exactly_those() -> anyhow::Result<()> {
    let env = Env::start("rp_range").await?;
    create_topics(&env.bootstrap(), &[ACCT, ORDER], 3).await?;
    let cfg = env.config_file()?;
    let mut c = env.sql().await?;
    write_events(&mut c, &events("acct", "a-1", 3, "Deposited"), false).await?;
    let since = db_now(&c).await?;
    let in_a1 = events_from("acct", "a-1", 4, 3, "Deposited");
    let in_a2 = events("acct", "a-2", 2, "Withdrawn");
    let in_a3 = events("acct", "a-3", 2, "Frozen");
    write_events(&mut c, &in_a1, false).await?;
    write_events(&mut c, &in_a2, false).await?;
    write_events(&mut c, &in_a3, false).await?;
    write_events(&mut c, &events("order", "o-1", 2, "Deposited"), false).await?;
    let until = db_now(&c).await?;
    write_events(
        &mut c,
        &events_from("acct", "a-1", 7, 2, "Deposited"),
        false,
    )
    .await?;

    let range = ["--since", since.as_str(), "--until", until.as_str()];
    let narrow = [
        &range[..],
        &[
            "--event-type",
            "Deposited",
            "--event-type",
            "Withdrawn",
            "--aggregate-type",
            "acct",
        ],
    ]
    .concat();
    let dry = replay(&cfg, &narrow, true);
    assert!(dry.contains("events:     5 to republish"), "{dry}");
    let dry = replay(
        &cfg,
        &[&range[..], &["--aggregate-id", "a-2"]].concat(),
        true,
    );
    assert!(dry.contains("events:     2 to republish"), "{dry}");
    let dry = replay(&cfg, &range, true);
    assert!(dry.contains("events:     9 to republish"), "{dry}");
    // Filters narrow a range, never a list of ids.
    let out = replay(
        &cfg,
        &[&in_a1[0].event_id.to_string(), "--event-type", "X"],
        false,
    );
    assert!(out.contains("narrow a --since/--until range"), "{out}");

    let out = replay(
        &cfg,
        &[&narrow[..], &["--execute", "--reason", "index rebuild"]].concat(),
        true,
    );
    assert!(out.contains("finished: 5 event(s) sent"), "{out}");
    let got = raw_records(&env, ACCT, 5)?;
    let mut ids: Vec<String> = got.iter().map(Raw::event_id).collect();
    ids.sort();
    let mut want: Vec<String> = in_a1
        .iter()
        .chain(&in_a2)
        .map(|e| e.event_id.to_string())
        .collect();
    want.sort();
    assert_eq!(ids, want, "exactly the selected events, once each");
    // Per aggregate in version order, as they were written.
    let versions: Vec<String> = got
        .iter()
        .filter(|r| r.key == b"a-1")
        .map(|r| {
            let v = &r
                .headers
                .iter()
                .find(|(k, _)| k == "aggregate_version")
                .unwrap()
                .1;
            String::from_utf8_lossy(v).into_owned()
        })
        .collect();
    assert_eq!(versions, ["4", "5", "6"]);
    assert!(
        raw_records(&env, ORDER, 0)?.is_empty(),
        "another aggregate type was sent"
    );
    let (_, _, _, _, n, sent, _, sel) = audit(&c, 1).await?;
    assert_eq!((n, sent), (5, 5));
    assert_eq!(sel["by"], "range");
    assert_eq!(
        sel["event_types"],
        serde_json::json!(["Deposited", "Withdrawn"])
    );

    // Under shadow mode the legacy path delivers the shadowed types: no replay of those.
    let shadow = env.dir.path().join("shadow.toml");
    std::fs::write(
        &shadow,
        format!(
            "{}\n[shadow]\nenabled = true\nlegacy_topics = [\"legacy.acct\"]\ndeliver_types = [\"Withdrawn\"]\n",
            env.toml()
        ),
    )?;
    let dry = replay(&shadow, &narrow, true);
    assert!(
        dry.contains("WARNING: event type Deposited is in shadow mode"),
        "{dry}"
    );
    assert!(
        !dry.contains("event type Withdrawn is in shadow mode"),
        "{dry}"
    );
    let out = replay(
        &shadow,
        &[&narrow[..], &["--execute", "--reason", "r"]].concat(),
        false,
    );
    assert!(out.contains("Deposited are in shadow mode"), "{out}");
    let only = [
        &range[..],
        &["--event-type", "Withdrawn", "--execute", "--reason", "r"],
    ]
    .concat();
    let out = replay(&shadow, &only, true);
    assert!(out.contains("finished: 2 event(s) sent"), "{out}");
    Ok(())
}

/// Creates the roles of sql/roles.sql and two operators in the replay group; returns their DSNs.
async fn operators(env: &Env) -> anyhow::Result<(String, String)> {
    let c = env.sql().await?;
    let roles = include_str!("../../sql/roles.sql");
    let (create, grants) = roles.split_once("-- ---- 2.").expect("two blocks");
    c.batch_execute(create).await?;
    c.batch_execute(&format!("--{grants}")).await?;
    c.batch_execute(
        "CREATE ROLE alice LOGIN PASSWORD 'alice-pw' IN ROLE outboxd_replay; \
         CREATE ROLE bob LOGIN PASSWORD 'bob-pw' IN ROLE outboxd_replay",
    )
    .await?;
    let dsn = |who: &str| {
        env.pg.dsn(&env.db).replace(
            &format!("postgres:{}", testkit::PG_PASSWORD),
            &format!("{who}:{who}-pw"),
        )
    };
    Ok((dsn("alice"), dsn("bob")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_or_side_effecting_replays_need_another_role_to_approve() -> anyhow::Result<()> {
    let mut env = Env::start("rp_approve").await?;
    env.extra_toml =
        "[replay]\napproval_over = 4\nside_effect_types = [\"EmailRequested\"]\n".into();
    create_topics(&env.bootstrap(), &[ACCT], 3).await?;
    let cfg = env.config_file()?;
    let (alice, bob) = operators(&env).await?;
    let mut c = env.sql().await?;
    let since = db_now(&c).await?;
    write_events(&mut c, &events("acct", "a-1", 5, "Deposited"), false).await?;
    let email = events("acct", "a-9", 1, "EmailRequested");
    write_events(&mut c, &email, false).await?;
    let until = db_now(&c).await?;
    let range = ["--since", since.as_str(), "--until", until.as_str()];
    let as_alice = ["--dsn", alice.as_str()];
    let as_bob = ["--dsn", bob.as_str()];

    // Over approval_over: refused, naming the way.
    let out = replay(
        &cfg,
        &[&range[..], &["--execute", "--reason", "r"], &as_alice].concat(),
        false,
    );
    assert!(
        out.contains("6 events, over replay.approval_over = 4"),
        "{out}"
    );
    assert!(out.contains("outboxd replay request"), "{out}");
    // One event, but with side effects: warned about, and refused too.
    let id = email[0].event_id.to_string();
    let dry = replay(&cfg, &[id.as_str(), "--dsn", &alice], true);
    assert!(
        dry.contains("WARNING: event type EmailRequested has side effects"),
        "{dry}"
    );
    let out = replay(
        &cfg,
        &[id.as_str(), "--execute", "--reason", "r", "--dsn", &alice],
        false,
    );
    assert!(out.contains("needs an approval"), "{out}");

    let out = replay(
        &cfg,
        &[
            &["request"],
            &range[..],
            &["--reason", "shipping lost a day", "--rate", "50"],
            &as_alice,
        ]
        .concat(),
        true,
    );
    assert!(
        out.contains("replay 1 requested by database role alice: 6 event(s)"),
        "{out}"
    );
    let out = replay(&cfg, &[&["run", "1"][..], &as_alice].concat(), false);
    assert!(out.contains("needs an approval first"), "{out}");
    let out = replay(&cfg, &[&["approve", "1"][..], &as_alice].concat(), false);
    assert!(
        out.contains("requested by database role alice: another role must approve"),
        "{out}"
    );
    // The table's guard holds against a hand-written approval too.
    let (as_alice_sql, conn) = tokio_postgres::connect(&alice, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let err = as_alice_sql
        .execute(
            "UPDATE outboxd_replay SET state = 'approved', approved_by = 'bob' WHERE id = 1",
            &[],
        )
        .await
        .expect_err("the requester approved her own replay");
    assert!(
        format!("{err:?}").contains("another role must approve"),
        "{err:?}"
    );
    let err = as_alice_sql
        .execute(
            "UPDATE outboxd_replay SET state = 'approved' WHERE id = 1",
            &[],
        )
        .await
        .expect_err("a requested replay left 'requested' without an approval");
    assert!(format!("{err:?}").contains("needs an approval"), "{err:?}");
    assert_eq!(
        raw_records(&env, ACCT, 0)?.len(),
        0,
        "sent before the approval"
    );

    let out = replay(&cfg, &[&["approve", "1"][..], &as_bob].concat(), true);
    assert!(out.contains("approved by database role bob"), "{out}");
    let out = replay(&cfg, &[&["run", "1"][..], &as_bob].concat(), true);
    assert!(out.contains("replay 1 finished: 6 event(s) sent"), "{out}");
    assert_eq!(raw_records(&env, ACCT, 6)?.len(), 6);
    let out = replay(&cfg, &[&["run", "1"][..], &as_bob].concat(), false);
    assert!(out.contains("is finished"), "{out}");

    let (state, by, approved, reason, n, sent, run_by, sel) = audit(&c, 1).await?;
    assert_eq!(
        (
            state.as_str(),
            by.as_str(),
            approved.as_deref(),
            reason.as_str(),
            n,
            sent,
            run_by.as_deref()
        ),
        (
            "finished",
            "alice",
            Some("bob"),
            "shipping lost a day",
            6,
            6,
            Some("bob")
        )
    );
    assert_eq!(sel["by"], "range");
    let effects: Vec<String> = c
        .query_one("SELECT side_effects FROM outboxd_replay WHERE id = 1", &[])
        .await?
        .get(0);
    assert_eq!(effects, ["EmailRequested"]);
    let list = replay(&cfg, &["list", "--all"], true);
    assert!(
        list.contains("finished") && list.contains("alice") && list.contains("bob"),
        "{list}"
    );
    Ok(())
}

/// Rows handed to the producer by `replay run`, from its output.
fn sent_by(out: &str) -> u64 {
    out.split("finished: ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replay_resumes_at_its_cursor() -> anyhow::Result<()> {
    const N: usize = 120;
    let env = Env::start("rp_resume").await?;
    create_topics(&env.bootstrap(), &[ACCT], 3).await?;
    let cfg = env.config_file()?;
    let mut c = env.sql().await?;
    let since = db_now(&c).await?;
    let written = events("acct", "a-1", N as i64, "Deposited");
    for chunk in written.chunks(10) {
        write_events(&mut c, chunk, false).await?;
    }
    let until = db_now(&c).await?;

    let log = env.dir.path().join("replay.log");
    let f = std::fs::File::create(&log)?;
    let mut cmd = Command::new(relay_bin());
    cmd.args(["replay", "--config"])
        .arg(&cfg)
        .args([
            "--since",
            &since,
            "--until",
            &until,
            "--execute",
            "--reason",
            "resume test",
            "--rate",
            "20",
        ])
        .stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f);
    testkit::die_with_parent(&mut cmd);
    let mut child = cmd.spawn()?;
    let acked = || async {
        let r = c
            .query_opt("SELECT sent FROM outboxd_replay WHERE id = 1", &[])
            .await?;
        anyhow::Ok(r.map_or(0, |r| r.get::<_, i64>(0)))
    };
    eventually(Duration::from_secs(60), || async {
        Ok(acked().await? >= 40)
    })
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    child.kill()?; // SIGKILL
    child.wait()?;
    let text = std::fs::read_to_string(&log)?;
    assert!(
        text.contains("events acknowledged"),
        "no progress lines:\n{text}"
    );
    let (state, cursor): (String, Option<String>) = {
        let r = c
            .query_one(
                "SELECT state, cursor_id FROM outboxd_replay WHERE id = 1",
                &[],
            )
            .await?;
        (r.get(0), r.get(1))
    };
    assert_eq!(state, "running");
    assert!(cursor.is_some());
    let before = acked().await? as u64;
    assert!(before < N as u64, "the run ended before the kill");

    let t0 = Instant::now();
    let out = replay(&cfg, &["run", "1"], true);
    let took = t0.elapsed();
    // Only what the broker had not acknowledged before the cursor is sent again.
    assert_eq!(sent_by(&out), N as u64 - before, "{out}");
    assert!(
        out.contains(&format!("{N} of {N} selected acknowledged")),
        "{out}"
    );
    let recs = raw_records(&env, ACCT, N)?;
    let copies = by_id(&recs);
    for e in &written {
        assert!(
            copies.contains_key(&e.event_id.to_string()),
            "{} never arrived",
            e.event_id
        );
    }
    // Duplicates: the first run's unacknowledged tail (a batch of 4 at 20/s, plus what was in flight).
    let extra = recs.len() - N;
    assert!(
        extra <= 20,
        "{extra} duplicates: more than the unacknowledged tail"
    );
    // The second run is rate-capped too (generous: 80 % of count / rate).
    let floor = Duration::from_secs_f64((N as u64 - before) as f64 / 20.0 * 0.8);
    assert!(took >= floor, "{took:?} < {floor:?}");
    let (state, .., sent, _, _) = audit(&c, 1).await?;
    assert_eq!((state.as_str(), sent), ("finished", N as i64));
    eprintln!(
        "resumed: {before} acknowledged before the kill, {extra} duplicate(s), second run {took:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_cap_spreads_a_replay_over_time() -> anyhow::Result<()> {
    let env = Env::start("rp_rate").await?;
    create_topics(&env.bootstrap(), &[ACCT], 3).await?;
    let cfg = env.config_file()?;
    let mut c = env.sql().await?;
    let since = db_now(&c).await?;
    write_events(&mut c, &events("acct", "a-1", 60, "Deposited"), false).await?;
    let until = db_now(&c).await?;
    let args = ["--since", since.as_str(), "--until", until.as_str()];
    let t0 = Instant::now();
    replay(
        &cfg,
        &[&args[..], &["--execute", "--reason", "r", "--rate", "30"]].concat(),
        true,
    );
    let slow = t0.elapsed();
    // 60 events at 30/s: about 2 s (at most 0.2 s of catch-up; bounds are generous).
    assert!(slow >= Duration::from_millis(1600), "{slow:?}");
    assert!(slow < Duration::from_secs(60), "{slow:?}");
    let t0 = Instant::now();
    replay(
        &cfg,
        &[
            &args[..],
            &["--execute", "--reason", "r", "--rate", "100000"],
        ]
        .concat(),
        true,
    );
    let fast = t0.elapsed();
    assert!(
        fast < slow,
        "uncapped {fast:?} is not faster than capped {slow:?}"
    );
    assert_eq!(raw_records(&env, ACCT, 120)?.len(), 120);
    Ok(())
}

/// What the docs promise consumers: a replay brings events they already applied, with the same
/// event_ids, and the inbox absorbs every copy — each effect exactly once in the business table,
/// while the relay keeps streaming new events beside the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_absorbs_a_replay() -> anyhow::Result<()> {
    use outboxd_tests::reliability::*;
    let mut env = Env::start("rp_inbox").await?;
    env.extra_toml = "[replay]\napproval_over = 100000\n".into();
    create_topics(&env.bootstrap(), &[ACCT], 3).await?;
    let cfg = env.config_file()?;
    let c = env.sql().await?;
    let since = db_now(&c).await?;
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let reader = InboxReader::start(&env.bootstrap(), ACCT, &inbox_dsn);
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&cfg, log.clone())?;
    writer.wait_committed(300, Duration::from_secs(60)).await?;
    let until = db_now(&c).await?;
    // The writer goes on while the replay runs.
    let out = replay(
        &cfg,
        &[
            "--since",
            &since,
            "--until",
            &until,
            "--execute",
            "--reason",
            "consumer bug",
            "--rate",
            "100000",
        ],
        true,
    );
    let replayed = sent_by(&out);
    assert!(replayed >= 300, "{out}");
    let wlog = writer.stop().await?;
    env.caught_up(Duration::from_secs(60))
        .await
        .with_context(|| read_log(&log))?;
    assert!(relay.sigterm()?.success());
    let (stats, report) = drain_and_verify(reader, &wlog, "acct", &inbox_dsn).await?;
    assert!(
        stats.duplicates >= replayed,
        "{replayed} replayed, {} absorbed as duplicates: {stats:?}",
        stats.duplicates
    );
    eprintln!(
        "inbox absorbed a replay of {replayed}: {} committed, {} records, {} duplicates",
        wlog.committed.len(),
        report.records,
        stats.duplicates
    );
    Ok(())
}

/// SIGTERM (Ctrl-C) stops a run after the events in flight are acknowledged: the cursor is
/// recorded, the state is `interrupted`, and `replay run` finishes the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_interrupts_a_replay_and_run_finishes_it() -> anyhow::Result<()> {
    const N: usize = 60;
    let env = Env::start("rp_term").await?;
    create_topics(&env.bootstrap(), &[ACCT], 3).await?;
    let cfg = env.config_file()?;
    let mut c = env.sql().await?;
    let since = db_now(&c).await?;
    write_events(&mut c, &events("acct", "a-1", N as i64, "Deposited"), false).await?;
    let until = db_now(&c).await?;
    let mut cmd = Command::new(relay_bin());
    cmd.args(["replay", "--config"])
        .arg(&cfg)
        .args(["--since", &since, "--until", &until])
        .args(["--execute", "--reason", "r", "--rate", "20"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    testkit::die_with_parent(&mut cmd);
    let child = cmd.spawn()?;
    let sent = || async {
        let r = c
            .query_opt("SELECT sent FROM outboxd_replay WHERE id = 1", &[])
            .await?;
        anyhow::Ok(r.map_or(0, |r| r.get::<_, i64>(0)))
    };
    eventually(Duration::from_secs(60), || async {
        Ok(sent().await? >= 10)
    })
    .await?;
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = tokio::task::block_in_place(|| child.wait_with_output())?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("replay 1 interrupted"), "{text}");
    let r = c
        .query_one("SELECT state, sent FROM outboxd_replay WHERE id = 1", &[])
        .await?;
    let (state, before): (String, i64) = (r.get(0), r.get(1));
    assert_eq!(state, "interrupted");
    // Everything handed to the producer was acknowledged and recorded before the exit.
    let on_topic = raw_records(&env, ACCT, before as usize)?.len();
    assert_eq!(
        on_topic as i64, before,
        "sent but not recorded, or recorded but not sent"
    );
    let out = replay(&cfg, &["run", "1"], true);
    assert_eq!(sent_by(&out), N as u64 - before as u64, "{out}");
    let recs = raw_records(&env, ACCT, N)?;
    assert_eq!(recs.len(), N, "a graceful stop re-sends nothing");
    Ok(())
}

/// A replay parks nothing: an event the live path would park (here larger than
/// message.max.bytes) stops it with the event named, and `outbox_parked` stays empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_stops_a_replay_and_nothing_is_parked() -> anyhow::Result<()> {
    let mut env = Env::start("rp_poison").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"2000\"\n".into();
    create_topics(&env.bootstrap(), &[ACCT], 3).await?;
    let cfg = env.config_file()?;
    let mut c = env.sql().await?;
    let since = db_now(&c).await?;
    let mut evs = events("acct", "a-1", 3, "Deposited");
    evs[1].payload = serde_json::json!({"blob": "x".repeat(5000)});
    for e in &evs {
        write_events(&mut c, std::slice::from_ref(e), false).await?;
    }
    let until = db_now(&c).await?;
    let range = ["--since", since.as_str(), "--until", until.as_str()];
    let out = replay(
        &cfg,
        &[&range[..], &["--execute", "--reason", "r"]].concat(),
        false,
    );
    let big = evs[1].event_id.to_string();
    assert!(
        out.contains(&format!("event {big} cannot be republished (too_large)"))
            && out.contains("Nothing was parked"),
        "{out}"
    );
    let r = c
        .query_one(
            "SELECT state, error, sent FROM outboxd_replay WHERE id = 1",
            &[],
        )
        .await?;
    let (state, error, sent): (String, Option<String>, i64) = (r.get(0), r.get(1), r.get(2));
    assert_eq!(state, "failed");
    assert!(error.unwrap_or_default().contains(&big));
    assert!(sent <= 1, "the cursor passed the refused event: {sent}");
    let parked: i64 = c
        .query_one("SELECT count(*) FROM outbox_parked", &[])
        .await?
        .get(0);
    assert_eq!(parked, 0, "a replay parked an event");
    let out = replay(&cfg, &["show", "1"], true);
    assert!(
        out.contains("state:         failed") && out.contains(&big),
        "{out}"
    );
    Ok(())
}

/// A consumer in group `group` that joins it on `topic` (subscribe), reads `n` records and
/// commits where it is; kept alive by the caller (a member of the group). tansu completes a join
/// after about half of session.timeout.ms, hence 6 s.
fn join_and_commit(
    bootstrap: &str,
    group: &str,
    topic: &str,
    n: usize,
) -> anyhow::Result<rdkafka::consumer::BaseConsumer> {
    use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
    let consumer: BaseConsumer = reader_config(bootstrap)
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[topic])?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = 0;
    while seen < n {
        anyhow::ensure!(Instant::now() < deadline, "{group}: {seen} of {n} records");
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            m?;
            seen += 1;
        }
    }
    consumer.commit_consumer_state(CommitMode::Sync)?;
    Ok(consumer)
}

/// Commits `offset` on every partition of `topic` for group `group` without joining it (an
/// offset-only group, as tools that assign partitions themselves keep).
fn commit_offsets(bootstrap: &str, group: &str, topic: &str, offset: i64) -> anyhow::Result<()> {
    use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
    let consumer: BaseConsumer = reader_config(bootstrap).set("group.id", group).create()?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..3 {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Offset(offset))?;
    }
    consumer.commit(&tpl, CommitMode::Sync)?;
    Ok(())
}

/// The lines of `out` from the one starting with `label` to the next unindented one, without
/// the label and the indentation.
fn section<'a>(out: &'a str, label: &str) -> Vec<&'a str> {
    out.lines()
        .skip_while(|l| !l.starts_with(label))
        .enumerate()
        .take_while(|(i, l)| *i == 0 || l.starts_with(' '))
        .map(|(_, l)| l.strip_prefix(label).unwrap_or(l).trim_start())
        .collect()
}

/// Who receives a replay (R38): the dry run lists, per target topic, the consumer groups with
/// committed offsets on it and their lag — a group that joined and read everything, an
/// offset-only group that read nothing, no group on a topic nobody reads; `replay request` and
/// `replay show` too. Without a broker it says "unknown" and why, and the dry run still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dry_run_names_the_consumer_groups_and_their_lag() -> anyhow::Result<()> {
    let mut env = Env::start("rp_groups").await?;
    create_topics(&env.bootstrap(), &[ACCT, ORDER], 3).await?;
    let cfg = env.config_file()?;
    let mut c = env.sql().await?;
    let since = db_now(&c).await?;
    // One record per produce request: tansu reports a partition's high watermark as the last
    // batch's first offset + 1, so batches of one keep the lag exact.
    let relay = Relay::start(env.config()?);
    for e in events("order", "o-1", 4, "Paid") {
        write_events(&mut c, &[e], false).await?;
        env.caught_up(Duration::from_secs(30)).await?;
    }
    write_events(&mut c, &events("acct", "a-1", 2, "Deposited"), false).await?;
    env.caught_up(Duration::from_secs(30)).await?;
    relay.shutdown().await?;
    let until = db_now(&c).await?;
    let t = Instant::now();
    let bootstrap = env.bootstrap();
    let billing = tokio::task::block_in_place(|| join_and_commit(&bootstrap, "billing", ORDER, 4))?;
    commit_offsets(&bootstrap, "audit", ORDER, 0)?;
    eprintln!("groups ready in {:?}", t.elapsed());

    let range = ["--since", since.as_str(), "--until", until.as_str()];
    let t = Instant::now();
    let dry = replay(&cfg, &range, true);
    eprintln!("dry run with the consumer lookup: {:?}", t.elapsed());
    let who = section(&dry, "consumers:  ");
    // The order events share a key, so one partition of three holds them.
    assert!(
        who.iter().any(|l| *l
            == format!("{ORDER}: audit (lag 4, no members), billing (lag 0 on 1 of 3 partitions)")),
        "{dry}"
    );
    assert!(
        who.iter()
            .any(|l| *l == format!("{ACCT}: no consumer group has committed offsets on it")),
        "{dry}"
    );
    assert!(
        who.last().unwrap().contains("an inbox deduplicates them"),
        "{dry}"
    );

    let out = replay(
        &cfg,
        &[&["request"], &range[..], &["--reason", "r"]].concat(),
        true,
    );
    assert!(
        out.contains(&format!("consumers: {ACCT}: no consumer group"))
            && out.contains("billing (lag 0 on 1 of 3 partitions)"),
        "{out}"
    );
    drop(billing);
    let show = replay(&cfg, &["show", "1"], true);
    let now = section(&show, "consumers now: ");
    assert!(
        now.iter()
            .any(|l| l.contains("billing (lag 0 on 1 of 3 partitions")),
        "{show}"
    );

    env.broker.kill();
    let t = Instant::now();
    let dry = replay(&cfg, &range, true);
    eprintln!("dry run without a broker: {:?}", t.elapsed());
    assert!(dry.contains("events:     6 to republish"), "{dry}");
    assert!(
        dry.contains("consumers:  unknown (the broker did not list its consumer groups: ")
            && dry.contains("Connection refused"),
        "{dry}"
    );
    Ok(())
}
