-- outboxd: tells the replication stream when a publication changes (docs/reliability.md,
-- "Publication changes").
-- pgoutput decodes a change only if its table is in the publication *at that point of the WAL*:
-- rows inserted while the outbox table was out of the publication (ALTER PUBLICATION … DROP
-- TABLE, then ADD TABLE, as a migration tool may do) are never decoded, and a publication
-- dropped and created again cannot be decoded past at all. This event trigger writes a
-- transactional logical message ('outboxd.publication') into the WAL with every publication
-- DDL, so the stream itself says where the publication changed; the relay then republishes
-- what the stream may have skipped, from the table, exactly.
-- Created by `outboxd init` when it runs as a superuser (CREATE EVENT TRIGGER needs one);
-- otherwise apply this file as one. Idempotent. Database-wide: one for every relay.

-- It runs as whoever issues the publication DDL, often a superuser: it searches only pg_catalog,
-- so no role that can create objects in a schema on that session's search_path can put its own
-- function or operator in the place of the ones it calls.
CREATE OR REPLACE FUNCTION public.outboxd_publication_changed() RETURNS event_trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    changed jsonb;
    joined jsonb := '[]'::jsonb;
    left_tables jsonb := '[]'::jsonb;
BEGIN
    IF TG_EVENT = 'sql_drop' THEN
        SELECT jsonb_agg(jsonb_build_array(object_type, object_identity)) INTO changed
        FROM pg_event_trigger_dropped_objects() WHERE object_type LIKE 'publication%';
        -- Each table taken out of a publication, by oid and the name it has here: the relay
        -- owes a pattern's table the rows it misses while out, as a join, and streams every
        -- other table on (issue 56, F5) instead of replacing the slot.
        SELECT COALESCE(jsonb_agg(jsonb_build_array(d.address_args[1], c.oid::bigint,
                                                    n.nspname::text, c.relname::text)), '[]')
        INTO left_tables
        FROM pg_event_trigger_dropped_objects() d
        JOIN pg_namespace n ON n.nspname = d.address_names[1]
        JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = d.address_names[2]
        WHERE d.object_type = 'publication relation';
    ELSE
        SELECT jsonb_agg(jsonb_build_array(object_type, object_identity)) INTO changed
        FROM pg_event_trigger_ddl_commands() WHERE object_type LIKE 'publication%';
        -- Each table added, by oid and the name it has at this point of the WAL: a table
        -- renamed into a pattern and out again before the relay looked at the catalog is
        -- still taken in by what the stream says here (issue 56).
        SELECT COALESCE(jsonb_agg(jsonb_build_array(p.pubname::text, pr.prrelid::bigint,
                                                    n.nspname::text, c.relname::text)), '[]')
        INTO joined
        FROM pg_event_trigger_ddl_commands() d
        JOIN pg_publication_rel pr ON pr.oid = d.objid
        JOIN pg_publication p ON p.oid = pr.prpubid
        JOIN pg_class c ON c.oid = pr.prrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE d.object_type = 'publication relation';
    END IF;
    -- 'event' tells a table added (ddl_command_end, 'publication relation' objects only) from
    -- one dropped (sql_drop): an addition skips nothing of what was streamed before it.
    PERFORM pg_logical_emit_message(true, 'outboxd.publication',
        jsonb_build_object('tag', TG_TAG, 'event', TG_EVENT,
                           'objects', COALESCE(changed, '[]'::jsonb),
                           'joined', joined, 'left', left_tables)::text);
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = 'outboxd_publication_ddl') THEN
        CREATE EVENT TRIGGER outboxd_publication_ddl ON ddl_command_end
            WHEN TAG IN ('CREATE PUBLICATION', 'ALTER PUBLICATION')
            EXECUTE FUNCTION public.outboxd_publication_changed();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = 'outboxd_publication_drop') THEN
        CREATE EVENT TRIGGER outboxd_publication_drop ON sql_drop
            WHEN TAG IN ('DROP PUBLICATION', 'ALTER PUBLICATION')
            EXECUTE FUNCTION public.outboxd_publication_changed();
    END IF;
END
$$;
