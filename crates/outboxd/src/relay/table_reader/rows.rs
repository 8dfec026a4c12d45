//! Where the table reader's rows come from: the outbox table's columns as pgoutput announces
//! them, read as their text output, through a cursor (recovery) or in keyset pages (replay).

use crate::config::tables::OutboxTable;
use crate::config::Config;
use crate::error::RelayError;
use crate::relay::pgoutput::{Column, Relation};
use crate::relay::source::quote_ident;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, SimpleQueryMessage};

/// A row's place in the replay order ([`Order`]), as text: aggregate type, aggregate id, then
/// the version (or, without a version column, the row's `ctid`), then `event_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    pub keys: Vec<String>,
}

impl Position {
    /// The last row's `event_id` (for people).
    pub fn event_id(&self) -> &str {
        self.keys.last().map_or("", String::as_str)
    }

    /// How it is stored (`outboxd_replay.cursor_id`): a JSON array of the keys.
    pub fn to_text(&self) -> String {
        serde_json::Value::from(self.keys.clone()).to_string()
    }

    /// `None` for anything but a stored position of this order (a cursor of an older outboxd,
    /// which read in `(created_at, event_id)` order, cannot be continued in this one).
    pub fn from_text(t: &str) -> Option<Self> {
        let keys: Vec<String> = serde_json::from_str(t).ok()?;
        (keys.len() == 4).then_some(Self { keys })
    }
}

/// The replay order: per aggregate, by version, so a consumer sees an aggregate's events in
/// version order whatever their `created_at` (docs/reliability.md, "Order of republished rows").
/// Text keys compare bytewise (`COLLATE "C"`) and NULLs as empty text, so the keyset's `>` and
/// the `ORDER BY` agree. Without a version column the row's `ctid` (insertion order within the
/// table) stands in.
#[derive(Debug, Clone)]
pub struct Order {
    /// Per key: the SQL expression over `o`, the type its parameter is cast to, and where its
    /// text is in a fetched row (the `ctid` is read as an extra last column).
    keys: Vec<(String, &'static str, usize)>,
    /// The fetched rows carry the `ctid` as an extra last column.
    ctid: bool,
}

impl Order {
    fn new(relation: &Relation, names: &crate::model::columns::ColumnNames) -> Option<Self> {
        let find = |n: &str| relation.columns.iter().position(|c| c.name == n);
        let text = |i: usize| {
            let c = quote_ident(&relation.columns[i].name);
            (
                format!("COALESCE(o.{c}::text, '') COLLATE \"C\""),
                "text",
                i,
            )
        };
        let n = relation.columns.len();
        let (at, id, ev) = (
            find(&names.aggregate_type)?,
            find(&names.aggregate_id)?,
            find(&names.event_id)?,
        );
        let version = names.aggregate_version.as_deref().and_then(find);
        let third = match version {
            Some(v) => (
                format!(
                    "COALESCE(o.{}::numeric, -1e30)",
                    quote_ident(&relation.columns[v].name)
                ),
                "numeric",
                v,
            ),
            None => ("o.ctid".to_string(), "tid", n),
        };
        Some(Self {
            keys: vec![text(at), text(id), third, text(ev)],
            ctid: version.is_none(),
        })
    }

    /// A fetched row's position (its key texts), and the row without the extra `ctid`.
    fn split(&self, mut row: Vec<Option<String>>) -> (Position, Vec<Option<String>>) {
        let keys = self
            .keys
            .iter()
            .map(|(_, ty, i)| {
                let v = row.get(*i).cloned().flatten();
                match (*ty, v) {
                    (_, Some(v)) => v,
                    ("numeric", None) => "-1e30".into(),
                    (_, None) => String::new(),
                }
            })
            .collect();
        if self.ctid {
            row.pop();
        }
        (Position { keys }, row)
    }
}

/// A filter over the outbox table (alias `o`) with its parameters (`$1`…).
pub struct Filter {
    pub sql: String,
    pub params: Vec<Box<dyn ToSql + Sync + Send>>,
}

/// How the rows are read.
pub enum Rows {
    /// `FETCH` from the cursor [`Source::declare`] declared inside the caller's transaction.
    Cursor,
    /// Pages in [`Order`] after a position, each its own statement.
    Pages {
        filter: Filter,
        after: Option<Position>,
    },
}

/// Text output as the reader expects it (ISO timestamps in UTC, floats exact, bytea as `\x`
/// hex whatever the database's `bytea_output`: decoded by `model::bytea` like the stream's).
const SESSION: &str = "SET datestyle = ISO, YMD; SET timezone = UTC; SET extra_float_digits = 3; \
                       SET bytea_output = hex";

/// One connection reading the outbox table.
pub struct Source {
    pub client: Client,
    pub relation: Relation,
    pub rows: Rows,
    pub batch: usize,
    /// The replay order, when the mapping names the columns it needs.
    pub order: Option<Order>,
}

impl Source {
    /// Prepares `client` (a connection of its own) for reading. Call before opening the
    /// caller's transaction.
    pub async fn prepare_session(client: &Client) -> Result<(), RelayError> {
        Ok(client.batch_execute(SESSION).await?)
    }

    pub async fn new(table: &OutboxTable, client: Client, rows: Rows) -> Result<Self, RelayError> {
        let (relation, _) = relation_of(table, &client).await?;
        let names = table.columns.resolve()?;
        let order = Order::new(&relation, &names);
        Ok(Self {
            client,
            relation,
            rows,
            batch: 1_000,
            order,
        })
    }

    /// Declares the cursor [`Rows::Cursor`] fetches from: rows matching `filter` (SQL over
    /// alias `o`, literals only) in `order`.
    pub async fn declare(&self, filter: &str, order: &[String]) -> Result<(), RelayError> {
        Ok(self
            .client
            .batch_execute(&format!(
                "DECLARE outboxd_table_reader NO SCROLL CURSOR FOR SELECT {} FROM {} AS o \
                 WHERE {filter} ORDER BY {}",
                self.select_list(),
                qualified(&self.relation),
                order.join(", ")
            ))
            .await?)
    }

    /// `SELECT` list: every column as pgoutput would send it (its text output).
    fn select_list(&self) -> String {
        let cols: Vec<String> = self
            .relation
            .columns
            .iter()
            .map(|c| format!("o.{}::text", quote_ident(&c.name)))
            .collect();
        cols.join(", ")
    }

    /// The next batch of rows (each column's text or NULL) and, for pages, the last row's
    /// position; empty when all were read. Pages move past the batch's last row.
    pub async fn fetch(
        &mut self,
    ) -> Result<(Vec<Vec<Option<String>>>, Option<Position>), RelayError> {
        let rows = match &self.rows {
            Rows::Cursor => {
                let msgs = self
                    .client
                    .simple_query(&format!("FETCH {} FROM outboxd_table_reader", self.batch))
                    .await?;
                let rows = msgs
                    .into_iter()
                    .filter_map(|m| match m {
                        SimpleQueryMessage::Row(r) => {
                            Some((0..r.len()).map(|i| r.get(i).map(str::to_string)).collect())
                        }
                        _ => None,
                    })
                    .collect();
                return Ok((rows, None));
            }
            Rows::Pages { filter, after } => self.page(filter, after.as_ref()).await?,
        };
        let order = self.order.as_ref().ok_or_else(no_order)?;
        let mut last = None;
        let rows = rows
            .into_iter()
            .map(|r| {
                let (p, r) = order.split(r);
                last = Some(p);
                r
            })
            .collect();
        if let Rows::Pages { after, .. } = &mut self.rows {
            if last.is_some() {
                after.clone_from(&last);
            }
        }
        Ok((rows, last))
    }

    async fn page(
        &self,
        filter: &Filter,
        after: Option<&Position>,
    ) -> Result<Vec<Vec<Option<String>>>, RelayError> {
        let order = self.order.as_ref().ok_or_else(no_order)?;
        let mut params: Vec<&(dyn ToSql + Sync)> = filter
            .params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        let exprs: Vec<&str> = order.keys.iter().map(|(e, _, _)| e.as_str()).collect();
        let keyset = match after {
            Some(p) => {
                let mut placeholders = Vec::new();
                for ((_, ty, _), k) in order.keys.iter().zip(&p.keys) {
                    params.push(k);
                    let cast = match *ty {
                        "text" => format!("${}::text COLLATE \"C\"", params.len()),
                        ty => format!("${}::text::{ty}", params.len()),
                    };
                    placeholders.push(cast);
                }
                format!(
                    " AND ({}) > ({})",
                    exprs.join(", "),
                    placeholders.join(", ")
                )
            }
            None => String::new(),
        };
        let extra = if order.ctid { ", o.ctid::text" } else { "" };
        let q = format!(
            "SELECT {}{extra} FROM {} AS o WHERE ({}){keyset} ORDER BY {} LIMIT {}",
            self.select_list(),
            qualified(&self.relation),
            filter.sql,
            exprs.join(", "),
            self.batch
        );
        let rows = self.client.query(&q, &params).await?;
        Ok(rows
            .iter()
            .map(|r| {
                (0..r.len())
                    .map(|i| r.get::<_, Option<String>>(i))
                    .collect()
            })
            .collect())
    }
}

fn no_order() -> RelayError {
    RelayError::Setup(
        "the outbox mapping does not name the columns the replay order needs (aggregate type, \
         aggregate id, event_id)"
            .into(),
    )
}

fn qualified(rel: &Relation) -> String {
    format!("{}.{}", quote_ident(&rel.namespace), quote_ident(&rel.name))
}

/// The outbox table's columns as pgoutput announces them (no dropped or generated columns),
/// with each column's SQL type.
pub async fn relation(
    cfg: &Config,
    client: &Client,
) -> Result<(Relation, Vec<String>), RelayError> {
    let (schema, table) = cfg.table_name();
    relation_named(schema, table, client).await
}

/// [`relation`] of one listed table.
pub async fn relation_of(
    table: &OutboxTable,
    client: &Client,
) -> Result<(Relation, Vec<String>), RelayError> {
    match relation_named(table.schema.clone(), table.name.clone(), client).await {
        // A pattern's table renamed out (or dropped) since the session resolved it: a new
        // session resolves the tables again (issue 56, found by the sequence test: a recovery
        // stopped the relay with "not found").
        Err(RelayError::Setup(m)) if table.discovered.is_some() && m.ends_with(" not found") => {
            Err(RelayError::TablesChanged(format!(
                "{} (renamed or dropped while it was being read)",
                table.label()
            )))
        }
        r => r,
    }
}

async fn relation_named(
    schema: String,
    table: String,
    client: &Client,
) -> Result<(Relation, Vec<String>), RelayError> {
    let rows = client
        .query(
            "SELECT c.oid, a.attname::text, a.atttypid, format_type(a.atttypid, a.atttypmod), \
                    a.atttypmod \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_attribute a ON a.attrelid = c.oid \
             WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
               AND a.attgenerated = '' ORDER BY a.attnum",
            &[&schema, &table],
        )
        .await?;
    let id: u32 = rows
        .first()
        .map(|r| r.get(0))
        .ok_or_else(|| RelayError::Setup(format!("outbox table {schema}.{table} not found")))?;
    let relation = Relation {
        id,
        namespace: schema,
        name: table,
        columns: rows
            .iter()
            .map(|r| Column {
                name: r.get(1),
                type_oid: r.get(2),
                type_modifier: r.get(4),
            })
            .collect(),
    };
    Ok((relation, rows.iter().map(|r| r.get(3)).collect()))
}
