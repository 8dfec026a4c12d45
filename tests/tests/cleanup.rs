//! Outbox cleanup (issue 20, R34): `outboxd cleanup` deletes delivered rows older than the
//! retention in capped batches, never rows behind a slot's delivery mark or inside the recovery
//! window, not while a recovery runs, not while any slot has delivered nothing; the loop inside
//! `outboxd run`; a time-partitioned outbox whose old partitions are dropped while the relay
//! streams across partition changes.

use outboxd_tests::reliability::read_log;
use outboxd_tests::*;
use std::time::Duration;

/// Inserts `n` rows of one aggregate with `created_at = now() - age` in one transaction.
async fn insert_aged(
    c: &tokio_postgres::Client,
    agg: &str,
    from_version: i64,
    n: i64,
    age: &str,
) -> anyhow::Result<()> {
    c.execute(
        "INSERT INTO outbox (event_id, aggregate_type, aggregate_id, aggregate_version, \
                             event_type, payload, created_at) \
         SELECT gen_random_uuid(), 'acct', $1, v, 'Deposited', jsonb_build_object('v', v), \
                now() - $4::text::interval \
         FROM generate_series($2::bigint, $2::bigint + $3::bigint - 1) v",
        &[&agg, &from_version, &n, &age],
    )
    .await?;
    Ok(())
}

async fn count(c: &tokio_postgres::Client, filter: &str) -> anyhow::Result<i64> {
    Ok(
        c.query_one(&format!("SELECT count(*) FROM outbox WHERE {filter}"), &[])
            .await?
            .get(0),
    )
}

/// Writes the env's config with `[cleanup]` = `cleanup` and a recovery window of 1 h (rows of
/// the tests are hours old); returns the file and its text.
fn write_config(env: &mut Env, cleanup: &str) -> anyhow::Result<(std::path::PathBuf, String)> {
    env.extra_toml = format!("[cleanup]\n{cleanup}");
    let toml = env.toml().replace(
        "[source]\n",
        "[source]\nrecovery_window = \"1h\"\nstate_interval_ms = 200\n",
    );
    let cfg = env.dir.path().join("outboxd.toml");
    std::fs::write(&cfg, &toml)?;
    Ok((cfg, toml))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_deletes_only_delivered_rows_outside_the_window_in_capped_batches(
) -> anyhow::Result<()> {
    let mut env = Env::start("cleanup_rows").await?;
    let (cfg, toml) = write_config(
        &mut env,
        "retention = \"1h\"\nbatch_size = 50\nmax_rows_per_run = 120\npause_ms = 0\n",
    )?;
    let c = env.sql().await?;
    insert_aged(&c, "old", 1, 300, "3 hours").await?;
    insert_aged(&c, "new", 1, 10, "0 seconds").await?;

    // Before the relay delivered anything nothing is known to be delivered (`init` created the
    // slot and its state row, without a mark).
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("nothing deleted: slot") && out.contains("has not delivered anything yet"),
        "{out}"
    );

    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&cfg, log.clone())?;
    env.caught_up(Duration::from_secs(60)).await?;
    env.mark_recorded().await?;

    // A dry run changes nothing.
    let (code, out) = outboxd_cli(&["cleanup", "--dry-run"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("300 row(s) would be deleted"), "{out}");
    assert_eq!(count(&c, "true").await?, 310);

    // Capped runs: 120 + 120 + 60, in batches of at most 50; the recent rows stay.
    for (expect, capped) in [(120, true), (120, true), (60, false)] {
        let (code, out) = outboxd_cli(&["cleanup"], &cfg);
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains(&format!("deleted         {expect} row(s) in ")),
            "{out}"
        );
        assert_eq!(out.contains("cap reached"), capped, "{out}");
    }
    assert_eq!(count(&c, "true").await?, 10);
    assert!(relay.sigterm()?.success());

    // Rows written while the relay is down are not delivered, whatever their created_at says
    // (an application's event time, a backfill): they stay, although 5 hours "old".
    insert_aged(&c, "undelivered", 1, 25, "5 hours").await?;
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("deleted         0 row(s)"), "{out}");
    assert_eq!(count(&c, "aggregate_id = 'undelivered'").await?, 25);
    let mut relay = RelayProcess::spawn(&cfg, log.clone())?;
    insert_aged(&c, "behind", 1, 20, "150 minutes").await?;
    insert_aged(&c, "ancient", 1, 30, "5 hours").await?;
    env.caught_up(Duration::from_secs(60)).await?;
    env.mark_recorded().await?;
    assert!(relay.sigterm()?.success());

    // Delivered, and the relay has been down for 3 hours: its mark is 3 h old. Rows created
    // since (2.5 h ago) stay, although older than the retention; rows older than mark - window
    // go.
    c.execute(
        "UPDATE outboxd_slot_state SET delivery_mark = now() - interval '3 hours'",
        &[],
    )
    .await?;
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("deleted         55 row(s)"), "{out}");
    assert!(
        out.contains(&format!("held back by    slot {:?}", env.slot)),
        "{out}"
    );
    assert_eq!(count(&c, "aggregate_id = 'behind'").await?, 20);
    assert_eq!(count(&c, "aggregate_id = 'ancient'").await?, 0);
    assert_eq!(count(&c, "aggregate_id = 'undelivered'").await?, 0);

    // Not while a recovery runs, nor while another slot has delivered nothing.
    c.execute(
        "UPDATE outboxd_slot_state SET recovering_since = now() - interval '4 hours'",
        &[],
    )
    .await?;
    insert_aged(&c, "ancient", 100, 5, "6 hours").await?;
    let (_, out) = outboxd_cli(&["cleanup"], &cfg);
    assert!(
        out.contains("nothing deleted") && out.contains("recovering"),
        "{out}"
    );
    c.execute("UPDATE outboxd_slot_state SET recovering_since = NULL", &[])
        .await?;
    c.execute(
        "INSERT INTO outboxd_slot_state (slot_name, system_identifier, timeline, acked_lsn) \
         VALUES ('other_relay', 'x', 1, '0/0')",
        &[],
    )
    .await?;
    let (_, out) = outboxd_cli(&["cleanup"], &cfg);
    assert!(
        out.contains("slot \"other_relay\" has not delivered anything yet"),
        "{out}"
    );
    assert_eq!(count(&c, "aggregate_id = 'ancient'").await?, 5);

    // `check` names where cleanup runs and whether its role may delete.
    let (_, out) = outboxd_cli(&["check"], &cfg);
    assert!(
        out.lines().any(|l| l.starts_with("ok")
            && l.contains("cleanup")
            && l.contains("retention 1h, when `outboxd cleanup` runs (cron), as role postgres")),
        "{out}"
    );
    c.batch_execute("CREATE ROLE cleanup_ro LOGIN PASSWORD 'ro-pass'; GRANT SELECT ON outbox, outboxd_slot_state, outboxd_replay TO cleanup_ro")
        .await?;
    let ro_dsn = env.pg.dsn(&env.db).replace(
        &format!("postgres:{}@", outboxd_tests::testkit::PG_PASSWORD),
        "cleanup_ro:ro-pass@",
    );
    std::fs::write(&cfg, format!("{toml}dsn = \"{ro_dsn}\"\n"))?;
    let (_, out) = outboxd_cli(&["check"], &cfg);
    assert!(
        out.lines().any(|l| l.starts_with("FAIL")
            && l.contains("role cleanup_ro cannot delete")
            && l.contains("GRANT SELECT, DELETE ON \"public\".\"outbox\" TO \"cleanup_ro\"")),
        "{out}"
    );
    assert!(!out.contains("ro-pass"), "{out}");
    c.execute(
        "DELETE FROM outboxd_slot_state WHERE slot_name = 'other_relay'",
        &[],
    )
    .await?;
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("the cleanup role") && out.contains("DELETE"),
        "{out}"
    );

    // A retention shorter than the recovery window is refused before anything connects.
    std::fs::write(
        &cfg,
        toml.replace("retention = \"1h\"", "retention = \"30m\""),
    )?;
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_ne!(code, 0);
    assert!(
        out.contains("cleanup.retention (30m) is shorter than source.recovery_window (1h)"),
        "{out}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_loop_runs_inside_the_relay() -> anyhow::Result<()> {
    let mut env = Env::start("cleanup_loop").await?;
    let (cfg, _) = write_config(&mut env, "retention = \"1h\"\nevery = \"1s\"\n")?;
    let c = env.sql().await?;
    insert_aged(&c, "old", 1, 50, "3 hours").await?;
    insert_aged(&c, "new", 1, 5, "0 seconds").await?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&cfg, log.clone())?;
    let res = eventually(Duration::from_secs(30), || async {
        Ok(count(&c, "true").await? == 5)
    })
    .await;
    assert!(res.is_ok(), "old rows not cleaned: {}", read_log(&log));
    assert!(read_log(&log).contains("cleanup"), "{}", read_log(&log));
    assert!(relay.sigterm()?.success());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_streams_across_partition_changes_and_drops_old_days(
) -> anyhow::Result<()> {
    let mut env = Env::start("cleanup_parts").await?;
    let c = env.sql().await?;
    // Replace init's plain table with the partitioned alternative.
    c.batch_execute("DROP PUBLICATION outbox_pub; DROP TABLE outbox;")
        .await?;
    let ddl = std::fs::read_to_string(
        outboxd_tests::testkit::workspace_root().join("sql/optional/outbox_partitioned.sql"),
    )?;
    c.batch_execute(&ddl).await?;
    // An old day's partition with delivered history in it.
    c.batch_execute(
        "CREATE TABLE outbox_p_old PARTITION OF outbox \
           FOR VALUES FROM (now() - interval '10 days') TO (now() - interval '9 days')",
    )
    .await?;
    let (cfg, _) = write_config(&mut env, "retention = \"1d\"\n")?;
    create_topics(&env.bootstrap(), &["outbox.event.acct"], 1).await?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&cfg, log.clone())?;

    insert_aged(&c, "old", 1, 20, "9 days 12 hours").await?; // outbox_p_old
    insert_aged(&c, "today", 1, 20, "0 seconds").await?; // today's partition
    insert_aged(&c, "tomorrow", 1, 5, "-1 day").await?; // a future partition
    let res = env.caught_up(Duration::from_secs(60)).await;
    assert!(res.is_ok(), "{}", read_log(&log));
    env.mark_recorded().await?;

    let (code, out) = outboxd_cli(&["cleanup", "--dry-run"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("would drop      partition public.outbox_p_old"),
        "{out}"
    );
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("dropped         partition public.outbox_p_old"),
        "{out}"
    );
    assert_eq!(count(&c, "aggregate_id = 'old'").await?, 0);
    assert_eq!(count(&c, "true").await?, 25);

    // A partition created while the relay streams: its rows arrive too.
    c.batch_execute(
        "CREATE TABLE outbox_p_later PARTITION OF outbox \
           FOR VALUES FROM (now() + interval '30 days') TO (now() + interval '31 days')",
    )
    .await?;
    insert_aged(&c, "later", 1, 7, "-30 days -1 hour").await?;
    let res = env.caught_up(Duration::from_secs(60)).await;
    assert!(res.is_ok(), "{}", read_log(&log));
    let records = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        52,
        Duration::from_secs(30),
    )?;
    let later = records.iter().filter(|r| r.key == b"later").count();
    assert_eq!(later, 7, "{} records", records.len());
    assert!(relay.sigterm()?.success());
    Ok(())
}

/// Cleanup's bounds are every relay's, not its own config's: a second relay's state in another
/// schema holds rows back by its delivered_xid; a pgoutput slot nobody recorded blocks cleanup
/// until it is listed as foreign; a recovery in the other relay's schema blocks it; a table
/// partitioned by something else than created_at is not cleaned by partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_obeys_every_relays_state_and_unknown_slots() -> anyhow::Result<()> {
    let mut env = Env::start("cleanup_bounds").await?;
    let (cfg, toml) = write_config(&mut env, "retention = \"1h\"\npause_ms = 0\n")?;
    let c = env.sql().await?;
    let before: String = c
        .query_one("SELECT pg_snapshot_xmin(pg_current_snapshot())::text", &[])
        .await?
        .get(0);
    insert_aged(&c, "old", 1, 50, "3 hours").await?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&cfg, log.clone())?;
    env.caught_up(Duration::from_secs(60)).await?;
    env.mark_recorded().await?;
    assert!(relay.sigterm()?.success());

    // Another relay (relay_schema = relay_b) that delivered only what came before these rows.
    c.batch_execute(
        "CREATE SCHEMA relay_b; \
         CREATE TABLE relay_b.outboxd_slot_state (LIKE public.outboxd_slot_state INCLUDING ALL)",
    )
    .await?;
    c.execute(
        "INSERT INTO relay_b.outboxd_slot_state \
           (slot_name, system_identifier, timeline, acked_lsn, delivery_mark, delivered_xid) \
         VALUES ('relay_b', 'x', 1, '0/0', now(), $1::text::xid8)",
        &[&before],
    )
    .await?;
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("deleted         0 row(s)"), "{out}");

    // A recovery under way in that schema blocks cleanup.
    c.batch_execute("UPDATE relay_b.outboxd_slot_state SET recovering_xid = delivered_xid")
        .await?;
    let (_, out) = outboxd_cli(&["cleanup"], &cfg);
    assert!(
        out.contains("nothing deleted: a relay is recovering"),
        "{out}"
    );
    c.batch_execute(
        "UPDATE relay_b.outboxd_slot_state SET recovering_xid = NULL, \
         delivered_xid = pg_snapshot_xmin(pg_current_snapshot())",
    )
    .await?;

    // A pgoutput slot no relay recorded: cleanup cannot know what it still needs.
    c.batch_execute("SELECT pg_create_logical_replication_slot('stranger', 'pgoutput')")
        .await?;
    let (_, out) = outboxd_cli(&["cleanup"], &cfg);
    assert!(
        out.contains("nothing deleted")
            && out.contains("\"stranger\"")
            && out.contains("cleanup.ignore_slots"),
        "{out}"
    );
    std::fs::write(
        &cfg,
        toml.replace("[cleanup]\n", "[cleanup]\nignore_slots = [\"stranger\"]\n"),
    )?;
    let (code, out) = outboxd_cli(&["cleanup"], &cfg);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("deleted         50 row(s)"), "{out}");
    assert_eq!(count(&c, "aggregate_id = 'old'").await?, 0);

    // Partitioned by something else than created_at: not cleaned by partition.
    c.batch_execute(
        "CREATE TABLE outbox_by_type (event_id uuid, aggregate_type text, aggregate_id text, \
           aggregate_version bigint, event_type text, payload jsonb, created_at timestamptz) \
         PARTITION BY LIST (aggregate_type); \
         CREATE TABLE outbox_by_type_acct PARTITION OF outbox_by_type FOR VALUES IN ('acct')",
    )
    .await?;
    std::fs::write(
        &cfg,
        toml.replace(
            "[source]\n",
            "[source]\ntable = \"public.outbox_by_type\"\n",
        )
        .replace("[cleanup]\n", "[cleanup]\nignore_slots = [\"stranger\"]\n"),
    )?;
    let (_, out) = outboxd_cli(&["cleanup"], &cfg);
    assert!(
        out.contains("nothing deleted") && out.contains("not by RANGE (created_at)"),
        "{out}"
    );
    Ok(())
}
