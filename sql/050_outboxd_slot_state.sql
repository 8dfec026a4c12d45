-- outboxd: the relay's durable memory of its replication stream, one row per slot, in the
-- SOURCE database (so a restored or promoted server holds exactly what its WAL holds).
-- Created by `outboxd init` and, when missing, by `outboxd run`. Written by the relay every
-- source.state_interval_ms; read by `outboxd status` and `outboxd recover`.
-- See docs/reliability.md ("Slot loss").

CREATE TABLE IF NOT EXISTS public.outboxd_slot_state (
    slot_name            text        PRIMARY KEY,
    system_identifier    text        NOT NULL,            -- IDENTIFY_SYSTEM systemid: a new cluster has a new one
    timeline             bigint      NOT NULL,            -- grows at every promotion / point-in-time restore
    acked_lsn            pg_lsn      NOT NULL,            -- everything committed before it is on the broker
    delivery_mark        timestamptz,                     -- commit time of the newest fully acknowledged transaction with events
    delivered_xid        xid8,                            -- every transaction with a smaller id finished before acked_lsn: delivered (the exact gap bound)
    recovering_since     timestamptz,                     -- set while a recovery runs (a killed relay recovers again)
    recovering_xid       xid8,                            -- the gap of that recovery: rows of transactions at or above this id
    recovery_reason      text,
    recoveries           bigint      NOT NULL DEFAULT 0,
    last_recovery_at     timestamptz,
    last_recovery_events bigint,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now()
);

-- Upgrade from a table written before delivered_xid existed (outboxd init, or run as the owner).
ALTER TABLE public.outboxd_slot_state ADD COLUMN IF NOT EXISTS delivered_xid xid8;
ALTER TABLE public.outboxd_slot_state ADD COLUMN IF NOT EXISTS recovering_xid xid8;
