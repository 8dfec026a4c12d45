-- outboxd: the audit of replays (`outboxd replay`, R38): every executed replay is a row, with
-- who asked (the database role), why, what (the selection), who approved it, when it ran, how
-- far it got and how it ended. Created by `outboxd init` and, when missing, by `outboxd replay`.
-- Nothing is ever deleted by outboxd. See docs/operations.md ("Replay after a consumer bug").
--
-- States:
--   requested   : waits for an approval by another database role (`replay approve`)
--   approved    : may run (approved, or small and harmless enough to run without approval)
--   running     : a run is under way (or was killed: `replay run` continues at the cursor)
--   interrupted : a run stopped on SIGTERM/SIGINT after its acknowledged events were recorded
--   failed      : a run stopped on an error (`error`); `replay run` continues at the cursor
--   finished    : every selected event was republished and acknowledged   (terminal)

CREATE TABLE IF NOT EXISTS public.outboxd_replay (
    id              bigserial   PRIMARY KEY,
    slot            text        NOT NULL,                -- the relay (config) it replays for
    state           text        NOT NULL
                    CHECK (state IN ('requested', 'approved', 'running', 'interrupted', 'failed', 'finished')),
    selection       jsonb       NOT NULL,                -- {"by": "ids", "ids": [...]} or {"by": "range", "since": ..., "until": ..., ...}
    events          bigint      NOT NULL,                -- events selected when it was requested
    summary         jsonb       NOT NULL,                -- [[event_type, topic, count], ...] when requested
    side_effects    text[]      NOT NULL DEFAULT '{}',   -- selected event types marked as having side effects
    needs_approval  boolean     NOT NULL,
    reason          text        NOT NULL CHECK (reason <> ''),
    operator        text,                                -- what --operator / $USER says (informational)
    rate            integer     NOT NULL CHECK (rate > 0),  -- events/s, the cap it was approved with
    requested_by    text        NOT NULL DEFAULT current_user,
    requested_login text        NOT NULL DEFAULT session_user,
    requested_at    timestamptz NOT NULL DEFAULT now(),
    approved_by     text,
    approved_login  text,
    approved_at     timestamptz,
    run_by          text,                                -- role of the latest run
    runs            integer     NOT NULL DEFAULT 0,
    started_at      timestamptz,                         -- first run
    finished_at     timestamptz,
    cursor_ts       text,                                -- unused since issue 26 (an older outboxd's cursor)
    cursor_id       text,                                -- the replay order's keys (JSON) of the last event before which the broker acknowledged everything
    sent            bigint      NOT NULL DEFAULT 0,      -- events acknowledged up to the cursor, over all runs
    error           text,
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- Two people, enforced by the database too: the requesting role is whoever inserted the row,
-- an approval records whoever approves, and the requesting role (or login) cannot approve.
-- A replay that needs an approval cannot leave `requested` without one.
CREATE OR REPLACE FUNCTION public.outboxd_replay_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.requested_by := current_user;
        NEW.requested_login := session_user;
        NEW.requested_at := now();
        NEW.approved_by := NULL;
        NEW.approved_login := NULL;
        NEW.approved_at := NULL;
        IF NEW.needs_approval AND NEW.state <> 'requested' THEN
            RAISE EXCEPTION 'outboxd replay: this replay needs an approval (outboxd replay request)';
        END IF;
        RETURN NEW;
    END IF;
    -- What was requested (and approved) stays what it was.
    NEW.requested_by := OLD.requested_by;
    NEW.requested_login := OLD.requested_login;
    NEW.requested_at := OLD.requested_at;
    NEW.slot := OLD.slot;
    NEW.selection := OLD.selection;
    NEW.events := OLD.events;
    NEW.summary := OLD.summary;
    NEW.side_effects := OLD.side_effects;
    NEW.needs_approval := OLD.needs_approval;
    NEW.reason := OLD.reason;
    NEW.operator := OLD.operator;
    NEW.rate := OLD.rate;
    IF NEW.approved_by IS DISTINCT FROM OLD.approved_by THEN
        IF OLD.approved_by IS NOT NULL THEN
            RAISE EXCEPTION 'outboxd replay %: already approved by %', OLD.id, OLD.approved_by;
        END IF;
        IF current_user = OLD.requested_by OR session_user = OLD.requested_login THEN
            RAISE EXCEPTION 'outboxd replay %: requested by role %, so another role must approve it', OLD.id, OLD.requested_by;
        END IF;
        NEW.approved_by := current_user;
        NEW.approved_login := session_user;
        NEW.approved_at := now();
    ELSE
        NEW.approved_login := OLD.approved_login;
        NEW.approved_at := OLD.approved_at;
    END IF;
    IF OLD.state = 'requested' AND NEW.state <> 'requested' AND NEW.approved_by IS NULL THEN
        RAISE EXCEPTION 'outboxd replay %: needs an approval by another role first', OLD.id;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS outboxd_replay_guard ON public.outboxd_replay;
CREATE TRIGGER outboxd_replay_guard BEFORE INSERT OR UPDATE ON public.outboxd_replay
    FOR EACH ROW EXECUTE FUNCTION public.outboxd_replay_guard();
