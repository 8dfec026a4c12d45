//! The bare replication reader: the ceiling measured with the same client library, the same
//! status interval and the same completion criterion (the slot's confirmed LSN) as outboxd, but
//! with nothing done to the rows. Whatever outboxd spends beyond this is outboxd's own cost.

use anyhow::Result;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent};
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct BareArgs {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long)]
    pub port: u16,
    #[arg(long, default_value = "postgres")]
    pub user: String,
    #[arg(long, env = "PGPASSWORD")]
    pub password: String,
    #[arg(long)]
    pub db: String,
    #[arg(long)]
    pub slot: String,
    #[arg(long, default_value = crate::world::PUBLICATION)]
    pub publication: String,
    /// The slot's confirmed_flush_lsn, reported back until something newer is applied.
    #[arg(long, default_value_t = 0)]
    pub ack_lsn: u64,
    #[arg(long, default_value_t = 10)]
    pub status_ms: u64,
    /// Stream over TLS (sslmode=require, as outboxd's TLS variant).
    #[arg(long)]
    pub tls: bool,
}

/// Streams the slot until SIGTERM; confirms each commit as soon as it is received, and the
/// server's WAL end on keepalives outside a transaction (as outboxd does when idle).
pub async fn run(a: BareArgs) -> Result<()> {
    let status = Duration::from_millis(a.status_ms);
    let rc = ReplicationConfig::new(a.host, a.user, a.password, a.db, a.slot, a.publication)
        .with_port(a.port)
        .with_start_lsn(Lsn(0))
        .with_ack_lsn(Lsn(a.ack_lsn))
        .with_status_interval(status)
        .with_wakeup_interval(status)
        .with_buffer_size(1024);
    let rc = if a.tls {
        rc.with_tls(pgwire_replication::TlsConfig::require())
    } else {
        rc
    };
    let mut client = ReplicationClient::connect(rc).await?;
    client.wait_started().await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut in_tx = false;
    let mut rows = 0u64;
    loop {
        tokio::select! {
            biased;
            _ = term.recv() => break,
            ev = client.recv() => match ev? {
                Some(ReplicationEvent::Begin { .. }) => in_tx = true,
                Some(ReplicationEvent::XLogData { data, .. }) => {
                    // Count inserts so the loop observes the payload without decoding it.
                    rows += u64::from(data.first() == Some(&b'I'));
                }
                Some(ReplicationEvent::Commit { end_lsn, .. }) => {
                    in_tx = false;
                    client.update_applied_lsn(end_lsn);
                }
                Some(ReplicationEvent::KeepAlive { wal_end, .. }) if !in_tx => {
                    client.update_applied_lsn(wal_end);
                }
                Some(_) => {}
                None => break,
            },
        }
    }
    // Let the last status update reach the server before disconnecting.
    tokio::time::sleep(status * 2).await;
    client.stop();
    eprintln!("bare-reader: {rows} inserts received");
    Ok(())
}
