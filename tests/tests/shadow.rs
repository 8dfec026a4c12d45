//! Shadow mode (issue 20, R35): a relay with `shadow.enabled` builds every record and delivers
//! none, compares them by `event_id` with what a legacy "publish inside the transaction" path
//! sent (here: the test, producing to a legacy topic), and reports matched, mismatched (which
//! field), missing on either side — in `outboxd shadow report` and the metrics. Canary types
//! are delivered for real; with a shadow topic prefix the records go there instead.

use outboxd_tests::reliability::read_log;
use outboxd_tests::testkit::free_port;
use outboxd_tests::*;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::time::Duration;
use uuid::Uuid;

/// What a legacy path does: publishes the event itself (here before the outbox row commits,
/// as code that sends inside the transaction does).
async fn legacy_send(p: &FutureProducer, id: Uuid, agg: &str, event_type: &str, value: &str) {
    let id = id.to_string();
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "event_id",
            value: Some(id.as_bytes()),
        })
        .insert(Header {
            key: "event_type",
            value: Some(event_type.as_bytes()),
        });
    p.send(
        FutureRecord::to("legacy.orders")
            .key(agg)
            .payload(value)
            .headers(headers),
        Duration::from_secs(10),
    )
    .await
    .expect("legacy send");
}

fn event(id: Uuid, agg: &str, event_type: &str, payload: serde_json::Value) -> NewEvent {
    let mut e = NewEvent::new("order", agg, 1, event_type, payload);
    e.event_id = id;
    e
}

async fn start(env: &mut Env, shadow_toml: &str) -> anyhow::Result<(RelayProcess, String)> {
    create_topics(
        &env.bootstrap(),
        &[
            "legacy.orders",
            "outbox.event.order",
            "shadow.outbox.event.order",
        ],
        1,
    )
    .await?;
    let maddr = format!("127.0.0.1:{}", free_port());
    env.extra_toml = format!(
        "[metrics]\nlisten = \"{maddr}\"\n[shadow]\nenabled = true\nlegacy_topics = [\"legacy.orders\"]\n\
         legacy_event_type = \"header:event_type\"\ncompare = [\"key\", \"value\", \"header:event_type\"]\n\
         match_window = \"3s\"\ndeliver_types = [\"OrderShipped\"]\n{shadow_toml}"
    );
    let cfg = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let relay = RelayProcess::spawn(&cfg, log.clone())?;
    let res = eventually(Duration::from_secs(30), || async {
        Ok(read_log(&log).contains("shadow mode: records are compared"))
    })
    .await;
    assert!(res.is_ok(), "{}", read_log(&log));
    env.caught_up(Duration::from_secs(30)).await?;
    // Comparing starts a grace second after the comparator listens.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    Ok((relay, maddr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_compares_with_the_legacy_path_and_delivers_only_canary_types(
) -> anyhow::Result<()> {
    let mut env = Env::start("shadow_compare").await?;
    let (mut relay, maddr) = start(&mut env, "").await?;
    let cfg = env.config_file()?;
    let legacy: FutureProducer = reader_config(&env.bootstrap()).create()?;
    let mut c = env.sql().await?;
    let (same, differs, lost, phantom, canary) = (
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
    );
    // The same event; the legacy serializer orders keys and spaces differently (JSON-equal).
    legacy_send(
        &legacy,
        same,
        "o-1",
        "OrderPlaced",
        r#"{ "total": 10, "id": "o-1" }"#,
    )
    .await;
    write_events(
        &mut c,
        &[event(
            same,
            "o-1",
            "OrderPlaced",
            serde_json::json!({"id": "o-1", "total": 10}),
        )],
        false,
    )
    .await?;
    // The legacy path computed another total.
    legacy_send(
        &legacy,
        differs,
        "o-2",
        "OrderPlaced",
        r#"{"id":"o-2","total":99}"#,
    )
    .await;
    write_events(
        &mut c,
        &[event(
            differs,
            "o-2",
            "OrderPlaced",
            serde_json::json!({"id": "o-2", "total": 20}),
        )],
        false,
    )
    .await?;
    // Committed, but the legacy send never happened (it failed after the commit).
    write_events(
        &mut c,
        &[event(
            lost,
            "o-3",
            "OrderPlaced",
            serde_json::json!({"id": "o-3"}),
        )],
        false,
    )
    .await?;
    // Sent, then the business transaction rolled back.
    legacy_send(&legacy, phantom, "o-4", "OrderPlaced", r#"{"id":"o-4"}"#).await;
    write_events(
        &mut c,
        &[event(
            phantom,
            "o-4",
            "OrderPlaced",
            serde_json::json!({"id": "o-4"}),
        )],
        true,
    )
    .await?;
    // A canary type: delivered by outboxd for real.
    write_events(
        &mut c,
        &[event(
            canary,
            "o-5",
            "OrderShipped",
            serde_json::json!({"id": "o-5"}),
        )],
        false,
    )
    .await?;

    let report = || -> anyhow::Result<serde_json::Value> {
        let (code, out) = outboxd_cli(&["shadow", "report", "--json"], &cfg);
        anyhow::ensure!(code == 0, "{out}");
        Ok(serde_json::from_str(&out)?)
    };
    let res = eventually(Duration::from_secs(30), || async {
        let t = &report()?["event_types"];
        Ok(t["OrderPlaced"]["matched"] == 1
            && t["OrderPlaced"]["mismatched"] == 1
            && t["OrderPlaced"]["missing_legacy"] == 1
            && t["unknown"]["missing_outbox"].is_null()
            && t["OrderPlaced"]["missing_outbox"] == 1)
    })
    .await;
    assert!(
        res.is_ok(),
        "{}\n{}",
        report()?,
        read_log(&env.dir.path().join("relay.log"))
    );
    let v = report()?;
    assert_eq!(
        v["event_types"]["OrderPlaced"]["mismatched_fields"]["value"], 1,
        "{v}"
    );
    let diffs = v["latest_differences"].as_array().unwrap();
    assert!(diffs.iter().any(
        |d| d["event_id"] == differs.to_string() && d["fields"] == serde_json::json!(["value"])
    ));
    assert!(diffs
        .iter()
        .any(|d| d["event_id"] == lost.to_string() && d["result"] == "missing_legacy"));
    assert!(diffs
        .iter()
        .any(|d| d["event_id"] == phantom.to_string() && d["result"] == "missing_outbox"));
    let (_, table) = outboxd_cli(&["shadow", "report"], &cfg);
    assert!(
        table.contains("OrderPlaced") && table.contains("value (1)"),
        "{table}"
    );

    // Only the canary reached the real topic.
    env.caught_up(Duration::from_secs(30)).await?;
    let real = read_topic(
        &env.bootstrap(),
        "outbox.event.order",
        1,
        Duration::from_secs(10),
    )?;
    assert_eq!(real.len(), 1, "{real:?}");
    assert_eq!(real[0].header("event_id"), canary.to_string());
    // The outcomes are in the metrics too.
    let scrape = http_get(&maddr, "/metrics").1;
    assert!(
        scrape.contains(
            "outboxd_shadow_events_total{event_type=\"OrderPlaced\",result=\"mismatched\"} 1"
        ),
        "{scrape}"
    );
    assert!(relay.sigterm()?.success());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_prefix_shadowed_records_go_to_the_shadow_topic() -> anyhow::Result<()> {
    let mut env = Env::start("shadow_prefix").await?;
    let (mut relay, _) = start(&mut env, "shadow_topic_prefix = \"shadow.\"\n").await?;
    // `check` says loudly that nothing is delivered, and names missing legacy topics.
    let cfg = env.config_file()?;
    let (_, out) = outboxd_cli(&["check"], &cfg);
    assert!(
        out.lines().any(|l| l.starts_with("WARN")
            && l.contains("shadow mode")
            && l.contains("NOT delivered (except [\"OrderShipped\"])")),
        "{out}"
    );
    let wrong = env.dir.path().join("wrong.toml");
    std::fs::write(
        &wrong,
        std::fs::read_to_string(&cfg)?.replace("[\"legacy.orders\"]", "[\"legacy.nothere\"]"),
    )?;
    let (_, out) = outboxd_cli(&["check"], &wrong);
    assert!(
        out.lines()
            .any(|l| l.starts_with("FAIL") && l.contains("legacy.nothere")),
        "{out}"
    );
    let mut c = env.sql().await?;
    let id = Uuid::now_v7();
    write_events(
        &mut c,
        &[event(
            id,
            "o-1",
            "OrderPlaced",
            serde_json::json!({"id": "o-1"}),
        )],
        false,
    )
    .await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let shadow = read_topic(
        &env.bootstrap(),
        "shadow.outbox.event.order",
        1,
        Duration::from_secs(20),
    )?;
    assert_eq!(shadow.len(), 1);
    assert_eq!(shadow[0].header("event_id"), id.to_string());
    assert_eq!(shadow[0].key, b"o-1");
    let real = read_topic(
        &env.bootstrap(),
        "outbox.event.order",
        0,
        Duration::from_secs(3),
    )?;
    assert!(real.is_empty(), "{real:?}");
    assert!(relay.sigterm()?.success());
    Ok(())
}
