-- outboxd: what the active relay of each slot last reported, for `outboxd status`.
-- Written by the relay every few seconds; created by `outboxd init` and at relay start-up.
CREATE TABLE IF NOT EXISTS public.outboxd_status (
    slot                 text        PRIMARY KEY,
    instance             text        NOT NULL,   -- host:pid of the active relay
    updated_at           timestamptz NOT NULL DEFAULT now(),
    confirmed_lsn        text,
    pending_events       bigint,
    pending_bytes        bigint,
    oldest_pending_age_s float8,                  -- age of the oldest unacknowledged event
    heartbeat_delay_s    float8,                  -- source → relay delay of the last heartbeat
    last_heartbeat_at    timestamptz,
    errors               jsonb,                   -- error counts per class since the relay started
    halted               boolean     NOT NULL DEFAULT false,
    attempt              bigint,                  -- consecutive failed sessions (0 while healthy)
    last_error_class     text,                    -- class of the last transient failure
    last_error           text,
    next_attempt_at      timestamptz              -- when the failing relay tries again
);

-- Added later (idempotent upgrades; `outboxd init` and the relay apply them): the liveness
-- signal of the instance that holds the slot, written every second by that instance while its
-- walsender holds the slot. Standbys compare alive_at with now() (the server's clock) and fence
-- a holder that went silent (relay.takeover_after_ms; docs/reliability.md, "Fencing").
ALTER TABLE public.outboxd_status ADD COLUMN IF NOT EXISTS alive_at timestamptz;            -- last beat
ALTER TABLE public.outboxd_status ADD COLUMN IF NOT EXISTS holder_pid integer;              -- its walsender's PID (pg_replication_slots.active_pid)
ALTER TABLE public.outboxd_status ADD COLUMN IF NOT EXISTS holder_instance text;            -- host:pid of the holder
ALTER TABLE public.outboxd_status ADD COLUMN IF NOT EXISTS holder_since timestamptz;        -- when its session took the slot
