#!/usr/bin/env bash
# Seeded randomized sequences on demand (tests/tests/sequences.rs: a generator with an oracle):
# N seeds one after the other, each in its own Postgres + tansu world with the relay as a real
# process, then the totals (sequences, steps, rows committed, records read, findings). A failing
# seed prints its seed, findings, whole step list and how to replay it.
#
#   scripts/sequences.sh --seeds N [--from S]   # N sequences from seed S (default 1000)
#   scripts/sequences.sh --seed S               # replay exactly seed S
#
# Extra arguments after `--` go to `cargo nextest run`. About 30–90 s per seed on 2 cores.
# Environment passed through: OUTBOXD_SEQ_PREFIX, OUTBOXD_SEQ_KEEP, OUTBOXD_SEQ_LEAVE_UNSETTLED,
# OUTBOXD_SEQ_RESTART_AFTER_EXIT (narrowing a finding; see tests/tests/sequences.rs's top comment).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
seeds=1
from=1000
seed=
while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) seeds=${2:?--seeds needs a number}; shift 2 ;;
    --from) from=${2:?--from needs a number}; shift 2 ;;
    --seed) seed=${2:?--seed needs a number}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
for n in "$seeds" "$from" ${seed:+"$seed"}; do
  case "$n" in '' | *[!0-9]*) echo "not a number: $n" >&2; exit 2 ;; esac
done

# Postgres 15 and tansu are all these tests need.
scripts/deps.sh --demo >/dev/null

# .config/nextest.toml ends a test after 5 minutes; a run of many seeds is one long test.
cfg=$(mktemp)
trap 'rm -f "$cfg"' EXIT
cat >"$cfg" <<'EOF'
[profile.sequences]
slow-timeout = { period = "300s", terminate-after = 10000 }
EOF

export OUTBOXD_SEQ_SEEDS="$seeds" OUTBOXD_SEQ_FROM="$from"
if [ -n "$seed" ]; then
  export OUTBOXD_SEQ_SEED="$seed"
else
  unset OUTBOXD_SEQ_SEED
fi
cargo nextest run -p outboxd-tests --test sequences --run-ignored only --no-capture \
  --tool-config-file "outboxd-sequences:$cfg" --profile sequences "$@" on_demand
