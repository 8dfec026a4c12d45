//! Issue 53, "the relay's credential republishes any event, out of order": run as the roles of
//! sql/roles.sql against a running relay (no `[parked] key`, the default) and the real broker.
//! With the relay's credential one could insert a `blocked` copy of a delivered event under a
//! negative (or any) id, ahead of its head, and have it published again at the next repair
//! tick; with DELETE one could re-insert a delivered row as `blocked`. Each must now be refused
//! and nothing may reach the topic a second time.

use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

const ACCT: &str = "outbox.event.acct";

async fn refused(c: &tokio_postgres::Client, sql: &str) -> String {
    match c.batch_execute(sql).await {
        Ok(()) => panic!("not refused: {sql}"),
        Err(e) => format!("{e:?}"),
    }
}

async fn connect(dsn: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (c, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(c)
}

/// event_id → how many records of it are on the topic.
fn copies(env: &Env, want: usize) -> anyhow::Result<std::collections::BTreeMap<String, usize>> {
    let recs = read_topic(&env.bootstrap(), ACCT, want, Duration::from_secs(5))?;
    let mut n = std::collections::BTreeMap::new();
    for r in recs {
        *n.entry(r.header("event_id").to_string()).or_insert(0) += 1;
    }
    Ok(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_credential_cannot_republish_a_delivered_event() -> anyhow::Result<()> {
    let env = Env::start("parked_forgery").await?;
    let app = env.sql().await?; // the superuser: application and admin here
    let roles = include_str!("../../sql/roles.sql");
    let (create, grants) = roles.split_once("-- ---- 2.").expect("two blocks");
    app.batch_execute(create).await?;
    app.batch_execute(&format!("--{grants}")).await?;
    let dsn = |role: &str, pw: &str| {
        env.pg.dsn(&env.db).replace(
            &format!("postgres:{}@", testkit::PG_PASSWORD),
            &format!("{role}:{pw}@"),
        )
    };
    let relay_toml = env
        .toml()
        .replace(
            &format!("postgres:{}@", testkit::PG_PASSWORD),
            "outboxd_relay:change-me-relay@",
        )
        .replace("[relay]\n", "[relay]\nrepair_interval_ms = 200\n");
    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &relay_toml,
        Vec::<(String, String)>::new(),
    )?);

    // Real events: E delivered live; P parked (it spoofs a reserved header) with F held
    // behind it, then P retried by an operator (the superuser here) and F released.
    let insert = "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                  event_type, payload, headers) VALUES ($1, 'acct', $2, $3, 'Deposited', $4::text::jsonb, $5::text::jsonb)";
    let (e, p, f) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let spoof = Some(r#"{"event_id": "x"}"#.to_string());
    for (id, agg, v, payload, headers) in [
        (e, "Y", 1i64, r#"{"amount": 1}"#, None),
        (p, "X", 1, r#"{"amount": 2}"#, spoof),
        (f, "X", 2, r#"{"amount": 3}"#, None),
    ] {
        app.execute(insert, &[&id, &agg, &v, &payload.to_string(), &headers])
            .await?;
    }
    env.caught_up(Duration::from_secs(30)).await?;
    let cfg = env.config_file()?;
    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"amount": 20}"#)?;
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "retry",
            &p.to_string(),
            "--payload",
            fixed.to_str().unwrap(),
            "--reason",
            "fixed",
        ],
        &cfg,
    );
    assert_eq!(code, 0, "{out}");
    let state = |id: Uuid| {
        let app = &app;
        async move {
            let r = app
                .query_one(
                    "SELECT state FROM outbox_parked WHERE event_id = $1",
                    &[&id.to_string()],
                )
                .await?;
            anyhow::Ok(r.get::<_, String>(0))
        }
    };
    eventually(Duration::from_secs(30), || async {
        Ok(state(f).await? == "delivered")
    })
    .await?;
    let before = copies(&env, 3)?;
    assert_eq!(before.values().sum::<usize>(), 3, "{before:?}");

    // ---- with the relay's credential ------------------------------------------------------
    let r = connect(&dsn("outboxd_relay", "change-me-relay")).await?;
    let slot = &env.slot;
    let cols = "slot, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, \
                topic, payload, headers, state, blocks_aggregate, blocked_by, error_class, error_message";
    let head = Uuid::now_v7();
    r.batch_execute(&format!(
        "INSERT INTO outbox_parked ({cols}) VALUES ('{slot}', '{head}', 'acct', 'Y', 9, \
           'Deposited', '{ACCT}', '{{}}', '[]', 'parked', true, NULL, 'x', 'x')"
    ))
    .await?;
    // An exact copy of E under a negative id, ahead of its (fake) head: the relay role may not
    // choose an id at all, from the sequence or not.
    let copy = |id: &str| {
        format!(
            "INSERT INTO outbox_parked (id, {cols}) VALUES ({id}, '{slot}', '{e}', 'acct', 'Y', 1, \
               'Deposited', '{ACCT}', '{{\"amount\": 1}}', '[]', 'blocked', true, '{head}', 'blocked', 'x')"
        )
    };
    for id in ["-2", "nextval('outbox_parked_id_seq')"] {
        let err = refused(&r, &copy(id)).await;
        assert!(err.contains("permission denied"), "{id}: {err}");
    }
    // A role that may insert any column (an earlier version's grant, the owner): the guard
    // takes the id from the sequence anyway, so the copy lands behind its head.
    app.batch_execute(&copy("-2")).await?;
    let (id, head_id): (i64, i64) = {
        let row = app
            .query_one(
                "SELECT (SELECT id FROM outbox_parked WHERE event_id = $1), \
                        (SELECT id FROM outbox_parked WHERE event_id = $2)",
                &[&e.to_string(), &head.to_string()],
            )
            .await?;
        (row.get(0), row.get(1))
    };
    assert!(id > head_id && id > 0, "{id} behind {head_id}");

    // ---- a role that may delete: a delivered row re-inserted --------------------------------
    app.batch_execute(
        "CREATE ROLE mallory LOGIN PASSWORD 'pw'; \
         GRANT USAGE ON SCHEMA public TO mallory; \
         GRANT SELECT, INSERT, DELETE ON outbox_parked TO mallory; \
         GRANT USAGE ON SEQUENCE outbox_parked_id_seq TO mallory",
    )
    .await?;
    let m = connect(&dsn("mallory", "pw")).await?;
    let err = refused(
        &m,
        &format!(
            "BEGIN; \
             CREATE TEMP TABLE f AS SELECT * FROM outbox_parked WHERE event_id = '{f}'; \
             DELETE FROM outbox_parked WHERE event_id = '{f}'; \
             UPDATE f SET state = 'blocked', blocked_by = '{head}', aggregate_id = 'Y'; \
             INSERT INTO outbox_parked SELECT * FROM f; COMMIT"
        ),
    )
    .await;
    assert!(err.contains("was parked for slot"), "{err}");
    m.batch_execute("ROLLBACK").await?;
    assert_eq!(state(f).await?, "delivered");

    // Several repair ticks later nothing was published twice.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = copies(&env, 4)?;
    assert_eq!(after, before);
    relay.shutdown().await?;
    Ok(())
}
