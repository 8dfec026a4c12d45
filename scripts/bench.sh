#!/usr/bin/env bash
# The full benchmark of docs/benchmarks.md: outboxd against the single-slot ceiling and a polling
# relay, in one run, on this machine (starts its own Postgres and broker; ~10 minutes on 2 cores).
# Extra arguments go to `outboxd-bench run` (see `outboxd-bench run --help`), e.g.
#   scripts/bench.sh --events 100000 --runs 3
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/deps.sh >/dev/null
cargo build --release -p outboxd-bench
bin="${CARGO_TARGET_DIR:-target}/release/outboxd-bench"
out="${CARGO_TARGET_DIR:-target}/bench"
mkdir -p "$out" docs/bench
"$bin" run --chart docs/bench/latency.svg --json "$out/results.json" --markdown "$out/results.md" "$@"
echo "results: $out/results.md, $out/results.json; chart: docs/bench/latency.svg" >&2
