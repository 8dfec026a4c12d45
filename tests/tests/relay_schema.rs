//! Schema handling and instances: the Debezium preset reads Debezium's table unchanged (with zstd
//! compression); a column added mid-stream is harmless; a required column dropped mid-stream stops
//! the relay with a clear error and nothing past it is confirmed; a second instance on the same
//! slot stands by instead of crash-looping and takes over when the first stops; with the preset,
//! columns placed in headers and NULL aggregate ids survive parking and an operator's release.

use outboxd_tests::*;
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debezium_preset_reads_a_debezium_table_unchanged() -> anyhow::Result<()> {
    let mut env = Env::start("debezium").await?;
    let c = env.sql().await?;
    c.batch_execute(
        "CREATE TABLE public.dbz_outbox (id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL, \
         aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb); \
         CREATE PUBLICATION dbz_pub FOR TABLE public.dbz_outbox WITH (publish = 'insert');",
    )
    .await?;
    env.extra_toml = "".into();
    let toml = env
        .toml()
        .replace("[source]\n", "[source]\ntable = \"public.dbz_outbox\"\npublication = \"dbz_pub\"\n")
        .replace("[sink.kafka]\n", "[source.columns]\npreset = \"debezium\"\n[sink.kafka]\n\"compression.type\" = \"zstd\"\n");
    let cfg = outboxd::Config::from_toml_and_env(&toml, Vec::<(String, String)>::new())?;
    let relay = Relay::start(cfg);
    let id = Uuid::now_v7();
    c.execute(
        "INSERT INTO dbz_outbox VALUES ($1, 'customer', 'c-9', 'CustomerCreated', '{\"name\": \"x\"}')",
        &[&id],
    )
    .await?;
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.customer",
        1,
        Duration::from_secs(30),
    )?;
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].key, b"c-9");
    assert_eq!(recs[0].header("event_id"), id.to_string());
    // Debezium's consumers deduplicate on header `id` (issue 16): sent as well.
    assert_eq!(recs[0].header("id"), id.to_string());
    assert_eq!(recs[0].header("event_type"), "CustomerCreated");
    assert_eq!(recs[0].value, b"{\"name\": \"x\"}");
    assert!(!recs[0].headers.contains_key("aggregate_version"));
    // A NULL payload is what Debezium users write to delete an aggregate's state: a record
    // with a null value (a tombstone), and the aggregate's next event is not held behind it.
    let (gone, next) = (Uuid::now_v7(), Uuid::now_v7());
    c.execute(
        "INSERT INTO dbz_outbox VALUES ($1, 'customer', 'c-9', 'CustomerDeleted', NULL)",
        &[&gone],
    )
    .await?;
    c.execute(
        "INSERT INTO dbz_outbox VALUES ($1, 'customer', 'c-9', 'CustomerCreated', '{}')",
        &[&next],
    )
    .await?;
    let mut tomb = None;
    let n = scan_topic(
        &env.bootstrap(),
        "outbox.event.customer",
        3,
        Duration::from_secs(30),
        |m| {
            use rdkafka::message::{Headers, Message};
            let id = m
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "id"))
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned());
            if id.as_deref() == Some(gone.to_string().as_str()) {
                tomb = Some((m.payload().is_none(), m.key().map(<[u8]>::to_vec)));
            }
        },
    )?;
    assert_eq!(n, 3);
    assert_eq!(
        tomb,
        Some((true, Some(b"c-9".to_vec()))),
        "a tombstone keyed by the aggregate"
    );
    let parked: i64 = c
        .query_one("SELECT count(*) FROM outbox_parked", &[])
        .await?
        .get(0);
    assert_eq!(parked, 0);
    relay.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relation_changes_mid_stream() -> anyhow::Result<()> {
    let env = Env::start("relchange").await?;
    let relay = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let ev = |agg: &str, v: i64| NewEvent {
        event_id: Uuid::now_v7(),
        aggregate_type: "item".into(),
        aggregate_id: agg.into(),
        version: v,
        event_type: "ItemChanged".into(),
        payload: serde_json::json!({"v": v}),
    };
    write_events(&mut c, &[ev("i-1", 1)], false).await?;
    // An added column: harmless, the mapping is re-resolved.
    c.batch_execute("ALTER TABLE outbox ADD COLUMN tenant text DEFAULT 'acme'")
        .await?;
    write_events(&mut c, &[ev("i-1", 2)], false).await?;
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.item",
        2,
        Duration::from_secs(30),
    )?;
    assert_eq!(recs.len(), 2);
    eventually(Duration::from_secs(10), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await?;

    // A required column disappears: the relay stops, naming it, and confirms nothing past it.
    c.batch_execute("ALTER TABLE outbox RENAME COLUMN aggregate_id TO agg")
        .await?;
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, agg, aggregate_version, event_type, payload) \
         VALUES ($1, 'item', 'i-1', 3, 'ItemChanged', '{}')",
        &[&Uuid::now_v7()],
    )
    .await?;
    let err = tokio::time::timeout(Duration::from_secs(30), relay.join())
        .await?
        .expect_err("relay must stop on a missing required column");
    let msg = err.to_string();
    assert!(
        msg.contains("aggregate_id") && msg.contains("source.columns"),
        "{msg}"
    );
    assert!(!err.is_transient());
    // Nothing past the unreadable row was confirmed: a relay mapping the renamed column
    // delivers it. (The slot may have confirmed a position inside that row's transaction — a
    // heartbeat or keepalive decoded before its commit — from where the transaction is still
    // streamed whole, so a bound on the LSN would be too strict.)
    let renamed = outboxd::Config::from_toml_and_env(
        &format!("{}\n[source.columns]\naggregate_id = \"agg\"\n", env.toml()),
        Vec::<(String, String)>::new(),
    )?;
    let relay = Relay::start(renamed);
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.item",
        3,
        Duration::from_secs(30),
    )?;
    let versions: Vec<&str> = recs.iter().map(|r| r.header("aggregate_version")).collect();
    assert!(
        versions.contains(&"3"),
        "confirmed past the unreadable row: {versions:?}"
    );
    relay.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_instance_stands_by_then_takes_over() -> anyhow::Result<()> {
    let env = Env::start("standby").await?;
    let a = Relay::start(env.config()?);
    let mut c = env.sql().await?;
    let ev = |v: i64| NewEvent {
        event_id: Uuid::now_v7(),
        aggregate_type: "ha".into(),
        aggregate_id: "x".into(),
        version: v,
        event_type: "Tick".into(),
        payload: serde_json::json!({"v": v}),
    };
    write_events(&mut c, &[ev(1)], false).await?;
    eventually(Duration::from_secs(20), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await?;
    // The slot is busy: the second instance must neither crash nor steal it.
    let b = Relay::start(env.config()?);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!b.is_finished(), "standby instance exited");
    write_events(&mut c, &[ev(2)], false).await?;
    a.shutdown().await?;
    // The standby takes over and delivers what comes next.
    write_events(&mut c, &[ev(3)], false).await?;
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.ha",
        3,
        Duration::from_secs(30),
    )?;
    let versions: std::collections::BTreeSet<String> = recs
        .iter()
        .map(|r| r.header("aggregate_version").to_string())
        .collect();
    assert_eq!(versions.into_iter().collect::<Vec<_>>(), ["1", "2", "3"]);
    eventually(Duration::from_secs(20), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await?;
    b.shutdown().await?;
    Ok(())
}

/// One record as read: key, value and headers (`None`: no bytes), by the `id` header.
type Seen = (
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Vec<(String, Option<Vec<u8>>)>,
);

fn seen_by_id(bootstrap: &str, topic: &str, min: usize) -> anyhow::Result<HashMap<String, Seen>> {
    use rdkafka::message::{Headers, Message};
    let mut by_id = HashMap::new();
    scan_topic(bootstrap, topic, min, Duration::from_secs(30), |m| {
        let headers: Vec<(String, Option<Vec<u8>>)> = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        let id = headers
            .iter()
            .find(|(k, _)| k == "id")
            .and_then(|(_, v)| v.clone())
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default();
        by_id.insert(
            id,
            (
                m.key().map(<[u8]>::to_vec),
                m.payload().map(<[u8]>::to_vec),
                headers,
            ),
        );
    })?;
    Ok(by_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_headers_and_null_keys_survive_parking_and_release() -> anyhow::Result<()> {
    // Debezium's table plus a tenant column placed in a header (issue 16), a broker that
    // refuses big records: parked events are republished as the live path sends them.
    let mut env = Env::start("dbz_release").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    let c = env.sql().await?;
    c.batch_execute(
        "CREATE TABLE public.outboxevent (id uuid PRIMARY KEY, aggregatetype text, \
         aggregateid text, type text, payload jsonb, tenant_id text); \
         CREATE PUBLICATION dbz_pub FOR TABLE public.outboxevent WITH (publish = 'insert');",
    )
    .await?;
    let toml = env
        .toml()
        .replace("[source]\n", "[source]\ntable = \"public.outboxevent\"\npublication = \"dbz_pub\"\n")
        .replace(
            "[sink.kafka]\n",
            "[source.columns]\npreset = \"debezium\"\nadditional = \"tenant_id:header, type:header:eventType\"\n[sink.kafka]\n",
        );
    let cfg_file = env.dir.path().join("dbz.toml");
    std::fs::write(&cfg_file, &toml)?;
    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &toml,
        Vec::<(String, String)>::new(),
    )?);
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(30_000));
    let (a1, a2, keyless) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    // Too big, a NULL tenant; the aggregate's next event waits behind it.
    c.execute(
        "INSERT INTO outboxevent VALUES ($1, 'customer', 'c-1', 'Created', $2::text::jsonb, NULL)",
        &[&a1, &big],
    )
    .await?;
    c.execute(
        "INSERT INTO outboxevent VALUES ($1, 'customer', 'c-1', NULL, '{\"n\": 2}', 't-2')",
        &[&a2],
    )
    .await?;
    // Too big and without aggregate id: parked, holding nothing.
    c.execute(
        "INSERT INTO outboxevent VALUES ($1, 'customer', NULL, 'Created', $2::text::jsonb, 't-3')",
        &[&keyless, &big],
    )
    .await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let states: Vec<(String, String, bool)> = c
        .query(
            "SELECT event_id, state, blocks_aggregate FROM outbox_parked ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        states,
        [
            (a1.to_string(), "parked".into(), true),
            (a2.to_string(), "blocked".into(), true),
            (keyless.to_string(), "parked".into(), false),
        ]
    );
    // Parked as it would have been sent: the NULL tenant as a header without value.
    let stored: serde_json::Value = c
        .query_one(
            "SELECT headers FROM outbox_parked WHERE event_id = $1",
            &[&a1.to_string()],
        )
        .await?
        .get(0);
    assert!(
        stored
            .as_array()
            .unwrap()
            .contains(&serde_json::json!(["tenant_id", null])),
        "{stored}"
    );

    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"blob": "trimmed"}"#)?;
    for id in [a1, keyless] {
        let (code, out) = outboxd_cli(
            &[
                "parked",
                "retry",
                &id.to_string(),
                "--payload",
                fixed.to_str().unwrap(),
                "--operator",
                "alice",
                "--reason",
                "trim blob",
            ],
            &cfg_file,
        );
        assert_eq!(code, 0, "{out}");
    }
    let recs = seen_by_id(&env.bootstrap(), "outbox.event.customer", 3)?;
    let h = |id: &Uuid| {
        let (key, _, headers) = &recs[&id.to_string()];
        let placed: Vec<(&str, Option<&[u8]>)> = headers
            .iter()
            .filter(|(k, _)| ["id", "tenant_id", "eventType"].contains(&k.as_str()))
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect();
        (key.as_deref(), placed)
    };
    let id = |u: &Uuid| u.to_string().into_bytes();
    let (a1_id, a2_id, k_id) = (id(&a1), id(&a2), id(&keyless));
    assert_eq!(
        h(&a1),
        (
            Some(&b"c-1"[..]),
            vec![
                ("id", Some(&a1_id[..])),
                ("tenant_id", None),
                ("eventType", Some(&b"Created"[..]))
            ]
        )
    );
    assert_eq!(
        h(&a2),
        (
            Some(&b"c-1"[..]),
            vec![
                ("id", Some(&a2_id[..])),
                ("tenant_id", Some(&b"t-2"[..])),
                ("eventType", None)
            ]
        )
    );
    assert_eq!(
        h(&keyless),
        (
            None,
            vec![
                ("id", Some(&k_id[..])),
                ("tenant_id", Some(&b"t-3"[..])),
                ("eventType", Some(&b"Created"[..]))
            ]
        )
    );
    // No schema_version header appears on release when the table has no such column.
    let (_, _, headers) = &recs[&a1.to_string()];
    assert!(
        !headers.iter().any(|(k, _)| k == "schema_version"),
        "{headers:?}"
    );
    relay.shutdown().await?;
    Ok(())
}
