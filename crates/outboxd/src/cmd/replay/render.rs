//! What `outboxd replay` prints: the dry run, the list, one replay. Names read from the table
//! (event types, topics, roles, reasons) are shown escaped, never sent to the terminal raw.

use crate::cmd::parked::printable;
use crate::replay::consumers::{self, Consumers, Lag, OnTopic};
use crate::replay::select::{Selection, Summary};
use crate::replay::store;
use chrono::{DateTime, Utc};
use std::fmt::Write;

/// Groups shown per topic (the rest are counted).
const GROUPS_SHOWN: usize = 20;

/// Who receives the events: per target topic the consumer groups with committed offsets and
/// their lag, or why the broker could not say. One line each, the first to follow a label.
pub fn consumers(c: &Consumers) -> Vec<String> {
    let mut out = Vec::new();
    match c {
        Consumers::Unknown(why) => out.push(format!("unknown ({})", printable(why))),
        Consumers::Known {
            topics,
            listed,
            unchecked,
            failed,
        } => {
            let mut bound = false;
            for (topic, on) in topics {
                let groups = match on {
                    OnTopic::Missing => "the broker has no such topic".to_string(),
                    OnTopic::Unreadable(e) => {
                        format!("not described by the broker ({})", printable(e))
                    }
                    OnTopic::Groups(g) if g.is_empty() => {
                        "no consumer group has committed offsets on it".to_string()
                    }
                    OnTopic::Groups(g) => {
                        let mut shown: Vec<String> = g
                            .iter()
                            .take(GROUPS_SHOWN)
                            .map(|g| {
                                bound |= matches!(g.lag, Lag::AtLeast(_));
                                let mut s = match g.lag {
                                    Lag::Exact(n) => format!("lag {n}"),
                                    Lag::AtLeast(n) => format!("lag ≥ {n}"),
                                    Lag::Unknown => "lag unknown".into(),
                                };
                                if g.committed < g.partitions {
                                    s += &format!(
                                        " on {} of {} partitions",
                                        g.committed, g.partitions
                                    );
                                }
                                if !g.active {
                                    s += ", no members";
                                }
                                format!("{} ({s})", printable(&g.name))
                            })
                            .collect();
                        if g.len() > GROUPS_SHOWN {
                            shown.push(format!("… and {} more", g.len() - GROUPS_SHOWN));
                        }
                        shown.join(", ")
                    }
                };
                out.push(format!("{}: {groups}", printable(topic)));
            }
            if *listed == 0 && !topics.is_empty() {
                out.push(
                    "the broker listed no consumer group: there is none, or [sink.kafka]'s \
                     principal may not describe them (Kafka lists only those it may)"
                        .into(),
                );
            }
            if *unchecked > 0 {
                out.push(format!(
                    "{unchecked} group(s) not checked (at most {} groups, {} s)",
                    consumers::MAX_GROUPS,
                    consumers::BUDGET.as_secs()
                ));
            }
            if *failed > 0 {
                out.push(format!(
                    "{failed} group(s) whose committed offsets the broker did not return"
                ));
            }
            if bound {
                out.push(
                    "lag ≥: a high watermark the broker reported is below a committed offset \
                     (its watermarks lag)"
                        .into(),
                );
            }
        }
    }
    out
}

/// `lines` under `label`, the rest indented to its width.
fn labeled(o: &mut String, label: &str, lines: &[String]) {
    let pad = " ".repeat(label.chars().count());
    for (i, l) in lines.iter().enumerate() {
        let _ = writeln!(o, "{}{l}", if i == 0 { label } else { &pad });
    }
}

/// The dry run, judged by the database's `policy`; `capped`: the `--until` asked for, when it
/// was later than the database's clock (the selection ends at its now()).
pub fn plan(
    sel: &Selection,
    s: &Summary,
    policy: &store::Policy,
    capped: Option<DateTime<Utc>>,
    rate: u32,
    c: &Consumers,
) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "dry run: nothing was sent");
    let _ = writeln!(o, "selection:  {}", sel.describe());
    if let Some(asked) = capped {
        let _ = writeln!(
            o,
            "until:      --until {} is in the future: capped at the database's now() (rows \
             written later are never part of this replay)",
            asked.to_rfc3339()
        );
    }
    let rate = rate.max(1);
    let _ = writeln!(
        o,
        "events:     {} to republish with their original event_id (at {rate}/s: about {} s)",
        s.total,
        (s.total as u64).div_ceil(rate as u64)
    );
    if let (Some(a), Some(b)) = (s.first, s.last) {
        let _ = writeln!(o, "created:    {} .. {}", a.to_rfc3339(), b.to_rfc3339());
    }
    if !s.groups.is_empty() {
        let w = s
            .groups
            .iter()
            .map(|g| g.0.len())
            .max()
            .unwrap_or(0)
            .max(10);
        let _ = writeln!(o, "  {:<w$}  {:>8}  topic", "event type", "events");
        for (t, topic, n) in &s.groups {
            let _ = writeln!(o, "  {:<w$}  {n:>8}  {}", printable(t), printable(topic));
        }
    }
    if !s.not_found.is_empty() {
        let shown: Vec<&str> = s.not_found.iter().take(20).map(String::as_str).collect();
        let more = s.not_found.len().saturating_sub(shown.len());
        let _ = writeln!(
            o,
            "not found:  {} event_id(s) not in the outbox table: {}{}",
            s.not_found.len(),
            shown.join(", "),
            if more > 0 {
                format!(" … and {more} more")
            } else {
                String::new()
            }
        );
    }
    for t in &s.side_effects {
        let _ = writeln!(
            o,
            "WARNING: event type {} has side effects (replay.side_effect_types, the database's \
             policy): a consumer that does not deduplicate by event_id acts on it again",
            printable(t)
        );
    }
    for t in &s.shadowed {
        let _ = writeln!(
            o,
            "WARNING: event type {} is in shadow mode (not in shadow.deliver_types): the legacy \
             path delivers it, so outboxd refuses to replay it",
            printable(t)
        );
    }
    let why = s.approval_reasons(policy);
    if why.is_empty() {
        let _ = writeln!(
            o,
            "approval:   not needed; run it with the same selection and --execute --reason R"
        );
    } else {
        let _ = writeln!(
            o,
            "approval:   needed ({}): `outboxd replay request … --reason R`, `outboxd replay \
             approve ID` by another database role, then `outboxd replay run ID`",
            printable(&why.join("; "))
        );
    }
    let mut lines = consumers(c);
    lines.push(
        "receive these events again with the same event_id; an inbox deduplicates them \
         (docs/inbox.md)"
            .into(),
    );
    labeled(&mut o, "consumers:  ", &lines);
    o
}

pub fn list(rows: &[store::Replay]) -> String {
    let mut o = format!(
        "{:>5}  {:<11}  {:>8}  {:>8}  {:<16}  {:<16}  {:<20}  reason\n",
        "id", "state", "events", "acked", "requested_by", "approved_by", "requested_at"
    );
    for r in rows {
        let _ = writeln!(
            o,
            "{:>5}  {:<11}  {:>8}  {:>8}  {:<16}  {:<16}  {:<20}  {}",
            r.id,
            r.state,
            r.events,
            r.sent,
            printable(&r.requested_by),
            printable(r.approved_by.as_deref().unwrap_or("-")),
            r.requested_at.format("%Y-%m-%dT%H:%M:%SZ"),
            printable(&r.reason)
        );
    }
    let _ = writeln!(o, "{} replay(s)", rows.len());
    o
}

/// One replay, with the consumers of its topics now.
pub fn show(r: &store::Replay, c: &Consumers) -> String {
    let t = |t: &Option<DateTime<Utc>>| t.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into());
    let sel = Selection::from_json(&r.selection)
        .map(|s| s.describe())
        .unwrap_or_else(|e| e.to_string());
    let mut o = String::new();
    let _ = writeln!(o, "replay:        {}", r.id);
    let _ = writeln!(o, "state:         {}", r.state);
    let _ = writeln!(o, "selection:     {}", printable(&sel));
    if let Some(table) = crate::replay::select::recorded_table(&r.selection) {
        let _ = writeln!(o, "table:         {}", printable(table));
    }
    let _ = writeln!(o, "selected:      {} event(s) when requested", r.events);
    if let Some(groups) = r.summary.as_array() {
        for g in groups {
            let f = |i: usize| match g.get(i) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => String::new(),
            };
            let _ = writeln!(
                o,
                "               {} → {}: {}",
                printable(&f(0)),
                printable(&f(1)),
                f(2)
            );
        }
    }
    if !r.side_effects.is_empty() {
        let _ = writeln!(
            o,
            "side effects:  {}",
            printable(&r.side_effects.join(", "))
        );
    }
    let _ = writeln!(o, "reason:        {}", printable(&r.reason));
    let _ = writeln!(
        o,
        "requested:     {} by database role {} (operator {})",
        r.requested_at.to_rfc3339(),
        printable(&r.requested_by),
        printable(r.operator.as_deref().unwrap_or("-"))
    );
    let _ = writeln!(
        o,
        "approval:      {}",
        match (&r.approved_by, r.needs_approval) {
            (Some(a), _) => format!("{} by database role {}", t(&r.approved_at), printable(a)),
            (None, true) => "waiting (`outboxd replay approve ID` by another role)".into(),
            (None, false) => "not needed (small, no side-effecting types)".into(),
        }
    );
    let _ = writeln!(o, "rate:          {}/s", r.rate);
    let _ = writeln!(
        o,
        "runs:          {} (last by {}), started {}, finished {}",
        r.runs,
        printable(r.run_by.as_deref().unwrap_or("-")),
        t(&r.started_at),
        t(&r.finished_at)
    );
    let _ = writeln!(o, "acknowledged:  {} event(s)", r.sent);
    labeled(&mut o, "consumers now: ", &consumers(c));
    if let Some(c) = &r.cursor {
        let _ = writeln!(
            o,
            "cursor:        after aggregate {}/{} at {}, event_id {}",
            printable(&c.keys[0]),
            printable(&c.keys[1]),
            printable(&c.keys[2]),
            printable(c.event_id())
        );
    }
    if let Some(e) = &r.error {
        let _ = writeln!(o, "error:         {}", printable(e));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::consumers::Group;

    fn group(name: &str, lag: Lag, committed: usize, active: bool) -> Group {
        Group {
            name: name.into(),
            lag,
            committed,
            partitions: 3,
            active,
        }
    }

    #[test]
    fn consumers_per_topic_with_lag_or_why_unknown() {
        let c = Consumers::Known {
            topics: vec![
                ("outbox.event.acct".into(), OnTopic::Groups(vec![])),
                ("outbox.event.gone".into(), OnTopic::Missing),
                (
                    "outbox.event.hidden".into(),
                    OnTopic::Unreadable("Broker: Topic authorization failed".into()),
                ),
                (
                    "outbox.event.order".into(),
                    OnTopic::Groups(vec![
                        group("billing", Lag::Exact(0), 3, true),
                        group("old\u{1b}[2J", Lag::AtLeast(4), 1, false),
                        group("search", Lag::Unknown, 3, true),
                    ]),
                ),
            ],
            listed: 5,
            unchecked: 2,
            failed: 1,
        };
        let mut o = String::new();
        labeled(&mut o, "consumers:  ", &consumers(&c));
        assert_eq!(
            o,
            "consumers:  outbox.event.acct: no consumer group has committed offsets on it\n\
             \x20           outbox.event.gone: the broker has no such topic\n\
             \x20           outbox.event.hidden: not described by the broker (Broker: Topic \
             authorization failed)\n\
             \x20           outbox.event.order: billing (lag 0), old\\u{1b}[2J (lag ≥ 4 on 1 of 3 \
             partitions, no members), search (lag unknown)\n\
             \x20           2 group(s) not checked (at most 200 groups, 10 s)\n\
             \x20           1 group(s) whose committed offsets the broker did not return\n\
             \x20           lag ≥: a high watermark the broker reported is below a committed \
             offset (its watermarks lag)\n"
        );
        let none = Consumers::Known {
            topics: vec![("t".into(), OnTopic::Groups(vec![]))],
            listed: 0,
            unchecked: 0,
            failed: 0,
        };
        assert_eq!(
            consumers(&none)[1],
            "the broker listed no consumer group: there is none, or [sink.kafka]'s principal \
             may not describe them (Kafka lists only those it may)"
        );
        let u = Consumers::Unknown("the broker did not list its consumer groups: \u{7}x".into());
        assert_eq!(
            consumers(&u),
            ["unknown (the broker did not list its consumer groups: \\u{7}x)"]
        );
    }
}
