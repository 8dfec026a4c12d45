#!/usr/bin/env bash
# The README's first command: outboxd end to end on a fresh machine. Starts a throwaway Postgres
# and broker (unless OUTBOXD_DEMO_DSN and OUTBOXD_DEMO_BOOTSTRAP are set), applies sql/, runs
# outboxd, writes sample events in real transactions, shows them on the topic, tears down.
#   scripts/demo.sh --keep   leaves Postgres, the broker and outboxd running in the background and
#                            prints how to connect and how to stop them.
# Installs only what the demo needs (Postgres 15, the tansu broker: scripts/deps.sh --demo).
# Read a topic: target/debug/outboxd tail <topic> --bootstrap HOST:PORT [-X key=value] [-f]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
keep=
case "${1:-}" in
  --keep) keep=1 ;;
  "") ;;
  *) echo "usage: scripts/demo.sh [--keep]" >&2; exit 2 ;;
esac
start=$SECONDS
step() { printf '\n[%s, %ds] %s\n' "$1" "$((SECONDS - start))" "$2"; }

step 1/3 "Postgres 15 and the tansu broker (installed on the first run only)"
scripts/deps.sh --demo >/dev/null
bin="${CARGO_TARGET_DIR:-target}/debug"
if [ -x "$bin/outboxd" ] && [ -x "$bin/outboxd-demo" ]; then
  step 2/3 "building outboxd and the demo (debug)"
else
  step 2/3 "building outboxd and the demo (debug; the first build compiles librdkafka and OpenSSL: 4-5 min on 2 cores)"
fi
# Cargo's own progress: a bar at a terminal, a line per crate otherwise.
cargo build -p outboxd -p outboxd-demo
step 3/3 "the demo: Postgres, broker, outboxd, events written in transactions and read back"
if [ -z "$keep" ]; then
  "$bin/outboxd-demo" "$bin/outboxd"
  echo "(demo done in $((SECONDS - start)) s)"
  exit 0
fi
# In the background, in its own session (a closed terminal does not stop it); show its output
# until it says how to stop it.
log="${TMPDIR:-/tmp}/outboxd-demo-keep.log"
: >"$log"
setsid "$bin/outboxd-demo" --keep "$bin/outboxd" >"$log" 2>&1 </dev/null &
pid=$!
tail -n +1 -f "$log" &
tailer=$!
while kill -0 "$pid" 2>/dev/null && ! grep -q '^to stop:' "$log"; do sleep 0.5; done
sleep 0.2
kill "$tailer" 2>/dev/null || true
wait "$tailer" 2>/dev/null || true
if ! kill -0 "$pid" 2>/dev/null; then
  wait "$pid" || exit $?
  exit 1
fi
echo "(still running in the background: its further output goes to $log)"
