#!/usr/bin/env bash
# The README's first command: outboxd end to end on a fresh machine. Starts a throwaway Postgres
# and broker (unless OUTBOXD_DEMO_DSN and OUTBOXD_DEMO_BOOTSTRAP are set), applies sql/, runs
# outboxd, writes sample events in real transactions, shows them on the topic, tears down.
#   scripts/demo.sh --keep   leaves Postgres, the broker and outboxd running in the background and
#                            prints how to connect and how to stop them.
# Read a topic: target/debug/outboxd-demo tail <topic> --bootstrap HOST:PORT [-X key=value] [-f]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
keep=
case "${1:-}" in
  --keep) keep=1 ;;
  "") ;;
  *) echo "usage: scripts/demo.sh [--keep]" >&2; exit 2 ;;
esac
scripts/deps.sh >/dev/null
cargo build --quiet -p outboxd -p outboxd-demo
bin="${CARGO_TARGET_DIR:-target}/debug"
if [ -z "$keep" ]; then
  exec "$bin/outboxd-demo" "$bin/outboxd"
fi
# In the background, in its own session (a closed terminal does not stop it); show its output
# until it says how to stop it.
log="${TMPDIR:-/tmp}/outboxd-demo-keep.log"
setsid "$bin/outboxd-demo" --keep "$bin/outboxd" >"$log" 2>&1 </dev/null &
pid=$!
tail -n +1 -f "$log" &
tailer=$!
while kill -0 "$pid" 2>/dev/null && ! grep -q '^to stop:' "$log"; do sleep 0.5; done
sleep 0.2
kill "$tailer" 2>/dev/null || true
if ! kill -0 "$pid" 2>/dev/null; then
  wait "$pid" || exit $?
  exit 1
fi
echo "(its output continues in $log)"
