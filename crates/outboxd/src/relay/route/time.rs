//! Postgres `timestamptz` text to epoch milliseconds: the record timestamp (`created_at`).

/// Parses Postgres `timestamptz` text output (ISO DateStyle, which the replication session
/// pins) to epoch milliseconds. `infinity` and anything unparseable yield `None`.
pub fn parse_timestamptz_ms(s: &str) -> Option<i64> {
    parse_iso_fast(s.as_bytes()).or_else(|| {
        chrono::DateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f%#z")
            .ok()
            .map(|d| d.timestamp_millis())
    })
}

/// The hot path: `YYYY-MM-DD HH:MM:SS[.ffffff]+00` exactly as the pinned session renders it
/// (chrono re-parses its format string on every call, ~12% of the relay's instructions).
fn parse_iso_fast(b: &[u8]) -> Option<i64> {
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let d = b.get(r)?;
        d.iter().try_fold(0i64, |acc, c| {
            c.is_ascii_digit().then(|| acc * 10 + i64::from(c - b'0'))
        })
    };
    if b.len() < 22
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b' '
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mut i = 19;
    let mut ms = 0i64;
    if b[i] == b'.' {
        let start = i + 1;
        i = start;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let frac = &b[start..i];
        for k in 0..3 {
            ms = ms * 10 + frac.get(k).map_or(0, |c| i64::from(c - b'0'));
        }
    }
    if &b[i..] != b"+00" {
        return None; // another offset or format: the general parser handles it
    }
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + h) * 60 + mi) * 60_000 + sec * 1000 + ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(parse_timestamptz_ms("infinity"), None);
        assert_eq!(parse_timestamptz_ms("1970-01-01 00:00:01+00"), Some(1000));
        assert_eq!(parse_timestamptz_ms("1970-01-01 01:00:01+01"), Some(1000));
        assert_eq!(
            parse_timestamptz_ms("2024-02-29 23:59:59.999+00"),
            Some(1_709_251_199_999)
        );
        assert_eq!(parse_timestamptz_ms("1969-12-31 23:59:59.5+00"), Some(-500));
    }

    proptest::proptest! {
        /// The fast path agrees with chrono on every instant it accepts.
        #[test]
        fn fast_timestamp_parser_matches_chrono(ms in -2_000_000_000_000i64..4_000_000_000_000i64, micros in 0u32..1000) {
            let t = chrono::DateTime::from_timestamp_millis(ms).unwrap();
            let text = format!("{}{:03}+00", t.format("%Y-%m-%d %H:%M:%S%.3f"), micros);
            let slow = chrono::DateTime::parse_from_str(&text, "%Y-%m-%d %H:%M:%S%.f%#z").unwrap().timestamp_millis();
            proptest::prop_assert_eq!(parse_iso_fast(text.as_bytes()), Some(slow));
            let whole = format!("{}+00", t.format("%Y-%m-%d %H:%M:%S"));
            let slow = chrono::DateTime::parse_from_str(&whole, "%Y-%m-%d %H:%M:%S%#z").unwrap().timestamp_millis();
            proptest::prop_assert_eq!(parse_iso_fast(whole.as_bytes()), Some(slow));
        }
    }
}
