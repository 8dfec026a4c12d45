-- outboxd: parked (poison) events and the operator audit trail (R16, R28).
-- Created by `outboxd init` and, when missing, at relay start-up. NOT part of the publication.
--
-- A row is written and committed BEFORE the slot's confirmed LSN may pass the event, so a
-- parked event is never lost. States:
--   parked    : a deterministic failure (too large, schema-invalid, unroutable, rejected)
--   blocked   : a later event of the same aggregate held behind a parked one (ordering = "aggregate")
--   retry     : an operator asked to republish it (same event_id, possibly corrected payload)
--   delivered : republished and acknowledged by the broker            (terminal)
--   discarded : an operator discarded it, with a reason               (terminal)
-- Nothing is ever deleted by outboxd.

CREATE TABLE IF NOT EXISTS public.outbox_parked (
    id                bigserial   PRIMARY KEY,             -- release order = stream order
    slot              text        NOT NULL,                -- which relay parked it
    event_id          text        NOT NULL,
    aggregate_type    text,
    aggregate_id      text,
    aggregate_version bigint,
    event_type        text,
    topic             text,
    record_key        bytea,
    payload           bytea,                               -- the record value, byte for byte
    headers           jsonb,                               -- the Kafka headers, in order: [["name", "value"], ...]
    record_ts_ms      bigint,                              -- the record timestamp (created_at)
    commit_lsn        pg_lsn,
    state             text        NOT NULL DEFAULT 'parked'
                      CHECK (state IN ('parked', 'blocked', 'retry', 'delivered', 'discarded')),
    blocks_aggregate  boolean     NOT NULL DEFAULT false,  -- parked under ordering = "aggregate"
    blocked_by        text,                                -- event_id of the parked event ahead
    error_class       text        NOT NULL,
    error_message     text        NOT NULL,
    attempts          int         NOT NULL DEFAULT 1,
    first_seen        timestamptz NOT NULL DEFAULT now(),
    last_seen         timestamptz NOT NULL DEFAULT now(),
    resolved_at       timestamptz,
    UNIQUE (slot, event_id)
);

CREATE INDEX IF NOT EXISTS outbox_parked_open_idx
    ON public.outbox_parked (slot, aggregate_type, aggregate_id, id)
    WHERE state IN ('parked', 'blocked', 'retry');

CREATE TABLE IF NOT EXISTS public.outbox_parked_audit (
    id          bigserial   PRIMARY KEY,
    slot        text        NOT NULL,
    event_id    text        NOT NULL,
    action      text        NOT NULL CHECK (action IN ('retry', 'discard')),
    operator    text        NOT NULL,
    reason      text        NOT NULL,
    old_payload bytea,                                     -- the payload before a correction
    new_payload bytea,
    at          timestamptz NOT NULL DEFAULT now()
);

-- Added later (idempotent upgrades of existing installs; `outboxd init` and the relay apply them):
-- the audit row of the operator's current retry request. The relay releases a `retry` row only
-- when it names a `retry` audit row of the same event: a bare UPDATE of `state` publishes nothing.
ALTER TABLE public.outbox_parked ADD COLUMN IF NOT EXISTS retry_audit_id bigint;
-- The database role that made the change (`operator` is what the person typed).
ALTER TABLE public.outbox_parked_audit ADD COLUMN IF NOT EXISTS db_user text NOT NULL DEFAULT session_user;
