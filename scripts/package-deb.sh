#!/usr/bin/env bash
# Builds the Debian package of outboxd (cargo-deb; metadata in crates/outboxd/Cargo.toml):
# the binary, the systemd unit (not enabled), /etc/outboxd/outboxd.toml, the SQL files, man
# pages and shell completions generated from the binary itself.
#   scripts/package-deb.sh                      release build (~8 min cold on 2 cores), target/debian/
#   scripts/package-deb.sh --profile dev -o DIR from the debug binary (what the tests package)
#   --no-build                                  use the binary already built for that profile
#   --fast                                      faster compression, a larger file
# Needs cargo-deb (scripts/deps.sh installs it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
profile=release out=target/debian build=1 fast=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    -o | --output) out="$2"; shift 2 ;;
    --no-build) build=; shift ;;
    --fast) fast=(--fast); shift ;;
    *) echo "usage: scripts/package-deb.sh [--profile release|dev] [--no-build] [--fast] [-o DIR]" >&2; exit 2 ;;
  esac
done
dir=$profile
[ "$profile" = dev ] && dir=debug
target="${CARGO_TARGET_DIR:-target}/$dir"
if [ -n "$build" ]; then
  cargo build --locked --profile "$profile" -p outboxd
fi
bin="$target/outboxd"
[ -x "$bin" ] || { echo "$bin is missing: build it, or drop --no-build" >&2; exit 1; }
rm -rf "$target/deb"
mkdir -p "$target/deb/man" "$target/deb/completions"
"$bin" man --dir "$target/deb/man" >/dev/null
gzip -9n "$target"/deb/man/*.1
"$bin" completions bash >"$target/deb/completions/outboxd"
"$bin" completions zsh >"$target/deb/completions/_outboxd"
"$bin" completions fish >"$target/deb/completions/outboxd.fish"
mkdir -p "$out"
cargo deb --no-build --profile "$profile" -p outboxd -o "$out" "${fast[@]}"
