//! Relation messages, and the tables that join the session while it streams (issue 56): a
//! table a pattern matches that joined the publication is taken into the running session —
//! its events held ([`crate::relay::held`]) until the session has assessed what it is owed
//! (`crate::supervisor::joining`) — instead of ending the session, which re-read the stream
//! from the confirmed position for every tenant that joined.

use super::Stages;
use crate::config::tables::OutboxTable;
use crate::error::RelayError;
use crate::poison::store::ParkedRecord;
use crate::relay::ack::Seq;
use crate::relay::outboxes::Orphan;
use crate::relay::pgoutput::Relation;
use crate::relay::source::{in_publication, plain_table};

impl Stages {
    pub(super) async fn on_relation(&mut self, rel: &Relation) -> Result<(), RelayError> {
        match self.outboxes.adopt_orphan(rel)? {
            Orphan::Adopted(t) => return self.poison.add_table(&t),
            Orphan::Mapped => return Ok(()),
            Orphan::NotOne => {}
        }
        match self.outboxes.on_relation(rel) {
            Err(RelayError::TablesChanged(t))
                if !in_publication(&self.sql, &self.publication, rel).await? =>
            {
                tracing::warn!(table = %t, "relaying what the stream holds of a table the pattern matches that is no longer in the publication (dropped, or removed from it)");
                if let Some(t) = self.outboxes.adopt(rel)? {
                    self.poison.add_table(&t)?;
                }
                Ok(())
            }
            // A plain table that joined: taken in, held until assessed. A partitioned one
            // ends the session (its partitions are resolved at a session's start).
            Err(RelayError::TablesChanged(t)) if plain_table(&self.sql, rel.id).await? => {
                let Some(table) = self.outboxes.adopt(rel)? else {
                    return Err(RelayError::TablesChanged(t));
                };
                self.take_in(&table)?;
                self.arrived.push(table);
                Ok(())
            }
            r => r,
        }
    }

    /// `table` joins the running session (found by a state write, before any Relation message
    /// of it): its events are held until the session assessed it.
    pub fn join_table(&mut self, table: &OutboxTable) -> Result<(), RelayError> {
        self.outboxes.push_table(table)?;
        self.take_in(table)
    }

    fn take_in(&mut self, table: &OutboxTable) -> Result<(), RelayError> {
        self.poison.add_table(table)?;
        self.hold(&table.label());
        Ok(())
    }

    /// Relation `oid` is read as the table labelled `label` (renamed since it joined).
    pub fn alias(&mut self, oid: u32, label: &str) {
        self.outboxes.alias(oid, label);
    }

    /// The tables that joined through a Relation message since the last call.
    pub fn take_arrived(&mut self) -> Vec<OutboxTable> {
        std::mem::take(&mut self.arrived)
    }

    /// Holds `label`'s streamed events until [`Stages::release`] ([`crate::relay::held`]).
    pub fn hold(&mut self, label: &str) -> bool {
        self.held.hold_label(&self.outboxes.labels(), label)
    }

    /// Stops holding `label` and hands over what was held of it, to be sent under their
    /// positions (`Producer::send_held`) after its republished rows, if any.
    pub fn release(&mut self, label: &str) -> Vec<(Seq, ParkedRecord)> {
        self.held.release_label(&self.outboxes.labels(), label)
    }

    /// Events held ([`crate::relay::held`]).
    pub fn held(&self) -> usize {
        self.held.len()
    }
}
