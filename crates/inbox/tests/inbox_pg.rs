//! The inbox against a real Postgres: dedupe, conflicts, R32 rollback, gaps, ledger, retention.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use common::*;
use outboxd_inbox::{
    Claim, ConflictKind, EffectError, EffectOutcome, GapResolution, Inbox, InboxError, Ledger,
    Ordering, Outcome, Resolution, RetentionPolicy,
};
use serde_json::json;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(3600);

#[tokio::test]
async fn same_event_delivered_five_times_has_one_effect() -> Result<()> {
    for ordering in [
        Ordering::Unordered,
        Ordering::PerAggregate { hold_for: LONG },
    ] {
        let (mut c, _) = consumer_db(cluster(), "dup").await?;
        let inbox = Inbox::new(Projection::new("shipping", ordering));
        let e = event(Uuid::now_v7(), "o-1", 1, "placed");
        let mut outcomes = Vec::new();
        for _ in 0..5 {
            outcomes.push(inbox.process(&mut c, &e).await?);
        }
        let result = json!({"shipment_status": "placed", "version": 1});
        assert_eq!(
            outcomes[0],
            Outcome::Applied {
                result: result.clone(),
                released: vec![]
            }
        );
        for o in &outcomes[1..] {
            // The stored result comes back; the handler does not run again (R20).
            assert_eq!(
                o,
                &Outcome::Duplicate {
                    result: Some(result.clone())
                }
            );
        }
        assert_eq!(
            applied(&c, "o-1").await?,
            vec![(e.event_id, 1)],
            "{ordering:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn concurrent_deliveries_of_one_event_apply_once() -> Result<()> {
    let (mut c1, db) = consumer_db(cluster(), "race").await?;
    let mut c2 = cluster().connect(&db).await?;
    let inbox = Inbox::new(Projection::new("shipping", Ordering::Unordered));
    let e = event(Uuid::now_v7(), "o-1", 1, "placed");
    let (a, b) = tokio::join!(inbox.process(&mut c1, &e), inbox.process(&mut c2, &e));
    let mut kinds = [a?, b?].map(|o| matches!(o, Outcome::Applied { .. }));
    kinds.sort();
    assert_eq!(kinds, [false, true], "one applied, one duplicate");
    assert_eq!(applied(&c1, "o-1").await?.len(), 1);
    Ok(())
}

#[tokio::test]
async fn conflicting_event_is_an_error_and_has_no_effect() -> Result<()> {
    for ordering in [
        Ordering::Unordered,
        Ordering::PerAggregate { hold_for: LONG },
    ] {
        let (mut c, _) = consumer_db(cluster(), "conflict").await?;
        let inbox = Inbox::new(Projection::new("shipping", ordering));
        let first = event(Uuid::now_v7(), "o-1", 1, "placed");
        inbox.process(&mut c, &first).await?;

        // Same aggregate and version, different event id: a real conflict, not a duplicate.
        let rival = event(Uuid::now_v7(), "o-1", 1, "cancelled");
        let err = inbox.process(&mut c, &rival).await.unwrap_err();
        assert!(
            matches!(&err, InboxError::Conflict { kind: ConflictKind::VersionTaken { existing_event_id }, .. }
                if *existing_event_id == first.event_id),
            "{err:?}"
        );
        // Same event id for another version: also a conflict.
        let reused = event(first.event_id, "o-1", 2, "shipped");
        let err = inbox.process(&mut c, &reused).await.unwrap_err();
        assert!(matches!(
            err,
            InboxError::Conflict {
                kind: ConflictKind::EventIdReused { .. },
                ..
            }
        ));
        assert_eq!(applied(&c, "o-1").await?, vec![(first.event_id, 1)]);
        assert_eq!(count(&c, "SELECT count(*) FROM processed_event").await?, 1);
        let status: String = c
            .query_one("SELECT status FROM shipment WHERE order_id = 'o-1'", &[])
            .await?
            .get(0);
        assert_eq!(status, "placed");
    }
    Ok(())
}

#[tokio::test]
async fn failed_consumer_transaction_loses_processed_event_and_redelivery_runs_once() -> Result<()>
{
    let (mut c, _) = consumer_db(cluster(), "r32").await?;
    let handler = Projection::new("shipping", Ordering::PerAggregate { hold_for: LONG });
    let inbox = Inbox::new(handler.clone());
    let e = event(Uuid::now_v7(), "o-1", 1, "placed");

    handler.fail_next.store(true, AtomicOrdering::SeqCst);
    let err = inbox.process(&mut c, &e).await.unwrap_err();
    assert!(matches!(err, InboxError::Handler { .. }));
    assert!(err.is_transient());
    // The business update and processed_event rolled back together (R32).
    assert_eq!(count(&c, "SELECT count(*) FROM processed_event").await?, 0);
    assert_eq!(count(&c, "SELECT count(*) FROM shipment").await?, 0);
    assert_eq!(count(&c, "SELECT count(*) FROM apply_log").await?, 0);

    // The redelivery is processed, once.
    assert!(matches!(
        inbox.process(&mut c, &e).await?,
        Outcome::Applied { .. }
    ));
    assert!(matches!(
        inbox.process(&mut c, &e).await?,
        Outcome::Duplicate { .. }
    ));
    assert_eq!(applied(&c, "o-1").await?, vec![(e.event_id, 1)]);
    Ok(())
}

#[tokio::test]
async fn versions_1_3_2_are_applied_as_1_2_3() -> Result<()> {
    let (mut c, _) = consumer_db(cluster(), "gap").await?;
    let inbox = Inbox::new(Projection::ordered("shipping", LONG));
    let (e1, e2, e3) = (
        event(Uuid::now_v7(), "o-1", 1, "placed"),
        event(Uuid::now_v7(), "o-1", 2, "paid"),
        event(Uuid::now_v7(), "o-1", 3, "shipped"),
    );
    assert!(matches!(
        inbox.process(&mut c, &e1).await?,
        Outcome::Applied { .. }
    ));
    assert_eq!(
        inbox.process(&mut c, &e3).await?,
        Outcome::Held { waiting_for: 2 }
    );
    assert_eq!(inbox.process(&mut c, &e3).await?, Outcome::AlreadyHeld);
    // Other aggregates are not blocked by o-1's gap.
    let other = event(Uuid::now_v7(), "o-2", 1, "placed");
    assert!(matches!(
        inbox.process(&mut c, &other).await?,
        Outcome::Applied { .. }
    ));
    match inbox.process(&mut c, &e2).await? {
        Outcome::Applied { released, .. } => assert_eq!(released, vec![e3.event_id]),
        o => panic!("{o:?}"),
    }
    assert_eq!(
        applied(&c, "o-1").await?,
        vec![(e1.event_id, 1), (e2.event_id, 2), (e3.event_id, 3)]
    );
    assert_eq!(count(&c, "SELECT count(*) FROM inbox_held_event").await?, 0);
    let status: String = c
        .query_one("SELECT status FROM shipment WHERE order_id = 'o-1'", &[])
        .await?
        .get(0);
    assert_eq!(status, "shipped");
    // A late redelivery of the released event is a duplicate.
    assert!(matches!(
        inbox.process(&mut c, &e3).await?,
        Outcome::Duplicate { result: Some(_) }
    ));
    Ok(())
}

#[tokio::test]
async fn gap_never_filled_alerts_after_the_window_then_resyncs() -> Result<()> {
    let (mut c, _) = consumer_db(cluster(), "gapto").await?;
    let window = Duration::from_millis(50);
    let handler = Projection::ordered("shipping", window);
    let inbox = Inbox::new(handler.clone());
    let e1 = event(Uuid::now_v7(), "o-1", 1, "placed");
    let e3 = event(Uuid::now_v7(), "o-1", 3, "shipped");
    inbox.process(&mut c, &e1).await?;
    inbox.process(&mut c, &e3).await?;
    let held_at: chrono::DateTime<chrono::Utc> = c
        .query_one("SELECT held_at FROM inbox_held_event", &[])
        .await?
        .get(0);
    let window_c = chrono::Duration::from_std(window)?;
    let ms = chrono::Duration::milliseconds(1);

    // Time is passed in: no sleeping, no wall-clock assertions.
    let r = inbox.sweep_at(&mut c, held_at + window_c - ms).await?;
    assert!(r.timed_out.is_empty());
    assert_eq!(r.held, 1);
    assert!(handler.gaps.lock().unwrap().is_empty());

    let t1 = held_at + window_c;
    let r = inbox.sweep_at(&mut c, t1).await?;
    assert_eq!(r.timed_out.len(), 1, "alert after the window");
    let gap = handler.gaps.lock().unwrap()[0].clone();
    assert_eq!(
        (gap.current_version, gap.held_versions.clone()),
        (1, vec![3])
    );
    assert_eq!(
        r.held, 1,
        "KeepHolding keeps the newer event: never dropped"
    );

    // Alerted once per window, not on every sweep.
    let r = inbox.sweep_at(&mut c, t1 + ms).await?;
    assert!(r.timed_out.is_empty());

    // Next window: the hook fetches the source of truth (state at version 2).
    *handler.on_gap.lock().unwrap() = GapResolution::Resynced { version: 2 };
    let r = inbox.sweep_at(&mut c, t1 + window_c).await?;
    assert_eq!(r.resynced, vec![("order".into(), "o-1".into(), 2)]);
    assert_eq!(r.released, vec![e3.event_id]);
    assert_eq!(r.held, 0);
    assert_eq!(handler.gaps.lock().unwrap().len(), 2);
    assert_eq!(
        applied(&c, "o-1").await?,
        vec![(e1.event_id, 1), (e3.event_id, 3)]
    );

    // The missing version finally arrives: older than the state, never overwrites it.
    let e2 = event(Uuid::now_v7(), "o-1", 2, "paid");
    assert_eq!(
        inbox.process(&mut c, &e2).await?,
        Outcome::Stale { current_version: 3 }
    );
    let row = c
        .query_one(
            "SELECT status, version FROM shipment WHERE order_id = 'o-1'",
            &[],
        )
        .await?;
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, i64>(1)),
        ("shipped".into(), 3)
    );
    assert!(matches!(
        inbox.process(&mut c, &e2).await?,
        Outcome::Duplicate { result: None }
    ));
    Ok(())
}

#[tokio::test]
async fn resync_to_an_older_version_is_refused() -> Result<()> {
    let (mut c, _) = consumer_db(cluster(), "back").await?;
    let handler = Projection::ordered("shipping", Duration::ZERO);
    let inbox = Inbox::new(handler.clone());
    inbox
        .process(&mut c, &event(Uuid::now_v7(), "o-1", 1, "a"))
        .await?;
    inbox
        .process(&mut c, &event(Uuid::now_v7(), "o-1", 2, "b"))
        .await?;
    inbox
        .process(&mut c, &event(Uuid::now_v7(), "o-1", 5, "e"))
        .await?;
    *handler.on_gap.lock().unwrap() = GapResolution::Resynced { version: 1 };
    let err = inbox
        .sweep_at(&mut c, chrono::Utc::now() + chrono::Duration::hours(1))
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        InboxError::ResyncBackwards {
            current: 2,
            to: 1,
            ..
        }
    ));
    assert_eq!(count(&c, "SELECT count(*) FROM inbox_held_event").await?, 1);
    Ok(())
}

#[tokio::test]
async fn side_effect_ledger_never_repeats_a_call_blindly() -> Result<()> {
    let (mut c, _) = consumer_db(cluster(), "ledger").await?;
    let ledger = Ledger::new("mailer");
    let (ev_a, ev_b) = (Uuid::now_v7(), Uuid::now_v7());
    let tx = c.transaction().await?;
    let key_a = ledger
        .record(&tx, ev_a, "welcome_email", &json!({"to": "user-1"}))
        .await?;
    let key_b = ledger
        .record(&tx, ev_b, "welcome_email", &json!({}))
        .await?;
    // Recording twice (a redelivery inside a retried handler) keeps one row.
    ledger
        .record(&tx, ev_a, "welcome_email", &json!({}))
        .await?;
    tx.commit().await?;
    assert_eq!(key_a, format!("{ev_a}:welcome_email"));
    assert_eq!(ledger.pending(&c, 10).await?.len(), 2);

    let calls = Arc::new(AtomicUsize::new(0));
    let send = |ok: bool| {
        let calls = calls.clone();
        move |key: String| async move {
            calls.fetch_add(1, AtomicOrdering::SeqCst);
            assert!(key.ends_with(":welcome_email"));
            if ok {
                Ok(json!({"message_id": "m-1"}))
            } else {
                Err(EffectError::Unknown("timeout".into()))
            }
        }
    };

    assert_eq!(
        ledger.perform(&c, &key_a, send(true)).await?,
        EffectOutcome::Done(json!({"message_id": "m-1"}))
    );
    assert_eq!(
        ledger.perform(&c, &key_a, send(true)).await?,
        EffectOutcome::AlreadyDone(Some(json!({"message_id": "m-1"})))
    );
    assert_eq!(calls.load(AtomicOrdering::SeqCst), 1);

    // A worker claims B and dies mid-call: the next claim sees an unknown outcome.
    assert_eq!(
        ledger.claim(&c, &key_b).await?,
        Claim::Proceed { attempt: 1 }
    );
    assert_eq!(
        ledger.perform(&c, &key_b, send(true)).await?,
        EffectOutcome::Unknown
    );
    assert_eq!(calls.load(AtomicOrdering::SeqCst), 1, "not called blindly");
    // Reconciliation: the provider has no such message, so it may be sent again.
    ledger
        .resolve_unknown(&c, &key_b, Resolution::NotPerformed)
        .await?;
    assert_eq!(
        ledger.perform(&c, &key_b, send(false)).await?,
        EffectOutcome::Unknown
    );
    assert_eq!(calls.load(AtomicOrdering::SeqCst), 2);
    let state: String = c
        .query_one(
            "SELECT state FROM inbox_side_effect WHERE operation_key = $1",
            &[&key_b],
        )
        .await?
        .get(0);
    assert_eq!(state, "unknown");
    assert!(ledger.pending(&c, 10).await?.is_empty());
    Ok(())
}

#[tokio::test]
async fn retention_refuses_to_go_below_the_redelivery_and_dr_windows() -> Result<()> {
    let (mut c, _) = consumer_db(cluster(), "retention").await?;
    let inbox = Inbox::new(Projection::new("shipping", Ordering::Unordered));
    for i in 0..5 {
        inbox
            .process(&mut c, &event(Uuid::now_v7(), &format!("o-{i}"), 1, "x"))
            .await?;
    }
    c.execute(
        "UPDATE processed_event SET processed_at = now() - interval '40 days'
          WHERE aggregate_id IN ('o-0', 'o-1', 'o-2')",
        &[],
    )
    .await?;
    let day = Duration::from_secs(86_400);
    let policy = RetentionPolicy::new(7 * day, 30 * day);
    assert_eq!(policy.minimum(), 30 * day);
    let err = policy
        .prune(&c, "shipping", day, 100, 10)
        .await
        .unwrap_err();
    assert!(matches!(err, InboxError::RetentionTooShort { .. }));
    assert_eq!(count(&c, "SELECT count(*) FROM processed_event").await?, 5);

    let deleted = policy.prune(&c, "shipping", 31 * day, 2, 10).await?;
    assert_eq!(deleted, 3);
    assert_eq!(count(&c, "SELECT count(*) FROM processed_event").await?, 2);
    // Another consumer's rows are never touched.
    assert_eq!(policy.prune(&c, "other", 31 * day, 2, 10).await?, 0);
    Ok(())
}
