//! The bounds of what the relay parks and holds (`[parked] max_record_bytes`,
//! `max_open_bytes`, issue 40): the stored records are in the database, so a flood of poison
//! events or one huge one must not fill it. Past a bound the relay halts at the event: the slot
//! keeps it, nothing is dropped, and it goes on once the bound allows it again.

use crate::error::RelayError;
use crate::poison::record::ParkedRecord;

/// One session's bounds and the bytes its slot's open rows hold.
pub struct Bounds {
    max_record_bytes: u64,
    max_open_bytes: u64,
    /// Loaded at session start and every repair tick; grows with each row parked between.
    pub open_bytes: u64,
}

impl Bounds {
    pub fn of(cfg: &crate::config::parked::ParkedConfig) -> Self {
        Self {
            max_record_bytes: cfg.max_record_bytes,
            max_open_bytes: cfg.max_open_bytes,
            open_bytes: 0,
        }
    }

    /// `[parked] max_record_bytes`: the relay parks no larger record, so it reads none.
    pub fn max_record_bytes(&self) -> u64 {
        self.max_record_bytes
    }

    /// `[parked]` bounds: a record larger than `max_record_bytes`, or one that would take the
    /// open rows past `max_open_bytes`, halts the relay (the slot keeps the event) rather than
    /// fill the database or drop it.
    pub fn admit(&mut self, rec: &ParkedRecord) -> Result<(), RelayError> {
        let size = (rec.key.as_ref().map_or(0, Vec::len)
            + rec.payload.as_ref().map_or(0, Vec::len)
            + serde_json::to_string(&rec.headers).map_or(0, |h| h.len())) as u64;
        let halt = |class: &str, message: String| RelayError::Halted {
            event_id: rec.event_id.clone(),
            class: class.into(),
            message,
        };
        if size > self.max_record_bytes {
            return Err(halt(
                "parked_record_too_large",
                format!(
                    "the event's record is {size} bytes, over [parked] max_record_bytes = {}: it \
                     is not parked (nor dropped); the relay halts here and the slot keeps it. \
                     Raise parked.max_record_bytes (and max_open_bytes) to park it, or fix \
                     what makes the record this large",
                    self.max_record_bytes
                ),
            ));
        }
        if self.open_bytes + size > self.max_open_bytes {
            return Err(halt(
                "parked_store_full",
                format!(
                    "the open parked and held events of this slot hold {} bytes; this one \
                     ({size} bytes) would pass [parked] max_open_bytes = {}: the relay halts \
                     here (nothing dropped, the slot keeps it). Resolve parked events \
                     (`outboxd parked list`, then `retry`/`discard`) or raise parked.max_open_bytes",
                    self.open_bytes, self.max_open_bytes
                ),
            ));
        }
        self.open_bytes += size;
        Ok(())
    }
}
