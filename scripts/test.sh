#!/usr/bin/env bash
# Runs every test of the workspace: unit, property and end-to-end (real Postgres 15, plus 14, 16, 17 and
# 18 for the version matrix, and tansu). Extra arguments go to `cargo nextest run` (e.g.
# `-p outboxd-outbox`, `--test relay_crash`).
# Installs what the tests need when missing (scripts/deps.sh).
# Then checks what the suite left in the temp directory: test processes keep their clusters and
# files in $TMPDIR/outboxd-testkit/<pid>-<start time>/ (crates/testkit/src/scratch.rs), removed at
# exit or swept by the next run; more than OUTBOXD_TEST_LEFTOVER_MB (default 100) of directories
# whose process is dead fails the run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/deps.sh >/dev/null

# The tests skipped by default (#[ignore]: long benchmarks and soak runs), named up front so the
# end of the output is the summary. `file::test (reason)`.
skipped=$(grep -rn --include='*.rs' -A1 '#\[ignore' tests/tests crates 2>/dev/null |
  sed -n 's|^\([^-]*\)/\([a-z_0-9]*\)\.rs-[0-9]*-.*fn \([a-z_0-9]*\).*|\2::\3|p' | paste -sd, - | sed 's/,/, /g')
if [ -n "$skipped" ]; then
  echo "skipped by default (on demand, see docs/development.md): $skipped"
  echo "  run one: cargo nextest run -p outboxd-tests --test <file> --run-ignored only --no-capture <test>"
fi

# The whole workspace unless packages are named (`--workspace` would override `-p`).
scope=(--workspace)
for a in "$@"; do
  case "$a" in -p | -p* | --package | --package=*) scope=() ;; esac
done
pkgs=()
prev=
for a in "$@"; do
  case "$prev" in -p | --package) pkgs+=(-p "$a") ;; esac
  case "$a" in -p?* ) pkgs+=(-p "${a#-p}") ;; --package=*) pkgs+=(-p "${a#--package=}") ;; esac
  prev=$a
done

status=0
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run "${scope[@]}" "$@" || status=$?
else
  cargo test "${scope[@]}" "$@" || status=$?
fi

# Doctests (nextest does not run them), of the same packages: one line unless one fails.
doc_out=$(cargo test "${scope[@]}" "${pkgs[@]}" --doc --quiet 2>&1) || {
  echo "$doc_out"
  status=1
}
echo "$doc_out" | awk '/^test result:/ { p += $4; f += $6; i += $8 }
  END { printf "doctests: %d passed, %d failed, %d ignored\n", p, f, i }'

# Leftovers: directories of dead test processes (a killed test; the next run sweeps them).
root="${TMPDIR:-/tmp}/outboxd-testkit"
limit_mb="${OUTBOXD_TEST_LEFTOVER_MB:-100}"
left=()
for d in "$root"/*-*/; do
  [ -d "$d" ] || continue
  name=$(basename "$d")
  pid=${name%%-*} start=${name#*-}
  now=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | awk '{print $20}') || true
  [ "$now" = "$start" ] || left+=("$d")
done
if [ ${#left[@]} -gt 0 ]; then
  kb=$(du -sk "${left[@]}" 2>/dev/null | awk '{s += $1} END {print s + 0}')
  if [ "$kb" -gt $((limit_mb * 1024)) ]; then
    echo "leftovers: ${#left[@]} directories of dead test processes, $((kb / 1024)) MB (limit ${limit_mb} MB):" >&2
    du -sh "${left[@]}" >&2 || true
    status=1
  fi
fi
exit "$status"
