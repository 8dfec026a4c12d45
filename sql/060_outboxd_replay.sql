-- outboxd: the audit of replays (`outboxd replay`, R38, R41): every executed replay is a row,
-- with who asked (the database role), why, what (the selection), who approved it, when it ran,
-- how far it got and how it ended. Created (and upgraded) by `outboxd init`, run by the admin
-- role, which owns these tables; `outboxd replay` never creates them. Nothing is ever deleted by
-- outboxd. See docs/operations.md ("Replay after a consumer bug").
--
-- States:
--   requested   : waits for an approval by another database role (`replay approve`)
--   approved    : may run (approved, or small and harmless enough to run without approval)
--   running     : a run is under way (or was killed: `replay run` continues at the cursor)
--   interrupted : a run stopped on SIGTERM/SIGINT after its acknowledged events were recorded
--   failed      : a run stopped on an error (`error`); `replay run` continues at the cursor
--   finished    : every selected event was republished and acknowledged   (terminal)
--
-- The guard below trusts nothing a member of outboxd_replay writes but the selection, the reason,
-- the operator name, the rate and the counts (which `replay run` counts again before it runs):
-- whether a replay needs an approval comes from the admin's policy table, who requested and who
-- approved from the connection's roles, and every column of a run from the state transition.
-- The guard functions search only pg_catalog (and name these tables by schema): a role that can
-- create objects in a schema on someone's search path cannot put its own `=` in their place.

CREATE TABLE IF NOT EXISTS public.outboxd_replay (
    id              bigserial   PRIMARY KEY,
    slot            text        NOT NULL,                -- the relay (config) it replays for
    state           text        NOT NULL
                    CHECK (state IN ('requested', 'approved', 'running', 'interrupted', 'failed', 'finished')),
    selection       jsonb       NOT NULL,                -- {"by": "ids", "ids": [...]} or {"by": "range", "since": ..., "until": ..., ...}
    events          bigint      NOT NULL,                -- events selected when it was requested
    summary         jsonb       NOT NULL,                -- [[event_type, topic, count], ...] when requested
    side_effects    text[]      NOT NULL DEFAULT '{}',   -- selected event types the policy marks as having side effects
    needs_approval  boolean     NOT NULL,                -- computed by the guard from the policy
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

-- The approval policy, per relay (slot): written by `outboxd init` from the admin's `[replay]`
-- (replay.approval_over, replay.side_effect_types); read by the guard and by `outboxd replay`.
-- Only its owner (the admin) writes it; everyone may read it (the guard runs as the operator).
CREATE TABLE IF NOT EXISTS public.outboxd_replay_policy (
    slot              text        PRIMARY KEY,
    approval_over     bigint      NOT NULL CHECK (approval_over >= 0),  -- more events than this need an approval
    side_effect_types text[]      NOT NULL,              -- event types whose replay needs an approval
    updated_by        text        NOT NULL DEFAULT current_user,
    updated_at        timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT ON public.outboxd_replay_policy TO PUBLIC;

-- Two people, enforced by the database: the requesting role is whoever inserted the row, an
-- approval records whoever approves, the requesting role (or login) cannot approve, and whether
-- an approval is needed is computed here from the policy, never taken from the row.
CREATE OR REPLACE FUNCTION public.outboxd_replay_guard() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    over     bigint;
    effects  text[];
    counted  bigint;
    types    text[];
    ids      bigint := 0;
    since    timestamptz;
    until    timestamptz;
BEGIN
    IF TG_OP = 'INSERT' THEN
        SELECT p.approval_over, p.side_effect_types INTO over, effects
        FROM public.outboxd_replay_policy AS p WHERE p.slot = NEW.slot;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'outboxd replay: no replay policy for slot % (outboxd_replay_policy): run `outboxd init` as the admin role', NEW.slot;
        END IF;
        IF jsonb_typeof(NEW.summary) IS DISTINCT FROM 'array' OR EXISTS (
            SELECT 1 FROM jsonb_array_elements(NEW.summary) AS g
            WHERE jsonb_typeof(g) <> 'array' OR jsonb_typeof(g -> 2) IS DISTINCT FROM 'number'
               OR (g ->> 2)::numeric < 0 OR (g ->> 2)::numeric <> trunc((g ->> 2)::numeric))
        THEN
            RAISE EXCEPTION 'outboxd replay: summary must be [[event_type, topic, count], ...] with whole counts >= 0';
        END IF;
        SELECT coalesce(sum((g ->> 2)::bigint), 0), coalesce(array_agg(DISTINCT g ->> 0), '{}')
        INTO counted, types FROM jsonb_array_elements(NEW.summary) AS g;
        IF NEW.events IS NULL OR NEW.events < 0 OR counted <> NEW.events THEN
            RAISE EXCEPTION 'outboxd replay: events (%) is not the sum of the summary''s counts (%)', NEW.events, counted;
        END IF;
        CASE NEW.selection ->> 'by'
        WHEN 'ids' THEN
            IF jsonb_typeof(NEW.selection -> 'ids') IS DISTINCT FROM 'array' THEN
                RAISE EXCEPTION 'outboxd replay: an ids selection needs "ids": [...]';
            END IF;
            ids := jsonb_array_length(NEW.selection -> 'ids');
        WHEN 'range' THEN
            since := (NEW.selection ->> 'since')::timestamptz;
            until := least((NEW.selection ->> 'until')::timestamptz, now());
            IF since IS NULL OR until IS NULL OR NOT isfinite(since) OR NOT (since < until) THEN
                RAISE EXCEPTION 'outboxd replay: a range needs since < until, until capped at now() (% .. %)', NEW.selection ->> 'since', NEW.selection ->> 'until';
            END IF;
            -- What runs is what is stored: both ends in one spelling (RFC 3339, UTC), and no
            -- end in the future, where rows written after the approval would land.
            NEW.selection := jsonb_set(jsonb_set(NEW.selection,
                '{since}', to_jsonb(to_char(since AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))),
                '{until}', to_jsonb(to_char(until AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')));
        ELSE
            RAISE EXCEPTION 'outboxd replay: selection->>''by'' must be ''ids'' or ''range'', not %', coalesce(NEW.selection ->> 'by', 'NULL');
        END CASE;
        NEW.side_effects := ARRAY(SELECT t FROM unnest(types) AS t WHERE t = ANY (effects) ORDER BY t);
        NEW.needs_approval := greatest(NEW.events, ids) > over OR cardinality(NEW.side_effects) > 0;
        IF NEW.state IS NULL OR NEW.state NOT IN ('requested', 'approved') THEN
            RAISE EXCEPTION 'outboxd replay: a new replay is requested or approved, not %', coalesce(NEW.state, 'NULL');
        END IF;
        IF NEW.state = 'approved' AND NEW.needs_approval THEN
            RAISE EXCEPTION 'outboxd replay: this replay needs an approval (% events, approval over %; side effects: %): insert it as requested (outboxd replay request) and have another role approve it',
                greatest(NEW.events, ids), over, NEW.side_effects;
        END IF;
        NEW.requested_by := current_user;
        NEW.requested_login := session_user;
        NEW.requested_at := now();
        NEW.approved_by := NULL;
        NEW.approved_login := NULL;
        NEW.approved_at := NULL;
        NEW.run_by := NULL;
        NEW.runs := 0;
        NEW.started_at := NULL;
        NEW.finished_at := NULL;
        NEW.cursor_ts := NULL;
        NEW.cursor_id := NULL;
        NEW.sent := 0;
        NEW.error := NULL;
        NEW.updated_at := now();
        RETURN NEW;
    END IF;

    -- What was requested (and approved) stays what it was.
    NEW.id := OLD.id;
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
    NEW.updated_at := now();

    IF OLD.state = 'finished' THEN
        RAISE EXCEPTION 'outboxd replay %: finished (terminal), not % again: replaying it again is a new request', OLD.id, NEW.state;
    END IF;

    -- An approval: requested → approved, by another role.
    IF NEW.approved_by IS DISTINCT FROM OLD.approved_by THEN
        IF OLD.approved_by IS NOT NULL THEN
            RAISE EXCEPTION 'outboxd replay %: already approved by %', OLD.id, OLD.approved_by;
        END IF;
        IF current_user = OLD.requested_by OR session_user = OLD.requested_login THEN
            RAISE EXCEPTION 'outboxd replay %: requested by role %, so another role must approve it', OLD.id, OLD.requested_by;
        END IF;
        IF OLD.state <> 'requested' OR NEW.state <> 'approved' THEN
            RAISE EXCEPTION 'outboxd replay %: an approval takes it from requested to approved, not % to %', OLD.id, OLD.state, NEW.state;
        END IF;
        NEW.approved_by := current_user;
        NEW.approved_login := session_user;
        NEW.approved_at := now();
    ELSE
        NEW.approved_login := OLD.approved_login;
        NEW.approved_at := OLD.approved_at;
    END IF;
    IF OLD.state = 'requested' THEN
        IF NEW.state <> 'requested' AND NEW.approved_by IS NULL THEN
            RAISE EXCEPTION 'outboxd replay %: needs an approval by another role first (% to %)', OLD.id, OLD.state, NEW.state;
        END IF;
        IF NEW.state <> 'approved' THEN
            RAISE EXCEPTION 'outboxd replay %: % to % is not allowed', OLD.id, OLD.state, NEW.state;
        END IF;
    END IF;

    -- The runner's columns follow from the transition, never from the row.
    IF OLD.state = 'requested' THEN
        NEW.run_by := OLD.run_by;
        NEW.runs := OLD.runs;
        NEW.started_at := OLD.started_at;
        NEW.finished_at := OLD.finished_at;
        NEW.cursor_ts := OLD.cursor_ts;
        NEW.cursor_id := OLD.cursor_id;
        NEW.sent := OLD.sent;
        NEW.error := OLD.error;
        RETURN NEW;
    END IF;
    IF NEW.state = 'running' AND (OLD.state <> 'running' OR NEW.runs IS DISTINCT FROM OLD.runs) THEN
        -- A run starts (after a stop, or after a killed run, which left `running`): it says so
        -- by changing `runs`, which the guard counts itself.
        IF OLD.state NOT IN ('approved', 'running', 'interrupted', 'failed') THEN
            RAISE EXCEPTION 'outboxd replay %: % to % is not allowed', OLD.id, OLD.state, NEW.state;
        END IF;
        IF OLD.needs_approval AND OLD.approved_by IS NULL THEN
            RAISE EXCEPTION 'outboxd replay %: needs an approval by another role first', OLD.id;
        END IF;
        NEW.run_by := current_user;
        NEW.runs := OLD.runs + 1;
        NEW.started_at := coalesce(OLD.started_at, now());
        NEW.finished_at := NULL;
        NEW.cursor_ts := OLD.cursor_ts;
        NEW.cursor_id := OLD.cursor_id;
        NEW.sent := OLD.sent;
        NEW.error := NULL;
        RETURN NEW;
    END IF;
    IF OLD.state <> 'running' OR NEW.state NOT IN ('running', 'interrupted', 'failed', 'finished') THEN
        RAISE EXCEPTION 'outboxd replay %: % to % is not allowed', OLD.id, OLD.state, NEW.state;
    END IF;
    -- Progress of the run (running → running), or its end.
    IF NEW.sent IS NULL OR NEW.sent < OLD.sent THEN
        RAISE EXCEPTION 'outboxd replay %: sent cannot go back (% to %)', OLD.id, OLD.sent, NEW.sent;
    END IF;
    IF NEW.cursor_id IS NULL AND OLD.cursor_id IS NOT NULL THEN
        RAISE EXCEPTION 'outboxd replay %: the cursor cannot go back to the start', OLD.id;
    END IF;
    IF NEW.cursor_ts IS NOT NULL THEN
        NEW.cursor_ts := OLD.cursor_ts;
    END IF;
    NEW.run_by := OLD.run_by;
    NEW.runs := OLD.runs;
    NEW.started_at := OLD.started_at;
    NEW.finished_at := CASE WHEN NEW.state = 'finished' THEN now() END;
    IF NEW.state <> 'failed' THEN
        NEW.error := NULL;
    END IF;
    RETURN NEW;
END $$;
COMMENT ON FUNCTION public.outboxd_replay_guard() IS 'outboxd replay guard v2 (policy table, computed runner columns)';

DROP TRIGGER IF EXISTS outboxd_replay_guard ON public.outboxd_replay;
CREATE TRIGGER outboxd_replay_guard BEFORE INSERT OR UPDATE ON public.outboxd_replay
    FOR EACH ROW EXECUTE FUNCTION public.outboxd_replay_guard();
