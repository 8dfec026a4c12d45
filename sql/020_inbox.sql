-- outboxd consumer side: the inbox tables, created in the CONSUMER's own database (not the
-- producer's). Applied by `outboxd_inbox::migrate` (idempotent) or by your migration tool.
-- One database may serve several handlers: every table is keyed by `consumer` (the handler name).
-- See docs/inbox.md.

-- One row per event a handler has dealt with, written in the same transaction as the handler's
-- business change (R18): if that transaction fails, this row is gone too (R32), and a redelivery
-- is processed once. A redelivery of a recorded event returns `result` without running the
-- handler again (R20). Retention: see docs/inbox.md (R21, R39) - never shorter than the
-- broker's redelivery window and the producer's disaster-recovery window.
CREATE TABLE IF NOT EXISTS processed_event (
    consumer          text        NOT NULL,
    event_id          uuid        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    -- applied: the handler ran; stale: older than the state already held, not applied;
    -- superseded: held during a gap, then covered by a source-of-truth resync.
    outcome           text        NOT NULL CHECK (outcome IN ('applied', 'stale', 'superseded')),
    result            jsonb,
    source_topic      text,
    source_partition  int,
    source_offset     bigint,
    processed_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id),
    -- Same aggregate and version under another event_id is a conflict, never a duplicate.
    UNIQUE (consumer, aggregate_type, aggregate_id, aggregate_version)
);
CREATE INDEX IF NOT EXISTS processed_event_processed_at_idx ON processed_event (processed_at);

-- Last version applied per aggregate, for handlers with per-aggregate ordering (R22). The row is
-- also the per-aggregate lock that serialises concurrent consumers of one aggregate.
CREATE TABLE IF NOT EXISTS inbox_aggregate_version (
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint      NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);

-- Events that arrived ahead of a missing version, held durably so the Kafka offset can move on.
-- Released in version order when the gap fills; after the hold window an alert fires and the
-- handler's hook fetches the source of truth.
CREATE TABLE IF NOT EXISTS inbox_held_event (
    consumer          text        NOT NULL,
    event_id          uuid        NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    schema_version    int         NOT NULL,
    payload           bytea       NOT NULL,
    headers           jsonb       NOT NULL,
    committed_at      timestamptz,
    source_topic      text,
    source_partition  int,
    source_offset     bigint,
    held_at           timestamptz NOT NULL DEFAULT now(),
    alerted_at        timestamptz,
    PRIMARY KEY (consumer, event_id),
    UNIQUE (consumer, aggregate_type, aggregate_id, aggregate_version)
);

-- Side-effect ledger (R19): one row per external call a handler intends, keyed by an operation
-- key derived from event_id + effect name. `pending` + started_at = an attempt began and its
-- outcome was never recorded: to anyone else that is `unknown`, never "try again blindly".
CREATE TABLE IF NOT EXISTS inbox_side_effect (
    operation_key text        PRIMARY KEY,
    consumer      text        NOT NULL,
    event_id      uuid        NOT NULL,
    effect        text        NOT NULL,
    state         text        NOT NULL CHECK (state IN ('pending', 'done', 'unknown')),
    request       jsonb,
    result        jsonb,
    attempts      int         NOT NULL DEFAULT 0,
    started_at    timestamptz,
    last_error    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS inbox_side_effect_open_idx
    ON inbox_side_effect (consumer, state) WHERE state <> 'done';
