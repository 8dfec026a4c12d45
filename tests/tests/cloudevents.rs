//! Issue 42: `[sink] format = "cloudevents"`. In both content modes of the CloudEvents Kafka
//! binding, a relay process is SIGKILLed at random moments under load and restarted; then
//! every record on the topic is decoded by the CloudEvents Python SDK (PyPI `cloudevents`
//! 2.2.0, `cloudevents.v1.kafka`, via `tests/python/cloudevents_check.py`; installed by
//! `scripts/deps.sh`) and compared with its row: id, type, source, subject, time (to the
//! microsecond), data, partitionkey = key = aggregate_id, the trace context and the aggregate
//! version. No committed event is missing, no rolled-back one is there, duplicates are
//! byte-identical.

use outboxd_tests::*;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;
use uuid::Uuid;

/// The row as the test wrote it (and as Postgres stored it).
struct Row {
    aggregate_id: String,
    version: i64,
    payload: serde_json::Value,
    traceparent: String,
    created_us: i64,
}

fn checker() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/cloudevents_check.py")
}

/// Is the SDK importable? Only then can the records be decoded by it.
fn sdk_present() -> bool {
    Command::new("python3")
        .args(["-c", "import cloudevents.v1.kafka"])
        .status()
        .is_ok_and(|s| s.success())
}

/// Hands the records to the SDK; one decoded event per record, in order.
fn decode(mode: &str, recs: &[Record]) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut child = Command::new("python3")
        .arg(checker())
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut input = String::new();
    for r in recs {
        let line = serde_json::json!({
            "key": String::from_utf8(r.key.clone())?,
            "value": String::from_utf8(r.value.clone())?,
            "headers": r.headers.iter().map(|(k, v)| vec![k.clone(), v.clone()]).collect::<Vec<_>>(),
        });
        input.push_str(&line.to_string());
        input.push('\n');
    }
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output()?;
    writer.join().expect("writer")?;
    anyhow::ensure!(
        out.status.success(),
        "the CloudEvents SDK refused a record: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)?
        .lines()
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect()
}

async fn sigkill_under_load(mode: &str) -> anyhow::Result<()> {
    if !sdk_present() {
        eprintln!(
            "SKIPPED: python3 cannot import cloudevents.v1.kafka (PyPI cloudevents==2.2.0); \
             run scripts/deps.sh"
        );
        return Ok(());
    }
    let mut env = Env::start(&format!("ce_{mode}")).await?;
    env.extra_toml = format!(
        "[sink]\nformat = \"cloudevents\"\n[sink.cloudevents]\nmode = \"{mode}\"\n\
         type = \"com.acme.{{aggregate_type}}.{{event_type}}\"\n"
    );
    let topic = "outbox.event.cart";
    create_topics(&env.bootstrap(), &[topic], 3).await?;
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");

    let c = env.sql().await?;
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let writer = tokio::spawn(async move {
        let mut c = c;
        let mut rng = rand::rngs::StdRng::from_entropy();
        let mut committed = HashSet::new();
        let mut rolled_back = HashSet::new();
        let mut version: HashMap<String, i64> = HashMap::new();
        while !*stop_rx.borrow_and_update() {
            let rollback = rng.gen_bool(0.15);
            let tx = c.transaction().await?;
            let mut ids = Vec::new();
            for _ in 0..rng.gen_range(1..20) {
                let agg = format!("cart-{}", rng.gen_range(0..40));
                let v = version.entry(agg.clone()).or_insert(0);
                *v += 1;
                let id = Uuid::now_v7();
                let payload = serde_json::json!({"sku": rng.gen_range(0..1_000_000), "note": "ü \"q\"", "pad": "x".repeat(rng.gen_range(0..300))});
                let headers = serde_json::json!({
                    "traceparent": format!("00-{:032x}-{:016x}-01", rng.gen::<u128>(), rng.gen::<u64>()),
                    "tenant_id": "t-1",
                });
                tx.execute(
                    "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                     event_type, payload, headers, created_at) \
                     VALUES ($1, 'cart', $2, $3, 'ItemAdded', $4, $5, clock_timestamp())",
                    &[&id, &agg, &*v, &payload, &headers],
                )
                .await?;
                ids.push(id.to_string());
            }
            if rollback {
                tx.rollback().await?;
                rolled_back.extend(ids);
            } else {
                tx.commit().await?;
                committed.extend(ids);
            }
            tokio::time::sleep(Duration::from_millis(rng.gen_range(0..5))).await;
        }
        anyhow::Ok((committed, rolled_back))
    });

    let mut rng = rand::thread_rng();
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..1500))).await;
        relay.sigkill();
        relay = RelayProcess::spawn(&config, log.clone())?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_tx.send(true)?;
    let (committed, rolled_back) = writer.await??;
    eventually(Duration::from_secs(60), || async {
        Ok(env.confirmed_lsn().await? >= env.current_lsn().await?)
    })
    .await?;
    let status = relay.sigterm()?;
    assert!(status.success(), "graceful shutdown exit status {status}");

    // The rows as stored.
    let c = env.sql().await?;
    let mut rows: HashMap<String, Row> = HashMap::new();
    for r in c
        .query(
            "SELECT event_id::text, aggregate_id, aggregate_version, payload, headers->>'traceparent', \
             (extract(epoch from created_at) * 1000000)::bigint FROM outbox",
            &[],
        )
        .await?
    {
        rows.insert(
            r.get(0),
            Row {
                aggregate_id: r.get(1),
                version: r.get(2),
                payload: r.get(3),
                traceparent: r.get(4),
                created_us: r.get(5),
            },
        );
    }
    assert_eq!(rows.len(), committed.len());

    let recs = read_topic(
        &env.bootstrap(),
        topic,
        committed.len(),
        Duration::from_secs(120),
    )?;
    let decoded = decode(mode, &recs)?;
    assert_eq!(decoded.len(), recs.len());
    let source = format!("/outboxd/{}/public/outbox", env.db);
    let mut first: HashMap<String, (Vec<u8>, Vec<u8>, String)> = HashMap::new();
    let mut dups = 0;
    for (rec, ev) in recs.iter().zip(&decoded) {
        let a = &ev["attributes"];
        let s = |k: &str| a[k].as_str().unwrap_or_default().to_string();
        let id = s("id");
        assert!(
            !rolled_back.contains(&id),
            "rolled-back event {id} delivered"
        );
        let row = rows
            .get(&id)
            .unwrap_or_else(|| panic!("unknown event {id} on the topic"));
        let key = String::from_utf8(rec.key.clone())?;
        assert_eq!(s("specversion"), "1.0", "{id}");
        assert_eq!(s("type"), "com.acme.cart.ItemAdded", "{id}");
        assert_eq!(s("source"), source, "{id}");
        assert_eq!(s("subject"), row.aggregate_id, "{id}");
        assert_eq!(key, row.aggregate_id, "{id}: key");
        assert_eq!(s("partitionkey"), key, "{id}: partitionkey");
        assert_eq!(
            ev["time_us"].as_i64(),
            Some(row.created_us),
            "{id}: time {}",
            s("time")
        );
        assert_eq!(ev["data"], row.payload, "{id}: data");
        assert_eq!(s("traceparent"), row.traceparent, "{id}");
        assert_eq!(s("aggregateversion"), row.version.to_string(), "{id}");
        assert_eq!(s("aggregatetype"), "cart", "{id}");
        if mode == "binary" {
            // The SDK maps `content-type` to datacontenttype (in structured mode it also
            // overwrites the envelope's with the binding's own `application/cloudevents+json`).
            assert_eq!(s("datacontenttype"), "application/json", "{id}");
            assert_eq!(
                rec.header("tenant_id"),
                "t-1",
                "{id}: other row headers stay headers"
            );
            assert_eq!(
                rec.header("event_id"),
                "",
                "no outbox-format headers in a CloudEvent"
            );
        } else {
            assert!(rec
                .header("content-type")
                .starts_with("application/cloudevents+json"));
            let env: serde_json::Value = serde_json::from_slice(&rec.value)?;
            assert_eq!(env["datacontenttype"], "application/json");
            assert_eq!(env["data"], row.payload);
        }
        let fields = (
            rec.key.clone(),
            rec.value.clone(),
            format!("{:?}", rec.headers),
        );
        match first.get(&id) {
            Some(prev) => {
                dups += 1;
                assert_eq!(
                    *prev, fields,
                    "a duplicate of {id} differs from the first copy"
                );
            }
            None => {
                first.insert(id, fields);
            }
        }
    }
    let missing: Vec<&String> = committed
        .iter()
        .filter(|k| !first.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty(),
        "{} committed events missing, e.g. {:?}",
        missing.len(),
        missing.first()
    );
    eprintln!(
        "{mode}: {} committed, {} records, {dups} duplicates, every record decoded by the SDK",
        committed.len(),
        recs.len()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_mode_survives_sigkill_and_decodes_with_the_sdk() -> anyhow::Result<()> {
    sigkill_under_load("binary").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_mode_survives_sigkill_and_decodes_with_the_sdk() -> anyhow::Result<()> {
    sigkill_under_load("structured").await
}

/// Bad names and templates stop the relay at startup with the setting named.
#[test]
fn bad_cloudevents_settings_are_refused_at_startup() {
    let base = |extra: &str| {
        format!(
            "[source]\ndsn = \"postgres://u@127.0.0.1/app\"\n[sink.kafka]\n\
             \"bootstrap.servers\" = \"127.0.0.1:9092\"\n{extra}"
        )
    };
    let load = |extra: &str| {
        outboxd::Config::from_toml_and_env(&base(extra), Vec::<(String, String)>::new())
    };
    assert!(load("[sink]\nformat = \"cloudevents\"\n").is_ok());
    let err = |extra: &str| load(extra).unwrap_err().to_string();
    let e = err("[sink]\nformat = \"cloudevents\"\n[sink.cloudevents]\ntype = \"x.{aggregate}\"\n");
    assert!(
        e.contains("sink.cloudevents.type") && e.contains("{aggregate}"),
        "{e}"
    );
    let e = err("[sink]\nformat = \"cloudevents\"\n[sink.cloudevents]\nsource = \"/a b\"\n");
    assert!(e.contains("URI-reference"), "{e}");
    let e = err("[sink]\nformat = \"cloudevent\"\n");
    assert!(e.contains("expected `outbox` or `cloudevents`"), "{e}");
    let e = err("[sink.cloudevents]\nmode = \"binery\"\n");
    assert!(e.contains("mode") || e.contains("binery"), "{e}");
}

/// A replayed event is the identical CloudEvent (key, value, headers in order), in both
/// modes: `outboxd replay` reads the row from the table and routes it through the same router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_event_is_the_identical_cloudevent() -> anyhow::Result<()> {
    use outboxd_tests::replay::{deliver_live, events, raw_records, replay, Raw};
    for mode in ["binary", "structured"] {
        let mut env = Env::start(&format!("ce_rp_{mode}")).await?;
        env.extra_toml =
            format!("[sink]\nformat = \"cloudevents\"\n[sink.cloudevents]\nmode = \"{mode}\"\n");
        let topic = "outbox.event.acct";
        create_topics(&env.bootstrap(), &[topic], 3).await?;
        let cfg = env.config_file()?;
        let mut c = env.sql().await?;
        let evs = events("acct", "a-1", 4, "Deposited");
        write_events(&mut c, &evs, false).await?;
        deliver_live(&env).await?;
        let id_of = |r: &Raw| -> String {
            match mode {
                "binary" => r.header("ce_id"),
                _ => serde_json::from_slice::<serde_json::Value>(&r.value).unwrap()["id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            }
        };
        let live = raw_records(&env, topic, 4)?;
        assert_eq!(live.len(), 4, "{mode}");
        let picked = [evs[1].event_id.to_string(), evs[2].event_id.to_string()];
        let out = replay(
            &cfg,
            &[&picked[0], &picked[1], "--execute", "--reason", "ce"],
            true,
        );
        assert!(out.contains("2 event(s) sent"), "{mode}: {out}");
        let after = raw_records(&env, topic, 6)?;
        assert_eq!(after.len(), 6, "{mode}");
        for id in &picked {
            let copies: Vec<&Raw> = after.iter().filter(|r| id_of(r) == *id).collect();
            let first = live.iter().find(|r| id_of(r) == *id).expect("live record");
            assert_eq!(copies.len(), 2, "{mode} {id}");
            assert_eq!(copies[0], first, "{mode} {id}");
            assert_eq!(
                (&copies[1].key, &copies[1].value, &copies[1].headers),
                (&first.key, &first.value, &first.headers),
                "{mode} {id}: the replayed CloudEvent differs"
            );
        }
    }
    Ok(())
}

/// Parking and release: an oversized CloudEvent is parked, its follower held; after the
/// operator's repair both are released as CloudEvents that decode with the SDK and match their
/// rows (the time to the microsecond: a parked CloudEvent keeps its raw `created_at`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_event_is_a_cloudevent_matching_its_row() -> anyhow::Result<()> {
    if !sdk_present() {
        eprintln!("SKIPPED: python3 cannot import cloudevents.v1.kafka; run scripts/deps.sh");
        return Ok(());
    }
    for mode in ["binary", "structured"] {
        let mut env = Env::start(&format!("ce_park_{mode}")).await?;
        env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
        env.extra_toml =
            format!("[sink]\nformat = \"cloudevents\"\n[sink.cloudevents]\nmode = \"{mode}\"\n");
        let topic = "outbox.event.acct";
        create_topics(&env.bootstrap(), &[topic], 2).await?;
        let relay = Relay::start(env.config()?);
        let mut c = env.sql().await?;
        let big = NewEvent::new(
            "acct",
            "A",
            1,
            "Deposited",
            serde_json::json!({"blob": "x".repeat(30_000)}),
        );
        let next = NewEvent::new("acct", "A", 2, "Deposited", serde_json::json!({"n": 2}));
        write_events(&mut c, std::slice::from_ref(&big), false).await?;
        write_events(&mut c, std::slice::from_ref(&next), false).await?;
        eventually(Duration::from_secs(30), || async {
            let n: i64 = c
                .query_one("SELECT count(*) FROM outbox_parked", &[])
                .await?
                .get(0);
            Ok(n == 2)
        })
        .await?;
        let cfg = env.config_file()?;
        let fixed = env.dir.path().join("fixed.json");
        std::fs::write(&fixed, r#"{"blob": "trimmed"}"#)?;
        let id = big.event_id.to_string();
        let (code, out) = outboxd_cli(
            &[
                "parked",
                "retry",
                &id,
                "--payload",
                fixed.to_str().unwrap(),
                "--operator",
                "o",
                "--reason",
                "trim",
            ],
            &cfg,
        );
        assert_eq!(code, 0, "{mode}: {out}");
        let recs = read_topic(&env.bootstrap(), topic, 2, Duration::from_secs(30))?;
        relay.shutdown().await?;
        let decoded = decode(mode, &recs)?;
        assert_eq!(decoded.len(), 2, "{mode}: {recs:?}");
        for (ev, want) in decoded.iter().zip([&big, &next]) {
            let a = &ev["attributes"];
            let row = c
                .query_one(
                    "SELECT (extract(epoch from created_at) * 1000000)::bigint FROM outbox WHERE event_id = $1",
                    &[&want.event_id],
                )
                .await?;
            assert_eq!(
                a["id"],
                want.event_id.to_string(),
                "{mode}: released in order"
            );
            assert_eq!(a["type"], "Deposited");
            assert_eq!(a["subject"], "A");
            assert_eq!(a["partitionkey"], "A");
            assert_eq!(a["aggregateversion"], want.version.to_string());
            assert_eq!(ev["time_us"].as_i64(), Some(row.get::<_, i64>(0)), "{mode}");
        }
        assert_eq!(decoded[0]["data"], serde_json::json!({"blob": "trimmed"}));
        assert_eq!(decoded[1]["data"], next.payload);
        assert!(
            recs.iter()
                .all(|r| r.header("outboxd_ce_created_at").is_empty()),
            "{mode}: the parked-copy header leaked"
        );
    }
    Ok(())
}

/// Issue 55: a row's `ce_phase` header arrives as the extension `phase`, decoded by the
/// CloudEvents SDK, in both modes; only a header that would set an attribute outboxd sets
/// (`ce_type`) or is no CloudEvents name (`ce_Phase`) is parked, the reason naming the
/// attribute or the rule, and the other aggregates' events flow on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ce_row_header_arrives_as_an_extension() -> anyhow::Result<()> {
    if !sdk_present() {
        eprintln!("SKIPPED: python3 cannot import cloudevents.v1.kafka; run scripts/deps.sh");
        return Ok(());
    }
    for mode in ["binary", "structured"] {
        let mut env = Env::start(&format!("ce_ext_{mode}")).await?;
        env.extra_toml =
            format!("[sink]\nformat = \"cloudevents\"\n[sink.cloudevents]\nmode = \"{mode}\"\n");
        let topic = "outbox.event.job";
        create_topics(&env.bootstrap(), &[topic], 2).await?;
        let relay = Relay::start(env.config()?);
        let c = env.sql().await?;
        let rows = [
            (
                "j-1",
                serde_json::json!({"ce_phase": "beta", "tenant_id": "t-1"}),
            ),
            ("j-2", serde_json::json!({"ce_type": "Forged"})),
            ("j-3", serde_json::json!({"ce_Phase": "beta"})),
            ("j-4", serde_json::json!({"ce_phase": "ga"})),
        ];
        let mut ids = vec![];
        for (agg, headers) in &rows {
            let id = Uuid::now_v7();
            c.execute(
                "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                 event_type, payload, headers) VALUES ($1, 'job', $2, 1, 'Started', '{\"n\": 1}', $3)",
                &[&id, agg, headers],
            )
            .await?;
            ids.push(id);
        }
        let recs = read_topic(&env.bootstrap(), topic, 2, Duration::from_secs(30))?;
        eventually(Duration::from_secs(30), || async {
            let n: i64 = c
                .query_one("SELECT count(*) FROM outbox_parked", &[])
                .await?
                .get(0);
            Ok(n == 2)
        })
        .await?;
        let parked = c
            .query(
                "SELECT event_id::uuid, error_class, error_message FROM outbox_parked ORDER BY id",
                &[],
            )
            .await?;
        relay.shutdown().await?;
        let decoded = decode(mode, &recs)?;
        let mut phases: Vec<(String, String)> = decoded
            .iter()
            .map(|ev| {
                let a = &ev["attributes"];
                (
                    a["subject"].as_str().unwrap_or_default().to_string(),
                    a["phase"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        phases.sort();
        assert_eq!(
            phases,
            [("j-1".into(), "beta".into()), ("j-4".into(), "ga".into())],
            "{mode}"
        );
        for r in &recs {
            let ext_header = r.header("ce_phase");
            if mode == "binary" {
                assert!(!ext_header.is_empty(), "binary: the ce_phase header");
            } else {
                assert!(
                    ext_header.is_empty(),
                    "structured: in the envelope, not a header"
                );
                let v: serde_json::Value = serde_json::from_slice(&r.value)?;
                assert!(v["phase"].is_string(), "{v}");
            }
        }
        let parked: Vec<(Uuid, String, String)> = parked
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        assert_eq!(parked.len(), 2, "{mode}: {parked:?}");
        assert_eq!(
            (parked[0].0, parked[0].1.as_str()),
            (ids[1], "reserved_header")
        );
        assert!(
            parked[0].2.contains("attribute `type`"),
            "{mode}: {}",
            parked[0].2
        );
        assert_eq!(
            (parked[1].0, parked[1].1.as_str()),
            (ids[2], "invalid_event")
        );
        assert!(
            parked[1].2.contains("`ce_Phase`") && parked[1].2.contains("lower-case"),
            "{mode}: {}",
            parked[1].2
        );
    }
    Ok(())
}
