//! Shared test fixtures: a consumer database with a small projection, and a recording handler.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use outboxd_inbox::{Envelope, Gap, GapResolution, Handler, HandlerError, Ordering};
use outboxd_testkit::Postgres;
use serde_json::{json, Value};
use tokio_postgres::{Client, Transaction};
use uuid::Uuid;

/// One cluster per test process, removed at exit (testkit's `shared_cluster`).
pub fn cluster() -> &'static Postgres {
    outboxd_testkit::shared_cluster()
}

/// A fresh consumer database with the inbox schema and the projection tables.
pub async fn consumer_db(pg: &Postgres, prefix: &str) -> Result<(Client, String)> {
    static N: AtomicUsize = AtomicUsize::new(0);
    let name = format!("{prefix}_{}", N.fetch_add(1, AtomicOrdering::SeqCst));
    pg.create_database(&name).await?;
    let c = pg.connect(&name).await?;
    outboxd_inbox::migrate(&c).await?;
    c.batch_execute(
        "CREATE TABLE shipment (order_id text PRIMARY KEY, status text NOT NULL,
                                version bigint NOT NULL);
         CREATE TABLE apply_log (seq bigserial PRIMARY KEY, event_id uuid NOT NULL,
                                 order_id text NOT NULL, version bigint NOT NULL);",
    )
    .await?;
    Ok((c, name))
}

/// Projects order events into `shipment`, logging every application in `apply_log`.
pub struct Projection {
    pub name: String,
    pub ordering: Ordering,
    /// Fail the next `apply` AFTER its business update (R32).
    pub fail_next: AtomicBool,
    pub gaps: Mutex<Vec<Gap>>,
    pub on_gap: Mutex<GapResolution>,
}

impl Projection {
    pub fn new(name: &str, ordering: Ordering) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            ordering,
            fail_next: AtomicBool::new(false),
            gaps: Mutex::new(Vec::new()),
            on_gap: Mutex::new(GapResolution::KeepHolding),
        })
    }

    pub fn ordered(name: &str, hold_for: Duration) -> Arc<Self> {
        Self::new(name, Ordering::PerAggregate { hold_for })
    }
}

impl Handler for Projection {
    fn name(&self) -> &str {
        &self.name
    }

    fn ordering(&self) -> Ordering {
        self.ordering
    }

    async fn apply(&self, tx: &Transaction<'_>, event: &Envelope) -> Result<Value, HandlerError> {
        let body: Value = event.payload_as()?;
        let status = body["status"].as_str().unwrap_or("?").to_string();
        tx.execute(
            "INSERT INTO shipment (order_id, status, version) VALUES ($1, $2, $3)
             ON CONFLICT (order_id) DO UPDATE SET status = $2, version = $3",
            &[&event.aggregate_id, &status, &event.aggregate_version],
        )
        .await?;
        tx.execute(
            "INSERT INTO apply_log (event_id, order_id, version) VALUES ($1, $2, $3)",
            &[
                &event.event_id,
                &event.aggregate_id,
                &event.aggregate_version,
            ],
        )
        .await?;
        if self.fail_next.swap(false, AtomicOrdering::SeqCst) {
            return Err(HandlerError::transient(
                "injected failure after the business update",
            ));
        }
        Ok(json!({ "shipment_status": status, "version": event.aggregate_version }))
    }

    async fn on_gap_timeout(
        &self,
        tx: &Transaction<'_>,
        gap: &Gap,
    ) -> Result<GapResolution, HandlerError> {
        self.gaps.lock().unwrap().push(gap.clone());
        let resolution = self.on_gap.lock().unwrap().clone();
        if let GapResolution::Resynced { version } = resolution {
            // "Fetch the source of truth": here, a fixed snapshot at `version`.
            tx.execute(
                "INSERT INTO shipment (order_id, status, version) VALUES ($1, 'resynced', $2)
                 ON CONFLICT (order_id) DO UPDATE SET status = 'resynced', version = $2",
                &[&gap.aggregate_id, &version],
            )
            .await?;
        }
        Ok(resolution)
    }
}

/// An envelope as the relay would deliver it.
pub fn event(event_id: Uuid, order_id: &str, version: i64, status: &str) -> Envelope {
    Envelope {
        event_id,
        event_type: "OrderStatusChanged".into(),
        aggregate_type: "order".into(),
        aggregate_id: order_id.into(),
        aggregate_version: version,
        schema_version: 1,
        payload: serde_json::to_vec(&json!({ "status": status })).unwrap(),
        headers: BTreeMap::new(),
        committed_at: Some(chrono::Utc::now()),
        source: None,
    }
}

/// `(event_id, version)` in application order.
pub async fn applied(c: &Client, order_id: &str) -> Result<Vec<(Uuid, i64)>> {
    Ok(c.query(
        "SELECT event_id, version FROM apply_log WHERE order_id = $1 ORDER BY seq",
        &[&order_id],
    )
    .await?
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect())
}

pub async fn count(c: &Client, sql: &str) -> Result<i64> {
    Ok(c.query_one(sql, &[]).await?.get(0))
}
