//! A Postgres DSN taken apart by its structure (issue 53): where its secrets are written, so a
//! view replaces exactly those bytes.
//!
//! Replacing the decoded password inside the raw DSN text misses every password that is
//! written differently from what it means: percent-encoded in a URL (`S3cr%40t%2Fpw`), a
//! `?password=a%26b` parameter, a quoted key=value (`password='a b\'c'`). So both forms are
//! parsed the way the driver reads them (tokio-postgres, libpq's rules) and each secret's
//! span, as written, is replaced: the URL's password (after the user name) and every parameter
//! whose name is a secret's (`password`, `sslpassword`, …, [`is_secret_key`]). A DSN that cannot
//! be taken apart is shown as [`REDACTED`] whole: it may be anything.

use super::secret_names::{is_secret_key, REDACTED};
use std::ops::Range;

/// One secret of a DSN: the bytes it is written as, and the value they mean.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    pub raw: Range<usize>,
    pub value: String,
}

/// Never prints the value.
impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({:?})", self.raw)
    }
}

/// Why a DSN could not be taken apart (no value in it: it may be the secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unparsed {
    #[error("a key=value DSN entry without `=` at byte {0}")]
    NoEquals(usize),
    #[error("a quoted key=value DSN value is not closed")]
    Unterminated,
}

/// The secrets of `dsn` (URL or key=value form), in the order written.
pub fn secrets(dsn: &str) -> Result<Vec<Secret>, Unparsed> {
    match url_body(dsn) {
        Some(start) => Ok(url_secrets(dsn, start)),
        None => kv_secrets(dsn),
    }
}

/// `dsn` with each secret replaced by [`REDACTED`]; the user name, hosts, database and other
/// parameters stay readable. A DSN that cannot be taken apart, or one whose secret would
/// still be readable after the replacement (a value also written elsewhere), is [`REDACTED`]
/// whole.
pub fn redact(dsn: &str) -> String {
    let Ok(found) = secrets(dsn) else {
        return REDACTED.to_string();
    };
    let mut out = String::with_capacity(dsn.len());
    let mut at = 0;
    for s in &found {
        out.push_str(&dsn[at..s.raw.start]);
        out.push_str(REDACTED);
        at = s.raw.end;
    }
    out.push_str(&dsn[at..]);
    // A check, not a replacement: the structure decided what is secret; a value still in the
    // text (password "app" for database "app") means the view shows nothing rather than guess.
    let leaks = found.iter().any(|s| {
        let raw = &dsn[s.raw.clone()];
        [raw, s.value.as_str()]
            .iter()
            .any(|v| v.chars().count() >= 3 && out.contains(*v))
    });
    if leaks {
        REDACTED.to_string()
    } else {
        out
    }
}

/// Every secret of `dsn` as written and as meant, for the redactor that scrubs other texts
/// (a driver's error may quote either). A DSN that cannot be taken apart gives itself: it is
/// only ever shown redacted whole, and any part of it may be the password.
pub fn secret_texts(dsn: &str) -> Vec<String> {
    match secrets(dsn) {
        Ok(found) => found
            .into_iter()
            .flat_map(|s| [dsn[s.raw].to_string(), s.value])
            .collect(),
        Err(_) => vec![dsn.to_string()],
    }
}

/// Where a URL DSN's body starts (after `postgres://` or `postgresql://`), as tokio-postgres
/// tells the two forms apart.
fn url_body(dsn: &str) -> Option<usize> {
    ["postgresql://", "postgres://"]
        .iter()
        .find(|p| dsn.starts_with(*p))
        .map(|p| p.len())
}

fn url_secrets(dsn: &str, start: usize) -> Vec<Secret> {
    let body = &dsn[start..];
    let mut out = Vec::new();
    // tokio-postgres ends the credentials at the first '@'; an unencoded '@' inside a password
    // ends them later for a person, so the last '@' before the path or query counts.
    let creds_end = body.find('@').map(|first| {
        let host_end = body[first..]
            .find(['/', '?', '#'])
            .map_or(body.len(), |i| first + i);
        body[..host_end].rfind('@').unwrap_or(first)
    });
    let after_creds = match creds_end {
        Some(end) => {
            if let Some(colon) = body[..end].find(':') {
                let raw = start + colon + 1..start + end;
                out.push(Secret {
                    value: percent_decode(&dsn[raw.clone()]),
                    raw,
                });
            }
            end + 1
        }
        None => 0,
    };
    let Some(q) = body[after_creds..].find('?').map(|i| after_creds + i + 1) else {
        return out;
    };
    let query_end = body[q..].find('#').map_or(body.len(), |i| q + i);
    let mut at = q;
    for param in body[q..query_end].split('&') {
        if let Some((k, v)) = param.split_once('=') {
            if is_secret_key(&percent_decode(k)) {
                let from = start + at + k.len() + 1;
                out.push(Secret {
                    raw: from..from + v.len(),
                    value: percent_decode(v),
                });
            }
        }
        at += param.len() + 1;
    }
    out
}

/// libpq's key=value form: `key = value` pairs separated by whitespace, a value either bare
/// or single-quoted, `\` escaping the next character in both.
fn kv_secrets(dsn: &str) -> Result<Vec<Secret>, Unparsed> {
    let b = dsn.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let skip_ws = |mut i: usize| {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_ws(i);
        if i == b.len() {
            return Ok(out);
        }
        let key_start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &dsn[key_start..i];
        i = skip_ws(i);
        if b.get(i) != Some(&b'=') {
            return Err(Unparsed::NoEquals(key_start));
        }
        i = skip_ws(i + 1);
        let value_start = i;
        let mut value = Vec::new();
        let quoted = b.get(i) == Some(&b'\'');
        if quoted {
            i += 1;
        }
        loop {
            match b.get(i) {
                None if quoted => return Err(Unparsed::Unterminated),
                None => break,
                Some(b'\'') if quoted => {
                    i += 1;
                    break;
                }
                Some(c) if !quoted && c.is_ascii_whitespace() => break,
                Some(b'\\') if i + 1 < b.len() => {
                    value.push(b[i + 1]);
                    i += 2;
                }
                Some(&c) => {
                    value.push(c);
                    i += 1;
                }
            }
        }
        if is_secret_key(key) {
            out.push(Secret {
                raw: value_start..i,
                value: String::from_utf8_lossy(&value).into_owned(),
            });
        }
    }
}

/// `%XX` sequences decoded (a malformed one kept as written), as UTF-8 (lossy).
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every byte outside RFC 3986's unreserved set as `%XX`: the form a secret takes in a URL.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for &c in s.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
            out.push(c as char);
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(dsn: &str) -> Vec<String> {
        secrets(dsn).unwrap().into_iter().map(|s| s.value).collect()
    }

    #[test]
    fn an_encoded_url_password_is_found_as_written_and_as_meant() {
        let dsn = "postgres://relay:S3cr%40t%2Fpw@db:5432/app?sslmode=require";
        assert_eq!(values(dsn), ["S3cr@t/pw"]);
        assert_eq!(
            redact(dsn),
            "postgres://relay:[redacted]@db:5432/app?sslmode=require"
        );
        let texts = secret_texts(dsn);
        assert!(texts.contains(&"S3cr%40t%2Fpw".to_string()), "{texts:?}");
        assert!(texts.contains(&"S3cr@t/pw".to_string()), "{texts:?}");
    }

    #[test]
    fn query_passwords_multi_host_and_unencoded_at_signs() {
        let dsn =
            "postgresql://u@h1:5432,h2:5433/app?password=a%26b&sslpassword=kp&application_name=x";
        assert_eq!(values(dsn), ["a&b", "kp"]);
        assert_eq!(
            redact(dsn),
            "postgresql://u@h1:5432,h2:5433/app?password=[redacted]&sslpassword=[redacted]&application_name=x"
        );
        let dsn = "postgres://u:p@ss:w%C3%A9rd@h1,h2:6432/db";
        assert_eq!(values(dsn), ["p@ss:wérd"]);
        assert_eq!(redact(dsn), "postgres://u:[redacted]@h1,h2:6432/db");
        assert_eq!(
            redact("postgres://u@h/db"),
            "postgres://u@h/db",
            "nothing secret"
        );
        // tokio-postgres reads the same password.
        use std::str::FromStr;
        let c = tokio_postgres::Config::from_str("postgres://relay:S3cr%40t%2Fpw@db/app").unwrap();
        assert_eq!(c.get_password(), Some(&b"S3cr@t/pw"[..]));
    }

    #[test]
    fn key_value_dsns_with_quoted_and_escaped_values() {
        let dsn = r"host=db user=relay password='a b\'c' dbname=app";
        assert_eq!(values(dsn), ["a b'c"]);
        assert_eq!(
            redact(dsn),
            "host=db user=relay password=[redacted] dbname=app"
        );
        let dsn = r"password = bare\ pw host=db sslpassword='é\\x'";
        assert_eq!(values(dsn), ["bare pw", r"é\x"]);
        assert_eq!(
            redact(dsn),
            "password = [redacted] host=db sslpassword=[redacted]"
        );
        assert_eq!(redact("host=db password='open"), REDACTED);
        assert_eq!(redact("host=db justaword"), REDACTED);
        assert_eq!(
            secret_texts("host=db password='open"),
            ["host=db password='open"]
        );
    }

    #[test]
    fn a_password_also_written_elsewhere_hides_the_whole_dsn() {
        assert_eq!(redact("postgres://app:app@h/app"), REDACTED);
        assert_eq!(redact("host=h dbname=secret1 password=secret1"), REDACTED);
    }

    #[test]
    fn percent_coding_never_panics_and_round_trips() {
        for s in ["%", "%2", "%2é", "a%zz", "%%41", "é%C3%A9"] {
            let _ = percent_decode(s);
        }
        assert_eq!(percent_decode("%2é"), "%2é");
        let s = "S3cr@t/pw é'\"";
        assert_eq!(percent_decode(&percent_encode(s)), s);
    }
}
