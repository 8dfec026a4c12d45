#!/usr/bin/env bash
# Runs every test of the workspace: unit, property and end-to-end (real Postgres 15, plus 14, 17 and
# 18 for the version matrix, and tansu).
# Installs what the tests need when missing (scripts/deps.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/deps.sh >/dev/null
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace "$@"
else
  cargo test --workspace "$@"
fi
cargo test --workspace --doc --quiet
