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
