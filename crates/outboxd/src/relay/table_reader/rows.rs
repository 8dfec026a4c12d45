//! Where the table reader's rows come from: the outbox table's columns as pgoutput announces
//! them, read as their text output, through a cursor (recovery) or in keyset pages (replay).

use crate::config::Config;
use crate::error::RelayError;
use crate::relay::pgoutput::{Column, Relation};
use crate::relay::source::quote_ident;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, SimpleQueryMessage};

/// A row's place in the replay order: `created_at` and `event_id` as Postgres prints them
/// (the reader's session prints timestamps in ISO format, UTC, so the text reads back exactly).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    pub created_at: String,
    pub event_id: String,
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
    /// Pages in `(created_at, event_id)` order after a position, each its own statement.
    Pages {
        filter: Filter,
        after: Option<Position>,
    },
}

/// Text output as the reader expects it (ISO timestamps in UTC, floats exact).
const SESSION: &str = "SET datestyle = ISO, YMD; SET timezone = UTC; SET extra_float_digits = 3";

/// One connection reading the outbox table.
pub struct Source {
    pub client: Client,
    pub relation: Relation,
    /// `format_type` of each column (casts of parameters compared with a column).
    types: Vec<String>,
    pub rows: Rows,
    pub batch: usize,
    /// Indexes of `created_at` and `event_id` in the relation, when created_at is mapped.
    pub key: Option<(usize, usize)>,
}

impl Source {
    /// Prepares `client` (a connection of its own) for reading. Call before opening the
    /// caller's transaction.
    pub async fn prepare_session(client: &Client) -> Result<(), RelayError> {
        Ok(client.batch_execute(SESSION).await?)
    }

    pub async fn new(cfg: &Config, client: Client, rows: Rows) -> Result<Self, RelayError> {
        let (relation, types) = relation(cfg, &client).await?;
        let names = cfg.source.columns.resolve()?;
        let find = |n: &str| relation.columns.iter().position(|c| c.name == n);
        let key = names
            .created_at
            .as_deref()
            .and_then(find)
            .zip(find(&names.event_id));
        Ok(Self {
            client,
            relation,
            types,
            rows,
            batch: 1_000,
            key,
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

    /// The next batch of rows (each column's text or NULL); empty when all were read. Pages
    /// move past the batch's last row.
    pub async fn fetch(&mut self) -> Result<Vec<Vec<Option<String>>>, RelayError> {
        let rows = match &self.rows {
            Rows::Cursor => {
                let msgs = self
                    .client
                    .simple_query(&format!("FETCH {} FROM outboxd_table_reader", self.batch))
                    .await?;
                return Ok(msgs
                    .into_iter()
                    .filter_map(|m| match m {
                        SimpleQueryMessage::Row(r) => {
                            Some((0..r.len()).map(|i| r.get(i).map(str::to_string)).collect())
                        }
                        _ => None,
                    })
                    .collect());
            }
            Rows::Pages { filter, after } => self.page(filter, after.as_ref()).await?,
        };
        if let Some(last) = rows.last() {
            // A row without a position would make the next page start here again (the
            // filter excludes such rows; a changed table might not).
            let p = self.position(last).ok_or_else(|| {
                RelayError::Setup(
                    "an outbox row without created_at or event_id was read in keyset order".into(),
                )
            })?;
            if let Rows::Pages { after, .. } = &mut self.rows {
                *after = Some(p);
            }
        }
        Ok(rows)
    }

    async fn page(
        &self,
        filter: &Filter,
        after: Option<&Position>,
    ) -> Result<Vec<Vec<Option<String>>>, RelayError> {
        let (ts, id) = self.key.ok_or_else(|| {
            RelayError::Setup(
                "the outbox mapping has no created_at column (source.columns.created_at): rows \
                 cannot be read in a stable order"
                    .into(),
            )
        })?;
        let id_type = &self.types[id];
        let ts = quote_ident(&self.relation.columns[ts].name);
        let id = quote_ident(&self.relation.columns[id].name);
        let mut params: Vec<&(dyn ToSql + Sync)> = filter
            .params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        let n = params.len();
        let keyset = match after {
            Some(p) => {
                params.push(&p.created_at);
                params.push(&p.event_id);
                format!(
                    " AND (o.{ts}, o.{id}) > (${}::text::timestamptz, CAST(${}::text AS {id_type}))",
                    n + 1,
                    n + 2
                )
            }
            None => String::new(),
        };
        let q = format!(
            "SELECT {} FROM {} AS o WHERE ({}){keyset} ORDER BY o.{ts}, o.{id} LIMIT {}",
            self.select_list(),
            qualified(&self.relation),
            filter.sql,
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

    /// Where `row` sits in `(created_at, event_id)` order, when created_at is mapped.
    pub fn position(&self, row: &[Option<String>]) -> Option<Position> {
        let (ts, id) = self.key?;
        Some(Position {
            created_at: row.get(ts)?.clone()?,
            event_id: row.get(id)?.clone()?,
        })
    }
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
