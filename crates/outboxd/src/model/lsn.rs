//! LSNs written as Postgres writes them (`16/B374D848`): what the relay logs and confirms, the
//! status row and `outboxd status` show. Reading one back (`parse_lsn`, a `RelayError` when it
//! is not one): `crate::relay::lsn`.

/// Formats an LSN like Postgres does.
pub fn fmt_lsn(l: u64) -> String {
    format!("{:X}/{:X}", l >> 32, l & 0xffff_ffff)
}
