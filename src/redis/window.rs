//! The exact sliding window in Redis: one ZSET per key, decided by one
//! atomic Lua script called with EVALSHA over the daemon's one shared link
//! (`link`), which owns the deadline, reconnects, reloads the script and
//! breaks the circuit on its own. This module knows the script: its keys,
//! its arguments and its reply. The hot path never takes a lock.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::{RedisWrite, Script, ToRedisArgs};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::coalesce::{Answer, Batch, ColdLanes, ColdWaiter, InFlight, Join, Lane, Waiter, MAX_BATCH};
use super::connector::{Connector, ConnectorError};
use super::keys::{verdict, WindowKey};
use super::link::{LinkSettings, RedisLink};
use super::scripts;
use super::multi::{MultiAnswer, MultiAsk, RefundItem, RefundOutcome, Reservations};
use crate::denial_cache::DenialCache;
use crate::config::{ClockSource, RedisConfig, RedisSecrets};
use crate::protocol::Algorithm;
use crate::metrics::METRICS;
use crate::window::{LimitSpec, StoreError, Verdict};

/// The link's index of the penalty box's script: after the algorithms' and
/// the leases'.
const PENALTY_SCRIPT: usize = Algorithm::ALL.len() + 1;

/// The script of each algorithm; the link holds them in `Algorithm::ALL`
/// order, so `Algorithm::index` names its SHA there.
const fn script_of(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::Log => scripts::LOG,
        Algorithm::Ring => scripts::RING,
        Algorithm::Gcra => scripts::GCRA,
        Algorithm::SlidingCounter => scripts::SLIDING_COUNTER,
        Algorithm::Fixed => scripts::FIXED,
    }
}

/// The Redis key of a key's concurrency leases: the stem, then
/// `:concurrency` (src/redis/scripts/concurrency_slots.lua).
#[derive(Clone, Copy, Debug)]
struct LeaseKey<'a>(WindowKey<'a>);

impl LeaseKey<'_> {
    fn write_into(&self, w: &mut impl Write) -> std::io::Result<()> {
        self.0.write_stem(w).and_then(|()| w.write_all(b":concurrency"))
    }
}

impl ToRedisArgs for LeaseKey<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let _ = self.write_into(&mut out.writer_for_next_arg());
    }
}

/// A Redis key of a key's penalty box: the stem, then `suffix`
/// (`:penalty:ban`, `:penalty:strikes`), so in the key's Cluster slot.
#[derive(Clone, Copy, Debug)]
struct PenaltyKey<'a>(WindowKey<'a>, &'static [u8]);

impl PenaltyKey<'_> {
    fn write_into(&self, w: &mut impl Write) -> std::io::Result<()> {
        self.0.write_stem(w).and_then(|()| w.write_all(self.1))
    }
}

impl ToRedisArgs for PenaltyKey<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let _ = self.write_into(&mut out.writer_for_next_arg());
    }
}

/// The suffix of a key's ban.
pub const BAN_SUFFIX: &[u8] = b":penalty:ban";
/// The suffix of a key's strikes (refusals counted towards a ban).
pub const STRIKES_SUFFIX: &[u8] = b":penalty:strikes";

/// What the penalty box's script answered besides the window's verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PenaltyState {
    /// Not 0: the key is banned for this many ms more (the request was
    /// refused for it).
    pub banned_ms: u32,
    /// This request's refusal engaged the ban, which ends then (Unix ms,
    /// the script's clock).
    pub engaged: Option<u64>,
}

impl WindowKey<'_> {
    /// The Redis key of this key's ban (admin tools).
    pub fn ban_key(self) -> Vec<u8> {
        let mut v = Vec::new();
        PenaltyKey(self, BAN_SUFFIX).write_into(&mut v).expect("writing to a Vec cannot fail");
        v
    }

    /// The Redis key of this key's strikes (admin tools).
    pub fn strikes_key(self) -> Vec<u8> {
        let mut v = Vec::new();
        PenaltyKey(self, STRIKES_SUFFIX).write_into(&mut v).expect("writing to a Vec cannot fail");
        v
    }

    /// The Redis key of this key's concurrency leases (admin tools; the
    /// window and algorithm are not part of it).
    pub fn lease_key(self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.prefix.len() + self.key.len() + 16);
        LeaseKey(self).write_into(&mut v).expect("writing to a Vec cannot fail");
        v
    }
}

/// A ZSET member that no other request shares: a random 64-bit id drawn at
/// start-up (distinct across daemons and restarts) and a per-process sequence.
#[derive(Clone, Copy, Debug)]
struct MemberId {
    instance: u64,
    seq: u64,
}

impl ToRedisArgs for MemberId {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let _ = write!(out.writer_for_next_arg(), "{:016x}:{}", self.instance, self.seq);
    }
}

/// The Redis backend.
pub struct RedisWindow {
    link: Arc<RedisLink>,
    key_prefix: Box<[u8]>,
    instance: u64,
    seq: AtomicU64,
    clock: ClockSource,
    /// Windows with a call in flight, and the requests queued for the next.
    in_flight: InFlight,
    /// A Redis Cluster: a call's keys must share a slot.
    cluster: bool,
    /// Multi-item checks and refunds, and the tasks they leave running.
    multi: Arc<Reservations>,
    /// Cold log keys batched across keys (`redis.batch_cold_keys`; never
    /// on a Cluster).
    cold: Option<ColdLanes>,
}

/// One request of a call: the call names the key and window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchAsk {
    pub limit: u32,
    pub cost: u32,
}

impl std::fmt::Debug for RedisWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisWindow").field("instance", &format_args!("{:016x}", self.instance)).field("link", &self.link).finish()
    }
}

impl RedisWindow {
    /// Builds the backend and starts its link, which stops with `shutdown`.
    /// Does not wait for Redis: until the link is up, requests follow their
    /// fail policy. Use `wait_ready` to wait a bounded time.
    pub fn start(cfg: &RedisConfig, secrets: &RedisSecrets, shutdown: CancellationToken) -> Result<Arc<Self>, StartError> {
        let connector = Connector::new(cfg, secrets)?;
        let instance = instance_id()?;
        let script = Script::new(scripts::LOG);
        let probe = probe_command(&script, cfg.key_prefix.as_bytes(), instance);
        // The algorithms' scripts in `Algorithm::ALL` order, then the leases'.
        // The algorithms' scripts, the leases' and the penalty box's.
        let sources: Vec<&'static str> = Algorithm::ALL.iter().map(|&a| script_of(a)).chain([scripts::CONCURRENCY, scripts::PENALIZED_CHECK]).collect();
        let link = RedisLink::start(connector, &sources, probe, LinkSettings::from(cfg), shutdown);
        Ok(Arc::new(Self {
            multi: Arc::new(Reservations::new(link.clone(), cfg.key_prefix.as_bytes())),
            link,
            key_prefix: cfg.key_prefix.as_bytes().into(),
            instance,
            seq: AtomicU64::new(0),
            clock: cfg.clock,
            in_flight: InFlight::default(),
            cluster: matches!(cfg.target, crate::config::RedisTarget::Cluster(_)),
            cold: (cfg.batch_cold_keys && !matches!(cfg.target, crate::config::RedisTarget::Cluster(_))).then(ColdLanes::default),
        }))
    }

    /// The SHA1 that EVALSHA names for the log.
    pub fn script_sha(&self) -> &str {
        self.link.script_sha(Algorithm::Log.index())
    }

    /// True while requests reach Redis: connected, script loaded, breaker closed.
    pub fn is_ready(&self) -> bool {
        self.link.is_ready()
    }

    pub fn breaker_open(&self) -> bool {
        self.link.breaker_open()
    }

    /// Waits up to `limit` for the link to be up; returns whether it is.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        self.link.wait_ready(limit).await
    }

    /// Waits up to `limit` for the link's first attempt: ready (true), or
    /// failed (false, as soon as it has).
    pub async fn wait_first_answer(&self, limit: Duration) -> bool {
        self.link.wait_first_answer(limit).await
    }

    /// The Redis key for a client key.
    fn window_key<'a>(&'a self, key: &'a [u8], window_ms: u32, algorithm: Algorithm) -> WindowKey<'a> {
        WindowKey { prefix: &self.key_prefix, key, window_ms, algorithm }
    }

    /// `now` as the script takes it: 0 for Redis `TIME`, else this host's clock.
    fn now_arg(&self) -> u64 {
        match self.clock {
            ClockSource::Redis => 0,
            ClockSource::Local => wall_clock_ms(),
        }
    }

    /// Decides one request within the configured deadline. If a call for
    /// the same key and window is in flight, the request waits for it and
    /// goes to Redis with the others that queued meanwhile, in one call
    /// (`coalesce`); it is answered within the deadline either way.
    pub async fn check(self: &Arc<Self>, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Result<Verdict, StoreError> {
        let fp = self.in_flight.fingerprint(spec.key, spec.window_ms, algorithm);
        match self.in_flight.join(fp, spec.key, spec.window_ms, algorithm, spec.limit, spec.cost) {
            Join::Alone => self.check_cold(spec, algorithm).await,
            Join::Lead => {
                // Dropped with the future too (a client gone mid-call), so
                // the requests queued behind this call are always sent.
                let _lead = Lead { window: self, fp };
                self.check_cold(spec, algorithm).await
            }
            Join::Wait(rx) => self.batched_answer(rx).await,
        }
    }

    /// The answer a batched call sends back to a request queued on it,
    /// within the deadline. At the deadline its queue place is skipped if
    /// the batch has not started yet; else it may still be counted, as any
    /// call cut at its deadline.
    async fn batched_answer(&self, rx: oneshot::Receiver<Answer>) -> Result<Verdict, StoreError> {
        let limit = self.link.timeout();
        match tokio::time::timeout(limit, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(StoreError::Unavailable("the batched call was abandoned (shutting down)".into())),
            Err(_) => Err(StoreError::Timeout(limit)),
        }
    }

    /// The one call of a window with no call in flight: sent at once, or,
    /// with cold keys batched and every lane busy, queued for the next
    /// call across keys.
    async fn check_cold(self: &Arc<Self>, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Result<Verdict, StoreError> {
        let Some(cold) = self.cold.as_ref().filter(|_| algorithm == Algorithm::Log) else {
            return self.check_at_with(spec, algorithm, self.now_arg()).await;
        };
        match cold.enter(spec.key, spec.window_ms, spec.limit, spec.cost) {
            Lane::Send => {
                // Dropped with the future too: the queue behind is always sent.
                let _lane = ColdLane { window: self };
                self.check_at_with(spec, algorithm, self.now_arg()).await
            }
            Lane::Queued(rx) => self.batched_answer(rx).await,
        }
    }

    /// Sends the cold checks queued behind a lane's call, one call across
    /// keys after another, until none are left; then frees the lane.
    async fn drain_cold(self: Arc<Self>, mut waiters: Vec<ColdWaiter>) {
        loop {
            waiters.retain(|w| !w.tx.is_closed());
            if !waiters.is_empty() {
                METRICS.coalesced(waiters.len() as u64);
                let verdicts = self.check_keys_at(&waiters, self.now_arg()).await;
                answer_each(waiters.into_iter().map(|w| w.tx), verdicts);
            }
            match self.cold.as_ref().and_then(ColdLanes::leave) {
                Some(next) => waiters = next,
                None => return,
            }
        }
    }

    /// Checks of different log keys in one call (mode 'B'), each decided
    /// exactly as a call of its own at `now_ms` (0 = Redis `TIME`).
    async fn check_keys_at(&self, asks: &[ColdWaiter], now_ms: u64) -> Result<Vec<Verdict>, StoreError> {
        let member = MemberId { instance: self.instance, seq: self.seq.fetch_add(1, Ordering::Relaxed) };
        let mut cmd = redis::Cmd::with_capacity(6 + 4 * asks.len(), 64 + asks.iter().map(|a| 48 + self.key_prefix.len() + a.key.len()).sum::<usize>());
        cmd.arg("EVALSHA").arg(self.link.script_sha(Algorithm::Log.index())).arg(asks.len());
        for a in asks {
            cmd.arg(self.window_key(&a.key, a.window_ms, Algorithm::Log));
        }
        cmd.arg("B").arg(now_ms).arg(member);
        for a in asks {
            cmd.arg(a.window_ms).arg(a.limit).arg(a.cost);
        }
        let flat: Vec<i64> = self.link.eval(&cmd).await?;
        if flat.len() != 5 * asks.len() {
            return Err(StoreError::Redis(format!("the script answered {} values for {} keys", flat.len(), asks.len())));
        }
        Ok(flat.chunks_exact(5).map(|v| verdict(v[0], v[1], v[2], v[3], v[4])).collect())
    }

    /// Sends the requests that queued behind a finished call, batch after
    /// batch, until none are left; runs as a task of its own.
    async fn drain(self: Arc<Self>, fp: u128, mut batch: Batch) {
        loop {
            let Batch { key, window_ms, algorithm, mut waiters } = batch;
            while !waiters.is_empty() {
                let rest = if waiters.len() > MAX_BATCH { waiters.split_off(MAX_BATCH) } else { Vec::new() };
                self.send_batch(&key, window_ms, algorithm, waiters).await;
                waiters = rest;
            }
            match self.in_flight.next_batch(fp) {
                Some(next) => batch = next,
                None => return,
            }
        }
    }

    /// One call for `waiters`, each answered with its own verdict. Requests
    /// already answered by their deadline are left out, so they are not
    /// counted.
    async fn send_batch(&self, key: &[u8], window_ms: u32, algorithm: Algorithm, waiters: Vec<Waiter>) {
        let waiters: Vec<Waiter> = waiters.into_iter().filter(|w| !w.tx.is_closed()).collect();
        if waiters.is_empty() {
            return;
        }
        METRICS.coalesced(waiters.len() as u64);
        let asks: Vec<BatchAsk> = waiters.iter().map(|w| BatchAsk { limit: w.limit, cost: w.cost }).collect();
        let verdicts = self.check_batch_at_with(key, window_ms, algorithm, &asks, self.now_arg()).await;
        answer_each(waiters.into_iter().map(|w| w.tx), verdicts);
    }

    /// Decides one request at `now_ms` (0 = Redis `TIME`), in a call of its
    /// own.
    pub async fn check_at(&self, spec: &LimitSpec<'_>, now_ms: u64) -> Result<Verdict, StoreError> {
        self.check_at_with(spec, Algorithm::Log, now_ms).await
    }

    /// `check_at` counted by `algorithm`.
    pub async fn check_at_with(&self, spec: &LimitSpec<'_>, algorithm: Algorithm, now_ms: u64) -> Result<Verdict, StoreError> {
        let member = MemberId { instance: self.instance, seq: self.seq.fetch_add(1, Ordering::Relaxed) };
        let mut cmd = redis::Cmd::with_capacity(9, 96 + self.key_prefix.len() + spec.key.len());
        cmd.arg("EVALSHA")
            .arg(self.link.script_sha(algorithm.index()))
            .arg(1)
            .arg(self.window_key(spec.key, spec.window_ms, algorithm))
            .arg(spec.window_ms)
            .arg(now_ms)
            .arg(member)
            .arg(spec.limit)
            .arg(spec.cost);
        let (allowed, count, remaining, retry_after_ms, reset_ms): (i64, i64, i64, i64, i64) = self.link.eval(&cmd).await?;
        Ok(verdict(allowed, count, remaining, retry_after_ms, reset_ms))
    }

    /// Acquires (`acquire`) or releases a concurrency lease, in a call of
    /// its own: no coalescing (each lease is a member of its own), and the
    /// caller keeps the denial cache out (a release frees a slot at any
    /// time). The reply is a verdict: see src/redis/scripts/concurrency_slots.lua.
    pub async fn lease(&self, acquire: bool, key: &[u8], lease: &[u8], limit: u32, lease_ms: u32, cost: u32) -> Result<Verdict, StoreError> {
        let mut cmd = redis::Cmd::with_capacity(10, 128 + self.key_prefix.len() + key.len() + lease.len());
        cmd.arg("EVALSHA")
            .arg(self.link.script_sha(Algorithm::ALL.len()))
            .arg(1)
            .arg(LeaseKey(self.window_key(key, 0, Algorithm::Log)))
            .arg(if acquire { "acquire" } else { "release" })
            .arg(self.now_arg())
            .arg(lease)
            .arg(limit)
            .arg(lease_ms)
            .arg(cost);
        let (allowed, count, remaining, retry_after_ms, reset_ms): (i64, i64, i64, i64, i64) = self.link.eval(&cmd).await?;
        Ok(verdict(allowed, count, remaining, retry_after_ms, reset_ms))
    }

    /// Decides one request of a policy with a penalty box (the log), in a
    /// call of its own (never coalesced, no quota lease): the key's ban is
    /// read, the window decided and a refusal counted as a strike in the
    /// same atomic call (src/redis/scripts/penalized_check.lua).
    pub async fn check_penalized(&self, spec: &LimitSpec<'_>, after: u32, within_ms: u32, ban_ms: u32) -> Result<(Verdict, PenaltyState), StoreError> {
        let member = MemberId { instance: self.instance, seq: self.seq.fetch_add(1, Ordering::Relaxed) };
        let stem = self.window_key(spec.key, 0, Algorithm::Log);
        let mut cmd = redis::Cmd::with_capacity(14, 160 + 3 * (self.key_prefix.len() + spec.key.len()));
        cmd.arg("EVALSHA")
            .arg(self.link.script_sha(PENALTY_SCRIPT))
            .arg(3)
            .arg(self.window_key(spec.key, spec.window_ms, Algorithm::Log))
            .arg(PenaltyKey(stem, BAN_SUFFIX))
            .arg(PenaltyKey(stem, STRIKES_SUFFIX))
            .arg(spec.window_ms)
            .arg(self.now_arg())
            .arg(member)
            .arg(spec.limit)
            .arg(spec.cost)
            .arg(after)
            .arg(within_ms)
            .arg(ban_ms);
        let r: (i64, i64, i64, i64, i64, i64, i64) = self.link.eval(&cmd).await?;
        Ok((verdict(r.0, r.1, r.2, r.3, r.4), PenaltyState { banned_ms: r.5.clamp(0, i64::from(u32::MAX)) as u32, engaged: (r.6 > 0).then_some(r.6 as u64) }))
    }

    /// The fleet's index of bans, `<key_prefix>admin:bans`.
    pub fn penalty_index_key(&self) -> Vec<u8> {
        let mut k = self.key_prefix.to_vec();
        k.extend_from_slice(b"admin:bans");
        k
    }

    /// Adds a ban this daemon's request engaged to the fleet's index of
    /// bans (`admin_api::bans`), so that the admin API lists it: once per
    /// ban, off the request path.
    pub async fn note_ban(&self, index_key: &[u8], scoped: &[u8], ends_at_ms: u64) -> Result<(), StoreError> {
        let mut cmd = redis::Cmd::with_capacity(4, 32 + index_key.len() + scoped.len());
        cmd.arg("ZADD").arg(index_key).arg(ends_at_ms).arg(scoped);
        let _: i64 = self.link.eval(&cmd).await?;
        Ok(())
    }

    /// Decides `asks` in one call, in order, each exactly as a call of its
    /// own at the same instant would (`now_ms`: 0 = Redis `TIME`).
    pub async fn check_batch_at(&self, key: &[u8], window_ms: u32, asks: &[BatchAsk], now_ms: u64) -> Result<Vec<Verdict>, StoreError> {
        self.check_batch_at_with(key, window_ms, Algorithm::Log, asks, now_ms).await
    }

    /// `check_batch_at` counted by `algorithm`.
    pub async fn check_batch_at_with(&self, key: &[u8], window_ms: u32, algorithm: Algorithm, asks: &[BatchAsk], now_ms: u64) -> Result<Vec<Verdict>, StoreError> {
        let member = MemberId { instance: self.instance, seq: self.seq.fetch_add(1, Ordering::Relaxed) };
        let mut cmd = redis::Cmd::with_capacity(7 + 2 * asks.len(), 96 + self.key_prefix.len() + key.len() + 16 * asks.len());
        cmd.arg("EVALSHA").arg(self.link.script_sha(algorithm.index())).arg(1).arg(self.window_key(key, window_ms, algorithm)).arg(window_ms).arg(now_ms).arg(member);
        for a in asks {
            cmd.arg(a.limit).arg(a.cost);
        }
        let flat: Vec<i64> = self.link.eval(&cmd).await?;
        if flat.len() != 5 * asks.len() {
            return Err(StoreError::Redis(format!("the script answered {} values for {} requests", flat.len(), asks.len())));
        }
        Ok(flat.chunks_exact(5).map(|v| verdict(v[0], v[1], v[2], v[3], v[4])).collect())
    }
}

/// What a lease call answered (src/redis/scripts/sliding_window.lua, mode 'L').
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseGrant {
    /// The request's own verdict; its count includes the units reserved.
    pub verdict: Verdict,
    /// Units reserved for local admissions (0: none).
    pub granted: u32,
    /// The script's clock when it ran (Redis TIME, or the caller's `now`).
    pub now_ms: u64,
    /// Names the units: they are `<instance>:<seq>.l<u>`.
    pub seq: u64,
}

impl RedisWindow {
    /// Decides one log request (cost at most its limit) and, if it is
    /// admitted, reserves up to `want` units of the key's quota for local
    /// admissions during `life_ms` after this call was sent. Never
    /// coalesced; `now_ms` 0 = Redis `TIME`.
    pub async fn lease_at(&self, spec: &LimitSpec<'_>, want: u32, life_ms: u32, now_ms: u64) -> Result<LeaseGrant, StoreError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut cmd = redis::Cmd::with_capacity(12, 128 + self.key_prefix.len() + spec.key.len());
        cmd.arg("EVALSHA")
            .arg(self.link.script_sha(Algorithm::Log.index()))
            .arg(1)
            .arg(self.window_key(spec.key, spec.window_ms, Algorithm::Log))
            .arg("L")
            .arg(spec.window_ms)
            .arg(now_ms)
            .arg(MemberId { instance: self.instance, seq })
            .arg(spec.limit)
            .arg(spec.cost)
            .arg(want)
            .arg(life_ms);
        let r: (i64, i64, i64, i64, i64, i64, i64) = self.link.eval(&cmd).await?;
        Ok(LeaseGrant { verdict: verdict(r.0, r.1, r.2, r.3, r.4), granted: r.5.clamp(0, i64::from(want)) as u32, now_ms: r.6.max(0) as u64, seq })
    }

    /// `lease_at` on this backend's clock.
    pub async fn lease_now(&self, spec: &LimitSpec<'_>, want: u32, life_ms: u32) -> Result<LeaseGrant, StoreError> {
        self.lease_at(spec, want, life_ms, self.now_arg()).await
    }

    /// Settles lease `seq` of `granted` units on the log window `key`:
    /// units 1..=scores.len() get those scores, the rest are removed.
    /// Returns (rescored, removed).
    pub async fn settle_lease(&self, key: &[u8], window_ms: u32, seq: u64, granted: u32, scores: &[u64]) -> Result<(i64, i64), StoreError> {
        let _removing = self.removing(key, window_ms);
        let mut cmd = redis::Cmd::with_capacity(7 + scores.len(), 96 + self.key_prefix.len() + key.len() + 14 * scores.len());
        cmd.arg("EVALSHA")
            .arg(self.link.script_sha(Algorithm::Log.index()))
            .arg(1)
            .arg(self.window_key(key, window_ms, Algorithm::Log))
            .arg("S")
            .arg(MemberId { instance: self.instance, seq })
            .arg(granted);
        for s in scores {
            cmd.arg(*s);
        }
        self.link.eval(&cmd).await
    }
}

/// The Redis key of a reserve's settle record: the window's key, then
/// `:settle:` and the handle in hex (same slot as the window).
fn settle_record_key(window: WindowKey<'_>, handle: &[u8; 16]) -> Vec<u8> {
    let mut v = window.to_vec();
    v.extend_from_slice(b":settle:");
    for b in handle {
        let _ = write!(v, "{b:02x}");
    }
    v
}

impl RedisWindow {
    /// Reserves `spec.cost` (an estimate) on an O(1) algorithm's window and,
    /// when admitted, writes the settle record `handle` names, in the same
    /// atomic call (docs/PROTOCOL.md 4f). Never coalesced.
    pub async fn reserve(&self, spec: &LimitSpec<'_>, algorithm: Algorithm, handle: &[u8; 16]) -> Result<Verdict, StoreError> {
        let window = self.window_key(spec.key, spec.window_ms, algorithm);
        let mut cmd = redis::Cmd::with_capacity(10, 160 + 2 * (self.key_prefix.len() + spec.key.len()));
        cmd.arg("EVALSHA").arg(self.link.script_sha(algorithm.index())).arg(2).arg(window).arg(settle_record_key(window, handle));
        cmd.arg(spec.window_ms).arg(self.now_arg()).arg("r").arg(spec.limit).arg(spec.cost);
        let (allowed, count, remaining, retry_after_ms, reset_ms): (i64, i64, i64, i64, i64) = self.link.eval(&cmd).await?;
        Ok(verdict(allowed, count, remaining, retry_after_ms, reset_ms))
    }

    /// Settles the reserve `handle` names to `actual` (`spec.cost`): the
    /// record is read and deleted and the window moved by the difference,
    /// atomically. `None`: no such record (forged, replayed, expired), and
    /// nothing changed. The verdict is the window after the settle.
    pub async fn settle_reserve(&self, spec: &LimitSpec<'_>, algorithm: Algorithm, handle: &[u8; 16]) -> Result<Option<Verdict>, StoreError> {
        let _removing = self.removing(spec.key, spec.window_ms);
        let window = self.window_key(spec.key, spec.window_ms, algorithm);
        let mut cmd = redis::Cmd::with_capacity(10, 160 + 2 * (self.key_prefix.len() + spec.key.len()));
        cmd.arg("EVALSHA").arg(self.link.script_sha(algorithm.index())).arg(2).arg(window).arg(settle_record_key(window, handle));
        cmd.arg(spec.window_ms).arg(self.now_arg()).arg("s").arg(spec.limit).arg(spec.cost);
        let (matched, count, remaining, retry_after_ms, reset_ms): (i64, i64, i64, i64, i64) = self.link.eval(&cmd).await?;
        Ok((matched == 1).then(|| verdict(i64::from(remaining > 0), count, remaining, retry_after_ms, reset_ms)))
    }

    /// Decides several items all or nothing, within one deadline
    /// (docs/PROTOCOL.md 4b; how across Cluster slots: `multi`). Never
    /// coalesced: the members it writes are named by the returned handle.
    pub async fn check_multi(&self, asks: &[MultiAsk<'_>]) -> Result<MultiAnswer, StoreError> {
        self.multi.check(asks, self.cluster, self.now_arg(), None).await
    }

    /// `check_multi`, the members written named by `handle`, an admission's
    /// handle: a refund with it takes them back along with the admission's
    /// own (a sharded shadow item placed after the admission, S1, S3).
    /// The members' item numbers must be ones the admission wrote nothing
    /// under.
    pub async fn check_multi_under(&self, handle: &[u8; 16], asks: &[MultiAsk<'_>]) -> Result<MultiAnswer, StoreError> {
        self.multi.check(asks, self.cluster, self.now_arg(), Some(*handle)).await
    }

    /// Takes back the admissions a refundable check recorded: ZREM of the
    /// members `handle` names in the items' windows, every Cluster slot at
    /// once within one deadline. Exact and idempotent; members already out
    /// of their window are not found. Returns the members removed, or the
    /// first failure (then the slots that answered were refunded all the
    /// same: `refund_outcome` says how much).
    pub async fn refund(&self, handle: &[u8; 16], items: &[RefundItem<'_>]) -> Result<u64, StoreError> {
        let outcome = self.refund_outcome(handle, items).await;
        match outcome.failure {
            None => Ok(outcome.removed),
            Some(e) => Err(e),
        }
    }

    /// `refund`, saying what the slots that answered took back even when
    /// another slot failed (a retry takes back the rest: idempotent).
    pub async fn refund_outcome(&self, handle: &[u8; 16], items: &[RefundItem<'_>]) -> RefundOutcome {
        self.multi.refund(handle, items, self.cluster).await
    }

    /// Tells the backend of the denial cache in front of it: removals
    /// (refunds, reservations and quota leases settled or taken back)
    /// forget the windows they touch. Set once; later calls are ignored.
    pub fn set_denial_cache(&self, denials: Arc<DenialCache>) {
        let _ = self.multi.denials.set(denials);
    }

    /// A removal from `key`'s window of `window_ms` is starting: the denial
    /// cache forgets the window now (a refusal in flight is not recorded)
    /// and again when the returned guard drops (the removal is done, or
    /// its future was dropped), so no cached refusal outlives it.
    fn removing<'a>(&'a self, key: &'a [u8], window_ms: u32) -> Removing<'a> {
        let denials = self.multi.denials.get().map(|d| &**d);
        if let Some(d) = denials {
            d.forget_window(key, window_ms);
        }
        Removing { denials, key, window_ms }
    }

    /// Waits up to `limit` for multi-item checks still deciding, confirming
    /// or taking back across Cluster slots (at shutdown, after the last
    /// connection); returns whether all finished.
    pub async fn settle(&self, limit: Duration) -> bool {
        self.multi.settle(limit).await
    }
}

/// `RedisWindow::removing`'s guard.
struct Removing<'a> {
    denials: Option<&'a DenialCache>,
    key: &'a [u8],
    window_ms: u32,
}

impl Drop for Removing<'_> {
    fn drop(&mut self) {
        if let Some(d) = self.denials {
            d.forget_window(self.key, self.window_ms);
        }
    }
}

/// The link's probe: one admission on a key no client can name (a client
/// key never contains a NUL) with a 1 ms window, so it writes what a
/// request writes and leaves nothing behind.
/// The leader of a window's call: when dropped (the call is over, or its
/// future was dropped), the requests that queued behind it are sent.
struct Lead<'a> {
    window: &'a Arc<RedisWindow>,
    fp: u128,
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        if let Some(batch) = self.window.in_flight.next_batch(self.fp) {
            // Outside a runtime (the process is ending) the waiters' senders
            // are dropped with the batch: they answer "abandoned".
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(self.window.clone().drain(self.fp, batch));
            }
        }
    }
}

/// A cold lane's call: when dropped, the checks queued meanwhile are sent
/// (in a task, on the same lane), or the lane is freed.
struct ColdLane<'a> {
    window: &'a Arc<RedisWindow>,
}

impl Drop for ColdLane<'_> {
    fn drop(&mut self) {
        let Some(next) = self.window.cold.as_ref().and_then(ColdLanes::leave) else { return };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(self.window.clone().drain_cold(next));
        }
    }
}

fn probe_command(script: &Script, prefix: &[u8], instance: u64) -> redis::Cmd {
    let mut cmd = redis::Cmd::new();
    cmd.arg("EVALSHA")
        .arg(script.get_hash())
        .arg(1)
        .arg(WindowKey { prefix, key: b"\0probe", window_ms: 1, algorithm: Algorithm::Log })
        .arg(1)
        .arg(0)
        .arg(MemberId { instance, seq: u64::MAX })
        .arg(1_000_000)
        .arg(1);
    cmd
}

/// Why the Redis backend could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    /// Member ids must differ across daemons: no guessable fallback.
    #[error("redis: no OS randomness for member ids: {0}")]
    Randomness(getrandom::Error),
}

/// A random 64-bit id for this process's ZSET members: distinct across
/// daemons and restarts.
fn instance_id() -> Result<u64, StartError> {
    let mut id = [0u8; 8];
    getrandom::fill(&mut id).map_err(StartError::Randomness)?;
    Ok(u64::from_le_bytes(id))
}

/// Milliseconds since the Unix epoch on this host's clock.
fn wall_clock_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}


/// Each waiter of a call across requests its own verdict, in order, or the
/// call's error. A waiter gone by now (its deadline passed) is skipped.
fn answer_each(waiters: impl Iterator<Item = oneshot::Sender<Answer>>, verdicts: Result<Vec<Verdict>, StoreError>) {
    match verdicts {
        Ok(verdicts) => {
            for (tx, v) in waiters.zip(verdicts) {
                let _ = tx.send(Ok(v));
            }
        }
        Err(e) => {
            for tx in waiters {
                let _ = tx.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;


    #[test]
    fn member_ids_differ_by_instance_and_sequence() {
        let mut a = Vec::new();
        MemberId { instance: 0xab, seq: 7 }.write_redis_args(&mut a);
        assert_eq!(a, vec![b"00000000000000ab:7".to_vec()]);
    }

    #[test]
    fn script_has_the_documented_shape() {
        assert!(scripts::LOG.contains("redis.call('TIME')"));
        assert!(scripts::LOG.contains("PEXPIRE"));
        assert_eq!(Script::new(scripts::LOG).get_hash().len(), 40);
    }
}
