//! Is a parked copy what the application wrote? `outbox_parked` is written by the relay's role,
//! so a leaked relay credential could park a record the application never wrote (or had parked
//! one with another payload) and let the relay publish it once its head is resolved. Before a
//! release, the relay compares the parked copy with the event's row in the outbox table — which
//! only the application writes — by `event_id`:
//!
//! - a **blocked** event (released automatically once its head is resolved) goes out only when
//!   its row is there and the copy matches it: identity, version, payload and headers. Without
//!   the row (cleanup deleted it, or an application that deletes its outbox rows right after
//!   inserting them) nothing vouches for it: it becomes a parked head (`unverified`) that an
//!   operator inspects and retries or discards;
//! - a **retry** was asked for by an operator, whose audit row the relay cannot write: the
//!   operator vouches for it. When the row is there, the identity must still match, and the
//!   payload too unless the operator corrected it (the correction is the audit row's).
//!
//! A mismatch (`tampered`) is never published; the copy stays parked with the field named.

use super::store::Release;
use crate::config::tables::{OutboxTable, SOURCE_TABLE_HEADER};
use crate::error::RelayError;
use crate::model::bytea;
use crate::model::columns::ColumnNames;
use crate::model::route::is_reserved_header;
use crate::model::route::CONTENT_TYPE_HEADER;
use crate::model::sql::quote_ident;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

/// What the outbox table says about a parked copy.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    /// Nothing to refuse: it matches the row (or an operator vouched and nothing contradicts).
    Vouched,
    /// A blocked copy with no row to compare with.
    Unverified,
    /// The copy differs from the row in this field.
    Differs(&'static str),
}

/// The check, with its query built once per session (it needs the `event_id` column's type).
pub struct Provenance {
    names: ColumnNames,
    table: String,
    /// With several tables: the `source_table` header the copy must carry (this table's
    /// `schema.table`); it is the relay's, not the row's, so not compared with the row's headers.
    tag: Option<String>,
    query: Option<String>,
    /// The payload column is bytea: the row's text is `\x…` hex, compared as its bytes.
    binary: bool,
}

impl Provenance {
    /// The check against `table`, the outbox table the parked event came from; `tagged`: the
    /// relay lists several tables (its records carry the `source_table` header).
    pub fn new(table: &OutboxTable, tagged: bool) -> Result<Self, RelayError> {
        Ok(Self {
            tag: tagged.then(|| table.label()),
            names: table.columns.resolve()?,
            table: format!(
                "{}.{}",
                quote_ident(&table.schema),
                quote_ident(&table.name)
            ),
            query: None,
            binary: false,
        })
    }

    /// Columns read, in this order: identity, version, schema version, payload, headers, then
    /// the placed (`additional`) columns.
    fn columns(&self) -> Vec<Option<&str>> {
        let n = &self.names;
        let mut c = vec![
            Some(n.aggregate_type.as_str()),
            Some(n.aggregate_id.as_str()),
            Some(n.event_type.as_str()),
            n.aggregate_version.as_deref(),
            n.schema_version.as_deref(),
            Some(n.payload.as_str()),
            n.headers.as_deref(),
        ];
        c.extend(n.additional.iter().map(|p| Some(p.column.as_str())));
        c
    }

    async fn query(&mut self, sql: &Client) -> Result<&str, RelayError> {
        if self.query.is_none() {
            let id_type: String = sql
                .query_opt(
                    "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                     WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped",
                    &[&self.table, &self.names.event_id],
                )
                .await?
                .map(|r| r.get(0))
                .ok_or_else(|| {
                    RelayError::Setup(format!(
                        "the outbox table {} has no event_id column {:?}",
                        self.table, self.names.event_id
                    ))
                })?;
            self.binary = sql
                .query_opt(
                    "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) \
                     AND attname = $2 AND atttypid = 'bytea'::regtype AND NOT attisdropped",
                    &[&self.table, &self.names.payload],
                )
                .await?
                .is_some();
            let list: Vec<String> = self
                .columns()
                .iter()
                .map(|c| match c {
                    Some(c) => format!("o.{}::text", quote_ident(c)),
                    None => "NULL::text".into(),
                })
                .collect();
            self.query = Some(format!(
                "SELECT {} FROM {} AS o WHERE o.{} = CAST($1::text AS {id_type}) LIMIT 1",
                list.join(", "),
                self.table,
                quote_ident(&self.names.event_id)
            ));
        }
        Ok(self.query.as_deref().unwrap_or_default())
    }

    /// Compares `r` with its outbox row. Errors are the database's (the release waits).
    pub async fn check(&mut self, sql: &Client, r: &Release) -> Result<Found, RelayError> {
        let q = self.query(sql).await?.to_string();
        let row = match sql.query_opt(&q, &[&r.record.event_id]).await {
            Ok(row) => row,
            // Not even of the column's type (a forged id): no row can hold it.
            Err(e) if e.code() == Some(&SqlState::INVALID_TEXT_REPRESENTATION) => None,
            Err(e) => return Err(e.into()),
        };
        let Some(row) = row else {
            return Ok(if r.retry {
                Found::Vouched
            } else {
                Found::Unverified
            });
        };
        let mut cols: Vec<Option<String>> = (0..row.len()).map(|i| row.get(i)).collect();
        if self.binary {
            if bytes_differ(r, cols[5].as_deref()) {
                return Ok(Found::Differs("payload"));
            }
            cols[5] = None;
            return Ok(compare(&self.names, self.tag.as_deref(), r, &cols, true));
        }
        Ok(compare(&self.names, self.tag.as_deref(), r, &cols, false))
    }
}

/// The comparison itself (`cols` as [`Provenance::columns`] orders them).
/// A bytea payload: the copy holds the bytes, the row its text output (hex or escape,
/// whatever the session's `bytea_output`), compared decoded. A corrected copy is the audit
/// row's, not the row's.
fn bytes_differ(r: &Release, row_text: Option<&str>) -> bool {
    if r.corrected {
        return false;
    }
    match row_text.map(|t| bytea::decode(t.as_bytes())) {
        None => r.record.payload.is_some(),
        Some(Err(_)) => true,
        Some(Ok(b)) => r.record.payload.as_deref() != Some(&b[..]),
    }
}

/// The copy and the row hold the same JSON value, written differently: `ALTER … payload TYPE
/// jsonb` (from `json` or `text`) rewrites every row in jsonb's normal form (key order,
/// spacing, duplicate keys), so the text the copy was taken from no longer exists (issue 56:
/// every held event became "tampered" and stayed parked). Values, not bytes: nothing the
/// application did not write can pass, since the row is what the application wrote.
fn same_json(copy: Option<&[u8]>, row: Option<&str>) -> bool {
    let (Some(copy), Some(row)) = (copy, row) else {
        return false;
    };
    match (
        serde_json::from_slice::<serde_json::Value>(copy),
        serde_json::from_str::<serde_json::Value>(row),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// `payload_checked`: the payload was compared already (a bytea one, as its bytes).
fn compare(
    names: &ColumnNames,
    tag: Option<&str>,
    r: &Release,
    cols: &[Option<String>],
    payload_checked: bool,
) -> Found {
    let rec = &r.record;
    // A row of a table renamed since it was parked names the table as it was: its oid chose
    // this table, whose row must then vouch for it.
    if let Some(tag) = tag.filter(|_| !r.renamed) {
        let stored = rec.headers.iter().find(|(k, _)| k == SOURCE_TABLE_HEADER);
        if stored.and_then(|(_, v)| v.as_deref()) != Some(tag) {
            return Found::Differs(SOURCE_TABLE_HEADER);
        }
    }
    let identity = [
        ("aggregate_type", &rec.aggregate_type, &cols[0]),
        ("aggregate_id", &rec.aggregate_id, &cols[1]),
        ("event_type", &rec.event_type, &cols[2]),
    ];
    for (field, stored, row) in identity {
        if stored != row {
            return Found::Differs(field);
        }
    }
    if names.aggregate_version.is_some()
        && rec.aggregate_version != cols[3].as_deref().and_then(|v| v.parse().ok())
    {
        return Found::Differs("aggregate_version");
    }
    if !r.corrected
        && !payload_checked
        && rec.payload.as_deref() != cols[5].as_deref().map(str::as_bytes)
        && !same_json(rec.payload.as_deref(), cols[5].as_deref())
    {
        return Found::Differs("payload");
    }
    if r.retry {
        // The operator saw the headers (`parked show`) and vouched for them.
        return Found::Vouched;
    }
    let header = |k: &str| {
        rec.headers
            .iter()
            .find(|(h, _)| h == k)
            .map(|(_, v)| v.clone())
    };
    if names.schema_version.is_some() && header("schema_version").flatten() != cols[4] {
        return Found::Differs("schema_version");
    }
    for (i, p) in names.additional.iter().enumerate() {
        if header(&p.header) != Some(cols[7 + i].clone()) {
            return Found::Differs("headers");
        }
    }
    // The row's own headers as the live path sends them (strings as they are, other JSON
    // values as JSON text, nulls left out), against the copy's.
    let placed = |k: &str| names.additional.iter().any(|p| &*p.header == k);
    let taken = |k: &str| {
        is_reserved_header(k)
            || names.id_header && k.eq_ignore_ascii_case("id")
            || tag.is_some() && k == SOURCE_TABLE_HEADER
            || k == crate::model::cloudevents::CREATED_AT_HEADER
            || names.content_type.is_some() && k.eq_ignore_ascii_case(CONTENT_TYPE_HEADER)
    };
    let mut stored: Vec<(String, String)> = rec
        .headers
        .iter()
        .filter(|(k, _)| !taken(k) && !placed(k))
        .filter_map(|(k, v)| Some((k.clone(), v.clone()?)))
        .collect();
    let mut row: Vec<(String, String)> = match &cols[6] {
        None => Vec::new(),
        Some(text) => {
            match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text) {
                Err(_) => return Found::Differs("headers"),
                Ok(map) => map
                    .into_iter()
                    .filter_map(|(k, v)| match v {
                        serde_json::Value::Null => None,
                        serde_json::Value::String(s) => Some((k, s)),
                        other => Some((k, other.to_string())),
                    })
                    .collect(),
            }
        }
    };
    stored.sort();
    row.sort();
    if stored != row {
        return Found::Differs("headers");
    }
    Found::Vouched
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::columns::Columns;
    use crate::poison::record::ParkedRecord;

    fn release(retry: bool, corrected: bool) -> Release {
        let h = |k: &str, v: &str| (k.to_string(), Some(v.to_string()));
        Release {
            id: 1,
            record: ParkedRecord {
                event_id: "e".into(),
                aggregate_type: Some("acct".into()),
                aggregate_id: Some("A".into()),
                aggregate_version: Some(3),
                event_type: Some("Deposited".into()),
                payload: Some(br#"{"amount": 1}"#.to_vec()),
                headers: vec![
                    h("event_id", "e"),
                    h("aggregate_version", "3"),
                    h("schema_version", "1"),
                    h("traceparent", "00-1"),
                    h("n", "2"),
                ],
                ..ParkedRecord::default()
            },
            retry,
            corrected,
            parked_payload: None,
            blocks_aggregate: true,
            blocked_by: None,
            tag: None,
            relid: None,
            renamed: false,
        }
    }

    fn row() -> Vec<Option<String>> {
        [
            Some("acct"),
            Some("A"),
            Some("Deposited"),
            Some("3"),
            Some("1"),
            Some(r#"{"amount": 1}"#),
            Some(r#"{"traceparent": "00-1", "n": 2, "gone": null}"#),
        ]
        .iter()
        .map(|v| v.map(str::to_string))
        .collect()
    }

    #[test]
    fn a_blocked_copy_must_match_its_row_in_every_field_the_record_carries() {
        let names = Columns::default().resolve().unwrap();
        assert_eq!(
            compare(&names, None, &release(false, false), &row(), false),
            Found::Vouched
        );
        for (i, field, bad) in [
            (1, "aggregate_id", "B"),
            (3, "aggregate_version", "4"),
            (5, "payload", r#"{"amount": 1000}"#),
            (6, "headers", r#"{"traceparent": "00-1"}"#),
            (4, "schema_version", "2"),
        ] {
            let mut r = row();
            r[i] = Some(bad.to_string());
            assert_eq!(
                compare(&names, None, &release(false, false), &r, false),
                Found::Differs(field)
            );
        }
    }

    #[test]
    fn a_payload_rewritten_by_a_type_change_to_jsonb_still_matches() {
        let names = Columns::default().resolve().unwrap();
        let mut rel = release(false, false);
        rel.record.payload = Some(br#"{"b":[1, 2],"amount":1,"amount":2}"#.to_vec());
        let mut r = row();
        // What jsonb makes of it: keys sorted, spacing normal, the last duplicate kept.
        r[5] = Some(r#"{"b": [1, 2], "amount": 2}"#.into());
        assert_eq!(compare(&names, None, &rel, &r, false), Found::Vouched);
        r[5] = Some(r#"{"b": [1, 2], "amount": 3}"#.into());
        assert_eq!(
            compare(&names, None, &rel, &r, false),
            Found::Differs("payload")
        );
        r[5] = Some("not json".into());
        assert_eq!(
            compare(&names, None, &rel, &r, false),
            Found::Differs("payload")
        );
    }

    #[test]
    fn an_operators_retry_is_vouched_for_but_not_under_another_identity() {
        let names = Columns::default().resolve().unwrap();
        let mut r = row();
        r[5] = Some("{}".into());
        r[6] = None;
        // A corrected payload is the audit row's; the headers are what the operator saw.
        assert_eq!(
            compare(&names, None, &release(true, true), &r, false),
            Found::Vouched
        );
        assert_eq!(
            compare(&names, None, &release(true, false), &r, false),
            Found::Differs("payload")
        );
        r[2] = Some("Withdrawn".into());
        assert_eq!(
            compare(&names, None, &release(true, true), &r, false),
            Found::Differs("event_type")
        );
    }

    #[test]
    fn a_bytea_payload_is_compared_as_its_bytes() {
        let mut r = release(false, false);
        r.record.payload = Some(vec![0, 0xff, b'\\']);
        assert!(!bytes_differ(&r, Some("\\x00ff5c")));
        assert!(!bytes_differ(&r, Some("\\000\\377\\\\")));
        assert!(bytes_differ(&r, Some("\\x00ff5d")));
        assert!(bytes_differ(&r, Some("\\x0")));
        assert!(bytes_differ(&r, None));
        // The operator's correction is the audit row's.
        assert!(!bytes_differ(&release(true, true), Some("\\x01")));
    }
}
