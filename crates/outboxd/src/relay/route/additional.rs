//! Extra columns as Kafka headers (`[source.columns] additional`), with exactly the bytes
//! Debezium writes for them: its Postgres connector turns the column into a Kafka Connect value
//! and Kafka Connect's default header converter, `SimpleHeaderConverter`, writes that value's
//! text (`Values.convertToString`). A NULL is a header without a value, in both.
//!
//! Only column types whose rendering is verified against Debezium are accepted
//! (tests/golden/debezium-additional); any other type is refused when the table's schema
//! arrives, naming the column, rather than sent in a shape Debezium's consumers do not expect.

use std::borrow::Cow;

/// How a column's text (Postgres's output function, as pgoutput sends it) becomes the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Render {
    /// Postgres's text is Debezium's: text, varchar, char (with its padding), smallint,
    /// integer, bigint (Connect integers, printed in decimal), uuid (lower case), json (as
    /// written), jsonb (as Postgres normalises it).
    Text,
    /// `t`/`f` → `true`/`false` (recovery reads `::text`, which is already `true`/`false`).
    Bool,
    /// Debezium's `ZonedTimestamp`: ISO-8601 in UTC with a `Z`, exactly `digits` fraction
    /// digits (the column's precision, 6 when undeclared; none for precision 0), years beyond
    /// 9999 with a `+`, BC years astronomically with a `-` (44 BC is `-0043`); `infinity` and
    /// `-infinity` as they are.
    TimestampTz { digits: usize },
}

const BOOL: u32 = 16;
const INT8: u32 = 20;
const INT2: u32 = 21;
const INT4: u32 = 23;
const TEXT: u32 = 25;
const JSON: u32 = 114;
const BPCHAR: u32 = 1042;
const VARCHAR: u32 = 1043;
const TIMESTAMPTZ: u32 = 1184;
const UUID: u32 = 2950;
const JSONB: u32 = 3802;

impl Render {
    /// The rendering for a column of this type and type modifier, `None` when not supported.
    pub fn for_type(type_oid: u32, typmod: i32) -> Option<Self> {
        Some(match type_oid {
            TEXT | VARCHAR | BPCHAR | INT2 | INT4 | INT8 | UUID | JSON | JSONB => Self::Text,
            BOOL => Self::Bool,
            // timestamptz(p) has typmod p (0..=6); -1 when undeclared, which is 6.
            TIMESTAMPTZ => Self::TimestampTz {
                digits: usize::try_from(typmod).map_or(6, |p| p.min(6)),
            },
            _ => return None,
        })
    }

    /// The header text for a column's text, `None` when it is not what Postgres writes for the
    /// type (the replication session pins DateStyle ISO and TimeZone UTC).
    pub fn apply(self, text: &str) -> Option<Cow<'_, str>> {
        match self {
            Self::Text => Some(Cow::Borrowed(text)),
            Self::Bool => match text {
                "t" | "true" => Some(Cow::Borrowed("true")),
                "f" | "false" => Some(Cow::Borrowed("false")),
                _ => None,
            },
            Self::TimestampTz { digits } => zoned_timestamp(text, digits),
        }
    }
}

/// A type's name for a message (the common ones; others by OID).
pub fn type_name(oid: u32) -> Cow<'static, str> {
    Cow::Borrowed(match oid {
        17 => "bytea",
        700 => "real",
        701 => "double precision",
        1082 => "date",
        1083 => "time",
        1114 => "timestamp",
        1186 => "interval",
        1266 => "timetz",
        1700 => "numeric",
        _ => return Cow::Owned(format!("type OID {oid}")),
    })
}

/// `2024-01-02 03:04:05.12+00` (Postgres, ISO, UTC) → `2024-01-02T03:04:05.120000Z` (6 digits).
fn zoned_timestamp(text: &str, digits: usize) -> Option<Cow<'_, str>> {
    if text == "infinity" || text == "-infinity" {
        return Some(Cow::Borrowed(text));
    }
    let (body, bc) = match text.strip_suffix(" BC") {
        Some(b) => (b, true),
        None => (text, false),
    };
    let (date, time) = body.strip_suffix("+00")?.split_once(' ')?;
    let (year, month_day) = date.split_once('-')?;
    let md = month_day.as_bytes();
    let digit = |b: &u8| b.is_ascii_digit();
    if year.len() < 4 || !year.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if md.len() != 5 || md[2] != b'-' || !md[..2].iter().all(digit) || !md[3..].iter().all(digit) {
        return None;
    }
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let t = hms.as_bytes();
    let time_ok = t.len() == 8
        && t[2] == b':'
        && t[5] == b':'
        && [0, 1, 3, 4, 6, 7].iter().all(|&i| t[i].is_ascii_digit());
    if !time_ok || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let year: i64 = year.parse().ok()?;
    // Java's ISO_LOCAL_DATE: the proleptic year (1 BC is 0), four digits at least, a sign when
    // negative or beyond four digits.
    let year = if bc { 1 - year } else { year };
    let mut out = String::with_capacity(20 + digits.max(frac.len()));
    if year > 9999 {
        out.push('+');
    }
    if year < 0 {
        out.push_str(&format!("-{:04}", -year));
    } else {
        out.push_str(&format!("{year:04}"));
    }
    out.push('-');
    out.push_str(month_day);
    out.push('T');
    out.push_str(hms);
    if digits == 0 {
        // ISO_OFFSET_DATE_TIME: only the digits there are (a precision-0 column has none).
        if !frac.is_empty() {
            out.push('.');
            out.push_str(frac);
        }
    } else {
        out.push('.');
        let f = frac.as_bytes();
        out.extend((0..digits).map(|i| f.get(i).map_or('0', |&b| char::from(b))));
    }
    out.push('Z');
    Some(Cow::Owned(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(text: &str, typmod: i32) -> Option<String> {
        Render::for_type(TIMESTAMPTZ, typmod)?
            .apply(text)
            .map(Cow::into_owned)
    }

    #[test]
    fn timestamptz_as_debezium_writes_it() {
        // What Debezium 3.6.3 wrote for these values (a wider run than the golden set).
        for (text, typmod, want) in [
            ("2024-01-02 03:04:05+00", -1, "2024-01-02T03:04:05.000000Z"),
            (
                "2024-01-02 03:04:05.1+00",
                -1,
                "2024-01-02T03:04:05.100000Z",
            ),
            (
                "2024-01-02 03:04:05.123456+00",
                -1,
                "2024-01-02T03:04:05.123456Z",
            ),
            (
                "2024-01-02 03:04:05.000001+00",
                -1,
                "2024-01-02T03:04:05.000001Z",
            ),
            ("2024-01-02 03:04:05.123+00", 3, "2024-01-02T03:04:05.123Z"),
            ("2024-01-02 03:04:05.12+00", 3, "2024-01-02T03:04:05.120Z"),
            ("2024-01-02 03:04:05+00", 0, "2024-01-02T03:04:05Z"),
            (
                "1969-12-31 23:59:59.999999+00",
                -1,
                "1969-12-31T23:59:59.999999Z",
            ),
            ("0001-01-01 00:00:00+00", -1, "0001-01-01T00:00:00.000000Z"),
            (
                "9999-12-31 23:59:59.999999+00",
                -1,
                "9999-12-31T23:59:59.999999Z",
            ),
            ("10000-01-01 00:00:00+00", 3, "+10000-01-01T00:00:00.000Z"),
            ("0044-03-15 12:00:00+00 BC", 0, "-0043-03-15T12:00:00Z"),
            ("0001-06-01 00:00:00+00 BC", 0, "0000-06-01T00:00:00Z"),
            ("infinity", -1, "infinity"),
            ("-infinity", 3, "-infinity"),
        ] {
            assert_eq!(ts(text, typmod).as_deref(), Some(want), "{text} ({typmod})");
        }
        // Not what the pinned session writes: refused, never guessed.
        for bad in [
            "2024-01-02 03:04:05+02",
            "2024-01-02T03:04:05Z",
            "",
            "now",
            "24-01-02 03:04:05+00",
        ] {
            assert_eq!(ts(bad, -1), None, "{bad}");
        }
    }

    #[test]
    fn types() {
        assert_eq!(Render::for_type(INT4, -1), Some(Render::Text));
        assert_eq!(Render::for_type(VARCHAR, 44), Some(Render::Text));
        assert_eq!(
            Render::for_type(TIMESTAMPTZ, 9),
            Some(Render::TimestampTz { digits: 6 })
        );
        for oid in [17, 700, 701, 1082, 1114, 1700, 1009] {
            assert_eq!(Render::for_type(oid, -1), None, "{oid}");
        }
        assert_eq!(Render::Bool.apply("t").as_deref(), Some("true"));
        assert_eq!(Render::Bool.apply("false").as_deref(), Some("false"));
        assert_eq!(Render::Bool.apply("yes"), None);
        assert_eq!(type_name(1700), "numeric");
        assert_eq!(type_name(4242), "type OID 4242");
    }
}
