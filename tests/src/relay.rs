//! The relay as a real process: [`RelayProcess`] (killable with SIGKILL), the `outboxd` CLI,
//! and what tests read off a relay process (its log, exit, memory, replication connection).
//! The latter are exported through [`crate::reliability`], whose tests use them most.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Path of the relay binary built for the tests.
pub fn relay_bin() -> PathBuf {
    // target/<profile>/deps/<test-binary> → target/<profile>/outboxd-under-test
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    dir.join("outboxd-under-test")
}

/// A real relay process, killable with SIGKILL.
pub struct RelayProcess {
    pub child: Child,
    pub log: PathBuf,
}

impl RelayProcess {
    pub fn spawn(config: &std::path::Path, log: PathBuf) -> Result<Self> {
        Self::spawn_with_env(config, log, &[])
    }

    /// Spawns with extra environment, e.g. `OUTBOXD_FAILPOINTS=produced@50`.
    pub fn spawn_with_env(
        config: &std::path::Path,
        log: PathBuf,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let mut cmd = Command::new(relay_bin());
        cmd.arg("run")
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f);
        outboxd_testkit::die_with_parent(&mut cmd);
        let child = cmd.spawn().context("spawn relay")?;
        Ok(Self { child, log })
    }

    /// Waits for the process to exit by itself (e.g. at a failpoint), up to `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st);
            }
            if Instant::now() > deadline {
                bail!("relay still running after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn sigterm(&mut self) -> Result<std::process::ExitStatus> {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st);
            }
            if Instant::now() > deadline {
                self.sigkill();
                bail!("relay did not exit within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.sigkill();
    }
}

/// Runs `outboxd <args[0]> --config FILE <args[1..]>`; returns (exit code, stdout + stderr).
pub fn outboxd_cli(args: &[&str], config: &std::path::Path) -> (i32, String) {
    let out = Command::new(relay_bin())
        .arg(args[0])
        .arg("--config")
        .arg(config)
        .args(&args[1..])
        .output()
        .expect("run outboxd");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// Runs `outboxd check` and asserts that it fails and names `fix`; returns its output.
pub fn check_fails_naming(config: &std::path::Path, fix: &str) -> String {
    let (code, out) = outboxd_cli(&["check"], config);
    assert_ne!(code, 0, "check passed: {out}");
    assert!(out.contains(fix), "the fix ({fix:?}) is not named: {out}");
    out
}

/// PIDs of the relay processes streaming from `slot` (from `application_name`
/// `outboxd:<slot>:<pid>` in pg_stat_replication, state catchup or streaming: a standby that
/// lost the race for the slot shows up briefly in state `startup`, without the slot).
pub async fn streaming_pids(c: &tokio_postgres::Client, slot: &str) -> Result<Vec<u32>> {
    let prefix = format!("outboxd:{slot}:");
    Ok(c.query(
        "SELECT application_name FROM pg_stat_replication \
             WHERE application_name LIKE $1 || '%' AND state IN ('catchup', 'streaming')",
        &[&prefix],
    )
    .await?
    .iter()
    .filter_map(|r| {
        r.get::<_, String>(0)
            .strip_prefix(&prefix)
            .and_then(|p| p.parse().ok())
    })
    .collect())
}

/// Resident set size of a process in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The signal that ended a process, if any.
pub fn exit_signal(st: &std::process::ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    st.signal()
}

/// A relay log without its colour escapes.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A relay process's log, colour escapes removed.
pub fn read_log(p: &std::path::Path) -> String {
    strip_ansi(&std::fs::read_to_string(p).unwrap_or_default())
}

/// Waits for a relay process to exit by itself, without blocking the runtime.
pub async fn wait_exit(
    p: &mut RelayProcess,
    timeout: Duration,
) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = p.child.try_wait()? {
            return Ok(st);
        }
        if Instant::now() > deadline {
            bail!("the relay still runs after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until exactly one of `relays` streams from the slot and it is not `not`; returns its
/// index. Fails if two ever stream at once.
pub async fn wait_for_active(
    sql: &tokio_postgres::Client,
    slot: &str,
    relays: &[RelayProcess],
    not: Option<u32>,
    within: Duration,
) -> anyhow::Result<usize> {
    let index: std::collections::HashMap<u32, usize> = relays
        .iter()
        .enumerate()
        .map(|(i, r)| (r.child.id(), i))
        .collect();
    let deadline = Instant::now() + within;
    loop {
        let pids = streaming_pids(sql, slot).await?;
        assert!(
            pids.len() <= 1,
            "two sessions stream from one slot: {pids:?}"
        );
        if let Some(&pid) = pids.first() {
            if Some(pid) != not {
                let i = *index
                    .get(&pid)
                    .unwrap_or_else(|| panic!("unknown process {pid} streams"));
                return Ok(i);
            }
        }
        if Instant::now() > deadline {
            anyhow::bail!("no other instance streams after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
