//! The proxy against its RFC test vectors and a real librdkafka client.

use super::*;
use crate::Broker;
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ProducerContext};
use rdkafka::ClientContext;
use std::time::{Duration, Instant};

/// RFC 7677 section 3: user "user", password "pencil".
#[test]
fn scram_sha256_rfc7677_vector() {
    let salt = B64.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
    let first = scram_first(
        ScramHash::Sha256,
        "n,,n=user,r=rOprNGfwEbeRWgbNEkqO",
        |u| {
            (u == "user").then(|| {
                let salted = ScramHash::Sha256.salted_password("pencil", &salt, 4096);
                (salt.clone(), salted)
            })
        },
        "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0",
        4096,
    )
    .unwrap();
    assert_eq!(
        first.server_first,
        "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    );
    let fin = scram_final(
        &first,
        "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
             p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=",
    )
    .unwrap();
    assert_eq!(fin, "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=");
    // A wrong proof, a wrong nonce, an unknown user.
    assert!(scram_final(
        &first,
        "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,\
             p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVA="
    )
    .is_err());
    assert!(scram_final(&first, "c=biws,r=other,p=AAAA").is_err());
    assert!(scram_first(ScramHash::Sha256, "n,,n=bob,r=x", |_| None, "y", 4096).is_err());
}

#[test]
fn oauthbearer_parsing_and_jwt_sub() {
    let (t, ext) =
        parse_oauthbearer("n,,\x01auth=Bearer abc.def\x01logicalCluster=lkc-1\x01\x01").unwrap();
    assert_eq!(t, "abc.def");
    assert_eq!(ext, vec![("logicalCluster".into(), "lkc-1".into())]);
    assert!(parse_oauthbearer("n,,\x01auth=Basic x\x01\x01").is_none());
    let jwt = format!(
        "{}.{}.",
        B64URL.encode(r#"{"alg":"none"}"#),
        B64URL.encode(r#"{"sub":"alice"}"#)
    );
    assert_eq!(jwt_sub(&jwt).as_deref(), Some("alice"));
    assert_eq!(jwt_sub("opaque"), None);
}

/// Records what librdkafka reports through the error callback.
#[derive(Clone, Default)]
struct Errors(Arc<Mutex<Vec<String>>>);

impl ClientContext for Errors {
    fn error(&self, error: KafkaError, reason: &str) {
        self.0.lock().unwrap().push(format!("{error}: {reason}"));
    }
}

impl ProducerContext for Errors {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

fn create_topic(broker: &Broker, topic: &str) {
    let out = std::process::Command::new(crate::tansu_bin())
        .args(["topic", "create", "--partitions", "1", "--broker"])
        .arg(format!("tcp://127.0.0.1:{}", broker.port))
        .arg(topic)
        .output()
        .expect("run tansu topic create");
    assert!(
        out.status.success(),
        "tansu topic create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A producer of `bootstrap` with these settings on top of SASL_PLAINTEXT defaults.
fn producer(
    bootstrap: &str,
    settings: &[(&str, &str)],
) -> (BaseProducer<Errors>, Arc<Mutex<Vec<String>>>) {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", bootstrap)
        .set("security.protocol", "SASL_PLAINTEXT")
        .set("message.timeout.ms", "5000")
        .set("reconnect.backoff.ms", "100");
    for (k, v) in settings {
        cfg.set(*k, *v);
    }
    let ctx = Errors::default();
    let errors = ctx.0.clone();
    let p = cfg.create_with_context(ctx).expect("create producer");
    (p, errors)
}

/// Metadata, then one record delivered, through the proxy.
fn produce_one(p: &BaseProducer<Errors>, topic: &str) -> Result<()> {
    let md = p
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(5))?;
    anyhow::ensure!(md.topics().len() == 1 && md.topics()[0].error().is_none());
    p.send(BaseRecord::to(topic).key("k").payload("v"))
        .map_err(|(e, _)| e)?;
    p.flush(Duration::from_secs(5))?;
    anyhow::ensure!(p.in_flight_count() == 0, "not delivered");
    Ok(())
}

/// Polls `p` until librdkafka reported an error containing `needle`; returns it.
fn wait_error(p: &BaseProducer<Errors>, errors: &Mutex<Vec<String>>, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        p.poll(Duration::from_millis(100));
        if let Some(e) = errors.lock().unwrap().iter().find(|e| e.contains(needle)) {
            return e.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no error containing {needle:?}; got {:?}",
            errors.lock().unwrap()
        );
    }
}

fn scram(mech: &str, user: &str, pw: &str) -> Vec<(&'static str, String)> {
    vec![
        ("sasl.mechanism", mech.to_string()),
        ("sasl.username", user.to_string()),
        ("sasl.password", pw.to_string()),
    ]
}

fn as_refs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// SCRAM-SHA-512 through the proxy: the right password produces, a wrong one and an
/// unknown user are refused with librdkafka's SASL authentication error, a mechanism not
/// enabled with "Unsupported SASL mechanism", and a rotated password refuses the old one
/// for new clients while an authenticated client keeps producing.
#[test]
fn scram_sha512_wrong_password_wrong_mechanism_rotation() {
    let (broker, proxy) = Broker::start_behind_sasl(SaslOptions::new(&["SCRAM-SHA-512"])).unwrap();
    create_topic(&broker, "t");
    proxy.set_user("alice", "pw1");
    let bs = broker.bootstrap();

    let (good, _) = producer(&bs, &as_refs(&scram("SCRAM-SHA-512", "alice", "pw1")));
    produce_one(&good, "t").unwrap();
    assert!(proxy.successes() >= 1);
    assert_eq!(proxy.principals()[0], "alice");
    let seen = proxy.seen_versions();
    eprintln!("librdkafka sent before authenticating: {seen:?}");
    assert!(seen.contains(&(SASL_HANDSHAKE, 1)), "{seen:?}");

    let (bad, errors) = producer(&bs, &as_refs(&scram("SCRAM-SHA-512", "alice", "nope")));
    let e = wait_error(&bad, &errors, "SASL authentication error");
    eprintln!("wrong password: {e}");
    assert!(
        e.contains("Authentication failed during authentication due to invalid credentials"),
        "{e}"
    );
    assert!(proxy.failures() >= 1);
    drop(bad);

    let (nobody, errors) = producer(&bs, &as_refs(&scram("SCRAM-SHA-512", "bob", "pw1")));
    let e = wait_error(&nobody, &errors, "SASL authentication error");
    eprintln!("unknown user: {e}");
    drop(nobody);

    let (wrong_mech, errors) = producer(&bs, &as_refs(&scram("SCRAM-SHA-256", "alice", "pw1")));
    let e = wait_error(&wrong_mech, &errors, "Unsupported SASL mechanism");
    eprintln!("wrong mechanism: {e}");
    drop(wrong_mech);

    // Rotation: new clients need the new password; the open connection keeps working.
    proxy.set_user("alice", "pw2");
    let (old, errors) = producer(&bs, &as_refs(&scram("SCRAM-SHA-512", "alice", "pw1")));
    wait_error(&old, &errors, "SASL authentication error");
    drop(old);
    let (new, _) = producer(&bs, &as_refs(&scram("SCRAM-SHA-512", "alice", "pw2")));
    produce_one(&new, "t").unwrap();
    let before = proxy.successes();
    produce_one(&good, "t").unwrap();
    assert_eq!(
        proxy.successes(),
        before,
        "the first client did not re-authenticate"
    );

    proxy.remove_user("alice");
    let (gone, errors) = producer(&bs, &as_refs(&scram("SCRAM-SHA-512", "alice", "pw2")));
    wait_error(&gone, &errors, "SASL authentication error");
}

/// A client that does not authenticate (PLAINTEXT) gets ApiVersions, then its first other
/// request closes the connection, as with Kafka; nothing counts as an authentication.
#[test]
fn unauthenticated_client_is_cut_off() {
    let (broker, proxy) = Broker::start_behind_sasl(SaslOptions::new(&["SCRAM-SHA-512"])).unwrap();
    let (p, errors) = producer(&broker.bootstrap(), &[("security.protocol", "PLAINTEXT")]);
    assert!(p
        .client()
        .fetch_metadata(None, Duration::from_secs(2))
        .is_err());
    eprintln!("PLAINTEXT client: {:?}", errors.lock().unwrap());
    assert_eq!((proxy.successes(), proxy.failures()), (0, 0));
}

/// SCRAM-SHA-256 and PLAIN enabled together: both work, a wrong PLAIN password fails.
#[test]
fn scram_sha256_and_plain() {
    let (broker, proxy) =
        Broker::start_behind_sasl(SaslOptions::new(&["SCRAM-SHA-256", "PLAIN"])).unwrap();
    create_topic(&broker, "t");
    proxy.set_user("carol", "s3cret");
    let bs = broker.bootstrap();
    let (p, _) = producer(&bs, &as_refs(&scram("SCRAM-SHA-256", "carol", "s3cret")));
    produce_one(&p, "t").unwrap();
    let (p, _) = producer(&bs, &as_refs(&scram("PLAIN", "carol", "s3cret")));
    produce_one(&p, "t").unwrap();
    let (bad, errors) = producer(&bs, &as_refs(&scram("PLAIN", "carol", "wrong")));
    let e = wait_error(&bad, &errors, "SASL authentication error");
    eprintln!("PLAIN wrong password: {e}");
    assert!(e.contains("SASL mechanism PLAIN"), "{e}");
    // librdkafka opens two connections per client (bootstrap, then the advertised broker).
    assert!(proxy.successes() >= 2);
    assert!(proxy.principals().iter().all(|p| p == "carol"));
}

/// OAUTHBEARER with librdkafka's unsecured JWTs: the `sub` claim is the principal and the
/// extensions arrive; a proxy that allows no token refuses.
#[test]
fn oauthbearer_unsecured_jwt_and_extensions() {
    let settings = [
        ("sasl.mechanism", "OAUTHBEARER"),
        ("enable.sasl.oauthbearer.unsecure.jwt", "true"),
        (
            "sasl.oauthbearer.config",
            "principal=alice extension_logicalCluster=lkc-1",
        ),
    ];
    let (broker, proxy) = Broker::start_behind_sasl(SaslOptions::new(&["OAUTHBEARER"])).unwrap();
    create_topic(&broker, "t");
    let (refused, errors) = producer(&broker.bootstrap(), &settings);
    let e = wait_error(&refused, &errors, "SASL authentication error");
    eprintln!("OAUTHBEARER unknown token: {e}");
    drop(refused);
    proxy.allow_any_token();
    let (p, _) = producer(&broker.bootstrap(), &settings);
    produce_one(&p, "t").unwrap();
    assert!(proxy.principals().iter().all(|p| p == "alice"));
    assert_eq!(
        proxy.extensions(),
        vec![("logicalCluster".to_string(), "lkc-1".to_string())]
    );
}

/// SASL_SSL: the proxy terminates TLS (a private CA's certificate for 127.0.0.1) and SCRAM.
#[test]
fn sasl_ssl_scram() {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "testkit CA");
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();

    let (broker, proxy) = Broker::start_behind_sasl(
        SaslOptions::new(&["SCRAM-SHA-512"]).with_tls(&cert.pem(), &key.serialize_pem()),
    )
    .unwrap();
    create_topic(&broker, "t");
    proxy.set_user("alice", "pw");
    let creds = scram("SCRAM-SHA-512", "alice", "pw");
    let mut settings = as_refs(&creds);
    settings.push(("security.protocol", "SASL_SSL"));
    let ca_path = ca_file.to_str().unwrap().to_string();
    settings.push(("ssl.ca.location", &ca_path));
    let (p, _) = producer(&broker.bootstrap(), &settings);
    produce_one(&p, "t").unwrap();
    assert!(proxy.principals().iter().all(|p| p == "alice"));
    assert!(proxy.successes() >= 1);
}
