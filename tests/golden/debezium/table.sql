-- Debezium's documented default outbox table (EventRouter defaults: id, aggregatetype,
-- aggregateid, type, payload). Used by scripts/debezium-golden/generate.sh and
-- tests/tests/debezium_compat.rs.
CREATE TABLE public.outboxevent (
    id uuid PRIMARY KEY,
    aggregatetype text,
    aggregateid text,
    type text,
    payload jsonb
);
