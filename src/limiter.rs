//! Turns a validated request into a response: asks the store, and when the
//! shared store fails, applies the request's fail policy.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::denial_cache::{is_exact_for, DenialCache, Lookup};
use crate::local_store::{LocalStore, LocalStoreFull};
use crate::log_limit::RateLimitedLog;
use crate::metrics::METRICS;
use crate::config::PolicyLimit;
use crate::policies::{shard_limit, Outcome, Policies, Policy};
use crate::protocol::{
    Algorithm, CheckRequest, Decision, ErrorCode, Extension, FailPolicy, ItemResult, LeaseRequest, MultiCheckRequest, PolicyCheckRequest, PolicyItem, PolicyLeaseRequest, OP_ACQUIRE_POLICY, OP_RELEASE, RefundRequest, Response, Source, OP_ACQUIRE, OP_CHECK, OP_CHECK_POLICY, OP_REFUND,
};
use crate::redis::{shard_key, MultiAsk, RedisWindow, RefundItem};
use crate::top_refused::TOP_REFUSED;
use crate::window::{LimitSpec, StoreError, Verdict};

/// The response code of a store failure.
fn error_code(e: &StoreError) -> ErrorCode {
    match e {
        StoreError::Timeout(_) => ErrorCode::RedisTimeout,
        StoreError::Unavailable(_) => ErrorCode::RedisUnavailable,
        StoreError::Redis(_) => ErrorCode::RedisError,
        StoreError::CircuitOpen => ErrorCode::CircuitOpen,
        StoreError::Overloaded(_) => ErrorCode::Overloaded,
    }
}

/// The message of an `OVERLOADED` response: static, so that shedding load
/// allocates nothing per request.
const OVERLOADED_MESSAGE: &str = "overloaded: too many redis calls in flight; decided at once by the fail policy";

/// A policy named by the op of the other kind: CHECK_POLICY (or several
/// items, a refund) of a concurrency policy, or ACQUIRE_POLICY of a rate
/// policy. A configuration error of the location, answered loudly rather
/// than judged by the wrong rule.
fn wrong_policy_kind(policy: &Policy, id: u32, op: u8) -> Response {
    policy.counters.count(Outcome::Error);
    METRICS.decided(Decision::Error, Source::None, ErrorCode::WrongPolicyKind);
    let msg = if policy.lease_ms.is_some() {
        format!("policy '{}' is a concurrency policy: acquire and release it with op 7 (ratelimitd.concurrency{{policy=...}}), not with a check", policy.name)
    } else {
        format!("policy '{}' is a rate policy, not a concurrency one: check it with op 2 (ratelimitd.new{{policy=...}})", policy.name)
    };
    Response::error(id, op, ErrorCode::WrongPolicyKind, Cow::Owned(msg))
}

/// A validated request of either op.
#[derive(Debug)]
pub enum Ask {
    Check(CheckRequest),
    Policy(PolicyCheckRequest),
    Multi(MultiCheckRequest),
    Refund(RefundRequest),
    Lease(LeaseRequest),
    PolicyLease(PolicyLeaseRequest),
}

/// Where decisions are made.
#[derive(Debug, Clone)]
pub enum Backend {
    Redis(Arc<RedisWindow>),
    /// No Redis configured: the per-host store decides; limits are per host.
    Local,
}

/// The decision engine shared by all connections; replaced whole on reload.
#[derive(Debug)]
pub struct Limiter {
    backend: Backend,
    /// The store of the local backend, and the fallback of the `local` fail
    /// policy with Redis; outlives reloads.
    local: Arc<LocalStore>,
    failure_log: RateLimitedLog,
    capacity_log: RateLimitedLog,
    overload_log: RateLimitedLog,
    /// Refusals by Redis, answered again here (Redis backend only).
    denials: Option<Arc<DenialCache>>,
    /// The configured `[[policy]]` tables CHECK_POLICY names.
    policies: Arc<Policies>,
    unknown_policy_log: RateLimitedLog,
}

impl Limiter {
    pub fn new(backend: Backend, local: Arc<LocalStore>) -> Self {
        Self {
            backend,
            local,
            failure_log: RateLimitedLog::new(Duration::from_secs(1)),
            capacity_log: RateLimitedLog::new(Duration::from_secs(10)),
            overload_log: RateLimitedLog::new(Duration::from_secs(10)),
            denials: None,
            policies: Arc::default(),
            unknown_policy_log: RateLimitedLog::new(Duration::from_secs(1)),
        }
    }

    /// The policies CHECK_POLICY requests are decided with.
    pub fn with_policies(self, policies: Arc<Policies>) -> Self {
        Self { policies, ..self }
    }

    pub fn policies(&self) -> &Arc<Policies> {
        &self.policies
    }


    /// Decides one CHECK_POLICY item: resolves the policy and the key's
    /// limit, then decides exactly as a CHECK of that limit, window and cost
    /// would (same stores, denial cache and coalescing), under the key
    /// scoped to the policy. Never fails: errors become responses.
    pub async fn decide_policy(&self, req: PolicyCheckRequest) -> Response {
        let Some(policy) = self.policies.get(&req.name) else {
            return self.unknown_policy(&req);
        };
        if policy.lease_ms.is_some() {
            return wrong_policy_kind(policy, req.id, OP_CHECK_POLICY);
        }
        let limit = match policy.limit_for(&req.key) {
            PolicyLimit::Limit(l) => l,
            PolicyLimit::Unlimited => {
                policy.counters.count(Outcome::Exempt);
                METRICS.decided(Decision::Allowed, Source::Exempt, ErrorCode::None);
                return Response { decision: Decision::Allowed, source: Source::Exempt, error: ErrorCode::None, ..Response::error(req.id, OP_CHECK_POLICY, ErrorCode::None, Cow::Borrowed("")) };
            }
        };
        // A sharded key admits a cost only within one shard: the largest
        // shard's part is the most one request can ever get.
        let most = if policy.shards > 1 { shard_limit(limit, 0, policy.shards) } else { limit };
        if req.cost > most {
            // What a CHECK with this cost and limit gets: it can never pass.
            policy.counters.count(Outcome::Error);
            METRICS.decided(Decision::Error, Source::None, ErrorCode::InvalidCost);
            let msg = if most < limit {
                format!("cost {} is above {most}, the largest shard of the limit {limit} of policy '{}' ({} shards) for this key", req.cost, policy.name, policy.shards)
            } else {
                format!("cost {} is above the limit {limit} of policy '{}' for this key", req.cost, policy.name)
            };
            return Response::error(req.id, OP_CHECK_POLICY, ErrorCode::InvalidCost, Cow::Owned(msg));
        }
        // The policy's own fail policy, when it has one, replaces the location's.
        let (on_error, local_limit) = match policy.fail_policy {
            Some(f) => (f, policy.local_limit.unwrap_or(0)),
            None => (req.on_error, req.local_limit),
        };
        let check = CheckRequest { id: req.id, on_error, limit, window_ms: policy.window_ms, cost: req.cost, local_limit, key: req.scoped_key, algorithm: policy.algorithm };
        let mut resp = if policy.shards > 1 {
            let key = check.key.clone();
            let resp = self.decide_sharded(policy, check).await;
            if refused_by_a_limit(&resp) {
                TOP_REFUSED.record(&key);
            }
            resp
        } else {
            self.decide_inner(check).await
        };
        resp.op = OP_CHECK_POLICY;
        let mut outcome = outcome_of(&resp);
        if policy.shadow && resp.decision == Decision::Denied {
            // Reported, never enforced: nothing was recorded for a refusal,
            // so the shadow window counts what enforcing would have admitted.
            resp.decision = Decision::ShadowDenied;
            outcome = Outcome::ShadowRefused;
        }
        policy.counters.count(outcome);
        METRICS.decided(resp.decision, resp.source, resp.error);
        resp
    }

    /// Decides one ACQUIRE_POLICY (op 7) or its release: resolves the
    /// concurrency policy, the key's limit (override, allowlist) and the
    /// policy's lease and fail policy, then decides exactly as an ACQUIRE or
    /// RELEASE (ops 5, 6) of them would, under the key scoped to the policy.
    async fn decide_policy_lease(&self, req: PolicyLeaseRequest) -> Response {
        let op = OP_ACQUIRE_POLICY;
        let Some(policy) = self.policies.get(&req.name) else {
            let single = PolicyCheckRequest { id: req.id, on_error: req.on_error, local_limit: req.local_limit, cost: req.cost, name: req.name, key: req.key, scoped_key: req.scoped_key };
            return Response { op, ..self.unknown_policy(&single) };
        };
        let Some(lease_ms) = policy.lease_ms else {
            return wrong_policy_kind(policy, req.id, op);
        };
        let limit = match policy.limit_for(&req.key) {
            PolicyLimit::Limit(l) => l,
            PolicyLimit::Unlimited => {
                // Exempt: nothing acquired, so nothing to release.
                policy.counters.count(Outcome::Exempt);
                METRICS.decided(Decision::Allowed, Source::Exempt, ErrorCode::None);
                return Response { decision: Decision::Allowed, source: Source::Exempt, error: ErrorCode::None, ..Response::error(req.id, op, ErrorCode::None, Cow::Borrowed("")) };
            }
        };
        if req.cost > limit && !req.release {
            policy.counters.count(Outcome::Error);
            METRICS.decided(Decision::Error, Source::None, ErrorCode::InvalidCost);
            let msg = format!("cost {} is above the limit {limit} of policy '{}' for this key", req.cost, policy.name);
            return Response::error(req.id, op, ErrorCode::InvalidCost, Cow::Owned(msg));
        }
        let (on_error, local_limit) = match policy.fail_policy {
            Some(f) => (f, policy.local_limit.unwrap_or(0)),
            None => (req.on_error, req.local_limit),
        };
        let lease = LeaseRequest {
            id: req.id,
            op: if req.release { OP_RELEASE } else { OP_ACQUIRE },
            on_error,
            limit,
            lease_ms,
            cost: req.cost,
            local_limit,
            key: req.scoped_key,
            lease: req.lease,
        };
        let mut resp = self.decide_lease(&lease).await;
        resp.op = op;
        let mut outcome = outcome_of(&resp);
        if policy.shadow && resp.decision == Decision::Denied {
            // Reported, never enforced: no slot was taken.
            resp.decision = Decision::ShadowDenied;
            outcome = Outcome::ShadowRefused;
        }
        policy.counters.count(outcome);
        METRICS.decided(resp.decision, resp.source, resp.error);
        resp
    }

    /// A name the configuration does not have: a configuration error of the
    /// location (or a reload that removed the policy), logged loudly; the
    /// client's own fail policy decides.
    fn unknown_policy(&self, req: &PolicyCheckRequest) -> Response {
        METRICS.decided(Decision::Error, Source::None, ErrorCode::UnknownPolicy);
        crate::policies::count_unknown();
        let name = req.name.escape_ascii().to_string();
        if let Some(suppressed) = self.unknown_policy_log.permit() {
            tracing::error!(policy = %name, known = self.policies.len(), suppressed, "request names a policy that is not configured: the location's fail policy decides; add a [[policy]] of this name or fix the nginx configuration");
        }
        Response::error(req.id, OP_CHECK_POLICY, ErrorCode::UnknownPolicy, Cow::Owned(format!("no policy named '{name}' in the daemon's configuration")))
    }

    /// Puts `denials` in front of the Redis backend.
    pub fn with_denial_cache(self, denials: Option<Arc<DenialCache>>) -> Self {
        Self { denials, ..self }
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// `decide` or `decide_policy`, owning its limiter: the future outlives
    /// a reload. One future type for both ops, so a connection's requests
    /// in flight need no box each.
    pub async fn decide_owned(self: Arc<Self>, req: Ask) -> Response {
        match req {
            Ask::Check(r) => self.decide(r).await,
            Ask::Policy(r) => self.decide_policy(r).await,
            // Boxed: their futures are larger, and the single checks' future
            // (one per request in flight) stays the size it was.
            Ask::Multi(r) => Box::pin(self.decide_multi(r)).await,
            Ask::Refund(r) => Box::pin(self.refund(r)).await,
            Ask::Lease(r) => {
                let resp = self.decide_lease(&r).await;
                METRICS.decided(resp.decision, resp.source, resp.error);
                resp
            }
            Ask::PolicyLease(r) => Box::pin(self.decide_policy_lease(r)).await,
        }
    }

    /// ACQUIRE or RELEASE of a concurrency lease. Never coalesced, never
    /// answered by the denial cache (a release frees a slot at any moment).
    /// An ACQUIRE Redis cannot decide follows its fail policy (`local`: the
    /// per-host leases, with `local_limit`); a RELEASE is also applied to
    /// the per-host leases, which hold it if the fallback acquired it.
    async fn decide_lease(&self, req: &LeaseRequest) -> Response {
        let acquire = req.op == OP_ACQUIRE;
        let local = |limit| {
            if acquire {
                self.local.acquire(&req.key, &req.lease, limit, req.lease_ms, req.cost)
            } else {
                Ok(self.local.release(&req.key, &req.lease))
            }
        };
        let answer = |source, v: Verdict| Response { op: req.op, ..respond_id(req.id, source, v) };
        let redis = match &self.backend {
            Backend::Local => {
                return match local(req.limit) {
                    Ok(v) => answer(Source::Memory, v),
                    Err(full) => Response { source: Source::Memory, ..Response::error(req.id, req.op, ErrorCode::LocalCapacity, Cow::Owned(full.to_string())) },
                };
            }
            Backend::Redis(redis) => redis,
        };
        match redis.lease(acquire, &req.key, &req.lease, req.limit, req.lease_ms, req.cost).await {
            Ok(v) => {
                if !acquire {
                    self.local.release(&req.key, &req.lease);
                }
                answer(Source::Redis, v)
            }
            Err(e) => {
                METRICS.fail_policy_applied(req.on_error);
                if let Some(suppressed) = self.failure_log.permit() {
                    tracing::warn!(error = %e, policy = ?req.on_error, key = %String::from_utf8_lossy(&req.key), suppressed, "redis failed on a concurrency lease; the request's fail policy decides");
                }
                let mut r = match (acquire, req.on_error) {
                    (false, _) => answer(Source::LocalFallback, self.local.release(&req.key, &req.lease)),
                    (true, FailPolicy::Open) => answer(Source::FailOpen, Verdict { allowed: true, remaining: req.limit, ..Verdict::default() }),
                    (true, FailPolicy::Closed) => answer(Source::FailClosed, Verdict { retry_after_ms: req.lease_ms.min(1000), ..Verdict::default() }),
                    (true, FailPolicy::Local) => match local(req.local_limit) {
                        Ok(v) => answer(Source::LocalFallback, v),
                        Err(full) => Response { source: Source::LocalFallback, ..Response::error(req.id, req.op, ErrorCode::LocalCapacity, Cow::Owned(full.to_string())) },
                    },
                };
                r.error = error_code(&e);
                r.message = Cow::Owned(e.to_string());
                r
            }
        }
    }

    /// Decides one request. Never fails: errors become responses.
    pub async fn decide(&self, req: CheckRequest) -> Response {
        let resp = self.decide_inner(req).await;
        METRICS.decided(resp.decision, resp.source, resp.error);
        resp
    }

    async fn decide_inner(&self, req: CheckRequest) -> Response {
        let resp = self.decide_store(&req).await;
        if refused_by_a_limit(&resp) {
            // The inline key, or the policy-scoped one (shadow refusals too).
            TOP_REFUSED.record(&req.key);
        }
        resp
    }

    async fn decide_store(&self, req: &CheckRequest) -> Response {
        let spec = LimitSpec { key: &req.key, limit: req.limit, window_ms: req.window_ms, cost: req.cost };
        match self.verdict(&spec, req.algorithm).await {
            Ok((source, v)) => respond(req, source, v),
            Err(NoVerdict::Full(full)) => self.capacity_error(req, Source::Memory, full),
            Err(NoVerdict::Store(e)) => self.on_backend_error(req, spec, e),
        }
    }

    /// The store's verdict on `spec`: the in-memory backend's, or the denial
    /// cache's (for the algorithms it is exact for), or Redis's (recorded in
    /// the denial cache). No fail policy.
    async fn verdict(&self, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Result<(Source, Verdict), NoVerdict> {
        match &self.backend {
            Backend::Local => self.local.check(spec, algorithm).map(|v| (Source::Memory, v)).map_err(NoVerdict::Full),
            Backend::Redis(redis) => {
                let denials = self.denials.as_deref().filter(|_| is_exact_for(algorithm));
                let ticket = match denials.map(|d| d.check(spec, algorithm)) {
                    Some(Lookup::Refused(v)) => return Ok((Source::DenialCache, v)),
                    Some(Lookup::Miss(ticket)) => Some(ticket),
                    None => None,
                };
                let v = redis.check(spec, algorithm).await.map_err(NoVerdict::Store)?;
                if let (Some(d), Some(t)) = (denials, ticket) {
                    d.record(t, spec.cost, &v);
                }
                Ok((Source::Redis, v))
            }
        }
    }

    /// A request of a policy with `shards` > 1 (docs/SCALING.md, hot keys):
    /// the key's limit is split over its shards' windows (`shard_limit`,
    /// parts summing to the limit, so the key never admits more than its
    /// limit in any window). The shards are tried one after another from
    /// this daemon's round-robin start until one admits: a request is
    /// refused only when every shard refused it (or was unreachable). A
    /// shard whose Redis answered with an error at once (node down,
    /// CLUSTERDOWN) is skipped; a timeout, an open breaker or overload ends
    /// the tries and the fail policy decides, as for one window, so a
    /// request waits for at most one deadline. The fail policy's local
    /// window is the key's own, not a shard's.
    async fn decide_sharded(&self, policy: &Policy, req: CheckRequest) -> Response {
        let shards = policy.shards;
        let first = policy.first_shard();
        let whole = LimitSpec { key: &req.key, limit: req.limit, window_ms: req.window_ms, cost: req.cost };
        // The refusals so far, merged: room left summed, earliest retry.
        let mut refused: Option<(Source, Verdict)> = None;
        let mut skipped: Option<StoreError> = None;
        for t in 0..shards {
            let i = (first + t) % shards;
            let part = shard_limit(req.limit, i, shards);
            if req.cost > part {
                continue;
            }
            // A key of its own per shard: one small allocation per try,
            // only for sharded policies.
            let key = shard_key(&req.key, i, shards);
            let spec = LimitSpec { key: &key, limit: part, ..whole };
            match self.verdict(&spec, req.algorithm).await {
                Ok((source, v)) if v.allowed => {
                    // count and remaining of the key: estimated from this
                    // shard's, the round robin filling shards evenly.
                    let remaining = v.remaining.saturating_mul(shards).min(req.limit - req.cost.min(req.limit));
                    return respond(&req, source, Verdict { remaining, count: req.limit - remaining, ..v });
                }
                Ok((source, v)) => {
                    let merged = match refused {
                        None => (source, v),
                        Some((s, m)) => (
                            if s == Source::DenialCache { source } else { s },
                            Verdict {
                                remaining: m.remaining + v.remaining,
                                retry_after_ms: m.retry_after_ms.min(v.retry_after_ms),
                                reset_ms: m.reset_ms.max(v.reset_ms),
                                ..m
                            },
                        ),
                    };
                    refused = Some(merged);
                }
                Err(NoVerdict::Store(e @ (StoreError::Unavailable(_) | StoreError::Redis(_)))) => {
                    skipped.get_or_insert(e);
                }
                Err(NoVerdict::Store(e)) => return self.on_backend_error(&req, whole, e),
                Err(NoVerdict::Full(full)) => return self.capacity_error(&req, Source::Memory, full),
            }
        }
        match (refused, skipped) {
            (Some((source, v)), _) => {
                let remaining = v.remaining.min(req.limit);
                respond(&req, source, Verdict { allowed: false, remaining, count: req.limit - remaining, ..v })
            }
            (None, Some(e)) => self.on_backend_error(&req, whole, e),
            // decide_policy refuses a cost above every shard's part.
            (None, None) => Response::error(req.id, OP_CHECK, ErrorCode::InvalidCost, Cow::Borrowed("cost above every shard's limit")),
        }
    }

    /// No decision: the in-memory windows are full; the client's policy decides.
    fn capacity_error(&self, req: &CheckRequest, source: Source, full: LocalStoreFull) -> Response {
        if let Some(suppressed) = self.capacity_log.permit() {
            tracing::warn!(error = %full, suppressed, "in-memory windows full: new keys get LOCAL_CAPACITY; raise limits.max_local_keys or look for a flood of unique keys");
        }
        Response { source, ..Response::error(req.id, OP_CHECK, ErrorCode::LocalCapacity, Cow::Owned(full.to_string())) }
    }

    fn on_backend_error(&self, req: &CheckRequest, spec: LimitSpec<'_>, e: StoreError) -> Response {
        METRICS.fail_policy_applied(req.on_error);
        if let StoreError::Overloaded(limit) = &e {
            // Load shed by design, not a failure of Redis: a line of its own
            // at most every 10 s, so that the failure line stays about Redis.
            if let Some(suppressed) = self.overload_log.permit() {
                tracing::warn!(in_flight_limit = limit, policy = ?req.on_error, suppressed, "redis calls at their adaptive in-flight limit: the excess gets OVERLOADED and its fail policy decides");
            }
        } else if let Some(suppressed) = self.failure_log.permit() {
            tracing::warn!(
                error = %e,
                policy = ?req.on_error,
                key = %String::from_utf8_lossy(&req.key),
                suppressed,
                "redis failed; the request's fail policy decides"
            );
        }
        let mut r = match req.on_error {
            FailPolicy::Open => Response {
                decision: Decision::Allowed,
                source: Source::FailOpen,
                remaining: req.limit,
                ..respond(req, Source::FailOpen, Verdict::default())
            },
            FailPolicy::Closed => Response {
                decision: Decision::Denied,
                source: Source::FailClosed,
                // Ask clients to come back once, not to hammer a failing store.
                retry_after_ms: req.window_ms.min(1000),
                ..respond(req, Source::FailClosed, Verdict::default())
            },
            FailPolicy::Local => {
                let v = if spec.cost > req.local_limit {
                    // Can never fit the local quota: deny without recording.
                    Verdict { remaining: req.local_limit, retry_after_ms: crate::window::nominal_window_ms(req.window_ms), ..Verdict::default() }
                } else {
                    match self.local.check(&LimitSpec { limit: req.local_limit, ..spec }, req.algorithm) {
                        Ok(v) => v,
                        Err(full) => return self.capacity_error(req, Source::LocalFallback, full),
                    }
                };
                respond(req, Source::LocalFallback, v)
            }
        };
        r.error = error_code(&e);
        r.message = match e {
            StoreError::Overloaded(_) => Cow::Borrowed(OVERLOADED_MESSAGE),
            e => Cow::Owned(e.to_string()),
        };
        r
    }
}

/// One resolved item of a multi-item check.
struct Resolved<'p> {
    policy: &'p Policy,
    /// The key's limit; `None`: exempt (allowlisted or unlimited).
    limit: Option<u32>,
}

/// Several items, all or nothing (docs/PROTOCOL.md, section 4b), and
/// refunds (section 4c).
impl Limiter {
    /// Resolves every item's policy and limit; the first unknown name or
    /// cost above a limit answers for the whole request.
    fn resolve<'p>(&'p self, id: u32, op: u8, items: &[PolicyItem]) -> Result<Vec<Resolved<'p>>, Response> {
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let Some(policy) = self.policies.get(&item.name) else {
                let single = PolicyCheckRequest { id, on_error: FailPolicy::Closed, local_limit: 0, cost: item.cost, name: item.name.clone(), key: item.key.clone(), scoped_key: item.scoped_key.clone() };
                return Err(Response { op, ..self.unknown_policy(&single) });
            };
            let limit = match policy.limit_for(&item.key) {
                PolicyLimit::Limit(l) => Some(l),
                PolicyLimit::Unlimited => None,
            };
            if policy.lease_ms.is_some() {
                return Err(wrong_policy_kind(policy, id, op));
            }
            // Several items in one call, and refunds, are written for the
            // exact log's script and windows; another algorithm's policy
            // would be judged by the wrong rule: refused loudly instead.
            if policy.algorithm != Algorithm::Log {
                policy.counters.count(Outcome::Error);
                METRICS.decided(Decision::Error, Source::None, ErrorCode::UnknownAlgorithm);
                let msg = format!("policy '{}' uses algorithm {}: several policies in one request, and refunds, need algorithm log", policy.name, policy.algorithm.as_str());
                return Err(Response::error(id, op, ErrorCode::UnknownAlgorithm, Cow::Owned(msg)));
            }
            if limit.is_some_and(|l| item.cost > l) && op != OP_REFUND {
                policy.counters.count(Outcome::Error);
                METRICS.decided(Decision::Error, Source::None, ErrorCode::InvalidCost);
                let msg = format!("cost {} is above the limit {} of policy '{}' for this key", item.cost, limit.unwrap_or(0), policy.name);
                return Err(Response::error(id, op, ErrorCode::InvalidCost, Cow::Owned(msg)));
            }
            out.push(Resolved { policy, limit });
        }
        Ok(out)
    }

    /// Decides a CHECK_POLICY of several items (or one refundable): every
    /// item admits and all are recorded, or none is recorded and the
    /// response names the first item that refused. Never coalesced; the
    /// denial cache answers when it refuses any enforced item (exact: Redis
    /// would refuse that item, so the request); shadow items never refuse.
    pub async fn decide_multi(&self, req: MultiCheckRequest) -> Response {
        let resolved = match self.resolve(req.id, OP_CHECK_POLICY, &req.items) {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        let n = req.items.len();
        let mut results = vec![ItemResult::NOT_EVALUATED; n];
        // The items a store decides; exempt ones are admitted here.
        let mut stored: Vec<usize> = Vec::with_capacity(n);
        for (i, r) in resolved.iter().enumerate() {
            match r.limit {
                Some(_) => stored.push(i),
                None => results[i] = ItemResult { decision: Decision::Allowed, source: Source::Exempt, window_ms: r.policy.window_ms, ..ItemResult::NOT_EVALUATED },
            }
        }
        let spec = |i: usize| LimitSpec { key: &req.items[i].scoped_key, limit: resolved[i].limit.unwrap_or(0), window_ms: resolved[i].policy.window_ms, cost: req.items[i].cost };
        let mut handle = None;
        let mut failure = None;
        let committed = match &self.backend {
            _ if stored.is_empty() => true,
            Backend::Local => {
                let specs: Vec<(LimitSpec<'_>, bool)> = stored.iter().map(|&i| (spec(i), resolved[i].policy.shadow)).collect();
                match self.local.check_multi(&specs) {
                    Ok((committed, verdicts)) => {
                        for (&i, v) in stored.iter().zip(verdicts) {
                            results[i] = item_result(v, Source::Memory, &spec(i));
                        }
                        committed
                    }
                    Err(full) => {
                        let check = CheckRequest { id: req.id, on_error: req.on_error, limit: 0, window_ms: 0, cost: 0, local_limit: 0, algorithm: Algorithm::Log, key: req.items[0].scoped_key.clone() };
                        return Response { op: OP_CHECK_POLICY, ..self.capacity_error(&check, Source::Memory, full) };
                    }
                }
            }
            Backend::Redis(redis) => {
                let mut tickets = Vec::with_capacity(stored.len());
                let mut cached_refusal = None;
                if let Some(d) = self.denials.as_deref() {
                    for &i in &stored {
                        match d.check(&spec(i), Algorithm::Log) {
                            Lookup::Refused(v) if !resolved[i].policy.shadow => {
                                cached_refusal = Some((i, v));
                                break;
                            }
                            Lookup::Refused(_) => tickets.push(None),
                            Lookup::Miss(t) => tickets.push(Some(t)),
                        }
                    }
                }
                if let Some((i, v)) = cached_refusal {
                    results[i] = item_result(v, Source::DenialCache, &spec(i));
                    false
                } else {
                    let asks: Vec<MultiAsk<'_>> = stored
                        .iter()
                        .map(|&i| {
                            let s = spec(i);
                            MultiAsk { key: s.key, window_ms: s.window_ms, limit: s.limit, cost: s.cost, shadow: resolved[i].policy.shadow, number: (i + 1) as u8 }
                        })
                        .collect();
                    match redis.check_multi(&asks).await {
                        Ok(answer) => {
                            for (k, (&i, v)) in stored.iter().zip(&answer.verdicts).enumerate() {
                                if let Some(v) = v {
                                    results[i] = item_result(*v, Source::Redis, &spec(i));
                                    if let (Some(d), Some(Some(t))) = (&self.denials, tickets.get(k)) {
                                        d.record(*t, spec(i).cost, v);
                                    }
                                }
                            }
                            if answer.committed && req.refundable {
                                handle = Some(answer.handle);
                            }
                            answer.committed
                        }
                        Err(e) => {
                            let committed = self.multi_fail_policy(&req, &resolved, &stored, &mut results);
                            failure = Some(e);
                            committed
                        }
                    }
                }
            }
        };
        self.multi_response(&req, &resolved, results, committed, handle, failure)
    }

    /// Redis could not decide a multi-item check: each item's fail policy
    /// (its policy's own, else the request's) decides, all or nothing:
    /// `closed` refuses, `open` admits, `local` items are checked together
    /// in the per-host windows with their local quota.
    fn multi_fail_policy(&self, req: &MultiCheckRequest, resolved: &[Resolved<'_>], stored: &[usize], results: &mut [ItemResult]) -> bool {
        let mut refused = false;
        let mut local: Vec<(usize, u32)> = Vec::new();
        for &i in stored {
            let p = resolved[i].policy;
            let (on_error, local_limit) = match p.fail_policy {
                Some(f) => (f, p.local_limit.unwrap_or(0)),
                None => (req.on_error, req.local_limit),
            };
            let limit = resolved[i].limit.unwrap_or(0);
            let base = ItemResult { limit, window_ms: p.window_ms, ..ItemResult::NOT_EVALUATED };
            METRICS.fail_policy_applied(on_error);
            results[i] = match on_error {
                FailPolicy::Open => ItemResult { decision: Decision::Allowed, source: Source::FailOpen, remaining: limit, ..base },
                FailPolicy::Closed => {
                    refused |= !p.shadow;
                    ItemResult { decision: Decision::Denied, source: Source::FailClosed, retry_after_ms: p.window_ms.min(1000), ..base }
                }
                FailPolicy::Local if req.items[i].cost > local_limit => {
                    refused |= !p.shadow;
                    ItemResult { decision: Decision::Denied, source: Source::LocalFallback, remaining: local_limit, retry_after_ms: p.window_ms, limit: local_limit, ..base }
                }
                FailPolicy::Local => {
                    local.push((i, local_limit));
                    base
                }
            };
        }
        if refused || local.is_empty() {
            return !refused;
        }
        let specs: Vec<(LimitSpec<'_>, bool)> = local
            .iter()
            .map(|&(i, l)| (LimitSpec { key: &req.items[i].scoped_key, limit: l, window_ms: resolved[i].policy.window_ms, cost: req.items[i].cost }, resolved[i].policy.shadow))
            .collect();
        match self.local.check_multi(&specs) {
            Ok((committed, verdicts)) => {
                for ((&(i, _), v), (s, _)) in local.iter().zip(verdicts).zip(&specs) {
                    results[i] = item_result(v, Source::LocalFallback, s);
                }
                committed
            }
            Err(full) => {
                if let Some(suppressed) = self.capacity_log.permit() {
                    tracing::warn!(error = %full, suppressed, "in-memory windows full: a multi-item check's local fallback refuses");
                }
                for &(i, _) in &local {
                    results[i].source = Source::LocalFallback;
                }
                false
            }
        }
    }

    /// The response of a decided multi-item check, and its counters.
    fn multi_response(&self, req: &MultiCheckRequest, resolved: &[Resolved<'_>], mut results: Vec<ItemResult>, committed: bool, handle: Option<[u8; 16]>, failure: Option<StoreError>) -> Response {
        let mut refused = 0u8;
        for (i, (r, res)) in resolved.iter().zip(results.iter_mut()).enumerate() {
            if res.decision == Decision::Denied && matches!(res.source, Source::Redis | Source::DenialCache | Source::Memory | Source::LocalFallback) {
                // As for a one-item check: the policy-scoped key (shadow too).
                TOP_REFUSED.record(&req.items[i].scoped_key);
            }
            let outcome = match (res.decision, res.source) {
                (Decision::Denied, Source::None) => None,
                (Decision::Denied, _) if r.policy.shadow => {
                    res.decision = Decision::ShadowDenied;
                    Some(Outcome::ShadowRefused)
                }
                (Decision::Denied, _) => {
                    if refused == 0 {
                        refused = (i + 1) as u8;
                    }
                    Some(outcome_of(&Response { decision: res.decision, source: res.source, ..Response::error(0, 0, ErrorCode::None, Cow::Borrowed("")) }))
                }
                (_, Source::Exempt) => Some(Outcome::Exempt),
                // Had room, but another item refused: charged nothing, counted nowhere.
                _ if !committed => None,
                _ => Some(outcome_of(&Response { decision: res.decision, source: res.source, ..Response::error(0, 0, ErrorCode::None, Cow::Borrowed("")) })),
            };
            if let Some(o) = outcome {
                r.policy.counters.count(o);
            }
        }
        // The fixed fields: the first refusing item's (retry-after: when
        // every refusing item fits), else the most constrained item's.
        let main = if refused > 0 {
            let mut m = results[refused as usize - 1];
            m.retry_after_ms = results.iter().filter(|r| r.decision == Decision::Denied && r.source != Source::None).map(|r| r.retry_after_ms).max().unwrap_or(m.retry_after_ms);
            m
        } else {
            results.iter().filter(|r| r.source != Source::Exempt && r.decision == Decision::Allowed).min_by_key(|r| r.remaining).copied().unwrap_or(results[0])
        };
        let mut resp = Response {
            id: req.id,
            op: OP_CHECK_POLICY,
            decision: if refused > 0 { Decision::Denied } else { Decision::Allowed },
            source: main.source,
            count: main.count,
            remaining: main.remaining,
            retry_after_ms: main.retry_after_ms,
            reset_ms: main.reset_ms,
            error: ErrorCode::None,
            message: Cow::Borrowed(""),
            extension: Some(Box::new(Extension { refused, handle, items: results })),
        };
        if let Some(e) = failure {
            if let Some(suppressed) = self.failure_log.permit() {
                tracing::warn!(error = %e, suppressed, "redis failed; a multi-item check's fail policies decide");
            }
            resp.error = error_code(&e);
            resp.message = Cow::Owned(e.to_string());
        }
        METRICS.decided(resp.decision, resp.source, resp.error);
        resp
    }

    /// Takes back what a refundable check recorded (REFUND, op 3): exact
    /// and idempotent with Redis (the members are removed; gone ones are
    /// not found). The in-memory backend keeps no member ids: it answers
    /// `REFUND_UNSUPPORTED`.
    pub async fn refund(&self, req: RefundRequest) -> Response {
        let resolved = match self.resolve(req.id, OP_REFUND, &req.items) {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        let resp = match &self.backend {
            Backend::Local => Response::error(req.id, OP_REFUND, ErrorCode::RefundUnsupported, Cow::Borrowed("the in-memory backend keeps no member ids: refunds need the Redis backend")),
            Backend::Redis(redis) => {
                let items: Vec<RefundItem<'_>> =
                    req.items.iter().zip(&resolved).enumerate().map(|(i, (item, r))| RefundItem { key: &item.scoped_key, window_ms: r.policy.window_ms, cost: item.cost, number: (i + 1) as u8 }).collect();
                let outcome = redis.refund_outcome(&req.handle, &items).await;
                match outcome.failure {
                    None => {
                        let removed = outcome.removed;
                        METRICS.refunded(removed);
                        if let Some(d) = self.denials.as_deref() {
                            for (item, r) in req.items.iter().zip(&resolved) {
                                if let Some(limit) = r.limit {
                                    d.forget(&LimitSpec { key: &item.scoped_key, limit, window_ms: r.policy.window_ms, cost: item.cost });
                                }
                            }
                        }
                        Response { decision: Decision::Allowed, source: Source::Redis, count: removed.min(u64::from(u32::MAX)) as u32, ..Response::error(req.id, OP_REFUND, ErrorCode::None, Cow::Borrowed("")) }
                    }
                    // The slots that answered were refunded: `count` says how much (PROTOCOL.md 4c).
                    Some(e) => Response { source: Source::Redis, count: outcome.removed.min(u64::from(u32::MAX)) as u32, ..Response::error(req.id, OP_REFUND, error_code(&e), Cow::Owned(e.to_string())) },
                }
            }
        };
        if resp.error != ErrorCode::None {
            METRICS.decided(resp.decision, resp.source, resp.error);
        }
        resp
    }
}

fn item_result(v: Verdict, source: Source, spec: &LimitSpec<'_>) -> ItemResult {
    ItemResult {
        decision: if v.allowed { Decision::Allowed } else { Decision::Denied },
        source,
        count: v.count,
        remaining: v.remaining,
        retry_after_ms: v.retry_after_ms,
        reset_ms: v.reset_ms,
        limit: spec.limit,
        window_ms: spec.window_ms,
    }
}

/// A refusal by a limit (a store, the denial cache, the local fallback's
/// quota), as `top` lists them: not fail-closed, not an error.
#[inline]
fn refused_by_a_limit(r: &Response) -> bool {
    r.decision == Decision::Denied && matches!(r.source, Source::Redis | Source::DenialCache | Source::Memory | Source::LocalFallback)
}

/// Why a store gave no verdict.
enum NoVerdict {
    /// Redis failed: the fail policy decides.
    Store(StoreError),
    /// The in-memory windows are full.
    Full(LocalStoreFull),
}

/// The per-policy outcome of a decided response.
fn outcome_of(r: &Response) -> Outcome {
    match (r.decision, r.source) {
        (Decision::Error, _) => Outcome::Error,
        (Decision::Denied, Source::DenialCache) => Outcome::RefusedFromCache,
        (_, Source::FailOpen) => Outcome::FailOpen,
        (_, Source::FailClosed) => Outcome::FailClosed,
        (Decision::Allowed, Source::LocalFallback) => Outcome::FailLocalAdmitted,
        (_, Source::LocalFallback) => Outcome::FailLocalRefused,
        (Decision::Allowed, _) => Outcome::Admitted,
        _ => Outcome::Refused,
    }
}

fn respond(req: &CheckRequest, source: Source, v: Verdict) -> Response {
    respond_id(req.id, source, v)
}

fn respond_id(id: u32, source: Source, v: Verdict) -> Response {
    Response {
        id,
        op: OP_CHECK,
        decision: if v.allowed { Decision::Allowed } else { Decision::Denied },
        source,
        count: v.count,
        remaining: v.remaining,
        retry_after_ms: v.retry_after_ms,
        reset_ms: v.reset_ms,
        error: ErrorCode::None,
        message: Cow::Borrowed(""),
        extension: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn req(key: &'static str, limit: u32, on_error: FailPolicy) -> CheckRequest {
        CheckRequest { id: 1, on_error, limit, window_ms: 1000, cost: 1, local_limit: 2, key: Bytes::from_static(key.as_bytes()), algorithm: crate::protocol::Algorithm::Log }
    }

    fn policy_req(name: &'static str, key: &'static str) -> PolicyCheckRequest {
        let mut scoped = vec![name.len() as u8];
        scoped.extend_from_slice(name.as_bytes());
        scoped.extend_from_slice(key.as_bytes());
        let scoped = Bytes::from(scoped);
        PolicyCheckRequest {
            id: 3,
            on_error: FailPolicy::Closed,
            local_limit: 0,
            cost: 1,
            name: scoped.slice(1..1 + name.len()),
            key: scoped.slice(1 + name.len()..),
            scoped_key: scoped,
        }
    }

    fn policies(shadow: bool) -> Arc<Policies> {
        use crate::config::PolicyConfig;
        let order = PolicyConfig {
            name: "order".into(),
            limit: 2,
            window: Duration::from_secs(60),
            calendar_window_ms: None,
            fail_policy: None,
            local_limit: None,
            shadow,
            algorithm: crate::protocol::Algorithm::Log,
            lease_ms: None,
            shards: 1,
            overrides: [("big".to_string(), PolicyLimit::Limit(3)), ("free".to_string(), PolicyLimit::Unlimited)].into_iter().collect(),
        };
        Arc::new(Policies::build(&[order], None))
    }

    #[tokio::test]
    async fn policies_resolve_limits_overrides_and_unknown_names() {
        let l = Limiter::new(Backend::Local, Arc::new(LocalStore::new(1000))).with_policies(policies(false));
        let run = |key| {
            let l = &l;
            async move {
                let mut got = Vec::new();
                for _ in 0..4 {
                    got.push(l.decide_policy(policy_req("order", key)).await.decision);
                }
                got
            }
        };
        use Decision::{Allowed as A, Denied as D};
        assert_eq!(run("t1").await, [A, A, D, D]);
        assert_eq!(run("big").await, [A, A, A, D], "the override's limit");
        let r = l.decide_policy(policy_req("order", "free")).await;
        assert_eq!((r.decision, r.source, r.op), (A, Source::Exempt, OP_CHECK_POLICY));
        // The policy's window is scoped: an inline check of the same key is not charged.
        assert_eq!(l.decide(req("t1", 2, FailPolicy::Closed)).await.decision, A);
        let r = l.decide_policy(policy_req("nope", "t1")).await;
        assert_eq!((r.decision, r.source, r.error), (Decision::Error, Source::None, ErrorCode::UnknownPolicy));
        let c = &l.policies().get(b"order").unwrap().counters;
        assert_eq!((c.get(Outcome::Admitted), c.get(Outcome::Refused), c.get(Outcome::Exempt)), (5, 3, 1));
    }

    /// A sharded policy against a serial model: limit 10 over 3 shards (4,
    /// 3, 3) admits exactly 10 of any number of requests of cost 1, the
    /// refusal reports the room left summed over the shards (0) and the
    /// key's limit as count + remaining; a cost above the largest shard (4)
    /// is INVALID_COST.
    #[tokio::test]
    async fn sharded_policy_admits_exactly_its_limit() {
        use crate::config::PolicyConfig;
        let hot = PolicyConfig { algorithm: Algorithm::Log, name: "hot".into(), limit: 10, window: Duration::from_secs(60), calendar_window_ms: None, fail_policy: None, local_limit: None, shadow: false, lease_ms: None, shards: 3, overrides: Default::default() };
        let l = Limiter::new(Backend::Local, Arc::new(LocalStore::new(1000))).with_policies(Arc::new(Policies::build(&[hot], None)));
        let mut admitted = 0;
        for n in 0..25 {
            let r = l.decide_policy(policy_req("hot", "t1")).await;
            assert_eq!(r.count + r.remaining, 10, "{r:?}");
            match r.decision {
                Decision::Allowed => admitted += 1,
                Decision::Denied => {
                    assert!(n >= 10, "refused at request {n} with room left: {r:?}");
                    assert_eq!((r.source, r.remaining), (Source::Memory, 0), "{r:?}");
                    assert!(r.retry_after_ms > 0 && r.retry_after_ms <= 60_000, "{r:?}");
                }
                d => panic!("{d:?}"),
            }
        }
        assert_eq!(admitted, 10);
        // The shards' own windows hold 4, 3 and 3.
        for (i, part) in [(0, 4), (1, 3), (2, 3)] {
            let key = crate::redis::shard_key(&policy_req("hot", "t1").scoped_key, i, 3);
            let v = l.local.check(&LimitSpec { key: &key, limit: part, window_ms: 60_000, cost: 1 }, Algorithm::Log).unwrap();
            assert_eq!((v.allowed, v.count), (false, part), "shard {i}");
        }
        let big = PolicyCheckRequest { cost: 5, ..policy_req("hot", "t2") };
        let r = l.decide_policy(big).await;
        assert_eq!(r.error, ErrorCode::InvalidCost, "{r:?}");
        assert!(r.message.contains("largest shard"), "{}", r.message);
    }

    #[tokio::test]
    async fn shadow_policies_report_refusals_and_admit() {
        let l = Limiter::new(Backend::Local, Arc::new(LocalStore::new(1000))).with_policies(policies(true));
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(l.decide_policy(policy_req("order", "t1")).await.decision);
        }
        assert_eq!(got, [Decision::Allowed, Decision::Allowed, Decision::ShadowDenied, Decision::ShadowDenied]);
        assert_eq!(l.policies().get(b"order").unwrap().counters.get(Outcome::ShadowRefused), 2);
    }

    #[tokio::test]
    async fn memory_backend_answers_with_source_memory() {
        let l = Limiter::new(Backend::Local, Arc::new(LocalStore::new(1000)));
        let r = l.decide(req("a", 1, FailPolicy::Closed)).await;
        assert_eq!((r.decision, r.source, r.count, r.remaining), (Decision::Allowed, Source::Memory, 1, 0));
        let r = l.decide(req("a", 1, FailPolicy::Closed)).await;
        assert_eq!(r.decision, Decision::Denied);
        assert_eq!(r.error, ErrorCode::None);
    }

    #[test]
    fn fail_policies_decide_on_backend_errors() {
        let l = Limiter::new(Backend::Local, Arc::new(LocalStore::new(1000)));
        let e = || StoreError::Timeout(Duration::from_millis(20));
        let spec_of = |r: &CheckRequest| LimitSpec { key: b"k", limit: r.limit, window_ms: r.window_ms, cost: r.cost };

        let open = req("k", 10, FailPolicy::Open);
        let r = l.on_backend_error(&open, spec_of(&open), e());
        assert_eq!((r.decision, r.source, r.error), (Decision::Allowed, Source::FailOpen, ErrorCode::RedisTimeout));

        let closed = req("k", 10, FailPolicy::Closed);
        let r = l.on_backend_error(&closed, spec_of(&closed), e());
        assert_eq!((r.decision, r.source, r.retry_after_ms), (Decision::Denied, Source::FailClosed, 1000));

        let local = req("k", 10, FailPolicy::Local);
        let got: Vec<_> = (0..3).map(|_| l.on_backend_error(&local, spec_of(&local), e()).decision).collect();
        assert_eq!(got, [Decision::Allowed, Decision::Allowed, Decision::Denied]);

        let r = l.on_backend_error(&closed, spec_of(&closed), StoreError::Overloaded(64));
        assert_eq!((r.decision, r.source, r.error), (Decision::Denied, Source::FailClosed, ErrorCode::Overloaded));
        assert!(matches!(r.message, Cow::Borrowed(_)), "shedding allocates no message");
    }
}
