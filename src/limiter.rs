//! Turns a validated request into a response: asks the store, and when the
//! shared store fails, applies the request's fail policy.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::denial_cache::{DenialCache, Lookup};
use crate::local_store::{LocalStore, LocalStoreFull};
use crate::log_limit::RateLimitedLog;
use crate::metrics::METRICS;
use crate::config::PolicyLimit;
use crate::policies::{shard_limit, Outcome, Policies, Policy};
use crate::protocol::{CheckRequest, Decision, ErrorCode, FailPolicy, PolicyCheckRequest, Response, Source, OP_CHECK, OP_CHECK_POLICY};
use crate::redis::{shard_key, RedisWindow};
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

/// A validated request of either op.
#[derive(Debug)]
pub enum Ask {
    Check(CheckRequest),
    Policy(PolicyCheckRequest),
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
        let check = CheckRequest { id: req.id, on_error, limit, window_ms: policy.window_ms, cost: req.cost, local_limit, key: req.scoped_key };
        let mut resp = if policy.shards > 1 { self.decide_sharded(policy, check).await } else { self.decide_inner(check).await };
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

    /// A name the configuration does not have: a configuration error of the
    /// location (or a reload that removed the policy), logged loudly; the
    /// client's own fail policy decides.
    fn unknown_policy(&self, req: &PolicyCheckRequest) -> Response {
        METRICS.decided(Decision::Error, Source::None, ErrorCode::UnknownPolicy);
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
        }
    }

    /// Decides one request. Never fails: errors become responses.
    pub async fn decide(&self, req: CheckRequest) -> Response {
        let resp = self.decide_inner(req).await;
        METRICS.decided(resp.decision, resp.source, resp.error);
        resp
    }

    async fn decide_inner(&self, req: CheckRequest) -> Response {
        let spec = LimitSpec { key: &req.key, limit: req.limit, window_ms: req.window_ms, cost: req.cost };
        match self.verdict(&spec).await {
            Ok((source, v)) => respond(&req, source, v),
            Err(NoVerdict::Full(full)) => self.capacity_error(&req, Source::Memory, full),
            Err(NoVerdict::Store(e)) => self.on_backend_error(&req, spec, e),
        }
    }

    /// The store's verdict on `spec`: the in-memory backend's, or the denial
    /// cache's, or Redis's (recorded in the denial cache). No fail policy.
    async fn verdict(&self, spec: &LimitSpec<'_>) -> Result<(Source, Verdict), NoVerdict> {
        match &self.backend {
            Backend::Local => self.local.check(spec).map(|v| (Source::Memory, v)).map_err(NoVerdict::Full),
            Backend::Redis(redis) => {
                let ticket = match self.denials.as_deref().map(|d| d.check(spec)) {
                    Some(Lookup::Refused(v)) => return Ok((Source::DenialCache, v)),
                    Some(Lookup::Miss(ticket)) => Some(ticket),
                    None => None,
                };
                let v = redis.check(spec).await.map_err(NoVerdict::Store)?;
                if let (Some(d), Some(t)) = (&self.denials, ticket) {
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
            match self.verdict(&spec).await {
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
                    Verdict { remaining: req.local_limit, retry_after_ms: req.window_ms, ..Verdict::default() }
                } else {
                    match self.local.check(&LimitSpec { limit: req.local_limit, ..spec }) {
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
    Response {
        id: req.id,
        op: OP_CHECK,
        decision: if v.allowed { Decision::Allowed } else { Decision::Denied },
        source,
        count: v.count,
        remaining: v.remaining,
        retry_after_ms: v.retry_after_ms,
        reset_ms: v.reset_ms,
        error: ErrorCode::None,
        message: Cow::Borrowed(""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn req(key: &'static str, limit: u32, on_error: FailPolicy) -> CheckRequest {
        CheckRequest { id: 1, on_error, limit, window_ms: 1000, cost: 1, local_limit: 2, key: Bytes::from_static(key.as_bytes()) }
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
            fail_policy: None,
            local_limit: None,
            shadow,
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
        let hot = PolicyConfig { name: "hot".into(), limit: 10, window: Duration::from_secs(60), fail_policy: None, local_limit: None, shadow: false, shards: 3, overrides: Default::default() };
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
            let v = l.local.check(&LimitSpec { key: &key, limit: part, window_ms: 60_000, cost: 1 }).unwrap();
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
