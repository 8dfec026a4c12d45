//! SASL to Kafka (issue 13) against a broker that demands it: tansu behind the testkit's
//! SASL-terminating proxy (PLAIN, SCRAM-SHA-256/512, OAUTHBEARER as a Kafka broker speaks them;
//! tansu 0.6 cannot authenticate anyone itself).
//!
//! - every mechanism connects over TLS, SCRAM streams with nothing lost, and `outboxd check`
//!   names the fix for a wrong password and a mechanism the broker does not enable;
//! - a running relay refused by the broker reports class `auth` (metrics, `/readyz`,
//!   `outboxd status`) without echoing a secret, and heals when the broker accepts it again;
//! - password rotation with instances restarted one at a time loses nothing;
//! - OIDC client credentials: outboxd fetches the token (with extensions) from a token
//!   endpoint, refreshes it, and a refused client is named.

use outboxd_tests::certs::Ca;
use outboxd_tests::reliability::*;
use outboxd_tests::testkit::sasl_proxy::{SaslOptions, SaslProxy};
use outboxd_tests::testkit::token_stub::TokenStub;
use outboxd_tests::testkit::{free_port, Broker, Postgres};
use outboxd_tests::*;
use std::path::PathBuf;
use std::time::Duration;

const TOPIC: &str = "outbox.event.acct";
const USER: &str = "outboxd";
const PASSWORD: &str = "Sasl-Pw-7f3a9c-right";
const WRONG: &str = "Sasl-Pw-0d41e2-wrong";

/// A world whose broker only takes SASL (and TLS when `tls`), with `mechanisms` enabled.
async fn sasl_env(
    name: &str,
    mechanisms: &[&str],
    tls: Option<&Ca>,
) -> anyhow::Result<(Env, SaslProxy)> {
    let tls = match tls {
        Some(ca) => Some(ca.server(&["127.0.0.1", "localhost"])?),
        None => None,
    };
    let (broker, proxy) = Broker::start_behind_sasl(SaslOptions {
        mechanisms: mechanisms.iter().map(|m| m.to_string()).collect(),
        tls,
    })?;
    let env = Env::with(Postgres::start()?, broker, name).await?;
    // tansu's CLI talks to the plain port: the advertised one wants SASL.
    create_topic_on_port(env.broker.port, TOPIC)?;
    Ok((env, proxy))
}

/// `[sink.kafka]` lines for SASL with the password read from a file.
fn sasl_lines(
    env: &Env,
    mechanism: &str,
    tls_ca: Option<&Ca>,
    password: &str,
    tag: &str,
) -> String {
    let pw = env.dir.path().join(format!("{tag}.password"));
    std::fs::write(&pw, format!("{password}\n")).unwrap();
    let mut s = format!(
        "\"security.protocol\" = \"{}\"\n\"sasl.mechanism\" = \"{mechanism}\"\n\
         \"sasl.username\" = \"{USER}\"\n\"sasl.password.file\" = \"{}\"\n",
        if tls_ca.is_some() {
            "sasl_ssl"
        } else {
            "sasl_plaintext"
        },
        pw.display()
    );
    if let Some(ca) = tls_ca {
        let ca_path = env.dir.path().join(format!("{tag}.ca.pem"));
        std::fs::write(&ca_path, ca.cert.pem()).unwrap();
        s.push_str(&format!(
            "\"ssl.ca.location\" = \"{}\"\n",
            ca_path.display()
        ));
    }
    s
}

fn write_config(env: &Env, kafka_lines: &str, file: &str) -> anyhow::Result<PathBuf> {
    let toml = env
        .toml()
        .replace("[sink.kafka]\n", &format!("[sink.kafka]\n{kafka_lines}"));
    let path = env.dir.path().join(file);
    std::fs::write(&path, toml)?;
    Ok(path)
}

/// A reader's bootstrap string that authenticates as `user` (see `reader_config`).
fn reader_bootstrap(env: &Env, proxy: &SaslProxy, mech: &str, user: &str, pw: &str) -> String {
    let _ = proxy;
    format!(
        "{} security.protocol=SASL_PLAINTEXT sasl.mechanism={mech} sasl.username={user} sasl.password={pw}",
        env.bootstrap()
    )
}

fn assert_no_secret(text: &str, secrets: &[&str], what: &str) {
    for s in secrets {
        assert!(!text.contains(s), "a secret appears in {what}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mechanism_over_tls_and_check_names_each_refusal() -> anyhow::Result<()> {
    let ca = Ca::new("outboxd SASL test CA")?;
    let mechs = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"];
    let (env, proxy) = sasl_env("ksasl", &mechs, Some(&ca)).await?;
    proxy.set_user(USER, PASSWORD);

    // Each mechanism authenticates over TLS (check connects with the configured security).
    for m in mechs {
        let config = write_config(
            &env,
            &sasl_lines(&env, m, Some(&ca), PASSWORD, m),
            &format!("{m}.toml"),
        )?;
        let (code, out) = outboxd_cli(&["check"], &config);
        assert_eq!(code, 0, "{m}: {out}");
    }

    // SCRAM-SHA-512 over TLS streams; the broker acknowledged all (the slot confirms past them)
    // and a reader authenticated as another user finds every event once.
    let config = write_config(
        &env,
        &sasl_lines(&env, "SCRAM-SHA-512", Some(&ca), PASSWORD, "run"),
        "run.toml",
    )?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    env.deliver("a-1", 200, &log).await?;
    assert!(relay.sigterm()?.success());
    proxy.set_user("reader", "reader-pw");
    let ca_path = env.dir.path().join("run.ca.pem");
    let records = read_topic(
        &format!(
            "{} security.protocol=SASL_SSL sasl.mechanism=PLAIN sasl.username=reader \
             sasl.password=reader-pw ssl.ca.location={}",
            env.bootstrap(),
            ca_path.display()
        ),
        TOPIC,
        200,
        Duration::from_secs(30),
    )?;
    let ids: std::collections::HashSet<&str> =
        records.iter().map(|r| r.header("event_id")).collect();
    assert_eq!(ids.len(), 200, "{} records", records.len());
    assert!(proxy.principals().iter().any(|p| p == USER));

    // A wrong password: refused, the fix named, the password nowhere.
    let config = write_config(
        &env,
        &sasl_lines(&env, "SCRAM-SHA-512", Some(&ca), WRONG, "wrong"),
        "wrong.toml",
    )?;
    let out = check_fails_naming(&config, "credentials");
    assert_no_secret(&out, &[WRONG, PASSWORD], "check output");
    assert!(proxy.failures() > 0);

    // A mechanism the broker does not enable (a second listener offering SCRAM-SHA-512 only).
    let (cert, key) = ca.server(&["127.0.0.1"])?;
    let only512 = SaslProxy::start(
        ([127, 0, 0, 1], env.broker.port).into(),
        SaslOptions {
            mechanisms: vec!["SCRAM-SHA-512".into()],
            tls: Some((cert, key)),
        },
    )?;
    let lines = sasl_lines(&env, "SCRAM-SHA-256", Some(&ca), PASSWORD, "mech");
    let toml = env.toml().replace(
        &format!("\"bootstrap.servers\" = \"{}\"", env.bootstrap()),
        &format!(
            "\"bootstrap.servers\" = \"127.0.0.1:{}\"\n{lines}",
            only512.port
        ),
    );
    let config = env.dir.path().join("mech.toml");
    std::fs::write(&config, toml)?;
    check_fails_naming(&config, "does not enable");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_relay_reports_auth_and_heals_when_the_broker_accepts_it() -> anyhow::Result<()> {
    let (env, proxy) = sasl_env("ksasl_auth", &["SCRAM-SHA-256"], None).await?;
    proxy.set_user(USER, PASSWORD);
    let maddr = format!("127.0.0.1:{}", free_port());
    let mut env = env;
    env.extra_toml = format!("[metrics]\nlisten = \"{maddr}\"\n");
    // The relay was given a password the broker does not (yet) accept.
    let config = write_config(
        &env,
        &sasl_lines(&env, "SCRAM-SHA-256", None, WRONG, "r"),
        "r.toml",
    )?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    let mut c = env.sql().await?;
    let events: Vec<NewEvent> = (1..=50)
        .map(|v| NewEvent::new("acct", "a-2", v, "Deposited", serde_json::json!({"v": v})))
        .collect();
    let lsn = write_events_returning_lsn(&mut c, &events).await?;

    // Class auth everywhere an operator looks; nothing confirmed past the waiting events.
    eventually(Duration::from_secs(30), || async {
        let m = http_get(&maddr, "/metrics").1;
        Ok(m.lines().any(|l| {
            l.starts_with("outboxd_broker_errors_total{class=\"auth\"}") && !l.ends_with(" 0")
        }))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}: {}", read_log(&log)))?;
    let ready = http_get(&maddr, "/readyz").1;
    assert!(ready.contains("refuses this relay (auth)"), "{ready}");
    eventually(Duration::from_secs(20), || async {
        let (code, out) = outboxd_cli(&["status", "--json"], &config);
        anyhow::ensure!(code == 0, "{out}");
        let v: serde_json::Value = serde_json::from_str(&out)?;
        Ok(v.pointer("/reported/last_error_class")
            .and_then(|c| c.as_str())
            == Some("auth"))
    })
    .await?;
    let (_, status) = outboxd_cli(&["status"], &config);
    eprintln!("refused relay: /readyz says {ready}\nstatus says:\n{status}");
    assert!(status.contains("broker:auth"), "{status}");
    assert!(env.confirmed_lsn().await? < lsn);

    // The broker accepts the relay's password (rotated on the broker side): it heals without
    // a restart and delivers everything.
    proxy.set_user(USER, WRONG);
    eventually(Duration::from_secs(60), || async {
        Ok(env.confirmed_lsn().await? > lsn)
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}: {}", read_log(&log)))?;
    eventually(Duration::from_secs(20), || async {
        Ok(http_get(&maddr, "/readyz").1.contains("ready")
            && !http_get(&maddr, "/readyz").1.contains("not ready"))
    })
    .await?;
    assert!(relay.sigterm()?.success());
    assert_no_secret(&read_log(&log), &[WRONG, PASSWORD], "the relay log");
    assert_no_secret(&status, &[WRONG, PASSWORD], "outboxd status");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_rotation_one_instance_at_a_time_loses_nothing() -> anyhow::Result<()> {
    let (mut env, proxy) = sasl_env("ksasl_rot", &["SCRAM-SHA-512", "PLAIN"], None).await?;
    env.extra_toml = "standby_poll_ms = 500".into();
    proxy.set_user(USER, PASSWORD);
    proxy.set_user("reader", "reader-pw");
    let inbox_dsn = env.pg.dsn(&consumer_db(&env.pg, "inbox").await?);
    let reader = InboxReader::start(
        &reader_bootstrap(&env, &proxy, "PLAIN", "reader", "reader-pw"),
        TOPIC,
        &inbox_dsn,
    );
    let writer = Writer::start(env.pg.dsn(&env.db), Load::default());
    // Both instances read the password from the same secret file, as a mounted secret is.
    let config = write_config(
        &env,
        &sasl_lines(&env, "SCRAM-SHA-512", None, PASSWORD, "shared"),
        "rot.toml",
    )?;
    let pw_file = env.dir.path().join("shared.password");
    let log_of = |i: usize, gen: usize| env.dir.path().join(format!("relay-{i}-{gen}.log"));
    let sql = env.sql().await?;
    let mut a = RelayProcess::spawn(&config, log_of(0, 0))?;
    eventually(Duration::from_secs(30), || async {
        Ok(streaming_pids(&sql, &env.slot)
            .await?
            .contains(&a.child.id()))
    })
    .await?;
    let mut b = RelayProcess::spawn(&config, log_of(1, 0))?;
    writer.wait_committed(300, Duration::from_secs(60)).await?;

    // 1. The broker gets the new password (existing connections stay authenticated, as in
    //    Kafka); 2. the secret file is updated; 3. the standby restarts with it; 4. the active
    //    one restarts, the standby takes over with the new password; 5. it comes back as the
    //    standby.
    proxy.set_user(USER, WRONG);
    std::fs::write(&pw_file, format!("{WRONG}\n"))?;
    assert!(b.sigterm()?.success());
    b = RelayProcess::spawn(&config, log_of(1, 1))?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = writer.committed_events();
    assert!(a.sigterm()?.success());
    eventually(Duration::from_secs(30), || async {
        Ok(streaming_pids(&sql, &env.slot)
            .await?
            .contains(&b.child.id()))
    })
    .await?;
    a = RelayProcess::spawn(&config, log_of(0, 1))?;
    writer
        .wait_committed(before + 300, Duration::from_secs(60))
        .await?;
    let wlog = writer.stop().await?;
    let (stats, report) = drain_and_verify(reader, &wlog, "acct", &inbox_dsn).await?;
    eprintln!("rotation: {stats:?} {report:?}");
    assert!(b.sigterm()?.success());
    assert!(a.sigterm()?.success());
    for (i, g) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        assert_no_secret(&read_log(&log_of(i, g)), &[WRONG, PASSWORD], "a relay log");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_client_credentials_fetch_refresh_and_refusal() -> anyhow::Result<()> {
    const CLIENT: &str = "outboxd-client";
    const SECRET: &str = "oidc-secret-5b8e1d";
    let (env, proxy) = sasl_env("ksasl_oidc", &["OAUTHBEARER"], None).await?;
    // Tokens live 8 s: the relay must fetch a new one at 80% of that, and the broker takes
    // only tokens the endpoint issued.
    let stub = TokenStub::start_for(&proxy, CLIENT, SECRET, 8)?;
    let secret_file = env.dir.path().join("oidc.secret");
    std::fs::write(&secret_file, SECRET)?;
    let lines = format!(
        "\"security.protocol\" = \"sasl_plaintext\"\n\"sasl.mechanism\" = \"OAUTHBEARER\"\n\
         \"sasl.oauthbearer.method\" = \"oidc\"\n\
         \"sasl.oauthbearer.token.endpoint.url\" = \"{}\"\n\
         \"sasl.oauthbearer.client.id\" = \"{CLIENT}\"\n\
         \"sasl.oauthbearer.client.secret.file\" = \"{}\"\n\
         \"sasl.oauthbearer.scope\" = \"kafka\"\n\
         \"sasl.oauthbearer.extensions\" = \"logicalCluster=lkc-1,identityPoolId=pool-2\"\n",
        stub.url(),
        secret_file.display()
    );
    let config = write_config(&env, &lines, "oidc.toml")?;
    let (code, out) = outboxd_cli(&["check"], &config);
    assert_eq!(code, 0, "{out}");
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    env.deliver("a-1", 100, &log).await?;
    // A refresh before the first token expires.
    eventually(Duration::from_secs(20), || async {
        Ok(stub.issued().len() >= 3)
    })
    .await?;
    assert!(relay.sigterm()?.success());
    let reqs = stub.requests();
    assert!(
        reqs.iter().all(|r| r.basic_user.as_deref() == Some(CLIENT)
            && r.grant_type.as_deref() == Some("client_credentials")
            && r.scope.as_deref() == Some("kafka")),
        "{reqs:?}"
    );
    let ext = proxy.extensions();
    assert!(
        ext.contains(&("logicalCluster".into(), "lkc-1".into())),
        "{ext:?}"
    );
    assert!(proxy.principals().iter().any(|p| p == CLIENT));

    // The provider refuses the client: named, the secret nowhere.
    std::fs::write(&secret_file, "not-the-secret-93c1")?;
    let out = check_fails_naming(&config, "refused the client credentials");
    assert_no_secret(&out, &[SECRET, "not-the-secret-93c1"], "check output");
    for t in stub.issued() {
        assert_no_secret(&read_log(&log), &[&t, SECRET], "the relay log");
    }
    Ok(())
}
