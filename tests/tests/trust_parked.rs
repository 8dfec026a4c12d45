//! Trust boundaries of parked events and the delivery state (issue 27), run as the roles of
//! sql/roles.sql against a running relay and the real broker: with the relay's credential one
//! could insert `blocked` rows the relay then published, resurrect discarded or delivered rows,
//! re-use an old audit row for a new retry, rewrite a parked record, and move the delivery
//! state into the future. Each attempt must now fail with a clear error, or end parked with
//! the reason, and nothing forged may reach the topic.

use outboxd_tests::*;
use std::time::Duration;
use uuid::Uuid;

const ACCT: &str = "outbox.event.acct";

/// The error text of a statement that must fail.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaked_relay_credential_cannot_forge_resurrect_or_retarget_a_parked_event(
) -> anyhow::Result<()> {
    let env = Env::start("trust_parked").await?;
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
    let as_role = |role: &str, pw: &str| {
        env.toml()
            .replace(
                &format!("postgres:{}@", testkit::PG_PASSWORD),
                &format!("{role}:{pw}@"),
            )
            .replace("[relay]\n", "[relay]\nrepair_interval_ms = 200\n")
    };
    let relay_toml = as_role("outboxd_relay", "change-me-relay");
    let repair = env.dir.path().join("repair.toml");
    std::fs::write(&repair, as_role("outboxd_repair", "change-me-repair"))?;
    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &relay_toml,
        Vec::<(String, String)>::new(),
    )?);

    // Real events: P1 parked (it spoofs a reserved header), P2 held behind it, E delivered,
    // D parked and then discarded by the repair role.
    let insert = "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                  event_type, payload, headers) VALUES ($1, 'acct', $2, $3, 'Deposited', $4::text::jsonb, $5::text::jsonb)";
    let (p1, p2, e, d) = (
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
    );
    let spoof = Some(r#"{"event_id": "x"}"#.to_string());
    for (id, agg, v, payload, headers) in [
        (p1, "X", 1i64, r#"{"amount": 1}"#, spoof.clone()),
        (
            p2,
            "X",
            2,
            r#"{"amount": 2}"#,
            Some(r#"{"traceparent": "00-2"}"#.into()),
        ),
        (e, "Y", 1, r#"{"amount": 3}"#, None),
        (d, "W", 1, r#"{"amount": 4}"#, spoof.clone()),
    ] {
        app.execute(insert, &[&id, &agg, &v, &payload.to_string(), &headers])
            .await?;
    }
    env.caught_up(Duration::from_secs(30)).await?;
    let (code, out) = outboxd_cli(
        &["parked", "discard", &d.to_string(), "--reason", "spoofed"],
        &repair,
    );
    assert_eq!(code, 0, "{out}");

    // ---- with the relay's credential ------------------------------------------------------
    let r = connect(&dsn("outboxd_relay", "change-me-relay")).await?;
    let slot = &env.slot;
    let cols = "slot, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, \
                topic, payload, headers, state, blocks_aggregate, blocked_by, error_class, error_message";
    // A held event needs an open head of its aggregate.
    let err = refused(
        &r,
        &format!(
        "INSERT INTO outbox_parked ({cols}) VALUES ('{slot}', '{}', 'acct', 'Z', 1, 'Deposited', \
           '{ACCT}', '{{}}', '[]', 'blocked', true, 'nobody', 'blocked', 'x')",
        Uuid::now_v7()
    ),
    )
    .await;
    assert!(
        err.contains("no open parked event of its aggregate"),
        "{err}"
    );
    // Nothing is born released or retried.
    let err = refused(
        &r,
        &format!(
            "INSERT INTO outbox_parked ({cols}) VALUES ('{slot}', 'forged-retry', 'acct', 'Z', 1, \
           'Deposited', '{ACCT}', '{{}}', '[]', 'retry', true, NULL, 'x', 'x')"
        ),
    )
    .await;
    assert!(err.contains("a new row is parked or blocked"), "{err}");
    // A discarded event stays discarded.
    let err = refused(
        &r,
        &format!("UPDATE outbox_parked SET state = 'blocked' WHERE event_id = '{d}'"),
    )
    .await;
    assert!(
        err.contains("discarded -> blocked is not a change outboxd makes"),
        "{err}"
    );
    // A retry needs its own audit row: not the discard's, not one the relay writes.
    let err = refused(
        &r,
        &format!(
            "UPDATE outbox_parked SET state = 'retry', retry_audit_id = \
           (SELECT max(id) FROM outbox_parked_audit) WHERE event_id = '{p1}'"
        ),
    )
    .await;
    assert!(err.contains("a retry needs its own audit row"), "{err}");
    let err = refused(
        &r,
        &format!(
            "INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason) \
         VALUES ('{slot}', '{p1}', 'retry', 'mallory', 'x')"
        ),
    )
    .await;
    assert!(err.contains("permission denied"), "{err}");
    // What was parked cannot be rewritten: no grant on the column, and the guard for anyone.
    let err = refused(
        &r,
        &format!(
            "UPDATE outbox_parked SET payload = '{{\"amount\": 1000}}' WHERE event_id = '{p2}'"
        ),
    )
    .await;
    assert!(err.contains("permission denied"), "{err}");
    let err = refused(
        &app,
        &format!(
            "UPDATE outbox_parked SET aggregate_id = 'Q', topic = 'evil' WHERE event_id = '{p2}'"
        ),
    )
    .await;
    assert!(err.contains("what was parked cannot change"), "{err}");
    // The delivery state cannot claim what is impossible.
    for (set, why) in [
        (
            "delivery_mark = now() + interval '1 day'",
            "is in the future",
        ),
        ("acked_lsn = 'FFFFFFFF/0'", "past the end of the WAL"),
        ("delivered_xid = '99999999999'", "has not been assigned yet"),
    ] {
        let err = refused(
            &r,
            &format!("UPDATE outboxd_slot_state SET {set} WHERE slot_name = '{slot}'"),
        )
        .await;
        assert!(err.contains(why), "{set}: {err}");
    }
    // What the credential can still write: parked rows (a relay must park). A forged head with
    // a forged event held behind it; behind P1, a copy of the real E under aggregate X with a
    // forged payload, and an event the application never wrote.
    let forged_head = Uuid::now_v7();
    let forged_held = Uuid::now_v7();
    let never_written = Uuid::now_v7();
    r.batch_execute(&format!(
        "INSERT INTO outbox_parked ({cols}) VALUES \
           ('{slot}', '{forged_head}', 'acct', 'Z', 1, 'Deposited', '{ACCT}', '{{}}', '[]', 'parked', true, NULL, 'x', 'x'); \
         INSERT INTO outbox_parked ({cols}) VALUES \
           ('{slot}', '{forged_held}', 'acct', 'Z', 2, 'Deposited', '{ACCT}', '{{\"evil\": 1}}', '[]', 'blocked', true, '{forged_head}', 'blocked', 'x'); \
         INSERT INTO outbox_parked ({cols}) VALUES \
           ('{slot}', '{e}', 'acct', 'X', 3, 'Deposited', '{ACCT}', '{{\"amount\": 3000}}', '[]', 'blocked', true, '{p1}', 'blocked', 'x'), \
           ('{slot}', '{never_written}', 'acct', 'X', 4, 'Deposited', '{ACCT}', '{{\"amount\": 9}}', '[]', 'blocked', true, '{p1}', 'blocked', 'x')"
    ))
    .await?;

    // ---- the repair role ------------------------------------------------------------------
    let fixed = env.dir.path().join("fixed.json");
    std::fs::write(&fixed, r#"{"amount": 10}"#)?;
    let p1s = p1.to_string();
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "retry",
            &p1s,
            "--payload",
            fixed.to_str().unwrap(),
            "--reason",
            "fixed",
            "--operator",
            "alice",
        ],
        &repair,
    );
    assert_eq!(code, 0, "{out}");
    // An operator who takes the forged head for junk and discards it releases nothing forged.
    let (code, out) = outboxd_cli(
        &[
            "parked",
            "discard",
            &forged_head.to_string(),
            "--reason",
            "junk",
        ],
        &repair,
    );
    assert_eq!(code, 0, "{out}");
    let state = |id: Uuid| {
        let app = &app;
        async move {
            let r = app
                .query_one(
                    "SELECT state, error_class FROM outbox_parked WHERE event_id = $1",
                    &[&id.to_string()],
                )
                .await?;
            anyhow::Ok((r.get::<_, String>(0), r.get::<_, String>(1)))
        }
    };
    eventually(Duration::from_secs(30), || async {
        Ok(state(p2).await?.0 == "delivered"
            && state(e).await?.1 == "tampered"
            && state(forged_held).await?.1 == "unverified")
    })
    .await?;
    assert_eq!(state(p1).await?.0, "delivered");
    // E's forged copy is now the head of aggregate X: what came after it waits.
    assert_eq!(state(never_written).await?.0, "blocked");
    let (_, out) = outboxd_cli(&["parked", "list"], &repair);
    assert!(
        out.contains("tampered") && out.contains("unverified"),
        "{out}"
    );

    // On the topic: the real events only, P1 with the operator's payload.
    let recs = read_topic(&env.bootstrap(), ACCT, 3, Duration::from_secs(10))?;
    let mut seen: Vec<(String, Vec<u8>)> = recs
        .iter()
        .map(|r| (r.header("event_id").to_string(), r.value.clone()))
        .collect();
    seen.sort();
    let mut want = vec![
        (p1.to_string(), br#"{"amount": 10}"#.to_vec()),
        (p2.to_string(), br#"{"amount": 2}"#.to_vec()),
        (e.to_string(), br#"{"amount": 3}"#.to_vec()),
    ];
    want.sort();
    assert_eq!(seen, want);
    let p2_rec = recs
        .iter()
        .find(|r| r.header("event_id") == p2.to_string())
        .unwrap();
    assert_eq!(p2_rec.header("traceparent"), "00-2");

    // Delivered is final, for both roles; an audit row is used once, by its own transaction.
    let err = refused(
        &r,
        &format!("UPDATE outbox_parked SET state = 'retry' WHERE event_id = '{p1}'"),
    )
    .await;
    assert!(
        err.contains("delivered -> retry is not a change outboxd makes"),
        "{err}"
    );
    let rep = connect(&dsn("outboxd_repair", "change-me-repair")).await?;
    let err = refused(&rep, &format!(
        "UPDATE outbox_parked SET state = 'retry', retry_audit_id = \
           (SELECT retry_audit_id FROM outbox_parked WHERE event_id = '{p1}') WHERE event_id = '{e}'"
    )).await;
    assert!(err.contains("a retry needs its own audit row"), "{err}");
    let err = refused(&rep, &format!(
        "BEGIN; INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason) \
           VALUES ('{slot}', '{p1}', 'retry', 'alice', 'x'); \
         UPDATE outbox_parked SET state = 'retry', retry_audit_id = lastval() WHERE event_id = '{e}'; COMMIT"
    )).await;
    assert!(err.contains("a retry needs its own audit row"), "{err}");
    rep.batch_execute("ROLLBACK").await?;
    let err = refused(
        &rep,
        "UPDATE outbox_parked_audit SET reason = 'nothing to see'",
    )
    .await;
    assert!(err.contains("permission denied"), "{err}");
    let err = refused(&app, "DELETE FROM outbox_parked_audit").await;
    assert!(err.contains("append-only"), "{err}");
    // The audit names the database role, whatever the client says.
    rep.batch_execute(&format!(
        "INSERT INTO outbox_parked_audit (slot, event_id, action, operator, reason, db_user) \
         VALUES ('{slot}', 'x', 'discard', 'alice', 'x', 'somebody_else')"
    ))
    .await?;
    let who: String = app
        .query_one(
            "SELECT db_user FROM outbox_parked_audit WHERE event_id = 'x'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(who, "outboxd_repair");
    relay.shutdown().await?;
    Ok(())
}

/// An install whose guards are gone (an older outboxd's tables, or an owner who disabled one)
/// is named by `check`, and `init` (as the admin) puts them back; a relay role that owns
/// outboxd's tables is named too, since an owner can disable the guards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_missing_guard_and_init_installs_it() -> anyhow::Result<()> {
    let env = Env::start("trust_guards").await?;
    let cfg = env.config_file()?;
    let (code, out) = outboxd_cli(&["check"], &cfg);
    assert!(
        out.contains("outboxd's tables are guarded"),
        "{code}: {out}"
    );
    let app = env.sql().await?;
    app.batch_execute(
        "DROP TRIGGER outbox_parked_guard ON outbox_parked; \
         ALTER TABLE outboxd_slot_state DISABLE TRIGGER outboxd_slot_state_guard",
    )
    .await?;
    let (_, out) = outboxd_cli(&["check"], &cfg);
    for what in [
        "outboxd_slot_state (bounds",
        "outbox_parked and outbox_parked_audit",
    ] {
        let line = out
            .lines()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("{what} not named:\n{out}"));
        assert!(
            line.starts_with("WARN") && line.contains("run `outboxd init` as the admin role"),
            "{line}"
        );
    }
    let (code, out) = outboxd_cli(&["init"], &cfg);
    assert_eq!(code, 0, "{out}");
    let (_, out) = outboxd_cli(&["check"], &cfg);
    assert!(out.contains("outboxd's tables are guarded"), "{out}");
    // The guards hold again.
    let err = refused(
        &app,
        "UPDATE outboxd_slot_state SET delivery_mark = now() + interval '1 hour'",
    )
    .await;
    assert!(err.contains("is in the future"), "{err}");

    app.batch_execute(
        "CREATE ROLE owner_relay LOGIN REPLICATION PASSWORD 'pw'; \
         ALTER TABLE outbox_parked OWNER TO owner_relay",
    )
    .await?;
    let file = env.dir.path().join("owner.toml");
    std::fs::write(
        &file,
        env.toml().replace(
            &format!("postgres:{}@", testkit::PG_PASSWORD),
            "owner_relay:pw@",
        ),
    )?;
    let (_, out) = outboxd_cli(&["check"], &file);
    assert!(
        out.lines().any(|l| l.starts_with("WARN")
            && l.contains("role \"owner_relay\" owns outbox_parked")
            && l.contains("can disable their guards")),
        "{out}"
    );
    Ok(())
}
