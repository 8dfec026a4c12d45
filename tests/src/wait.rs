//! Polling until a condition holds.

use anyhow::{bail, Result};
use std::time::{Duration, Instant};

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("condition not reached within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
