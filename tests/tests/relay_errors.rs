//! Test 6 of the relay issue: bad config, `wal_level=replica` and a missing publication make both
//! `outboxd check` and `outboxd run` fail fast with a message naming the problem and the fix.

use outboxd_tests::testkit::{Broker, PgOptions, Postgres};
use outboxd_tests::*;
use std::process::Command;
use std::time::{Duration, Instant};

/// Runs the real binary; returns (exit code, stdout + stderr) and how long it took.
fn outboxd(args: &[&str], config: &std::path::Path) -> (i32, String, Duration) {
    let t = Instant::now();
    let out = Command::new(relay_bin())
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .expect("run outboxd");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text, t.elapsed())
}

fn assert_fails(args: &[&str], config: &std::path::Path, needles: &[&str]) {
    let (code, text, took) = outboxd(args, config);
    assert_ne!(code, 0, "{args:?} succeeded: {text}");
    for n in needles {
        assert!(text.contains(n), "{args:?}: expected {n:?} in:\n{text}");
    }
    assert!(took < Duration::from_secs(30), "{args:?} took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_setups_fail_fast_with_the_fix() -> anyhow::Result<()> {
    let env = Env::start("errors").await?;
    let good = env.config_file()?;
    let (code, text, _) = outboxd(&["check"], &good);
    assert_eq!(code, 0, "check on a good setup failed:\n{text}");
    // No topic yet: a warning that says who would create it, with what.
    assert!(
        text.contains("WARN") && text.contains("outboxd does not create topics"),
        "{text}"
    );
    create_topics(&env.bootstrap(), &["outbox.event.acct"], 2).await?;
    let (_, text, _) = outboxd(&["check"], &good);
    assert!(text.contains("1 topic(s) named outbox.event."), "{text}");
    // The password never appears in output.
    assert!(
        !text.contains(outboxd_tests::testkit::PG_PASSWORD),
        "{text}"
    );

    // A missing file is named once, with its reason once.
    let (code, text, _) = outboxd(&["check"], &env.dir.path().join("nope.toml"));
    assert_ne!(code, 0);
    assert_eq!(text.matches("No such file").count(), 1, "{text}");
    assert_eq!(text.matches("nope.toml").count(), 1, "{text}");

    // Bad config: unknown key, missing broker, unsafe producer settings.
    let bad = env.dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        env.toml().replace("[relay]", "[relay]\nmax_in_flight = 3"),
    )?;
    for cmd in [["check"], ["run"]] {
        assert_fails(&cmd, &bad, &["max_in_flight"]);
    }
    std::fs::write(
        &bad,
        env.toml()
            .replace("\"linger.ms\" = \"2\"", "\"acks\" = \"1\""),
    )?;
    assert_fails(&["run"], &bad, &["acks=all"]);

    // Missing publication.
    env.sql()
        .await?
        .batch_execute("DROP PUBLICATION outbox_pub")
        .await?;
    for cmd in [["check"], ["run"]] {
        assert_fails(
            &cmd,
            &good,
            &[
                "publication \"outbox_pub\" does not exist",
                "CREATE PUBLICATION",
            ],
        );
    }
    // A definite error of `run` ends with the operator's fix for its class.
    assert_fails(&["run"], &good, &["fix: do what the message names"]);
    // `init` repairs it, and `check` is happy again.
    let (code, text, _) = outboxd(&["init"], &good);
    assert_eq!(code, 0, "{text}");
    assert_eq!(outboxd(&["check"], &good).0, 0);

    // No slot yet: check says so once, without the replication client's own ERROR line.
    env.sql()
        .await?
        .execute("SELECT pg_drop_replication_slot($1)", &[&env.slot])
        .await?;
    let (code, text, _) = outboxd(&["check"], &good);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("does not exist yet") && !text.contains("ERROR"),
        "{text}"
    );

    // Broker down: check names the broker, in its table, without librdkafka's chatter.
    drop(env.broker);
    assert_fails(&["check"], &good, &["broker"]);
    let (_, text, _) = outboxd(&["check"], &good);
    assert!(
        !text.contains("librdkafka") && text.lines().count() < 20,
        "{text}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_replica_is_refused_with_the_fix() -> anyhow::Result<()> {
    let pg = Postgres::start_with(PgOptions {
        wal_level: "replica".into(),
        ..Default::default()
    })?;
    let broker = Broker::start()?;
    pg.create_database("replica").await?;
    let cfg = tempfile::NamedTempFile::new()?;
    std::fs::write(
        cfg.path(),
        format!(
            "[source]\ndsn = \"{}\"\n[sink.kafka]\n\"bootstrap.servers\" = \"{}\"\n",
            pg.dsn("replica"),
            broker.bootstrap()
        ),
    )?;
    for cmd in [["check"], ["run"]] {
        assert_fails(
            &cmd,
            cfg.path(),
            &["wal_level", "ALTER SYSTEM SET wal_level = logical"],
        );
    }
    Ok(())
}

/// Every walsender taken (here: none configured): the SQL checks pass, so `check` must try
/// the replication connection itself and name the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_free_walsender_is_named_by_check() -> anyhow::Result<()> {
    let pg = Postgres::start_with(PgOptions {
        settings: vec![("max_wal_senders".into(), "0".into())],
        ..Default::default()
    })?;
    let env = Env::with(pg, Broker::start()?, "nosender").await?;
    let (code, text, took) = outboxd(&["check"], &env.config_file()?);
    assert_ne!(code, 0, "{text}");
    assert!(
        text.contains("replication connection") && text.contains("raise max_wal_senders"),
        "{text}"
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
    Ok(())
}
