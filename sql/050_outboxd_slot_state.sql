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
-- The outbox tables whose rows from before they joined the publication are published (or owed
-- nothing): a table that joins later has them republished once (crates/outboxd/src/slot/join.rs).
-- NULL until a session first records the tables published then.
ALTER TABLE public.outboxd_slot_state ADD COLUMN IF NOT EXISTS joined_tables oid[];
-- The partitions a relay read as their root's (a publication without publish_via_partition_root
-- streams rows under each partition's own oid), kept after one leaves (DETACH, DROP) until the
-- slot passed the position where it was first seen gone: a later session still reads the rows
-- it committed as a partition (crates/outboxd/src/slot/join/partitions.rs). A JSON array of
-- {"oid": …, "root": "schema.table", "left_at": "X/Y" or null}.
ALTER TABLE public.outboxd_slot_state ADD COLUMN IF NOT EXISTS partitions_seen jsonb;

-- Bounds (issue 27): the relay's role writes this row, so a leaked relay credential could claim
-- progress that never happened — a delivery mark or transaction id in the future empties a
-- slot-loss recovery and moves cleanup's bound; an acknowledged position ahead of the WAL
-- names WAL that does not exist. The guard refuses what cannot be true when it is written:
-- a delivery mark after now, a transaction id past the next one to be assigned (the
-- current snapshot's xmax), a position past the end of the WAL. Within those bounds the row
-- is the relay's word (docs/operations.md, "Roles and privileges", says what that leaves).
CREATE OR REPLACE FUNCTION public.outboxd_slot_state_guard() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wal_end pg_lsn := CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                           ELSE pg_current_wal_insert_lsn() END;
    next_xid xid8 := pg_snapshot_xmax(pg_current_snapshot());
BEGIN
    IF NEW.acked_lsn > wal_end THEN
        RAISE EXCEPTION 'outboxd_slot_state %: acked_lsn % is past the end of the WAL (%)',
            NEW.slot_name, NEW.acked_lsn, wal_end;
    END IF;
    IF NEW.delivery_mark > clock_timestamp() THEN
        RAISE EXCEPTION 'outboxd_slot_state %: delivery_mark % is in the future',
            NEW.slot_name, NEW.delivery_mark;
    END IF;
    IF NEW.delivered_xid > next_xid OR NEW.recovering_xid > next_xid THEN
        RAISE EXCEPTION 'outboxd_slot_state %: transaction id % or % has not been assigned yet',
            NEW.slot_name, NEW.delivered_xid, NEW.recovering_xid;
    END IF;
    IF NEW.recovering_since > clock_timestamp() THEN
        RAISE EXCEPTION 'outboxd_slot_state %: recovering_since % is in the future',
            NEW.slot_name, NEW.recovering_since;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS outboxd_slot_state_guard ON public.outboxd_slot_state;
CREATE TRIGGER outboxd_slot_state_guard BEFORE INSERT OR UPDATE ON public.outboxd_slot_state
    FOR EACH ROW EXECUTE FUNCTION public.outboxd_slot_state_guard();
