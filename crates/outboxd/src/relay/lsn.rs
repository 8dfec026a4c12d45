//! LSNs as Postgres writes them (`16/B374D848`) read back, and its timestamps' epoch (writing
//! one: `crate::model::lsn::fmt_lsn`).

use crate::error::RelayError;

/// Postgres timestamps count from 2000-01-01; this many µs after the unix epoch.
pub const PG_EPOCH_US: i64 = 946_684_800_000_000;

/// `16/B374D848` → u64.
pub fn parse_lsn(s: &str) -> Result<u64, RelayError> {
    let bad = || RelayError::Postgres(format!("bad LSN {s:?}"));
    let (hi, lo) = s.split_once('/').ok_or_else(bad)?;
    let hi = u64::from_str_radix(hi, 16).map_err(|_| bad())?;
    let lo = u64::from_str_radix(lo, 16).map_err(|_| bad())?;
    Ok((hi << 32) | lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lsn::fmt_lsn;

    #[test]
    fn lsn_roundtrip() {
        assert_eq!(parse_lsn("16/B374D848").unwrap(), 0x16_B374_D848);
        assert_eq!(fmt_lsn(0x16_B374_D848), "16/B374D848");
        assert!(parse_lsn("nope").is_err());
    }
}
