#!/usr/bin/env bash
# Optional (not part of .ci/run or scripts/deps.sh: a cold build takes tens of minutes on 2 cores).
# Installs the mq-bridge CLI (`mqb`, crates.io mq-bridge-app) into .dev/mqb/bin, for
# `outboxd-bench mqbridge` (issue 28: outboxd against mq-bridge, commit -> consumer).
#
# Built from source with `cargo install --locked` (the crate's own Cargo.lock) at the exact version
# below, with only the endpoints the comparison uses — `postgres-cdc` (input) and `kafka` (output,
# librdkafka) — plus `http` (the app's own code does not compile without it: its web UI) and
# `mimalloc`, the allocator its default ("full") build and its release binaries use. No other
# feature changes the Postgres CDC -> Kafka path.
# Idempotent: does nothing when .dev/mqb/bin/mqb already reports this version.
# Environment: CARGO_TARGET_DIR (default .dev/mqb/target); the build runs under `nice -n 19`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="1.3.0"
features="kafka,postgres-cdc,http,mimalloc"
dest="$root/.dev/mqb"
bin="$dest/bin/mqb"

if [ -x "$bin" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version $features" ]; then
  echo "$bin"
  exit 0
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$dest/target}"
echo "installing mq-bridge-app $version (features $features) into $dest (cargo install, nice -n 19)..." >&2
mkdir -p "$dest"
nice -n 19 cargo install mq-bridge-app --version "=$version" --locked --root "$dest" \
  --no-default-features --features "$features" >&2
echo "$version $features" > "$dest/VERSION"
echo "$bin"
