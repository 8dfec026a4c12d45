//! The outbox tables a configuration reads: the listed ones with their overrides applied, the
//! pattern entries, the tables they match, and the one-table view of a listed table.

use super::{tables, Config};

impl Config {
    /// (schema, table) of the outbox table of a one-table configuration (`source.table`).
    /// Callers that read the outbox check [`Config::one_table`] first: with several tables
    /// this is only the first, and reading only it would skip the others.
    pub fn table_name(&self) -> (String, String) {
        match self.source.tables.first() {
            Some(t) => tables::split(&t.name),
            None => tables::split(
                self.source
                    .table
                    .as_deref()
                    .unwrap_or(tables::DEFAULT_TABLE),
            ),
        }
    }

    /// One `[[source.tables]]` entry is the shorthand written longhand: folded into
    /// `source.table`, `[source.columns]` and `[sink] topic`, so every one-table path reads it
    /// exactly as it reads the shorthand.
    pub(super) fn fold_single_table(&mut self) {
        if self.source.tables.len() != 1 || self.has_patterns() {
            return;
        }
        let t = self.source.tables.remove(0);
        self.source.table = Some(t.name);
        if let Some(c) = t.columns {
            self.source.columns = c;
        }
        if let Some(topic) = t.topic {
            self.sink.topic = topic;
        }
        if let Some(p) = t.policy {
            self.policy = p.merged(&self.policy);
        }
        if let Some(v) = t.validation {
            self.validation = v.merged(&self.validation);
        }
        if let Some(ce) = t.cloudevents {
            self.sink.cloudevents = ce.merged(&self.sink.cloudevents);
        }
    }

    /// Every outbox table this relay reads, overrides applied, in configuration order.
    /// Pattern entries are not tables: a session adds the tables they match
    /// ([`Config::with_discovered`]).
    pub fn tables(&self) -> Vec<tables::OutboxTable> {
        let mut all = self.tables_plain();
        // CloudEvents settings per table (errors are reported by validation at startup).
        for t in &mut all {
            let dir = t.validation.schema_dir.as_deref();
            t.columns.cloudevents =
                super::cloudevents::for_table(self, &t.schema, &t.name, dir, &t.cloudevents)
                    .unwrap_or(None);
        }
        all
    }

    fn tables_plain(&self) -> Vec<tables::OutboxTable> {
        if self.source.tables.is_empty() {
            let (schema, name) = self.table_name();
            return vec![tables::OutboxTable {
                schema,
                name,
                columns: self.source.columns.clone(),
                topic: self.sink.topic.clone(),
                discovered: None,
                policy: self.policy.clone(),
                validation: self.validation.clone(),
                cloudevents: self.sink.cloudevents.clone(),
            }];
        }
        self.source
            .tables
            .iter()
            .filter(|t| t.pattern.is_none())
            .map(|t| {
                let (schema, name) = tables::split(&t.name);
                tables::OutboxTable {
                    topic: match &t.topic {
                        Some(own) => tables::topic_for(own, &schema, &name),
                        None => self.sink.topic.clone(),
                    },
                    schema,
                    name,
                    columns: t
                        .columns
                        .clone()
                        .unwrap_or_else(|| self.source.columns.clone()),
                    discovered: t.discovered.clone(),
                    policy: match &t.policy {
                        Some(p) => p.merged(&self.policy),
                        None => self.policy.clone(),
                    },
                    validation: match &t.validation {
                        Some(v) => v.merged(&self.validation),
                        None => self.validation.clone(),
                    },
                    cloudevents: match &t.cloudevents {
                        Some(ce) => ce.merged(&self.sink.cloudevents),
                        None => self.sink.cloudevents.clone(),
                    },
                }
            })
            .collect()
    }

    /// The `pattern` entries of `[[source.tables]]`, each with the entry's index.
    pub fn patterns(&self) -> Vec<(usize, tables::Pattern)> {
        self.source
            .tables
            .iter()
            .enumerate()
            .filter_map(|(i, t)| {
                let p = tables::Pattern::parse(t.pattern.as_deref()?).ok()?;
                Some((i, p))
            })
            .collect()
    }

    /// Has `[[source.tables]]` any `pattern` entry?
    pub fn has_patterns(&self) -> bool {
        self.source.tables.iter().any(|t| t.pattern.is_some())
    }

    /// This configuration with the tables the patterns match now (`(schema, table, entry
    /// index)`, from the catalog) listed as entries of their own, after the listed ones: what
    /// a session reads. The pattern entries stay, so the session knows a table that joins
    /// later.
    pub fn with_discovered(&self, found: &[(String, String, usize)]) -> Config {
        let mut c = self.clone();
        for (schema, table, i) in found {
            let entry = &self.source.tables[*i];
            c.source.tables.push(tables::TableEntry {
                name: format!("{schema}.{table}"),
                pattern: None,
                columns: entry.columns.clone(),
                topic: entry.topic.clone(),
                discovered: entry.pattern.clone(),
                policy: entry.policy.clone(),
                validation: entry.validation.clone(),
                cloudevents: entry.cloudevents.clone(),
            });
        }
        c
    }

    /// More than one outbox table, or a pattern (however many tables it matches now: records
    /// keep one shape as tenants come): records carry the `source_table` header, and what
    /// reads only one table refuses the configuration ([`Config::one_table`]).
    pub fn is_multi_table(&self) -> bool {
        self.source.tables.len() > 1 || self.has_patterns()
    }

    /// Do records carry the `source_table` header? With several tables, and for one table of
    /// such a configuration ([`Config::for_table`]).
    pub fn tags_records(&self) -> bool {
        self.is_multi_table() || self.tagged_table
    }

    /// The one-table configuration of listed table `name` (`schema.table`, or `table` in
    /// `public`): for what reads one table at a time (replay). Its records carry the
    /// `source_table` header when this configuration lists several tables. Err names the
    /// listed tables when `name` is not one of them.
    pub fn for_table(&self, name: &str) -> Result<Config, String> {
        let (schema, table) = tables::split(name);
        let all = self.tables();
        let Some(t) = all.iter().find(|t| t.schema == schema && t.name == table) else {
            let listed: Vec<String> = all.iter().map(|t| t.label()).collect();
            return Err(format!(
                "{schema}.{table} is not a listed outbox table (listed: {})",
                listed.join(", ")
            ));
        };
        let mut one = self.clone();
        one.tagged_table = self.tags_records();
        one.source.tables.clear();
        one.source.table = Some(t.label());
        one.source.columns = t.columns.clone();
        one.sink.topic = t.topic.clone();
        one.policy = t.policy.clone();
        one.validation = t.validation.clone();
        one.sink.cloudevents = t.cloudevents.clone();
        Ok(one)
    }

    /// For a capability that reads one outbox table: Err (the message names `what` and the
    /// tables) when this configuration lists several, rather than read only the first.
    pub fn one_table(&self, what: &str) -> Result<(), String> {
        if self.is_multi_table() {
            return Err(tables::not_with_several(what, &self.tables()));
        }
        Ok(())
    }
}
