//! The daemon's one link to Redis: a multiplexed connection shared by every
//! request, a circuit breaker, and a supervisor task that (re)connects and
//! loads the script.
//!
//! Requests go through one entry point, `eval`, which owns what every call
//! needs: the deadline, the single-flight reload and one retry on
//! `NOSCRIPT`, the breaker's bookkeeping and the latency metric. It takes
//! the current connection from an `ArcSwap` (no lock) and checks the breaker
//! (one atomic). Everything slow happens in the supervisor: connecting
//! (directly, or through Sentinel to the current master), `SCRIPT LOAD` at
//! start-up, after every reconnect and on `NOSCRIPT`, and probing while the
//! breaker is open. A new connection is only put in place once it has loaded
//! the script, so requests never race a half-ready link.
//!
//! On a Redis Cluster the connection is redis-rs's cluster connection (one
//! multiplexed connection per node, routing by slot, MOVED/ASK, slot-map
//! refresh) and the same `eval` serves it, with two differences that keep
//! one node's trouble its own keys' trouble: a node answering `NOSCRIPT`
//! gets the call again as `EVAL` of the script's text (which caches it on
//! that node; a `SCRIPT LOAD` goes to every node and fails if any is down),
//! and a lost node connection fails only the request that met it (the
//! client reconnects and refreshes the slot map itself). A call's failures
//! count toward the breaker of its key's hash slot (`SlotBreakers`), on
//! the slot's own evidence: a dead primary opens its own slots' breakers,
//! never the other primaries' keys'. The link's breaker opens on a
//! cluster only when the connection itself is lost (the supervisor).
//!
//! Two guards stand between a request and Redis, and they answer different
//! questions:
//!
//! - The breaker (`breaker`): is Redis failing? It opens at once on a lost
//!   connection, and after `breaker_failures` consecutive deadlines during
//!   which Redis answered nothing. A timeout is evidence only if Redis
//!   answered no call of ours in the whole time this one waited
//!   (`last_answer_us` of `admission` is not later than the call's admission): Redis answers
//!   one connection in order, so a reply that arrived meanwhile was for a
//!   call ahead of this one, and this one was merely queued behind our own
//!   work; Redis was alive (`queued` if at least `min_in_flight` calls were
//!   ahead of it, else `stalled`: Redis or the host paused, not our queue).
//!   A timeout whose timer fired more than a quarter of the deadline late
//!   is no evidence either: the daemon itself was not running (a starved
//!   host), and it cannot tell what Redis did. Of the
//!   silent timeouts, only one per deadline counts (`last_counted_us`: a
//!   call counts only if it was admitted after the last counted one timed
//!   out), so the counted waits never overlap: all the calls in flight
//!   timing out together in one stall of a few tens of ms (a loaded host
//!   not scheduling Redis) count once, and `breaker_failures` in a row (a
//!   success resets the count) mean Redis was silent for that many whole
//!   deadlines, 100 ms by default. A hung or paused Redis, a black-holed
//!   network, or a Redis slower than the deadline for every call (no reply
//!   ever arrives in time) opens it after those 100 ms; a busy but healthy
//!   Redis never does. `ratelimitd_redis_timeouts_total{cause}` counts each
//!   kind of timeout.
//! - Admission (`admission`): would this call miss its deadline waiting in
//!   our own queue (or behind a Redis silent for about a deadline)? Its wait
//!   is estimated from the calls ahead and the observed time per call; a
//!   call that would miss is refused at once with `StoreError::Overloaded`
//!   and never touches the breaker.

mod admission;
mod breaker;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use redis::{AsyncConnectionConfig, Cmd, FromRedisValue, RedisError, Script};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use self::admission::{InFlightLimit, Permit};
use self::breaker::{Breaker, SlotBreakers};
use super::connector::{Connector, LinkConnection};
use super::sentinel::SentinelConnector;
use crate::config::RedisConfig;
use crate::log_limit::RateLimitedLog;
use crate::metrics::{TimeoutCause, METRICS};
use crate::window::StoreError;

/// Timings of the link.
#[derive(Debug, Clone)]
pub struct LinkSettings {
    /// Deadline of one request's Redis call.
    pub timeout: Duration,
    /// Deadline of opening a connection.
    pub connect_timeout: Duration,
    /// Consecutive timeouts that open the breaker (only those that are
    /// evidence against Redis count).
    pub breaker_failures: u32,
    /// Bounds of the adaptive limit on calls in flight.
    pub min_in_flight: u32,
    pub max_in_flight: u32,
}

impl From<&RedisConfig> for LinkSettings {
    fn from(cfg: &RedisConfig) -> Self {
        Self {
            timeout: cfg.timeout,
            connect_timeout: cfg.connect_timeout,
            breaker_failures: cfg.breaker_failures,
            min_in_flight: cfg.min_in_flight,
            max_in_flight: cfg.max_in_flight,
        }
    }
}

pub struct RedisLink {
    conn: ArcSwapOption<LinkConnection>,
    breaker: Breaker,
    /// On a Cluster: a breaker per hash slot, which a call's failures
    /// count toward instead of `breaker` (see the module doc).
    slot_breakers: Option<SlotBreakers>,
    /// Admission: the adaptive limit on calls in flight.
    in_flight: InFlightLimit,
    /// When the last timeout the breaker counted fired, same clock: one
    /// count per deadline of silence (see the module doc).
    last_counted_us: AtomicU64,
    /// Bumped after every successful SCRIPT LOAD.
    generation: AtomicU64,
    reconnect_wanted: AtomicBool,
    reload_wanted: AtomicBool,
    /// A cluster connection stalled (see `watch_cluster`): replace it
    /// without opening the breaker.
    replace_wanted: AtomicBool,
    /// When a stalled connection was last replaced, or a stall probe
    /// answered (same clock as `in_flight.last_answer_us()`).
    last_replaced_us: AtomicU64,
    stall_log: RateLimitedLog,
    /// Wakes the supervisor.
    wake: Notify,
    /// Wakes requests waiting for a reload.
    loaded: Notify,
    /// A connection attempt of the supervisor has failed with an answer
    /// (refused, or an error reply; not a timeout): start-up stops waiting
    /// for such a Redis (`wait_first_answer`).
    attempt_failed: AtomicBool,
    /// Told when `attempt_failed` is first set (not `loaded`: its waiters
    /// take a wake-up for a finished load).
    failed: Notify,
    settings: LinkSettings,
    /// The scripts, one per algorithm, in the order given to `start`
    /// (`script_sha(i)`); all are loaded together, so a link is ready
    /// for every algorithm or for none. Each keeps its text for `EVAL` when
    /// a cluster node answers NOSCRIPT.
    scripts: Box<[(Script, &'static str)]>,
    /// A real call of the script (on a key of its own) that a new connection
    /// must answer before the breaker closes: `SCRIPT LOAD` alone succeeds on
    /// a server that then refuses or blocks writes (`CLIENT PAUSE WRITE`,
    /// OOM), and the breaker would flap on every request.
    probe: Cmd,
    /// Warnings of the breaker opening, and of it closing again: at most one
    /// each per interval however often a sick Redis trips it.
    trip_log: RateLimitedLog,
    up_log: RateLimitedLog,
    /// A line saying Redis is down or slow was logged and no line saying it
    /// is back has been since: the next recovery is logged whatever
    /// `up_log` says, so the log never ends on "cannot reach redis" while
    /// the link is up.
    down_said: AtomicBool,
}

impl std::fmt::Debug for RedisLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLink")
            .field("breaker_open", &self.breaker.is_open())
            .field("in_flight_limit", &self.in_flight.limit())
            .field("generation", &self.generation.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// How a failed call bears on the link.
enum Failure {
    /// The connection is gone or points at the wrong server: reconnect.
    Link,
    /// The call took too long: counts toward opening the breaker.
    Slow,
    /// The server answered with an error about this call only.
    Call,
}

fn classify(e: &RedisError) -> Failure {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_unrecoverable_error() {
        return Failure::Link;
    }
    if e.is_timeout() {
        return Failure::Slow;
    }
    // A demoted master (READONLY), a master that lost the replicas
    // `min-replicas-to-write` asks for (NOREPLICAS: at a failover, the
    // promoted replica left it), or a server not ready to serve (LOADING,
    // MASTERDOWN): the link must find the master again.
    match e.code() {
        Some("READONLY" | "NOREPLICAS" | "LOADING" | "MASTERDOWN" | "NOAUTH" | "WRONGPASS") => Failure::Link,
        _ => Failure::Call,
    }
}

impl RedisLink {
    /// Starts the supervisor; the link is down (breaker open) until it has
    /// connected and loaded every script of `sources` (the probe calls the
    /// first). Background tasks stop with `shutdown`.
    pub fn start(connector: Connector, sources: &[&'static str], probe: Cmd, settings: LinkSettings, shutdown: CancellationToken) -> Arc<Self> {
        let scripts = sources.iter().map(|s| (Script::new(s), *s)).collect();
        let link = Arc::new(Self {
            conn: ArcSwapOption::empty(),
            breaker: Breaker::new(settings.breaker_failures),
            slot_breakers: matches!(connector, Connector::Cluster { .. }).then(|| SlotBreakers::new(settings.breaker_failures)),
            in_flight: InFlightLimit::new(settings.min_in_flight, settings.max_in_flight, settings.timeout),
            last_counted_us: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            reconnect_wanted: AtomicBool::new(true),
            reload_wanted: AtomicBool::new(false),
            replace_wanted: AtomicBool::new(false),
            last_replaced_us: AtomicU64::new(0),
            stall_log: RateLimitedLog::new(LOG_INTERVAL),
            wake: Notify::new(),
            loaded: Notify::new(),
            attempt_failed: AtomicBool::new(false),
            failed: Notify::new(),
            settings,
            scripts,
            probe,
            trip_log: RateLimitedLog::new(LOG_INTERVAL),
            up_log: RateLimitedLog::new(LOG_INTERVAL),
            down_said: AtomicBool::new(false),
        });
        METRICS.redis_in_flight_limit(link.in_flight.limit());
        if let Connector::Sentinel(s) = &connector {
            let link = Arc::downgrade(&link);
            let on_leave = move || match link.upgrade() {
                Some(l) => {
                    l.failover_announced();
                    true
                }
                None => false,
            };
            tokio::spawn(SentinelConnector::watch_failovers(s.failover_watch(), on_leave, shutdown.clone()));
        }
        if matches!(connector, Connector::Cluster { .. }) {
            tokio::spawn(watch_cluster(Arc::downgrade(&link), shutdown.clone()));
        }
        tokio::spawn(supervise(link.clone(), connector, shutdown));
        link
    }

    /// Deadline of one request's call.
    pub fn timeout(&self) -> Duration {
        self.settings.timeout
    }

    /// The SHA1 that EVALSHA names for the `i`-th script given to `start`.
    pub fn script_sha(&self, i: usize) -> &str {
        self.scripts[i].0.get_hash()
    }

    /// The text of the script `cmd` (an EVALSHA) names, for its EVAL.
    fn source_of(&self, cmd: &Cmd) -> &'static str {
        let sha = cmd.args_iter().nth(1).and_then(|a| match a {
            redis::Arg::Simple(b) => Some(b),
            _ => None,
        });
        self.scripts.iter().find(|(s, _)| sha == Some(s.get_hash().as_bytes())).unwrap_or(&self.scripts[0]).1
    }

    /// Runs `cmd`, an EVALSHA of the link's script, within the deadline. On
    /// `NOSCRIPT` (Redis lost its script cache) it waits for the one reload
    /// the supervisor does for all requests, then retries once. Every
    /// outcome is reported to the breaker, the adaptive in-flight limit and
    /// the latency metric.
    ///
    /// With the breaker open the answer is `CircuitOpen`; when waiting would
    /// miss the deadline (see `admission`) it is `Overloaded`, at once: neither
    /// waits, and neither counts as a failure of Redis.
    ///
    /// A connection found dead (Redis or a proxy closed it while idle,
    /// `CLIENT KILL`, a restart) is not an answer: the request waits, within
    /// its deadline, for the fresh connection the supervisor opens and is
    /// sent once more. If the first copy did reach Redis before the
    /// connection died, it is counted twice: the error is on the side of
    /// refusing, never of admitting too much.
    pub async fn eval<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        self.eval_by(cmd, Instant::now() + self.settings.timeout).await
    }

    /// `eval` with a deadline of the caller's: the calls of one decision
    /// over several Cluster slots share one (`multi`), whatever their
    /// number.
    pub async fn eval_by<T: FromRedisValue>(&self, cmd: &Cmd, deadline: Instant) -> Result<T, StoreError> {
        let started = Instant::now();
        let mut conn = self.connection()?;
        let conn_is_cluster = conn.is_cluster();
        let slot = self.slot_breakers.as_ref().filter(|_| conn_is_cluster).zip(first_key_slot(cmd));
        if let Some((slots, slot)) = slot {
            if !slots.admit(slot, self.in_flight.micros(started), self.reprobe_us()) {
                return Err(StoreError::CircuitOpen);
            }
        }
        let Some(permit) = self.in_flight.admit(started) else {
            return Err(StoreError::Overloaded(self.in_flight.limit()));
        };
        let attempt = async {
            let seen = self.generation();
            let first = routed(cmd, &mut conn, deadline).await;
            match first {
                Err(e) if is_noscript(&e) && conn.is_cluster() => {
                    // One node of the cluster lost its script cache (a
                    // promoted replica, SCRIPT FLUSH, a restart): EVAL the
                    // text there. It runs the call and caches the script on
                    // that node only; the other nodes are not asked, and
                    // none being down matters (`SCRIPT LOAD` on a cluster
                    // goes to every node and fails if any one is down).
                    METRICS.noscript_reload();
                    let eval = eval_source(cmd, self.source_of(cmd));
                    routed(&eval, &mut conn, deadline).await
                }
                Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                    METRICS.noscript_reload();
                    self.wait_for_reload(seen).await;
                    cmd.query_async::<T>(&mut conn).await
                }
                // A cluster connection reconnects to its nodes and retries
                // by itself; the error is this request's only.
                Err(e) if (e.is_connection_dropped() || e.is_io_error()) && !conn.is_cluster() => {
                    self.link_lost(&e);
                    // Leave a little of the deadline for the call itself.
                    let wait = self.settings.timeout.saturating_sub(started.elapsed() + Duration::from_millis(1));
                    if !self.wait_ready(wait).await {
                        return Err(e);
                    }
                    match self.connection() {
                        Ok(mut fresh) => cmd.query_async::<T>(&mut fresh).await,
                        Err(_) => Err(e),
                    }
                }
                other => other,
            }
        };
        let outcome = tokio::time::timeout_at(deadline.into(), attempt).await;
        let took = started.elapsed();
        let now = started + took;
        METRICS.redis_call(took);
        match outcome {
            Ok(Ok(v)) => {
                self.replied(&permit, now, took);
                self.breaker.record_success();
                if let Some((slots, slot)) = slot {
                    self.slot_answered(slots, slot, now);
                }
                Ok(v)
            }
            Ok(Err(e)) => Err(self.record_failure(&e, conn_is_cluster, slot, &permit, now, took)),
            Err(_) => {
                self.record_timeout(slot, &permit, now, took);
                Err(StoreError::Timeout(self.settings.timeout))
            }
        }
    }

    /// How long a slot's open breaker refuses before it lets a probe
    /// through: a deadline, so one request per deadline waits on a dead
    /// primary, and its keys are back within about one after its replica
    /// is promoted.
    fn reprobe_us(&self) -> u64 {
        self.settings.timeout.max(MIN_BACKOFF).as_micros() as u64
    }

    /// A call on a Cluster slot was answered (an error reply is an answer too).
    #[inline]
    fn slot_answered(&self, slots: &SlotBreakers, slot: u16, now: Instant) {
        if slots.answered(slot, self.in_flight.micros(now)) {
            if let Some(suppressed) = self.up_log.permit() {
                tracing::info!(slot, closed_before = suppressed, "a redis cluster slot answers again; its breaker closed");
            }
        }
    }

    /// A call on a Cluster slot got no answer, and no other call on the
    /// slot was answered while it waited: counts toward the slot's breaker.
    fn slot_silent(&self, slots: &SlotBreakers, slot: u16, permit: &Permit<'_>, now: Instant) {
        if !slots.silent_since(slot, permit.admitted_us) {
            return;
        }
        if slots.failed(slot, permit.admitted_us, self.in_flight.micros(now), self.reprobe_us()) {
            METRICS.breaker_opened();
            if let Some(suppressed) = self.trip_log.permit() {
                tracing::warn!(
                    slot,
                    failures = self.settings.breaker_failures,
                    breaker_opened_before = suppressed,
                    "a redis cluster slot's primary is silent or unreachable; its slot's breaker is open (its keys follow their fail policy until a probe succeeds), the other slots are not affected"
                );
                self.down_said.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Redis answered a call still waiting for it.
    #[inline]
    fn replied(&self, permit: &Permit<'_>, now: Instant, took: Duration) {
        self.in_flight.answered(took, now, permit.admitted_us);
    }

    /// A sentinel announced a failover of our master (its first step, or
    /// the switch to another server than ours): stop using it now.
    fn failover_announced(&self) {
        if self.breaker.trip() {
            METRICS.breaker_opened();
        }
        self.want_reconnect();
    }

    /// A connection attempt failed with an answer (refused, or an error
    /// reply), not a timeout: start-up stops waiting (`wait_first_answer`).
    fn answered_no(&self) {
        if !self.attempt_failed.swap(true, Ordering::AcqRel) {
            self.failed.notify_waiters();
        }
    }

    pub fn breaker_open(&self) -> bool {
        self.breaker.is_open()
    }

    /// The connection to use now, or why there is none.
    #[inline]
    fn connection(&self) -> Result<LinkConnection, StoreError> {
        if self.breaker.is_open() {
            return Err(StoreError::CircuitOpen);
        }
        match &*self.conn.load() {
            Some(c) => Ok((**c).clone()),
            None => Err(StoreError::CircuitOpen),
        }
    }

    #[inline]
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Reports a failed call and returns the error to answer with.
    ///
    /// On a cluster, a lost connection is one node's (a primary killed, a
    /// node restarting): redis-rs reconnects to it and refreshes the slot
    /// map itself, and the other nodes' keys are still decided in Redis, so
    /// it does not open the breaker at once nor replace the connection; the
    /// request follows its fail policy. It counts toward the breaker of the
    /// key's slot, as a silent timeout does, only if no call on the slot was
    /// answered while it waited: a slot's breaker opens when its primary is
    /// unreachable or silent for `breaker_failures` deadlines. (A call with
    /// no key, none on the request path, counts toward the link's breaker
    /// if no node answered any call of ours meanwhile.)
    fn record_failure(&self, e: &RedisError, cluster: bool, slot: Option<(&SlotBreakers, u16)>, permit: &Permit<'_>, now: Instant, took: Duration) -> StoreError {
        match classify(e) {
            Failure::Link if cluster => {
                match slot {
                    Some((slots, slot)) => self.slot_silent(slots, slot, permit, now),
                    None if self.in_flight.last_answer_us() <= permit.admitted_us => self.count_toward_breaker(permit, now),
                    None => {}
                }
                StoreError::Unavailable(e.to_string())
            }
            Failure::Link => {
                self.link_lost(e);
                StoreError::Unavailable(e.to_string())
            }
            Failure::Slow => {
                self.record_timeout(slot, permit, now, took);
                StoreError::Timeout(self.settings.timeout)
            }
            Failure::Call => {
                // An error reply is still a reply: Redis is alive.
                self.replied(permit, now, took);
                if let Some((slots, slot)) = slot {
                    self.slot_answered(slots, slot, now);
                }
                StoreError::Redis(e.to_string())
            }
        }
    }

    /// Why a call that `permit` admitted waited out its deadline (see the
    /// module doc): only `RedisSilent` is evidence against Redis (on a
    /// Cluster, against the primary of the call's slot: no call on the slot
    /// was answered meanwhile).
    fn timeout_cause(&self, slot: Option<(&SlotBreakers, u16)>, permit: &Permit<'_>, took: Duration) -> TimeoutCause {
        let silent = match slot {
            Some((slots, slot)) => slots.silent_since(slot, permit.admitted_us),
            None => self.in_flight.last_answer_us() <= permit.admitted_us,
        };
        if took > self.settings.timeout + self.settings.timeout / LATE_TIMER_DIVISOR {
            TimeoutCause::DaemonLate
        } else if silent {
            TimeoutCause::RedisSilent
        } else if permit.ahead >= self.in_flight.min() {
            TimeoutCause::Queued
        } else {
            TimeoutCause::Stalled
        }
    }

    /// Whether the line saying the link is up again may be logged now (with
    /// how many were held back): always after a logged failure, else at
    /// most once per `LOG_INTERVAL`.
    fn recovery_permit(&self) -> Option<u64> {
        if self.down_said.swap(false, Ordering::Relaxed) {
            Some(self.up_log.force())
        } else {
            self.up_log.permit()
        }
    }

    /// The connection is gone or points at the wrong server: open the
    /// breaker and reconnect.
    fn link_lost(&self, e: &RedisError) {
        if self.breaker.trip() {
            METRICS.breaker_opened();
            if let Some(suppressed) = self.trip_log.permit() {
                tracing::warn!(error = %e, breaker_opened_before = suppressed, "redis connection lost; breaker open, reconnecting");
                self.down_said.store(true, Ordering::Relaxed);
            }
        }
        self.want_reconnect();
    }

    /// Reports a call that passed its deadline: to the in-flight limit if it
    /// waited in our own queue (Redis was answering the calls ahead, and at
    /// least `min_in_flight` were ahead: the queue was too long), to the
    /// breaker if Redis answered nothing at all meanwhile. A stall (Redis
    /// answering, few ahead) or a timer that fired late (the daemon was not
    /// running) goes to neither: it says nothing about a dead Redis or a
    /// long queue.
    fn record_timeout(&self, slot: Option<(&SlotBreakers, u16)>, permit: &Permit<'_>, now: Instant, took: Duration) {
        let cause = self.timeout_cause(slot, permit, took);
        METRICS.redis_timeout(cause);
        self.in_flight.timed_out(now, permit.ahead, cause == TimeoutCause::Queued);
        if cause == TimeoutCause::RedisSilent {
            match slot {
                Some((slots, slot)) => self.slot_silent(slots, slot, permit, now),
                None => self.count_toward_breaker(permit, now),
            }
        }
    }

    /// A call that got no answer while Redis answered no call of ours:
    /// counts toward opening the breaker (one per deadline of silence).
    fn count_toward_breaker(&self, permit: &Permit<'_>, now: Instant) {
        if self.count_silence(permit, now) && self.breaker.record_failure() {
            METRICS.breaker_opened();
            if let Some(suppressed) = self.trip_log.permit() {
                tracing::warn!(
                    failures = self.settings.breaker_failures,
                    timeout_ms = self.settings.timeout.as_millis() as u64,
                    breaker_opened_before = suppressed,
                    "redis too slow; breaker open, requests follow their fail policy until a probe succeeds"
                );
                self.down_said.store(true, Ordering::Relaxed);
            }
            self.want_reconnect();
        }
    }

    /// Whether a silent timeout is a new deadline of silence: its call was
    /// admitted after the last counted one timed out. Claims it if so.
    fn count_silence(&self, permit: &Permit<'_>, now: Instant) -> bool {
        let last = self.last_counted_us.load(Ordering::Relaxed);
        permit.admitted_us >= last && self.last_counted_us.compare_exchange(last, self.in_flight.micros(now), Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }

    fn want_reconnect(&self) {
        self.reconnect_wanted.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Waits for a script load newer than generation `seen` (after NOSCRIPT).
    async fn wait_for_reload(&self, seen: u64) {
        let loaded = self.loaded.notified();
        tokio::pin!(loaded);
        loaded.as_mut().enable();
        if self.generation() != seen {
            return; // a reload finished since this request read the generation
        }
        self.reload_wanted.store(true, Ordering::Release);
        self.wake.notify_one();
        loaded.await;
    }

    /// True once connected with the script loaded, and the breaker closed.
    pub fn is_ready(&self) -> bool {
        !self.breaker.is_open() && self.generation() > 0
    }

    /// Waits up to `limit` for the link to be ready; returns whether it is.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let loaded = self.loaded.notified();
                if self.is_ready() {
                    return;
                }
                loaded.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }

    /// Waits up to `limit` for the supervisor's first attempt to end: the
    /// link ready (true), or an attempt failed (a Redis that refuses or
    /// times out: false at once, not after `limit`).
    pub async fn wait_first_answer(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let (loaded, failed) = (self.loaded.notified(), self.failed.notified());
                tokio::pin!(loaded, failed);
                loaded.as_mut().enable();
                failed.as_mut().enable();
                if self.is_ready() || self.attempt_failed.load(Ordering::Acquire) {
                    return;
                }
                tokio::select! {
                    _ = loaded => {}
                    _ = failed => {}
                }
            }
        };
        let _ = tokio::time::timeout(limit, wait).await;
        self.is_ready()
    }

    fn publish_load(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.loaded.notify_waiters();
    }
}

const MIN_BACKOFF: Duration = Duration::from_millis(25);
/// Caps the pause between probes, so a returning Redis is back in use
/// within about half a second plus one connect.
const MAX_BACKOFF: Duration = Duration::from_millis(500);
/// A link that fails again this soon after it came up is flapping: the
/// backoff goes on growing instead of starting over.
const STABLE_AFTER: Duration = Duration::from_secs(2);
/// An idle link sends PING this often, so that a Redis `timeout` or a
/// proxy's idle timeout (1 s at the least) never closes it under us.
const KEEPALIVE: Duration = Duration::from_millis(500);
/// A deadline's timer that fires later than 1/LATE_TIMER_DIVISOR of the
/// deadline past it shows a daemon that was not running: its timeouts say
/// nothing about Redis. (Timers are 1 ms grained: 5 ms of 20 is well clear.)
const LATE_TIMER_DIVISOR: u32 = 4;
/// Interval of the breaker's open/close log lines.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// (Re)connects, reloads the script and closes the breaker; runs until shutdown.
async fn supervise(link: Arc<RedisLink>, connector: Connector, shutdown: CancellationToken) {
    let sha = link.script_sha(0);
    let conn_cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(link.settings.connect_timeout))
        .set_response_timeout(Some(link.settings.timeout.max(Duration::from_secs(1))));
    let probe_limit = link.settings.connect_timeout + Duration::from_secs(1);
    let target = connector.describe();
    let mut backoff = MIN_BACKOFF;
    let mut failures = 0u32;
    let mut up_since: Option<Instant> = None;
    loop {
        let needs_link = link.reconnect_wanted.load(Ordering::Acquire) || link.breaker.is_open();
        let needs_load = link.reload_wanted.load(Ordering::Acquire);
        if !needs_link && link.replace_wanted.swap(false, Ordering::AcqRel) {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = replace_stalled(&link, &connector, &conn_cfg, probe_limit) => {}
            }
            continue;
        }
        if !needs_link && !needs_load {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = link.wake.notified() => continue,
                _ = tokio::time::sleep(KEEPALIVE) => {
                    // A request's trip wakes us: reconnecting must not wait
                    // for a PING to a hung server.
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = link.wake.notified() => {}
                        _ = keepalive(&link) => {}
                    }
                    continue;
                }
            }
        }
        if needs_link {
            if let Some(since) = up_since.take() {
                if since.elapsed() < STABLE_AFTER {
                    // Up, then down again at once: wait as after a failure.
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                } else {
                    backoff = MIN_BACKOFF;
                }
            }
        }
        let attempt = async {
            if needs_link {
                link.reconnect_wanted.store(false, Ordering::Release);
                link.reload_wanted.store(false, Ordering::Release);
                // A fresh connection replaces a stalled one too.
                link.replace_wanted.store(false, Ordering::Release);
                let mut conn = connector.connect(&conn_cfg).await?;
                load_script(&link, &mut conn).await?;
                if conn.is_cluster() {
                    // The probe's node may have no script if SCRIPT LOAD
                    // missed it (see `load_script`).
                    match link.probe.query_async::<redis::Value>(&mut conn).await {
                        Err(e) if is_noscript(&e) => eval_source(&link.probe, link.source_of(&link.probe)).query_async::<redis::Value>(&mut conn).await?,
                        other => other?,
                    };
                } else {
                    link.probe.query_async::<redis::Value>(&mut conn).await?;
                }
                link.conn.store(Some(Arc::new(conn)));
            } else {
                link.reload_wanted.store(false, Ordering::Release);
                let mut conn = match &*link.conn.load() {
                    Some(c) => (**c).clone(),
                    None => return Err(RedisError::from(std::io::Error::other("no connection"))),
                };
                load_script(&link, &mut conn).await?;
            }
            Ok::<_, RedisError>(())
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = tokio::time::timeout(probe_limit, attempt) => r,
        };
        match result {
            Ok(Ok(())) => {
                METRICS.script_loaded();
                // Close first, then wake the waiters: they check both.
                let was_open = link.breaker.is_open();
                link.breaker.close();
                link.publish_load();
                if needs_link {
                    up_since = Some(Instant::now());
                }
                if !was_open {
                    tracing::debug!(sha, scripts = link.scripts.len(), "every script reloaded");
                } else if let Some(suppressed) = link.recovery_permit() {
                    tracing::info!(redis = %target, sha, scripts = link.scripts.len(), after_failures = failures, closed_before = suppressed, "redis link up; script loaded; breaker closed");
                }
                failures = 0;
                continue;
            }
            Ok(Err(e)) => {
                failures += 1;
                let reason = e.to_string();
                log_probe_failure(&link, &target, failures, &reason);
                // Start-up stops waiting for a Redis that answered (refused
                // the connection, or said no), not for one that timed out:
                // a slow first connection (a TLS Cluster's handshakes) is
                // tried again within READY_WAIT before any request is
                // decided by its fail policy.
                if !(e.is_timeout() || reason.contains("timed out")) {
                    link.answered_no();
                }
            }
            Err(_) => {
                failures += 1;
                log_probe_failure(&link, &target, failures, &format!("no answer within {probe_limit:?}"));
            }
        }
        // Whatever failed, the next attempt starts from a fresh connection.
        if link.breaker.trip() {
            METRICS.breaker_opened();
        }
        link.reconnect_wanted.store(true, Ordering::Release);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// How often `watch_cluster` looks, and how long the cluster connection
/// may answer nothing while calls of ours wait before it is probed.
const STALL_CHECK: Duration = Duration::from_millis(10);
const STALL_LIMIT_MIN: Duration = Duration::from_millis(25);
const STALL_LIMIT_MAX: Duration = Duration::from_millis(100);

/// Watches a cluster link for a stalled connection, and has it replaced.
///
/// Why: redis-rs 1.8's cluster connection refreshes its slot map after
/// every `MOVED` (a slot move's hand-over) inside its one polling loop,
/// and while the refresh runs no call in flight is polled
/// (`ClusterConnInner::poll_flush` waits on `poll_recover`). The refresh
/// takes the connection map's write lock (a fair tokio `RwLock`): a call
/// that was granted that lock while queued behind another writer, but is
/// not polled any more, holds it for ever, and the refresh waits for it.
/// Seen during slot moves under mixed traffic: "beginning slot refresh"
/// with no "slot refresh complete", every call of the daemon timing out
/// until the breaker replaced the connection 2.5 s later (the class of
/// valkey-glide #2643 and #3946, redis-rs #882). The symptom is all this
/// tells us from outside: calls in flight and no answer to any of them for
/// `stall_limit`. Then one `PING` to every primary, answered when the
/// first answers: a healthy connection with slow nodes answers it; a
/// stalled one cannot. No answer: the supervisor builds a fresh cluster
/// connection beside the old one and puts it in place (the breaker is not
/// touched; if that fails, nothing changes). The calls already waiting on
/// the old one get their deadline's timeout (re-sending them would need a
/// wake-up registered per call on the request path); the next ones go to
/// the new connection.
async fn watch_cluster(link: std::sync::Weak<RedisLink>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(STALL_CHECK) => {}
        }
        let Some(link) = link.upgrade() else { return };
        let stall_limit = (link.settings.timeout / 5).clamp(STALL_LIMIT_MIN, STALL_LIMIT_MAX);
        if link.in_flight.current() == 0 || link.breaker.is_open() || link.replace_wanted.load(Ordering::Acquire) {
            continue;
        }
        let now = link.in_flight.micros(Instant::now());
        let quiet_since = link.in_flight.last_answer_us().max(link.last_replaced_us.load(Ordering::Relaxed));
        if now.saturating_sub(quiet_since) < stall_limit.as_micros() as u64 {
            continue;
        }
        let Some(conn) = link.conn.load_full() else { continue };
        let LinkConnection::Cluster(mut cluster) = (*conn).clone() else { return };
        let ping = redis::cmd("PING");
        let routing = redis::cluster_routing::RoutingInfo::MultiNode((redis::cluster_routing::MultipleNodeRoutingInfo::AllMasters, Some(redis::cluster_routing::ResponsePolicy::OneSucceeded)));
        let answered = tokio::time::timeout(stall_limit, cluster.route_command(ping, routing)).await.is_ok_and(|r| r.is_ok());
        if answered {
            // Alive: note it, so a slow node is not probed every check.
            link.last_replaced_us.fetch_max(link.in_flight.micros(Instant::now()), Ordering::Relaxed);
            continue;
        }
        link.replace_wanted.store(true, Ordering::Release);
        link.wake.notify_one();
    }
}

/// Builds a fresh cluster connection and puts it in place of a stalled one
/// (`watch_cluster`); on failure the old one stays, and the breaker is not
/// touched.
async fn replace_stalled(link: &RedisLink, connector: &Connector, conn_cfg: &AsyncConnectionConfig, limit: Duration) {
    let fresh = async {
        let mut conn = connector.connect(conn_cfg).await?;
        load_script(link, &mut conn).await?;
        Ok::<_, RedisError>(conn)
    };
    match tokio::time::timeout(limit, fresh).await {
        Ok(Ok(conn)) => {
            link.conn.store(Some(Arc::new(conn)));
            link.last_replaced_us.fetch_max(link.in_flight.micros(Instant::now()), Ordering::Relaxed);
            METRICS.script_loaded();
            if let Some(suppressed) = link.stall_log.permit() {
                tracing::warn!(replaced_before = suppressed, "the redis cluster connection answered nothing while calls waited, and no primary answered a PING through it: replaced by a fresh one (redis-rs stalled in a slot-map refresh)");
            }
        }
        failed => {
            // Not probed again before another `stall_limit` of silence.
            link.last_replaced_us.fetch_max(link.in_flight.micros(Instant::now()), Ordering::Relaxed);
            if let Some(suppressed) = link.stall_log.permit() {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no fresh connection within {limit:?}"),
                };
                tracing::warn!(%error, suppressed, "the redis cluster connection looks stalled, and a fresh one could not be made; keeping the old one");
            }
        }
    }
}

/// Runs `cmd` where its slot is now: follows a redirect redis-rs gave up
/// on (`follow_redirect`), and sends the call again on `TRYAGAIN` until
/// `deadline`.
///
/// `TRYAGAIN`: while a Cluster slot migrates, a call naming several keys of
/// the slot gets it from the source node when some of its keys have moved
/// (or never existed: a penalty box's ban and strike keys, a settle record)
/// and others have not, and from the importing node (after `ASKING`) when
/// any is missing there; it lasts until the last key has moved or the slot
/// is handed over. Every script but the plain checks' names more than one
/// key, so a resharding sent them all to the fail policy (issue 33: 133 of
/// 167 penalty checks, a banned key admitted under `on_error = "open"`).
/// The call is sent again after a pause of 1 ms doubling up to 16 ms (a
/// migration of a slot's keys takes milliseconds to seconds: often enough
/// to catch its end, rarely enough not to load the nodes), as long as the
/// pause ends before `deadline`; then the `TRYAGAIN` stands (an answer:
/// the fail policy decides, and the breaker counts Redis alive). On the
/// request path only after an error: no cost to a call that succeeds.
///
/// A redirect still standing after `follow_redirect`'s hops is paused for
/// and sent again the same way: during a hand-over the nodes learn the
/// slot's new owner one `SETSLOT NODE` at a time, and until the importing
/// node has it the two send a call back and forth (`MOVED` both ways;
/// seen in `ask_redirects_are_followed_during_a_manual_slot_move` beside a
/// parallel build). A redirect means the script did not run, so sending it
/// again counts nothing twice.
async fn routed<T: FromRedisValue>(cmd: &Cmd, conn: &mut LinkConnection, deadline: Instant) -> Result<T, RedisError> {
    let mut pause = TRYAGAIN_FIRST_PAUSE;
    loop {
        let reply = match cmd.query_async::<T>(conn).await {
            Err(e) if is_redirect(&e) => follow_redirect(cmd, e, conn).await,
            other => other,
        };
        match reply {
            Err(e) if (is_tryagain(&e) || is_redirect(&e)) && conn.is_cluster() && Instant::now() + pause < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(TRYAGAIN_MAX_PAUSE);
            }
            other => return other,
        }
    }
}

const TRYAGAIN_FIRST_PAUSE: Duration = Duration::from_millis(1);
const TRYAGAIN_MAX_PAUSE: Duration = Duration::from_millis(16);

fn is_tryagain(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain)
}

/// A redirect redis-rs gave up on (see `follow_redirect`).
fn is_redirect(e: &RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::Server(redis::ServerErrorKind::Ask | redis::ServerErrorKind::Moved))
}

/// Redirects followed here, one after the other, before the error stands.
const REDIRECT_HOPS: usize = 4;

/// Follows a redirect that redis-rs gave up on. During a slot migration
/// redis-rs (cluster-async 1.8) follows `ASK` by sending `ASKING` and then
/// the command as two requests on the importing node's shared multiplexed
/// connection, awaiting the first before writing the second. Many calls
/// redirected at once (a busy slot) write their `ASKING`s back to back,
/// and the first command to follow consumes the node's one-shot flag: the
/// others meet the importing node without it, are sent back (`MOVED` to
/// the old node, which answers `ASK` again), one more gets through per
/// round, and after its 16 retries the caller gets the `MOVED` or `ASK`
/// error. Here `ASK` is followed with one pipeline `ASKING` + command to
/// the node named (a pipeline is written in one piece: nothing comes
/// between), and `MOVED` with the command to the node named.
async fn follow_redirect<T: FromRedisValue>(cmd: &Cmd, first: RedisError, conn: &mut LinkConnection) -> Result<T, RedisError> {
    let LinkConnection::Cluster(cluster) = conn else { return Err(first) };
    let mut err = first;
    for _ in 0..REDIRECT_HOPS {
        let ask = err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Ask);
        let Some((host, port)) = err.redirect_node().and_then(|(node, _slot)| node.rsplit_once(':')).and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?))) else {
            return Err(err);
        };
        let mut pipe = redis::pipe();
        if ask {
            pipe.cmd("ASKING");
        }
        pipe.add_command(cmd.clone());
        let route = redis::cluster_routing::SingleNodeRoutingInfo::ByAddress { host, port };
        let reply = cluster.route_pipeline(pipe, usize::from(ask), 1, route).await.and_then(|mut values| values.pop().ok_or_else(|| RedisError::from(std::io::Error::other("redirected call: no reply"))));
        match reply.and_then(|v| v.extract_error()) {
            Err(e) if is_redirect(&e) => err = e,
            Err(e) => return Err(e),
            Ok(v) => return T::from_redis_value(v).map_err(RedisError::from),
        }
    }
    Err(err)
}

/// The hash slot of an EVALSHA's (or EVAL's) first key, which is the slot
/// the call goes to; None for a call with no key.
fn first_key_slot(cmd: &Cmd) -> Option<u16> {
    fn simple<'a>(a: Option<redis::Arg<&'a [u8]>>) -> Option<&'a [u8]> {
        match a {
            Some(redis::Arg::Simple(b)) => Some(b),
            _ => None,
        }
    }
    let mut args = cmd.args_iter().skip(2);
    let numkeys = simple(args.next())?;
    if numkeys == b"0" {
        return None;
    }
    simple(args.next()).map(super::keys::key_slot)
}

fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// `cmd`, an EVALSHA, as the EVAL of `source` with the same keys and
/// arguments. Built only after a NOSCRIPT, never on the request path.
fn eval_source(cmd: &Cmd, source: &str) -> Cmd {
    let mut eval = redis::cmd("EVAL");
    eval.arg(source);
    for arg in cmd.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = arg {
            eval.arg(bytes);
        }
    }
    eval
}

/// `SCRIPT LOAD` over `conn`. On a cluster redis-rs sends it to every node,
/// replicas too (so a replica promoted later already has it), and fails if
/// any one node does not answer: a node down must not keep the link down
/// (the others decide their keys), so there it is only logged; a node
/// without the script answers NOSCRIPT and gets an EVAL (`eval`).
async fn load_script(link: &RedisLink, conn: &mut LinkConnection) -> Result<(), RedisError> {
    for (script, _) in link.scripts.iter() {
        match script.load_async(conn).await {
            Ok(_) => {}
            Err(e) if conn.is_cluster() => {
                tracing::debug!(error = %e, "SCRIPT LOAD did not reach every cluster node; nodes without the script get EVAL on NOSCRIPT");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// PINGs the idle link. A lost connection is found here rather than by the
/// next request; a slow answer is left to the requests' own deadlines.
async fn keepalive(link: &RedisLink) {
    let Some(conn) = &*link.conn.load() else { return };
    if link.breaker.is_open() {
        return;
    }
    let mut conn = (**conn).clone();
    let ping = tokio::time::timeout(Duration::from_secs(1), redis::cmd("PING").query_async::<redis::Value>(&mut conn)).await;
    if let Ok(Err(e)) = ping {
        // A cluster's PING goes to every primary; one that fails is that
        // node's affair (see `record_failure`).
        if matches!(classify(&e), Failure::Link) && !conn.is_cluster() {
            link.link_lost(&e);
        }
    }
}

fn log_probe_failure(link: &RedisLink, target: &str, failures: u32, reason: &str) {
    // The first failure, then every 60th: about every 30 s when attempts
    // fail at once, longer when each waits out a connect timeout.
    if failures == 1 || failures % 60 == 0 {
        tracing::warn!(redis = %target, failures, reason, "cannot reach redis; requests follow their fail policy");
        link.down_said.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_s_slot_is_its_first_key_s() {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg("0123").arg(2).arg("ratelimitd:{t1}:1000ms").arg("other");
        assert_eq!(first_key_slot(&cmd), Some(super::super::keys::key_slot(b"t1")));
        let mut none = redis::cmd("EVALSHA");
        none.arg("0123").arg(0).arg("x");
        assert_eq!(first_key_slot(&none), None);
        assert_eq!(first_key_slot(&redis::cmd("PING")), None);
    }

    #[test]
    fn errors_are_classified_by_what_they_mean_for_the_link() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(classify(&io), Failure::Link));
        let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(matches!(classify(&timeout), Failure::Link | Failure::Slow));
    }
}
