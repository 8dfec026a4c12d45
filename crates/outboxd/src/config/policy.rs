//! `[policy]` and `[source.tables.policy]`: what a deterministic failure does per event type —
//! park or halt, may later events of the aggregate overtake it, what a NULL payload becomes
//! (R15–R17). Which failures are deterministic: `crate::poison::policy`.

use serde::Deserialize;
use std::collections::BTreeMap;

/// May later events of the same aggregate overtake a parked one?
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// No: they are parked behind it, in order, until it is retried or discarded (strict
    /// sequences such as balances).
    #[default]
    Aggregate,
    /// Yes: later events continue (independent notifications).
    None,
}

/// What a deterministic failure does.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnPoison {
    /// Write the event to `outbox_parked` and continue as `ordering` says.
    #[default]
    Park,
    /// Stop: nothing past the event is confirmed, readiness fails, the relay retries it with
    /// the maximum backoff until an operator fixes the cause.
    Halt,
}

/// What a row whose payload is NULL becomes.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NullPayload {
    /// A record with a null value: on a compacted topic a tombstone that deletes the key
    /// (what Debezium's EventRouter sends; the Debezium preset's default).
    Tombstone,
    /// A deterministic failure (`invalid_event`), parked or halting as `on_poison` says (the
    /// default of the outboxd preset).
    Park,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct TypePolicy {
    #[serde(default)]
    pub ordering: Option<Ordering>,
    #[serde(default)]
    pub on_poison: Option<OnPoison>,
    #[serde(default)]
    pub on_null_payload: Option<NullPayload>,
}

/// `[policy]`: defaults plus per-event-type overrides in `[policy.event_types.<type>]`.
#[derive(Debug, Clone, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    #[serde(default)]
    pub ordering: Ordering,
    #[serde(default)]
    pub on_poison: OnPoison,
    /// Unset: `tombstone` with the Debezium preset, `park` otherwise.
    #[serde(default)]
    pub on_null_payload: Option<NullPayload>,
    #[serde(default)]
    pub event_types: BTreeMap<String, TypePolicy>,
}

/// `[source.tables.policy]`: one table's overrides of `[policy]` (R44).
///
/// It is merged with `[policy]`, never read alone: a key set here replaces the top-level key
/// for this table; an `event_types` entry here replaces the top-level entry of that type
/// whole (its unset keys fall back to this table's defaults, as top-level entries fall back to
/// the top-level defaults); top-level entries this table does not name apply as written.
/// A table default that differs from what a top-level entry sets for the same key is refused
/// ([`PolicyOverride::conflicts`]): nothing says which of the two should win.
#[derive(Debug, Clone, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PolicyOverride {
    #[serde(default)]
    pub ordering: Option<Ordering>,
    #[serde(default)]
    pub on_poison: Option<OnPoison>,
    #[serde(default)]
    pub on_null_payload: Option<NullPayload>,
    #[serde(default)]
    pub event_types: BTreeMap<String, TypePolicy>,
}

impl PolicyOverride {
    /// `top` with this table's overrides applied (see the type's docs). Check
    /// [`PolicyOverride::conflicts`] first: this resolves a conflict in the table's favour.
    pub fn merged(&self, top: &PolicyConfig) -> PolicyConfig {
        let mut event_types = top.event_types.clone();
        event_types.extend(self.event_types.clone());
        PolicyConfig {
            ordering: self.ordering.unwrap_or(top.ordering),
            on_poison: self.on_poison.unwrap_or(top.on_poison),
            on_null_payload: self.on_null_payload.or(top.on_null_payload),
            event_types,
        }
    }

    /// The first ambiguity of this table's policy against `top`, as `(event_type, key,
    /// table's default, top-level entry's value)`: a default this table sets that a top-level
    /// `[policy.event_types.<type>]` entry, which this table does not override, sets otherwise.
    pub fn conflicts(&self, top: &PolicyConfig) -> Option<(String, &'static str, String, String)> {
        let ours = TypePolicy {
            ordering: self.ordering,
            on_poison: self.on_poison,
            on_null_payload: self.on_null_payload,
        }
        .keys();
        top.event_types
            .iter()
            .filter(|(name, _)| !self.event_types.contains_key(*name))
            .find_map(|(name, entry)| {
                ours.iter()
                    .zip(entry.keys())
                    .find_map(|((key, o), (_, t))| match (o, t) {
                        (Some(o), Some(t)) if *o != t => Some((name.clone(), *key, o.clone(), t)),
                        _ => None,
                    })
            })
    }
}

impl TypePolicy {
    /// Each key as written in TOML, with its value (`None`: unset).
    fn keys(&self) -> [(&'static str, Option<String>); 3] {
        let text = |v: &dyn std::fmt::Debug| format!("{v:?}").to_ascii_lowercase();
        [
            ("ordering", self.ordering.map(|v| text(&v))),
            ("on_poison", self.on_poison.map(|v| text(&v))),
            ("on_null_payload", self.on_null_payload.map(|v| text(&v))),
        ]
    }
}

/// The policy that applies to one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effective {
    pub ordering: Ordering,
    pub on_poison: OnPoison,
}

impl PolicyConfig {
    /// What a NULL payload of `event_type` becomes; `preset` is the preset's default.
    pub fn null_payload(&self, event_type: &str, preset: NullPayload) -> NullPayload {
        self.event_types
            .get(event_type)
            .and_then(|t| t.on_null_payload)
            .or(self.on_null_payload)
            .unwrap_or(preset)
    }

    pub fn for_type(&self, event_type: &str) -> Effective {
        let t = self.event_types.get(event_type);
        Effective {
            ordering: t.and_then(|t| t.ordering).unwrap_or(self.ordering),
            on_poison: t.and_then(|t| t.on_poison).unwrap_or(self.on_poison),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two per-type overrides, after a default given by each test.
    const TYPES: &str = r#"
[event_types.EmailRequested]
ordering = "none"
[event_types.BalanceChanged]
on_poison = "halt"
"#;

    #[test]
    fn per_type_overrides_fall_back_to_defaults() {
        let p: PolicyConfig =
            toml::from_str(&format!("ordering = \"aggregate\"\n{TYPES}")).unwrap();
        assert_eq!(
            p.for_type("EmailRequested"),
            Effective {
                ordering: Ordering::None,
                on_poison: OnPoison::Park
            }
        );
        assert_eq!(p.for_type("BalanceChanged").on_poison, OnPoison::Halt);
        assert_eq!(p.for_type("BalanceChanged").ordering, Ordering::Aggregate);
        assert_eq!(p.for_type("Other"), p.for_type("Another"));
    }

    #[test]
    fn null_payload_policy_per_type_then_global_then_preset() {
        let p: PolicyConfig =
            toml::from_str("[event_types.Deleted]\non_null_payload = \"tombstone\"\n").unwrap();
        assert_eq!(
            p.null_payload("Deleted", NullPayload::Park),
            NullPayload::Tombstone
        );
        assert_eq!(
            p.null_payload("Other", NullPayload::Park),
            NullPayload::Park
        );
        assert_eq!(
            p.null_payload("Other", NullPayload::Tombstone),
            NullPayload::Tombstone
        );
        let p: PolicyConfig = toml::from_str("on_null_payload = \"park\"\n").unwrap();
        assert_eq!(
            p.null_payload("Other", NullPayload::Tombstone),
            NullPayload::Park
        );
    }

    #[test]
    fn a_table_policy_merges_per_event_type_and_refuses_ambiguity() {
        let top: PolicyConfig = toml::from_str(&format!("on_poison = \"halt\"\n{TYPES}")).unwrap();
        let table: PolicyOverride = toml::from_str(
            r#"
ordering = "none"
[event_types.BalanceChanged]
on_poison = "park"
[event_types.Tenant]
ordering = "aggregate"
"#,
        )
        .unwrap();
        assert_eq!(table.conflicts(&top), None);
        let m = table.merged(&top);
        // The table's defaults; the top-level on_poison where the table sets none.
        assert_eq!(m.for_type("Other").ordering, Ordering::None);
        assert_eq!(m.for_type("Other").on_poison, OnPoison::Halt);
        // The table's entry replaces the top-level one whole.
        assert_eq!(m.for_type("BalanceChanged").on_poison, OnPoison::Park);
        assert_eq!(m.for_type("BalanceChanged").ordering, Ordering::None);
        assert_eq!(m.for_type("Tenant").ordering, Ordering::Aggregate);
        // A top-level entry the table does not name applies as written.
        assert_eq!(m.for_type("EmailRequested").ordering, Ordering::None);
        assert_eq!(m.for_type("EmailRequested").on_poison, OnPoison::Halt);
        // Nothing set: the top-level policy itself.
        let none = PolicyOverride::default();
        assert_eq!(none.merged(&top).for_type("X"), top.for_type("X"));
        // A table default against a top-level entry's own value: ambiguous.
        let park: PolicyOverride = toml::from_str("on_poison = \"park\"\n").unwrap();
        assert_eq!(
            park.conflicts(&top),
            Some((
                "BalanceChanged".into(),
                "on_poison",
                "park".into(),
                "halt".into()
            ))
        );
        // The same value is no conflict.
        let halt: PolicyOverride = toml::from_str("on_poison = \"halt\"\n").unwrap();
        assert_eq!(halt.conflicts(&top), None);
    }
}
