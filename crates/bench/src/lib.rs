//! outboxd-bench: outboxd against the single-slot ceiling and a polling relay, in one run.
//!
//! One invocation starts its own Postgres and broker (testkit), loads the same rows for every
//! contestant, and measures side by side:
//! - **ceiling**: how fast this Postgres streams the rows out of a pgoutput slot with nothing done
//!   to them (`pg_recvlogical` to /dev/null, and a bare pgwire-replication reader);
//! - **outboxd**: the real relay process, from commit to broker acknowledgement;
//! - **polling**: a `FOR UPDATE SKIP LOCKED` relay, written fairly.
//!
//! # Layout
//! - [`bench`]: the phases (throughput per tx size, latency sweep, one huge transaction);
//!   `bench/live.rs`: the latency phase.
//! - [`consume`]: the commit→consumer point's consumer.
//! - [`world`]: Postgres, broker, tables, server-side loaders.
//! - [`contest`]: timed runs of each contestant as its own process; [`contestant`]: who runs.
//! - [`kafka_hop`]: the second broker behind a plain-or-TLS proxy (what TLS to Kafka costs);
//!   `report/kafka_tls.rs`: its part of the report.
//! - [`bare`], [`poll`]: the bare reader and the polling relay (hidden subcommands).
//! - [`latency`]: open-loop writers and commit→ack measurement.
//! - [`verify`]: read-back of every event after the clock stopped.
//! - [`procstat`]: CPU and RSS from /proc and wait4.
//! - [`report`], [`chart`]: Markdown/JSON results and the SVG chart.
//! - [`tables`]: `outboxd-bench tables`, many outbox tables through one relay against one
//!   relay per table (issue 30); `tables/fleet.rs`: the relays of one arrangement.
//! - [`standby`]: `outboxd-bench standby`, the slot on a physical standby against the slot on
//!   the primary (issue 31): primary CPU per event and commit→ack.
//! - [`mqbridge`]: `outboxd-bench mqbridge`, outboxd against mq-bridge at light load, commit →
//!   consumer (issue 28); mq-bridge runs as its own CLI (`scripts/mqbridge.sh`).
//! - [`otel`]: `outboxd-bench otel`, what OpenTelemetry trace export costs delivery (issue 43):
//!   backlog and live, off / all sampled / 1 % / receiver down; [`otlp`]: its OTLP receiver.

pub mod bare;
pub mod bench;
pub mod bytea;
pub mod ce;
pub mod chart;
pub mod consume;
pub mod contest;
pub mod contestant;
pub mod kafka_hop;
pub mod latency;
pub mod mqbridge;
pub mod otel;
pub mod otlp;
pub mod poll;
pub mod procstat;
pub mod report;
pub mod report_latency;
pub mod scrape;
pub mod standby;
pub mod tables;
pub mod verify;
pub mod world;
