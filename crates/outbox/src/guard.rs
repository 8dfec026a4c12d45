//! Optimistic concurrency on the business row (R10): the command read version `v`, so its
//! update only applies `WHERE version = v`. Zero rows means someone else won; that is a typed
//! error, and the caller drops the transaction so nothing of the command is committed.

use tokio_postgres::types::ToSql;
use tokio_postgres::Transaction;

use crate::error::ConflictSource;
use crate::event::AggregateRef;
use crate::ident::{Ident, QualifiedName};
use crate::OutboxError;

/// Checks the row count of a conditional update you wrote yourself
/// (`UPDATE ... WHERE id = $1 AND version = $2`): exactly one row, or a
/// [`OutboxError::VersionConflict`]. More than one row is a broken WHERE clause and is reported
/// as invalid, never committed.
pub fn expect_one_row(
    affected: u64,
    aggregate: &AggregateRef,
    expected_version: i64,
) -> Result<(), OutboxError> {
    match affected {
        1 => Ok(()),
        0 => {
            tracing::warn!(
                aggregate_type = aggregate.aggregate_type(),
                aggregate_id = aggregate.aggregate_id(),
                expected_version,
                "version conflict: conditional update matched no row"
            );
            Err(OutboxError::VersionConflict {
                aggregate_type: aggregate.aggregate_type().to_string(),
                aggregate_id: aggregate.aggregate_id().to_string(),
                expected: expected_version,
                source_kind: ConflictSource::ExpectedVersion,
            })
        }
        n => Err(OutboxError::invalid(
            "conditional update",
            format!(
                "updated {n} rows for {}/{}; the WHERE clause must select one aggregate",
                aggregate.aggregate_type(),
                aggregate.aggregate_id()
            ),
        )),
    }
}

/// A conditional version bump on a business table: `UPDATE table SET version = new WHERE id =
/// $id AND version = expected`. Run it first in the command's transaction; it also takes the
/// row lock, so the rest of the command works on a version nobody else can move.
#[derive(Clone, Debug)]
pub struct VersionGuard {
    sql: String,
}

impl VersionGuard {
    /// `table` as `schema.table` or `table`; column names are plain identifiers.
    pub fn new(table: &str, id_column: &str, version_column: &str) -> Result<Self, OutboxError> {
        let table = QualifiedName::parse("aggregate table", table)?;
        let id = Ident::parse("id column", id_column)?.quoted();
        let version = Ident::parse("version column", version_column)?.quoted();
        let sql = format!(
            "UPDATE {} SET {version} = $3 WHERE {id} = $1 AND {version} = $2",
            table.quoted()
        );
        Ok(Self { sql })
    }

    /// Moves the row identified by `id` from `expected_version` to `new_version`, or fails with
    /// [`OutboxError::VersionConflict`]. `id` is the business key in its own SQL type (uuid,
    /// bigint, text...); `aggregate` is only used for the error and the log line.
    pub async fn advance(
        &self,
        tx: &Transaction<'_>,
        aggregate: &AggregateRef,
        id: &(dyn ToSql + Sync),
        expected_version: i64,
        new_version: i64,
    ) -> Result<(), OutboxError> {
        if new_version <= expected_version {
            return Err(OutboxError::invalid(
                "new_version",
                format!("{new_version} does not move past {expected_version}"),
            ));
        }
        let n = tx
            .execute(&self.sql, &[id, &expected_version, &new_version])
            .await?;
        expect_one_row(n, aggregate, expected_version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_count_is_checked() {
        let a = AggregateRef::new("order", "o-1").unwrap();
        assert!(expect_one_row(1, &a, 3).is_ok());
        assert!(matches!(
            expect_one_row(0, &a, 3),
            Err(OutboxError::VersionConflict {
                expected: 3,
                source_kind: ConflictSource::ExpectedVersion,
                ..
            })
        ));
        assert!(matches!(
            expect_one_row(2, &a, 3),
            Err(OutboxError::Invalid { .. })
        ));
    }

    #[test]
    fn guard_sql_is_quoted() {
        let g = VersionGuard::new("shop.orders", "id", "version").unwrap();
        assert_eq!(
            g.sql,
            r#"UPDATE "shop"."orders" SET "version" = $3 WHERE "id" = $1 AND "version" = $2"#
        );
        assert!(VersionGuard::new("orders; drop", "id", "v").is_err());
    }
}
