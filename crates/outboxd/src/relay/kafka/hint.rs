//! Names the fix for the broker connection failures librdkafka reports as text: TLS (protocol,
//! unknown CA, host name), SASL (mechanism not built in, wrong credentials) and ACLs.

/// Whether `msg` already names what to change: one of our hints, or an error of ours that
/// carries its fix (the OIDC token endpoint's).
pub fn names_fix(msg: &str) -> bool {
    msg.contains(" — ") || msg.contains("OIDC token endpoint")
}

/// `msg` followed by what to change, when the failure is one we can name.
pub fn with_hint(msg: &str) -> String {
    match hint(msg) {
        Some(h) => format!("{msg} — {h}"),
        None => msg.to_string(),
    }
}

const WRONG_NAME: &str = "the broker's certificate does not list the host named in \
     bootstrap.servers: connect by a name the certificate lists (or reissue it); \
     ssl.endpoint.identification.algorithm = \"none\" turns the check off and is for tests only";

const UNKNOWN_CA: &str = "the broker's certificate is not signed by a CA outboxd trusts: set \
     ssl.ca.location to the PEM file of your CA (managed services document theirs)";

/// For `outboxd check`: a certificate failure told apart by a handshake of our own (see
/// [`crate::relay::tls::diagnose_server_cert`]) against the first bootstrap server, with the same CA
/// file; otherwise the text hints.
pub fn explain(msg: &str, kafka: &std::collections::BTreeMap<String, String>) -> String {
    if !msg.contains("certificate verify failed") {
        return with_hint(msg);
    }
    let first = kafka
        .get("bootstrap.servers")
        .and_then(|b| b.split(',').next())
        .map(|s| s.trim().rsplit("://").next().unwrap_or(s).to_string());
    let target = first.as_deref().and_then(|hp| {
        let (h, p) = hp.rsplit_once(':')?;
        Some((
            h.trim_matches(|c| c == '[' || c == ']').to_string(),
            p.parse::<u16>().ok()?,
        ))
    });
    let ca = kafka
        .get("ssl.ca.location")
        .filter(|l| *l != "probe")
        .map(std::path::Path::new);
    let found = target.and_then(|(h, p)| crate::relay::tls::diagnose_server_cert(&h, p, ca));
    match found {
        Some(crate::relay::tls::CertProblem::WrongName) => format!("{msg} — {WRONG_NAME}"),
        Some(crate::relay::tls::CertProblem::UnknownCa) => format!("{msg} — {UNKNOWN_CA}"),
        None => with_hint(msg),
    }
}

fn hint(msg: &str) -> Option<&'static str> {
    let m = msg.to_ascii_lowercase();
    let has = |s: &str| m.contains(s);
    Some(if has("hostname mismatch") || has("ip address mismatch") {
        WRONG_NAME
    } else if has("certificate verify failed")
        || has("unable to get local issuer")
        || has("self-signed")
        || has("self signed")
    {
        UNKNOWN_CA
    } else if has("ssl handshake failed")
        || has("wrong version number")
        || has("packet length too long")
    {
        "the TLS handshake failed: security.protocol must match the listener (SSL or SASL_SSL for \
         a TLS port, PLAINTEXT or SASL_PLAINTEXT otherwise)"
    } else if has("oidc token endpoint") {
        // Our own OIDC errors already name the fix.
        return None;
    } else if has("unsupported sasl mechanism") || has("supported mechanisms") {
        "the broker does not enable this SASL mechanism: set sasl.mechanism to one it lists \
         (MSK and Aiven: SCRAM-SHA-512; Confluent Cloud: PLAIN or OAUTHBEARER)"
    } else if has("no provider for sasl mechanism") {
        "this SASL mechanism is not built in: `outboxd --version` lists the built-in features \
         (PLAIN, SCRAM-SHA-256/512 and OAUTHBEARER are)"
    } else if has("authentication failed")
        || has("sasl authentication error")
        || has("invalid username or password")
        || has("authentication error")
    {
        "authentication failed: check sasl.mechanism and the credentials (sasl.username and \
         sasl.password, from the environment or a \"sasl.password.file\")"
    } else if has("authorization failed") || has("not authorized") || has("authorization_failed") {
        "the principal lacks ACLs: grant WRITE and DESCRIBE on the outbox topics and \
         IDEMPOTENT_WRITE on the cluster"
    } else {
        return None;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_fix() {
        for (msg, want) in [
            (
                "SSL handshake failed: certificate verify failed: Hostname mismatch",
                "does not list the host",
            ),
            (
                "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed",
                "ssl.ca.location",
            ),
            (
                "SSL handshake failed: error:0A00010B:SSL routines::wrong version number",
                "security.protocol",
            ),
            ("No provider for SASL mechanism GSSAPI", "not built in"),
            (
                "SASL Handshake failed: Broker: Unsupported SASL mechanism (broker's supported mechanisms: PLAIN)",
                "does not enable",
            ),
            (
                "SASL authentication error: Authentication failed during authentication",
                "credentials",
            ),
            ("Broker: Topic authorization failed", "ACLs"),
        ] {
            assert!(with_hint(msg).contains(want), "{msg} → {}", with_hint(msg));
        }
        assert_eq!(with_hint("timed out"), "timed out");
    }
}
