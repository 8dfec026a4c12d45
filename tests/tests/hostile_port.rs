//! Hostile port (issue 15): a flood of idle and slow-loris connections on the metrics listener
//! of a relay limited to 64 file descriptors. The listener may starve itself, never the relay:
//! events keep arriving (also across a Postgres reconnect during the flood, which needs new
//! descriptors), the listener does not spin on failing `accept`s, and `/healthz` answers again
//! once the flood ends.

use outboxd_tests::reliability::read_log;
use outboxd_tests::testkit::free_port;
use outboxd_tests::*;
use std::io::Write;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TOPIC: &str = "outbox.event.acct";
/// The relay's descriptor limit: what a small container or a careless `ulimit` gives it.
const NOFILE: u64 = 64;
const IDLE: usize = 160;
const SLOW_LORIS: usize = 10;

/// A relay process started with a descriptor limit of `nofile` (soft and hard), set before it
/// runs a line of its own: the listener sizes itself from the limit it finds.
fn spawn_limited(config: &Path, log: PathBuf, nofile: u64) -> anyhow::Result<RelayProcess> {
    let out = std::fs::File::create(&log)?;
    let mut cmd = Command::new(relay_bin());
    cmd.arg("run")
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    testkit::die_with_parent(&mut cmd);
    let lim = libc::rlimit {
        rlim_cur: nofile,
        rlim_max: nofile,
    };
    // SAFETY: setrlimit is async-signal-safe and reads only `lim`, copied into the closure.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(RelayProcess {
        child: cmd.spawn()?,
        log,
    })
}

/// User + system CPU time of a process, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/pid/stat");
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks as f64 / hz
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Writes `n` events and waits (up to `timeout`) until the slot confirmed past them.
async fn deliver_within(env: &Env, agg: &str, n: i64, timeout: Duration) -> anyhow::Result<()> {
    let mut c = env.sql().await?;
    let events: Vec<NewEvent> = (1..=n)
        .map(|v| NewEvent::new("acct", agg, v, "Deposited", serde_json::json!({"v": v})))
        .collect();
    let lsn = write_events_returning_lsn(&mut c, &events).await?;
    eventually(timeout, || async { Ok(env.confirmed_lsn().await? > lsn) }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_flood_starves_the_listener_never_the_relay() -> anyhow::Result<()> {
    let mut env = Env::start("hostile_port").await?;
    let maddr = format!("127.0.0.1:{}", free_port());
    env.extra_toml = format!("[metrics]\nlisten = \"{maddr}\"\n");
    create_topics(&env.bootstrap(), &[TOPIC], 1).await?;
    let cfg = env.config_file()?;
    let log = env.dir.path().join("relay.log");
    let relay = spawn_limited(&cfg, log.clone(), NOFILE)?;
    let pid = relay.child.id();
    eventually(Duration::from_secs(30), || async {
        Ok(http_get(&maddr, "/readyz").0 == 200)
    })
    .await?;
    env.deliver("a-1", 3, &log).await?;
    let fds_before = open_fds(pid);

    // The flood: idle connections that never send a byte, and slow-loris ones that send half a
    // request header and then nothing.
    let mut flood = Vec::new();
    for _ in 0..IDLE {
        flood.push(TcpStream::connect(&maddr)?);
    }
    for _ in 0..SLOW_LORIS {
        let mut s = TcpStream::connect(&maddr)?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")?;
        flood.push(s);
    }
    // No accept spin: the relay's CPU time over the flood stays low.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (cpu0, t0) = (cpu_seconds(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let cpu = (cpu_seconds(pid) - cpu0) / t0.elapsed().as_secs_f64();
    let fds_flood = open_fds(pid);
    eprintln!(
        "relay fds: {fds_before} before, {fds_flood} during the flood; CPU during the flood: \
         {:.0}% of one core",
        cpu * 100.0
    );

    // The relay keeps delivering, also through new Postgres connections: end its sessions so it
    // must reconnect while the flood goes on.
    let c = env.sql().await?;
    c.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
        &[],
    )
    .await?;
    c.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_replication \
         WHERE application_name LIKE 'outboxd:%'",
        &[],
    )
    .await?;
    let delivered = deliver_within(&env, "a-2", 5, Duration::from_secs(20)).await;
    let fds_open = open_fds(pid);
    drop(flood);
    assert!(
        delivered.is_ok(),
        "the relay stopped delivering during the flood ({fds_open} fds open): {:?}\n{}",
        delivered.err(),
        read_log(&log)
    );
    assert!(
        cpu < 0.3,
        "the relay used {:.0}% of a core while its listener was flooded",
        cpu * 100.0
    );
    assert!(
        fds_flood < NOFILE as usize,
        "the flood took every descriptor ({fds_flood})"
    );
    let records = read_topic(&env.bootstrap(), TOPIC, 8, Duration::from_secs(20))?;
    assert_eq!(records.len(), 8, "every event on the topic");

    // The listener recovers once the flood is gone.
    eventually(Duration::from_secs(10), || async {
        Ok(http_get(&maddr, "/healthz").0 == 200)
    })
    .await?;
    let text = read_log(&log);
    let warns = text.matches("metrics listener").count();
    assert!(warns < 20, "accept errors logged {warns} times:\n{text}");
    Ok(())
}
