//! The relay started with exactly what docker-compose.yml and the Kubernetes manifests give it —
//! arguments, environment (the image's `ENV` included), config file and secret files — with only
//! the hosts pointed at this test's Postgres and broker, and the metrics port made free. Every
//! `OUTBOXD_*` variable those files set must reach the setting it names, and the relay must
//! deliver. The files themselves: tests/tests/deploy_files.rs.

use anyhow::{Context, Result};
use outboxd_tests::deploy::{
    every_override_reaches_its_setting, kustomize, launch_of, of_kind, repo, run_ok, s, yaml_docs,
    Launch,
};
use outboxd_tests::reliability::{read_log, wait_for_active};
use outboxd_tests::testkit::{free_port, Broker, Postgres, PG_PASSWORD};
use outboxd_tests::{read_topic, write_events, NewEvent, RelayProcess};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Where the deployment's hosts are here.
struct Hosts {
    pg_port: u16,
    db: String,
    bootstrap: String,
}

impl Hosts {
    /// `postgres://user@anyhost:port/anydb` → this test's Postgres and database.
    fn dsn(&self, dsn: &str) -> String {
        let (user, _) = dsn.split_once('@').expect("a DSN with a user");
        format!("{user}@127.0.0.1:{}/{}", self.pg_port, self.db)
    }

    /// A config file with its DSN, bootstrap servers and metrics port pointed here.
    fn config(&self, toml: &str, metrics_port: u16) -> String {
        toml.lines()
            .map(|l| {
                let t = l.trim_start();
                if t.starts_with("dsn = ") {
                    let v = t.split('"').nth(1).unwrap();
                    format!("dsn = \"{}\"", self.dsn(v))
                } else if t.starts_with("\"bootstrap.servers\" = ") {
                    format!("\"bootstrap.servers\" = \"{}\"", self.bootstrap)
                } else if t.starts_with("listen = ") {
                    format!("listen = \"127.0.0.1:{metrics_port}\"")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A launch's environment values pointed here (DSNs and bootstrap servers).
    fn env(&self, l: &mut Launch) {
        for (k, v) in l.env.iter_mut() {
            if v.contains("://") && v.contains('@') {
                *v = self.dsn(v);
            } else if k == "OUTBOXD_SINK_KAFKA_BOOTSTRAP_SERVERS" {
                v.clone_from(&self.bootstrap);
            }
        }
    }
}

/// Points the launch's config file here (in place) and checks every override; returns the
/// metrics port it listens on.
fn prepare(l: &mut Launch, hosts: &Hosts, scratch: &Path) -> Result<u16> {
    hosts.env(l);
    let file = outboxd_tests::deploy::config_of(l)?;
    let port = free_port();
    let toml = hosts.config(&std::fs::read_to_string(&file)?, port);
    std::fs::write(&file, &toml)?;
    let checked = every_override_reaches_its_setting(&toml, &l.host_env(), scratch)?;
    assert!(!checked.is_empty());
    Ok(port)
}

fn spawn(l: &Launch, name: &str, log: PathBuf) -> Result<RelayProcess> {
    let f = std::fs::File::create(&log)?;
    let child = l
        .command(name)
        .stdout(f.try_clone()?)
        .stderr(f)
        .spawn()
        .context("spawn the relay")?;
    Ok(RelayProcess { child, log })
}

/// `outboxd probe QUESTION` as the container's probe runs it; true when it exits 0.
fn probe(l: &Launch, question: &str, port: u16) -> bool {
    // An exec probe: the container's environment, another command.
    let mut exec = l.clone();
    exec.args = ["probe", question, "--addr", &format!("127.0.0.1:{port}")]
        .map(String::from)
        .to_vec();
    let out = exec.command("probe").output().expect("run outboxd probe");
    if !out.status.success() {
        eprintln!(
            "probe {question} :{port}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out.status.success()
}

async fn until(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + within;
    while !f() {
        anyhow::ensure!(Instant::now() < deadline, "{what} not within {within:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Writes `n` events of aggregate `agg` and reads back that every one reached its topic.
async fn delivers(pg: &Postgres, hosts: &Hosts, agg: &str, n: i64) -> Result<()> {
    let mut c = pg.connect(&hosts.db).await?;
    let events: Vec<NewEvent> = (1..=n)
        .map(|v| NewEvent::new("deploy", agg, v, "Checked", serde_json::json!({ "v": v })))
        .collect();
    write_events(&mut c, &events, false).await?;
    let want: BTreeSet<String> = events.iter().map(|e| e.event_id.to_string()).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut missing = want.clone();
    while !missing.is_empty() && Instant::now() < deadline {
        let bootstrap = hosts.bootstrap.clone();
        let records = tokio::task::spawn_blocking(move || {
            read_topic(
                &bootstrap,
                "outbox.event.deploy",
                1,
                Duration::from_secs(10),
            )
        })
        .await??;
        for r in &records {
            missing.remove(r.header("event_id"));
        }
    }
    anyhow::ensure!(missing.is_empty(), "not delivered: {missing:?}");
    Ok(())
}

/// A broker next to `pg`, a database `deploy_NAME` and a scratch directory.
async fn world(pg: Postgres, name: &str) -> Result<(Postgres, Broker, Hosts, tempfile::TempDir)> {
    let broker = Broker::start()?;
    let hosts = Hosts {
        pg_port: pg.port,
        db: pg.create_database(&format!("deploy_{name}")).await?,
        bootstrap: broker.bootstrap(),
    };
    let scratch = outboxd_testkit::tempdir(&format!("{name}-"))?;
    Ok((pg, broker, hosts, scratch))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// docker-compose.yml on Postgres 17 (its image's major): the postgres container's init script
/// creates the two roles, `outboxd-init` runs `init` as outboxd_admin, `outboxd-grants` grants
/// outboxd_relay from sql/roles.sql, and `outboxd` runs as outboxd_relay — no superuser —,
/// passes `check` without a privilege warning, answers its HEALTHCHECK and delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_services_deliver_as_the_least_privilege_relay() -> Result<()> {
    let compose = yaml_docs(&read("docker-compose.yml"))?.remove(0);
    let services = &compose["services"];
    let image = s(&services["postgres"]["image"]);
    let major: u32 = image.rsplit(':').next().unwrap()[..2].parse()?;
    let (pg, _broker, hosts, scratch) = world(Postgres::start_version(major)?, "compose").await?;
    let db = hosts.db.clone();
    // Compose mounts each secret at /run/secrets/NAME; the superuser's is this cluster's.
    let secrets = scratch.path().join("secrets");
    std::fs::create_dir_all(&secrets)?;
    for (name, def) in compose["secrets"].as_object().unwrap() {
        let text = if name == "postgres-password" {
            PG_PASSWORD.to_string()
        } else {
            read(s(&def["file"]).trim_start_matches("./"))
        };
        std::fs::write(secrets.join(name), text)?;
    }
    // The image's ENV, then the service's environment, command and mounts.
    let image_env: Vec<(String, String)> = read("Dockerfile")
        .lines()
        .filter_map(|l| l.strip_prefix("ENV "))
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let service = |name: &str, dir: &str| -> Result<Launch> {
        let svc = &services[name];
        let mut l = Launch::default();
        l.env.extend(image_env.iter().cloned());
        for (k, v) in svc["environment"].as_object().into_iter().flatten() {
            l.env
                .insert(k.clone(), v.as_str().map_or(v.to_string(), str::to_string));
        }
        l.args = svc["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| s(a).to_string())
            .collect();
        let own = scratch.path().join(dir);
        std::fs::create_dir_all(&own)?;
        for v in svc["volumes"].as_array().into_iter().flatten() {
            let mut parts = s(v).split(':');
            let (host, container) = (parts.next().unwrap(), parts.next().unwrap());
            // A copy: the test points its hosts here without touching the repository.
            let copy = own.join(Path::new(container).file_name().unwrap());
            let src = repo().join(host.trim_start_matches("./"));
            if src.is_file() {
                std::fs::copy(&src, &copy)?;
                l.mounts.push((container.to_string(), copy));
            } else {
                l.mounts.push((container.to_string(), src));
            }
        }
        l.mounts.push(("/run/secrets".into(), secrets.clone()));
        Ok(l)
    };

    // 1. The postgres container's /docker-entrypoint-initdb.d, as its entrypoint runs it.
    let pg_env = &services["postgres"]["environment"];
    run_ok(
        Command::new("sh")
            .arg(repo().join("deploy/compose/initdb/10-outboxd-roles.sh"))
            .env("POSTGRES_USER", s(&pg_env["POSTGRES_USER"]))
            .env("POSTGRES_DB", &db)
            .env("SECRETS_DIR", &secrets)
            .env("SQL_DIR", repo().join("sql"))
            .env("PGHOST", "127.0.0.1")
            .env("PGPORT", pg.port.to_string())
            .env("PGPASSWORD", PG_PASSWORD),
    )?;
    // 2. outboxd-init.
    let mut init = service("outboxd-init", "init")?;
    prepare(&mut init, &hosts, scratch.path())?;
    assert!(init.env["OUTBOXD_SOURCE_DSN"].contains("outboxd_admin@"));
    let (ok, text) = init.output("outboxd-init")?;
    assert!(ok, "{text}");
    assert!(
        !text.contains("NOTICE"),
        "a fresh init says nothing it need not: {text}"
    );
    // 3. outboxd-grants: `sh /compose/grants.sh` with the postgres image's psql.
    let grants = service("outboxd-grants", "grants")?;
    assert_eq!(grants.args[0], "sh");
    let script = grants.host_path(&grants.args[1]).unwrap();
    let genv = &services["outboxd-grants"]["environment"];
    assert_eq!(s(&genv["PGHOST"]), "postgres");
    let out = run_ok(
        Command::new("sh")
            .arg(script)
            .env("PGHOST", "127.0.0.1")
            .env("PGPORT", pg.port.to_string())
            .env("PGUSER", s(&genv["PGUSER"]))
            .env("PGDATABASE", &db)
            .env("SECRETS_DIR", &secrets)
            .env("SQL_DIR", grants.host_path("/sql").unwrap()),
    )?;
    assert!(out.contains("outboxd_relay granted"), "{out}");
    // 4. outboxd: check, then run.
    let mut relay = service("outboxd", "relay")?;
    let port = prepare(&mut relay, &hosts, scratch.path())?;
    let mut check = relay.clone();
    check.args = vec!["check".into()];
    let (ok, text) = check.output("outboxd")?;
    assert!(ok, "{text}");
    assert!(
        !text.contains("superuser"),
        "the relay is not a superuser: {text}"
    );
    let mut p = spawn(&relay, "outboxd", scratch.path().join("relay.log"))?;
    until("the HEALTHCHECK passes", Duration::from_secs(60), || {
        probe(&relay, "ready", port)
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}: {}", read_log(&p.log)))?;
    delivers(&pg, &hosts, "compose", 20).await?;
    // stop_grace_period is above the drain.
    let grace: u64 = s(&services["outboxd"]["stop_grace_period"])
        .trim_end_matches('s')
        .parse()?;
    let t = Instant::now();
    let st = p.sigterm()?;
    assert!(
        st.success() && t.elapsed() < Duration::from_secs(grace),
        "{st:?}"
    );
    Ok(())
}

/// The one-pair overlay: the init Job runs `init` as outboxd_admin; both replicas of the
/// Deployment start with the pod's environment and files; one streams, the other stands by and
/// both pass the readiness probe (only one is `probe active`); the pair delivers; SIGTERM on the
/// active drains within terminationGracePeriodSeconds and the standby takes over and delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_pair_delivers_with_a_ready_standby_that_takes_over() -> Result<()> {
    let (_, docs) = kustomize("overlays/one-pair")?;
    let (pg, _broker, hosts, scratch) = world(Postgres::start()?, "k8s").await?;
    let db = hosts.db.clone();
    // The roles, as sql/roles.sql creates them (a DBA's step), with its passwords.
    let roles = read("sql/roles.sql");
    let (create, grants) = roles.split_once("-- ---- 2.").unwrap();
    let c = pg.connect(&db).await?;
    c.batch_execute(create).await?;
    let with_secret = |pod: &serde_json::Value, dir: &str, pw: &str| -> Result<Launch> {
        let d = scratch.path().join(dir);
        std::fs::create_dir_all(&d)?;
        let l = launch_of(&docs, pod, &d)?;
        for (container, host) in &l.mounts {
            if container.ends_with("secrets") {
                std::fs::write(host.join("source-password"), pw)?;
            }
        }
        Ok(l)
    };
    let job = of_kind(&docs, "Job")[0];
    let mut init = with_secret(&job["spec"]["template"]["spec"], "init", "change-me-admin")?;
    prepare(&mut init, &hosts, scratch.path())?;
    let out = run_ok(&mut init.command("outboxd-init-x1"))?;
    assert!(out.contains("slot"), "{out}");
    c.batch_execute(&format!("--{grants}")).await?;

    let deploy = of_kind(&docs, "Deployment")[0];
    let pod = &deploy["spec"]["template"]["spec"];
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    let mut replicas = Vec::new();
    let mut procs = Vec::new();
    for i in 0..deploy["spec"]["replicas"].as_u64().unwrap() {
        let mut l = with_secret(pod, &format!("pod{i}"), "change-me-relay")?;
        let port = prepare(&mut l, &hosts, scratch.path())?;
        let log = scratch.path().join(format!("pod{i}.log"));
        procs.push(spawn(&l, &format!("outboxd-pod{i}"), log)?);
        replicas.push((l, port));
    }
    let slot = replicas[0].0.env["OUTBOXD_SOURCE_SLOT"].clone();
    let logs = |procs: &[RelayProcess]| {
        procs
            .iter()
            .map(|p| read_log(&p.log))
            .collect::<Vec<_>>()
            .join("\n---\n")
    };
    let active = wait_for_active(&c, &slot, &procs, None, Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("{e}: {}", logs(&procs)))?;
    for (l, port) in &replicas {
        until("both replicas are Ready", Duration::from_secs(30), || {
            probe(l, "ready", *port)
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e}: {}", logs(&procs)))?;
    }
    let actives: Vec<bool> = replicas
        .iter()
        .map(|(l, p)| probe(l, "active", *p))
        .collect();
    assert_eq!(actives.iter().filter(|a| **a).count(), 1, "{actives:?}");
    assert!(actives[active], "{actives:?}");
    delivers(&pg, &hosts, "before", 20).await?;

    // A rollout or drain stops the active: it drains within the grace period, and the standby,
    // which stayed Ready all along, takes the slot.
    let old = procs[active].child.id();
    let t = Instant::now();
    let st = procs[active].sigterm()?;
    assert!(
        st.success() && t.elapsed() < Duration::from_secs(grace),
        "{st:?} after {:?}",
        t.elapsed()
    );
    let next = wait_for_active(&c, &slot, &procs, Some(old), Duration::from_secs(60)).await?;
    assert_ne!(next, active);
    let (l, port) = &replicas[next];
    until("the new active is Ready", Duration::from_secs(30), || {
        probe(l, "active", *port)
    })
    .await?;
    delivers(&pg, &hosts, "after", 20).await?;
    // `kubectl exec … -- outboxd tail TOPIC`: the pod's config and environment reach the broker.
    let mut tail = l.clone();
    tail.args = ["tail", "outbox.event.deploy", "-n", "1"]
        .map(String::from)
        .to_vec();
    let out = run_ok(&mut tail.command("outboxd-pod"))?;
    // One record of the topic, whichever partition answers first: "before" or "after".
    assert!(
        (out.contains("key=before") || out.contains("key=after")) && out.contains("event_id="),
        "{out}"
    );
    Ok(())
}

/// The README's quick start, as written: its minimal config (hosts pointed here, the password
/// from `OUTBOXD_SOURCE_PASSWORD` as it says), `init` — which on a fresh database prints what it
/// did and nothing else (the shipped SQL's `DROP … IF EXISTS` used to add NOTICEs about
/// triggers that "do not exist, skipping"; note: this test's binary, outboxd-under-test, did not
/// show them even before the fix, the plain `outboxd` binary did) — and the cleanup dry run the
/// README lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_minimal_config_inits_quietly_and_cleanup_dry_run_works() -> Result<()> {
    let (pg, _broker, hosts, scratch) = world(Postgres::start()?, "readme").await?;
    let readme = read("README.md");
    let block = readme
        .split("A minimal config")
        .nth(1)
        .and_then(|r| r.split("```toml\n").nth(1))
        .and_then(|r| r.split("```").next())
        .expect("README's minimal config");
    let file = scratch.path().join("outboxd.toml");
    std::fs::write(
        &file,
        hosts.config(&block.replace("user@", "postgres@"), free_port()),
    )?;
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(outboxd_tests::relay_bin())
            .args(args)
            .arg("--config")
            .arg(&file)
            .env("OUTBOXD_SOURCE_PASSWORD", PG_PASSWORD)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {text}");
        text
    };
    let out = run(&["init"], &[]);
    assert!(out.contains("slot") && !out.contains("NOTICE"), "{out}");
    let line = readme
        .lines()
        .find(|l| l.contains("OUTBOXD_CLEANUP_RETENTION="))
        .expect("the README's cleanup example");
    let retention = line.split("OUTBOXD_CLEANUP_RETENTION=").nth(1).unwrap();
    let retention = retention.split_whitespace().next().unwrap();
    let out = run(
        &["cleanup", "--dry-run"],
        &[("OUTBOXD_CLEANUP_RETENTION", retention)],
    );
    assert!(!out.is_empty(), "{out}");
    drop(pg);
    Ok(())
}
