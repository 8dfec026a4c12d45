#!/usr/bin/env bash
# The README's first command: outboxd end to end on a fresh machine. Starts a throwaway Postgres
# and broker (unless OUTBOXD_DEMO_DSN and OUTBOXD_DEMO_BOOTSTRAP are set), applies sql/, runs
# outboxd, writes sample events in real transactions, shows them on the topic, tears down.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/deps.sh >/dev/null
cargo build --quiet -p outboxd -p outboxd-demo
exec target/debug/outboxd-demo target/debug/outboxd
