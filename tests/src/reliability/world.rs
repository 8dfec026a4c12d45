//! A world under load for the reliability tests of one relay process: the env, an inbox
//! consumer reading [`TOPIC`], a writer committing random transactions, the relay's config and
//! log; [`finish`] stops the writer and verifies delivery and effects.

use super::{
    consumer_db, drain_and_verify, read_log, DeliveryReport, InboxReader, Load, WriteLog, Writer,
};
use crate::{create_topics, Env, RelayProcess};
use anyhow::Context;
use std::time::Duration;

/// The topic the writer's events go to.
pub const TOPIC: &str = "outbox.event.acct";

/// How long a relay may take to catch up at the end of a test.
pub const CAUGHT_UP: Duration = Duration::from_secs(120);

/// Stops the writer, waits for the relay and the consumer, verifies delivery and effects.
pub async fn finish(
    env: &Env,
    writer: Writer,
    reader: InboxReader,
    inbox_dsn: &str,
    relay: &mut RelayProcess,
) -> anyhow::Result<(WriteLog, DeliveryReport)> {
    let wlog = writer.stop().await?;
    env.caught_up(CAUGHT_UP)
        .await
        .with_context(|| read_log(&relay.log))?;
    let st = relay.sigterm()?;
    assert!(
        st.success(),
        "graceful exit: {st}\n{}",
        read_log(&relay.log)
    );
    let (_, report) = drain_and_verify(reader, &wlog, "acct", inbox_dsn).await?;
    Ok((wlog, report))
}

pub struct World {
    pub env: Env,
    pub inbox_dsn: String,
    pub reader: InboxReader,
    pub writer: Writer,
    pub config: std::path::PathBuf,
    pub log: std::path::PathBuf,
}

impl World {
    pub fn spawn(&self) -> anyhow::Result<RelayProcess> {
        RelayProcess::spawn(&self.config, self.log.clone())
    }

    /// A relay delivers the first `n` committed events, then stops gracefully.
    pub async fn deliver_then_stop(&self, n: usize) -> anyhow::Result<()> {
        let mut relay = self.spawn()?;
        self.writer
            .wait_committed(n, Duration::from_secs(60))
            .await?;
        self.env.caught_up(CAUGHT_UP).await?;
        assert!(relay.sigterm()?.success());
        Ok(())
    }

    /// Waits until `more` events committed since the call (nothing streams them meanwhile).
    pub async fn commit_more(&self, more: usize) -> anyhow::Result<()> {
        let before = self.writer.committed_events();
        self.writer
            .wait_committed(before + more, Duration::from_secs(120))
            .await
    }
}

/// Topics, an inbox consumer, a writer under the default load, the config file.
pub async fn world(env: Env) -> anyhow::Result<World> {
    create_topics(&env.bootstrap(), &[TOPIC], 3).await?;
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let reader = InboxReader::start(&env.bootstrap(), TOPIC, &inbox_dsn);
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    let config = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    Ok(World {
        env,
        inbox_dsn,
        reader,
        writer,
        config,
        log,
    })
}
