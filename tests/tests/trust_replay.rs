//! Replay trust (R41, issue 27): the two-person rule holds against members of the group role
//! `outboxd_replay` who write the audit table by hand, bring their own config, or shadow an
//! operator, as the least-privilege roles of sql/roles.sql (alice and bob, members; the env's
//! superuser is the admin that runs `outboxd init`). Each attack ends with nothing on the topic
//! and an error that says why:
//!
//! - a hand-written `approved` row: the guard computes whether it needs an approval from the
//!   database's policy; a row that lies about its count is counted again by `replay run`;
//! - an operator's own `[replay]` (config or `OUTBOXD_REPLAY_*`) does not change the policy;
//!   a policy tightened after a request is applied when it runs;
//! - a finished replay stays finished; the runner's columns are computed by the guard; a
//!   rewound cursor re-sends at most a batch (no run acknowledges more than was requested);
//! - a range that ends in the future ends at the request's now(): later rows are not sent, even
//!   by a run that resumes a killed one;
//! - rows written into an approved range stop the run (the recount);
//! - a decoy `=` operator in a schema on alice's search path does not fool the guard;
//! - `outboxd replay` never creates the audit table, and refuses a disabled or older guard;
//!   `init` does not adopt an audit table an operator created.

use outboxd_tests::replay::*;
use outboxd_tests::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_written_approved_row_does_not_skip_the_approval() -> anyhow::Result<()> {
    let (env, cfg, alice, _) = trust_world("tr_insert").await?;
    let mut c = env.sql().await?;
    let (evs, since, until) = written_range(&mut c, "a-1", 50).await?;
    let a = connect(&alice).await?;
    let sel = range(&since, &until);
    let honest = json!([["Deposited", ACCT, 50]]);

    // The row as the attack wrote it: needs_approval = false, approved.
    let err = insert_by_hand(&a, &env.slot, "approved", sel.clone(), 50, honest.clone())
        .await
        .expect_err("50 events stored as approved without an approval");
    assert!(db_message(&err).contains("needs an approval"), "{err:?}");
    // As requested it is stored, marked as needing an approval whatever the row said.
    let id = insert_by_hand(&a, &env.slot, "requested", sel.clone(), 50, honest).await?;
    let needs: bool = c
        .query_one(
            "SELECT needs_approval FROM outboxd_replay WHERE id = $1",
            &[&id],
        )
        .await?
        .get(0);
    assert!(needs, "the client's needs_approval = false was kept");
    // By ids the ids count, whatever the row claims.
    let ids: Vec<String> = evs.iter().map(|e| e.event_id.to_string()).collect();
    let err = insert_by_hand(
        &a,
        &env.slot,
        "approved",
        json!({"by": "ids", "ids": ids}),
        0,
        json!([]),
    )
    .await
    .expect_err("50 ids stored as approved");
    assert!(db_message(&err).contains("needs an approval"), "{err:?}");
    // A row that lies about its count is stored (the guard cannot count the outbox), but the
    // run counts the selection again and refuses it.
    let id = insert_by_hand(
        &a,
        &env.slot,
        "approved",
        sel,
        1,
        json!([["Deposited", ACCT, 1]]),
    )
    .await?;
    let out = replay(&cfg, &["run", &id.to_string(), "--dsn", &alice], false);
    assert!(
        out.contains(&format!(
            "replay {id}: the selection holds 50 events now, 1 were requested: request a new \
             replay"
        )),
        "{out}"
    );
    assert_eq!(replay_state(&c, id).await?, "approved", "it started");
    nothing_on_the_topic(&env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_config_does_not_set_the_approval_policy() -> anyhow::Result<()> {
    let (env, cfg, alice, _) = trust_world("tr_policy").await?;
    let mut c = env.sql().await?;
    let (evs, since, until) = written_range(&mut c, "a-1", 50).await?;
    let range = ["--since", since.as_str(), "--until", until.as_str()];
    let run = ["--execute", "--reason", "mine", "--dsn", alice.as_str()];

    // Her own config raises the threshold: the database's policy still says 4.
    let mine = env.dir.path().join("alice.toml");
    std::fs::write(
        &mine,
        env.toml().replace(
            ADMIN_POLICY,
            "[replay]\napproval_over = 100000\nside_effect_types = []\n",
        ),
    )?;
    let dry = replay(&mine, &[&range[..], &["--dsn", &alice]].concat(), true);
    assert!(
        dry.contains("approval:   needed (50 events, over replay.approval_over = 4"),
        "{dry}"
    );
    let out = replay(&mine, &[&range[..], &run].concat(), false);
    assert!(
        out.contains("50 events, over replay.approval_over = 4")
            && out.contains("needs an approval"),
        "{out}"
    );
    // So does the environment.
    let (code, out) = {
        let o = std::process::Command::new(relay_bin())
            .args(["replay", "--config"])
            .arg(&cfg)
            .args([&range[..], &run].concat())
            .env("OUTBOXD_REPLAY_APPROVAL_OVER", "100000")
            .output()?;
        let text =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        (o.status.code(), text)
    };
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("over replay.approval_over = 4"), "{out}");
    let (_, check) = outboxd_cli(&["check"], &mine);
    assert!(
        check.contains("the database's policy applies; run init as the admin"),
        "{check}"
    );
    let rows: i64 = c
        .query_one("SELECT count(*) FROM outboxd_replay", &[])
        .await?
        .get(0);
    assert_eq!(rows, 0);

    // A replay small enough when requested, of a type the admin marks as having side effects
    // before it runs: the run applies the policy of now.
    let a = connect(&alice).await?;
    let three: Vec<String> = evs[..3].iter().map(|e| e.event_id.to_string()).collect();
    let id = insert_by_hand(
        &a,
        &env.slot,
        "approved",
        json!({"by": "ids", "ids": three}),
        3,
        json!([["Deposited", ACCT, 3]]),
    )
    .await?;
    let mut env = env;
    env.extra_toml = "[replay]\napproval_over = 4\nside_effect_types = [\"Deposited\"]\n".into();
    init_as_admin(&env).await?;
    let out = replay(&cfg, &["run", &id.to_string(), "--dsn", &alice], false);
    assert!(
        out.contains(&format!(
            "replay {id} needs an approval (event type Deposited has side effects"
        )),
        "{out}"
    );
    assert_eq!(replay_state(&c, id).await?, "approved");
    nothing_on_the_topic(&env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_replay_cannot_be_set_back() -> anyhow::Result<()> {
    let (env, cfg, alice, bob) = trust_world("tr_finished").await?;
    let mut c = env.sql().await?;
    let (_, since, until) = written_range(&mut c, "a-1", 3).await?;
    let out = replay(
        &cfg,
        &[
            "--since",
            &since,
            "--until",
            &until,
            "--execute",
            "--reason",
            "r",
            "--dsn",
            &alice,
        ],
        true,
    );
    assert!(out.contains("replay 1 finished: 3 event(s) sent"), "{out}");
    for who in [&alice, &bob] {
        let s = connect(who).await?;
        for set in [
            "state = 'failed'",
            "state = 'approved'",
            "state = 'running', runs = runs + 1",
            "state = 'interrupted'",
            "state = 'requested'",
            "sent = 0, cursor_id = NULL",
        ] {
            let sql = format!("UPDATE outboxd_replay SET {set} WHERE id = $1");
            refused_by_guard(&s, &sql, 1, "finished (terminal)").await;
        }
    }
    let out = replay(&cfg, &["run", "1", "--dsn", &alice], false);
    assert!(out.contains("replay 1 is finished"), "{out}");
    assert_eq!(replay_state(&c, 1).await?, "finished");
    assert_eq!(raw_records(&env, ACCT, 3)?.len(), 3, "sent again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runners_columns_are_the_guards() -> anyhow::Result<()> {
    let (env, cfg, alice, bob) = trust_world("tr_runner").await?;
    let mut c = env.sql().await?;
    let (_, since, until) = written_range(&mut c, "a-1", 10).await?;
    request_as(&cfg, &alice, &since, &until);
    replay(&cfg, &["approve", "1", "--dsn", &bob], true);
    let a = connect(&alice).await?;

    // A run starts: whatever the row says, the guard counts it and records who and when.
    a.execute(
        "UPDATE outboxd_replay SET state = 'running', runs = 7, run_by = 'bob', sent = 10, \
           cursor_id = '[\"acct\",\"a-1\",\"10\",\"x\"]', started_at = '2000-01-01', error = 'e', \
           events = 1000, approved_by = 'bob' WHERE id = 1",
        &[],
    )
    .await?;
    let r = c
        .query_one(
            "SELECT runs, run_by, sent, cursor_id, started_at > now() - interval '1 hour', error, \
               events FROM outboxd_replay WHERE id = 1",
            &[],
        )
        .await?;
    let row: (i32, String, i64, Option<String>, bool, Option<String>, i64) = (
        r.get(0),
        r.get(1),
        r.get(2),
        r.get(3),
        r.get(4),
        r.get(5),
        r.get(6),
    );
    assert_eq!(row, (1, "alice".into(), 0, None, true, None, 10));
    // Progress only forward.
    a.execute(
        "UPDATE outboxd_replay SET sent = 5, cursor_id = '[\"acct\",\"a-1\",\"5\",\"x\"]' WHERE id = 1",
        &[],
    )
    .await?;
    let set = |s: &str| format!("UPDATE outboxd_replay SET {s} WHERE id = $1");
    refused_by_guard(&a, &set("sent = 4"), 1, "sent cannot go back").await;
    refused_by_guard(&a, &set("cursor_id = NULL"), 1, "cursor cannot go back").await;
    refused_by_guard(&a, &set("approved_by = NULL"), 1, "already approved by bob").await;
    // An end: the guard records finished_at and keeps an error only for `failed`.
    a.execute(
        "UPDATE outboxd_replay SET state = 'interrupted', finished_at = '2000-01-01', \
           error = 'x' WHERE id = 1",
        &[],
    )
    .await?;
    let r = c
        .query_one(
            "SELECT state, finished_at IS NULL, error IS NULL, sent FROM outboxd_replay WHERE id = 1",
            &[],
        )
        .await?;
    assert_eq!(
        (
            r.get::<_, String>(0),
            r.get(1),
            r.get(2),
            r.get::<_, i64>(3)
        ),
        ("interrupted".to_string(), true, true, 5)
    );
    for (to, says) in [
        ("finished", "interrupted to finished is not allowed"),
        ("approved", "interrupted to approved is not allowed"),
        ("requested", "interrupted to requested is not allowed"),
    ] {
        refused_by_guard(&a, &set(&format!("state = '{to}'")), 1, says).await;
    }
    refused_by_guard(
        &a,
        &set("sent = 9"),
        1,
        "interrupted to interrupted is not allowed",
    )
    .await;

    // A run killed midway leaves `running`: the next `replay run` starts again from there.
    let (later, since, until) = written_range(&mut c, "a-2", 6).await?;
    request_as(&cfg, &alice, &since, &until);
    replay(&cfg, &["approve", "2", "--dsn", &bob], true);
    a.execute(
        "UPDATE outboxd_replay SET state = 'running', runs = runs + 1 WHERE id = 2",
        &[],
    )
    .await?;
    let out = replay(&cfg, &["run", "2", "--dsn", &bob], true);
    assert!(out.contains("replay 2 finished: 6 event(s) sent"), "{out}");
    let r = c
        .query_one(
            "SELECT runs, run_by, sent FROM outboxd_replay WHERE id = 2",
            &[],
        )
        .await?;
    assert_eq!(
        (
            r.get::<_, i32>(0),
            r.get::<_, String>(1),
            r.get::<_, i64>(2)
        ),
        (2, "bob".to_string(), 6)
    );
    let recs = raw_records(&env, ACCT, 6)?;
    assert_eq!(recs.len(), 6);
    let ids: Vec<String> = later.iter().map(|e| e.event_id.to_string()).collect();
    assert!(recs.iter().all(|r| ids.contains(&r.event_id())));
    Ok(())
}

/// A member can still move a running replay's cursor (the guard cannot order the keys), but no
/// run acknowledges more events over all runs than were requested: a rewound replay stops after
/// at most a batch, and does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewound_replay_sends_no_more_than_was_requested() -> anyhow::Result<()> {
    let (env, cfg, alice, bob) = trust_world("tr_rewind").await?;
    let mut c = env.sql().await?;
    let (_, since, until) = written_range(&mut c, "a-1", 6).await?;
    request_as(&cfg, &alice, &since, &until);
    replay(&cfg, &["approve", "1", "--dsn", &bob], true);
    // As if a run had sent everything, with the cursor back at the start.
    let a = connect(&alice).await?;
    a.batch_execute(
        "UPDATE outboxd_replay SET state = 'running', runs = runs + 1 WHERE id = 1; \
         UPDATE outboxd_replay SET sent = 6 WHERE id = 1",
    )
    .await?;
    let out = replay(&cfg, &["run", "1", "--dsn", &bob], false);
    assert!(
        out.contains("events acknowledged over its runs, more than the 6 requested"),
        "{out}"
    );
    assert_eq!(replay_state(&c, 1).await?, "failed");
    let out = replay(&cfg, &["run", "1", "--dsn", &bob], false);
    assert!(
        out.contains("replay 1: 12 events acknowledged over its runs, more than the 6 requested"),
        "{out}"
    );
    // One batch (here the whole selection, 6 at 100/s in batches of 20) went out again; no more.
    assert_eq!(raw_records(&env, ACCT, 6)?.len(), 6);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_into_the_future_ends_at_the_requests_now() -> anyhow::Result<()> {
    let (env, cfg, alice, _) = trust_world("tr_future").await?;
    let mut c = env.sql().await?;
    let since = db_now(&c).await?;
    let first = events("acct", "a-1", 3, "Deposited");
    write_events(&mut c, &first, false).await?;
    let future = "2100-01-01T00:00:00Z";
    let dry = replay(
        &cfg,
        &["--since", &since, "--until", future, "--dsn", &alice],
        true,
    );
    assert!(
        dry.contains("capped at the database's now()") && dry.contains("events:     3 "),
        "{dry}"
    );
    let out = request_as(&cfg, &alice, &since, future);
    assert!(!out.contains("2100"), "stored as asked: {out}");

    // By hand, as approved (3 events need no approval): stored ending at now().
    let a = connect(&alice).await?;
    let id = insert_by_hand(
        &a,
        &env.slot,
        "approved",
        range(&since, future),
        3,
        json!([["Deposited", ACCT, 3]]),
    )
    .await?;
    let capped: bool = c
        .query_one(
            "SELECT (selection->>'until')::timestamptz <= now() FROM outboxd_replay WHERE id = $1",
            &[&id],
        )
        .await?
        .get(0);
    assert!(capped);
    let show = replay(&cfg, &["show", &id.to_string()], true);
    assert!(show.contains("created in ["), "{show}");
    // A run killed before it sent anything; rows written since; the run resumed.
    a.execute(
        "UPDATE outboxd_replay SET state = 'running', runs = runs + 1 WHERE id = $1",
        &[&id],
    )
    .await?;
    let second = events("acct", "a-2", 3, "Deposited");
    write_events(&mut c, &second, false).await?;
    let out = replay(&cfg, &["run", &id.to_string(), "--dsn", &alice], true);
    assert!(
        out.contains(&format!("replay {id} finished: 3 event(s) sent")),
        "{out}"
    );
    let recs = raw_records(&env, ACCT, 3)?;
    let ids: Vec<String> = first.iter().map(|e| e.event_id.to_string()).collect();
    assert_eq!(recs.len(), 3);
    assert!(
        recs.iter().all(|r| ids.contains(&r.event_id())),
        "a row written after the request was sent"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_into_an_approved_range_stop_the_run() -> anyhow::Result<()> {
    let (env, cfg, alice, bob) = trust_world("tr_grown").await?;
    let mut c = env.sql().await?;
    let (_, since, until) = written_range(&mut c, "a-1", 6).await?;
    request_as(&cfg, &alice, &since, &until);
    replay(&cfg, &["approve", "1", "--dsn", &bob], true);
    // Back-dated into the approved range after the approval.
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
           event_type, payload, created_at) \
         SELECT gen_random_uuid(), 'acct', 'a-late', v, 'Deposited', '{}', \
           $1::text::timestamptz + interval '1 millisecond' FROM generate_series(1, 2) AS v",
        &[&since],
    )
    .await?;
    let out = replay(&cfg, &["run", "1", "--dsn", &bob], false);
    assert!(
        out.contains(
            "replay 1: the selection holds 8 events now, 6 were requested: request a new replay"
        ),
        "{out}"
    );
    assert_eq!(replay_state(&c, 1).await?, "approved");
    nothing_on_the_topic(&env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoy_operator_does_not_fool_the_guard() -> anyhow::Result<()> {
    let (env, cfg, alice, _) = trust_world("tr_decoy").await?;
    let mut c = env.sql().await?;
    c.batch_execute("GRANT CREATE ON SCHEMA public TO alice")
        .await?;
    let (_, since, until) = written_range(&mut c, "a-1", 6).await?;
    request_as(&cfg, &alice, &since, &until);
    // Her own `=` for (name, text), which the guard's role comparisons would use, searched
    // before pg_catalog in her session.
    let a = connect(&alice).await?;
    a.batch_execute(
        "CREATE FUNCTION public.never_equal(name, text) RETURNS boolean LANGUAGE sql \
           IMMUTABLE AS 'SELECT false'; \
         CREATE OPERATOR public.= (LEFTARG = name, RIGHTARG = text, \
           FUNCTION = public.never_equal); \
         SET search_path = public, pg_catalog",
    )
    .await?;
    let fooled: bool = a
        .query_one("SELECT NOT (current_user = 'alice'::text)", &[])
        .await?
        .get(0);
    assert!(fooled, "the decoy is not in effect in her session");
    let set = |s: &str| format!("UPDATE outboxd_replay SET {s} WHERE id = $1");
    refused_by_guard(
        &a,
        &set("state = 'approved', approved_by = 'x'"),
        1,
        "another role must approve",
    )
    .await;
    refused_by_guard(
        &a,
        &set("state = 'running', runs = runs + 1"),
        1,
        "needs an approval",
    )
    .await;
    let out = replay(&cfg, &["run", "1", "--dsn", &alice], false);
    assert!(out.contains("needs an approval first"), "{out}");
    assert_eq!(replay_state(&c, 1).await?, "requested");
    nothing_on_the_topic(&env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_never_creates_the_audit_table() -> anyhow::Result<()> {
    let (env, cfg, alice, _) = trust_world("tr_missing").await?;
    let c = env.sql().await?;
    let since = db_now(&c).await?;
    let until = db_now(&c).await?;
    let dry = [
        "--since",
        since.as_str(),
        "--until",
        until.as_str(),
        "--dsn",
        alice.as_str(),
    ];
    replay(&cfg, &dry, true);

    // A disabled guard: check says so, replay refuses.
    c.batch_execute("ALTER TABLE outboxd_replay DISABLE TRIGGER outboxd_replay_guard")
        .await?;
    let (_, check) = outboxd_cli(&["check"], &cfg);
    assert!(
        check.contains("outboxd_replay_guard on outboxd_replay is DISABLED"),
        "{check}"
    );
    let out = replay(&cfg, &dry, false);
    assert!(
        out.contains("is disabled, so nothing enforces the two-person rule"),
        "{out}"
    );
    c.batch_execute("ALTER TABLE outboxd_replay ENABLE TRIGGER outboxd_replay_guard")
        .await?;
    // A guard of an older outboxd (it searches the caller's path): refused until init runs.
    c.batch_execute("ALTER FUNCTION outboxd_replay_guard() RESET search_path")
        .await?;
    let init = "run `outboxd init` as the admin role";
    let out = replay(&cfg, &dry, false);
    assert!(out.contains(init), "{out}");
    init_as_admin(&env).await?;
    replay(&cfg, &dry, true);

    // No table: replay names init and creates nothing.
    c.batch_execute("DROP TABLE outboxd_replay").await?;
    for args in [&dry[..], &["run", "1", "--dsn", &alice]] {
        let out = replay(&cfg, args, false);
        assert!(
            out.contains("outboxd_replay is missing (or predates the approval policy)")
                && out.contains(init),
            "{out}"
        );
    }
    let created: bool = c
        .query_one(
            "SELECT to_regclass('public.outboxd_replay') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    assert!(!created, "outboxd replay created the audit table");

    // An operator who creates it herself (as an older `outboxd replay` did for whoever ran it
    // first) could disable its guard: init does not adopt it, and check names her.
    c.batch_execute("GRANT CREATE ON SCHEMA public TO alice")
        .await?;
    connect(&alice)
        .await?
        .batch_execute("CREATE TABLE public.outboxd_replay (id bigserial PRIMARY KEY)")
        .await?;
    let err = init_as_admin(&env)
        .await
        .expect_err("init adopted her table");
    assert!(
        err.to_string().contains(
            "table outboxd_replay is owned by role alice: neither a superuser nor the outbox \
             table's owner"
        ),
        "{err:#}"
    );
    let (_, check) = outboxd_cli(&["check"], &cfg);
    assert!(
        check.contains("table outboxd_replay is owned by role alice"),
        "{check}"
    );
    let out = replay(&cfg, &dry, false);
    assert!(out.contains(init), "{out}");
    Ok(())
}
