//! Replay runs (R38, issue 20; selection and byte identity: replay.rs):
//!
//! - approval: too large or side-effecting (by the policy `init` wrote from the admin's config)
//!   → `--execute` refused naming `replay request`; the requesting role cannot approve (the
//!   command and the table's guard both refuse); another role can, and `run` executes;
//! - resume: a replay process SIGKILLed mid-run continues at its cursor: every event arrives,
//!   nothing acknowledged before the cursor is sent again;
//! - SIGTERM: the run stops after its in-flight events are acknowledged and recorded
//!   (`interrupted`); `replay run` finishes the rest without re-sending any;
//! - poison: an event the live path would park stops the replay, nothing is parked;
//! - rate cap: a replay at N events/s takes at least about its count / N seconds;
//! - an inbox consumer absorbs a replay (each effect once) while the relay streams.

use anyhow::Context;
use outboxd_tests::replay::*;
use outboxd_tests::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_or_side_effecting_replays_need_another_role_to_approve() -> anyhow::Result<()> {
    let mut env = Env::start("rp_approve").await?;
    // The admin's policy, written into the database by init (an operator's config has no say).
    env.extra_toml =
        "[replay]\napproval_over = 4\nside_effect_types = [\"EmailRequested\"]\n".into();
    init_as_admin(&env).await?;
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
    let as_alice_sql = connect(&alice).await?;
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
