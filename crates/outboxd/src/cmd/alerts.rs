//! `outboxd alerts`: Prometheus alerting rules generated from the config (R26): one delivery-delay
//! budget per event type — a search index may lag 10 minutes, a notification 1 minute — plus slot
//! lag, WAL status, a stalled heartbeat, a halted relay, parked events and no active relay.

use crate::config::alerts::AlertsConfig;
use crate::obs;
use std::fmt::Write;

/// Escapes a label value for a PromQL string literal (Go's escapes: a raw newline would end
/// the expression's parse).
fn promql_str(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '\\' => "\\\\".to_string(),
            '"' => "\\\"".to_string(),
            c if c.is_control() => format!("\\u{:04x}", c as u32),
            c => c.to_string(),
        })
        .collect()
}

/// Escapes RE2 metacharacters, so an event type is matched literally inside `=~`/`!~`
/// (`Order.Placed` must not also match `OrderXPlaced`, nor `a|b` split the alternation).
fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Escapes a YAML double-quoted scalar.
fn yaml_str(s: &str) -> String {
    let escaped: String = s
        .chars()
        .map(|c| match c {
            '\\' => "\\\\".to_string(),
            '"' => "\\\"".to_string(),
            c if c.is_control() => format!("\\u{:04x}", c as u32),
            c => c.to_string(),
        })
        .collect();
    format!("\"{escaped}\"")
}

/// `op`, or `op by (labels)` with the configured group labels first.
fn agg(op: &str, group: &[String], extra: &[&str]) -> String {
    let labels: Vec<&str> = group
        .iter()
        .map(String::as_str)
        .chain(extra.iter().copied())
        .collect();
    if labels.is_empty() {
        op.to_string()
    } else {
        format!("{op} by ({})", labels.join(", "))
    }
}

struct Rule {
    alert: &'static str,
    expr: String,
    for_: &'static str,
    severity: &'static str,
    labels: Vec<(&'static str, String)>,
    summary: String,
}

/// The rules file (YAML), for `rule_files:` in prometheus.yml.
pub fn rules(cfg: &AlertsConfig) -> String {
    let mut rules = Vec::new();
    let g = &cfg.group_by;
    let budgets = &cfg.delivery_budget_seconds;
    for (event_type, secs) in budgets.iter().filter(|(t, _)| *t != "default") {
        rules.push(Rule {
            alert: "OutboxdDeliveryBudgetExceeded",
            expr: format!(
                "{} ({}{{event_type=\"{}\"}}) > {secs}",
                agg("max", g, &["event_type"]),
                obs::OLDEST_PENDING_AGE,
                promql_str(event_type)
            ),
            for_: "30s",
            severity: "page",
            labels: vec![("event_type", event_type.clone())],
            summary: format!("{event_type} events wait longer than their {secs}s delivery budget"),
        });
    }
    if let Some(secs) = budgets.get("default") {
        let listed: Vec<String> = budgets
            .keys()
            .filter(|t| *t != "default")
            .map(|t| promql_str(&regex_literal(t)))
            .collect();
        let selector = if listed.is_empty() {
            String::new()
        } else {
            format!("{{event_type!~\"{}\"}}", listed.join("|"))
        };
        rules.push(Rule {
            alert: "OutboxdDeliveryBudgetExceeded",
            expr: format!(
                "{} ({}{selector}) > {secs}",
                agg("max", g, &["event_type"]),
                obs::OLDEST_PENDING_AGE
            ),
            for_: "30s",
            severity: "page",
            labels: vec![],
            summary: format!("events wait longer than the default {secs}s delivery budget"),
        });
    }
    rules.push(Rule {
        alert: "OutboxdSlotLagHigh",
        expr: format!(
            "{}({}) > {}",
            agg("max", g, &[]),
            obs::SLOT_LAG_BYTES,
            cfg.slot_lag_bytes
        ),
        for_: "5m",
        severity: "warning",
        labels: vec![],
        summary: "the replication slot retains more WAL than allowed; the relay is behind or down"
            .into(),
    });
    rules.push(Rule {
        alert: "OutboxdSlotLost",
        // Not `increase(losses[15m])`: a loss found at startup (a restore, a relay restarted
        // into a failover) makes the counter 1 before the first scrape, which is no increase.
        expr: format!(
            "time() - {}({} > 0) < 900",
            agg("max", g, &[]),
            obs::SLOT_LAST_LOSS
        ),
        for_: "0s",
        severity: "page",
        labels: vec![],
        summary: "the replication slot was lost (dropped, invalidated, failover or restore): \
                  check that the recovery finished (outboxd status) or run outboxd recover"
            .into(),
    });
    rules.push(Rule {
        alert: "OutboxdBrokerAuthFailing",
        expr: format!(
            "{}(increase({}{{class=~\"auth|tls\"}}[5m])) > 0",
            agg("sum", g, &[]),
            obs::BROKER_ERRORS
        ),
        for_: "2m",
        severity: "page",
        labels: vec![],
        summary: "the broker refuses the relay's credentials or TLS (rotated password, expired \
                  certificate, revoked client): events wait; outboxd status shows the cause"
            .into(),
    });
    rules.push(Rule {
        alert: "OutboxdSlotWalEndangered",
        expr: format!(
            "{}({}{{status=~\"unreserved|lost\"}}) == 1",
            agg("max", g, &[]),
            obs::SLOT_WAL_STATUS
        ),
        for_: "0s",
        severity: "page",
        labels: vec![],
        summary: "the slot's WAL is about to be or has been removed (max_slot_wal_keep_size)"
            .into(),
    });
    rules.push(Rule {
        alert: "OutboxdHeartbeatStale",
        // Only the active instance's age counts: a standby keeps the value its last session
        // left (possibly stale), which must not page while another instance streams fine.
        expr: format!(
            "{}({} and on (instance, job) ({} == 1)) > {}",
            agg("max", g, &[]),
            obs::HEARTBEAT_AGE,
            obs::ROLE_ACTIVE,
            cfg.heartbeat_stale_seconds,
        ),
        for_: "1m",
        severity: "page",
        labels: vec![],
        summary: "heartbeats no longer come back through the replication stream".into(),
    });
    rules.push(Rule {
        alert: "OutboxdHalted",
        expr: format!("{}({}) == 1", agg("max", g, &[]), obs::HALTED),
        for_: "0s",
        severity: "page",
        labels: vec![],
        summary: "the relay is halted at a poison event (on_poison = \"halt\"); see outboxd parked / logs".into(),
    });
    rules.push(Rule {
        alert: "OutboxdParkedEvents",
        expr: format!(
            "{} ({}{{state=\"parked\"}}) > 0",
            agg("sum", g, &["event_type"]),
            obs::PARKED
        ),
        for_: "0s",
        severity: "warning",
        labels: vec![],
        summary: "events are parked and need an operator (outboxd parked list)".into(),
    });
    rules.push(Rule {
        alert: "OutboxdAggregatesStuck",
        // Not a page of its own: the parked head already raised OutboxdParkedEvents. This one
        // says that later events of live aggregates have waited behind it for half an hour.
        expr: format!("{}({}) > 0", agg("max", g, &[]), obs::STUCK_AGGREGATES),
        for_: "30m",
        severity: "warning",
        labels: vec![],
        summary: "aggregates' later events have waited behind a parked event for 30 min (outboxd status names them; one outboxd parked retry or discard of the head releases its held events)".into(),
    });
    rules.push(Rule {
        alert: "OutboxdDown",
        // Per pair: instances that answer, none active. A pair whose every instance is gone
        // has no series left to group: Prometheus's own `up == 0` for its targets says that
        // (absent() only sees the last relay of all disappear).
        expr: format!(
            "absent({}) or {}({}) < 1",
            obs::UP,
            agg("sum", g, &[]),
            obs::ROLE_ACTIVE
        ),
        for_: "1m",
        severity: "page",
        labels: vec![],
        summary: "no outboxd instance holds the slot".into(),
    });

    let mut out = String::from("# Generated by `outboxd alerts` from the [alerts] config section.\ngroups:\n  - name: outboxd\n    rules:\n");
    for r in rules {
        let _ = writeln!(out, "      - alert: {}", r.alert);
        let _ = writeln!(out, "        expr: {}", yaml_str(&r.expr));
        let _ = writeln!(out, "        for: {}", r.for_);
        let _ = writeln!(out, "        labels:");
        let _ = writeln!(out, "          severity: {}", r.severity);
        for (k, v) in &r.labels {
            let _ = writeln!(out, "          {k}: {}", yaml_str(v));
        }
        let _ = writeln!(out, "        annotations:");
        let _ = writeln!(out, "          summary: {}", yaml_str(&r.summary));
        let _ = writeln!(out, "          runbook: \"docs/operations.md\"");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_become_rules_and_only_known_metrics_are_used() {
        let cfg: AlertsConfig = toml::from_str(
            "[delivery_budget_seconds]\nSearchIndexRequested = 600\nNotificationRequested = 60\ndefault = 300\n",
        )
        .unwrap();
        let y = rules(&cfg);
        assert!(y.contains("outboxd_oldest_pending_age_seconds{event_type=\\\"SearchIndexRequested\\\"}) > 600"), "{y}");
        assert!(
            y.contains("event_type!~\\\"NotificationRequested|SearchIndexRequested\\\""),
            "{y}"
        );
        let known: Vec<&str> = obs::METRICS.iter().map(|(n, _)| *n).collect();
        for word in y.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("outboxd_") {
                assert!(known.contains(&word), "rule uses unknown metric {word}");
            }
        }
    }

    #[test]
    fn group_by_aggregates_every_rule_per_pair() {
        let cfg: AlertsConfig =
            toml::from_str("group_by = [\"database\"]\n[delivery_budget_seconds]\ndefault = 300\n")
                .unwrap();
        cfg.validate().unwrap();
        let y = rules(&cfg);
        for expr in y.lines().filter(|l| l.trim_start().starts_with("expr:")) {
            let aggregations = expr.matches("max").count() + expr.matches("sum").count();
            let grouped = expr.matches("by (database").count();
            assert_eq!(aggregations, grouped, "{expr}");
        }
        assert!(y.contains("max by (database, event_type) (outboxd_oldest_pending_age_seconds)"));
        assert!(
            y.contains("sum by (database)(outboxd_role_active) < 1"),
            "{y}"
        );
        // Without it, the rules are what they were.
        let plain = rules(&AlertsConfig::default());
        assert!(plain.contains("absent(outboxd_up) or sum(outboxd_role_active) < 1"));
        for bad in ["", "a-b", "__name", "1x", "a b"] {
            let c = AlertsConfig {
                group_by: vec![bad.into()],
                ..AlertsConfig::default()
            };
            assert!(c.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn event_types_are_matched_literally() {
        assert_eq!(regex_literal("Order.Placed|x"), r"Order\.Placed\|x");
        assert_eq!(yaml_str("a\"b\nc"), r#""a\"b\u000ac""#);
        assert_eq!(promql_str("a\"b\\c\nd"), r#"a\"b\\c\u000ad"#);
    }
}
