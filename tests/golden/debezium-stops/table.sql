-- Debezium's documented default outbox table, as in tests/golden/debezium/table.sql.
CREATE TABLE public.outboxevent (
    id uuid PRIMARY KEY,
    aggregatetype text,
    aggregateid text,
    type text,
    payload jsonb
);
