//! The OTLP export headers (`[telemetry] headers`, `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS`):
//! `key1=value1,key2=value2` with percent-encoded values, the OpenTelemetry list format
//! (issue 53).
//!
//! The values are secrets (a receiver's API key), so nothing here ever puts one into an error:
//! a malformed entry is named by its key (or its position, when it has no key), never by what
//! it holds. Parsing never panics: the configuration is read (and these headers scrubbed from
//! its errors) on every start, with tracing on or off.

/// Why the export headers cannot be used. Carries no value: it may be the API key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error(
        "telemetry.headers (OTEL_EXPORTER_OTLP_HEADERS): the value of header {key:?} is not \
         valid percent-encoding (a `%` must be followed by two hex digits, and the decoded bytes \
         must be UTF-8); encode a literal `%` as %25 (the value is not shown)"
    )]
    BadEncoding { key: String },
    #[error(
        "telemetry.headers (OTEL_EXPORTER_OTLP_HEADERS): entry {position} (counting from 1) is \
         not key=value with both parts set; write key1=value1,key2=value2 (the entry is not shown)"
    )]
    NotAPair { position: usize },
}

/// `key=value` entries with their values decoded; an empty entry (`a=1,,b=2`) is skipped.
pub fn parse(list: &str) -> Result<Vec<(String, String)>, HeaderError> {
    let mut out = Vec::new();
    for (i, entry) in entries(list).enumerate() {
        let (k, v) = match entry.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() && !v.trim().is_empty() => (k.trim(), v.trim()),
            _ => return Err(HeaderError::NotAPair { position: i + 1 }),
        };
        let value = decode(v).ok_or_else(|| HeaderError::BadEncoding { key: k.to_string() })?;
        out.push((k.to_string(), value));
    }
    Ok(out)
}

/// The names of the entries, read leniently (what the OpenTelemetry SDK would send).
pub fn names(list: &str) -> Vec<String> {
    entries(list)
        .filter_map(|e| {
            e.split_once('=')
                .map(|(k, _)| k.trim().to_ascii_lowercase())
        })
        .filter(|k| !k.is_empty())
        .collect()
}

/// Every value as written and, when it decodes, as meant: what the redactor must know, even
/// of a list [`parse`] refuses (its error must not be the way a value gets out).
pub fn secret_texts(list: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in entries(list) {
        // An entry without `=` may be a value whose key was lost: all of it is secret.
        let raw = entry.split_once('=').map_or(entry, |(_, v)| v).trim();
        out.push(raw.to_string());
        out.extend(decode(raw).filter(|d| d != raw));
    }
    out
}

/// Resource attributes: the same list format, but a value that does not decode is kept as
/// written (they are labels, not credentials; the SDK does the same).
pub fn lenient_pairs(list: &str) -> Vec<(String, String)> {
    entries(list)
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (
                k.trim().to_string(),
                decode(v.trim()).unwrap_or_else(|| v.trim().to_string()),
            ),
            None => (p.trim().to_string(), String::new()),
        })
        .collect()
}

fn entries(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').filter(|p| !p.trim().is_empty())
}

/// Strict percent-decoding: `None` for a `%` without two hex digits after it or bytes that
/// are not UTF-8 (byte-wise, so a multi-byte character after `%` is no panic).
pub fn decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = hex(*b.get(i + 1)?)?;
            let l = hex(*b.get(i + 2)?)?;
            out.push(h << 4 | l);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A URL without its user info (`https://user:key@host/` → `https://host/`): what logs show
/// of the OTLP endpoint.
pub fn without_user_info(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => url.to_string(),
    }
}

/// The password of a URL's user info, as written and as meant (for the redactor).
pub fn url_password_texts(url: &str) -> Vec<String> {
    let Some((_, rest)) = url.split_once("://") else {
        return Vec::new();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return Vec::new();
    };
    let user_info = &rest[..at];
    let raw = user_info.split_once(':').map_or(user_info, |(_, p)| p);
    let mut out = vec![raw.to_string()];
    out.extend(decode(raw));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_value_is_an_error_naming_the_key_only_and_never_a_panic() {
        for bad in ["x=key%2é", "x=key%2", "x=key%", "x=%zzkey", "x=%C3key"] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e, HeaderError::BadEncoding { key: "x".into() }, "{bad}");
            assert!(!e.to_string().contains("key%"), "{e}");
        }
        let e = parse("a=1,just-a-secret-value").unwrap_err();
        assert_eq!(e, HeaderError::NotAPair { position: 2 });
        assert!(!e.to_string().contains("just-a-secret"), "{e}");
        assert!(parse("x=").is_err() && parse("=v").is_err());
        assert_eq!(
            parse(" x-api-key = a%20b%C3%A9 ,, other=c").unwrap(),
            [
                ("x-api-key".into(), "a bé".into()),
                ("other".into(), "c".into())
            ]
        );
        assert_eq!(secret_texts("x=key%2é,bare"), ["key%2é", "bare"]);
        assert_eq!(secret_texts("x=a%20b"), ["a%20b", "a b"]);
        assert_eq!(names("X-Api-Key=1,bare,=2"), ["x-api-key"]);
        assert_eq!(
            lenient_pairs("k=100%,j=a%20b"),
            [("k".into(), "100%".into()), ("j".into(), "a b".into())]
        );
    }

    #[test]
    fn user_info_leaves_the_endpoint() {
        assert_eq!(
            without_user_info("https://otel:S3cr%40t@collector:4318/v1/traces"),
            "https://collector:4318/v1/traces"
        );
        assert_eq!(without_user_info("http://c:4317"), "http://c:4317");
        assert_eq!(without_user_info("c:4317"), "c:4317");
        assert_eq!(
            url_password_texts("https://otel:S3cr%40t@collector:4318"),
            ["S3cr%40t", "S3cr@t"]
        );
    }
}
