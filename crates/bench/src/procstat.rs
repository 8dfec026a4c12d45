//! What the kernel knows about a process: CPU seconds, peak RSS, how it ended.
//!
//! Every contestant runs as its own process so that its CPU and memory are its own; the
//! walsender and the broker are separate processes too, so the cost of each side of the stream
//! can be read from `/proc` without any instrumentation inside them.

use anyhow::{bail, Result};
use std::path::Path;

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// utime + stime of `pid` in seconds (resolution: one clock tick, usually 10 ms).
pub fn cpu_secs(pid: u32) -> Option<f64> {
    stat_cpu_secs(&format!("/proc/{pid}/stat"))
}

/// utime + stime of one thread of this process (`/proc/<tid>/stat` would be the whole process).
pub fn thread_cpu_secs(tid: u32) -> Option<f64> {
    stat_cpu_secs(&format!("/proc/self/task/{tid}/stat"))
}

fn stat_cpu_secs(path: &str) -> Option<f64> {
    let s = std::fs::read_to_string(path).ok()?;
    // The command name may contain spaces or parentheses: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); utime and stime are fields 14 and 15.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / clk_tck())
}

/// Peak resident set size (`VmHWM`) of `pid` in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The first process whose command line contains `needle` (e.g. the broker's listener URL).
pub fn find_pid_by_cmdline(needle: &str) -> Option<u32> {
    let me = std::process::id();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(needle) {
                return Some(pid);
            }
        }
    }
    None
}

/// How a child ended, with the kernel's accounting of its whole life.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    pub success: bool,
    /// The signal that ended it, if one did (a reader that dies without a word was killed).
    pub signal: Option<i32>,
    pub cpu_secs: f64,
    pub max_rss_kib: u64,
}

fn exit_from(status: i32, ru: &libc::rusage) -> Exit {
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Exit {
        success: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
        cpu_secs: tv(ru.ru_utime) + tv(ru.ru_stime),
        max_rss_kib: ru.ru_maxrss as u64,
    }
}

/// Reaps `pid` if it has exited (None while it runs). The child must not be waited for by
/// `std::process::Child` afterwards.
pub fn try_reap(pid: u32) -> Result<Option<Exit>> {
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid out-parameter; wait4 on our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid as i32, &mut status, libc::WNOHANG, &mut ru) };
    match r {
        0 => Ok(None),
        r if r == pid as i32 => Ok(Some(exit_from(status, &ru))),
        _ => bail!("wait4({pid}): {}", std::io::Error::last_os_error()),
    }
}

/// Sends SIGTERM and reaps `pid`, SIGKILL after `grace`.
pub fn terminate(pid: u32, grace: std::time::Duration) -> Result<Exit> {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + grace;
    loop {
        if let Some(e) = try_reap(pid)? {
            return Ok(e);
        }
        if std::time::Instant::now() > deadline {
            // SAFETY: as above.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Facts about this machine for the report.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Machine {
    pub cpu_model: String,
    pub cores: usize,
    pub mem_gib: f64,
    pub kernel: String,
    pub load_avg_at_start: String,
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let mem_kib: f64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let read = |p: &str| {
        std::fs::read_to_string(Path::new(p))
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    Machine {
        cpu_model,
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        mem_gib: (mem_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
        kernel: read("/proc/sys/kernel/osrelease"),
        load_avg_at_start: read("/proc/loadavg"),
    }
}

/// CPU seconds of several processes, sampled together.
#[derive(Debug, Clone, Default)]
pub struct CpuSnap(pub Vec<Option<f64>>);

impl CpuSnap {
    pub fn take(pids: &[Option<u32>]) -> Self {
        Self(pids.iter().map(|p| p.and_then(cpu_secs)).collect())
    }

    /// Per-process deltas (None when either sample is missing).
    pub fn delta(&self, later: &CpuSnap) -> Vec<Option<f64>> {
        self.0
            .iter()
            .zip(&later.0)
            .map(|(a, b)| Some(b.as_ref()? - a.as_ref()?))
            .collect()
    }
}

/// Reads a file that a child wrote (its log), for error messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// One thread's counters: name, user and system seconds, voluntary and involuntary context
/// switches.
#[derive(Debug, Clone)]
pub struct ThreadSnap {
    pub tid: String,
    pub name: String,
    pub user: f64,
    pub sys: f64,
    pub vol: u64,
    pub invol: u64,
}

/// Every thread of `pid` (diagnostics: which thread of a relay spends what, and how often
/// threads hand off work).
pub fn thread_snaps(pid: u32) -> Vec<ThreadSnap> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    let tck = clk_tck();
    for t in dir.flatten() {
        let p = t.path();
        let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
        let status = std::fs::read_to_string(p.join("status")).unwrap_or_default();
        let name = stat
            .split_once('(')
            .and_then(|(_, r)| r.rsplit_once(')'))
            .map_or("?", |(n, _)| n);
        let f: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, r)| r)
            .split_whitespace()
            .collect();
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) / tck;
        let field = |k: &str| {
            status
                .lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .unwrap_or("0")
                .to_string()
        };
        out.push(ThreadSnap {
            tid: t.file_name().to_string_lossy().into_owned(),
            name: name.to_string(),
            user: ticks(11),
            sys: ticks(12),
            vol: field("voluntary_ctxt_switches").parse().unwrap_or(0),
            invol: field("nonvoluntary_ctxt_switches").parse().unwrap_or(0),
        });
    }
    out
}

/// Per-thread CPU (user/system seconds) and context switches of `pid`, one line per thread.
pub fn threads(pid: u32) -> String {
    thread_snaps(pid)
        .iter()
        .map(|t| {
            format!(
                "  {:<18} user {:>6.2} s  sys {:>6.2} s  ctxsw vol {:>8} invol {:>8}\n",
                t.name, t.user, t.sys, t.vol, t.invol
            )
        })
        .collect()
}

/// What each thread of a process spent between two [`thread_snaps`], per event: CPU µs
/// (user + system) and context switches per 1000 events.
pub fn threads_per_event(before: &[ThreadSnap], after: &[ThreadSnap], events: u64) -> String {
    let n = events.max(1) as f64;
    let mut out = String::new();
    for a in after {
        let b = before.iter().find(|b| b.tid == a.tid);
        let (u0, s0, v0, i0) = b.map_or((0.0, 0.0, 0, 0), |b| (b.user, b.sys, b.vol, b.invol));
        out.push_str(&format!(
            "  {:<18} user {:>6.2} µs  sys {:>6.2} µs  ctxsw/1000 events vol {:>7.1} invol {:>6.1}\n",
            a.name,
            (a.user - u0) * 1e6 / n,
            (a.sys - s0) * 1e6 / n,
            (a.vol - v0) as f64 * 1000.0 / n,
            (a.invol - i0) as f64 * 1000.0 / n,
        ));
    }
    out
}
