//! Secrets never echoed (issue 13): a distinctive marker is set in every secret-bearing key —
//! the DSN's password, `source.password`, `sasl.password`, `ssl.key.password`,
//! `ssl.keystore.password`, the parked rows' integrity key (`[parked] key`, issue 40), and where
//! librdkafka is refused first `sasl.oauthbearer.client.secret` — and each error path is provoked:
//! TOML syntax and type errors, `Config`'s `Debug`, a configuration librdkafka refuses, a
//! broker that rejects the credentials while the relay runs, `check` and `status`. The marker
//! must appear nowhere.

use outboxd_tests::*;
use std::time::Duration;

const MARK: &str = "Zq7-SECRET-MARK-41f9";

/// The marker in every secret of a config that is otherwise `env`'s.
fn secret_toml(env: &Env, kafka_extra: &str) -> String {
    env.toml()
        .replace(
            &format!(":{}@", outboxd_tests::testkit::PG_PASSWORD),
            &format!(":{MARK}-dsn@"),
        )
        .replace(
            "[source]\n",
            &format!(
                "[source]\npassword = \"{}\"\n",
                outboxd_tests::testkit::PG_PASSWORD
            ),
        )
        .replace(
            "[sink.kafka]\n",
            &format!(
                "[sink.kafka]\n\"sasl.password\" = \"{MARK}-sasl\"\n\"ssl.key.password\" = \
                 \"{MARK}-key\"\n\"ssl.keystore.password\" = \"{MARK}-ks\"\n{kafka_extra}\n"
            ),
        )
        + &format!("\n[parked]\nkey = \"{MARK}-parked-integrity-key-0123456789\"\n")
}

fn assert_clean(what: &str, text: &str) {
    assert!(
        !text.contains(MARK),
        "{what} echoes a secret:\n{}",
        text.lines()
            .filter(|l| l.contains(MARK))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_errors_and_debug_never_echo_secrets() -> anyhow::Result<()> {
    let env = Env::start("sec_cfg").await?;
    let good = secret_toml(
        &env,
        &format!("\"sasl.oauthbearer.client.secret\" = \"{MARK}-oidc\""),
    );
    let cfg = outboxd::Config::from_toml_and_env(&good, Vec::<(String, String)>::new())?;
    assert_clean("Config Debug", &format!("{cfg:?}"));
    assert_clean("Config Debug (pretty)", &format!("{cfg:#?}"));

    // A syntax error on the line holding the secret (unterminated string).
    let broken = good.replace(&format!("\"{MARK}-sasl\""), &format!("\"{MARK}-sasl"));
    let e = outboxd::Config::from_toml_and_env(&broken, Vec::<(String, String)>::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("line"), "{e}");
    assert_clean("TOML syntax error", &e);
    // Type errors echo the value they could not read.
    for (from, to) in [
        (format!("\"{MARK}-sasl\""), format!("[\"{MARK}-sasl\"]")),
        (
            format!("password = \"{}\"", outboxd_tests::testkit::PG_PASSWORD),
            format!("password = {{ v = \"{MARK}-pw\" }}"),
        ),
        (
            format!("key = \"{MARK}-parked-integrity-key-0123456789\""),
            format!("key = [\"{MARK}-parked-integrity-key-0123456789\"]"),
        ),
        (
            format!("key = \"{MARK}-parked-integrity-key-0123456789\""),
            format!("key = \"{MARK}-short\""),
        ),
    ] {
        let bad = good.replace(&from, &to);
        assert_ne!(bad, good);
        let e = outboxd::Config::from_toml_and_env(&bad, Vec::<(String, String)>::new())
            .unwrap_err()
            .to_string();
        assert_clean("config type error", &e);
    }
    // The same through the environment and through a secret file.
    let secret_file = env.dir.path().join("sasl_pw");
    std::fs::write(&secret_file, format!("{MARK}-file\n"))?;
    let from_file = good.replace(
        &format!("\"sasl.password\" = \"{MARK}-sasl\""),
        &format!("\"sasl.password.file\" = \"{}\"", secret_file.display()),
    );
    let cfg = outboxd::Config::from_toml_and_env(
        &from_file,
        vec![(
            "OUTBOXD_SINK_KAFKA_SASL_USERNAME".to_string(),
            "relay".to_string(),
        )],
    )?;
    assert_eq!(cfg.sink.kafka["sasl.password"], format!("{MARK}-file"));
    assert!(!cfg.sink.kafka.contains_key("sasl.password.file"));
    assert_clean("Config Debug with a secret file", &format!("{cfg:?}"));
    let e = outboxd::Config::from_toml_and_env(
        &from_file.replace(".file\" = \"", ".file\" = \"/nonexistent"),
        Vec::<(String, String)>::new(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cannot read"), "{e}");
    Ok(())
}

/// librdkafka refuses the configuration (a private key it cannot read with the given
/// passphrase): a definite error that names the property, exits without retrying, echoes no
/// secret; `check` and `status` neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_librdkafka_refuses_is_definite_and_redacted() -> anyhow::Result<()> {
    let env = Env::start("sec_rdk").await?;
    let key = env.dir.path().join("client.key");
    std::fs::write(
        &key,
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIBvTBXBgkqhkiG9w0BBQ0wSjApBgkqhkiG\n\
         -----END ENCRYPTED PRIVATE KEY-----\n",
    )?;
    let toml = secret_toml(
        &env,
        &format!(
            "\"security.protocol\" = \"ssl\"\n\"ssl.key.location\" = \"{}\"\n\
             \"ssl.certificate.location\" = \"{}\"",
            key.display(),
            key.display()
        ),
    );
    let config = env.dir.path().join("secret.toml");
    std::fs::write(&config, &toml)?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn_with_env(&config, log.clone(), &[("RUST_LOG", "debug")])?;
    let st = reliability::wait_exit(&mut relay, Duration::from_secs(60)).await?;
    let text = reliability::read_log(&log);
    assert!(
        !st.success(),
        "a refused configuration must stop the relay\n{text}"
    );
    assert!(
        text.contains("[sink.kafka] is not a valid librdkafka configuration"),
        "{text}"
    );
    assert!(
        !text.contains("session failed; restarting"),
        "a refused configuration is retried:\n{text}"
    );
    assert_clean("relay log", &text);
    let (_, out) = outboxd_cli(&["check"], &config);
    assert_clean("outboxd check", &out);
    let (_, out) = outboxd_cli(&["status"], &config);
    assert_clean("outboxd status", &out);

    // librdkafka refuses a property this build lacks and repeats its value in the error.
    let oidc = secret_toml(
        &env,
        &format!("\"sasl.oauthbearer.client.secret\" = \"{MARK}-oidc\""),
    );
    std::fs::write(&config, &oidc)?;
    let mut relay = RelayProcess::spawn_with_env(&config, log.clone(), &[("RUST_LOG", "debug")])?;
    let st = reliability::wait_exit(&mut relay, Duration::from_secs(60)).await?;
    assert!(!st.success());
    let text = reliability::read_log(&log);
    assert!(text.contains("not supported in this build"), "{text}");
    assert_clean("relay log (unsupported property)", &text);
    let (code, out) = outboxd_cli(&["check"], &config);
    assert_ne!(code, 0, "{out}");
    assert_clean("outboxd check (unsupported property)", &out);
    Ok(())
}

/// A running relay whose credentials the broker does not accept (SASL against a listener
/// without it): it keeps retrying — credentials get rotated — and never logs the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_credentials_are_retried_and_never_logged() -> anyhow::Result<()> {
    let env = Env::start("sec_auth").await?;
    let toml = secret_toml(
        &env,
        "\"security.protocol\" = \"sasl_plaintext\"\n\"sasl.mechanism\" = \"SCRAM-SHA-256\"\n\
         \"sasl.username\" = \"relay\"",
    )
    .replace(&format!("\"ssl.key.password\" = \"{MARK}-key\"\n"), "")
    .replace(&format!("\"ssl.keystore.password\" = \"{MARK}-ks\"\n"), "");
    let config = env.dir.path().join("secret.toml");
    std::fs::write(&config, &toml)?;
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn_with_env(&config, log.clone(), &[("RUST_LOG", "debug")])?;
    let mut c = env.sql().await?;
    write_events(
        &mut c,
        &[NewEvent::new(
            "acct",
            "a-1",
            1,
            "Deposited",
            serde_json::json!({"v": 1}),
        )],
        false,
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        relay.child.try_wait()?.is_none(),
        "the relay gave up on a credential problem:\n{}",
        reliability::read_log(&log)
    );
    relay.sigkill();
    let text = reliability::read_log(&log);
    assert!(
        text.contains("librdkafka"),
        "no broker error was logged:\n{text}"
    );
    assert_clean("relay log", &text);
    let (_, out) = outboxd_cli(&["check"], &config);
    assert!(out.contains("broker"), "{out}");
    assert_clean("outboxd check", &out);
    let (_, out) = outboxd_cli(&["status", "--json"], &config);
    assert_clean("outboxd status", &out);
    Ok(())
}

/// Issue 53: secrets written encoded, quoted and with unicode — the DSN's password
/// percent-encoded, a `?password=` parameter, a key=value `replication_dsn` with a quoted
/// password, librdkafka's passphrase — each carrying the marker. The password is wrong, so
/// every connection fails and says so: `check`, `status` and the running relay's log (debug)
/// show none of them, nor their percent-encoded form. (The status page, `Debug` and the
/// configuration errors: `obs::status::hostile` in the crate.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoded_quoted_and_unicode_secrets_never_show() -> anyhow::Result<()> {
    let env = Env::start("sec_hostile").await?;
    let hostile = |n: u32| format!("{MARK}{n}/é@'\"%&:? ü\\;");
    let all_encoded = |s: &str| s.bytes().map(|b| format!("%{b:02X}")).collect::<String>();
    let quoted = |s: &str| serde_json::to_string(s).unwrap();
    let kv = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"));
    let dsn = env.pg.dsn(&env.db);
    let port = dsn
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .unwrap();
    let hostile_dsn = format!(
        "{}?password={}",
        dsn.replace(
            &format!(":{}@", outboxd_tests::testkit::PG_PASSWORD),
            &format!(":{}@", all_encoded(&hostile(1)))
        ),
        all_encoded(&hostile(2))
    );
    let replication = format!(
        "host=127.0.0.1 port={port} user=postgres password={} dbname={}",
        kv(&hostile(3)),
        env.db
    );
    let toml = env
        .toml()
        .replace(
            &format!("dsn = \"{dsn}\""),
            &format!("dsn = {}", quoted(&hostile_dsn)),
        )
        .replace(
            "[source]\n",
            &format!("[source]\nreplication_dsn = {}\n", quoted(&replication)),
        )
        .replace(
            "[sink.kafka]\n",
            &format!(
                "[sink.kafka]\n\"sasl.password\" = {}\n\
                 \"sasl.oauthbearer.assertion.private.key.passphrase\" = {}\n",
                quoted(&hostile(4)),
                quoted(&hostile(5))
            ),
        );
    assert!(
        toml.contains("replication_dsn") && !toml.contains(&dsn),
        "{toml}"
    );
    let config = env.dir.path().join("hostile.toml");
    std::fs::write(&config, &toml)?;
    let clean = |what: &str, text: &str| {
        assert_clean(what, text);
        assert!(!text.contains(&all_encoded(MARK)), "{what}:\n{text}");
    };
    let (code, out) = outboxd_cli(&["check"], &config);
    assert_ne!(code, 0, "the password is wrong:\n{out}");
    clean("outboxd check", &out);
    let (_, out) = outboxd_cli(&["status", "--json"], &config);
    clean("outboxd status", &out);
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn_with_env(&config, log.clone(), &[("RUST_LOG", "debug")])?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    relay.sigkill();
    let text = reliability::read_log(&log);
    assert!(
        text.contains("password authentication failed"),
        "no connection failure logged:\n{text}"
    );
    clean("relay log", &text);
    Ok(())
}
