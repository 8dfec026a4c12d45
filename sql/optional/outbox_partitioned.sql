-- outboxd: a time-partitioned outbox — an ALTERNATIVE to sql/001_outbox.sql, not applied by
-- `outboxd init`. Run it instead of 001 on a new database (by hand or from your migration tool);
-- `outboxd init` afterwards creates outboxd's own tables and leaves this table and publication
-- as they are. See docs/operations.md, "Cleaning up the outbox table".
--
-- Why: `outboxd cleanup` then drops whole day partitions older than the cutoff instead of
-- deleting rows (no per-row WAL, no dead tuples, no vacuum debt on a hot table).
--
-- The price: a unique constraint on a partitioned table must contain the partition key. The
-- primary key becomes (event_id, created_at) and the per-aggregate uniqueness becomes
-- (aggregate_type, aggregate_id, aggregate_version, created_at): Postgres no longer rejects a
-- second row with the same aggregate version written at another time. The outbox writer
-- library (crates/outbox) still assigns versions under the aggregate's row lock; a writer that
-- relies on the constraint alone to detect a lost update should stay on the plain table.
--
-- Rows whose day has no partition land in outbox_default, so an insert never fails. Keep
-- partitions ahead with outbox_create_partitions(days) (cleanup calls it each run; or cron).

CREATE TABLE IF NOT EXISTS public.outbox (
    event_id          uuid        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    schema_version    int         NOT NULL DEFAULT 1,
    payload           jsonb       NOT NULL,
    headers           jsonb,
    created_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, created_at),
    UNIQUE (aggregate_type, aggregate_id, aggregate_version, created_at)
) PARTITION BY RANGE (created_at);

CREATE INDEX IF NOT EXISTS outbox_created_at_idx ON public.outbox (created_at);
CREATE TABLE IF NOT EXISTS public.outbox_default PARTITION OF public.outbox DEFAULT;

-- Creates the day partitions (UTC) from today to today + days that do not exist yet; returns
-- how many it created. A day whose rows already sit in outbox_default is skipped with a notice
-- (move them out first: that partition cannot be attached while the default holds its rows).
CREATE OR REPLACE FUNCTION public.outbox_create_partitions(days integer) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    d       date;
    name    text;
    created integer := 0;
BEGIN
    FOR i IN 0..days LOOP
        d := (now() AT TIME ZONE 'UTC')::date + i;
        name := 'outbox_p' || to_char(d, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(format('public.%I', name)) IS NOT NULL;
        BEGIN
            EXECUTE format(
                'CREATE TABLE public.%I PARTITION OF public.outbox FOR VALUES FROM (%L) TO (%L)',
                name, (d::timestamp AT TIME ZONE 'UTC'), ((d + 1)::timestamp AT TIME ZONE 'UTC'));
            created := created + 1;
        EXCEPTION WHEN check_violation THEN
            RAISE NOTICE 'outbox partition % not created: outbox_default holds rows of that day', name;
        END;
    END LOOP;
    RETURN created;
END
$$;

SELECT public.outbox_create_partitions(3);

-- publish_via_partition_root: changes of every partition, present and future, are published
-- as changes of public.outbox, which is the table outboxd reads (source.table).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_pub') THEN
        CREATE PUBLICATION outbox_pub FOR TABLE public.outbox
            WITH (publish = 'insert', publish_via_partition_root = true);
    END IF;
END
$$;
