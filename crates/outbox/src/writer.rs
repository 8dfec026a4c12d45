//! [`Outbox`]: inserts a command's events into the outbox table through the caller's open
//! transaction, and nowhere else.
//!
//! The signature takes `&Transaction`, not a client: an event can only be written as part of a
//! business transaction, so "write then send" or an autocommit insert that outlives a rolled-back
//! business change cannot be expressed (R1, R10).

use chrono::{DateTime, Utc};
use tokio_postgres::error::SqlState;
use tokio_postgres::Transaction;
use uuid::Uuid;

use crate::error::ConflictSource;
use crate::event::{AggregateRef, NewEvent};
use crate::ident::QualifiedName;
use crate::OutboxError;

/// Default limit on one serialised payload: half of Kafka's default `message.max.bytes`
/// (~1 MiB), leaving room for headers and a later schema addition.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 512 * 1024;

/// Default outbox table, as created by `sql/001_outbox.sql`.
pub const DEFAULT_TABLE: &str = "public.outbox";

/// A row this transaction inserted (visible to others only once the caller commits).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendedEvent {
    pub event_id: Uuid,
    pub aggregate_version: i64,
    /// `now()` of the inserting transaction, i.e. the Kafka record timestamp later on.
    pub created_at: DateTime<Utc>,
}

/// The producer-side writer. Cheap to clone; holds configuration only, no connection.
#[derive(Clone, Debug)]
pub struct Outbox {
    table: QualifiedName,
    max_payload_bytes: usize,
    insert_sql: String,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::with_table(DEFAULT_TABLE).expect("default table name is valid")
    }
}

impl Outbox {
    /// Writer for `public.outbox` with [`DEFAULT_MAX_PAYLOAD_BYTES`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Writer for another table of the same shape (`schema.table` or `table`).
    pub fn with_table(table: &str) -> Result<Self, OutboxError> {
        let table = QualifiedName::parse("outbox table", table)?;
        // One statement for any number of events: arrays are unnested server-side, so a
        // command costs one round trip and the statement is prepared once per connection.
        let insert_sql = format!(
            "INSERT INTO {} (event_id, aggregate_type, aggregate_id, aggregate_version, \
             event_type, schema_version, payload, headers) \
             SELECT e.id, $1, $2, e.version, e.event_type, e.schema_version, \
                    e.payload::jsonb, e.headers::jsonb \
             FROM unnest($3::uuid[], $4::bigint[], $5::text[], $6::int[], $7::text[], $8::text[]) \
                  AS e(id, version, event_type, schema_version, payload, headers) \
             RETURNING event_id, aggregate_version, created_at",
            table.quoted()
        );
        Ok(Self {
            table,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            insert_sql,
        })
    }

    /// Changes the payload size limit (bytes of the serialised JSON).
    pub fn max_payload_bytes(mut self, limit: usize) -> Self {
        self.max_payload_bytes = limit;
        self
    }

    /// The configured table, `schema.table`.
    pub fn table(&self) -> String {
        self.table.display()
    }

    /// Appends `events` for `aggregate` inside `tx`, with versions `expected_version + 1`,
    /// `+ 2`, ... in the order given (R11).
    ///
    /// `expected_version` is the aggregate version the command validated against (0 for a new
    /// aggregate). Pair this with [`crate::VersionGuard::advance`] (or your own conditional
    /// UPDATE checked by [`crate::expect_one_row`]) to move the business row to
    /// `expected_version + events.len()` in the same transaction.
    ///
    /// On any error the transaction is unusable for committing this command: a unique violation
    /// has already aborted it in Postgres, and the caller should drop it (roll back).
    pub async fn append(
        &self,
        tx: &Transaction<'_>,
        aggregate: &AggregateRef,
        expected_version: i64,
        events: &[NewEvent],
    ) -> Result<Vec<AppendedEvent>, OutboxError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        if expected_version < 0 {
            return Err(OutboxError::invalid(
                "expected_version",
                format!("{expected_version} is negative"),
            ));
        }
        for e in events {
            if e.payload.len() > self.max_payload_bytes {
                return Err(OutboxError::PayloadTooLarge {
                    event_type: e.event_type.clone(),
                    size: e.payload.len(),
                    limit: self.max_payload_bytes,
                });
            }
        }
        let ids: Vec<Uuid> = events.iter().map(|e| e.event_id).collect();
        let versions: Vec<i64> = (1..=events.len() as i64)
            .map(|i| expected_version + i)
            .collect();
        let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
        let schema_versions: Vec<i32> = events.iter().map(|e| e.schema_version).collect();
        let payloads: Vec<&str> = events.iter().map(|e| e.payload.as_str()).collect();
        let headers: Vec<Option<String>> = events.iter().map(NewEvent::headers_json).collect();

        let rows = tx
            .query(
                &self.insert_sql,
                &[
                    &aggregate.aggregate_type(),
                    &aggregate.aggregate_id(),
                    &ids,
                    &versions,
                    &types,
                    &schema_versions,
                    &payloads,
                    &headers,
                ],
            )
            .await
            .map_err(|e| self.classify(e, aggregate, expected_version, &ids))?;

        let mut out: Vec<AppendedEvent> = rows
            .iter()
            .map(|r| AppendedEvent {
                event_id: r.get(0),
                aggregate_version: r.get(1),
                created_at: r.get(2),
            })
            .collect();
        out.sort_by_key(|e| e.aggregate_version);
        for e in &out {
            tracing::debug!(
                event_id = %e.event_id,
                aggregate_type = aggregate.aggregate_type(),
                aggregate_id = aggregate.aggregate_id(),
                aggregate_version = e.aggregate_version,
                "outbox row inserted (visible once the caller commits)"
            );
        }
        Ok(out)
    }

    /// Maps unique violations to the two errors callers branch on. The primary key
    /// (`<table>_pkey`, Postgres' default name) guards `event_id`; any other unique constraint
    /// on the table is the `(aggregate_type, aggregate_id, aggregate_version)` one.
    fn classify(
        &self,
        err: tokio_postgres::Error,
        aggregate: &AggregateRef,
        expected_version: i64,
        ids: &[Uuid],
    ) -> OutboxError {
        let Some(db) = err.as_db_error() else {
            return err.into();
        };
        if db.code() != &SqlState::UNIQUE_VIOLATION {
            return err.into();
        }
        if db.constraint().is_some_and(|c| c.ends_with("_pkey")) {
            tracing::warn!(
                aggregate_type = aggregate.aggregate_type(),
                aggregate_id = aggregate.aggregate_id(),
                event_ids = ?ids,
                "command already committed: event id exists in the outbox"
            );
            return OutboxError::EventAlreadyRecorded {
                event_ids: ids.to_vec(),
            };
        }
        tracing::warn!(
            aggregate_type = aggregate.aggregate_type(),
            aggregate_id = aggregate.aggregate_id(),
            expected_version,
            "version conflict: (aggregate, version) already in the outbox"
        );
        OutboxError::VersionConflict {
            aggregate_type: aggregate.aggregate_type().to_string(),
            aggregate_id: aggregate.aggregate_id().to_string(),
            expected: expected_version,
            source_kind: ConflictSource::UniqueVersion,
        }
    }
}
