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
-- The relay's integrity tag (issue 40): HMAC-SHA256 under the relay's `[parked] key`, which the
-- database never sees, over the record and its placement (poison/integrity.rs). A row without
-- a valid tag is one the relay did not write, and is never released (docs/operations.md,
-- "Delete-after-insert outboxes"). NULL: parked by a relay without a key.
ALTER TABLE public.outbox_parked ADD COLUMN IF NOT EXISTS integrity_tag bytea;
-- The guard looks up an event's audit rows for every change it authorises: with a bulk repair
-- of thousands of events (outboxd parked retry|discard --all) a scan each would be quadratic.
CREATE INDEX IF NOT EXISTS outbox_parked_audit_event_idx ON public.outbox_parked_audit (slot, event_id);
-- Issue 55: releases read a batch of rows at a time in stream order, each an index probe
-- whatever the size of the store: the rows that may go out (blocked, or retry), by id, and the
-- parked or retrying heads that hold an aggregate. Delivered and discarded rows are in neither.
CREATE INDEX IF NOT EXISTS outbox_parked_release_idx
    ON public.outbox_parked (slot, id) WHERE state IN ('blocked', 'retry');
CREATE INDEX IF NOT EXISTS outbox_parked_heads_idx
    ON public.outbox_parked (slot, aggregate_type, aggregate_id, id) WHERE state IN ('parked', 'retry');
-- The database role that made the change (`operator` is what the person typed).
ALTER TABLE public.outbox_parked_audit ADD COLUMN IF NOT EXISTS db_user text NOT NULL DEFAULT session_user;
-- Issue 56: the oid of the outbox table the row came from (for a partition's row, the root it
-- belonged to when it was written), when the relay knew it. A table's holds and heads follow it
-- through renames: rows hold each other by oid, and by the `source_table` header (the name the
-- table had when the row was parked) when either row has no oid (parked by an earlier version)
-- or the other's table is gone (dropped). NULL: parked by an earlier version.
ALTER TABLE public.outbox_parked ADD COLUMN IF NOT EXISTS source_relid oid;

-- Trust boundaries (issue 27; docs/operations.md, "Roles and privileges"). The relay role may
-- park and release, the repair role may ask for a retry or a discard, and neither may change
-- what was parked or put a row into a state outboxd would not. Both guards run with a search
-- path of pg_catalog alone and name their tables by schema, so no role that can create objects
-- in some schema can shadow a function or operator they call. The table's owner (and a
-- superuser) can still disable them: `outboxd check` reports a guard that is missing or off.

-- The transaction that wrote an audit row: a change it authorises must be made by that same
-- transaction, so an audit row is used once and only by the person who wrote it.
ALTER TABLE public.outbox_parked_audit ADD COLUMN IF NOT EXISTS txid xid8;

-- The audit is append-only, and records who and when itself.
CREATE OR REPLACE FUNCTION public.outbox_parked_audit_guard() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        RAISE EXCEPTION 'outbox_parked_audit is append-only: % refused', TG_OP;
    END IF;
    NEW.db_user := session_user;
    NEW.at := now();
    NEW.txid := pg_current_xact_id();
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS outbox_parked_audit_guard ON public.outbox_parked_audit;
CREATE TRIGGER outbox_parked_audit_guard BEFORE INSERT OR UPDATE OR DELETE ON public.outbox_parked_audit
    FOR EACH ROW EXECUTE FUNCTION public.outbox_parked_audit_guard();

-- Issue 53: the ledger of every event ever parked or held, per slot, written by the guard
-- alone (it runs as the tables' owner; no role of sql/roles.sql may write or delete here). A
-- row of outbox_parked that was deleted (by a role with DELETE) cannot come back: the guard
-- refuses an INSERT of an event the ledger knows unless its row is still there (a replayed
-- park, which ON CONFLICT turns into an attempt). So a delivered or discarded event is never
-- re-inserted as `blocked` and released again, tag or no tag.
CREATE TABLE IF NOT EXISTS public.outbox_parked_ledger (
    slot      text        NOT NULL,
    event_id  text        NOT NULL,
    parked_id bigint      NOT NULL,                        -- outbox_parked.id it was given
    db_user   text        NOT NULL DEFAULT session_user,
    at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (slot, event_id)
);
REVOKE ALL ON public.outbox_parked_ledger FROM PUBLIC;
-- Upgrades: what is parked now was parked (rows deleted before this version are unknown).
INSERT INTO public.outbox_parked_ledger (slot, event_id, parked_id)
    SELECT slot, event_id, id FROM public.outbox_parked ON CONFLICT DO NOTHING;

-- What was parked never changes; the state moves only as the relay and the repair commands
-- move it:
--   (new)              -> parked | blocked   blocked only behind an open head of its aggregate
--                                           in its table (below)
--   parked             -> retry              with a 'retry' audit row written in this transaction
--   parked|retry|blocked -> discarded        with a 'discard' audit row written in this transaction
--   retry              -> delivered          (the relay, after the broker's acknowledgement)
--   blocked            -> delivered          only when nothing earlier of its aggregate is open
--   retry|blocked      -> parked             (the relay: the release failed again)
--   delivered, discarded: final. Nothing ever goes (back) into blocked.
-- An aggregate is held per outbox table (issue 30): a row's table is the `source_table` header
-- of its record (a relay with several tables writes it; a one-table relay writes none). Rows
-- of the same aggregate hold each other when their tables are the same or either has none, so
-- a one-table relay's rows hold as before, and rows parked before a relay listed several
-- tables (no header: which table is unknown) hold their aggregate in every table.
-- Issue 56: a row's table is its oid (`source_relid`) first. Two rows that both have one are
-- of the same table when the oids are equal; when they differ, only if one of those tables is
-- gone (dropped) and the names say so (a table recreated under its name holds as before). A
-- row without one (parked by an earlier version) is compared by name as above. So a table
-- renamed or moved keeps its holds, and two tables that swap names never swap them.
--
-- Issue 53: a new row's `id` (its place in release order) is the sequence's, taken here
-- whatever the INSERT supplied (the relay role has no INSERT grant on the column either): no
-- negative id, no id ahead of its head. The guard runs as the tables' owner (SECURITY
-- DEFINER) to write the ledger above, which the relay role cannot.
CREATE OR REPLACE FUNCTION public.outbox_parked_guard() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    -- NEW's table (the record is frozen below, so an UPDATE's is OLD's).
    row_table text := jsonb_path_query_first(NEW.headers, 'strict $[*] ? (@[0] == "source_table")', '{}', true) ->> 1;
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.state NOT IN ('parked', 'blocked') THEN
            RAISE EXCEPTION 'outbox_parked: event % cannot be parked as %: a new row is parked or blocked',
                NEW.event_id, NEW.state;
        END IF;
        IF NEW.state = 'blocked' AND NOT (NEW.blocks_aggregate AND EXISTS (
                SELECT 1 FROM public.outbox_parked h
                WHERE h.slot = NEW.slot AND h.event_id = NEW.blocked_by AND h.blocks_aggregate
                  AND h.state IN ('parked', 'blocked', 'retry')
                  AND h.aggregate_type = NEW.aggregate_type AND h.aggregate_id = NEW.aggregate_id
                  AND (CASE WHEN h.source_relid IS NULL OR NEW.source_relid IS NULL THEN (row_table IS NULL OR coalesce(jsonb_path_query_first(h.headers, 'strict $[*] ? (@[0] == "source_table")', '{}', true) ->> 1, row_table) = row_table) ELSE h.source_relid = NEW.source_relid OR ((NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = h.source_relid) OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = NEW.source_relid)) AND (row_table IS NULL OR coalesce(jsonb_path_query_first(h.headers, 'strict $[*] ? (@[0] == "source_table")', '{}', true) ->> 1, row_table) = row_table)) END))) THEN
            RAISE EXCEPTION 'outbox_parked: event % is held behind %, which is no open parked event of its aggregate in its table',
                NEW.event_id, NEW.blocked_by;
        END IF;
        NEW.id := nextval('public.outbox_parked_id_seq');
        IF NOT EXISTS (SELECT 1 FROM public.outbox_parked p
                       WHERE p.slot = NEW.slot AND p.event_id = NEW.event_id) THEN
            INSERT INTO public.outbox_parked_ledger (slot, event_id, parked_id)
                VALUES (NEW.slot, NEW.event_id, NEW.id) ON CONFLICT DO NOTHING;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'outbox_parked: event % was parked for slot % before and its row is gone (deleted): an event is parked once, and never released again',
                    NEW.event_id, NEW.slot;
            END IF;
        END IF;
        NEW.attempts := 1;
        NEW.first_seen := now();
        NEW.last_seen := now();
        NEW.resolved_at := NULL;
        NEW.retry_audit_id := NULL;
        RETURN NEW;
    END IF;
    IF ROW(NEW.id, NEW.slot, NEW.event_id, NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_version,
           NEW.event_type, NEW.topic, NEW.record_key, NEW.payload, NEW.headers, NEW.record_ts_ms,
           NEW.commit_lsn, NEW.blocks_aggregate, NEW.blocked_by, NEW.first_seen, NEW.source_relid)
       IS DISTINCT FROM
       ROW(OLD.id, OLD.slot, OLD.event_id, OLD.aggregate_type, OLD.aggregate_id, OLD.aggregate_version,
           OLD.event_type, OLD.topic, OLD.record_key, OLD.payload, OLD.headers, OLD.record_ts_ms,
           OLD.commit_lsn, OLD.blocks_aggregate, OLD.blocked_by, OLD.first_seen, OLD.source_relid) THEN
        RAISE EXCEPTION 'outbox_parked: event %: what was parked cannot change (a corrected payload goes in the retry''s audit row: outboxd parked retry --payload)',
            OLD.event_id;
    END IF;
    IF NEW.attempts < OLD.attempts THEN
        RAISE EXCEPTION 'outbox_parked: event %: attempts only go up', OLD.event_id;
    END IF;
    IF NEW.state = OLD.state THEN
        -- The same event seen again (a replay after a restart): attempts and last_seen only.
        IF ROW(NEW.retry_audit_id, NEW.resolved_at, NEW.error_class, NEW.error_message)
           IS DISTINCT FROM ROW(OLD.retry_audit_id, OLD.resolved_at, OLD.error_class, OLD.error_message) THEN
            RAISE EXCEPTION 'outbox_parked: event % (%): only attempts and last_seen change without a new state',
                OLD.event_id, OLD.state;
        END IF;
        RETURN NEW;
    END IF;
    IF OLD.state = 'parked' AND NEW.state = 'retry' THEN
        IF NOT EXISTS (SELECT 1 FROM public.outbox_parked_audit a
                WHERE a.id = NEW.retry_audit_id AND a.slot = OLD.slot AND a.event_id = OLD.event_id
                  AND a.action = 'retry' AND a.txid = pg_current_xact_id()) THEN
            RAISE EXCEPTION 'outbox_parked: event %: a retry needs its own audit row, written in the same transaction (outboxd parked retry)',
                OLD.event_id;
        END IF;
        NEW.resolved_at := NULL;
    ELSIF OLD.state IN ('parked', 'retry', 'blocked') AND NEW.state = 'discarded' THEN
        IF NOT EXISTS (SELECT 1 FROM public.outbox_parked_audit a
                WHERE a.slot = OLD.slot AND a.event_id = OLD.event_id AND a.action = 'discard'
                  AND a.txid = pg_current_xact_id()) THEN
            RAISE EXCEPTION 'outbox_parked: event %: a discard needs its own audit row, written in the same transaction (outboxd parked discard)',
                OLD.event_id;
        END IF;
        NEW.resolved_at := now();
        NEW.retry_audit_id := NULL;
    ELSIF OLD.state = 'retry' AND NEW.state = 'delivered' THEN
        IF NEW.retry_audit_id IS DISTINCT FROM OLD.retry_audit_id OR OLD.retry_audit_id IS NULL THEN
            RAISE EXCEPTION 'outbox_parked: event %: delivered by the retry its audit row asked for, or not at all',
                OLD.event_id;
        END IF;
        NEW.resolved_at := now();
    ELSIF OLD.state = 'blocked' AND NEW.state = 'delivered' THEN
        IF EXISTS (SELECT 1 FROM public.outbox_parked h
                WHERE h.slot = OLD.slot AND h.id < OLD.id AND h.blocks_aggregate
                  AND h.state IN ('parked', 'blocked', 'retry')
                  AND h.aggregate_type = OLD.aggregate_type AND h.aggregate_id = OLD.aggregate_id
                  AND (CASE WHEN h.source_relid IS NULL OR OLD.source_relid IS NULL THEN (row_table IS NULL OR coalesce(jsonb_path_query_first(h.headers, 'strict $[*] ? (@[0] == "source_table")', '{}', true) ->> 1, row_table) = row_table) ELSE h.source_relid = OLD.source_relid OR ((NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = h.source_relid) OR NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.oid = OLD.source_relid)) AND (row_table IS NULL OR coalesce(jsonb_path_query_first(h.headers, 'strict $[*] ? (@[0] == "source_table")', '{}', true) ->> 1, row_table) = row_table)) END)) THEN
            RAISE EXCEPTION 'outbox_parked: event % is still held behind an open event of its aggregate',
                OLD.event_id;
        END IF;
        NEW.resolved_at := now();
        NEW.retry_audit_id := NULL;
    ELSIF OLD.state IN ('retry', 'blocked') AND NEW.state = 'parked' THEN
        NEW.retry_audit_id := NULL;
        NEW.resolved_at := NULL;
    ELSE
        RAISE EXCEPTION 'outbox_parked: event %: % -> % is not a change outboxd makes',
            OLD.event_id, OLD.state, NEW.state;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS outbox_parked_guard ON public.outbox_parked;
CREATE TRIGGER outbox_parked_guard BEFORE INSERT OR UPDATE ON public.outbox_parked
    FOR EACH ROW EXECUTE FUNCTION public.outbox_parked_guard();
