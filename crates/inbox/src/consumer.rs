//! [`InboxConsumer`]: the Kafka loop around an [`Inbox`]. Per record: parse the envelope,
//! process it in the consumer database (retrying transient failures in place), and only then
//! commit the record's offset (R20). Anything that cannot be processed stops the loop with
//! the error, so no record is ever committed past without being processed.

use std::future::Future;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    CommitMode, Consumer, ConsumerContext, DefaultConsumerContext, StreamConsumer,
};
use rdkafka::message::{BorrowedMessage, Message};
use tokio_postgres::Client;

use crate::envelope::{Envelope, RecordSource};
use crate::error::InboxError;
use crate::handler::Handler;
use crate::inbox::{Inbox, Outcome};
use crate::metrics;

/// When the offset of a processed record reaches the broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetCommit {
    /// `commit_message(Sync)` after every record: simplest, one broker round trip per record.
    Sync,
    /// `store_offset_from_message` after every record and let librdkafka's auto-commit send
    /// stored offsets (needs `enable.auto.commit=true`, `enable.auto.offset.store=false`, as
    /// [`consumer_config`] sets them). Still only offsets of processed records are committed.
    StoreForAutoCommit,
}

/// Loop settings.
#[derive(Clone, Debug)]
pub struct ConsumerSettings {
    /// How often [`Inbox::sweep`] runs (releases repaired gaps, fires gap timeouts).
    pub sweep_every: Duration,
    /// Attempts per record for transient failures before the loop stops with the error.
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub offset_commit: OffsetCommit,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        Self {
            sweep_every: Duration::from_secs(5),
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            offset_commit: OffsetCommit::Sync,
        }
    }
}

/// A librdkafka configuration suited to the inbox: offsets are committed by this crate after
/// processing (never by a timer ahead of it), and a new group starts at the earliest record.
pub fn consumer_config(bootstrap: &str, group_id: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap)
        .set("group.id", group_id)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false");
    c
}

/// Counters of one [`InboxConsumer::run`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    pub records: u64,
    pub applied: u64,
    pub duplicates: u64,
    pub held: u64,
    pub stale: u64,
}

/// Kafka consumer + consumer database + handler.
///
/// With [`OffsetCommit::Sync`] the librdkafka setting `enable.auto.commit` is irrelevant for
/// correctness (no offset is stored ahead of processing either way).
pub struct InboxConsumer<H, C: ConsumerContext + 'static = DefaultConsumerContext> {
    inbox: Inbox<H>,
    db: Client,
    kafka: StreamConsumer<C>,
    settings: ConsumerSettings,
}

impl<H: Handler, C: ConsumerContext + 'static> InboxConsumer<H, C> {
    /// `kafka` must already be subscribed (or assigned).
    pub fn new(
        inbox: Inbox<H>,
        db: Client,
        kafka: StreamConsumer<C>,
        settings: ConsumerSettings,
    ) -> Self {
        Self {
            inbox,
            db,
            kafka,
            settings,
        }
    }

    pub fn inbox(&self) -> &Inbox<H> {
        &self.inbox
    }

    /// The Kafka consumer (e.g. to read committed offsets).
    pub fn kafka(&self) -> &StreamConsumer<C> {
        &self.kafka
    }

    /// The consumer database connection (e.g. for [`crate::Ledger`] or pruning between runs).
    pub fn db(&mut self) -> &mut Client {
        &mut self.db
    }

    /// Consumes until `shutdown` resolves (→ `Ok`) or a record cannot be processed (→ `Err`;
    /// its offset is not committed, so a restarted consumer sees it again).
    pub async fn run(
        &mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<RunStats, InboxError> {
        let Self {
            inbox,
            db,
            kafka,
            settings,
        } = self;
        let mut stats = RunStats::default();
        let mut sweep = tokio::time::interval(settings.sweep_every);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                _ = &mut shutdown => return Ok(stats),
                _ = sweep.tick() => {
                    if let Err(e) = inbox.sweep(db).await {
                        if !e.is_transient() {
                            return Err(e);
                        }
                        tracing::warn!(consumer = inbox.consumer(), error = %e, "sweep failed; will retry");
                    }
                }
                msg = kafka.recv() => {
                    let msg = msg?;
                    let outcome = handle(inbox, db, kafka, settings, &msg).await?;
                    stats.records += 1;
                    match outcome {
                        Outcome::Applied { .. } => stats.applied += 1,
                        Outcome::Duplicate { .. } | Outcome::AlreadyHeld => stats.duplicates += 1,
                        Outcome::Held { .. } => stats.held += 1,
                        Outcome::Stale { .. } => stats.stale += 1,
                    }
                }
            }
        }
    }
}

async fn handle<H: Handler, C: ConsumerContext + 'static>(
    inbox: &Inbox<H>,
    db: &mut Client,
    kafka: &StreamConsumer<C>,
    settings: &ConsumerSettings,
    msg: &BorrowedMessage<'_>,
) -> Result<Outcome, InboxError> {
    let env = Envelope::from_message(msg).map_err(|source| {
        metrics::malformed(inbox.consumer());
        tracing::error!(
            consumer = inbox.consumer(),
            topic = msg.topic(),
            partition = msg.partition(),
            offset = msg.offset(),
            error = %source,
            "malformed record: stopping, offset not committed"
        );
        InboxError::Malformed {
            source_at: Some(RecordSource {
                topic: msg.topic().to_string(),
                partition: msg.partition(),
                offset: msg.offset(),
            }),
            source,
        }
    })?;
    let mut attempt = 1;
    let mut backoff = settings.initial_backoff;
    let outcome = loop {
        match inbox.process(db, &env).await {
            Ok(o) => break o,
            Err(e) if e.is_transient() && attempt < settings.max_attempts => {
                tracing::warn!(
                    consumer = inbox.consumer(),
                    event_id = %env.event_id,
                    aggregate_id = %env.aggregate_id,
                    aggregate_version = env.aggregate_version,
                    attempt,
                    error = %e,
                    "transient failure; retrying the same record"
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(settings.max_backoff);
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    };
    // Only now, with the outcome durable in the consumer database, may the broker forget it.
    match settings.offset_commit {
        OffsetCommit::Sync => kafka.commit_message(msg, CommitMode::Sync)?,
        OffsetCommit::StoreForAutoCommit => kafka.store_offset_from_message(msg)?,
    }
    Ok(outcome)
}
