//! TLS to Postgres: a server that admits the relay's role only over TLS (`hostssl`), with a
//! certificate from a private CA. `verify-full` streams events and both of the relay's
//! connections (SQL and walsender) are encrypted, also when the role logs in by client
//! certificate and reached through `hostaddr`; a plain connection, a certificate from another
//! CA, a host name the certificate does not list and `verify-ca` are refused with the fix.

use outboxd_tests::certs::Ca;
use outboxd_tests::testkit::{Broker, PgOptions, Postgres, PG_PASSWORD};
use outboxd_tests::*;
use rcgen::{CertificateParams, DnType};
use std::time::Duration;

const RELAY_PW: &str = "relay-tls-pw";

/// A server certificate for 127.0.0.1 and `db.outboxd.test` (a name no resolver knows: reached
/// with `hostaddr`), signed by `ca`: (cert, key) PEM.
fn server_cert(ca: &Ca) -> anyhow::Result<(String, String)> {
    ca.server(&["127.0.0.1", "db.outboxd.test"])
}

/// A client certificate for role `user` (Postgres matches the CN), signed by `ca`.
fn client_cert(ca: &Ca, user: &str) -> anyhow::Result<(String, String)> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name.push(DnType::CommonName, user);
    ca.sign(p)
}

const HBA: &str = "\
local all all trust
host all postgres 127.0.0.1/32 scram-sha-256
host replication postgres 127.0.0.1/32 scram-sha-256
hostssl all relay 127.0.0.1/32 scram-sha-256
hostssl all relaycert 127.0.0.1/32 cert
";

/// The relay's config: role `relay`, the given DSN host part and `[source]` TLS lines.
fn relay_toml(env: &Env, host: &str, tls: &str) -> String {
    env.toml()
        .replace(
            &format!("postgres://postgres:{PG_PASSWORD}@127.0.0.1:"),
            &format!("postgres://relay:{RELAY_PW}@{host}:"),
        )
        .replace("[source]\n", &format!("[source]\n{tls}\n"))
}

fn check(env: &Env, name: &str, toml: &str) -> anyhow::Result<(i32, String)> {
    let p = env.dir.path().join(format!("{name}.toml"));
    std::fs::write(&p, toml)?;
    Ok(outboxd_cli(&["check"], &p))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_only_server_verify_full_streams_and_mistakes_are_named() -> anyhow::Result<()> {
    let good = Ca::new("outboxd test CA")?;
    let other = Ca::new("some other CA")?;
    let (cert, key) = server_cert(&good)?;
    let pg = Postgres::start_with(PgOptions {
        settings: vec![
            ("ssl".into(), "on".into()),
            ("ssl_cert_file".into(), "server.crt".into()),
            ("ssl_key_file".into(), "server.key".into()),
            ("ssl_ca_file".into(), "root.crt".into()),
        ],
        files: vec![
            ("server.crt".into(), cert.into_bytes()),
            ("server.key".into(), key.into_bytes()),
            ("root.crt".into(), good.cert.pem().into_bytes()),
            ("pg_hba.conf".into(), HBA.as_bytes().to_vec()),
        ],
        ..PgOptions::default()
    })?;
    let env = Env::with(pg, Broker::start()?, "tls").await?;
    let c = env.sql().await?;
    c.batch_execute(&format!(
        "CREATE ROLE relay LOGIN SUPERUSER PASSWORD '{RELAY_PW}'; \
         CREATE ROLE relaycert LOGIN SUPERUSER"
    ))
    .await?;
    let ca_file = env.dir.path().join("ca.pem");
    std::fs::write(&ca_file, good.cert.pem())?;
    let other_file = env.dir.path().join("other-ca.pem");
    std::fs::write(&other_file, other.cert.pem())?;
    let verify = |mode: &str, ca: &std::path::Path| {
        format!("sslmode = \"{mode}\"\nsslrootcert = \"{}\"", ca.display())
    };

    // Plain: the server refuses the role, and the error says what to set.
    let (code, out) = check(
        &env,
        "plain",
        &relay_toml(&env, "127.0.0.1", "sslmode = \"disable\""),
    )?;
    assert!(
        code != 0 && out.contains("no encryption") && out.contains("source.sslmode"),
        "{out}"
    );
    // A certificate from a CA we do not trust.
    let (code, out) = check(
        &env,
        "other_ca",
        &relay_toml(&env, "127.0.0.1", &verify("verify-full", &other_file)),
    )?;
    assert!(
        code != 0 && out.contains("source.sslrootcert"),
        "unknown issuer must name sslrootcert: {out}"
    );
    // Right CA, but reached by a name the certificate does not list: refused, and the fix
    // (hostaddr) is named. verify-ca is refused up front with the same advice.
    let by_name = |name: &str, mode: &str| {
        relay_toml(&env, name, &verify(mode, &ca_file)).replace(
            &format!("/{}\"", env.db),
            &format!("/{}?hostaddr=127.0.0.1\"", env.db),
        )
    };
    let (code, out) = check(&env, "name_full", &by_name("localhost", "verify-full"))?;
    assert!(code != 0 && out.contains("hostaddr"), "{out}");
    let (code, out) = check(&env, "name_ca", &by_name("localhost", "verify-ca"))?;
    assert!(code != 0 && out.contains("hostaddr"), "{out}");

    // verify-full with the right CA: the password role passes `check` by IP; the relay streams
    // by the certificate's DNS name (hostaddr gives the address) as a role that logs in by
    // client certificate (`cert` in pg_hba.conf), over TLS on both connections.
    let toml = relay_toml(&env, "127.0.0.1", &verify("verify-full", &ca_file));
    let (code, out) = check(&env, "good", &toml)?;
    assert_eq!(code, 0, "{out}");
    let (ccert, ckey) = client_cert(&good, "relaycert")?;
    let (cert_file, key_file) = (env.dir.path().join("c.crt"), env.dir.path().join("c.key"));
    std::fs::write(&cert_file, ccert)?;
    std::fs::write(&key_file, ckey)?;
    let toml = by_name("db.outboxd.test", "verify-full")
        .replace(&format!("relay:{RELAY_PW}@"), "relaycert@")
        .replace(
            "[source]\n",
            &format!(
                "[source]\nsslcert = \"{}\"\nsslkey = \"{}\"\n",
                cert_file.display(),
                key_file.display()
            ),
        );
    let (code, out) = check(&env, "mtls", &toml)?;
    assert_eq!(code, 0, "{out}");
    let relay = Relay::start(outboxd::Config::from_toml_and_env(
        &toml,
        Vec::<(String, String)>::new(),
    )?);
    let mut w = env.sql().await?;
    for v in 1..=3 {
        write_events(
            &mut w,
            &[NewEvent::new(
                "acct",
                "T",
                v,
                "Deposited",
                serde_json::json!({ "v": v }),
            )],
            false,
        )
        .await?;
    }
    let recs = read_topic(
        &env.bootstrap(),
        "outbox.event.acct",
        3,
        Duration::from_secs(30),
    )?;
    if recs.len() != 3 {
        eprintln!(
            "{}",
            outboxd_cli(&["status"], &env.dir.path().join("mtls.toml")).1
        );
    }
    assert_eq!(recs.len(), 3);
    let kinds: Vec<(String, bool)> = c
        .query(
            "SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = 'relaycert' ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        kinds.iter().any(|(k, _)| k == "walsender") && kinds.iter().all(|(_, ssl)| *ssl),
        "{kinds:?}"
    );
    relay.shutdown().await?;
    Ok(())
}
