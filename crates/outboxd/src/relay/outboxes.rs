//! The listed outbox tables as the live path routes them (R44): which Relation id is which
//! table, with that table's column mapping and topic template.
//!
//! pgoutput announces a table (a Relation message: id, schema, name, columns) before its first
//! change in a session and again after its schema changes; the id stays the table's oid. Each
//! listed table's Relation is resolved against that table's mapping; other published tables'
//! changes are counted and ignored. A partitioned table's rows come under its own Relation
//! (a publication with `publish_via_partition_root`) or under each partition's (one without):
//! the partitions the session knows ([`Config::partitions`]) are read as their root.

use crate::config::tables::{OutboxTable, Pattern, SOURCE_TABLE_HEADER};
use crate::config::Config;
use crate::error::RelayError;
use crate::model::columns::ColumnNames;
use crate::model::route::RouteError;
use crate::model::topic::TopicTemplate;
use crate::relay::pgoutput::Relation;
use crate::relay::route::{Event, PayloadKind, RowMapping};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// One listed table.
pub struct Outbox {
    schema: String,
    name: String,
    pub names: ColumnNames,
    pub topic: TopicTemplate,
    /// `schema.table`: the `source_table` header's value and the `table` metric label.
    pub label: Arc<str>,
    /// Records carry the `source_table` header (more than one table is listed).
    tagged: bool,
    /// JSON Schema validation applies (`schema_dir` set): refused for a bytea payload.
    validates: bool,
    /// The table's oid, from the last Relation message that named it (issue 56: what its
    /// parked rows, holds and heads key on). `None` until one came, and for a partitioned
    /// table whose rows come under its partitions' Relations.
    pub oid: Option<u32>,
}

impl Outbox {
    /// Adds the `source_table` header when the relay lists several tables (see
    /// [`SOURCE_TABLE_HEADER`]): last among the placed headers, before the row's own.
    pub fn tag(&self, event: &mut Event<'_>) {
        if self.tagged {
            event.additional.push((
                Arc::from(SOURCE_TABLE_HEADER),
                Some(Cow::Owned(self.label.to_string())),
            ));
        }
    }
}

impl Outbox {
    /// [`Outbox::tag`] for a row parked before it could be routed.
    pub fn tag_record(&self, rec: &mut crate::poison::record::ParkedRecord) {
        if self.tagged {
            rec.headers
                .push((SOURCE_TABLE_HEADER.into(), Some(self.label.to_string())));
        }
    }
}

/// What a change's relation id is.
pub enum Lookup<'a> {
    /// A listed table: its index (configuration order) and the mapping of its current columns.
    Outbox(usize, &'a RowMapping),
    /// Another published table.
    Other,
    /// No Relation message announced it in this session.
    Unknown,
}

/// See the module docs. One per session.
pub struct Outboxes {
    tables: Vec<Outbox>,
    /// `[[source.tables]]` patterns, each with its entry's index: a table they match that is
    /// not among `tables` joined while the session streamed ([`crate::slot::join`]), or left
    /// the publication since (see [`Outboxes::adopt`]).
    patterns: Vec<(usize, Pattern)>,
    /// The configuration, for the settings of a table [`Outboxes::adopt`] reads (patterns only).
    cfg: Option<Box<Config>>,
    tagged: bool,
    by_rel: HashMap<u32, (usize, RowMapping)>,
    others: HashSet<u32>,
    /// Partition oid → its root's index in `tables`.
    partitions: HashMap<u32, usize>,
    /// Partitions that left with their root (a pattern's tenant dropped) while rows they
    /// committed wait in the slot: partition oid → the root's label ([`Outboxes::adopt_orphan`]).
    orphans: HashMap<u32, String>,
}

/// What [`Outboxes::adopt_orphan`] did with a Relation message.
pub enum Orphan {
    /// Not a partition of a root that left.
    NotOne,
    /// Mapped to its root, already one of the session's tables.
    Mapped,
    /// Its root was adopted through the pattern that matched it: a new table of the session.
    Adopted(Box<OutboxTable>),
}

impl Outboxes {
    pub fn new(cfg: &Config) -> Result<Self, RelayError> {
        let tagged = cfg.tags_records();
        let tables = cfg
            .tables()
            .into_iter()
            .map(|t| {
                Ok(Outbox {
                    label: Arc::from(t.label()),
                    names: t.columns.resolve()?,
                    topic: TopicTemplate::parse(&t.topic)?,
                    validates: t.validation.schema_dir.is_some(),
                    schema: t.schema,
                    name: t.name,
                    tagged,
                    oid: None,
                })
            })
            .collect::<Result<Vec<_>, RelayError>>()?;
        let partitions = cfg
            .partitions
            .iter()
            .chain(&cfg.left_partitions)
            .filter_map(|(oid, root)| {
                let i = tables.iter().position(|t| &*t.label == root)?;
                Some((*oid, i))
            })
            .collect();
        let orphans = cfg
            .left_partitions
            .iter()
            .filter(|(_, root)| !tables.iter().any(|t| &*t.label == root))
            .cloned()
            .collect();
        Ok(Self {
            partitions,
            orphans,
            tables,
            patterns: cfg.patterns(),
            cfg: cfg.has_patterns().then(|| Box::new(cfg.clone())),
            tagged,
            by_rel: HashMap::new(),
            others: HashSet::new(),
        })
    }

    /// A Relation message: a listed table's columns resolved against its mapping (Err when a
    /// required column is missing), anything else remembered as not ours. A listed table
    /// renamed away stops being one. A table a pattern matches that the session does not read
    /// joined the publication since it started: Err([`RelayError::TablesChanged`]).
    pub fn on_relation(&mut self, rel: &Relation) -> Result<(), RelayError> {
        let by_name = self
            .tables
            .iter()
            .position(|t| (t.schema.as_str(), t.name.as_str()) == (&rel.namespace, &rel.name));
        if let Some(i) = by_name {
            self.tables[i].oid = Some(rel.id);
        }
        let listed = by_name.or_else(|| self.partitions.get(&rel.id).copied());
        match listed {
            Some(i) => {
                let mut missing = Vec::new();
                let mapping = RowMapping::resolve(&self.tables[i].names, rel, &mut missing)?;
                if self.tables[i].validates && mapping.payload_kind() == PayloadKind::Bytes {
                    return Err(RouteError::SchemaOnBinary {
                        table: self.tables[i].label.to_string(),
                        column: self.tables[i].names.payload.clone(),
                    }
                    .into());
                }
                if !missing.is_empty() {
                    let table = &*self.tables[i].label;
                    tracing::warn!(
                        table,
                        ?missing,
                        "optional outbox columns absent; not emitted"
                    );
                }
                self.by_rel.insert(rel.id, (i, mapping));
                self.others.remove(&rel.id);
            }
            None if self.pattern_of(rel).is_some() => {
                return Err(RelayError::TablesChanged(format!(
                    "outbox table {}.{} joined the publication",
                    rel.namespace, rel.name
                )));
            }
            None => {
                self.by_rel.remove(&rel.id);
                self.others.insert(rel.id);
            }
        }
        Ok(())
    }

    /// The table `schema.name` would be through a pattern (none matches: `None`).
    pub fn through(&self, schema: &str, name: &str) -> Option<OutboxTable> {
        self.through_pattern(schema, name)
    }

    /// `schema.name`'s settings through the first pattern that matches it (`None`: none does).
    fn through_pattern(&self, schema: &str, name: &str) -> Option<OutboxTable> {
        let (entry, _) = self
            .patterns
            .iter()
            .find(|(_, p)| p.matches(schema, name))?;
        let found = [(schema.to_string(), name.to_string(), *entry)];
        self.cfg.as_ref()?.with_discovered(&found).tables().pop()
    }

    fn pattern_of(&self, rel: &Relation) -> Option<usize> {
        self.patterns
            .iter()
            .position(|(_, p)| p.matches(&rel.namespace, &rel.name))
    }

    /// Reads a table a pattern matches that is no longer in the publication (dropped, or
    /// removed from it) but whose rows the stream still holds from when it was: relayed through
    /// the pattern's mapping, like when it was one of the session's tables. (Ending the session
    /// instead would meet the same Relation message again in the next one, forever.)
    /// Returns the table's settings (`None`: no pattern matches; read as any Relation).
    pub fn adopt(&mut self, rel: &Relation) -> Result<Option<OutboxTable>, RelayError> {
        let Some(t) = self.through_pattern(&rel.namespace, &rel.name) else {
            self.on_relation(rel)?;
            return Ok(None);
        };
        self.push_table(&t)?;
        self.on_relation(rel)?;
        Ok(Some(t))
    }

    /// Relation `oid` is read as the table labelled `label` whatever its name says (a table
    /// renamed since it joined; issue 56).
    pub fn alias(&mut self, oid: u32, label: &str) {
        if let Some(i) = self.tables.iter().position(|t| &*t.label == label) {
            self.partitions.insert(oid, i);
        }
    }

    /// A table joins the session's tables (its Relation message, when one comes, maps by its
    /// name); returns its index.
    pub fn push_table(&mut self, t: &OutboxTable) -> Result<usize, RelayError> {
        self.tables.push(Outbox {
            schema: t.schema.clone(),
            name: t.name.clone(),
            names: t.columns.resolve()?,
            topic: TopicTemplate::parse(&t.topic)?,
            label: Arc::from(t.label()),
            tagged: self.tagged,
            validates: t.validation.schema_dir.is_some(),
            oid: None,
        });
        Ok(self.tables.len() - 1)
    }

    /// A partition whose root left the relayed set while rows it committed as a partition wait
    /// in the slot (through a publication without `publish_via_partition_root`, a pattern's
    /// partitioned tenant dropped): its rows are read as the root's, through the pattern that
    /// matched the root (issue 56: they were confirmed past as another table's).
    pub fn adopt_orphan(&mut self, rel: &Relation) -> Result<Orphan, RelayError> {
        let Some(root) = self.orphans.get(&rel.id).cloned() else {
            return Ok(Orphan::NotOne);
        };
        if let Some(i) = self.tables.iter().position(|t| *t.label == *root) {
            self.partitions.insert(rel.id, i);
            self.on_relation(rel)?;
            return Ok(Orphan::Mapped);
        }
        let Some(t) = root
            .split_once('.')
            .and_then(|(schema, name)| self.through_pattern(schema, name))
        else {
            return Ok(Orphan::NotOne);
        };
        let i = self.push_table(&t)?;
        self.partitions.insert(rel.id, i);
        self.on_relation(rel)?;
        Ok(Orphan::Adopted(Box::new(t)))
    }

    pub fn lookup(&self, rel: u32) -> Lookup<'_> {
        match self.by_rel.get(&rel) {
            Some((i, m)) => Lookup::Outbox(*i, m),
            None if self.others.contains(&rel) => Lookup::Other,
            None => Lookup::Unknown,
        }
    }

    /// Every listed table's `schema.table`, in configuration order.
    pub fn labels(&self) -> Vec<Arc<str>> {
        self.tables.iter().map(|t| t.label.clone()).collect()
    }

    /// The oid of the table at `i`, when a Relation message named it ([`Outbox::oid`]) and the
    /// relay's records name their table: a one-table relay's parked rows name none and hold
    /// their aggregate in every table a later configuration lists, as before issue 56.
    pub fn oid(&self, i: usize) -> Option<u32> {
        self.tables.get(i).filter(|t| t.tagged).and_then(|t| t.oid)
    }

    /// The table at `i` (an index [`Lookup::Outbox`] gave).
    pub fn get(&self, i: usize) -> &Outbox {
        &self.tables[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::pgoutput::Column;

    fn cfg(tables: &str) -> Config {
        Config::from_toml_and_env(
            &format!(
                "[source]\ndsn = \"postgres://u@h/db\"\n[sink.kafka]\n\
                 \"bootstrap.servers\" = \"b:9092\"\n{tables}"
            ),
            Vec::<(String, String)>::new(),
        )
        .unwrap()
    }

    fn relation(id: u32, namespace: &str, name: &str, columns: &[&str]) -> Relation {
        Relation {
            id,
            namespace: namespace.into(),
            name: name.into(),
            columns: columns
                .iter()
                .map(|c| Column {
                    name: c.to_string(),
                    type_oid: if *c == "payload" { 3802 } else { 25 },
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    const OUTBOXD: [&str; 5] = [
        "event_id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
    ];
    const DEBEZIUM: [&str; 5] = ["id", "aggregatetype", "aggregateid", "type", "payload"];

    #[test]
    fn each_relation_maps_to_its_tables_mapping_and_others_are_ignored() {
        let mut o = Outboxes::new(&cfg("[[source.tables]]\nname = \"a.outbox\"\n\
             [[source.tables]]\nname = \"b.outbox\"\ncolumns = { preset = \"debezium\" }\n"))
        .unwrap();
        assert!(matches!(o.lookup(1), Lookup::Unknown));
        o.on_relation(&relation(1, "a", "outbox", &OUTBOXD))
            .unwrap();
        o.on_relation(&relation(2, "b", "outbox", &DEBEZIUM))
            .unwrap();
        o.on_relation(&relation(3, "public", "outbox", &OUTBOXD))
            .unwrap();
        assert!(matches!(o.lookup(1), Lookup::Outbox(0, _)));
        assert!(matches!(o.lookup(2), Lookup::Outbox(1, _)));
        assert!(matches!(o.lookup(3), Lookup::Other));
        assert_eq!(
            o.labels().iter().map(|l| &**l).collect::<Vec<_>>(),
            ["a.outbox", "b.outbox"]
        );
        // A table's own mapping: Debezium's columns are not outboxd's.
        assert!(o
            .on_relation(&relation(4, "a", "outbox", &DEBEZIUM))
            .is_err());
        // A listed table renamed away stops being one.
        o.on_relation(&relation(1, "a", "outbox_old", &OUTBOXD))
            .unwrap();
        assert!(matches!(o.lookup(1), Lookup::Other));
    }

    #[test]
    fn a_table_a_pattern_matches_that_the_session_does_not_read_ends_it() {
        let base = cfg("[[source.tables]]\npattern = \"tenant_%.outbox\"\n");
        let c = base.with_discovered(&[("tenant_a".into(), "outbox".into(), 0)]);
        let mut o = Outboxes::new(&c).unwrap();
        o.on_relation(&relation(1, "tenant_a", "outbox", &OUTBOXD))
            .unwrap();
        assert!(matches!(o.lookup(1), Lookup::Outbox(0, _)));
        let e = o
            .on_relation(&relation(2, "tenant_b", "outbox", &OUTBOXD))
            .unwrap_err();
        assert!(
            matches!(e, RelayError::TablesChanged(ref t) if t.contains("tenant_b.outbox joined"))
        );
        // One that left the publication since: its rows in the stream go the pattern's way.
        o.adopt(&relation(2, "tenant_b", "outbox", &OUTBOXD))
            .unwrap();
        assert!(matches!(o.lookup(2), Lookup::Outbox(1, _)));
        assert_eq!(&*o.get(1).label, "tenant_b.outbox");
        o.on_relation(&relation(3, "other", "outbox", &OUTBOXD))
            .unwrap();
        assert!(matches!(o.lookup(3), Lookup::Other));
        // A pattern's records always name their table, however many it matches now.
        assert!(c.tags_records());
    }

    #[test]
    fn a_partitions_rows_are_read_as_its_tables() {
        // A publication without publish_via_partition_root: Relations name the partitions.
        let mut c = cfg("[[source.tables]]\nname = \"a.outbox\"\n\
             [[source.tables]]\nname = \"b.outbox\"\ncolumns = { preset = \"debezium\" }\n");
        c.partitions = vec![(11, "a.outbox".into()), (12, "b.outbox".into())];
        let mut o = Outboxes::new(&c).unwrap();
        o.on_relation(&relation(11, "a", "outbox_p0", &OUTBOXD))
            .unwrap();
        o.on_relation(&relation(12, "b", "outbox_2026", &DEBEZIUM))
            .unwrap();
        assert!(matches!(o.lookup(11), Lookup::Outbox(0, _)));
        assert!(matches!(o.lookup(12), Lookup::Outbox(1, _)));
        // Each through its root's mapping: b's partition does not have outboxd's columns.
        assert!(o
            .on_relation(&relation(12, "b", "outbox_2026", &OUTBOXD))
            .is_err());
        // An unknown relation of the same name shape is someone else's.
        o.on_relation(&relation(13, "a", "outbox_p1", &OUTBOXD))
            .unwrap();
        assert!(matches!(o.lookup(13), Lookup::Other));
    }

    #[test]
    fn records_name_their_table_only_with_several_tables() {
        let rec = || crate::poison::record::ParkedRecord {
            event_id: "e".into(),
            aggregate_type: None,
            aggregate_id: None,
            aggregate_version: None,
            event_type: None,
            topic: None,
            key: None,
            payload: None,
            headers: vec![],
            timestamp_ms: None,
        };
        let several = Outboxes::new(&cfg(
            "[[source.tables]]\nname = \"a.outbox\"\n[[source.tables]]\nname = \"b\"\n",
        ))
        .unwrap();
        let mut r = rec();
        several.get(1).tag_record(&mut r);
        assert_eq!(
            r.headers,
            [(
                SOURCE_TABLE_HEADER.to_string(),
                Some("public.b".to_string())
            )]
        );
        let one = Outboxes::new(&cfg("")).unwrap();
        let mut r = rec();
        one.get(0).tag_record(&mut r);
        assert!(r.headers.is_empty());
    }
}
