//! Where test clusters, brokers and files live: one directory per test process,
//! `$TMPDIR/outboxd-testkit/<pid>-<start time>/`, swept by the next process once its owner is dead.
//!
//! Why not just `Drop`: a static (the per-process [`crate::shared_cluster`]) is never dropped, a
//! process killed by a timeout (SIGTERM/SIGKILL) runs no destructor and no `atexit` hook, and each
//! cluster is ~40 MB (a day of runs once filled the disk). So cleanup has three layers:
//! 1. `Drop` removes a cluster's directory when the test lets go of it;
//! 2. an `atexit` hook removes this process's whole directory on a normal exit (a passing or a
//!    panicking test: libtest exits through `exit(3)`), after the shared cluster's hook stopped it;
//! 3. whatever a killed process left is swept by the next testkit process on this machine
//!    ([`sweep`]): a directory whose owner is dead is deleted, after stopping any postmaster
//!    still running from it. The owner is its pid *and* the pid's start time (`/proc/<pid>/stat`
//!    field 22), so a reused pid does not keep a dead process's directory alive.
//!
//! Servers themselves never outlive their test process (`PR_SET_PDEATHSIG`, see
//! [`crate::die_with_parent`]); the sweep's kill is for a postmaster whose parent was not the
//! test (or a process that died between fork and prctl).

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The parent of every test process's directory: `$TMPDIR/outboxd-testkit`.
pub fn scratch_root() -> PathBuf {
    std::env::temp_dir().join("outboxd-testkit")
}

/// This process's directory (created, and dead owners' directories swept, on first use).
pub fn scratch_dir() -> Result<&'static Path> {
    static DIR: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    extern "C" fn remove_own() {
        if let Some(Ok(dir)) = DIR.get() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    let r = DIR.get_or_init(|| {
        let root = scratch_root();
        let make = || -> Result<PathBuf> {
            std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
            // Sticky and world-writable like /tmp: several users' tests can share the root.
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o1777));
            sweep(&root);
            let me = std::process::id();
            let dir = root.join(format!("{me}-{}", start_time(me).unwrap_or(0)));
            std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
            Ok(dir)
        };
        let dir = make().map_err(|e| format!("{e:#}"))?;
        // SAFETY: registers a plain function that only reads the initialised static.
        unsafe { libc::atexit(remove_own) };
        Ok(dir)
    });
    match r {
        Ok(p) => Ok(p.as_path()),
        Err(e) => anyhow::bail!("testkit scratch directory: {e}"),
    }
}

/// A fresh temporary directory inside [`scratch_dir`] (removed on drop, or by the sweep).
pub fn tempdir(prefix: &str) -> Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(scratch_dir()?)?)
}

/// Start time of `pid` in clock ticks since boot (`/proc/<pid>/stat` field 22), `None` if no
/// such process.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether `pid` exists and is not a zombie.
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s[s.rfind(')')? + 1..].split_whitespace().next()? != "Z"))
        .unwrap_or(false)
}

/// Whether the process that made the directory `name` (`<pid>-<start time>`) still runs.
/// Names of another shape are left alone (treated as alive).
fn owner_alive(name: &str) -> bool {
    let Some((pid, start)) = name.split_once('-') else {
        return true;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return true;
    };
    start_time(pid) == Some(start)
}

/// Directories under `root` whose owner is dead (what a killed test process left).
pub fn dead_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return vec![];
    };
    rd.flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| !owner_alive(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .collect()
}

/// Removes every directory under `root` whose owner is dead, first stopping any postmaster
/// still running from it. Errors are ignored: a concurrent sweeper may be removing the same
/// directory, and what is left now is retried by the next process.
pub fn sweep(root: &Path) {
    for dir in dead_dirs(root) {
        stop_postmasters(&dir, 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Stops (SIGQUIT, then SIGKILL after 5 s) the postmaster of every data directory at most
/// `depth` levels under `dir` whose `postmaster.pid` names a live process running from it
/// (its command line names the data directory: a reused pid is left alone).
fn stop_postmasters(dir: &Path, depth: u32) {
    let pidfile = dir.join("postmaster.pid");
    if let Ok(s) = std::fs::read_to_string(&pidfile) {
        if let Some(pid) = s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()) {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let needle = dir.as_os_str().as_encoded_bytes();
            if pid > 0 && cmdline.windows(needle.len()).any(|w| w == needle) {
                // SAFETY: kill(2) on a postmaster of a dead test process (checked above).
                unsafe { libc::kill(pid, libc::SIGQUIT) };
                let deadline = Instant::now() + Duration::from_secs(5);
                while running(pid) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                // SAFETY: as above; a no-op if it is gone.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    if depth == 0 {
        return;
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            stop_postmasters(&e.path(), depth - 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    #[test]
    fn owner_is_pid_and_start_time() {
        let me = std::process::id();
        let start = start_time(me).unwrap();
        assert!(owner_alive(&format!("{me}-{start}")));
        // Same pid, other start time: a reused pid.
        assert!(!owner_alive(&format!("{me}-{}", start + 1)));
        assert!(!owner_alive(&format!("{}-1", u32::MAX)));
        assert!(owner_alive("not-an-owner"));
    }

    /// A killed test process's directory (here: one whose owner never existed) is removed, its
    /// postmaster (here: a stand-in whose command line names the data dir) stopped; a live
    /// owner's directory is kept.
    #[test]
    fn sweep_stops_and_removes_dead_owners_only() {
        let root = tempfile::tempdir().unwrap();
        let dead = root.path().join(format!("{}-7", u32::MAX));
        let data = dead.join("pg-x/data");
        std::fs::create_dir_all(&data).unwrap();
        let mut stand_in = std::process::Command::new("sleep")
            .arg0(&data)
            .arg("60")
            .spawn()
            .unwrap();
        std::fs::write(data.join("postmaster.pid"), format!("{}\n", stand_in.id())).unwrap();
        // Until it has exec'd, the child's command line is still this test's: the sweep
        // would (rightly) leave it alone. Wait for the stand-in's own.
        let needle = data.as_os_str().as_encoded_bytes().to_vec();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read(format!("/proc/{}/cmdline", stand_in.id()))
            .unwrap_or_default()
            .windows(needle.len())
            .any(|w| w == needle)
        {
            assert!(Instant::now() < deadline, "the stand-in did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        let me = std::process::id();
        let alive = root
            .path()
            .join(format!("{me}-{}", start_time(me).unwrap()));
        std::fs::create_dir_all(&alive).unwrap();
        sweep(root.path());
        assert!(!dead.exists());
        assert!(alive.exists());
        assert!(
            stand_in.wait().unwrap().code().is_none(),
            "killed by a signal"
        );
    }
}
