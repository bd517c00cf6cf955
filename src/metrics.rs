//! Counters of the daemon and their Prometheus text exposition (served by
//! `metrics_server`).
//!
//! Every metric is a fixed atomic in one static: the request path adds to a
//! counter with one relaxed atomic operation, never a lock, a map lookup or
//! an allocation. Label sets are the protocol's own vocabulary (decision x
//! source, error code, fail policy), so they are plain arrays indexed by
//! each value's position in its `ALL`.

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::protocol::{Decision, ErrorCode, FailPolicy, Source};

const DECISIONS: usize = Decision::ALL.len();
const SOURCES: usize = Source::ALL.len();
const POLICIES: usize = FailPolicy::ALL.len();
const ERRORS: usize = ErrorCode::ALL.len();
/// Upper bounds of the Redis latency buckets, in µs.
const LATENCY_BUCKETS_US: [u64; 11] = [100, 250, 500, 1_000, 2_500, 5_000, 10_000, 20_000, 50_000, 100_000, 250_000];

/// Why the daemon closed a client connection on its own (not counted: the
/// client closed it, shutdown, a too-large frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// Nothing in flight and no byte for `server.idle_timeout_ms`.
    Idle,
    /// A frame still incomplete `server.frame_timeout_ms` after its first byte.
    FrameTimeout,
    /// Responses waiting and none written for `server.write_timeout_ms`.
    WriteTimeout,
    /// At `server.max_connections`: the longest-idle connection, closed for a new one.
    Evicted,
}

/// Why a Redis call waited out its deadline, as the breaker judges it
/// (see `redis::link`): only `RedisSilent` counts towards opening it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutCause {
    /// Redis answered no call of ours since this one was sent.
    RedisSilent,
    /// Redis was answering the calls ahead of it, and at least
    /// `redis.min_in_flight` were ahead: it waited in our own queue.
    Queued,
    /// Redis was answering, and few calls were ahead of it: a stall of Redis
    /// or of the host, not our queue and not a dead Redis.
    Stalled,
    /// The deadline's timer fired late: the daemon itself was not running.
    DaemonLate,
}

impl TimeoutCause {
    pub const ALL: [TimeoutCause; 4] = [Self::RedisSilent, Self::Queued, Self::Stalled, Self::DaemonLate];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::RedisSilent => "redis_silent",
            Self::Queued => "queued",
            Self::Stalled => "stalled",
            Self::DaemonLate => "daemon_late",
        }
    }
}

impl CloseReason {
    pub const ALL: [CloseReason; 4] = [Self::Idle, Self::FrameTimeout, Self::WriteTimeout, Self::Evicted];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::FrameTimeout => "frame_timeout",
            Self::WriteTimeout => "write_timeout",
            Self::Evicted => "evicted",
        }
    }
}

/// What `Metrics::figures` reads: the counters `ratelimitd top` shows.
#[derive(Debug, Clone)]
pub struct Figures {
    /// Every decision x source pair with its count.
    pub decisions: Vec<(Decision, Source, u64)>,
    /// The Redis latency histogram's upper bounds; `redis_latency_counts`
    /// has one more bucket (above the last bound), not cumulative.
    pub redis_latency_bounds_us: &'static [u64],
    pub redis_latency_counts: Vec<u64>,
    pub redis_latency_sum_us: u64,
    pub requests_in_flight: i64,
    pub connections_open: i64,
    pub redis_in_flight_limit: i64,
}

/// Declares the daemon's counters once: each field with its type and
/// its value at start, from which the struct and `Metrics::new` (a `const
/// fn`, for the static) are made, so the two cannot fall out of step.
macro_rules! counters {
    ($( $field:ident: $ty:ty = $zero:expr, )+) => {
        /// All the daemon's counters.
        pub struct Metrics {
            $( $field: $ty, )+
        }

        impl Metrics {
            pub const fn new() -> Self {
                Self { $( $field: $zero, )+ }
            }
        }
    };
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);

counters! {
    decisions: [[AtomicU64; SOURCES]; DECISIONS] = [const { [ZERO; SOURCES] }; DECISIONS],
    errors: [AtomicU64; ERRORS] = [ZERO; ERRORS],
    fail_policy: [AtomicU64; POLICIES] = [ZERO; POLICIES],
    redis_latency_buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1] = [ZERO; LATENCY_BUCKETS_US.len() + 1],
    redis_latency_sum_us: AtomicU64 = ZERO,
    noscript_reloads: AtomicU64 = ZERO,
    coalesced: AtomicU64 = ZERO,
    script_loads: AtomicU64 = ZERO,
    breaker_opened: AtomicU64 = ZERO,
    redis_timeouts: [AtomicU64; TimeoutCause::ALL.len()] = [ZERO; TimeoutCause::ALL.len()],
    redis_in_flight_limit: AtomicI64 = AtomicI64::new(0),
    connections_open: AtomicI64 = AtomicI64::new(0),
    connections_total: AtomicU64 = ZERO,
    connections_closed: [AtomicU64; CloseReason::ALL.len()] = [ZERO; CloseReason::ALL.len()],
    requests_in_flight: AtomicI64 = AtomicI64::new(0),
    reloads: AtomicU64 = ZERO,
    reload_failures: AtomicU64 = ZERO,
    refunds: AtomicU64 = ZERO,
    refunded_units: AtomicU64 = ZERO,
    refunds_unmatched: AtomicU64 = ZERO,
    settles: AtomicU64 = ZERO,
    settles_unmatched: AtomicU64 = ZERO,
    settle_retries_queued: AtomicU64 = ZERO,
    settle_retries_applied: AtomicU64 = ZERO,
    settle_retries_dropped: AtomicU64 = ZERO,
    lease_share_requests: AtomicU64 = ZERO,
    lease_shares: AtomicU64 = ZERO,
    lease_share_units: AtomicU64 = ZERO,
    lease_share_units_given_back: AtomicU64 = ZERO,
    lease_units_granted: AtomicU64 = ZERO,
    lease_units_returned: AtomicU64 = ZERO,
}

/// The process's metrics.
pub static METRICS: Metrics = Metrics::new();

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    #[inline]
    /// A LEASE_SHARE (op 10) that handed `units` (0: none) to a worker.
    pub fn lease_share(&self, units: u32) {
        self.lease_share_requests.fetch_add(1, Ordering::Relaxed);
        if units > 0 {
            self.lease_shares.fetch_add(1, Ordering::Relaxed);
            self.lease_share_units.fetch_add(u64::from(units), Ordering::Relaxed);
        }
    }

    /// `units` of worker shares given back unused and taken back into
    /// their lease.
    pub fn share_units_given_back(&self, units: u32) {
        self.lease_share_units_given_back.fetch_add(u64::from(units), Ordering::Relaxed);
    }

    /// A quota lease of `units` reserved in Redis.
    pub fn lease_granted(&self, units: u32) {
        self.lease_units_granted.fetch_add(u64::from(units), Ordering::Relaxed);
    }

    /// A quota lease settled with `units` neither admitted by the daemon
    /// nor handed to a worker: given back.
    pub fn lease_returned(&self, units: u32) {
        self.lease_units_returned.fetch_add(u64::from(units), Ordering::Relaxed);
    }

    pub fn decided(&self, decision: Decision, source: Source, error: ErrorCode) {
        self.decisions[decision.index()][source.index()].fetch_add(1, Ordering::Relaxed);
        if error != ErrorCode::None {
            self.errors[error.index()].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A REFUND that reached Redis, and the admission units it removed.
    /// (Refunds are not decisions: not in `decided`; their errors are.)
    pub fn refunded(&self, units: u64) {
        self.refunds.fetch_add(1, Ordering::Relaxed);
        self.refunded_units.fetch_add(units, Ordering::Relaxed);
    }

    /// A REFUND whose handle named no member in its keys: forged, replayed,
    /// another admission's, or out of the window already (removes nothing).
    pub fn refund_unmatched(&self) {
        self.refunds_unmatched.fetch_add(1, Ordering::Relaxed);
    }

    /// A SETTLE that reached Redis; `matched`: its handle named a reserve
    /// still outstanding (else forged, replayed or expired: nothing changed).
    pub fn settled(&self, matched: bool) {
        self.settles.fetch_add(1, Ordering::Relaxed);
        if !matched {
            self.settles_unmatched.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A settle (or a reserve's take-back) handed to src/settle_retry.rs
    /// after a Redis failure; later answered by Redis, or dropped (too
    /// many waiting, or its record's life over).
    pub fn settle_retry_queued(&self) {
        self.settle_retries_queued.fetch_add(1, Ordering::Relaxed);
    }

    pub fn settle_retry_applied(&self) {
        self.settle_retries_applied.fetch_add(1, Ordering::Relaxed);
    }

    pub fn settle_retry_dropped(&self) {
        self.settle_retries_dropped.fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub fn fail_policy_applied(&self, policy: FailPolicy) {
        self.fail_policy[policy.index()].fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub fn redis_call(&self, took: Duration) {
        let us = took.as_micros() as u64;
        let i = LATENCY_BUCKETS_US.iter().position(|&b| us <= b).unwrap_or(LATENCY_BUCKETS_US.len());
        self.redis_latency_buckets[i].fetch_add(1, Ordering::Relaxed);
        self.redis_latency_sum_us.fetch_add(us, Ordering::Relaxed);
    }

    pub fn noscript_reload(&self) {
        self.noscript_reloads.fetch_add(1, Ordering::Relaxed);
    }

    /// `n` requests went to Redis in a call of an earlier request's key
    /// (per-key coalescing) instead of a call of their own.
    pub fn coalesced(&self, n: u64) {
        self.coalesced.fetch_add(n, Ordering::Relaxed);
    }

    pub fn script_loaded(&self) {
        self.script_loads.fetch_add(1, Ordering::Relaxed);
    }

    pub fn breaker_opened(&self) {
        self.breaker_opened.fetch_add(1, Ordering::Relaxed);
    }

    pub fn redis_timeout(&self, cause: TimeoutCause) {
        self.redis_timeouts[cause as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The adaptive limit on Redis calls in flight (set once per window).
    pub fn redis_in_flight_limit(&self, limit: u32) {
        self.redis_in_flight_limit.store(limit.into(), Ordering::Relaxed);
    }

    pub fn connection_opened(&self) {
        self.connections_open.fetch_add(1, Ordering::Relaxed);
        self.connections_total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn connection_closed(&self) {
        self.connections_open.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn connection_closed_by_daemon(&self, reason: CloseReason) {
        self.connections_closed[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub fn in_flight(&self, delta: i64) {
        self.requests_in_flight.fetch_add(delta, Ordering::Relaxed);
    }

    pub fn reloaded(&self, ok: bool) {
        if ok { &self.reloads } else { &self.reload_failures }.fetch_add(1, Ordering::Relaxed);
    }

    /// The daemon-wide figures of `GET /top.json` (read with relaxed loads,
    /// like a scrape).
    pub fn figures(&self) -> Figures {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut decisions = Vec::new();
        for (d, row) in Decision::ALL.iter().zip(&self.decisions) {
            for (s, n) in Source::ALL.iter().zip(row) {
                decisions.push((*d, *s, get(n)));
            }
        }
        Figures {
            decisions,
            redis_latency_bounds_us: &LATENCY_BUCKETS_US,
            redis_latency_counts: self.redis_latency_buckets.iter().map(get).collect(),
            redis_latency_sum_us: get(&self.redis_latency_sum_us),
            requests_in_flight: self.requests_in_flight.load(Ordering::Relaxed),
            connections_open: self.connections_open.load(Ordering::Relaxed),
            redis_in_flight_limit: self.redis_in_flight_limit.load(Ordering::Relaxed),
        }
    }

    /// The Prometheus text exposition of every metric. `breaker_open` is
    /// None without Redis.
    pub fn render(&self, breaker_open: Option<bool>) -> String {
        let mut out = String::with_capacity(8192);
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(out, "# HELP ratelimitd_decisions_total Decisions by result and by who made them.\n# TYPE ratelimitd_decisions_total counter");
        for (d, row) in Decision::ALL.iter().zip(&self.decisions) {
            for (s, n) in Source::ALL.iter().zip(row) {
                let _ = writeln!(out, "ratelimitd_decisions_total{{decision=\"{}\",source=\"{}\"}} {}", d.as_str(), s.as_str(), get(n));
            }
        }
        let _ = writeln!(out, "# HELP ratelimitd_errors_total Responses carrying an error code, by code.\n# TYPE ratelimitd_errors_total counter");
        for (e, n) in ErrorCode::ALL.iter().zip(&self.errors).filter(|(e, _)| **e != ErrorCode::None) {
            let _ = writeln!(out, "ratelimitd_errors_total{{code=\"{}\"}} {}", e.as_str(), get(n));
        }
        let _ = writeln!(out, "# HELP ratelimitd_fail_policy_total Requests decided by their fail policy (on_error) because Redis could not, by on_error.\n# TYPE ratelimitd_fail_policy_total counter");
        for (p, n) in FailPolicy::ALL.iter().zip(&self.fail_policy) {
            let _ = writeln!(out, "ratelimitd_fail_policy_total{{on_error=\"{}\"}} {}", p.as_str(), get(n));
        }
        let _ = writeln!(out, "# HELP ratelimitd_redis_call_seconds Time of one decision's Redis call (EVALSHA, with a NOSCRIPT reload if any).\n# TYPE ratelimitd_redis_call_seconds histogram");
        let mut cumulative = 0;
        for (bound, n) in LATENCY_BUCKETS_US.iter().zip(&self.redis_latency_buckets) {
            cumulative += get(n);
            let _ = writeln!(out, "ratelimitd_redis_call_seconds_bucket{{le=\"{}\"}} {cumulative}", *bound as f64 / 1e6);
        }
        cumulative += get(&self.redis_latency_buckets[LATENCY_BUCKETS_US.len()]);
        let _ = writeln!(out, "ratelimitd_redis_call_seconds_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "ratelimitd_redis_call_seconds_sum {}", get(&self.redis_latency_sum_us) as f64 / 1e6);
        let _ = writeln!(out, "ratelimitd_redis_call_seconds_count {cumulative}");
        let counters: [(&str, &str, &AtomicU64); 21] = [
            ("ratelimitd_noscript_reloads_total", "Calls that met NOSCRIPT and waited for a reload.", &self.noscript_reloads),
            ("ratelimitd_coalesced_requests_total", "Requests decided in a batched Redis call with others of their key, rather than a call of their own.", &self.coalesced),
            ("ratelimitd_script_loads_total", "Successful SCRIPT LOADs (start-up, reconnects, NOSCRIPT).", &self.script_loads),
            ("ratelimitd_breaker_opened_total", "Times the circuit breaker opened.", &self.breaker_opened),
            ("ratelimitd_connections_total", "Client connections accepted.", &self.connections_total),
            ("ratelimitd_config_reloads_total", "Configuration reloads applied (SIGHUP).", &self.reloads),
            ("ratelimitd_config_reload_failures_total", "Configuration reloads not applied: an invalid file, or one removing a policy in use (ratelimitd_config_reloads_refused_total).", &self.reload_failures),
            ("ratelimitd_refunds_total", "REFUND requests carried out in Redis (a repeated one included).", &self.refunds),
            ("ratelimitd_refunded_units_total", "Admission units removed from Redis by refunds.", &self.refunded_units),
            ("ratelimitd_refunds_unmatched_total", "REFUNDs that removed nothing: a forged, replayed or foreign handle, or admissions already out of their window.", &self.refunds_unmatched),
            ("ratelimitd_settles_total", "SETTLE requests carried out in Redis (a repeated one included).", &self.settles),
            ("ratelimitd_settles_unmatched_total", "SETTLEs that changed nothing: a forged, replayed or expired handle.", &self.settles_unmatched),
            ("ratelimitd_settle_retries_queued_total", "Settles and reserve take-backs that met a Redis failure and were queued to be retried in the background.", &self.settle_retries_queued),
            ("ratelimitd_settle_retries_applied_total", "Settles retried in the background that Redis answered (applied, or their record already gone).", &self.settle_retries_applied),
            ("ratelimitd_settle_retries_dropped_total", "Settles not retried: the retry queue full, or their record's life (24 h) over; their reserves stay charged their estimates.", &self.settle_retries_dropped),
            ("ratelimitd_lease_share_requests_total", "LEASE_SHAREs (op 10) answered, with units or without (errors excluded).", &self.lease_share_requests),
            ("ratelimitd_lease_shares_total", "LEASE_SHAREs (op 10) that handed units of a quota lease to an nginx worker's shared dict.", &self.lease_shares),
            ("ratelimitd_lease_share_units_total", "Units of quota leases handed to nginx workers (each counted in Redis as used at the latest time a worker may use it, unless given back).", &self.lease_share_units),
            ("ratelimitd_lease_share_units_given_back_total", "Units of worker shares that no worker used, given back by nginx before their deadline and taken back into their lease.", &self.lease_share_units_given_back),
            ("ratelimitd_lease_units_granted_total", "Units of a key's quota reserved in Redis by quota leases.", &self.lease_units_granted),
            ("ratelimitd_lease_units_returned_total", "Units of quota leases given back unused at their settle (granted - returned - (shared - given back): admitted by the daemon).", &self.lease_units_returned),
        ];
        for (name, help, n) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", get(n));
        }
        let _ = writeln!(out, "# HELP ratelimitd_redis_timeouts_total Redis calls that waited out the deadline, by cause; only redis_silent counts towards opening the breaker.\n# TYPE ratelimitd_redis_timeouts_total counter");
        for (c, n) in TimeoutCause::ALL.iter().zip(&self.redis_timeouts) {
            let _ = writeln!(out, "ratelimitd_redis_timeouts_total{{cause=\"{}\"}} {}", c.as_str(), get(n));
        }
        let _ = writeln!(out, "# HELP ratelimitd_connections_closed_total Client connections the daemon closed on its own, by reason.\n# TYPE ratelimitd_connections_closed_total counter");
        for (r, n) in CloseReason::ALL.iter().zip(&self.connections_closed) {
            let _ = writeln!(out, "ratelimitd_connections_closed_total{{reason=\"{}\"}} {}", r.as_str(), get(n));
        }
        let gauges: [(&str, &str, i64); 3] = [
            ("ratelimitd_redis_in_flight_limit", "The adaptive limit on Redis calls in flight; calls over it get OVERLOADED (0 without Redis).", self.redis_in_flight_limit.load(Ordering::Relaxed)),
            ("ratelimitd_connections_open", "Client connections open now.", self.connections_open.load(Ordering::Relaxed)),
            ("ratelimitd_requests_in_flight", "Requests being decided now.", self.requests_in_flight.load(Ordering::Relaxed)),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        if let Some(open) = breaker_open {
            let _ = writeln!(out, "# HELP ratelimitd_breaker_open 1 while the circuit breaker to Redis is open.\n# TYPE ratelimitd_breaker_open gauge\nratelimitd_breaker_open {}", open as u8);
        }
        render_admin(&mut out);
        render_envoy(&mut out);
        out
    }
}

/// What an admin API request asked for (`admin_api`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminOp {
    Peek,
    Reset,
    OverrideList,
    OverrideSet,
    OverrideDelete,
    /// GET /v1/bans: the penalty box's bans, or one key's.
    BanList,
    /// DELETE /v1/bans: a ban lifted.
    BanLift,
}

impl AdminOp {
    pub const ALL: [AdminOp; 7] = [Self::Peek, Self::Reset, Self::OverrideList, Self::OverrideSet, Self::OverrideDelete, Self::BanList, Self::BanLift];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Peek => "peek",
            Self::Reset => "reset",
            Self::OverrideList => "override_list",
            Self::OverrideSet => "override_set",
            Self::OverrideDelete => "override_delete",
            Self::BanList => "ban_list",
            Self::BanLift => "ban_lift",
        }
    }
}

/// How an admin API request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminResult {
    Done,
    /// Bad input: nothing changed.
    Rejected,
    /// No token, or a wrong one.
    Unauthorized,
    /// A read token on a write.
    Forbidden,
    /// Redis could not be reached or failed.
    Failed,
}

impl AdminResult {
    pub const ALL: [AdminResult; 5] = [Self::Done, Self::Rejected, Self::Unauthorized, Self::Forbidden, Self::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Rejected => "rejected",
            Self::Unauthorized => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::Failed => "failed",
        }
    }
}

static ADMIN_REQUESTS: [[AtomicU64; AdminResult::ALL.len()]; AdminOp::ALL.len()] = [const { [ZERO; AdminResult::ALL.len()] }; AdminOp::ALL.len()];
static ADMIN_CONNECTIONS_OPEN: AtomicU64 = ZERO;
static ADMIN_CONNECTIONS_REFUSED: AtomicU64 = ZERO;
static LIVE_OVERRIDES: AtomicU64 = ZERO;
static LIVE_OVERRIDES_REFRESH_FAILURES: AtomicU64 = ZERO;

impl Metrics {
    pub fn admin_request(&self, op: AdminOp, result: AdminResult) {
        ADMIN_REQUESTS[op as usize][result as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn admin_connection_opened(&self) {
        ADMIN_CONNECTIONS_OPEN.fetch_add(1, Ordering::Relaxed);
    }

    pub fn admin_connection_closed(&self) {
        ADMIN_CONNECTIONS_OPEN.fetch_sub(1, Ordering::Relaxed);
    }

    /// A connection the admin listener closed at once: it held its cap.
    pub fn admin_connection_refused(&self) {
        ADMIN_CONNECTIONS_REFUSED.fetch_add(1, Ordering::Relaxed);
    }

    pub fn live_overrides(&self, in_force: usize) {
        LIVE_OVERRIDES.store(in_force as u64, Ordering::Relaxed);
    }

    pub fn live_overrides_refresh_failed(&self) {
        LIVE_OVERRIDES_REFRESH_FAILURES.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the Envoy rate limit service answered a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvoyOutcome {
    /// `overall_code` OK.
    Ok,
    /// `overall_code` OVER_LIMIT.
    OverLimit,
    /// A gRPC error: a request the front refuses (INVALID_ARGUMENT and
    /// the like), nothing counted.
    Refused,
}

impl EnvoyOutcome {
    const ALL: [Self; 3] = [Self::Ok, Self::OverLimit, Self::Refused];
    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::OverLimit => "over_limit",
            Self::Refused => "refused",
        }
    }
}

static ENVOY_REQUESTS: [AtomicU64; EnvoyOutcome::ALL.len()] = [const { ZERO }; EnvoyOutcome::ALL.len()];

impl Metrics {
    pub fn envoy_request(&self, outcome: EnvoyOutcome) {
        ENVOY_REQUESTS[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }
}

fn render_envoy(out: &mut String) {
    let _ = writeln!(out, "# HELP ratelimitd_envoy_requests_total ShouldRateLimit requests of the Envoy rate limit service, by answer (each descriptor's decision is counted under its policy too).\n# TYPE ratelimitd_envoy_requests_total counter");
    for o in EnvoyOutcome::ALL {
        let _ = writeln!(out, "ratelimitd_envoy_requests_total{{code=\"{}\"}} {}", o.as_str(), ENVOY_REQUESTS[o as usize].load(Ordering::Relaxed));
    }
}

fn render_admin(out: &mut String) {
    let _ = writeln!(out, "# HELP ratelimitd_admin_requests_total Admin API requests, by operation and result (writes are also logged).\n# TYPE ratelimitd_admin_requests_total counter");
    for (op, row) in AdminOp::ALL.iter().zip(&ADMIN_REQUESTS) {
        for (r, n) in AdminResult::ALL.iter().zip(row) {
            let _ = writeln!(out, "ratelimitd_admin_requests_total{{op=\"{}\",result=\"{}\"}} {}", op.as_str(), r.as_str(), n.load(Ordering::Relaxed));
        }
    }
    let _ = writeln!(out, "# HELP ratelimitd_admin_connections_open Admin API connections open now.\n# TYPE ratelimitd_admin_connections_open gauge\nratelimitd_admin_connections_open {}", ADMIN_CONNECTIONS_OPEN.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP ratelimitd_admin_connections_refused_total Admin API connections closed at once because the listener held its cap (admin.max_connections, at most a quarter of RLIMIT_NOFILE).\n# TYPE ratelimitd_admin_connections_refused_total counter\nratelimitd_admin_connections_refused_total {}", ADMIN_CONNECTIONS_REFUSED.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP ratelimitd_live_overrides Admin API overrides in force on this daemon.\n# TYPE ratelimitd_live_overrides gauge\nratelimitd_live_overrides {}", LIVE_OVERRIDES.load(Ordering::Relaxed));
    let _ = writeln!(out, "# HELP ratelimitd_live_overrides_refresh_failures_total Background reads of the overrides from Redis that failed.\n# TYPE ratelimitd_live_overrides_refresh_failures_total counter\nratelimitd_live_overrides_refresh_failures_total {}", LIVE_OVERRIDES_REFRESH_FAILURES.load(Ordering::Relaxed));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_has_every_family_and_counts() {
        let m = Metrics::new();
        m.decided(Decision::Allowed, Source::FailOpen, ErrorCode::CircuitOpen);
        m.fail_policy_applied(FailPolicy::Open);
        m.decided(Decision::Denied, Source::DenialCache, ErrorCode::None);
        m.redis_call(Duration::from_micros(300));
        m.redis_call(Duration::from_secs(1));
        m.connection_closed_by_daemon(CloseReason::WriteTimeout);
        m.redis_timeout(TimeoutCause::Queued);
        m.redis_in_flight_limit(64);
        let text = m.render(Some(true));
        assert!(text.contains("ratelimitd_decisions_total{decision=\"allowed\",source=\"fail_open\"} 1"), "{text}");
        assert!(text.contains("ratelimitd_errors_total{code=\"CIRCUIT_OPEN\"} 1"));
        assert!(text.contains("ratelimitd_decisions_total{decision=\"denied\",source=\"denial_cache\"} 1"), "{text}");
        assert!(text.contains("ratelimitd_fail_policy_total{on_error=\"open\"} 1"));
        assert!(text.contains("ratelimitd_redis_call_seconds_bucket{le=\"0.0005\"} 1"));
        assert!(text.contains("ratelimitd_redis_call_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("ratelimitd_redis_call_seconds_count 2"));
        assert!(text.contains("ratelimitd_breaker_open 1"));
        assert!(text.contains("ratelimitd_connections_closed_total{reason=\"write_timeout\"} 1"));
        assert!(text.contains("ratelimitd_connections_closed_total{reason=\"evicted\"} 0"));
        assert!(!text.contains("code=\"OK\""));
        assert!(text.contains("ratelimitd_redis_timeouts_total{cause=\"queued\"} 1"));
        assert!(text.contains("ratelimitd_redis_timeouts_total{cause=\"redis_silent\"} 0"));
        assert!(text.contains("ratelimitd_redis_in_flight_limit 64"));
    }
}
