-- Debezium's default outbox table plus one column of each type outboxd places in headers
-- (eventrouter.properties places them all). Used by scripts/debezium-golden/generate.sh and
-- tests/tests/debezium_compat.rs.
CREATE TABLE public.outboxevent (
    id uuid PRIMARY KEY,
    aggregatetype text,
    aggregateid text,
    type text,
    payload jsonb,
    tenant_id text,
    region varchar(16),
    code char(4),
    tenant_no integer,
    priority smallint,
    seq bigint,
    urgent boolean,
    correlation_id uuid,
    occurred_at timestamptz,
    occurred_ms timestamptz(3),
    occurred_s timestamptz(0),
    meta jsonb,
    meta_json json
);
