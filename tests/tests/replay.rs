//! Replay (R38, issue 20): `outboxd replay` republishes chosen outbox rows with their original
//! `event_id`s through the live path's router and producer. What it selects and sends (runs,
//! approval and resume: replay_runs.rs; helpers: tests/src/replay.rs):
//!
//! - by ids: the dry run sends nothing and reports counts, topics and missing ids; the executed
//!   replay's records equal the live relay's byte for byte (key, value, headers in order,
//!   timestamp); the audit row records who, why, what and the result;
//! - by time range and filters: exactly the selected events, nothing else; types that shadow
//!   mode does not deliver yet are refused;
//! - consumers: the dry run, `replay request` and `replay show` name the consumer groups with
//!   committed offsets on each target topic and their lag, and say "unknown" (and why) without
//!   a broker.

use outboxd_tests::replay::*;
use outboxd_tests::*;
use std::time::{Duration, Instant};

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
        .map(|r| r.header("aggregate_version"))
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

/// Two transactions on one aggregate, the one that started first writing the later version:
/// `created_at` (a transaction's start) orders them backwards. A range replay sends each
/// aggregate in version order all the same (issue 26).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_replay_sends_each_aggregate_in_version_order() -> anyhow::Result<()> {
    let env = Env::start("rp_order").await?;
    create_topics(&env.bootstrap(), &[ACCT], 3).await?;
    let cfg = env.config_file()?;
    let mut c = env.sql().await?;
    let since = db_now(&c).await?;
    let mut first = env.sql().await?;
    let t1 = first.transaction().await?;
    t1.batch_execute("SELECT 1").await?; // started: its created_at is fixed
    tokio::time::sleep(Duration::from_millis(50)).await;
    write_events(&mut c, &events("acct", "a-1", 1, "Deposited"), false).await?;
    insert_events(&t1, &events_from("acct", "a-1", 2, 1, "Deposited")).await?;
    t1.commit().await?;
    let until = db_now(&c).await?;
    let backwards: bool = c
        .query_one(
            "SELECT (SELECT created_at FROM outbox WHERE aggregate_version = 2) \
                  < (SELECT created_at FROM outbox WHERE aggregate_version = 1)",
            &[],
        )
        .await?
        .get(0);
    assert!(
        backwards,
        "the test needs version 2 created before version 1"
    );

    let out = replay(
        &cfg,
        &[
            "--since",
            &since,
            "--until",
            &until,
            "--execute",
            "--reason",
            "order",
        ],
        true,
    );
    assert!(out.contains("finished: 2 event(s) sent"), "{out}");
    let versions: Vec<String> = raw_records(&env, ACCT, 2)?
        .iter()
        .map(|r| r.header("aggregate_version"))
        .collect();
    assert_eq!(versions, ["1", "2"]);
    Ok(())
}
