//! Slot loss: the durable memory of the stream, detection at session start, and recovery of a
//! lost slot's gap from the outbox table (docs/reliability.md, "Slot loss").

pub(crate) mod fence;
pub(crate) mod gap;
pub(crate) mod guard;
pub(crate) mod join;
pub(crate) mod publication;
pub(crate) mod recovery;
pub(crate) mod state;
pub(crate) mod vouch;
