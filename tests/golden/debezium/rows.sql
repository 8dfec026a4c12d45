-- The rows behind tests/golden/debezium/records.jsonl: 500 ordinary rows and 40 edge cases,
-- inserted into table.sql's outboxevent in this order, in these transactions. Everything is
-- fixed (ids, values; no random(), no clock), so the rows can be re-inserted identically.
-- Ordinary ids: 00000000-0000-4000-a000-000000000001 … 500; edge cases: …-b000-0000000000NN.
-- Written with standard_conforming_strings = on (the default): a backslash inside '…' is a
-- backslash, so '{"a": "x\ny"}' is JSON text with an escaped newline.
-- After a change: scripts/debezium-golden/generate.sh rewrites records.jsonl.
SET client_encoding = 'UTF8';

-- Ordinary rows, part 1: two aggregate types, several events per aggregate.
BEGIN;
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
SELECT ('00000000-0000-4000-a000-' || lpad(i::text, 12, '0'))::uuid,
       CASE WHEN i % 2 = 0 THEN 'order' ELSE 'customer' END,
       CASE WHEN i % 2 = 0 THEN 'order-' || (i % 25) ELSE 'cust-' || (i % 20) END,
       CASE WHEN i % 2 = 0 THEN (CASE WHEN i % 3 = 0 THEN 'OrderPaid' ELSE 'OrderCreated' END)
            ELSE 'CustomerUpdated' END,
       jsonb_build_object('seq', i, 'amount', round(i * 1.25, 2), 'currency', 'EUR',
                          'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (i % 17), 'qty', i % 5 + 1)),
                          'note', 'ordinary row ' || i, 'paid', i % 3 = 0)
FROM generate_series(1, 100) AS i
ORDER BY i;
COMMIT;

-- Edge cases, one transaction each: payloads.
-- 01 unicode (raw UTF-8: umlauts, emoji with a skin-tone modifier, CJK, RTL, a combining accent)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000001', 'order', 'order-unicode', 'OrderCreated',
  '{"name": "Zoë Ünïcødé", "emoji": "😀👍🏽", "cjk": "日本語", "rtl": "שלום", "combining": "é"}');
-- 02 escapes (quote, backslash, newline, tab, control characters, escaped slash)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000002', 'order', 'order-escapes', 'OrderCreated',
  '{"quote": "say \"hi\"", "backslash": "C:\\path\\to", "newline": "a\nb", "tab": "a\tb", "cr": "a\rb", "ctrl": "\u0001\u001f", "slash": "\/", "bs_ff": "\b\f"}');
-- 03 \u escapes of non-ASCII (jsonb stores the characters; a surrogate pair is one character)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000003', 'order', 'order-escapes', 'OrderUpdated',
  '{"esc": "\u00fc\u00e9 \ud83d\ude00 \u2028\u2029", "del": "\u007f", "json_in_string": "{\"a\": [1, 2]}"}');
-- 04 big integers (beyond i64 and u64)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000004', 'customer', 'cust-big', 'CustomerUpdated',
  '{"big": 123456789012345678901234567890123456789, "i64max": 9223372036854775807, "u64max_plus1": 18446744073709551616, "neg": -9223372036854775809}');
-- 05 floats (jsonb keeps numeric text: exponents expanded, trailing zeros kept)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000005', 'customer', 'cust-big', 'CustomerUpdated',
  '{"tenth": 0.1, "pi": 3.14159265358979323846264338327950288, "small": 1e-7, "huge": 1.5E+300, "neg_zero": -0.0, "trailing": 2.50, "one": 1.0, "e_upper": 1E+2, "tiny": 5e-324}');
-- 06 a JSON string as the whole payload
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000006', 'order', 'order-scalars', 'OrderNoted', '"just a string"');
-- 07 {}
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000007', 'order', 'order-scalars', 'OrderNoted', '{}');
-- 08 []
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000008', 'order', 'order-scalars', 'OrderNoted', '[]');
-- 09 the JSON literal null (not SQL NULL: a record whose value is the four bytes null)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000009', 'order', 'order-scalars', 'OrderNoted', 'null');
-- 10 a number, 11 a boolean, 12 a JSON string with unicode and an escape
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000010', 'order', 'order-scalars', 'OrderNoted', '42');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000011', 'order', 'order-scalars', 'OrderNoted', 'true');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000012', 'order', 'order-scalars', 'OrderNoted', '"Grüße 😀 \"quoted\""');
-- 13 duplicate keys and odd whitespace (jsonb keeps the last duplicate, orders keys, normalises spacing)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000013', 'customer', 'cust-shape', 'CustomerUpdated',
  '{ "zeta" :1,"b":  [ 1 ,2 ,{ } ], "a": 2, "a": 3, "": "" , "long_key_name": null }');
-- 14 deep nesting
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000014', 'customer', 'cust-shape', 'CustomerUpdated',
  '{"d": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[{"deep": true}]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}');
-- 15 a big payload (96 KB, stored TOASTed and compressed; pgoutput sends it whole)
INSERT INTO outboxevent
SELECT '00000000-0000-4000-b000-000000000015', 'customer', 'cust-shape', 'CustomerUpdated',
       jsonb_build_object('blob', string_agg(md5(g::text), '' ORDER BY g))
FROM generate_series(1, 3000) AS g;
-- 16 a NULL payload for an aggregate with ordinary events before and after it (Debezium: a
-- record with a null value, a tombstone)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000016', 'customer', 'cust-3', 'CustomerDeleted', NULL);

-- Ordinary rows, part 2, with aggregate-id edge cases inside the same transaction.
BEGIN;
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
SELECT ('00000000-0000-4000-a000-' || lpad(i::text, 12, '0'))::uuid,
       CASE WHEN i % 2 = 0 THEN 'order' ELSE 'customer' END,
       CASE WHEN i % 2 = 0 THEN 'order-' || (i % 25) ELSE 'cust-' || (i % 20) END,
       CASE WHEN i % 2 = 0 THEN (CASE WHEN i % 3 = 0 THEN 'OrderPaid' ELSE 'OrderCreated' END)
            ELSE 'CustomerUpdated' END,
       jsonb_build_object('seq', i, 'amount', round(i * 1.25, 2), 'currency', 'EUR',
                          'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (i % 17), 'qty', i % 5 + 1)),
                          'note', 'ordinary row ' || i, 'paid', i % 3 = 0)
FROM generate_series(101, 250) AS i
ORDER BY i;
-- 17 spaces; 18 leading and trailing spaces; 19 umlauts; 20 a single quote; 21 double quotes
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000017', 'order', 'order 42 with spaces', 'OrderCreated', '{"k": 17}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000018', 'order', '  leading and trailing  ', 'OrderCreated', '{"k": 18}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000019', 'customer', 'Müller-Lüdenscheidt ÄÖÜ äöü ß', 'CustomerUpdated', '{"k": 19, "name": "Müller"}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000020', 'customer', 'O''Brien', 'CustomerUpdated', '{"k": 20}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000021', 'customer', 'say "cheese"', 'CustomerUpdated', '{"k": 21}');
-- 22 a backslash; 23 a tab and a newline; 24 emoji
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000022', 'order', 'back\slash', 'OrderCreated', '{"k": 22}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000023', 'order', E'tab\there\nnewline', 'OrderCreated', '{"k": 23}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000024', 'order', '😀 emoji key', 'OrderCreated', '{"k": 24}');
-- 25 the same aggregate ids again (order per key), one with a unicode event type
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000025', 'order', 'order 42 with spaces', 'BestellungGeändert – ü', '{"k": 25}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000026', 'customer', 'Müller-Lüdenscheidt ÄÖÜ äöü ß', 'CustomerUpdated', '{"k": 26}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000027', 'customer', 'O''Brien', 'CustomerUpdated', '{"k": 27}');
COMMIT;

-- 28 a NULL payload whose key has umlauts (a tombstone for that aggregate)
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000028', 'customer', 'Müller-Lüdenscheidt ÄÖÜ äöü ß', 'CustomerDeleted', NULL);

-- Ordinary rows, part 3 (cust-3 has events after its NULL payload).
BEGIN;
INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload)
SELECT ('00000000-0000-4000-a000-' || lpad(i::text, 12, '0'))::uuid,
       CASE WHEN i % 2 = 0 THEN 'order' ELSE 'customer' END,
       CASE WHEN i % 2 = 0 THEN 'order-' || (i % 25) ELSE 'cust-' || (i % 20) END,
       CASE WHEN i % 2 = 0 THEN (CASE WHEN i % 3 = 0 THEN 'OrderPaid' ELSE 'OrderCreated' END)
            ELSE 'CustomerUpdated' END,
       jsonb_build_object('seq', i, 'amount', round(i * 1.25, 2), 'currency', 'EUR',
                          'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (i % 17), 'qty', i % 5 + 1)),
                          'note', 'ordinary row ' || i, 'paid', i % 3 = 0)
FROM generate_series(251, 500) AS i
ORDER BY i;
COMMIT;

-- Several edge cases in one multi-row INSERT.
-- 29 an empty aggregate id (an empty key, not a null one); 30 a long aggregate id;
-- 31 a payload of unicode keys; 32 numbers inside an array payload; 33 escaped control
-- characters in a payload key and value; 34 a last event for cust-3.
INSERT INTO outboxevent VALUES
  ('00000000-0000-4000-b000-000000000029', 'order', '', 'OrderCreated', '{"k": 29}'),
  ('00000000-0000-4000-b000-000000000030', 'order', repeat('long-aggregate-id-', 20), 'OrderCreated', '{"k": 30}'),
  ('00000000-0000-4000-b000-000000000031', 'customer', 'cust-unicode-keys', 'CustomerUpdated', '{"ключ": "значение", "键": "值", "ö": {"ä": ["ü"]}}'),
  ('00000000-0000-4000-b000-000000000032', 'customer', 'cust-big', 'CustomerUpdated', '[0, -1, 1.5, 1e3, 100000000000000000000000000000.000000000000000000001, -0.000001]'),
  ('00000000-0000-4000-b000-000000000033', 'customer', 'cust-shape', 'CustomerUpdated', '{"a\tb\u0002": "\u001b[31mred\u001b[0m"}'),
  ('00000000-0000-4000-b000-000000000034', 'customer', 'cust-3', 'CustomerCreated', '{"k": 34}');

-- NULL in columns the EventRouter (no overrides) needs no value of: the key comes from
-- aggregateid (a NULL is a record with a null key), and type is not used at all. A NULL
-- aggregatetype, the routing field, stops Debezium instead: tests/golden/debezium-stops/.
-- 35 an ordinary event of order-1; 36 a NULL aggregateid; 37 a NULL type; 38 a NULL
-- aggregateid and a NULL payload (a record with neither key nor value); 39 a NULL aggregateid
-- and a NULL type; 40 an ordinary event of order-1 after them.
BEGIN;
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000035', 'order', 'order-1', 'OrderCreated', '{"k": 35}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000036', 'order', NULL, 'OrderCreated', '{"k": 36}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000037', 'customer', 'cust-3', NULL, '{"k": 37}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000038', 'customer', NULL, 'CustomerDeleted', NULL);
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000039', 'order', NULL, NULL, '{"k": 39}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-b000-000000000040', 'order', 'order-1', 'OrderPaid', '{"k": 40}');
COMMIT;
