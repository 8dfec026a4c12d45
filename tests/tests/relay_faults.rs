//! Tests 4 and 5 of the relay issue: a broker that is unreachable (connections cut and refused,
//! then blackholed) never lets the slot pass an unacknowledged event, and everything is delivered
//! when it returns, without restarting the relay; an idle outbox does not pin WAL while another
//! table takes heavy writes.

use outboxd_tests::testkit::Mode;
use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

fn events(agg: &str, n: usize, from: i64) -> Vec<NewEvent> {
    (0..n)
        .map(|i| NewEvent {
            event_id: Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: agg.into(),
            version: from + i as i64,
            event_type: "OrderPlaced".into(),
            payload: serde_json::json!({"i": i}),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_holds_the_slot_and_recovers_without_restart() -> anyhow::Result<()> {
    let env = Env::start_with_proxies("outage").await?;
    let topic = "outbox.event.order";
    create_topics(&env.bootstrap(), &[topic], 2).await?;
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    write_events(&mut c, &events("warm", 5, 1), false).await?;
    eventually(Duration::from_secs(20), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await?;

    let proxy = env.broker_proxy.as_ref().unwrap();
    let mut total = 5;
    for (round, mode) in [Mode::Down, Mode::Blackhole].into_iter().enumerate() {
        proxy.set_mode(mode);
        let agg = format!("o-{round}");
        // A WAL position inside the first outage transaction, before its commit record: a
        // confirm at or past it would acknowledge that transaction. The slot may still move
        // over WAL written before it (the relay's own status row, other sessions): that WAL
        // holds no outbox event, so confirming it is correct.
        let inside = write_events_returning_lsn(&mut c, &events(&agg, 50, 1)).await?;
        write_events(&mut c, &events(&agg, 50, 51), false).await?;
        total += 100;
        // Give the relay ample time to (wrongly) confirm; it must not.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(!relay.is_finished(), "relay stopped during the outage");
        let confirmed = env.confirmed_lsn().await?;
        assert!(
            confirmed <= inside,
            "slot advanced past unacknowledged events while the broker was {mode:?}: \
             confirmed {confirmed:X}, first unacknowledged transaction at {inside:X}"
        );
        proxy.set_mode(Mode::Pass);
        eventually(Duration::from_secs(60), || async {
            Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
        })
        .await?;
    }
    let recs = read_topic(&env.bootstrap(), topic, total, Duration::from_secs(60))?;
    let ids: std::collections::HashSet<&str> = recs.iter().map(|r| r.header("event_id")).collect();
    assert_eq!(ids.len(), total, "distinct events delivered");
    assert!(!relay.is_finished());
    relay.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_does_not_pin_wal_while_other_tables_are_busy() -> anyhow::Result<()> {
    let env = Env::start("idle").await?;
    let relay = Relay::start(env.config()?);
    let c = env.sql().await?;
    c.batch_execute("CREATE TABLE noise (id bigserial primary key, pad text)")
        .await?;
    let start = env.current_lsn().await?;
    // ~40 MB of WAL in a table the publication does not cover.
    for _ in 0..20 {
        c.batch_execute(
            "INSERT INTO noise (pad) SELECT repeat('x', 1000) FROM generate_series(1, 2000)",
        )
        .await?;
    }
    let written = env.current_lsn().await? - start;
    assert!(written > 30 << 20, "only {written} bytes of WAL written");
    let mut lag = u64::MAX;
    for _ in 0..100 {
        // Read one after the other: the slot may confirm WAL written after the first read.
        lag = env
            .current_lsn()
            .await?
            .saturating_sub(env.confirmed_lsn().await?);
        if lag < 1 << 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        lag < 1 << 20,
        "slot retains {lag} bytes of WAL after {written} bytes of unrelated writes"
    );
    relay.shutdown().await?;
    Ok(())
}
