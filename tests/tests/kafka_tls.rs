//! TLS to Kafka (issue 13) against a broker that only speaks TLS to its clients (tansu behind a
//! TLS-terminating proxy with a private CA): verified TLS streams with nothing lost; a
//! certificate from another CA and a name the certificate does not list are refused, and
//! `outboxd check` names the fix for each.

use outboxd_tests::certs::Ca;
use outboxd_tests::testkit::{Broker, Postgres};
use outboxd_tests::*;

const TOPIC: &str = "outbox.event.acct";

/// A test world whose broker only takes TLS, with a certificate for `names` from `ca`.
async fn tls_env(name: &str, ca: &Ca, names: &[&str]) -> anyhow::Result<Env> {
    let (cert, key) = ca.server(names)?;
    let (broker, proxy) = Broker::start_behind_tls(&cert, &key)?;
    let env = Env::with(Postgres::start()?, broker, name).await?;
    // The CLI talks to the plain port: the advertised one wants TLS.
    create_topic_on_port(env.broker.port, TOPIC)?;
    std::mem::forget(proxy); // lives as long as the test process
    Ok(env)
}

fn write_config(env: &Env, ca_pem: &str, file: &str) -> anyhow::Result<std::path::PathBuf> {
    let ca_path = env.dir.path().join(format!("{file}.ca.pem"));
    std::fs::write(&ca_path, ca_pem)?;
    let toml = env.toml().replace(
        "[sink.kafka]\n",
        &format!(
            "[sink.kafka]\n\"security.protocol\" = \"ssl\"\n\"ssl.ca.location\" = \"{}\"\n",
            ca_path.display()
        ),
    );
    let path = env.dir.path().join(file);
    std::fs::write(&path, toml)?;
    Ok(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verified_tls_streams_and_mistakes_are_named() -> anyhow::Result<()> {
    let good_ca = Ca::new("outboxd test CA")?;
    let env = tls_env("ktls", &good_ca, &["127.0.0.1", "localhost"]).await?;

    // Verified: the relay streams and confirms only what the broker acknowledged over TLS.
    let config = write_config(&env, &good_ca.cert.pem(), "good.toml")?;
    let (code, out) = outboxd_cli(&["check"], &config);
    assert_eq!(code, 0, "{out}");
    let log = env.dir.path().join("relay.log");
    let mut relay = RelayProcess::spawn(&config, log.clone())?;
    env.deliver("a-1", 200, &log).await?;
    assert!(relay.sigterm()?.success());

    // A certificate from another CA.
    let other = Ca::new("someone else")?;
    let config = write_config(&env, &other.cert.pem(), "wrong_ca.toml")?;
    check_fails_naming(&config, "ssl.ca.location");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_the_certificate_does_not_list_is_refused() -> anyhow::Result<()> {
    let good_ca = Ca::new("outboxd test CA")?;
    let env = tls_env("ktls_name", &good_ca, &["kafka.other.test"]).await?;
    let config = write_config(&env, &good_ca.cert.pem(), "wrong_name.toml")?;
    check_fails_naming(&config, "does not list the host");
    Ok(())
}
