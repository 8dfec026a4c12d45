#!/usr/bin/env python3
"""Decodes Kafka records with the CloudEvents Python SDK (PyPI cloudevents==2.2.0, its
cloudevents.v1.kafka binding), for tests/tests/cloudevents.rs.

stdin: one JSON object a line, {"key": str|null, "value": str, "headers": [[name, value], ...]}
argv[1]: "binary" or "structured" (the content mode the records must decode in).
stdout: one JSON object a line, the decoded event: its attributes (as the SDK returns them),
"data" (the decoded data), "time_us" (the time attribute as epoch microseconds, parsed here).
Any record the SDK refuses ends the run with exit status 1 and the SDK's error.
"""
import datetime
import json
import sys

from cloudevents.v1.kafka import KafkaMessage, from_binary, from_structured


def main() -> int:
    mode = sys.argv[1]
    for n, line in enumerate(sys.stdin):
        rec = json.loads(line)
        msg = KafkaMessage(
            headers={k: v.encode() for k, v in rec["headers"]},
            key=None if rec["key"] is None else rec["key"].encode(),
            value=rec["value"].encode(),
        )
        try:
            if mode == "binary":
                event = from_binary(msg, data_unmarshaller=json.loads)
            else:
                event = from_structured(msg)
        except Exception as e:  # the SDK's refusal is the finding
            print(f"record {n}: the CloudEvents SDK refused it: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in event.get_attributes().items()}
        out = {"attributes": attrs, "data": event.get_data()}
        t = attrs.get("time")
        if isinstance(t, str):
            d = datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))
            epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
            out["time_us"] = (d - epoch) // datetime.timedelta(microseconds=1)
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
