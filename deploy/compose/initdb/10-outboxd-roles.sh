#!/bin/sh
# Runs once, when the postgres container initialises its data directory
# (/docker-entrypoint-initdb.d), as the superuser. Creates only the two roles this stack uses
# (the full set, with repair, cleanup and replay roles, is sql/roles.sql):
#   outboxd_admin  runs `outboxd init` (service outboxd-init): owns the outbox table and
#                  outboxd's tables, creates the publication and the slot;
#   outboxd_relay  runs `outboxd run` (service outboxd), granted by grants.sh after init.
# Their passwords are the compose secrets. Also installs the publication guard, which needs a
# superuser (sql/080_outboxd_publication_guard.sql).
set -eu
secrets="${SECRETS_DIR:-/run/secrets}"
sql="${SQL_DIR:-/sql}"
psql -v ON_ERROR_STOP=1 -q --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v admin_pw="$(cat "$secrets/outboxd-admin-password")" \
  -v relay_pw="$(cat "$secrets/outboxd-relay-password")" <<'SQL'
SET client_min_messages = warning;
CREATE ROLE outboxd_admin LOGIN REPLICATION PASSWORD :'admin_pw';
CREATE ROLE outboxd_relay LOGIN REPLICATION PASSWORD :'relay_pw';
GRANT CREATE ON SCHEMA public TO outboxd_admin;
SELECT format('GRANT CREATE ON DATABASE %I TO outboxd_admin', current_database()) \gexec
SQL
psql -v ON_ERROR_STOP=1 -q --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -c 'SET client_min_messages = warning' -f "$sql/080_outboxd_publication_guard.sql"
