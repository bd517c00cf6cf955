//! Turns a validated request into a response: asks the store, and when the
//! shared store fails, applies the request's fail policy.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::denial_cache::{DenialCache, Lookup};
use crate::local_store::{LocalStore, LocalStoreFull};
use crate::log_limit::RateLimitedLog;
use crate::metrics::METRICS;
use crate::protocol::{CheckRequest, Decision, ErrorCode, FailPolicy, Response, Source, OP_CHECK};
use crate::redis::RedisWindow;
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
        }
    }

    /// Puts `denials` in front of the Redis backend.
    pub fn with_denial_cache(self, denials: Option<Arc<DenialCache>>) -> Self {
        Self { denials, ..self }
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// `decide`, owning its limiter: the future outlives a reload.
    pub async fn decide_owned(self: Arc<Self>, req: CheckRequest) -> Response {
        self.decide(req).await
    }

    /// Decides one request. Never fails: errors become responses.
    pub async fn decide(&self, req: CheckRequest) -> Response {
        let resp = self.decide_inner(req).await;
        METRICS.decided(resp.decision, resp.source, resp.error);
        resp
    }

    async fn decide_inner(&self, req: CheckRequest) -> Response {
        let spec = LimitSpec { key: &req.key, limit: req.limit, window_ms: req.window_ms, cost: req.cost };
        match &self.backend {
            Backend::Local => match self.local.check(&spec) {
                Ok(v) => respond(&req, Source::Memory, v),
                Err(full) => self.capacity_error(&req, Source::Memory, full),
            },
            Backend::Redis(redis) => {
                let ticket = match self.denials.as_deref().map(|d| d.check(&spec)) {
                    Some(Lookup::Refused(v)) => return respond(&req, Source::DenialCache, v),
                    Some(Lookup::Miss(ticket)) => Some(ticket),
                    None => None,
                };
                match redis.check(&spec).await {
                    Ok(v) => {
                        if let (Some(d), Some(t)) = (&self.denials, ticket) {
                            d.record(t, spec.cost, &v);
                        }
                        respond(&req, Source::Redis, v)
                    }
                    Err(e) => self.on_backend_error(&req, spec, e),
                }
            }
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
