//! `parked retry --payload FILE`: what the file holds depends on the table's payload column,
//! read from the catalog as the live router reads it ([`RowMapping::payload_kind`]): for a
//! bytea table the file's raw bytes (an Avro or Protobuf body, registry framing included) are
//! the corrected payload as they are; for a json/jsonb/text table it must be JSON.

use crate::config::tables::OutboxTable;
use crate::error::RelayError;
use crate::relay::route::{PayloadKind, RowMapping};
use crate::relay::table_reader::relation_of;
use std::path::Path;

/// A corrected payload as read from its file.
pub enum Read {
    Json(serde_json::Value),
    Bytes(Vec<u8>),
}

/// Reads `path` as the corrected payload of an event of `table`.
pub async fn read(
    table: &OutboxTable,
    sql: &tokio_postgres::Client,
    path: &Path,
) -> Result<Read, RelayError> {
    let bytes = std::fs::read(path)
        .map_err(|e| RelayError::Setup(format!("cannot read {}: {e}", path.display())))?;
    let (relation, _) = relation_of(table, sql).await?;
    let names = table.columns.resolve()?;
    let mapping = RowMapping::resolve(&names, &relation, &mut Vec::new())?;
    if mapping.payload_kind() == PayloadKind::Bytes {
        return Ok(Read::Bytes(bytes));
    }
    serde_json::from_slice(&bytes).map(Read::Json).map_err(|e| {
        RelayError::Setup(format!(
            "{} is not JSON: {e} (the payload column of {} is not bytea, so the corrected \
             payload must be JSON)",
            path.display(),
            table.label()
        ))
    })
}
