//! One replication session: source → decoder → router → producer → ack tracker → confirmer.
//!
//! The stages ([`crate::relay::stages`]) run in one task, in stream order, so per-aggregate order on the
//! topic equals commit order (one producer, idempotent, keyed by `aggregate_id`). Only
//! acknowledgements flow back, from librdkafka's delivery thread over a channel, and the only
//! thing the session ever tells Postgres is "acknowledged up to commit LSN X".

use crate::config::Config;
use crate::error::RelayError;
use crate::fail;
use crate::obs::telemetry::ops::Op;
use crate::obs::Observed;
use crate::relay::gulp::Gulp;
use crate::relay::kafka::Producer;
use crate::relay::source::{self, sql_bounded};
use crate::relay::stages::Stages;
use crate::slot::fence::Holder;
use crate::slot::guard::{self as slot_guard, Decision};
use crate::slot::join::Out;
use crate::slot::publication;
use crate::slot::recovery;
use crate::slot::state::{self as slot_state, Identity, XidProbe};
use crate::supervisor::joining::Joining;
use opentelemetry::KeyValue;
use pgwire_replication::Lsn;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How a session ended without error.
#[derive(Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// Shutdown was requested; in-flight events were drained and the last LSN confirmed.
    Shutdown,
}

/// What a session is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Stream until shutdown (`outboxd run`).
    Stream,
    /// `outboxd recover`: republish outbox rows created since the given time (or, without one,
    /// whatever gap the slot guard finds), then end without streaming.
    RecoverOnly(Option<chrono::DateTime<chrono::Utc>>),
}

/// Runs one session until shutdown (Ok) or an error (transient or definite).
pub async fn run_session(
    cfg: &Config,
    shutdown: &mut watch::Receiver<bool>,
    observed: &Arc<Observed>,
    shadow: Option<&crate::relay::tap::Tap>,
) -> Result<SessionEnd, RelayError> {
    run_session_as(cfg, shutdown, Mode::Stream, observed, shadow).await
}

/// [`run_session`] in the given [`Mode`].
pub async fn run_session_as(
    cfg: &Config,
    shutdown: &mut watch::Receiver<bool>,
    mode: Mode,
    observed: &Arc<Observed>,
    shadow: Option<&crate::relay::tap::Tap>,
) -> Result<SessionEnd, RelayError> {
    let traces = observed.traces(cfg).ok().flatten();
    let mut op = Op::start(
        traces.as_deref(),
        "outboxd session start",
        vec![
            KeyValue::new("outboxd.slot", cfg.source.slot.clone()),
            KeyValue::new("outboxd.publication", cfg.source.publication.clone()),
            KeyValue::new(
                "outboxd.session",
                observed.sessions.load(Relaxed) as i64 + 1,
            ),
        ],
    );
    let sql = source::sql_connect(cfg).await?;
    // The tables the patterns match now join this session's list (crate::slot::join).
    let resolved = crate::slot::join::resolve(cfg, &sql).await?;
    let cfg = &resolved;
    // A gap the publication left is owed and the table is still out of it: wait for it to be
    // back (recovering now would start the new slot inside the change).
    if publication_owed(cfg, &sql).await && !publication::covered(cfg, &sql).await? {
        return Err(RelayError::PublicationChanged(format!(
            "waiting until publication {:?} covers every listed outbox table again",
            cfg.source.publication
        )));
    }
    let host = source::SlotHost::connect(cfg).await?;
    let (slot, sender_timeout) = source::preflight_opt(cfg, &sql, &host).await?;
    if let Some(pid) = slot.as_ref().and_then(|s| s.active_pid) {
        return Err(RelayError::SlotBusy {
            slot: cfg.source.slot.clone(),
            pid: pid.to_string(),
        });
    }
    let mut status_interval = Duration::from_millis(cfg.source.status_interval_ms);
    if !sender_timeout.is_zero() {
        status_interval = status_interval.min(sender_timeout / 2);
    }
    crate::obs::touch_recovery_metrics();
    sql_bounded(slot_state::ensure_table(&sql)).await?;
    let identity = sql_bounded(slot_state::identity(&sql)).await?;
    let state = sql_bounded(slot_state::load(&sql, &cfg.source.slot)).await?;
    let found = slot_guard::decide(
        state.as_ref(),
        slot.as_ref(),
        &identity,
        cfg.source.recovery_window,
    );
    let decision = match mode {
        Mode::RecoverOnly(Some(since)) => Decision::Lost(found.manual_loss(slot.is_some(), since)),
        Mode::RecoverOnly(None) | Mode::Stream => found,
    };
    if let (Mode::RecoverOnly(None), Decision::Stream { .. } | Decision::Adopt { .. }) =
        (mode, &decision)
    {
        return Err(RelayError::Setup(format!(
            "replication slot {:?} is healthy: nothing to recover. To republish rows anyway, \
             pass --since TIME",
            cfg.source.slot
        )));
    }
    op.set("outboxd.slot.decision", decision.label());
    let mut recovery = None;
    let mut first_xid = None;
    let start = match decision {
        Decision::Create | Decision::Adopt { .. } => {
            let start = match decision {
                Decision::Adopt { start } => {
                    tracing::info!(slot = %cfg.source.slot, lsn = %crate::model::lsn::fmt_lsn(start), "recording delivery state for an existing slot");
                    start
                }
                _ if cfg.source.create_slot && mode == Mode::Stream => {
                    // The first start publishes nothing already in the table (a previous relay
                    // may have); `outboxd recover --since T` does, on request. Transactions
                    // older than the oldest one running now committed before the slot exists:
                    // not this relay's (the first delivered_xid).
                    first_xid = Some(sql_bounded(XidProbe::take(&sql)).await?.xmin);
                    let create = source::create_slot_sql(cfg, &sql, &host);
                    if host.in_recovery() {
                        // A standby creates it once the primary logged its running
                        // transactions: up to 15 s when outboxd may not ask for that record.
                        create.await?
                    } else {
                        sql_bounded(create).await?
                    }
                    .confirmed_flush
                }
                _ => {
                    return Err(RelayError::Setup(format!(
                        "replication slot {:?} does not exist: run `outboxd init --config FILE` \
                         or set source.create_slot = true",
                        cfg.source.slot
                    )))
                }
            };
            let reset = slot_state::reset(&sql, &cfg.source.slot, &identity, start, first_xid);
            sql_bounded(reset).await?;
            start
        }
        Decision::Stream { start, notes } => {
            for n in notes {
                tracing::warn!(slot = %cfg.source.slot, "{n}");
            }
            start
        }
        Decision::Lost(loss) => {
            let manual = mode != Mode::Stream;
            let p = recovery::prepare(cfg, &sql, &host, &identity, &loss, manual, status_interval)
                .await?;
            let start = p.start;
            recovery = Some(p);
            start
        }
    };
    let mut st = sql_bounded(Stages::new(
        cfg,
        sql,
        host,
        start,
        observed.clone(),
        shadow.cloned(),
    ))
    .await?;
    let (producer, mut acks) =
        Producer::for_session(cfg, observed.clone(), &identity.system_id, st.sql()).await?;
    // Tables that joined owing rows: paid while the session streams (supervisor::joining).
    let mut debts = Vec::new();
    let mut repl = match recovery {
        None => {
            if mode == Mode::Stream {
                debts = crate::slot::join::catch_up(cfg, st.sql()).await?;
            }
            source::start_stream(cfg, start, status_interval).await?
        }
        Some(p) => {
            let Some((gated, start)) =
                recovery::publish(cfg, p, &mut st, &producer, &mut acks, shutdown).await?
            else {
                return Ok(SessionEnd::Shutdown);
            };
            if mode != Mode::Stream {
                return Ok(SessionEnd::Shutdown);
            }
            debts = crate::slot::join::catch_up(cfg, st.sql()).await?;
            match gated {
                Some(mut g) => {
                    g.update_applied_lsn(Lsn(start));
                    source::begin_stream(&mut g).await?;
                    g
                }
                None => source::start_stream(cfg, start, status_interval).await?,
            }
        }
    };
    tracing::info!(
        slot = %cfg.source.slot,
        publication = %cfg.source.publication,
        resume_lsn = %crate::model::lsn::fmt_lsn(start),
        role = "active",
        "streaming"
    );
    op.set(
        "outboxd.resume_lsn",
        crate::model::lsn::fmt_lsn(start).to_string(),
    );
    op.ok();
    // Beats while our walsender holds the slot; notices when a standby fenced us.
    let mut holder = Holder::start(cfg, st.slot_sql()).await?;
    metrics::gauge!(crate::obs::ROLE_ACTIVE).set(1.0);
    metrics::gauge!(crate::obs::RETRY_BACKOFF).set(0.0);
    let health = &observed.health;
    health.standby.store(false, Relaxed);
    health.streaming.store(true, Relaxed);
    health.broker_ok.store(true, Relaxed);
    let mut reported = start;
    let max_events = cfg.relay.max_in_flight_events;
    let max_bytes = cfg.relay.max_in_flight_bytes;
    let repair_every = Duration::from_millis(cfg.relay.repair_interval_ms);
    let mut next_repair = Instant::now();
    let state_every = Duration::from_millis(cfg.source.state_interval_ms);
    let mut next_state = Instant::now() + state_every;
    let mut saved = Saved {
        lsn: start,
        mark_us: st.in_flight().delivery_mark_us(),
        xid: None,
        // The first probe now: the stream's first acknowledgements past it make the mark exact
        // from this session's start.
        probe: Some(sql_bounded(XidProbe::take(st.sql())).await?),
    };
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut ack_wait = crate::relay::ack_wait::AckWait::default();
    // Tables a pattern matches that this role could not add to the publication (said once).
    let mut refused = Vec::new();
    let pace = crate::relay::gulp::Pace::of(&cfg.relay);
    let mut joining = Joining::start(cfg, &mut st, debts, shutdown);
    // The relations this session streams, by oid: a name that comes to mean another one ends it.
    let identities = sql_bounded(crate::slot::join::identities(st.sql(), &cfg.tables())).await?;
    let mut stream = Gulp::new(&mut repl, pace, producer.outstanding());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    let result: Result<(), RelayError> = async {
        // Backpressure with hysteresis: once the in-flight window is full, reading resumes only
        // when it has drained to half. Resuming at the first free slot would wake the task for
        // every single ack and read one event at a time (measured: twice the CPU per event).
        let mut paused = false;
        loop {
            let (n, bytes) = (st.in_flight().events(), st.in_flight().bytes());
            if n >= max_events || bytes >= max_bytes {
                paused = true;
            } else if paused && n <= max_events / 2 && bytes <= max_bytes / 2 {
                paused = false;
            }
            let room = !paused;
            tokio::select! {
                biased;
                _ = shutdown.changed() => return Ok(()),
                e = holder.lost() => return Err(e),
                // Joining tables proven whole: their rows, then what was held of them.
                (i, r) = joining.settled(), if joining.settling() && !st.in_flight().in_transaction() => {
                    let lsn = st.confirmable();
                    let mut out = Out { st: &mut st, producer: &producer, acks: &mut acks, shutdown };
                    if r? && !joining.pay(i, cfg, &mut out, lsn).await? {
                        return Ok(());
                    }
                }
                // Caught up with the stream, acks wait for the thread to be awake
                // (crate::relay::ack_wait) and are taken below; reading paused, each frees
                // the window.
                Some(ack) = acks.recv(), if !(room && stream.caught_up()) => {
                    // An ack may release the next parked event: not from a fenced instance.
                    holder.check_after_gap(cfg, st.slot_sql()).await?;
                    st.on_ack(ack, &producer).await?
                }
                () = ack_wait.due(), if room && stream.caught_up() && (st.in_flight().events() > 0 || st.releasing()) => {
                    holder.check_after_gap(cfg, st.slot_sql()).await?;
                }
                ev = stream.recv(), if room => {
                    // Events read before a freeze are not produced by a fenced instance.
                    holder.check_after_gap(cfg, st.slot_sql()).await?;
                    match ev? {
                        Some(ev) => {
                            st.on_event(ev, &producer).await?;
                            for t in st.take_arrived() {
                                joining.arrive(cfg, &mut st, &producer, t, shutdown).await?;
                            }
                            for (t, oid) in st.take_left() {
                                let back = crate::slot::join::put_back(cfg, st.sql(), &t, oid);
                                if !sql_bounded(back).await? {
                                    return Err(RelayError::PublicationChanged(format!(
                                        "{} left publication {:?}, and the relay's role may not add it back",
                                        t.label(),
                                        cfg.source.publication
                                    )));
                                }
                            }
                        }
                        None => return Err(RelayError::Replication("stream ended".into())),
                    }
                    stream.settle(st.in_flight().in_transaction());
                }
                _ = tick.tick() => {
                    holder.check_after_gap(cfg, st.slot_sql()).await?;
                    sql_bounded(st.obs_tick(room)).await?;
                    if Instant::now() >= next_state {
                        next_state = Instant::now() + state_every;
                        // Tables that joined: into this session, not a new one.
                        let new = crate::slot::join::newcomers(cfg, st.sql(), joining.known());
                        for t in sql_bounded(new).await? {
                            st.join_table(&t)?;
                            joining.arrive(cfg, &mut st, &producer, (t, None), shutdown).await?;
                        }
                        // A pattern's table dropped is no publication change: first.
                        let changed = crate::slot::join::changed(cfg, st.sql(), &mut refused, &identities, joining.known());
                        if let Some(what) = sql_bounded(changed).await? {
                            return Err(RelayError::TablesChanged(what));
                        }
                        // Before a probe may be adopted: never past a change of the publication.
                        if !sql_bounded(publication::covered(cfg, st.sql())).await?
                            && !sql_bounded(publication::stream_will_say(cfg, st.sql())).await?
                        {
                            // Nor one dropped between the two checks.
                            let changed = crate::slot::join::changed(cfg, st.sql(), &mut refused, &identities, joining.known());
                            if let Some(what) = sql_bounded(changed).await? {
                                return Err(RelayError::TablesChanged(what));
                            }
                            return Err(RelayError::PublicationChanged(
                                "the outbox table is not in the publication (or it publishes no \
                                 inserts)".into(),
                            ));
                        }
                        saved = save_state(cfg, &st, &identity, holder.walsender(), saved).await?;
                        sql_bounded(joining.record_acked(cfg, &st)).await?;
                        if saved.probe.is_none() {
                            saved.probe = Some(sql_bounded(XidProbe::take(st.sql())).await?);
                        }
                    }
                    if Instant::now() >= next_repair {
                        next_repair = Instant::now() + repair_every;
                        sql_bounded(st.repair_tick(&producer)).await?;
                    }
                }
            }
            holder.turned();
            // Drain whatever acks are already waiting before the next event.
            while let Ok(ack) = acks.try_recv() {
                st.on_ack(ack, &producer).await?;
            }
            // Only the caught-up reader lets acks wait: no clock read per event of a backlog.
            if stream.caught_up() {
                ack_wait.looked();
            }
            let c = st.confirmable();
            if c > reported {
                if st.take_advanced_by_ack() {
                    fail::hit("acked");
                }
                stream.client().update_applied_lsn(Lsn(c));
                reported = c;
                if health.halted.swap(false, Relaxed) {
                    metrics::gauge!(crate::obs::HALTED).set(0.0);
                }
            }
        }
    }
    .await;
    let read_pauses = stream.pauses();

    // Whatever ended the session, confirm exactly what the broker acknowledged.
    let deadline = Instant::now() + cfg.shutdown_timeout();
    // A table that joined or left is routine: the other tables' records in flight land too,
    // so the next session does not send them again.
    if matches!(result, Ok(()) | Err(RelayError::TablesChanged(_))) {
        // Graceful: stop reading, let in-flight events land.
        'drain: while st.in_flight().events() > 0 && Instant::now() < deadline {
            producer.flush(Duration::from_millis(100));
            while let Ok(ack) = acks.try_recv() {
                if st.on_ack(ack, &producer).await.is_err() {
                    break 'drain;
                }
            }
            // Held events of a table still catching up never land in this session.
            if st.held() > 0 && producer.outstanding().all_reported() && acks.is_empty() {
                break;
            }
        }
    }
    let c = st.confirmable();
    if c > reported {
        repl.update_applied_lsn(Lsn(c));
    }
    if matches!(result, Err(RelayError::PublicationChanged(_))) {
        // The probe may postdate the change: the mark stays where the stream was complete.
        saved.probe = None;
    }
    // Bounded: the session may be ending because the connection went silent.
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        save_state(cfg, &st, &identity, holder.walsender(), saved),
    )
    .await;
    // And the joins whose catch-up the broker acknowledged: the write above may move the
    // delivery mark past a join, and a join it does not record is a tenant a later gap's
    // recovery would not know it relayed (seed 7042 under load).
    let _ = tokio::time::timeout(Duration::from_secs(1), joining.record_acked(cfg, &st)).await;
    let result = match result {
        Err(RelayError::PublicationChanged(what)) => {
            Err(owe_publication_gap(cfg, st.sql(), what).await)
        }
        r => r,
    };
    if c > start {
        // stop() sends no final status: wait until the server has taken our position.
        let wait_until = Instant::now() + status_interval * 2 + Duration::from_secs(1);
        while Instant::now() < wait_until {
            // Bounded: the session may be ending because this very connection went silent.
            let poll = tokio::time::timeout(
                Duration::from_secs(1),
                source::confirmed_flush(cfg, st.slot_sql()),
            );
            match poll.await {
                Ok(Ok(s)) if s >= c => break,
                Ok(Ok(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                Ok(Err(_)) | Err(_) => break,
            }
        }
    }
    repl.stop();
    drop(repl);
    drop(holder);
    health.streaming.store(false, Relaxed);
    tracing::info!(
        confirmed_lsn = %crate::model::lsn::fmt_lsn(c),
        in_flight = st.in_flight().events(),
        ignored_changes = st.ignored(),
        read_pauses,
        "session ended"
    );
    result.map(|()| SessionEnd::Shutdown)
}

/// What the state row holds (as far as this session wrote it), and the transaction-id probe
/// waiting for the acknowledged position to pass it ([`XidProbe`]).
#[derive(Debug, Clone, Copy)]
struct Saved {
    lsn: u64,
    mark_us: Option<i64>,
    xid: Option<u64>,
    probe: Option<XidProbe>,
}

/// Records the acknowledged position, the delivery mark and the delivered transaction id when
/// any moved since `saved`, while `walsender` (this session's) holds the slot. A probe whose
/// WAL position is acknowledged becomes the delivered transaction id (and is used up).
async fn save_state(
    cfg: &Config,
    st: &Stages,
    identity: &Identity,
    walsender: i32,
    saved: Saved,
) -> Result<Saved, RelayError> {
    // What the slot may confirm, not what the broker acknowledged: on a standby the replay
    // fence holds the position below a parked or held event whose row the standby has not
    // replayed yet, and the next session starts from this row's `acked_lsn` — uncapped, the
    // fence lasted one session (issue 56).
    let mut now = Saved {
        lsn: st.confirmable(),
        mark_us: st.in_flight().delivery_mark_us(),
        ..saved
    };
    if let Some(p) = saved.probe.filter(|p| now.lsn >= p.lsn) {
        now.xid = Some(p.xmin);
        now.probe = None;
    }
    if now.lsn <= saved.lsn && now.mark_us <= saved.mark_us && now.xid == saved.xid {
        return Ok(saved);
    }
    let mark = now
        .mark_us
        .and_then(chrono::DateTime::from_timestamp_micros);
    sql_bounded(slot_state::advance(
        st.sql(),
        st.host(),
        &cfg.source.slot,
        identity,
        walsender,
        slot_state::Progress {
            lsn: now.lsn,
            mark,
            xid: now.xid,
        },
    ))
    .await?;
    fail::hit("state_written");
    Ok(now)
}

/// The gap a publication change left is recorded before the session ends (the next one
/// recovers it, see [`publication`]); the error says what happened.
async fn owe_publication_gap(
    cfg: &Config,
    sql: &tokio_postgres::Client,
    what: String,
) -> RelayError {
    let reason = format!("{}: {what}", publication::REASON);
    match sql_bounded(slot_state::owe_gap(sql, &cfg.source.slot, &reason)).await {
        Ok(true) => {
            tracing::error!(slot = %cfg.source.slot, publication = %cfg.source.publication, "{what}: the stream may have skipped outbox rows; the next session republishes them from the table");
            RelayError::PublicationChanged(what)
        }
        Ok(false) => RelayError::SlotLost(format!(
            "{what}: the stream may have skipped outbox rows, and the delivery state has no \
             delivered_xid to bound them (outboxd_slot_state). Recover with: outboxd recover \
             --config FILE --since <the time of the change, minus your longest transaction>"
        )),
        Err(e) => e,
    }
}

/// Whether the state row owes a gap a publication change left.
async fn publication_owed(cfg: &Config, sql: &tokio_postgres::Client) -> bool {
    matches!(
        slot_state::load_if_present(sql, &cfg.source.slot).await,
        Ok(Some(st)) if st.recovering_xid.is_some()
            && st.recovery_reason.as_deref().is_some_and(|r| r.starts_with(publication::REASON))
    )
}
