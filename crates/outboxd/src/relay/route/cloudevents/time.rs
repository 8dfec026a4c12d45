//! The `time` attribute: Postgres `timestamptz`/`timestamp` text as RFC 3339, written into a
//! buffer on the stack (once per event, no allocation; issue 55).

/// Room for a date, a time, a fraction of up to 38 digits and an offset (Postgres writes at
/// most 6 fraction digits).
const CAP: usize = 64;

/// One event's `time`, RFC 3339.
pub struct Rfc3339 {
    buf: [u8; CAP],
    len: usize,
}

impl Rfc3339 {
    /// Postgres `timestamptz`/`timestamp` text (ISO DateStyle) as RFC 3339: `T` between date
    /// and time, `Z` for UTC, `+hh:mm` offsets, the fraction kept as written. `None` for
    /// `infinity`, BC dates and anything else not RFC 3339-representable (then no `time`).
    pub fn parse(s: &str) -> Option<Self> {
        let b = s.as_bytes();
        let digits =
            |r: std::ops::Range<usize>| b.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
        if b.len() < 19
            || !digits(0..4)
            || b[4] != b'-'
            || !digits(5..7)
            || b[7] != b'-'
            || !digits(8..10)
            || b[10] != b' '
            || !digits(11..13)
            || b[13] != b':'
            || !digits(14..16)
            || b[16] != b':'
            || !digits(17..19)
        {
            return None;
        }
        let mut out = Self {
            buf: [0; CAP],
            len: 0,
        };
        out.push(&b[..10])?;
        out.push(b"T")?;
        out.push(&b[11..19])?;
        let mut rest = &b[19..];
        if let Some(frac) = rest.strip_prefix(b".") {
            let n = frac.iter().take_while(|c| c.is_ascii_digit()).count();
            if n == 0 {
                return None;
            }
            out.push(b".")?;
            out.push(&frac[..n])?;
            rest = &frac[n..];
        }
        match rest {
            // `timestamp` without time zone: taken as UTC, as the record timestamp is.
            b"" | b"+00" | b"+00:00" | b"-00" => out.push(b"Z")?,
            [sign @ (b'+' | b'-'), o @ ..]
                if !o.is_empty() && o.iter().all(|c| c.is_ascii_digit() || *c == b':') =>
            {
                let mut d = [0u8; 4];
                let mut n = 0;
                for c in o.iter().filter(|c| c.is_ascii_digit()) {
                    // Seconds in an offset (historic zones) have no RFC 3339 form.
                    *d.get_mut(n)? = *c;
                    n += 1;
                }
                out.push(&[*sign])?;
                match n {
                    2 => {
                        out.push(&d[..2])?;
                        out.push(b":00")?;
                    }
                    4 => {
                        out.push(&d[..2])?;
                        out.push(b":")?;
                        out.push(&d[2..])?;
                    }
                    _ => return None,
                }
            }
            _ => return None,
        }
        Some(out)
    }

    fn push(&mut self, s: &[u8]) -> Option<()> {
        let end = self.len + s.len();
        self.buf.get_mut(self.len..end)?.copy_from_slice(s);
        self.len = end;
        Some(())
    }

    pub fn as_str(&self) -> &str {
        // Only ASCII from a `&str` and ASCII literals were copied in.
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or_default()
    }
}

/// [`Rfc3339::parse`] as a `String` (tests, messages).
#[cfg(test)]
pub fn rfc3339(s: &str) -> Option<String> {
    Rfc3339::parse(s).map(|t| t.as_str().to_string())
}
