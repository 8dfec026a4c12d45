//! The check before anything parked is published (a held event behind a resolved head, an
//! operator's retry): is this row one the relay wrote, unchanged?
//!
//! - With a key (`[parked] key`): the row's integrity tag decides ([`integrity`]). A valid tag
//!   proves the relay parked exactly this record here, so no outbox row is needed (tables whose
//!   rows are deleted right after insert have none). A wrong tag (`forged`) or, unless
//!   `accept_untagged`, a missing one (`untagged`) is refused whatever the outbox table says.
//! - Without a key, or for an untagged row under `accept_untagged`: the outbox row vouches
//!   ([`provenance`]), as before issue 40; a held event without its row stays `unverified`.
//!
//! [`integrity`]: super::integrity
//! [`provenance`]: super::provenance

use super::integrity::{Placement, Sealer, TagCheck};
use super::provenance::{Found, Provenance};
use super::store::Release;
use crate::error::RelayError;
use tokio_postgres::Client;

/// What the relay needs to vet releases: its keys, and what to do with untagged rows.
pub struct Vetting {
    pub sealer: Option<Sealer>,
    pub accept_untagged: bool,
}

/// Why a row is not published: (error class, the reason with the operator's fix).
pub type Refusal = (&'static str, String);

impl Vetting {
    pub fn of(cfg: &crate::config::parked::ParkedConfig) -> Self {
        Self {
            sealer: Sealer::from_config(cfg),
            accept_untagged: cfg.accept_untagged,
        }
    }

    /// `None`: release it; `Some`: it stays parked with the reason.
    pub async fn vet(
        &self,
        slot: &str,
        provenance: &mut Provenance,
        sql: &Client,
        r: &Release,
    ) -> Result<Option<Refusal>, RelayError> {
        if let Some(sealer) = &self.sealer {
            let at = Placement {
                slot,
                blocks_aggregate: r.blocks_aggregate,
                blocked_by: r.blocked_by.as_deref(),
            };
            match sealer.check(&at, &r.as_parked(), r.tag.as_deref()) {
                TagCheck::Valid => return Ok(None),
                TagCheck::Wrong => return Ok(Some(forged())),
                TagCheck::Missing if !self.accept_untagged => return Ok(Some(untagged())),
                TagCheck::Missing => {}
            }
        }
        Ok(match provenance.check(sql, r).await? {
            Found::Vouched => None,
            Found::Unverified => Some((
                "unverified",
                "its outbox row is gone (cleanup, or an application that deletes its outbox \
                 rows), so nothing shows this parked copy is what the application wrote: check it \
                 with `outboxd parked show`, then `outboxd parked retry` (you vouch for it) or \
                 `discard`. A relay with an integrity key ([parked] key) needs no outbox row \
                 for what it parks from then on"
                    .to_string(),
            )),
            Found::Differs(field) => Some((
                "tampered",
                format!(
                    "the parked copy's {field} differs from the event's row in the outbox table: \
                     someone with write access to outbox_parked changed or forged it; not \
                     published (find out who: outbox_parked_audit, the database's logs), then \
                     `outboxd parked discard` it, or `retry` with --payload"
                ),
            )),
        })
    }
}

fn forged() -> Refusal {
    (
        "forged",
        "its integrity tag does not match what is stored: the row was written or altered \
         outside the relay (through SQL by a role with write access to outbox_parked), or \
         sealed by a key this relay no longer has. Not published. Find out who \
         (outbox_parked_audit, the database's logs) and `outboxd parked discard` it; after a key \
         rotation, keep the old key as [parked] previous_key until its rows are resolved"
            .to_string(),
    )
}

fn untagged() -> Refusal {
    (
        "untagged",
        "it carries no integrity tag and this relay has a key ([parked] key): the relay did not \
         write it, or wrote it before the key was configured. Not published. A row parked \
         before the key: set [parked] accept_untagged = true until it is released \
         (docs/operations.md, \"Delete-after-insert outboxes\"); anything else: `outboxd parked \
         discard` it"
            .to_string(),
    )
}
