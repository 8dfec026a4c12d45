//! Which outbox table's routing and checks a released parked event goes through (issue 56):
//! its table by oid wherever that table is now — renamed or moved within the relayed set, it
//! keeps its route; two tables that swapped names never swap — and by the `source_table`
//! header when the row has no oid (parked by an earlier version) or its table is gone.

use crate::config::policy::{NullPayload, PolicyConfig};
use crate::config::tables::{stored_table, OutboxTable, ParkedTable};
use crate::config::Config;
use crate::error::RelayError;
use crate::model::topic::TopicTemplate;
use crate::poison::provenance::Provenance;
use crate::poison::store::{self as parking, Release};
use crate::poison::validate::Validator;
use tokio_postgres::Client;

/// What a released event of one outbox table goes through: that table's router and check.
pub(crate) struct ReleaseRoute {
    /// `schema.table`, what its records carry in the `source_table` header (several tables).
    pub label: String,
    /// The live path's topic template.
    pub topic: TopicTemplate,
    /// The column mapping: released events carry header `id`, the placed columns' headers and
    /// NULL aggregate ids or event types like live ones.
    pub names: crate::model::columns::ColumnNames,
    /// What a NULL payload becomes unless the policy says: the preset's choice.
    pub null_default: NullPayload,
    /// A release goes out only when the outbox row (or an operator's audit row) vouches for it.
    pub provenance: Provenance,
    /// `[policy]` merged with this table's: what its poison events do, whether they hold.
    pub policy: PolicyConfig,
    /// This table's schemas (`[validation]` merged with its own), for live and released events.
    pub validator: Option<Validator>,
}

impl ReleaseRoute {
    pub fn of(t: &OutboxTable, tagged: bool) -> Result<Self, RelayError> {
        Ok(Self {
            label: t.label(),
            topic: TopicTemplate::parse(&t.topic)?,
            names: t.columns.resolve()?,
            null_default: match t.columns.preset {
                crate::model::columns::Preset::Debezium => NullPayload::Tombstone,
                crate::model::columns::Preset::Outboxd => NullPayload::Park,
            },
            provenance: Provenance::new(t, tagged)?,
            policy: t.policy.clone(),
            validator: Validator::from_config(&t.validation),
        })
    }
}

/// Where a parked row's route is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Which {
    /// The session's table at this index.
    Listed(usize),
    /// A table a pattern matches under its current name that the session does not read (yet):
    /// a route of [`Routes::found`].
    Found(usize),
}

/// The routes of the session's tables (in its table order), and those found for released rows.
pub(crate) struct Routes {
    pub listed: Vec<ReleaseRoute>,
    pub found: Vec<ReleaseRoute>,
    /// The configuration, for a pattern's table found by oid under a name the session does not
    /// read (patterns only).
    pub cfg: Option<Box<Config>>,
    pub tagged: bool,
    /// Each table's name now, by oid, read once per release batch (cleared by the caller):
    /// a batch's rows mostly share a table, and one catalog read each was half the batch's
    /// round trips.
    pub names: std::collections::HashMap<u32, Option<String>>,
}

impl Routes {
    pub fn get(&mut self, w: Which) -> &mut ReleaseRoute {
        match w {
            Which::Listed(i) => &mut self.listed[i],
            Which::Found(i) => &mut self.found[i],
        }
    }

    /// The route of row `r` and whether its table was renamed or moved since it was parked
    /// (its header names the table as it was); Err: why no route may release it.
    pub async fn resolve(
        &mut self,
        sql: &Client,
        r: &Release,
    ) -> Result<Result<(Which, bool), String>, RelayError> {
        let stored = stored_table(&r.record.headers);
        if let (Some(relid), Some(stored)) = (r.relid, stored) {
            let now = match self.names.get(&relid) {
                Some(now) => now.clone(),
                None => {
                    let now = parking::name_of(sql, relid).await?;
                    self.names.insert(relid, now.clone());
                    now
                }
            };
            if let Some(now) = now {
                let renamed = now != stored;
                if let Some(i) = self.listed.iter().position(|x| x.label == now) {
                    return Ok(Ok((Which::Listed(i), renamed)));
                }
                if let Some(i) = self.found.iter().position(|x| x.label == now) {
                    return Ok(Ok((Which::Found(i), renamed)));
                }
                if let Some(t) = self.through_pattern(&now) {
                    self.found.push(ReleaseRoute::of(&t, self.tagged)?);
                    return Ok(Ok((Which::Found(self.found.len() - 1), renamed)));
                }
                return Ok(Err(format!(
                    "parked from {stored}, which is now {now} (the same table, renamed or moved \
                     since), and this configuration does not list {now}: no listed table's \
                     mapping, topic or row may release it. Discard it (`outboxd parked \
                     discard`), or list {now} and retry it"
                )));
            }
            // Its table is gone (dropped): by the name it had, as before issue 56.
        }
        let labels: Vec<String> = self.listed.iter().map(|x| x.label.clone()).collect();
        Ok(match ParkedTable::of(&labels, stored) {
            ParkedTable::Listed(i) => Ok((Which::Listed(i), false)),
            other => Err(other.not_listed().unwrap_or_default()),
        })
    }

    /// `label`'s settings through the first pattern that matches it.
    fn through_pattern(&self, label: &str) -> Option<OutboxTable> {
        let cfg = self.cfg.as_ref()?;
        let (schema, name) = label.split_once('.')?;
        let (entry, _) = cfg
            .patterns()
            .into_iter()
            .find(|(_, p)| p.matches(schema, name))?;
        let found = [(schema.to_string(), name.to_string(), entry)];
        cfg.with_discovered(&found).tables().pop()
    }
}
