-- outboxd: outbox_emit(), so any language or ORM can append an event inside ITS OWN transaction.
-- Requires sql/001_outbox.sql. Idempotent (CREATE OR REPLACE). See docs/producer.md.
--
-- Call it in the same transaction as the business change (R1, R10):
--   BEGIN;
--     UPDATE orders SET status = 'paid', version = 4 WHERE id = $1 AND version = 3;  -- expect 1 row
--     SELECT outbox_emit('order', $1, 4, 'OrderPaid', $2::jsonb, 1, $3::uuid);
--   COMMIT;
-- Called outside an explicit transaction it commits on its own: that is the "write the event
-- without the business change" bug the outbox exists to prevent. Don't.
--
-- Errors (SQLSTATE) callers can branch on:
--   23505 unique_violation       CONSTRAINT outbox_pkey: event_id already recorded (the command
--                                 was committed before: a retry after a lost COMMIT ack, R4);
--                                 any other constraint: (aggregate, version) conflict (R11).
--   54000 program_limit_exceeded payload over p_max_payload_bytes.
--   22023 invalid_parameter_value a field breaks the record contract.
-- Any error aborts the caller's transaction, so the business change is not committed either.

-- A UUIDv7 (time-ordered) built from gen_random_uuid() (core since Postgres 13): the 48-bit
-- Unix-millisecond timestamp replaces the first 6 bytes and the version nibble becomes 7.
-- search_path pinned like every function outboxd ships: callers run it with their own path,
-- and a schema on it that others may write (public before Postgres 15) must not shadow a call.
CREATE OR REPLACE FUNCTION public.outbox_uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

CREATE OR REPLACE FUNCTION public.outbox_emit(
    p_aggregate_type    text,
    p_aggregate_id      text,
    p_aggregate_version bigint,
    p_event_type        text,
    p_payload           jsonb,
    p_schema_version    int   DEFAULT 1,
    -- Pass the id generated when the command was first handled, so a retry reuses it (R4).
    -- NULL generates a UUIDv7 here, which protects nothing across retries of a lost commit.
    p_event_id          uuid  DEFAULT NULL,
    -- Extra Kafka headers: a JSON object of strings, e.g. {"traceparent": "00-..."}.
    p_headers           jsonb DEFAULT NULL,
    p_max_payload_bytes int   DEFAULT 524288
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_event_id   uuid := coalesce(p_event_id, public.outbox_uuid_v7());
    v_size       int;
    v_bad        text;
    v_constraint text;
BEGIN
    IF p_aggregate_type IS NULL OR p_aggregate_type !~ '^[A-Za-z0-9._-]+$'
       OR length(p_aggregate_type) > 236 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('outbox_emit: aggregate_type %L must match [A-Za-z0-9._-]{1,236} '
                             '(it becomes the topic outbox.event.<aggregate_type>)', p_aggregate_type);
    END IF;
    IF p_aggregate_id IS NULL OR p_aggregate_id = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'outbox_emit: aggregate_id must not be empty';
    END IF;
    IF p_aggregate_version IS NULL OR p_aggregate_version < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('outbox_emit: aggregate_version %s must be >= 1', p_aggregate_version);
    END IF;
    IF p_event_type IS NULL OR p_event_type = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'outbox_emit: event_type must not be empty';
    END IF;
    IF p_schema_version IS NULL OR p_schema_version < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('outbox_emit: schema_version %s must be >= 1 (R7)', p_schema_version);
    END IF;
    IF p_payload IS NULL OR jsonb_typeof(p_payload) = 'null' THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'outbox_emit: payload must not be null';
    END IF;
    v_size := octet_length(p_payload::text);
    IF v_size > p_max_payload_bytes THEN
        RAISE EXCEPTION USING ERRCODE = '54000',
            MESSAGE = format('outbox_emit: payload of %s is %s bytes, over the limit of %s',
                             p_event_type, v_size, p_max_payload_bytes),
            HINT = 'store large bodies as an immutable reference or a bounded snapshot (R12)';
    END IF;
    IF p_headers IS NOT NULL THEN
        IF jsonb_typeof(p_headers) <> 'object' THEN
            RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'outbox_emit: headers must be a JSON object';
        END IF;
        SELECT key INTO v_bad FROM jsonb_each(p_headers)
         WHERE jsonb_typeof(value) <> 'string'
            OR key = '' OR key IN ('event_id', 'event_type', 'aggregate_type', 'aggregate_id',
                                  'aggregate_version', 'schema_version')
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('outbox_emit: header %L is reserved, empty or not a string', v_bad);
        END IF;
    END IF;

    BEGIN
        INSERT INTO public.outbox (event_id, aggregate_type, aggregate_id, aggregate_version,
                                   event_type, schema_version, payload, headers)
        VALUES (v_event_id, p_aggregate_type, p_aggregate_id, p_aggregate_version,
                p_event_type, p_schema_version, p_payload, p_headers);
    EXCEPTION WHEN unique_violation THEN
        GET STACKED DIAGNOSTICS v_constraint = CONSTRAINT_NAME;
        IF v_constraint LIKE '%\_pkey' THEN
            RAISE EXCEPTION USING ERRCODE = '23505', CONSTRAINT = v_constraint,
                MESSAGE = format('outbox_emit: event_id %s already recorded (command committed before)',
                                 v_event_id);
        END IF;
        RAISE EXCEPTION USING ERRCODE = '23505', CONSTRAINT = v_constraint,
            MESSAGE = format('outbox_emit: version conflict: %s/%s version %s already emitted',
                             p_aggregate_type, p_aggregate_id, p_aggregate_version),
            HINT = 'reload the aggregate and retry the command';
    END;
    RETURN v_event_id;
END
$$;
