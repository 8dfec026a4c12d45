-- outboxd: shadow-mode results (R35), in the SOURCE database. Created by `outboxd init` and,
-- when missing, by a relay with shadow.enabled. Written by the relay's comparator once a second;
-- read by `outboxd shadow report`. See docs/operations.md, "Shadow mode".

-- Events per outcome and event type since shadowing began (matched, mismatched,
-- missing_legacy, missing_outbox).
CREATE TABLE IF NOT EXISTS public.outboxd_shadow_counts (
    slot        text        NOT NULL,
    event_type  text        NOT NULL,
    result      text        NOT NULL,
    events      bigint      NOT NULL DEFAULT 0,
    first_at    timestamptz NOT NULL DEFAULT now(),
    last_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (slot, event_type, result)
);

-- Each event that did not match (a bounded number per relay process): which, and which fields.
CREATE TABLE IF NOT EXISTS public.outboxd_shadow_diffs (
    id          bigserial   PRIMARY KEY,
    slot        text        NOT NULL,
    event_id    text        NOT NULL,
    event_type  text        NOT NULL,
    result      text        NOT NULL,
    fields      text[],
    detected_at timestamptz NOT NULL DEFAULT now()
);
