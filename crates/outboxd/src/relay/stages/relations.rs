//! Relation messages, and the tables that join the session while it streams (issue 56): a
//! table a pattern matches that joined the publication is taken into the running session —
//! its events held ([`crate::relay::held`]) until the session has assessed what it is owed
//! (`crate::supervisor::joining`) — instead of ending the session, which re-read the stream
//! from the confirmed position for every tenant that joined.

use super::Stages;
use crate::config::tables::OutboxTable;
use crate::error::RelayError;
use crate::model::publication;
use crate::poison::store::ParkedRecord;
use crate::relay::ack::Seq;
use crate::relay::outboxes::Orphan;
use crate::relay::pgoutput::Relation;
use crate::relay::source::{in_publication, plain_table, sql_bounded};

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
                self.arrived.push((table, Some(rel.id)));
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

    /// The tables that joined through the stream (a Relation message, or the publication
    /// guard's message) since the last call, with their oid.
    pub fn take_arrived(&mut self) -> Vec<(OutboxTable, Option<u32>)> {
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

    /// Events held ([`crate::relay::held`]), and joins whose rows are not handed over yet.
    pub fn held(&self) -> usize {
        self.held.len() + self.marks.len()
    }

    /// The publication guard's message (sql/080) says tables joined the publication here, by
    /// oid and the name they had then. One a pattern matches that the session does not read
    /// is taken in now, whatever its name becomes later: renamed into the pattern and out
    /// again before a state write looked at the catalog, its rows were never republished
    /// (issue 56, F1). A mark at this position (one per table the session is still catching
    /// up) keeps the slot from confirming past the join until the table's rows are handed over
    /// ([`Stages::unmark`]): a session that ends before meets the message again.
    pub(super) async fn on_joined(&mut self, content: &[u8]) -> Result<(), RelayError> {
        for j in crate::model::publication::joined(content, &self.publication) {
            let label = format!("{}.{}", j.schema, j.name);
            let known = self.outboxes.labels().iter().any(|l| **l == *label);
            let t = match known {
                // Found already (a session's start, a state write): marked while it catches up.
                true if self.held.holds_label(&self.outboxes.labels(), &label) => None,
                // Back after it left the publication ([`Stages::on_left`]): owed what it
                // missed, as a join; held until its rows are read (its route exists already).
                true if self.rejoin.contains(&j.oid) => {
                    self.rejoin.retain(|o| *o != j.oid);
                    let Some(t) = self.outboxes.through(&j.schema, &j.name) else {
                        continue;
                    };
                    tracing::info!(table = %label, "a table that left the publication is back (the stream says so): republishing what it holds");
                    self.hold(&label);
                    self.arrived.push((t, Some(j.oid)));
                    None
                }
                true => continue,
                false => match self.outboxes.through(&j.schema, &j.name) {
                    Some(t) => Some(t),
                    None => continue,
                },
            };
            if let Some(t) = t {
                if !self.table_exists(j.oid).await? {
                    tracing::warn!(table = %label, "a table joined the publication and was dropped before the relay read it: rows it held before it joined, if any, went with it");
                    continue;
                }
                if !plain_table(&self.sql, j.oid).await? {
                    // Partitioned: its partitions are resolved at a session's start.
                    return Err(RelayError::TablesChanged(label));
                }
                tracing::info!(table = %label, "a table joined the publication (the stream says so): taken into the running session");
                self.outboxes.push_table(&t)?;
                self.take_in(&t)?;
                self.arrived.push((t, Some(j.oid)));
            }
            let seq = self.in_flight.add_mark()?;
            self.marks.push((label, seq));
        }
        Ok(())
    }

    /// A message of the publication guard (sql/080): tables that left (a pattern's: owed as a
    /// join, [`Stages::on_left`]), the end of that same command, any other change of the
    /// publication (the session ends: [`RelayError::PublicationChanged`]), or tables that
    /// joined ([`Stages::on_joined`]).
    pub(super) async fn on_guard(&mut self, content: &[u8]) -> Result<(), RelayError> {
        let left = publication::left(content, &self.publication);
        if left.is_some_and(|l| self.on_left(&l)) {
            self.left_ends += 1;
            return Ok(());
        }
        if self.left_ends > 0 && publication::ends_alter(content, &self.publication) {
            self.left_ends -= 1;
            return Ok(());
        }
        if let Some(what) = publication::concerns(content, &self.publication) {
            return Err(RelayError::PublicationChanged(what));
        }
        self.on_joined(content).await
    }

    /// The guard's message says tables left the publication here (`ALTER PUBLICATION … DROP
    /// TABLE`; issue 56, F5). Rows a table writes while out are never streamed, but they are
    /// in the table: a pattern's table the session relays is owed them once it is back, like a
    /// table that joins. The supervisor puts it back ([`Stages::take_left`]), its join message
    /// takes it in again (held until its rows are read) and every other table streams on from
    /// the slot — before, the whole slot was replaced, and a Debezium table beside it, whose
    /// rows of that gap exist only in the slot, stopped the relay. `false`: a table that left
    /// is listed, or a pattern's that the session does not relay yet: the whole publication's
    /// change, as before.
    pub(super) fn on_left(&mut self, left: &[crate::model::publication::Joined]) -> bool {
        let labels = self.outboxes.labels();
        let mut out = Vec::new();
        for j in left {
            let label = format!("{}.{}", j.schema, j.name);
            let ours = labels.iter().any(|l| **l == *label);
            match self.outboxes.through(&j.schema, &j.name) {
                Some(t) if ours && t.discovered.is_some() => out.push((t, j.oid)),
                None if !ours => {} // Not an outbox: nothing of ours was skipped.
                _ => return false,
            }
        }
        for (t, oid) in out {
            tracing::warn!(table = %t.label(), "a table the pattern matches left the publication: streaming every other table on; it is put back and what it holds is republished");
            self.rejoin.push(oid);
            self.left.push((t, oid));
        }
        true
    }

    /// The tables [`Stages::on_left`] took note of since the last call, with their oid.
    pub fn take_left(&mut self) -> Vec<(OutboxTable, u32)> {
        std::mem::take(&mut self.left)
    }

    /// `label`'s rows and held events were handed over: its joins may be confirmed past.
    pub fn unmark(&mut self, label: &str) {
        let in_flight = &mut self.in_flight;
        self.marks.retain(|(l, seq)| {
            let keep = l != label;
            if !keep {
                in_flight.parked(*seq);
            }
            keep
        });
    }

    /// Does relation `oid` exist? A transaction the stream just gave may not be visible to
    /// another connection's snapshot yet (its commit record is decoded before the server
    /// shows it committed): asked again for up to a second before saying no.
    async fn table_exists(&self, oid: u32) -> Result<bool, RelayError> {
        for _ in 0..20 {
            let q = async {
                let r = self
                    .sql
                    .query_opt("SELECT 1 FROM pg_class WHERE oid = $1", &[&oid])
                    .await?;
                Ok(r.is_some())
            };
            if sql_bounded(q).await? {
                return Ok(true);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Ok(false)
    }
}
