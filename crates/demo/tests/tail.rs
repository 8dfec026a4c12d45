//! `outboxd-demo tail` prints a record's topic, key, headers and value (the binary, as users
//! run it), reading by manual assignment.

use outboxd_testkit::{kafka::create_topics, Broker};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_prints_key_headers_and_value() -> anyhow::Result<()> {
    let broker = Broker::start()?;
    create_topics(&broker.bootstrap(), &["outbox.event.order"], 2).await?;
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()?;
    producer
        .send(
            FutureRecord::to("outbox.event.order")
                .key("o-1")
                .payload("{\"total\":42}")
                .headers(OwnedHeaders::new().insert(Header {
                    key: "event_type",
                    value: Some("OrderPlaced\x1b[31m"),
                })),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd-demo"))
        .args(["tail", "outbox.event.order", "-n", "1", "--bootstrap"])
        .arg(broker.bootstrap())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("outbox.event.order ["), "{stdout}");
    assert!(stdout.contains("key=o-1"), "{stdout}");
    // Control characters of a record are shown escaped, never sent to the terminal.
    assert!(
        stdout.contains("event_type=OrderPlaced\\u{1b}[31m"),
        "{stdout}"
    );
    assert!(stdout.contains("value: {\"total\":42}"), "{stdout}");
    Ok(())
}
