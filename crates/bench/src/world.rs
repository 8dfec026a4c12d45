//! The bench's own world: a private Postgres and broker, the outbox table outboxd reads, the
//! polling baseline's table, and server-side loaders so loading costs no client round trips.

use crate::contestant::Contestant;
use crate::kafka_hop::{Hop, KafkaHop};
use crate::procstat;
use anyhow::{bail, Context, Result};
use outboxd_testkit::{Broker, PgOptions, Postgres, StandbyOptions, PG_PASSWORD};
use std::time::Duration;

/// Database every contestant reads from.
pub const DB: &str = "bench";
/// The publication outboxd, the bare reader and pg_recvlogical stream.
pub const PUBLICATION: &str = "outbox_pub";
/// aggregate_type of every bench event (topic suffix with outboxd's default template).
pub const AGG_TYPE: &str = "bench";

/// Server settings on top of testkit's (fsync=off, full_page_writes=off): no checkpoint in the
/// middle of a timed phase, and the default logical_decoding_work_mem.
pub const PG_SETTINGS: &[(&str, &str)] = &[
    ("max_wal_size", "8GB"),
    ("checkpoint_timeout", "30min"),
    ("shared_buffers", "256MB"),
    // Paused readers (see contest::Paused) send no status while the timed rows load.
    ("wal_sender_timeout", "0"),
];

/// The polling baseline's table: the same columns as `outbox` plus what a polling relay
/// needs, a serial id to page in commit-ish order and `sent_at`, with a partial index over
/// unsent rows so each poll reads only what is left.
const POLL_SQL: &str = r#"
CREATE TABLE IF NOT EXISTS outbox_poll (
    id                bigserial   PRIMARY KEY,
    event_id          uuid        NOT NULL UNIQUE,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    schema_version    int         NOT NULL DEFAULT 1,
    payload           jsonb       NOT NULL,
    headers           jsonb,
    created_at        timestamptz NOT NULL DEFAULT now(),
    sent_at           timestamptz
);
CREATE INDEX IF NOT EXISTS outbox_poll_unsent ON outbox_poll (id) WHERE sent_at IS NULL;
"#;

/// Loads `n` events into `tbls`, `tx` rows per committed transaction, entirely inside the server
/// (a procedure may COMMIT between statements). Transaction j goes to `tbls[j mod len]`: one
/// table, or a load spread evenly over several (the many-tables bench). Versions are
/// `first..first+n`, unique across the whole bench so every event can be told apart on the
/// topics. With several tables each table's aggregate ids carry its own prefix (`t2.agg-7`):
/// per-aggregate order holds within a table, so an aggregate must not span tables.
const LOAD_SQL: &str = r#"
CREATE OR REPLACE FUNCTION bench_insert_sql(tbls regclass[]) RETURNS text[]
LANGUAGE sql STABLE AS $$
    SELECT array_agg(format(
        'INSERT INTO %s (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, created_at) '
        'SELECT gen_random_uuid(), ''bench'', %L || (g %% $3), g, ''BenchEvent'', '
        'jsonb_build_object(''v'', g, ''pad'', repeat(''x'', $4)), clock_timestamp() '
        'FROM generate_series($1, $2) g',
        t, CASE WHEN cardinality(tbls) > 1 THEN 't' || k || '.agg-' ELSE 'agg-' END) ORDER BY k)
    FROM unnest(tbls) WITH ORDINALITY AS u(t, k)
$$;

CREATE OR REPLACE PROCEDURE bench_load(tbls regclass[], first bigint, n bigint, tx int, aggs int, pad int)
LANGUAGE plpgsql AS $$
DECLARE
    i bigint := 0;
    j bigint := 0;
    qs text[] := bench_insert_sql(tbls);
BEGIN
    WHILE i < n LOOP
        EXECUTE qs[1 + j % cardinality(qs)] USING first + i, first + least(i + tx, n) - 1, aggs, pad;
        i := i + tx;
        j := j + 1;
        COMMIT;
    END LOOP;
END $$;

-- One open-loop writer lane: commits transactions lane, lane+stride, … of ntx, transaction j
-- due at t0 + j·interval (unix seconds; interval 0: back to back) into tbls[j mod len], until
-- `deadline`. Each commit's start time and a WAL position at or after its end go to the
-- session's temp table bench_commits. Pacing and inserting in the server keep the load
-- generator's own cost to the inserts (a client round trip per transaction cost ~40% more CPU
-- per row here).
CREATE OR REPLACE PROCEDURE bench_paced(tbls regclass[], first bigint, ntx bigint, tx int, aggs int,
    pad int, t0 float8, interval_s float8, stride int, lane int, deadline float8)
LANGUAGE plpgsql AS $$
DECLARE
    j bigint := lane;
    a bigint;
    wait float8;
    sent timestamptz;
    qs text[] := bench_insert_sql(tbls);
BEGIN
    WHILE j < ntx AND extract(epoch FROM clock_timestamp()) < deadline LOOP
        IF interval_s > 0 THEN
            wait := t0 + j * interval_s - extract(epoch FROM clock_timestamp());
            IF wait > 0 THEN
                PERFORM pg_sleep(wait);
            END IF;
        END IF;
        a := first + j * tx;
        sent := clock_timestamp();
        EXECUTE qs[1 + j % cardinality(qs)] USING a, a + tx - 1, aggs, pad;
        COMMIT;
        -- Temp tables write no WAL and are not decoded: this row is invisible to every reader.
        INSERT INTO bench_commits VALUES (sent, pg_current_wal_insert_lsn(), tx);
        j := j + stride;
    END LOOP;
    COMMIT;
END $$;
"#;

/// Workload shape shared by every loader and writer.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    pub tx_size: usize,
    pub payload_bytes: usize,
    pub aggregates: usize,
}

impl Shape {
    /// `repeat('x', pad)` such that the payload's text form is about `payload_bytes` long
    /// (`{"v": 123456, "pad": "…"}` adds about 25 bytes).
    pub fn pad(&self) -> usize {
        self.payload_bytes.saturating_sub(25)
    }
}

/// The rows and topics of every bench (`run` and `tables`): shared options.
#[derive(clap::Args, Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RowOpts {
    /// Approximate payload (jsonb text) bytes per event.
    #[arg(long, default_value_t = 100)]
    pub payload_bytes: usize,
    /// Distinct aggregate ids (Kafka keys); per table with several tables.
    #[arg(long, default_value_t = 1000)]
    pub aggregates: usize,
    /// Partitions of every topic.
    #[arg(long, default_value_t = 3)]
    pub partitions: i32,
}

impl RowOpts {
    pub fn shape(&self, tx_size: usize) -> Shape {
        Shape {
            tx_size,
            payload_bytes: self.payload_bytes,
            aggregates: self.aggregates,
        }
    }
}

/// The paced live load points of the `standby` and `mqbridge` benches: shared options (and
/// report fields).
#[derive(clap::Args, Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PacedOpts {
    /// Seconds of each load.
    #[arg(long, default_value_t = 20.0)]
    pub secs: f64,
    /// Rows per transaction.
    #[arg(long, default_value_t = 10)]
    pub tx_size: usize,
    #[command(flatten)]
    #[serde(flatten)]
    pub rows: RowOpts,
    /// Runs per load point; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Writer connections.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
}

impl PacedOpts {
    pub fn shape(&self) -> Shape {
        self.rows.shape(self.tx_size)
    }

    /// "20 s per point, 4 writers, transactions of 10 rows, …, 3 partitions" (Markdown).
    pub fn describe(&self) -> String {
        format!(
            "{} s per point, {} writers, transactions of {} rows, payload ≈ {} bytes, {} \
             aggregates, {} partitions",
            self.secs,
            self.writers,
            self.tx_size,
            self.rows.payload_bytes,
            self.rows.aggregates,
            self.rows.partitions
        )
    }
}

/// The broker a contestant produces to, and how.
#[derive(Debug, Clone)]
pub struct Sink {
    pub bootstrap: String,
    pub broker_pid: Option<u32>,
    /// The bench's proxy thread in between, if any.
    pub proxy_tid: Option<u32>,
    /// TLS to the broker, trusting this CA.
    pub tls_ca: Option<std::path::PathBuf>,
}

pub struct World {
    pub pg: Postgres,
    pub broker: Broker,
    pub broker_pid: Option<u32>,
    /// The broker behind a plain-or-TLS proxy (TLS-to-Kafka comparison), when started.
    pub hop: Option<KafkaHop>,
    pub dir: tempfile::TempDir,
    /// Next unused aggregate_version (versions never repeat within a bench run).
    pub next_version: i64,
    /// A physical standby of `pg` (decoding on a standby), when started.
    pub standby: Option<Postgres>,
}

/// The standby's physical slot on the primary (`primary_slot_name`) and its
/// `application_name` in the primary's `pg_stat_replication` (testkit's).
pub const STANDBY_SLOT: &str = "bench_standby";
pub const STANDBY_APP: &str = "testkit_standby";

impl World {
    /// `ssl`: the server also accepts TLS (a throwaway self-signed certificate for 127.0.0.1);
    /// each client still chooses (`sslmode`).
    pub async fn start(ssl: bool) -> Result<Self> {
        Self::start_version(ssl, None).await
    }

    /// [`World::start`] on Postgres `version` (the version matrix's builds; `None`: testkit's
    /// default).
    pub async fn start_version(ssl: bool, version: Option<u32>) -> Result<Self> {
        let mut opts = PgOptions {
            settings: PG_SETTINGS
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            version,
            ..PgOptions::default()
        };
        if ssl {
            let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()])?;
            opts.files = vec![
                ("server.crt".into(), ck.cert.pem().into_bytes()),
                (
                    "server.key".into(),
                    ck.key_pair.serialize_pem().into_bytes(),
                ),
            ];
            for (k, v) in [
                ("ssl", "on"),
                ("ssl_cert_file", "server.crt"),
                ("ssl_key_file", "server.key"),
            ] {
                opts.settings.push((k.into(), v.into()));
            }
        }
        let pg = Postgres::start_with(opts)?;
        let broker = Broker::start()?;
        let broker_pid = procstat::find_pid_by_cmdline(&format!("tcp://127.0.0.1:{}", broker.port));
        pg.create_database(DB).await?;
        let w = Self {
            pg,
            broker,
            broker_pid,
            hop: None,
            dir: tempfile::Builder::new()
                .prefix("outboxd-bench-")
                .tempdir()?,
            next_version: 1,
            standby: None,
        };
        let c = w.sql().await?;
        c.batch_execute(outboxd::OUTBOX_SQL).await?;
        // An append-only outbox needs no vacuum during a benchmark; autovacuum waking up in the
        // middle of a timed phase would only add noise. The polling table keeps autovacuum:
        // its dead rows are part of what polling costs.
        c.batch_execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
            .await?;
        c.batch_execute(POLL_SQL).await?;
        c.batch_execute(LOAD_SQL).await?;
        Ok(w)
    }

    pub async fn sql(&self) -> Result<tokio_postgres::Client> {
        self.pg.connect(DB).await
    }

    pub fn dsn(&self) -> String {
        self.pg.dsn(DB)
    }

    /// Starts a physical standby of the primary as an operator would for decoding on it:
    /// `hot_standby_feedback = on` and `primary_slot_name` ([`STANDBY_SLOT`]); the primary's
    /// settings otherwise. It streams from here on, whoever decodes where.
    pub async fn start_standby(&mut self) -> Result<()> {
        let sb = self
            .pg
            .start_standby(StandbyOptions {
                slot: Some(STANDBY_SLOT.into()),
                settings: vec![("hot_standby_feedback".into(), "on".into())],
            })
            .await?;
        self.standby = Some(sb);
        Ok(())
    }

    fn standby(&self) -> Result<&Postgres> {
        self.standby.as_ref().context("no standby was started")
    }

    /// The standby's DSN (a relay's `source.replication_dsn`).
    pub fn standby_dsn(&self) -> Result<String> {
        Ok(self.standby()?.dsn(DB))
    }

    /// A client of the server a slot lives on: the standby or the primary.
    pub async fn slot_sql(&self, on_standby: bool) -> Result<tokio_postgres::Client> {
        match on_standby {
            true => self.standby()?.connect(DB).await,
            false => self.sql().await,
        }
    }

    /// libpq key=value connection string without the password (it goes in PGPASSWORD).
    pub fn libpq_conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={DB}",
            self.pg.port
        )
    }

    pub fn password(&self) -> &'static str {
        PG_PASSWORD
    }

    pub fn bootstrap(&self) -> String {
        self.broker.bootstrap()
    }

    /// Where `kind` produces: the main broker directly, or the hop's broker through its proxy.
    pub fn sink(&self, kind: Contestant) -> Result<Sink> {
        let Some(hop) = kind.hop() else {
            return Ok(Sink {
                bootstrap: self.bootstrap(),
                broker_pid: self.broker_pid,
                proxy_tid: None,
                tls_ca: None,
            });
        };
        let h = self.hop.as_ref().context("the Kafka hop is not running")?;
        Ok(Sink {
            bootstrap: h.bootstrap(),
            broker_pid: h.broker_pid,
            proxy_tid: Some(h.proxy_tid()),
            tls_ca: (hop == Hop::Tls).then(|| h.ca_path.clone()),
        })
    }

    pub async fn server_version(&self) -> Result<String> {
        Ok(self
            .sql()
            .await?
            .query_one("SELECT version()", &[])
            .await?
            .get(0))
    }

    /// Reserves `n` versions; returns the first.
    pub fn take_versions(&mut self, n: usize) -> i64 {
        let first = self.next_version;
        self.next_version += n as i64;
        first
    }

    /// Loads `n` events into `table` (server-side); returns the first version and the WAL
    /// insert position right after the last commit.
    pub async fn load(&mut self, table: &str, n: usize, shape: Shape) -> Result<(i64, u64)> {
        self.load_into(&[table.to_string()], n, shape).await
    }

    /// [`World::load`] spread over `tables`, transaction by transaction in turn.
    pub async fn load_into(
        &mut self,
        tables: &[String],
        n: usize,
        shape: Shape,
    ) -> Result<(i64, u64)> {
        let first = self.take_versions(n);
        let c = self.sql().await?;
        let table = regclass_array(tables);
        c.batch_execute(&format!(
            "CALL bench_load({table}, {first}, {n}, {}, {}, {})",
            shape.tx_size.max(1),
            shape.aggregates.max(1),
            shape.pad()
        ))
        .await
        .with_context(|| format!("load {n} events into {table}"))?;
        Ok((first, current_lsn(&c).await?))
    }

    pub async fn create_slot(&self, slot: &str) -> Result<()> {
        self.sql()
            .await?
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await
            .with_context(|| format!("create slot {slot}"))?;
        Ok(())
    }

    /// Drops the slot and, with it, its relay's delivery state: the relay is decommissioned.
    /// (A state row without its slot is a lost slot, which holds cleanup back, as it must.)
    pub async fn drop_slot(&self, slot: &str) -> Result<()> {
        self.drop_slot_on(slot, false).await
    }

    /// [`World::drop_slot`] of a slot on the standby (`on_standby`) or the primary; the
    /// delivery state is on the primary either way.
    pub async fn drop_slot_on(&self, slot: &str, on_standby: bool) -> Result<()> {
        self.drop_slot_only(&self.slot_sql(on_standby).await?, slot)
            .await?;
        let c = self.sql().await?;
        let state: bool = c
            .query_one("SELECT to_regclass('outboxd_slot_state') IS NOT NULL", &[])
            .await?
            .get(0);
        if state {
            c.execute(
                "DELETE FROM outboxd_slot_state WHERE slot_name = $1",
                &[&slot],
            )
            .await?;
        }
        Ok(())
    }

    async fn drop_slot_only(&self, c: &tokio_postgres::Client, slot: &str) -> Result<()> {
        // The walsender of a just-stopped reader may take a moment to release the slot.
        for _ in 0..100 {
            match c
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
            {
                Ok(_) => return Ok(()),
                // The message is on the server's error, not in `Display` ("db error").
                Err(e)
                    if e.as_db_error()
                        .is_some_and(|d| d.message().contains("is active")) =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => return Err(e).with_context(|| format!("drop slot {slot}")),
            }
        }
        bail!("slot {slot} stayed active")
    }

    /// Creates topics with `partitions` partitions each.
    pub async fn create_topics(&self, names: &[String], partitions: i32) -> Result<()> {
        create_topics_at(&self.bootstrap(), names, partitions).await
    }
}

pub use outboxd_testkit::kafka::create_topics as create_topics_at;

/// `ARRAY['a', 'b']::regclass[]`: the table list the loaders take (names the bench chose).
pub fn regclass_array(tables: &[String]) -> String {
    let items: Vec<String> = tables.iter().map(|t| format!("'{t}'")).collect();
    format!("ARRAY[{}]::regclass[]", items.join(", "))
}

/// WAL insert position (≥ the end of every commit that already returned).
pub async fn current_lsn(c: &tokio_postgres::Client) -> Result<u64> {
    let row = c
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint", &[])
        .await?;
    Ok(row.get::<_, i64>(0) as u64)
}

/// (walsender pid when the slot is active, confirmed_flush_lsn).
pub async fn slot_state(c: &tokio_postgres::Client, slot: &str) -> Result<(Option<i32>, u64)> {
    let row = c
        .query_opt(
            "SELECT active_pid, (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots \
             WHERE slot_name = $1",
            &[&slot],
        )
        .await?
        .with_context(|| format!("slot {slot} missing"))?;
    Ok((row.get(0), row.get::<_, Option<i64>>(1).unwrap_or(0) as u64))
}
