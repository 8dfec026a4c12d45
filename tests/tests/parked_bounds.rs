//! Issue 53, "oversized `outbox_parked` values": rows written with the relay's credential
//! (sql/roles.sql) whose `error_message` or payload is hundreds of MB (a few MB once Postgres
//! compressed them) must not be loaded by the relay — not for the status page, not for a
//! release — nor fill `[parked] max_open_bytes`: the relay reads lengths, refuses a row
//! larger than it ever writes without reading it, and goes on delivering.

use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

const ACCT: &str = "outbox.event.acct";
const MB: i64 = 1 << 20;

async fn connect(dsn: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (c, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(c)
}

/// The peak resident memory of this process (the relay runs in it), in bytes.
fn peak_rss() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_values_written_with_the_relay_credential_are_never_loaded() -> anyhow::Result<()> {
    let mut env = Env::start("parked_bounds").await?;
    let app = env.sql().await?; // the superuser: application, admin and operator here
    let roles = include_str!("../../sql/roles.sql");
    let (create, grants) = roles.split_once("-- ---- 2.").expect("two blocks");
    app.batch_execute(create).await?;
    app.batch_execute(&format!("--{grants}")).await?;
    let dsn = env.pg.dsn(&env.db).replace(
        &format!("postgres:{}@", testkit::PG_PASSWORD),
        "outboxd_relay:change-me-relay@",
    );
    env.kafka_toml = "\"message.max.bytes\" = \"20000\"".into();
    // A bound the attacker's rows would fill many times over, were they counted as written.
    env.extra_toml = format!(
        "repair_interval_ms = 200\n[parked]\nmax_record_bytes = {}\nmax_open_bytes = {}\n",
        MB,
        4 * MB
    );
    let relay_toml = env.toml().replace(
        &format!("postgres:{}@", testkit::PG_PASSWORD),
        "outboxd_relay:change-me-relay@",
    );
    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &relay_toml,
        Vec::<(String, String)>::new(),
    )?);
    let write = |agg: &str, v: i64| {
        NewEvent::new(
            "acct",
            agg,
            v,
            "Deposited",
            serde_json::json!({"amount": v}),
        )
    };
    let mut c = env.sql().await?;
    write_events(&mut c, &[write("A", 1)], false).await?;
    env.caught_up(Duration::from_secs(30)).await?;
    let base = peak_rss();

    // ---- with the relay's credential: a parked head, a row held behind it with a 100 MB
    // payload, a parked row with a 100 MB error message, and 8 parked rows of 1.5 MB each
    // (over the record bound: the relay never writes one; a few KB each once compressed),
    // past the 4 MB bound were they counted.
    let r = connect(&dsn).await?;
    let slot = &env.slot;
    let cols = "slot, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, \
                topic, payload, headers, state, blocks_aggregate, blocked_by, error_class, error_message";
    let (head, held, message) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    r.batch_execute(&format!(
        "INSERT INTO outbox_parked ({cols}) VALUES ('{slot}', '{head}', 'acct', 'H', 1, \
           'Deposited', '{ACCT}', '{{}}', '[]', 'parked', true, NULL, 'x', 'x'); \
         INSERT INTO outbox_parked ({cols}) VALUES ('{slot}', '{message}', 'acct', 'M', 1, \
           'Deposited', '{ACCT}', '{{}}', '[]', 'parked', false, NULL, 'x', repeat('m', 100 << 20)); \
         INSERT INTO outbox_parked ({cols}) VALUES ('{slot}', '{held}', 'acct', 'H', 2, \
           'Deposited', '{ACCT}', convert_to('{{\"a\": \"' || repeat('p', 100 << 20) || '\"}}', 'UTF8'), \
           '[]', 'blocked', true, '{head}', 'blocked', 'x')"
    ))
    .await?;
    for _ in 0..8 {
        r.batch_execute(&format!(
            "INSERT INTO outbox_parked ({cols}) VALUES ('{slot}', '{}', 'acct', 'F', 1, \
               'Deposited', '{ACCT}', convert_to(repeat('f', 1536 << 10), 'UTF8'), '[]', 'parked', \
               false, NULL, 'x', 'x')",
            Uuid::now_v7()
        ))
        .await?;
    }
    drop(r);

    // The operator discards the head: the held row may go, and the relay looks at it.
    let cfg = env.config_file()?;
    let (code, out) = outboxd_cli(
        &["parked", "discard", &head.to_string(), "--reason", "test"],
        &cfg,
    );
    assert_eq!(code, 0, "{out}");
    let state = || async {
        let row = app
            .query_one(
                "SELECT state, error_class FROM outbox_parked WHERE event_id = $1",
                &[&held.to_string()],
            )
            .await?;
        anyhow::Ok((row.get::<_, String>(0), row.get::<_, String>(1)))
    };
    eventually(Duration::from_secs(60), || async {
        Ok(state().await? == ("parked".into(), "oversized".into()))
    })
    .await?;
    let held_id = held.to_string();
    // The listing the status page reads every few seconds shows the reasons, bounded.
    let (code, list) = outboxd_cli(&["parked", "list", "--json"], &cfg);
    assert_eq!(code, 0);
    assert!(
        list.len() < 256 << 10,
        "`parked list` printed {} bytes",
        list.len()
    );

    // `parked show` of the 100 MB row reads what it prints, not the value (before: loaded
    // whole, twice that printed with --full); it says how large the value is.
    for full in [false, true] {
        let mut args = vec!["parked", "show", &held_id];
        if full {
            args.push("--full");
        }
        let (code, shown) = outboxd_cli(&args, &cfg);
        assert_eq!(code, 0, "{}", &shown[..shown.len().min(2000)]);
        let bound = if full { 17 << 20 } else { 16 << 10 };
        assert!(
            shown.len() < bound,
            "`parked show` printed {} bytes",
            shown.len()
        );
        assert!(
            shown.contains(&format!("{} bytes in all", (100 << 20) + 9)),
            "{}",
            &shown[..2000.min(shown.len())]
        );
    }

    // Still delivering, and a real poison (too large for the producer) still parks: the
    // attacker's rows do not fill the bound.
    write_events(&mut c, &[write("B", 1)], false).await?;
    let poison = NewEvent::new(
        "acct",
        "P",
        1,
        "Deposited",
        serde_json::json!("x".repeat(30_000)),
    );
    let poison_id = poison.event_id.to_string();
    write_events(&mut c, &[poison], false).await?;
    env.caught_up(Duration::from_secs(60)).await?;
    let parked: String = app
        .query_one(
            "SELECT state FROM outbox_parked WHERE event_id = $1",
            &[&poison_id],
        )
        .await?
        .get(0);
    assert_eq!(parked, "parked");
    let recs = read_topic(&env.bootstrap(), ACCT, 2, Duration::from_secs(30))?;
    assert_eq!(
        recs.iter()
            .map(|r| r.header("aggregate_id"))
            .collect::<Vec<_>>(),
        ["A", "B"],
        "nothing of the attacker's rows is published"
    );
    assert!(!relay.is_finished(), "the relay still runs");
    let grown = peak_rss() - base;
    eprintln!("peak RSS grew by {} MB", grown / MB);
    assert!(
        grown < 60 * MB,
        "the relay loaded a 100 MB value: peak RSS grew by {} MB",
        grown / MB
    );
    relay.shutdown().await?;
    Ok(())
}
