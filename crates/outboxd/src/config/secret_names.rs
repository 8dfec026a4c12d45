//! Which names hold secrets: librdkafka properties and DSN parameters alike (a leaf, so the
//! DSN parser and the redactor share one rule).

/// What replaces a secret in any output.
pub const REDACTED: &str = "[redacted]";

/// librdkafka properties whose values are secrets (passwords, passphrases, keys, client
/// secrets, tokens), and the DSN parameters of the same kind (`password`, `sslpassword`). By
/// name pattern rather than a list, so a property a newer librdkafka adds
/// (`sasl.oauthbearer.assertion.private.key.passphrase`) is a secret from the start.
pub fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    if LIBRDKAFKA_PATHS.contains(&k.as_str()) {
        return false;
    }
    k.contains("password")
        || k.contains("secret")
        || k.contains("token")
        || k.contains("passphrase")
        || k.contains("private.key")
        || k.contains("private_key")
        || k == "ssl.key.pem"
        || k == "ssl_key"
        || k == "sasl.oauthbearer.config"
        || k == "sasl.jaas.config"
}

/// librdkafka's own `*.file` properties: paths librdkafka reads itself, passed verbatim (not
/// outboxd's "read this secret from a file" form, and not secrets).
pub(super) const LIBRDKAFKA_PATHS: [&str; 3] = [
    "sasl.oauthbearer.assertion.file",
    "sasl.oauthbearer.assertion.jwt.template.file",
    "sasl.oauthbearer.assertion.private.key.file",
];
