#!/bin/sh
# Service outboxd-grants: after `outboxd init` created the tables (as outboxd_admin), grants
# outboxd_relay what `outboxd run` needs — the relay's part of sql/roles.sql, block 2, taken
# from that file so the two never differ. Runs as the superuser.
set -eu
secrets="${SECRETS_DIR:-/run/secrets}"
sql="${SQL_DIR:-/sql}"
PGPASSWORD="$(cat "$secrets/postgres-password")"
export PGPASSWORD
grants="$(mktemp)"
sed -n '/^-- ---- 2\. grants/,/^-- The repair role/p' "$sql/roles.sql" >"$grants"
grep -q 'TO outboxd_relay' "$grants" || { echo "no grants for outboxd_relay in $sql/roles.sql" >&2; exit 1; }
psql -v ON_ERROR_STOP=1 -q -f "$grants"
rm -f "$grants"
echo "outboxd_relay granted"
