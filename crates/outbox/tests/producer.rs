//! Producer library against a real Postgres (R29): business rows and outbox rows commit together
//! or not at all, including on version conflicts.

use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Result;
use outboxd_outbox::{
    install_emit_function, new_event_id, AggregateRef, ConflictSource, NewEvent, Outbox,
    OutboxError, VersionGuard,
};
use outboxd_testkit::{workspace_root, Postgres};
use serde_json::{json, Value};
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

/// One cluster per test process, removed at exit (testkit's `shared_cluster`).
fn cluster() -> &'static Postgres {
    outboxd_testkit::shared_cluster()
}

async fn fresh_db() -> Result<Client> {
    static N: AtomicUsize = AtomicUsize::new(0);
    let pg = cluster();
    let name = format!("producer_{}", N.fetch_add(1, Ordering::SeqCst));
    pg.create_database(&name).await?;
    let c = pg.connect(&name).await?;
    let schema = std::fs::read_to_string(workspace_root().join("sql/001_outbox.sql"))?;
    c.batch_execute(&schema).await?;
    install_emit_function(&c).await?;
    c.batch_execute(
        "CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL, total bigint NOT NULL,
                              version bigint NOT NULL);
         INSERT INTO orders VALUES ('o-1', 'new', 0, 0);",
    )
    .await?;
    Ok(c)
}

async fn outbox_rows(c: &Client, aggregate_id: &str) -> Result<Vec<(i64, String, Value)>> {
    let rows = c
        .query(
            "SELECT aggregate_version, event_type, payload FROM outbox
              WHERE aggregate_id = $1 ORDER BY aggregate_version",
            &[&aggregate_id],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

async fn order(c: &Client) -> Result<(String, i64, i64)> {
    let r = c
        .query_one(
            "SELECT status, total, version FROM orders WHERE id = 'o-1'",
            &[],
        )
        .await?;
    Ok((r.get(0), r.get(1), r.get(2)))
}

fn agg() -> AggregateRef {
    AggregateRef::new("order", "o-1").unwrap()
}

/// The usual command: read, validate, conditional update, business change, events, commit.
async fn add_to_total(
    c: &mut Client,
    amount: i64,
    event_id: uuid::Uuid,
) -> Result<(), OutboxError> {
    let outbox = Outbox::new();
    let guard = VersionGuard::new("orders", "id", "version")?;
    let tx = c.transaction().await?;
    let r = tx
        .query_one("SELECT total, version FROM orders WHERE id = 'o-1'", &[])
        .await?;
    let (total, version): (i64, i64) = (r.get(0), r.get(1));
    let new_total = total + amount;
    guard
        .advance(&tx, &agg(), &"o-1", version, version + 1)
        .await?;
    tx.execute(
        "UPDATE orders SET total = $1, status = 'open' WHERE id = 'o-1'",
        &[&new_total],
    )
    .await?;
    // Payload from the in-memory value being committed (R8).
    let ev =
        NewEvent::new("TotalChanged", 1, &json!({ "total": new_total }))?.with_event_id(event_id);
    outbox.append(&tx, &agg(), version, &[ev]).await?;
    tx.commit().await?;
    Ok(())
}

#[tokio::test]
async fn business_and_outbox_rows_commit_together_or_not_at_all() -> Result<()> {
    let mut c = fresh_db().await?;
    add_to_total(&mut c, 5, new_event_id()).await?;
    assert_eq!(order(&c).await?, ("open".into(), 5, 1));
    assert_eq!(
        outbox_rows(&c, "o-1").await?,
        vec![(1, "TotalChanged".into(), json!({"total": 5}))]
    );

    // Same command shape, but the transaction is dropped before commit: neither row appears.
    {
        let tx = c.transaction().await?;
        VersionGuard::new("orders", "id", "version")?
            .advance(&tx, &agg(), &"o-1", 1, 2)
            .await?;
        tx.execute("UPDATE orders SET total = 100 WHERE id = 'o-1'", &[])
            .await?;
        let ev = NewEvent::new("TotalChanged", 1, &json!({"total": 100}))?;
        Outbox::new().append(&tx, &agg(), 1, &[ev]).await?;
        // dropped: rollback
    }
    assert_eq!(order(&c).await?, ("open".into(), 5, 1));
    assert_eq!(outbox_rows(&c, "o-1").await?.len(), 1);
    Ok(())
}

#[tokio::test]
async fn stale_expected_version_is_a_typed_conflict_and_commits_nothing() -> Result<()> {
    let mut c = fresh_db().await?;
    add_to_total(&mut c, 5, new_event_id()).await?; // version 1

    let tx = c.transaction().await?;
    tx.execute(
        "UPDATE orders SET status = 'cancelled' WHERE id = 'o-1'",
        &[],
    )
    .await?;
    let err = VersionGuard::new("orders", "id", "version")?
        .advance(&tx, &agg(), &"o-1", 0, 1) // read before the first command committed
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        OutboxError::VersionConflict {
            expected: 0,
            source_kind: ConflictSource::ExpectedVersion,
            ..
        }
    ));
    assert!(err.is_retryable_conflict());
    drop(tx);
    assert_eq!(order(&c).await?, ("open".into(), 5, 1));
    assert_eq!(outbox_rows(&c, "o-1").await?.len(), 1);
    Ok(())
}

#[tokio::test]
async fn duplicate_aggregate_version_is_a_conflict_even_if_the_caller_commits() -> Result<()> {
    let mut c = fresh_db().await?;
    add_to_total(&mut c, 5, new_event_id()).await?; // version 1 in the outbox

    // A buggy command that skipped the guard: the outbox's unique (aggregate, version) stops it.
    let tx = c.transaction().await?;
    tx.execute(
        "UPDATE orders SET status = 'hijacked' WHERE id = 'o-1'",
        &[],
    )
    .await?;
    let ev = NewEvent::new("TotalChanged", 1, &json!({"total": 1}))?;
    let err = Outbox::new()
        .append(&tx, &agg(), 0, &[ev])
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            OutboxError::VersionConflict {
                source_kind: ConflictSource::UniqueVersion,
                ..
            }
        ),
        "{err:?}"
    );
    // Even a caller that ignores the error and commits gets nothing: Postgres aborted the tx.
    let _ = tx.commit().await;
    assert_eq!(order(&c).await?, ("open".into(), 5, 1));
    assert_eq!(outbox_rows(&c, "o-1").await?.len(), 1);
    Ok(())
}

#[tokio::test]
async fn several_events_get_consecutive_versions_in_order() -> Result<()> {
    let mut c = fresh_db().await?;
    let tx = c.transaction().await?;
    VersionGuard::new("orders", "id", "version")?
        .advance(&tx, &agg(), &"o-1", 0, 3)
        .await?;
    let events = vec![
        NewEvent::new("OrderPlaced", 1, &json!({"n": 1}))?,
        NewEvent::new("OrderPaid", 2, &json!({"n": 2}))?.with_header("traceparent", "00-ab")?,
        NewEvent::new("OrderShipped", 1, &json!({"n": 3}))?,
    ];
    let appended = Outbox::new().append(&tx, &agg(), 0, &events).await?;
    tx.commit().await?;
    let versions: Vec<i64> = appended.iter().map(|a| a.aggregate_version).collect();
    assert_eq!(versions, vec![1, 2, 3]);
    let ids: Vec<_> = appended.iter().map(|a| a.event_id).collect();
    assert_eq!(ids, events.iter().map(|e| e.event_id()).collect::<Vec<_>>());
    let types: Vec<String> = outbox_rows(&c, "o-1")
        .await?
        .into_iter()
        .map(|r| r.1)
        .collect();
    assert_eq!(types, vec!["OrderPlaced", "OrderPaid", "OrderShipped"]);
    let r = c
        .query_one(
            "SELECT schema_version, headers FROM outbox WHERE aggregate_version = 2",
            &[],
        )
        .await?;
    assert_eq!(r.get::<_, i32>(0), 2);
    assert_eq!(r.get::<_, Value>(1), json!({"traceparent": "00-ab"}));
    Ok(())
}

#[tokio::test]
async fn retry_after_a_lost_commit_ack_reuses_the_event_id_and_is_detected() -> Result<()> {
    let mut c = fresh_db().await?;
    let id = new_event_id(); // generated when the command was first handled
    add_to_total(&mut c, 5, id).await?;
    // The client never saw the COMMIT ack and retries the same command with the same id.
    let err = add_to_total(&mut c, 5, id).await.unwrap_err();
    assert!(
        matches!(&err, OutboxError::EventAlreadyRecorded { event_ids } if event_ids == &[id]),
        "{err:?}"
    );
    assert_eq!(order(&c).await?, ("open".into(), 5, 1), "applied once");
    Ok(())
}

#[tokio::test]
async fn oversized_payload_is_rejected_before_anything_is_written() -> Result<()> {
    let mut c = fresh_db().await?;
    let outbox = Outbox::new().max_payload_bytes(64);
    let tx = c.transaction().await?;
    tx.execute("UPDATE orders SET status = 'big' WHERE id = 'o-1'", &[])
        .await?;
    let ev = NewEvent::new("Big", 1, &json!({"blob": "x".repeat(100)}))?;
    let err = outbox.append(&tx, &agg(), 0, &[ev]).await.unwrap_err();
    assert!(matches!(
        err,
        OutboxError::PayloadTooLarge { limit: 64, .. }
    ));
    drop(tx);
    assert_eq!(order(&c).await?.0, "new");
    assert!(outbox_rows(&c, "o-1").await?.is_empty());
    Ok(())
}

#[tokio::test]
async fn table_name_is_configurable() -> Result<()> {
    let mut c = fresh_db().await?;
    c.batch_execute(
        "CREATE SCHEMA app; CREATE TABLE app.events_out (LIKE public.outbox INCLUDING ALL);",
    )
    .await?;
    let outbox = Outbox::with_table("app.events_out")?;
    assert_eq!(outbox.table(), "app.events_out");
    let tx = c.transaction().await?;
    outbox
        .append(&tx, &agg(), 0, &[NewEvent::new("X", 1, &json!({}))?])
        .await?;
    tx.commit().await?;
    let n: i64 = c
        .query_one("SELECT count(*) FROM app.events_out", &[])
        .await?
        .get(0);
    assert_eq!(n, 1);
    assert!(outbox_rows(&c, "o-1").await?.is_empty());
    assert!(Outbox::with_table("app.events_out; DROP TABLE x").is_err());
    Ok(())
}

/// Concurrent commands on one aggregate, each retrying on conflict: at the end the business
/// row and the outbox agree exactly (versions 1..=n, each payload = the state it committed).
#[tokio::test]
async fn concurrent_commands_keep_business_rows_and_outbox_in_lockstep() -> Result<()> {
    let c = fresh_db().await?;
    let db: String = c.query_one("SELECT current_database()", &[]).await?.get(0);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let mut c = cluster().connect(&db).await?;
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0;
            for _ in 0..8 {
                let id = new_event_id();
                loop {
                    match add_to_total(&mut c, 1, id).await {
                        Ok(()) => break,
                        Err(e) if e.is_retryable_conflict() => conflicts += 1,
                        Err(e) => panic!("{e:?}"),
                    }
                }
            }
            conflicts
        }));
    }
    for t in tasks {
        t.await?;
    }
    assert_eq!(order(&c).await?, ("open".into(), 32, 32));
    let rows = outbox_rows(&c, "o-1").await?;
    assert_eq!(rows.len(), 32);
    for (i, (version, _, payload)) in rows.iter().enumerate() {
        assert_eq!(*version, i as i64 + 1);
        assert_eq!(payload, &json!({ "total": i as i64 + 1 }));
    }
    Ok(())
}

#[tokio::test]
async fn outbox_emit_sql_function_appends_inside_the_callers_transaction() -> Result<()> {
    let mut c = fresh_db().await?;
    // Committed together with the business change.
    let tx = c.transaction().await?;
    tx.execute(
        "UPDATE orders SET status = 'paid', version = 1 WHERE id = 'o-1' AND version = 0",
        &[],
    )
    .await?;
    let id: uuid::Uuid = tx
        .query_one(
            "SELECT outbox_emit('order', 'o-1', 1, 'OrderPaid', '{\"s\":\"paid\"}'::jsonb,
                                2, NULL, '{\"traceparent\":\"00-x\"}'::jsonb)",
            &[],
        )
        .await?
        .get(0);
    tx.commit().await?;
    assert_eq!(id.get_version_num(), 7, "server-side default is a UUIDv7");
    let r = c
        .query_one(
            "SELECT schema_version, headers FROM outbox WHERE event_id = $1",
            &[&id],
        )
        .await?;
    assert_eq!(r.get::<_, i32>(0), 2);
    assert_eq!(r.get::<_, Value>(1), json!({"traceparent": "00-x"}));

    // Rolled back together with the business change.
    let tx = c.transaction().await?;
    tx.execute("UPDATE orders SET status = 'x' WHERE id = 'o-1'", &[])
        .await?;
    tx.execute(
        "SELECT outbox_emit('order', 'o-1', 2, 'X', '{}'::jsonb)",
        &[],
    )
    .await?;
    tx.rollback().await?;
    assert_eq!(outbox_rows(&c, "o-1").await?.len(), 1);
    assert_eq!(order(&c).await?.0, "paid");

    // Typed failures by SQLSTATE.
    let cases: [(&str, &SqlState, &str); 5] = [
        (
            "SELECT outbox_emit('order', 'o-1', 1, 'X', '{}'::jsonb)",
            &SqlState::UNIQUE_VIOLATION,
            "version conflict",
        ),
        (
            "SELECT outbox_emit('order', 'o-1', 9, 'X', '{}'::jsonb, 1, $1::uuid)",
            &SqlState::UNIQUE_VIOLATION,
            "already recorded",
        ),
        (
            "SELECT outbox_emit('order', 'o-1', 9, 'X', jsonb_build_object('b', repeat('x', 100)),
                                1, NULL, NULL, 64)",
            &SqlState::PROGRAM_LIMIT_EXCEEDED,
            "over the limit",
        ),
        (
            "SELECT outbox_emit('order', 'o-1', 9, 'X', '{}'::jsonb, 1, NULL,
                                '{\"event_id\":\"spoof\"}'::jsonb)",
            &SqlState::INVALID_PARAMETER_VALUE,
            "reserved",
        ),
        (
            "SELECT outbox_emit('ord/er', 'o-1', 9, 'X', '{}'::jsonb)",
            &SqlState::INVALID_PARAMETER_VALUE,
            "aggregate_type",
        ),
    ];
    for (sql, state, msg) in cases {
        let tx = c.transaction().await?;
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = if sql.contains("$1") {
            vec![&id]
        } else {
            vec![]
        };
        let err = tx.execute(sql, &params).await.unwrap_err();
        let db = err.as_db_error().expect("db error");
        assert_eq!(db.code(), state, "{sql}: {}", db.message());
        assert!(db.message().contains(msg), "{sql}: {}", db.message());
    }
    assert_eq!(outbox_rows(&c, "o-1").await?.len(), 1);
    Ok(())
}
