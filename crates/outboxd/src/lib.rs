//! outboxd: the transactional outbox relay. Committed outbox rows are read from the WAL through
//! a logical replication slot (pgoutput) and produced to Kafka keyed by `aggregate_id`; the slot's
//! confirmed LSN advances only after the broker acknowledged everything before it, so a crash
//! replays identical `event_id`s and never loses one.
//!
//! # Layout
//! Data flows one way through the relay; what flows back is the acknowledgement.
//!
//! - `supervisor`: [`run`] — one session after another; transient errors restart from the
//!   slot, definite ones stop the relay. `supervisor/session`: one session's loop (preflight,
//!   the slot's guard and recovery, tenant joins, then the stages over the stream).
//! - `relay/`: the stages of a session, in data-flow order:
//!   - `source`: SQL preflight, slot handling and the replication stream (`blockers`: a slot
//!     creation bounded, naming the transactions it waits for); `tls`: TLS to
//!     Postgres for both; `gulp`: reads a live stream a transaction (under load, several) at a
//!     time instead of one message per wake-up, gathering only when there are others to
//!     gather (the adaptive pace); `ack_wait`: when the session's thread takes acks;
//!   - `pgoutput`: our decoder of Relation/Insert messages;
//!   - `route`: outbox row → Kafka record (topic template, key, value, headers, timestamp);
//!   - `kafka`: librdkafka (idempotent, `acks=all`), each delivery report classified once into
//!     an `Ack`; `kafka/oidc`: OAUTHBEARER tokens; `kafka/hint`: the fix for a refusal;
//!     `kafka/consumer`: consumers from `[sink.kafka]` (shadow's legacy reader, replay's lookup);
//!   - `ack`: the tracker turning out-of-order acks into the one LSN safe to confirm;
//!     `in_flight`: the tracker plus bytes, labels and latency of the unacknowledged events;
//!   - `status_feed`: the parked events handed to the status page as obs's plain values;
//!   - `stages`: dispatches one replication event or Ack to the parts it owns (`InFlight`,
//!     `PoisonHandler`, `obs::watch::Watch`); `park`: `PoisonHandler`, what a session does with
//!     a poison event (park or halt, hold, release in order; through `poison/`'s store and
//!     checks);
//!   - `table_reader`: outbox rows read from the table instead of the WAL, fed to the stages as
//!     synthetic pgoutput messages (byte-identical records): slot-loss recovery and replay.
//! - `slot/`: slot loss — `state` (the durable stream memory, table `outboxd_slot_state`),
//!   `guard` (detection at session start), `recovery` (republishing a lost slot's gap),
//!   `publication` (changes of the publication under the stream), `join` (tables that join),
//!   `fence` (who holds the slot).
//! - `poison/`: events retrying cannot fix — `policy` (the failure classes), `validate`
//!   (JSON Schema), `store` (all `outbox_parked` SQL: parking, holding, release, repair;
//!   `store/bulk`: repairs of a selection), `integrity` (the HMAC tag only the relay's key makes),
//!   `vet` (the check before a release: the tag, else the outbox row via `provenance`),
//!   `bounds` (the parked store's size limits: halt, never drop). The session's use of them is
//!   `relay/park` (poison imports no stage).
//! - `replay/`: `outboxd replay` (R38) — `select` (ids or an audited range, the dry run's
//!   summary), `consumers` (the consumer groups of the target topics and their lag, from the
//!   broker), `store` (all `outboxd_replay` SQL: request, approval by another role, cursor,
//!   result), `run` (one rate-capped, resumable run through the table reader), `pace`,
//!   `progress`.
//! - `obs/`: metric names ([`obs`]) and health, `http` (the HTTP listener, bounded), `watch`
//!   (heartbeats, stalls, slot health, per-type ages), `errors` (error counts), `status_row`
//!   (all `outboxd_status` SQL), `status/` (the status page, `/` and `/status.json`: the
//!   facts the relay hands it, their JSON and HTML, the last hour of lag), `view` (the traits
//!   through which the relay hands them the slot's server and the in-flight events:
//!   `SlotServer`, `Pending`), `telemetry/` (OpenTelemetry: the relay's `Traces` pipeline and
//!   its export thread, `span` the publish spans, `ids` the span ids derived from the event,
//!   `ops` the relay's own spans, `http_client` the OTLP/HTTP client).
//! - `cleanup/`: deleting delivered outbox rows (R34) in batches behind every slot's delivery
//!   mark and the recovery window; `partitions`: dropping whole partitions of a partitioned outbox.
//! - `shadow/`: shadow mode (R35) — `compare` (pairing by event_id), `legacy` (the legacy
//!   path's topics), `store` (all `outboxd_shadow_*` SQL); the stages hand it built records
//!   through `relay/tap` (the `Tap` it creates; shadow imports the relay, never the reverse).
//! - `cmd/`: the command line, one file per command (`admin`: init, `check`, `status`,
//!   `alerts`, `parked`, `recover`, `replay`); `check_line`: one line of `outboxd check`, which
//!   `check`, `check_jobs`, `privileges` and `parked` produce (none imports another for it).
//! - [`config`] (+ `secrets`; `load`: file, environment, secrets, validation; `table_set`: the
//!   tables a configuration reads; one file per section: `alerts`, `cleanup`, `oidc`, `parked`,
//!   `policy`, `replay`, `shadow`, `tables`, `validate`), [`error`], `fail` (crash hooks for the
//!   crash-window tests).
//! - `model/`: the shared vocabulary — `columns` (which column holds which event field, presets,
//!   `additional` placements), `topic` (the topic template), `route` (`SettingError`,
//!   `RouteError`, the reserved header names), `tls` (`[source]`'s TLS settings and their checks),
//!   `stream` (`DecodeError`, `ProtocolError`: what can be wrong with the replication stream),
//!   `lsn` (`fmt_lsn`), `record` (`Rec`: a built record as plain data, for shadow's comparator),
//!   `sql` (`quote_ident`), `publication` (the publication guard's messages, membership SQL).
//!
//! # Floors
//! Imports point down: a module imports its own floor's modules or the floors below, never one
//! above (checked by `tests/tests/house.rs`). Where a lower module must call back up, it is handed
//! a small trait or a value.
//!
//! 1. `cmd/` — the command line: reads every floor below, nothing imports it.
//! 2. the stages — `supervisor` (with `supervisor/session`, one session's loop, which drives
//!    the relay's stages and the slot's guard, joins and recovery), `slot/` (which runs the
//!    relay's stages over rows read from the table), `relay/`, `poison/`, `replay/`, `cleanup/`,
//!    `shadow/`, `obs/`. Among them too imports point one way: no two import each other, and the
//!    top-level graph has no cycle.
//! 3. [`config`] (every section's type: `config/alerts` for `outboxd alerts`, `config/policy` for
//!    the poison policy, `config/oidc` for `[sink.kafka]`'s OIDC settings), [`error`] (which
//!    wraps `ConfigError` and the ground floor's errors; it imports no stage), `schema` (where
//!    outboxd's own tables live and how their DDL is applied), `fail`.
//! 4. `model/` — the ground floor: imports nothing of the crate.
//!
//! `obs/` imports no other stage: the relay hands it what it reads (`obs::view`).
//! `tests/tests/house.rs` checks all of it (`FLOORS`, with `crate::`, `super::` and `self::`
//! paths), so it stays true.
//!
//! Other crates use [`run`] (or [`run_observed`] with an [`obs::Observed`] they also serve),
//! [`Config`], [`RelayError`], [`cmd::main`], [`init`], [`OUTBOX_SQL`] and the metric names in
//! [`obs`]; everything else is private to the crate. No state is process-wide: a relay's health,
//! error counts, session count and trace pipeline live in the `Observed` its runner created and
//! passed down.

pub(crate) mod cleanup;
pub mod cmd;
pub mod config;
pub mod error;
pub(crate) mod fail;
pub(crate) mod model;
pub mod obs;
pub(crate) mod poison;
pub(crate) mod relay;
pub(crate) mod replay;
pub(crate) mod schema;
pub(crate) mod shadow;
pub(crate) mod slot;
pub(crate) mod supervisor;

pub use cmd::admin::{init, OUTBOX_SQL};
pub use config::Config;
pub use error::RelayError;
pub use supervisor::{run, run_observed};
