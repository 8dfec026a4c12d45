//! OpenTelemetry (issue 43): the relay's publish spans as an OTLP receiver built on the
//! OpenTelemetry project's generated protocol code (`opentelemetry-proto`, its tonic server)
//! receives them — parentage, the Kafka attributes, the record's `traceparent` continuing the
//! span, unsampled rows, and a receiver that is down and comes back.

use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, status::StatusCode};
use outboxd_tests::otlp::{attr, first_publish_continues, hex, http_receiver, receiver, Received};
use outboxd_tests::replay::{by_id, raw_records, replay};
use outboxd_tests::testkit::free_port;
use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

const TOPIC: &str = "outbox.event.order";

async fn insert(c: &tokio_postgres::Client, agg: &str, headers: &str) -> anyhow::Result<Uuid> {
    let id = Uuid::now_v7();
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers) \
         VALUES ($1, 'order', $2, 1, 'OrderPlaced', '{\"secret\": \"payload-must-not-leak\"}', $3::text::jsonb)",
        &[&id, &agg, &headers],
    )
    .await?;
    Ok(id)
}

fn telemetry_toml(port: u16) -> String {
    format!(
        "[telemetry]\nendpoint = \"http://127.0.0.1:{port}\"\nschedule_delay_ms = 200\n\
         timeout_ms = 1000\nheaders = \"x-api-key=otel-secret-key\"\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_rows_get_a_child_publish_span_and_the_record_continues_it() -> anyhow::Result<()> {
    let port = free_port();
    let got = Received::default();
    let _stop = receiver(port, got.clone());
    let mut env = Env::start("otel").await?;
    env.extra_toml = telemetry_toml(port);
    create_topics(&env.bootstrap(), &[TOPIC], 2).await?;
    let relay = Relay::start(env.config()?);
    let c = env.sql().await?;

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let sampled = insert(
        &c,
        "o-1",
        &format!(r#"{{"traceparent": "00-{trace}-{parent}-01", "tracestate": "vendor=x"}}"#),
    )
    .await?;
    let unsampled_tp = "00-5bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-00";
    let unsampled = insert(
        &c,
        "o-2",
        &format!(r#"{{"traceparent": "{unsampled_tp}"}}"#),
    )
    .await?;
    let bare = insert(&c, "o-3", "{}").await?;

    let recs = read_topic(&env.bootstrap(), TOPIC, 3, Duration::from_secs(30))?;
    assert_eq!(recs.len(), 3);
    let rec = |id: Uuid| {
        recs.iter()
            .find(|r| r.header("event_id") == id.to_string())
            .unwrap()
            .clone()
    };
    eventually(Duration::from_secs(20), || async {
        Ok(!got.publish_spans().is_empty())
    })
    .await?;
    // Let any stray span arrive before counting.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let spans = got.publish_spans();
    assert_eq!(
        spans.len(),
        1,
        "one span, for the sampled row only: {spans:#?}"
    );
    let s = &spans[0];
    assert_eq!(hex(&s.trace_id), trace, "the row's trace");
    assert_eq!(hex(&s.parent_span_id), parent, "child of the row's span");
    assert_eq!(s.kind, SpanKind::Producer as i32);
    assert_eq!(s.name, format!("send {TOPIC}"));
    let r = rec(sampled);
    for (k, v) in [
        ("messaging.system", "kafka".to_string()),
        ("messaging.destination.name", TOPIC.to_string()),
        (
            "messaging.destination.partition.id",
            r.partition.to_string(),
        ),
        ("messaging.kafka.offset", r.offset.to_string()),
        ("messaging.kafka.message.key", "o-1".to_string()),
        ("messaging.message.id", sampled.to_string()),
    ] {
        assert_eq!(attr(s, k).as_deref(), Some(v.as_str()), "{k}");
    }
    assert!(s.end_time_unix_nano >= s.start_time_unix_nano);
    assert_ne!(
        s.status.as_ref().map(|st| st.code),
        Some(StatusCode::Error as i32)
    );
    let dump = format!("{s:?}");
    assert!(!dump.contains("payload-must-not-leak") && !dump.contains("otel-secret-key"));
    // The record continues the publish span; tracestate travels as it was.
    assert_eq!(
        r.header("traceparent"),
        format!("00-{trace}-{}-01", hex(&s.span_id))
    );
    assert_eq!(r.header("tracestate"), "vendor=x");
    // Unsampled and bare rows: no span, headers untouched.
    assert_eq!(rec(unsampled).header("traceparent"), unsampled_tp);
    assert!(!rec(bare).headers.contains_key("traceparent"));
    // The inbox library reads the publish span's context back from the record.
    let cx = outboxd_inbox::trace_context(&rec(sampled).headers).expect("trace context");
    assert_eq!((cx.trace_id.as_str(), cx.sampled), (trace, true));
    assert_eq!(cx.parent_span_id, hex(&s.span_id));
    relay.shutdown().await?;
    Ok(())
}

/// `protocol = "http/protobuf"`: the same span (parentage, header continuation) over OTLP/HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_http_protobuf_too() -> anyhow::Result<()> {
    let port = free_port();
    let got = Received::default();
    http_receiver(port, got.clone()).await?;
    let mut env = Env::start("otel_http").await?;
    env.extra_toml = format!(
        "{}protocol = \"http/protobuf\"\nservice_name = \"relay-under-test\"\n",
        telemetry_toml(port)
    );
    create_topics(&env.bootstrap(), &[TOPIC], 1).await?;
    let relay = Relay::start(env.config()?);
    let c = env.sql().await?;
    let trace = "6bf92f3577b34da6a3ce929d0e0e4736";
    let id = insert(
        &c,
        "h-1",
        &format!(r#"{{"traceparent": "00-{trace}-20f067aa0ba902b7-01"}}"#),
    )
    .await?;
    let recs = read_topic(&env.bootstrap(), TOPIC, 1, Duration::from_secs(30))?;
    first_publish_continues(
        &got,
        trace,
        "20f067aa0ba902b7",
        &id.to_string(),
        recs[0].header("traceparent"),
    )
    .await?;
    relay.shutdown().await?;
    Ok(())
}

/// A record refused for good (too large) ends its span with error status and event
/// `outboxd.rejected`; after `outboxd parked retry` the released record gets a new span in the
/// same trace, linked to the context its parked copy carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_event_errors_and_its_release_links_back() -> anyhow::Result<()> {
    let port = free_port();
    let got = Received::default();
    let _stop = receiver(port, got.clone());
    let mut env = Env::start("otel_parked").await?;
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    env.extra_toml = telemetry_toml(port);
    create_topics(&env.bootstrap(), &[TOPIC], 1).await?;
    let relay = Relay::start(env.config()?);
    let c = env.sql().await?;
    let trace = "7bf92f3577b34da6a3ce929d0e0e4736";
    let row_span = "30f067aa0ba902b7";
    let id = Uuid::now_v7();
    let big = serde_json::json!({"blob": "x".repeat(30_000)});
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers) \
         VALUES ($1, 'order', 'p-1', 1, 'OrderPlaced', $2, $3::text::jsonb)",
        &[&id, &big, &format!(r#"{{"traceparent": "00-{trace}-{row_span}-01"}}"#)],
    )
    .await?;
    eventually(Duration::from_secs(20), || async {
        Ok(!got.publish_spans().is_empty())
    })
    .await?;
    let first = got.publish_spans()[0].clone();
    assert_eq!(hex(&first.parent_span_id), row_span);
    assert_eq!(
        first.status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32)
    );
    assert!(first.events.iter().any(|e| e.name == "outboxd.rejected"));
    assert_eq!(attr(&first, "error.type").as_deref(), Some("too_large"));
    assert!(
        !format!("{first:?}").contains("xxxxxxxxxx"),
        "payload in a span"
    );

    env.confirmed_past_now(Duration::from_secs(30)).await?;
    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"blob": "trimmed"}"#)?;
    let cfg = env.config_file()?;
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
            "trim",
        ],
        &cfg,
    );
    assert_eq!(code, 0, "{out}");
    let recs = read_topic(&env.bootstrap(), TOPIC, 1, Duration::from_secs(30))?;
    eventually(Duration::from_secs(20), || async {
        Ok(got.publish_spans().len() >= 2)
    })
    .await?;
    let release = got.publish_spans()[1].clone();
    assert_eq!(hex(&release.trace_id), trace, "the same trace");
    assert_eq!(release.links.len(), 1, "{release:?}");
    let link = &release.links[0];
    assert_eq!(hex(&link.trace_id), trace);
    // librdkafka refused the record before it left (larger than message.max.bytes), so its
    // parked copy carries the row's traceparent: the release is a child of, and links to, the
    // row's span.
    assert_eq!(hex(&link.span_id), row_span);
    assert_eq!(hex(&release.parent_span_id), row_span);
    assert!(release
        .events
        .iter()
        .any(|e| e.name == "outboxd.republished"));
    assert_eq!(
        recs[0].header("traceparent"),
        format!("00-{trace}-{}-01", hex(&release.span_id))
    );
    relay.shutdown().await?;
    Ok(())
}

/// The receiver is down: delivery goes on (every record arrives), the spans that could not be
/// exported are counted; once it is back, spans of new rows arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_never_holds_delivery_and_spans_resume() -> anyhow::Result<()> {
    let port = free_port();
    let maddr = format!("127.0.0.1:{}", free_port());
    let mut env = Env::start("otel_down").await?;
    env.extra_toml = format!(
        "{}root_sample_ratio = 1.0\n[metrics]\nlisten = \"{maddr}\"\n",
        telemetry_toml(port)
    );
    create_topics(&env.bootstrap(), &[TOPIC], 2).await?;
    let mut relay = RelayProcess::spawn(&env.config_file()?, env.dir.path().join("relay.log"))?;
    let c = env.sql().await?;
    for i in 0..50 {
        insert(&c, &format!("d-{i}"), "{}").await?;
    }
    let recs = read_topic(&env.bootstrap(), TOPIC, 50, Duration::from_secs(30))?;
    assert_eq!(recs.len(), 50, "delivery goes on without the receiver");
    assert!(recs
        .iter()
        .all(|r| r.header("traceparent").starts_with("00-")));
    let dropped = || {
        http_get(&maddr, "/metrics")
            .1
            .lines()
            .find(|l| l.starts_with("outboxd_trace_spans_dropped_total"))
            .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    eventually(Duration::from_secs(20), || async { Ok(dropped() >= 50.0) }).await?;

    let got = Received::default();
    let _stop = receiver(port, got.clone());
    let mut back = Vec::new();
    for i in 0..5 {
        back.push(insert(&c, &format!("u-{i}"), "{}").await?.to_string());
    }
    eventually(Duration::from_secs(30), || async {
        let ids: Vec<String> = got
            .spans()
            .iter()
            .filter_map(|s| attr(s, "messaging.message.id"))
            .collect();
        Ok(back.iter().all(|b| ids.contains(b)))
    })
    .await?;
    let recs = read_topic(&env.bootstrap(), TOPIC, 55, Duration::from_secs(30))?;
    assert_eq!(recs.len(), 55);
    let _ = relay.child.kill();
    let _ = relay.child.wait();
    Ok(())
}

/// Span ids derive from the event: `outboxd recover` republishing rows the stream already
/// delivered writes byte-identical records (their `traceparent` names the same publish span),
/// and `outboxd replay` starts a new span that links to the first one — for a row with its own
/// trace and for a root span alike. The relay's own work shows as `outboxd session start` and
/// `outboxd slot recovery` spans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_is_the_same_span_and_a_replay_links_to_it() -> anyhow::Result<()> {
    let port = free_port();
    let got = Received::default();
    let _stop = receiver(port, got.clone());
    let mut env = Env::start("otel_links").await?;
    env.extra_toml = format!("{}root_sample_ratio = 1.0\n", telemetry_toml(port));
    create_topics(&env.bootstrap(), &[TOPIC], 2).await?;
    let cfg = env.config_file()?;
    let c = env.sql().await?;
    let since = outboxd_tests::replay::db_now(&c).await?;
    let trace = "8bf92f3577b34da6a3ce929d0e0e4736";
    let row_span = "40f067aa0ba902b7";
    let traced = insert(
        &c,
        "l-1",
        &format!(r#"{{"traceparent": "00-{trace}-{row_span}-01"}}"#),
    )
    .await?
    .to_string();
    let root = insert(&c, "l-2", "{}").await?.to_string();
    outboxd_tests::replay::deliver_live(&env).await?;
    let first = by_id(&raw_records(&env, TOPIC, 2)?);
    let tp = |id: &str| first[id][0].header("traceparent");
    assert!(
        tp(&traced).starts_with(&format!("00-{trace}-")),
        "{}",
        tp(&traced)
    );
    assert!(tp(&root).starts_with("00-"), "a root span's header");

    // The slot is healthy; `recover --since` republishes both rows through the stream.
    let (code, out) = outboxd_cli(&["recover", "--since", &since], &cfg);
    assert_eq!(code, 0, "{out}");
    let again = by_id(&raw_records(&env, TOPIC, 4)?);
    for id in [&traced, &root] {
        assert_eq!(again[id].len(), 2, "{id}");
        assert_eq!(
            again[id][1], again[id][0],
            "{id}: the redelivered record differs"
        );
    }

    replay(
        &cfg,
        &[
            &traced,
            &root,
            "--execute",
            "--reason",
            "consumer bug",
            "--operator",
            "dora",
        ],
        true,
    );
    let after = by_id(&raw_records(&env, TOPIC, 6)?);
    eventually(Duration::from_secs(20), || async {
        let replayed = got
            .publish_spans()
            .into_iter()
            .filter(|s| s.events.iter().any(|e| e.name == "outboxd.replayed"))
            .count();
        Ok(replayed >= 2)
    })
    .await?;
    let spans = got.publish_spans();
    for id in [&traced, &root] {
        let (t, s) = {
            let h = tp(id);
            let p: Vec<&str> = h.split('-').collect();
            (p[1].to_string(), p[2].to_string())
        };
        let mine: Vec<_> = spans
            .iter()
            .filter(|x| attr(x, "messaging.message.id").as_deref() == Some(id.as_str()))
            .collect();
        let firsts: Vec<_> = mine.iter().filter(|x| hex(&x.span_id) == s).collect();
        assert!(
            !firsts.is_empty(),
            "{id}: the first publish span was exported"
        );
        let replayed = mine
            .iter()
            .find(|x| x.events.iter().any(|e| e.name == "outboxd.replayed"))
            .unwrap_or_else(|| panic!("{id}: no replay span in {mine:#?}"));
        assert_eq!(hex(&replayed.trace_id), t, "{id}: the same trace");
        assert_ne!(hex(&replayed.span_id), s, "{id}: a span of its own");
        assert_eq!(replayed.links.len(), 1, "{id}");
        assert_eq!(
            hex(&replayed.links[0].span_id),
            s,
            "{id}: links the first publish"
        );
        assert_eq!(hex(&replayed.links[0].trace_id), t);
        let rec = after[id].last().unwrap();
        assert_eq!(
            rec.header("traceparent"),
            format!("00-{t}-{}-01", hex(&replayed.span_id)),
            "{id}: the replayed record continues the replay span"
        );
    }
    let replayed_traced = spans
        .iter()
        .find(|x| {
            attr(x, "messaging.message.id").as_deref() == Some(traced.as_str())
                && x.events.iter().any(|e| e.name == "outboxd.replayed")
        })
        .unwrap();
    assert_eq!(
        hex(&replayed_traced.parent_span_id),
        row_span,
        "child of the row's span"
    );

    // The relay's own spans: its session, and the recovery `recover` ran.
    eventually(Duration::from_secs(20), || async {
        Ok(!got.named("outboxd slot recovery").is_empty())
    })
    .await?;
    let start = got.named("outboxd session start");
    assert!(!start.is_empty());
    assert_eq!(
        attr(&start[0], "outboxd.slot").as_deref(),
        Some(env.slot.as_str())
    );
    assert!(
        attr(&start[0], "outboxd.resume_lsn").is_some(),
        "{:?}",
        start[0]
    );
    let rec = &got.named("outboxd slot recovery")[0];
    assert_eq!(attr(rec, "outboxd.recovery.events").as_deref(), Some("2"));
    assert_eq!(
        attr(rec, "outboxd.slot_loss.reason").as_deref(),
        Some("manual")
    );
    Ok(())
}

/// Backlog throughput with tracing off, every row sampled, and 1 % sampled, in one run (a
/// measurement, not a check: `cargo nextest run -p outboxd-tests --test otel --run-ignored
/// only`, figures printed). Debug build of the relay process: a quick look only; the
/// release measurement in docs/benchmarks.md is `outboxd-bench otel` (crates/bench/src/otel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn bench_backlog_with_tracing_off_all_and_one_percent_sampled() -> anyhow::Result<()> {
    let n: i64 = std::env::var("OTEL_BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let mut lines = Vec::new();
    for (mode, every) in [
        ("off", 0),
        ("all sampled", 1),
        ("1 % sampled", 100),
        ("off", 0),
    ] {
        let port = free_port();
        let got = Received::default();
        let _stop = receiver(port, got.clone());
        let mut env = Env::start("otel_bench").await?;
        if every > 0 {
            env.extra_toml = telemetry_toml(port);
        }
        create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
        let c = env.sql().await?;
        // Every row carries a traceparent; `every` says which are sampled (0: all, unexported).
        let sampled = if every == 0 { 1 } else { every };
        c.execute(
            "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers) \
             SELECT gen_random_uuid(), 'order', 'b-' || i, 1, 'OrderPlaced', '{\"n\": 1}', \
                    jsonb_build_object('traceparent', '00-' || md5(i::text) || '-' || substr(md5('s' || i), 1, 16) \
                                       || CASE WHEN i % $2 = 0 THEN '-01' ELSE '-00' END) \
             FROM generate_series(1, $1::bigint) i",
            &[&n, &(sampled as i64)],
        )
        .await?;
        let t0 = std::time::Instant::now();
        let mut relay = RelayProcess::spawn(&env.config_file()?, env.dir.path().join("relay.log"))?;
        env.confirmed_past_now(Duration::from_secs(300)).await?;
        let secs = t0.elapsed().as_secs_f64();
        let _ = relay.child.kill();
        let _ = relay.child.wait();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let line = format!(
            "{mode}: {n} events in {secs:.2} s = {:.0} events/s, {} spans received",
            n as f64 / secs,
            got.publish_spans().len()
        );
        eprintln!("{line}");
        lines.push(line);
    }
    println!("{}", lines.join("\n"));
    Ok(())
}

/// Issue 53: the documented precedence holds for headers too. The file's `headers` win over
/// `OTEL_EXPORTER_OTLP_HEADERS` in the relay's environment (the SDK used to add those on top,
/// overriding the file's value), on both protocols; headers to a plain `http://` endpoint are
/// warned about once at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_headers_win_over_otel_env_on_both_protocols() -> anyhow::Result<()> {
    let env = Env::start("otel_prec").await?;
    for protocol in ["grpc", "http/protobuf"] {
        let port = free_port();
        let got = Received::default();
        let _stop = if protocol == "grpc" {
            Some(receiver(port, got.clone()))
        } else {
            http_receiver(port, got.clone()).await?;
            None
        };
        let config = env.dir.path().join("otel_prec.toml");
        std::fs::write(
            &config,
            format!(
                "{}\n[telemetry]\nendpoint = \"http://127.0.0.1:{port}\"\nprotocol = \"{protocol}\"\n\
                 schedule_delay_ms = 200\nroot_sample_ratio = 1.0\nheaders = \"x-api-key=from-file\"\n",
                env.toml()
            ),
        )?;
        let log = env.dir.path().join(format!("relay-{port}.log"));
        let mut relay = RelayProcess::spawn_with_env(
            &config,
            log.clone(),
            &[
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    "x-api-key=from-env,x-env-only=1",
                ),
                (
                    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                    "x-api-key=from-env-traces",
                ),
            ],
        )?;
        let c = env.sql().await?;
        insert(&c, &format!("prec-{port}"), "{}").await?;
        let waited = eventually(Duration::from_secs(30), || async {
            Ok(!got.x_headers().is_empty())
        })
        .await;
        relay.sigkill();
        let text = reliability::read_log(&log);
        waited.map_err(|e| anyhow::anyhow!("{protocol}: no export: {e}\n{text}"))?;
        let headers = got.x_headers();
        assert!(
            headers
                .iter()
                .all(|h| h == &("x-api-key".into(), "from-file".into())),
            "{protocol}: {headers:?}"
        );
        assert_eq!(
            text.matches("plain-text http:// endpoint").count(),
            1,
            "{protocol}: warned once\n{text}"
        );
        assert!(!text.contains("from-file"), "{protocol}: {text}");
    }
    Ok(())
}
