//! Poison events (R15–R17): failures retrying cannot fix, what the policy does with them, and the
//! durable `outbox_parked` table with the in-order release after an operator's repair.

pub(crate) mod bounds;
pub(crate) mod integrity;
pub(crate) mod policy;
pub(crate) mod provenance;
pub(crate) mod record;
pub(crate) mod store;
pub(crate) mod validate;
pub(crate) mod vet;
