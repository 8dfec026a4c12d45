-- The rows behind tests/golden/debezium-additional/records.jsonl: 60 ordinary rows and 30 edge
-- cases of the placed columns, inserted into table.sql's outboxevent in this order, in these
-- transactions. Fixed values only (no random(), no clock). Ordinary ids:
-- 00000000-0000-4000-f000-000000000001 … 060; edge cases: …-f100-0000000000NN.
-- After a change: scripts/debezium-golden/generate.sh debezium-additional.
SET client_encoding = 'UTF8';
SET timezone = 'UTC';

-- Ordinary rows: every placed column set, two aggregate types, several events per aggregate.
BEGIN;
INSERT INTO outboxevent
SELECT ('00000000-0000-4000-f000-' || lpad(i::text, 12, '0'))::uuid,
       CASE WHEN i % 2 = 0 THEN 'order' ELSE 'customer' END,
       CASE WHEN i % 2 = 0 THEN 'order-' || (i % 7) ELSE 'cust-' || (i % 5) END,
       CASE WHEN i % 3 = 0 THEN 'Paid' ELSE 'Created' END,
       jsonb_build_object('seq', i, 'amount', round(i * 1.25, 2)),
       'tenant-' || (i % 4),
       (ARRAY['eu-west', 'us-east', 'ap-south'])[i % 3 + 1],
       'C' || (i % 10),
       i * 1000 - 30000,
       (i % 5 - 2)::smallint,
       i::bigint * 1000000007,
       i % 2 = 0,
       ('10000000-0000-4000-8000-' || lpad((i * 7)::text, 12, '0'))::uuid,
       timestamptz '2024-03-01 00:00:00+00' + i * interval '1 hour 1 minute 1.123456 second',
       timestamptz '2024-03-01 00:00:00+00' + i * interval '1 minute 0.5005 second',
       timestamptz '2024-03-01 00:00:00+00' + i * interval '1 second',
       jsonb_build_object('trace', 'tr-' || i, 'n', i),
       ('{"trace": "tr-' || i || '",  "n": ' || i || '}')::json
FROM generate_series(1, 60) AS i
ORDER BY i;
COMMIT;

-- Edge cases, one transaction.
BEGIN;
-- 01 every placed column NULL (headers without a value)
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
VALUES ('00000000-0000-4000-f100-000000000001', 'order', 'order-1', 'Created', '{"k": 1}');
-- 02 a NULL type (header eventType without a value) and a NULL aggregateid (a null key)
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, tenant_id)
VALUES ('00000000-0000-4000-f100-000000000002', 'order', NULL, NULL, '{"k": 2}', 'tenant-0');
-- 03 a NULL payload (a record with a null value) that still carries its headers
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, tenant_id, tenant_no, urgent)
VALUES ('00000000-0000-4000-f100-000000000003', 'customer', 'cust-1', 'Deleted', NULL, 'tenant-1', 7, true);
-- 04 text: unicode, an empty string (an empty header, not a missing one), quotes and a backslash;
-- 05 control characters (tab, newline, escape); 06 a long value; 07 padding of char(4)
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, tenant_id, region, code) VALUES
  ('00000000-0000-4000-f100-000000000004', 'customer', 'cust-2', 'Créé – ü', '{"k": 4}', 'Zoë Ünïcødé 😀👍🏽 日本語', '', 'a"\'),
  ('00000000-0000-4000-f100-000000000005', 'customer', 'cust-2', 'Created', '{"k": 5}', E'tab\there\nnewline\u001b[0m', ' ', ''),
  ('00000000-0000-4000-f100-000000000006', 'customer', 'cust-2', 'Created', '{"k": 6}', repeat('long-tenant-', 400), 'x', 'ab'),
  ('00000000-0000-4000-f100-000000000007', 'customer', 'cust-2', 'Created', '{"k": 7}', 'ü', 'ü', 'ü');
-- 08-11 integers at their bounds
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, tenant_no, priority, seq) VALUES
  ('00000000-0000-4000-f100-000000000008', 'order', 'order-2', 'Created', '{"k": 8}', -2147483648, -32768, -9223372036854775808),
  ('00000000-0000-4000-f100-000000000009', 'order', 'order-2', 'Created', '{"k": 9}', 2147483647, 32767, 9223372036854775807),
  ('00000000-0000-4000-f100-000000000010', 'order', 'order-2', 'Created', '{"k": 10}', 0, 0, 0),
  ('00000000-0000-4000-f100-000000000011', 'order', 'order-2', 'Created', '{"k": 11}', -1, -1, -1);
-- 12 booleans; 13 a uuid written in upper case (Postgres prints it in lower case); 14 the nil uuid
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, urgent, correlation_id) VALUES
  ('00000000-0000-4000-f100-000000000012', 'order', 'order-3', 'Created', '{"k": 12}', false, NULL),
  ('00000000-0000-4000-f100-000000000013', 'order', 'order-3', 'Created', '{"k": 13}', true, 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'),
  ('00000000-0000-4000-f100-000000000014', 'order', 'order-3', 'Created', '{"k": 14}', NULL, '00000000-0000-0000-0000-000000000000');
-- 15-27 timestamps, each in the three precisions: whole seconds, one fraction digit, trailing
-- zeros, a microsecond, before 1970, year 1, the last microsecond of 9999 (rounds to 10000 in
-- the coarser columns), beyond 9999, BC, infinity, -infinity, written with another offset,
-- rounding at the column's precision
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, occurred_at, occurred_ms, occurred_s)
SELECT ('00000000-0000-4000-f100-' || lpad((14 + n)::text, 12, '0'))::uuid, 'order', 'order-4', 'Created',
       jsonb_build_object('k', 14 + n), t::timestamptz, t::timestamptz, t::timestamptz
FROM unnest(ARRAY[
  '2024-01-02 03:04:05+00',
  '2024-01-02 03:04:05.1+00',
  '2024-01-02 03:04:05.120+00',
  '2024-01-02 03:04:05.000001+00',
  '1969-12-31 23:59:59.999999+00',
  '0001-01-01 00:00:00+00',
  '9999-12-31 23:59:59.999999+00',
  '10000-01-01 00:00:00+00',
  '0044-03-15 12:00:00.5+00 BC',
  'infinity',
  '-infinity',
  '2024-06-01 12:00:00.25+02:30',
  '2024-01-02 03:04:05.4995+00'
]) WITH ORDINALITY AS x(t, n)
ORDER BY n;
-- 28 jsonb normalised by Postgres and json as written (duplicate keys, odd spacing, escapes)
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, meta, meta_json) VALUES
  ('00000000-0000-4000-f100-000000000028', 'order', 'order-5', 'Created', '{"k": 28}',
   '{"b": 1,  "a": [1, 2.50, "x\ny"], "a": "last", "ü": "\u00fc"}', '{"b": 1,  "a": [1, 2.50, "x\ny"], "a": "last", "ü": "\u00fc"}'),
-- 29 JSON scalars in the JSON columns
  ('00000000-0000-4000-f100-000000000029', 'order', 'order-5', 'Created', '{"k": 29}', '"a string"', ' 42 ');
-- 30 a last ordinary event of order-1 after its edge cases
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload, tenant_id)
VALUES ('00000000-0000-4000-f100-000000000030', 'order', 'order-1', 'Paid', '{"k": 30}', 'tenant-1');
COMMIT;
