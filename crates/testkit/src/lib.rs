//! Throwaway infrastructure for tests, the demo and the benchmarks.
//!
//! # Layout
//! - [`Postgres`]: a private Postgres cluster (own data dir, free port, `wal_level=logical`,
//!   SCRAM password auth on TCP) that can be crashed (`-m immediate`) and restarted on the same port.
//! - [`Broker`]: a tansu Kafka-protocol broker on a free port (memory storage) that can be
//!   killed and restarted on the same port.
//! - [`free_port`], [`tansu_bin`], [`pg_bin_dir`]: locating things.
//!
//! Every child process gets `PR_SET_PDEATHSIG = SIGKILL`, so a test process that dies (or is
//! killed by a timeout) never leaves servers behind.

pub mod proxy;

pub use proxy::{Mode, Proxy};

use anyhow::{bail, Context, Result};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Password of the `postgres` superuser in every test cluster.
pub const PG_PASSWORD: &str = "outboxd-test-pw";

/// Workspace root (two levels above this crate's manifest).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("workspace root")
        .to_path_buf()
}

/// A TCP port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// Directory holding `postgres`, `initdb`, `pg_ctl` (env `OUTBOXD_PG_BIN` overrides).
pub fn pg_bin_dir() -> PathBuf {
    std::env::var_os("OUTBOXD_PG_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

/// The tansu binary (env `OUTBOXD_TANSU` overrides; `scripts/deps.sh` installs the default).
pub fn tansu_bin() -> PathBuf {
    std::env::var_os("OUTBOXD_TANSU")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".dev/bin/tansu"))
}

/// Makes the child get SIGKILL when the thread that spawned it exits (tests never leak servers
/// or relays, even when the test process is killed by a timeout).
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// uid/gid to run Postgres as: the `postgres` user when we are root (initdb refuses root).
fn pg_owner() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let name = std::ffi::CString::new("postgres").unwrap();
    // SAFETY: getpwnam returns a pointer into static storage or null; we copy the ids at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(
        !pw.is_null(),
        "running as root needs a `postgres` user (apt install postgresql-15)"
    );
    // SAFETY: non-null pointer returned by getpwnam.
    unsafe { Some(((*pw).pw_uid, (*pw).pw_gid)) }
}

fn as_pg_owner(cmd: &mut Command) {
    if let Some((uid, gid)) = pg_owner() {
        cmd.uid(uid).gid(gid);
    }
}

fn chown_tree(path: &Path) -> Result<()> {
    if let Some((uid, gid)) = pg_owner() {
        let st = Command::new("chown")
            .arg("-R")
            .arg(format!("{uid}:{gid}"))
            .arg(path)
            .status()?;
        if !st.success() {
            bail!("chown {} failed", path.display());
        }
    }
    Ok(())
}

/// initdb once per machine (per Postgres binary directory and user) into a shared template
/// directory; clusters are copies of it (initdb costs about a second, a copy a few
/// milliseconds). The template is built under a private name and renamed into place, so
/// concurrent test processes never see a half-built one, and it is never duplicated per process
/// (one per process used to fill the disk: every nextest test is its own process).
fn template_dir() -> Result<&'static Path> {
    static TEMPLATE: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    let r = TEMPLATE.get_or_init(|| make_template().map_err(|e| format!("{e:#}")));
    match r {
        Ok(p) => Ok(p.as_path()),
        Err(e) => bail!("initdb template failed: {e}"),
    }
}

fn make_template() -> Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    pg_bin_dir().hash(&mut h);
    PG_PASSWORD.hash(&mut h);
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let shared = std::env::temp_dir().join(format!("outboxd-pgtemplate-{uid}-{:x}", h.finish()));
    let data = shared.join("data");
    if data.join("PG_VERSION").exists() {
        return Ok(data);
    }
    let base =
        std::env::temp_dir().join(format!("outboxd-pgtemplate-build-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base)?;
    let pwfile = base.join("pw");
    std::fs::write(&pwfile, PG_PASSWORD)?;
    let built = base.join("data");
    chown_tree(&base)?;
    let mut cmd = Command::new(pg_bin_dir().join("initdb"));
    cmd.arg("-D")
        .arg(&built)
        .args([
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
        ])
        .args(["-E", "UTF8", "--locale=C", "-N"])
        .arg(format!("--pwfile={}", pwfile.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    as_pg_owner(&mut cmd);
    let out = cmd
        .output()
        .context("run initdb (is postgresql-15 installed?)")?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&base);
        bail!("initdb: {}", String::from_utf8_lossy(&out.stderr));
    }
    let _ = std::fs::remove_file(&pwfile);
    // Another process may have won the race: then ours is simply discarded.
    if std::fs::rename(&base, &shared).is_err() {
        let _ = std::fs::remove_dir_all(&base);
    }
    if data.join("PG_VERSION").exists() {
        Ok(data)
    } else {
        bail!("template cluster missing at {}", data.display())
    }
}

/// Extra settings for a test cluster.
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// `wal_level`; tests of the "wrong wal_level" error path set `replica`.
    pub wal_level: String,
    /// Additional `-c name=value` settings.
    pub settings: Vec<(String, String)>,
    /// Files written into the data directory (mode 0600, owned by the server's user) before
    /// start, e.g. TLS keys and an `hba_file`; settings name them relative to the data dir.
    pub files: Vec<(String, Vec<u8>)>,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            wal_level: "logical".into(),
            settings: vec![],
            files: vec![],
        }
    }
}

/// A private Postgres cluster. Dropping it kills the server and deletes the data.
pub struct Postgres {
    pub port: u16,
    dir: tempfile::TempDir,
    opts: PgOptions,
    child: Option<Child>,
}

impl Postgres {
    pub fn start() -> Result<Self> {
        Self::start_with(PgOptions::default())
    }

    pub fn start_with(opts: PgOptions) -> Result<Self> {
        let template = template_dir()?;
        let dir = tempfile::Builder::new().prefix("outboxd-pg-").tempdir()?;
        let st = Command::new("cp")
            .arg("-a")
            .arg(template)
            .arg(dir.path().join("data"))
            .status()?;
        if !st.success() {
            bail!("copy the template cluster");
        }
        for (name, content) in &opts.files {
            use std::os::unix::fs::PermissionsExt;
            let p = dir.path().join("data").join(name);
            std::fs::write(&p, content)?;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
        }
        chown_tree(dir.path())?;
        let mut pg = Self {
            port: free_port(),
            dir,
            opts,
            child: None,
        };
        pg.spawn()?;
        Ok(pg)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn(&mut self) -> Result<()> {
        let mut cmd = Command::new(pg_bin_dir().join("postgres"));
        cmd.arg("-D")
            .arg(self.data_dir())
            .arg("-p")
            .arg(self.port.to_string())
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            .arg("-c")
            .arg(format!("wal_level={}", self.opts.wal_level))
            .args(["-c", "max_replication_slots=32", "-c", "max_wal_senders=32"])
            .args(["-c", "max_connections=200", "-c", "fsync=off"])
            .args(["-c", "full_page_writes=off", "-c", "logging_collector=off"]);
        for (k, v) in &self.opts.settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        let log = std::fs::File::create(self.dir.path().join("postgres.log"))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        as_pg_owner(&mut cmd);
        die_with_parent(&mut cmd);
        self.child = Some(cmd.spawn().context("spawn postgres")?);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = Command::new(pg_bin_dir().join("pg_isready"))
                .args(["-h", "127.0.0.1", "-q", "-p"])
                .arg(self.port.to_string())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut() {
                if let Some(st) = c.try_wait()? {
                    bail!("postgres exited with {st}: {}", self.log_tail());
                }
            }
            if Instant::now() > deadline {
                bail!("postgres did not become ready: {}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The last lines of the server log, for failure messages.
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// `postgres://postgres:PW@127.0.0.1:PORT/db`
    pub fn dsn(&self, db: &str) -> String {
        format!(
            "postgres://postgres:{PG_PASSWORD}@127.0.0.1:{}/{db}",
            self.port
        )
    }

    /// Connects with tokio-postgres; the connection task is spawned on the current runtime.
    pub async fn connect(&self, db: &str) -> Result<tokio_postgres::Client> {
        let (client, conn) = tokio_postgres::connect(&self.dsn(db), tokio_postgres::NoTls)
            .await
            .with_context(|| format!("connect to test postgres db {db}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(client)
    }

    /// Creates a database and returns its name (for isolation inside one cluster).
    pub async fn create_database(&self, name: &str) -> Result<String> {
        let c = self.connect("postgres").await?;
        c.batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .with_context(|| format!("create database {name}"))?;
        Ok(name.to_string())
    }

    /// Crash the server like a power cut of the process tree (`pg_ctl stop -m immediate`).
    pub fn stop_immediate(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            // SIGQUIT is the postmaster's "immediate shutdown".
            // SAFETY: plain kill(2) on our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGQUIT) };
            c.wait()?;
        }
        Ok(())
    }

    /// Start again on the same port and data directory (crash recovery runs).
    pub fn restart(&mut self) -> Result<()> {
        self.stop_immediate()?;
        self.spawn()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self.stop_immediate();
    }
}

/// A tansu broker (memory storage). Dropping it kills the broker.
pub struct Broker {
    pub port: u16,
    /// Port clients are told to use (a proxy's), when not `port`.
    advertised: u16,
    child: Option<Child>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Broker {
    pub fn start() -> Result<Self> {
        let port = free_port();
        Self::start_on(port, port)
    }

    /// A broker reachable only through a [`Proxy`] (it advertises the proxy's address, so
    /// clients never bypass it after the metadata round trip).
    pub fn start_behind_proxy() -> Result<(Self, Proxy)> {
        let port = free_port();
        let proxy = Proxy::start(0, ([127, 0, 0, 1], port).into())?;
        let b = Self::start_on(port, proxy.port)?;
        Ok((b, proxy))
    }

    fn start_on(port: u16, advertised: u16) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("outboxd-tansu-")
            .tempdir()?;
        let mut b = Self {
            port,
            advertised,
            child: None,
            log: dir.path().join("tansu.log"),
            _dir: dir,
        };
        b.spawn()?;
        Ok(b)
    }

    /// The address clients use (the proxy's when behind one).
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.advertised)
    }

    fn spawn(&mut self) -> Result<()> {
        let bin = tansu_bin();
        if !bin.exists() {
            bail!(
                "tansu not found at {} — run scripts/deps.sh (or set OUTBOXD_TANSU)",
                bin.display()
            );
        }
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let adv = format!("tcp://127.0.0.1:{}", self.advertised);
        let log = std::fs::File::create(&self.log)?;
        let mut cmd = Command::new(bin);
        cmd.arg("broker")
            .args(["--listener-url", &url, "--advertised-listener-url", &adv])
            .args(["--storage-engine", "memory://tansu/"])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_parent(&mut cmd);
        self.child = Some(cmd.spawn().context("spawn tansu")?);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                bail!("tansu did not listen on {}", self.port);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// SIGKILL the broker (memory storage: its data is gone).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start a fresh broker on the same port.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn postgres_and_broker_start() -> Result<()> {
        let pg = Postgres::start()?;
        let c = pg.connect("postgres").await?;
        let row = c.query_one("SHOW wal_level", &[]).await?;
        assert_eq!(row.get::<_, String>(0), "logical");
        let b = Broker::start()?;
        assert!(std::net::TcpStream::connect(b.bootstrap()).is_ok());
        let (_b2, proxy) = Broker::start_behind_proxy()?;
        assert!(std::net::TcpStream::connect(proxy.addr()).is_ok());
        Ok(())
    }
}
