//! Metrics through the `metrics` facade: duplicates, conflicts (alert), held gauge, gap
//! timeouts, commit→consume delay, and bounded labels (never an event or aggregate id).
//! Own test binary: it installs a global recorder.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::Result;
use common::*;
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use outboxd_inbox::{metrics as m, Inbox};
use uuid::Uuid;

#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

#[derive(Default)]
struct TestRecorder {
    counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
    gauges: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
    histograms: Mutex<BTreeMap<String, Arc<Samples>>>,
}

/// `name{k=v,...}` with labels sorted, so tests can look series up by text.
fn render(key: &Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let c = self
            .counters
            .lock()
            .unwrap()
            .entry(render(key))
            .or_default()
            .clone();
        Counter::from_arc(c)
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let g = self
            .gauges
            .lock()
            .unwrap()
            .entry(render(key))
            .or_default()
            .clone();
        Gauge::from_arc(g)
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let h = self
            .histograms
            .lock()
            .unwrap()
            .entry(render(key))
            .or_default()
            .clone();
        Histogram::from_arc(h)
    }
}

fn recorder() -> &'static TestRecorder {
    static R: OnceLock<&'static TestRecorder> = OnceLock::new();
    R.get_or_init(|| {
        let r: &'static TestRecorder = Box::leak(Box::default());
        metrics::set_global_recorder(r).expect("install recorder");
        r
    })
}

impl TestRecorder {
    fn counter(&self, series: &str) -> u64 {
        self.counters
            .lock()
            .unwrap()
            .get(series)
            .map_or(0, |c| c.load(AtomicOrdering::SeqCst))
    }

    fn gauge(&self, series: &str) -> Option<f64> {
        self.gauges
            .lock()
            .unwrap()
            .get(series)
            .map(|g| f64::from_bits(g.load(AtomicOrdering::SeqCst)))
    }

    fn all_series(&self) -> Vec<String> {
        let mut v: Vec<String> = self.counters.lock().unwrap().keys().cloned().collect();
        v.extend(self.gauges.lock().unwrap().keys().cloned());
        v.extend(self.histograms.lock().unwrap().keys().cloned());
        v
    }
}

#[tokio::test]
async fn inbox_metrics_have_bounded_labels_and_alert_on_conflicts_and_gaps() -> Result<()> {
    let rec = recorder();
    let (mut c, _) = consumer_db(cluster(), "metrics").await?;
    let window = Duration::from_millis(10);
    let inbox = Inbox::new(Projection::ordered("metrics-shipping", window));
    let e1 = event(Uuid::now_v7(), "order-17", 1, "placed");
    for _ in 0..3 {
        inbox.process(&mut c, &e1).await?;
    }
    let rival = event(Uuid::now_v7(), "order-17", 1, "cancelled");
    assert!(inbox.process(&mut c, &rival).await.is_err());
    let e3 = event(Uuid::now_v7(), "order-17", 3, "shipped");
    inbox.process(&mut c, &e3).await?;
    inbox
        .sweep_at(&mut c, chrono::Utc::now() + chrono::Duration::hours(1))
        .await?;

    let l = "consumer=metrics-shipping";
    assert_eq!(
        rec.counter(&format!("{}{{{l},outcome=applied}}", m::EVENTS_TOTAL)),
        1
    );
    assert_eq!(
        rec.counter(&format!("{}{{{l},outcome=duplicate}}", m::EVENTS_TOTAL)),
        2
    );
    assert_eq!(
        rec.counter(&format!("{}{{{l},outcome=held}}", m::EVENTS_TOTAL)),
        1
    );
    assert_eq!(
        rec.counter(&format!(
            "{}{{aggregate_type=order,{l}}}",
            m::CONFLICTS_TOTAL
        )),
        1
    );
    assert_eq!(rec.counter(&format!("{}{{{l}}}", m::GAP_TIMEOUTS_TOTAL)), 1);
    assert_eq!(rec.gauge(&format!("{}{{{l}}}", m::HELD_EVENTS)), Some(1.0));
    let delay = format!(
        "{}{{{l},event_type=OrderStatusChanged}}",
        m::COMMIT_TO_CONSUME_SECONDS
    );
    let n = rec.histograms.lock().unwrap()[&delay]
        .0
        .lock()
        .unwrap()
        .len();
    assert_eq!(n, 5, "one delay sample per consumed record");

    for s in rec.all_series() {
        for id in [e1.event_id, rival.event_id, e3.event_id] {
            assert!(!s.contains(&id.to_string()), "{s} carries an event id");
        }
        assert!(!s.contains("order-17"), "{s} carries an aggregate id");
    }
    Ok(())
}
