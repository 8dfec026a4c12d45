"""Registry-framed Avro payloads for tests/tests/bytea_payloads.rs, made and checked by a client
no one here wrote: confluent-kafka's AvroSerializer / AvroDeserializer (PyPI
confluent-kafka[avro,schemaregistry]==2.16.1) against its MockSchemaRegistryClient.

The mock registry lives in this process only, so one process does both halves:
  1. serializes N events and prints one line per event, `<event_id> <hex of the framed bytes>`,
     then `READY` (the Rust test inserts them into the bytea outbox and runs the relay);
  2. waits for a line `CHECK <bootstrap> <topic>` on stdin, reads the topic from the beginning
     and decodes every record whose `event_id` it made with AvroDeserializer: prints one JSON
     line {"decoded": n, "missing": [...], "mismatched": [...], "not_framed": [...]}.

Usage: avro_outbox.py N  (exit 3: confluent_kafka is not installed, the test says so and skips)
"""

import json
import sys
import time
import uuid

try:
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.schema_registry import SchemaRegistryClient  # noqa: F401
    from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
    from confluent_kafka.schema_registry._sync.mock_schema_registry_client import (
        MockSchemaRegistryClient,
    )
    from confluent_kafka.serialization import MessageField, SerializationContext
except ImportError as e:  # the tool is missing: say so, the test skips naming it
    print(f"MISSING confluent-kafka[avro,schemaregistry]==2.16.1: {e}", flush=True)
    sys.exit(3)

SCHEMA = json.dumps(
    {
        "type": "record",
        "name": "OrderPlaced",
        "namespace": "com.example.orders",
        "fields": [
            {"name": "order_id", "type": "string"},
            {"name": "amount_cents", "type": "long"},
            {"name": "note", "type": "string"},
            {"name": "blob", "type": "bytes"},
        ],
    }
)


def event(i):
    # Bytes that are not UTF-8 (NUL, 0xff) inside the Avro body too.
    return {
        "order_id": f"o-{i}",
        "amount_cents": i * 101 - 5000,
        "note": "é\u0000ü" * (i % 7),
        "blob": bytes([0, 0xFF, i % 256]) * (i % 5),
    }


def main():
    n = int(sys.argv[1])
    registry = MockSchemaRegistryClient({"url": "mock://bytea-test"})
    ser = AvroSerializer(registry, SCHEMA)
    made = {}
    for i in range(n):
        ctx = SerializationContext("outbox.event.order", MessageField.VALUE)
        framed = ser(event(i), ctx)
        eid = str(uuid.uuid4())
        made[eid] = i
        print(eid, framed.hex(), flush=True)
    print("READY", flush=True)

    line = sys.stdin.readline().split()
    if len(line) != 3 or line[0] != "CHECK":
        print(f"expected `CHECK <bootstrap> <topic>`, got {line}", file=sys.stderr)
        sys.exit(2)
    _, bootstrap, topic = line
    de = AvroDeserializer(registry)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"avro-check-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    meta = consumer.list_topics(topic, timeout=10)
    parts = meta.topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])
    seen, mismatched, not_framed = set(), [], []
    # tansu's high watermark lags: read until everything made was seen and the topic is quiet.
    deadline, last = time.time() + 120, time.time()
    while time.time() < deadline:
        first = consumer.poll(0.2)
        msgs = ([first] if first is not None else []) + consumer.consume(500, 0)
        if not msgs:
            if len(seen) >= len(made) and time.time() - last > 1.0:
                break
            continue
        last = time.time()
        for m in msgs:
            if m.error():
                continue
            hs = dict(m.headers() or [])
            eid = (hs.get("event_id") or b"").decode()
            if eid not in made:
                continue
            value = m.value() or b""
            if value[:1] != b"\x00":
                not_framed.append(eid)
                continue
            got = de(value, SerializationContext(topic, MessageField.VALUE))
            if got != event(made[eid]):
                mismatched.append(eid)
            seen.add(eid)
    consumer.close()
    missing = [e for e in made if e not in seen]
    print(
        json.dumps(
            {
                "decoded": len(seen),
                "missing": missing[:5],
                "missing_count": len(missing),
                "mismatched": mismatched[:5],
                "not_framed": not_framed[:5],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
