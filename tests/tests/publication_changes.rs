//! The publication changes under the relay (issue 26): pgoutput decodes an insert only if its
//! table is in the publication at that point of the WAL, so rows written while the outbox table
//! was out of it are never decoded, and a publication dropped and created again cannot be
//! decoded past at all. Before: 940 events of one second lost silently (Debezium loses the same),
//! and an endless retry on `publication "outbox_pub" does not exist`. Now the relay notices (the
//! event trigger's message in the stream, the walsender's error, or its membership check), ends
//! the session, records the gap, and the next session replaces the slot and republishes the gap
//! from the table. Under load, with an inbox consumer: every committed event delivered, first
//! copies in order, each effect once.

use outboxd_tests::reliability::world::{finish, world};
use outboxd_tests::reliability::*;
use outboxd_tests::*;
use std::time::Duration;

/// Runs `change` (SQL) under load, `pause` later `back` (SQL), and checks that nothing is lost.
async fn change_under_load(
    name: &str,
    before: &str,
    change: &str,
    pause: Duration,
    back: &str,
) -> anyhow::Result<String> {
    let w = world(Env::start(name).await?).await?;
    let c = w.env.sql().await?;
    if !before.is_empty() {
        c.batch_execute(before).await?;
    }
    let mut relay = w.spawn()?;
    w.writer
        .wait_committed(300, Duration::from_secs(60))
        .await?;
    c.batch_execute(change).await?;
    let during = w.writer.committed_events();
    tokio::time::sleep(pause).await;
    let skipped = w.writer.committed_events() - during;
    c.batch_execute(back).await?;
    w.commit_more(300).await?;
    let (wlog, report) = finish(&w.env, w.writer, w.reader, &w.inbox_dsn, &mut relay).await?;
    let log = read_log(&w.log);
    eprintln!(
        "{name}: {skipped} events committed while the publication was changed; {} committed, \
         {} records, {} duplicates",
        wlog.committed.len(),
        report.records,
        report.duplicates
    );
    assert!(skipped > 0, "the writer wrote nothing during the change");
    assert!(log.contains("publication changed"), "{log}");
    assert!(log.contains("recovery finished"), "{log}");
    Ok(log)
}

/// `ALTER PUBLICATION … DROP TABLE` and, a second later, `ADD TABLE` (a migration tool's
/// reshuffle): the event trigger's message marks the change in the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_leaves_the_publication_for_a_second_under_load() -> anyhow::Result<()> {
    change_under_load(
        "pub_readd",
        "",
        "ALTER PUBLICATION outbox_pub DROP TABLE outbox",
        Duration::from_secs(1),
        "ALTER PUBLICATION outbox_pub ADD TABLE outbox",
    )
    .await?;
    Ok(())
}

/// The publication dropped and created again: a slot cannot decode past that (`publication …
/// does not exist` at every restart); the slot is replaced and the gap republished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publication_is_dropped_and_created_again_under_load() -> anyhow::Result<()> {
    change_under_load(
        "pub_recreate",
        "",
        "DROP PUBLICATION outbox_pub",
        Duration::from_secs(1),
        "CREATE PUBLICATION outbox_pub FOR TABLE outbox WITH (publish = 'insert')",
    )
    .await?;
    Ok(())
}

/// Without the event trigger (a role that could not install it) a change that lasts across a
/// state write is still caught, by the relay's membership check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_event_trigger_a_longer_change_is_caught_by_the_check() -> anyhow::Result<()> {
    change_under_load(
        "pub_poll",
        "DROP EVENT TRIGGER outboxd_publication_ddl; DROP EVENT TRIGGER outboxd_publication_drop",
        "ALTER PUBLICATION outbox_pub DROP TABLE outbox",
        Duration::from_secs(3),
        "ALTER PUBLICATION outbox_pub ADD TABLE outbox",
    )
    .await?;
    Ok(())
}
