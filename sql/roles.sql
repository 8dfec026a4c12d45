-- outboxd: least-privilege roles (see docs/operations.md, "Roles and privileges").
--
-- Five roles, each with only what its job needs:
--   outboxd_admin  : runs `outboxd init` once (and after every upgrade: it installs the guards):
--                    owns the outbox table, the publication and outboxd's own tables. Not used
--                    by the running relay.
--   outboxd_relay  : runs `outboxd run`: streams the WAL (REPLICATION), reads the outbox table
--                    (slot-loss recovery), parks events and records its progress.
--   outboxd_repair : runs `outboxd parked retry|discard` (--dsn / OUTBOXD_REPAIR_DSN): asks for
--                    a retry or a discard of a parked event, each with its audit row.
--   outboxd_cleanup: runs `outboxd cleanup` (cleanup.dsn, --dsn / OUTBOXD_CLEANUP_DSN): deletes
--                    delivered outbox rows. The relay cannot delete, so a leaked relay
--                    credential cannot destroy undelivered events.
--   outboxd_replay : a group (NOLOGIN) for `outboxd replay` (--dsn / OUTBOXD_REPLAY_DSN): reads
--                    the outbox and writes the replay audit. Each operator logs in as a role of
--                    their own that is a member, so the audit names people and the one who
--                    requested a replay cannot approve it (two-person rule, docs/operations.md).
--
-- What a leaked credential can and cannot do (guards: triggers installed by `init`, owned by
-- outboxd_admin; `outboxd check` warns when one is missing or disabled):
--   outboxd_relay  CANNOT publish what the application did not write: a parked row's record
--                  never changes after it is parked; a held (blocked) event is published only
--                  when its copy matches its row in the outbox table; a retry or discard needs
--                  an audit row, which only the repair role writes, in the same transaction;
--                  delivered and discarded are final; it cannot choose a parked row's id
--                  (the guard takes it from the sequence) nor re-insert an event ever parked
--                  (the guard's ledger, issue 53). It cannot claim progress that is not
--                  possible (a delivery mark in the future, a transaction id not yet assigned,
--                  a position past the end of the WAL).
--                  It CAN, through REPLICATION: read the WAL of the published tables (every
--                  event's payload), advance or drop the slot (events skipped: the relay's
--                  slot-loss detection sees a dropped slot, not an advanced one), and stop or
--                  slow delivery (terminate the walsender, mark held events delivered, park
--                  rows the relay then waits for). It can withhold and lose events; it cannot
--                  forge or resurrect one.
--   outboxd_repair CAN republish a parked event (with a corrected payload) or discard one; each
--                  is an audit row naming its database role, which it cannot change or delete.
--   outboxd_replay members CAN request replays; one that is large or of a side-effecting type
--                  (the policy init writes from the admin's [replay] config) runs only after
--                  another member approved it, and only what was approved.
--   outboxd_admin, the owner of outboxd's tables, and superusers can do anything, including
--                  disabling the guards: keep those credentials out of running services.
-- Written for the defaults: the outbox table public.outbox, publication outbox_pub and
-- source.relay_schema = public. With another relay_schema replace `public.outbox_parked`,
-- `public.outboxd_*` below. Replace the passwords (or use another authentication method).
--
-- Order: run the first block as a superuser, then `outboxd init` connected as outboxd_admin,
-- then the second block (the tables must exist to be granted on).

-- ---- 1. roles (as a superuser) -----------------------------------------------------------
CREATE ROLE outboxd_admin LOGIN REPLICATION PASSWORD 'change-me-admin';
CREATE ROLE outboxd_relay LOGIN REPLICATION PASSWORD 'change-me-relay';
CREATE ROLE outboxd_repair LOGIN PASSWORD 'change-me-repair';
CREATE ROLE outboxd_cleanup LOGIN PASSWORD 'change-me-cleanup';
CREATE ROLE outboxd_replay NOLOGIN;
-- One login role per operator who requests, approves or runs replays:
--   CREATE ROLE alice LOGIN PASSWORD 'change-me-alice' IN ROLE outboxd_replay;
-- init creates the outbox table and outboxd's tables in public, and the publication (which
-- needs CREATE on the database).
GRANT CREATE ON SCHEMA public TO outboxd_admin;
DO $$ BEGIN EXECUTE format('GRANT CREATE ON DATABASE %I TO outboxd_admin', current_database()); END $$;
-- An outbox table that already exists must be owned by outboxd_admin to be published:
--   ALTER TABLE public.outbox OWNER TO outboxd_admin;

-- ---- 2. grants (as outboxd_admin or a superuser, after `outboxd init`) --------------------
-- The relay: read the outbox (recovery), write its own tables, emit heartbeats.
GRANT USAGE ON SCHEMA public TO outboxd_relay;
GRANT SELECT ON public.outbox TO outboxd_relay;
-- INSERT on the columns parking writes only: never `id` (the guard takes it from the sequence)
-- nor what the guard sets. The REVOKE turns the table-wide grant of earlier versions into this.
REVOKE INSERT ON public.outbox_parked FROM outboxd_relay;
GRANT SELECT ON public.outbox_parked TO outboxd_relay;
GRANT INSERT (slot, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, topic,
              record_key, payload, headers, record_ts_ms, commit_lsn, state, blocks_aggregate,
              blocked_by, error_class, error_message, integrity_tag, source_relid)
    ON public.outbox_parked TO outboxd_relay;
-- Only what a release or a re-park changes; the rest of a parked row is frozen by its guard.
GRANT UPDATE (state, attempts, last_seen, resolved_at, error_class, error_message, retry_audit_id)
    ON public.outbox_parked TO outboxd_relay;
GRANT SELECT, INSERT, UPDATE ON public.outboxd_status, public.outboxd_slot_state TO outboxd_relay;
GRANT SELECT ON public.outbox_parked_audit TO outboxd_relay;
-- Shadow mode (shadow.enabled) records its comparison here.
GRANT SELECT, INSERT, UPDATE ON public.outboxd_shadow_counts, public.outboxd_shadow_diffs TO outboxd_relay;
GRANT USAGE ON SEQUENCE public.outboxd_shadow_diffs_id_seq TO outboxd_relay;
GRANT USAGE ON SEQUENCE public.outbox_parked_id_seq TO outboxd_relay;
-- Fencing (relay.takeover_after_ms): a standby terminates the walsender of a frozen active
-- instance with pg_terminate_backend. For a walsender of the same role that needs nothing more;
-- only if instances log in as different roles:  GRANT pg_signal_backend TO outboxd_relay;
-- pg_logical_emit_message is executable by everyone by default; if your installation revoked
-- it, heartbeats need: GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO outboxd_relay;

-- The repair role: move parked events to retry or discarded, write the audit, read the status.
GRANT USAGE ON SCHEMA public TO outboxd_repair;
GRANT SELECT ON public.outbox_parked TO outboxd_repair;
GRANT UPDATE (state, last_seen, resolved_at, retry_audit_id) ON public.outbox_parked TO outboxd_repair;
GRANT SELECT, INSERT ON public.outbox_parked_audit TO outboxd_repair;
GRANT USAGE ON SEQUENCE public.outbox_parked_audit_id_seq TO outboxd_repair;
GRANT SELECT ON public.outboxd_status TO outboxd_repair;

-- The cleanup role: delete delivered rows behind every slot's delivery mark. (A partitioned
-- outbox is cleaned by dropping partitions, which needs ownership: run cleanup as its owner.)
GRANT USAGE ON SCHEMA public TO outboxd_cleanup;
GRANT SELECT, DELETE ON public.outbox TO outboxd_cleanup;
GRANT SELECT ON public.outboxd_slot_state TO outboxd_cleanup;
GRANT SELECT ON public.outboxd_replay TO outboxd_cleanup;  -- no deletes while a replay runs

-- Replays: read the outbox, write the replay audit (Kafka credentials come from the config).
GRANT USAGE ON SCHEMA public TO outboxd_replay;
GRANT SELECT ON public.outbox TO outboxd_replay;
GRANT SELECT, INSERT, UPDATE ON public.outboxd_replay TO outboxd_replay;
-- The approval policy: written by `init` (outboxd_admin) from its [replay] config; readable by
-- everyone already (sql/060: the guard reads it as the operator), named here to be explicit.
GRANT SELECT ON public.outboxd_replay_policy TO outboxd_replay;
GRANT USAGE ON SEQUENCE public.outboxd_replay_id_seq TO outboxd_replay;

-- The application: writes events into the outbox in its own transactions.
--   GRANT INSERT ON public.outbox TO my_service;
