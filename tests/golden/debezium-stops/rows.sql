-- A row Debezium's EventRouter (no overrides) cannot deliver: a NULL aggregatetype, the field
-- it routes by (route.by.field). Debezium stops on it (stopped.txt) and delivers nothing after
-- it; outboxd parks it and goes on. The ordinary row after it is one Debezium never reaches.
SET client_encoding = 'UTF8';
INSERT INTO outboxevent VALUES ('00000000-0000-4000-d000-000000000001', NULL, 'order-1', 'OrderCreated', '{"k": 1}');
INSERT INTO outboxevent VALUES ('00000000-0000-4000-d000-000000000002', 'order', 'order-1', 'OrderCreated', '{"k": 2}');
