//! `outboxd init` installs the producer functions of `sql/010_outbox_emit.sql` next to the
//! outbox table, so the README's SQL path works on a fresh database: `outbox_emit()` appends an
//! event in the caller's transaction (with an `outbox_uuid_v7()` id when none is given) and the
//! relay delivers it.

use outboxd_tests::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_installs_outbox_emit_and_its_events_are_relayed() -> anyhow::Result<()> {
    let env = Env::start("init_emit").await?;
    let config = env.config_file()?;
    // Again through the CLI: idempotent, and it says what is there.
    let (code, out) = outboxd_cli(&["init"], &config);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("functions public.outbox_uuid_v7() and public.outbox_emit() present"),
        "{out}"
    );
    create_topics(&env.bootstrap(), &["outbox.event.order"], 1).await?;
    let mut c = env.sql().await?;
    let id: uuid::Uuid = c.query_one("SELECT outbox_uuid_v7()", &[]).await?.get(0);
    assert_eq!(id.get_version_num(), 7);
    let tx = c.transaction().await?;
    let emitted: uuid::Uuid = tx
        .query_one(
            "SELECT outbox_emit('order', 'o-1', 1, 'OrderPlaced', '{\"total\": 42}'::jsonb)",
            &[],
        )
        .await?
        .get(0);
    tx.commit().await?;
    assert_eq!(emitted.get_version_num(), 7);

    let _relay = Relay::start(env.config()?);
    let records = read_topic(
        &env.bootstrap(),
        "outbox.event.order",
        1,
        Duration::from_secs(30),
    )?;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].key, b"o-1");
    assert_eq!(records[0].header("event_id"), emitted.to_string());
    assert_eq!(records[0].header("event_type"), "OrderPlaced");
    Ok(())
}
