//! One replication session, in data-flow order: source → decoder → router → producer → ack
//! tracker → confirmer.

pub(crate) mod ack;
pub(crate) mod ack_wait;
pub(crate) mod address;
pub(crate) mod blockers;
pub(crate) mod gulp;
pub(crate) mod held;
pub(crate) mod in_flight;
pub(crate) mod kafka;
pub(crate) mod lsn;
pub(crate) mod outboxes;
pub(crate) mod park;
pub(crate) mod park_routes;
pub(crate) mod pgoutput;
pub(crate) mod releasing;
pub(crate) mod route;
pub(crate) mod slot_host;
pub(crate) mod source;
pub(crate) mod stages;
pub(crate) mod status_feed;
pub(crate) mod table_reader;
pub(crate) mod tap;
pub(crate) mod tls;
