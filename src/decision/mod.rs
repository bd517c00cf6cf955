//! The decision pipeline: one validated `Request` (the decoder's) is
//! decided along one path, shaped like envoyproxy/ratelimit's
//! `shouldRateLimitWorker`:
//!
//! 1. **resolve** (`resolve.rs`) every item once: inline or a policy's
//!    limit after overrides and the allowlist, window, algorithm, shadow,
//!    shards, fail policy; a combination that cannot be honoured is refused
//!    there, the same way for every kind of request;
//! 2. **plan** (`plan.rs`) the store windows: one key, or a sharded key's
//!    shards in round robin, the same for single, multi-item and
//!    refundable checks and refunds;
//! 3. **execute** (`execute.rs` one item, `multi.rs` several all or
//!    nothing and refunds) against the memory backend, the denial cache and
//!    Redis, with the fail policies;
//! 4. **respond** (`respond.rs`): one response; and the request counted
//!    once, in one place (`count::account`, called by `decide` only).
//!
//! Reserve and settle (`settle.rs`, docs/PROTOCOL.md 4f) are two more
//! kinds of request along the same steps.
//!
//! A single check is the one-item case of the same steps without the
//! generality's cost: no allocation, and Redis's coalescing `check` (every
//! algorithm, the denial cache); several items or a refundable one go
//! through Redis's all-or-nothing `check_multi`.

mod count;
mod execute;
mod fail;
mod layers;
mod lease;
mod limiter;
mod multi;
mod penalty;
mod plan;
mod resolve;
mod respond;
mod settle;

use std::sync::Arc;

use crate::protocol::{
    unknown_policy_response, DescribeRequest, PolicyDescription, PolicyKind, Decision, ErrorCode, FailPolicy, Header, LeaseRequest, MultiCheckRequest, PolicyCheckRequest, PolicyItem, PolicyLeaseRequest, RefundRequest, Request, Response, Source, OP_ACQUIRE, OP_ACQUIRE_POLICY, OP_CHECK,
    OP_CHECK_POLICY, OP_LEASE_SHARE, OP_REFUND,
};
use crate::metrics::METRICS;
use crate::protocol::Algorithm;
use crate::window::LimitSpec;

pub(crate) use count::count_undecoded;
pub use lease::{lease_life_ms, leasable, reserved_life_ms, QuotaLease, QuotaLeases, ShareAnswer, WorkerShare, MAX_LEASE_UNITS, MAX_SHARE_MS};
pub use limiter::Limiter;
pub use resolve::{kind_refusal, Kind};

use count::{account, Charge};
use resolve::{Item, Named, Rejected};

/// A decided request and what it is counted against.
type Decided<'a> = (Response, Charge<'a>);

impl<'a> From<Rejected<'a>> for Decided<'a> {
    fn from(r: Rejected<'a>) -> Self {
        (r.response, r.charge)
    }
}

impl Limiter {
    /// Decides one request, owning its limiter (the future outlives a
    /// reload). Never fails: errors become responses. Every request is
    /// counted here, once.
    pub async fn decide(self: Arc<Self>, req: Request) -> Response {
        let (response, charge) = match &req {
            Request::Check(r) => (self.check_item(r.header.id, OP_CHECK, &Item::inline(r), r.limit).await, Charge::one(None, Some(&r.key[..]))),
            Request::PolicyCheck(r) => self.policy_check(r).await,
            // Boxed: their futures are larger, and the single checks' future
            // (one per request in flight) stays the size it was.
            Request::MultiCheck(r) => Box::pin(self.multi_check(r)).await,
            Request::Refund(r) => Box::pin(self.refund(r)).await,
            Request::Lease(r) => Box::pin(self.inline_lease(r)).await,
            Request::PolicyLease(r) => Box::pin(self.policy_lease(r)).await,
            Request::Reserve(r) => Box::pin(self.reserve(r)).await,
            Request::Settle(r) => Box::pin(self.settle(r)).await,
            Request::LeaseShare(r) => (Box::pin(self.lease_share(r)).await, Charge::Nobody),
            Request::InlineShare(r) => (Box::pin(self.share_item(r.header.id, OP_CHECK, &Item::inline(r), r.cost)).await, Charge::Nobody),
            Request::GiveBack(r) => (self.give_back(r), Charge::Nobody),
            Request::InlineGiveBack(r) => (self.give_back_item(r.header.id, OP_CHECK, &Item::inline(r), r.cost), Charge::Nobody),
            Request::Describe(r) => (self.describe(r), Charge::Described),
        };
        account(&response, &charge);
        response
    }

    /// DESCRIBE_POLICY (op 8): the configuration in force's policy of that
    /// name, or UNKNOWN_POLICY. Not a decision: no store asked, nothing
    /// counted as one, nothing logged (the client logs an unknown name).
    fn describe(&self, r: &DescribeRequest) -> Response {
        let Some(p) = self.policies.get(&r.name) else { return unknown_policy_response(r.id) };
        // nginx names this policy: a reload may not drop it unforced.
        p.counters.described(r.uses);
        PolicyDescription {
            kind: if p.rule.lease_ms.is_some() { PolicyKind::Concurrency } else { PolicyKind::Rate },
            algorithm: p.rule.algorithm,
            limit: p.rule.limit,
            window_ms: p.rule.lease_ms.unwrap_or(p.rule.window_ms),
            on_error: p.rule.fail_policy,
            local_limit: p.rule.local_limit.unwrap_or(0),
            shadow: p.rule.shadow,
        }
        .to_response(r.id)
    }

    /// CHECK_POLICY of one item: resolved, then decided exactly as a CHECK
    /// of its limit, window and cost would be (same stores, denial cache and
    /// coalescing), under the key scoped to the policy, or its shards.
    async fn policy_check<'a>(&'a self, r: &'a PolicyCheckRequest) -> Decided<'a> {
        let item = match self.resolve(&named(OP_CHECK_POLICY, &r.header, &r.item), Kind::Check) {
            Ok(item) => item,
            Err(rejected) => return rejected.into(),
        };
        let (id, charge) = (r.header.id, Charge::one(item.policy, Some(&r.item.scoped_key[..])));
        let Some(limit) = item.limit else { return (respond::shadowed(respond::exempt(id, OP_CHECK_POLICY), &item), charge) };
        (respond::shadowed(self.check_item(id, OP_CHECK_POLICY, &item, limit).await, &item), charge)
    }

    /// CHECK_POLICY of several items, or of one refundable: all or nothing.
    async fn multi_check<'a>(&'a self, r: &'a MultiCheckRequest) -> Decided<'a> {
        let op = OP_CHECK_POLICY;
        let id = r.header.id;
        let items = match self.resolve_all(op, r.header, &r.items, Kind::Multi) {
            Ok(items) => items,
            Err(rejected) => return rejected.into(),
        };
        let done = match self.check_items(id, op, &items, r.refundable).await {
            Ok(done) => done,
            Err(response) => return (response, Charge::Nobody),
        };
        if let Some(e) = &done.failure {
            if let Some(suppressed) = self.failure_log.permit() {
                tracing::warn!(error = %e, suppressed, "redis failed; a multi-item check's fail policies decide");
            }
        }
        let response = respond::aggregate(id, op, &items, done);
        let policies = items.iter().filter_map(|i| i.policy).collect();
        (response, Charge::Items { policies, items: &r.items })
    }

    /// REFUND: the admission's members removed from its items' windows.
    async fn refund<'a>(&'a self, r: &'a RefundRequest) -> Decided<'a> {
        let items = match self.resolve_all(OP_REFUND, Header { id: r.id, on_error: FailPolicy::Closed, local_limit: 0 }, &r.items, Kind::Refund) {
            Ok(items) => items,
            Err(rejected) => return rejected.into(),
        };
        match self.refund_items(r.id, OP_REFUND, &r.handle, &items).await {
            Ok(removed) => {
                let count = removed.min(u64::from(u32::MAX)) as u32;
                (Response { decision: Decision::Allowed, source: Source::Redis, count, ..Response::error(r.id, OP_REFUND, ErrorCode::None, "".into()) }, Charge::Refund { removed })
            }
            Err(response) => (response, Charge::Nobody),
        }
    }

    /// ACQUIRE or RELEASE (ops 5, 6) of an inline concurrency limit.
    async fn inline_lease<'a>(&'a self, r: &'a LeaseRequest) -> Decided<'a> {
        let item = Item::inline_lease(r);
        (self.lease(r.header.id, r.op, r.op == OP_ACQUIRE, &item, r.limit, &r.lease).await, Charge::one(None, None))
    }

    /// ACQUIRE_POLICY (op 7) or its release: resolved (limit, override,
    /// allowlist, lease, fail policy), then decided as ops 5 and 6 would
    /// under the key scoped to the policy. Only an acquire is ever a
    /// shadow refusal (SEMANTICS S5): a release of a lease not held is a
    /// release, whatever the policy.
    async fn policy_lease<'a>(&'a self, r: &'a PolicyLeaseRequest) -> Decided<'a> {
        let op = OP_ACQUIRE_POLICY;
        let id = r.header.id;
        let item = match self.resolve(&named(op, &r.header, &r.item), Kind::Lease { release: r.release }) {
            Ok(item) => item,
            Err(rejected) => return rejected.into(),
        };
        let charge = Charge::one(item.policy, None);
        // Exempt: nothing acquired, so nothing to release.
        let Some(limit) = item.limit else { return (if r.release { respond::exempt(id, op) } else { respond::shadowed(respond::exempt(id, op), &item) }, charge) };
        let response = self.lease(id, op, !r.release, &item, limit, &r.lease).await;
        (if r.release { response } else { respond::shadowed(response, &item) }, charge)
    }

    /// LEASE_SHARE (op 10): units of this daemon's quota lease on the
    /// policy's key for a worker's shared dict, when the key resolves to a
    /// plain log window (not exempt, shadow, sharded or penalized) and the daemon
    /// holds a lease for its limit now in force (after overrides). Not a
    /// decision: nothing is counted but the share metric; the answer is
    /// `count` units (0: none) valid for `retry_after_ms` from the worker's
    /// send. A Redis call only when the hot key has no lease in hand.
    async fn lease_share(&self, r: &PolicyCheckRequest) -> Response {
        let op = OP_LEASE_SHARE;
        // Resolved as a check of cost 1: the units wanted are not a cost.
        let named = Named { cost: 1, ..named(op, &r.header, &r.item) };
        match self.resolve(&named, Kind::Check) {
            Ok(item) => self.share_item(r.header.id, op, &item, r.item.cost).await,
            Err(rejected) => rejected.response,
        }
    }

    /// LEASE_SHARE with the give-back flag: units of a worker share of the
    /// policy's key that no worker used, back into this daemon's lease.
    fn give_back(&self, r: &PolicyCheckRequest) -> Response {
        let op = OP_LEASE_SHARE;
        let named = Named { cost: 1, ..named(op, &r.header, &r.item) };
        match self.resolve(&named, Kind::Check) {
            Ok(item) => self.give_back_item(r.header.id, op, &item, r.item.cost),
            Err(rejected) => rejected.response,
        }
    }

    /// `units` of a worker share of a resolved item's window given back,
    /// unused: taken back into the lease they were shared from, if this
    /// daemon still holds it (its settle then removes them from Redis, or
    /// the daemon admits from them); else nothing (they stay counted until
    /// they leave the window: under-admission only). No Redis call. The
    /// answer's `count` is the units taken back, `remaining` the key's
    /// room outside the lease plus its units left.
    fn give_back_item(&self, id: u32, op: u8, item: &Item<'_>, units: u32) -> Response {
        let (taken, remaining) = match (item.limit, &self.leases) {
            (Some(limit), Some(leases)) if item.algorithm == Algorithm::Log => leases.take_back(&LimitSpec { key: item.key, limit, window_ms: item.window_ms, cost: 1 }, units),
            _ => (0, 0),
        };
        if taken > 0 {
            METRICS.share_units_given_back(taken);
            if let Some(p) = item.policy {
                p.counters.share_given_back(taken);
            }
        }
        Response {
            decision: Decision::Allowed,
            source: Source::Redis,
            count: taken,
            remaining,
            reset_ms: item.window_ms,
            ..Response::error(id, op, ErrorCode::None, "".into())
        }
    }

    /// `units` of this daemon's quota lease on a resolved item's window
    /// for a worker (op 10, or an inline limit's CHECK with the share flag),
    /// when the item is a plain log window (not exempt, shadow, sharded or
    /// penalized) and the daemon holds a lease for its limit now in force.
    async fn share_item(&self, id: u32, op: u8, item: &Item<'_>, units: u32) -> Response {
        let share = match (item.limit, &self.leases) {
            // A penalty policy's refusals must reach Redis (each one is a strike), so
            // its keys are never leased, to the daemon or to a worker.
            (Some(limit), Some(leases)) if !item.shadow && item.shards == 1 && item.algorithm == Algorithm::Log && item.policy.map_or(true, |p| p.rule.penalty.is_none()) => {
                // A Redis error leaves the worker deciding per request.
                leases.share(&LimitSpec { key: item.key, limit, window_ms: item.window_ms, cost: 1 }, units).await.ok()
            }
            _ => None,
        };
        // With no units, retry_after_ms is when to ask again (0: not soon).
        let (share, retry_after_ms) = match share.unwrap_or(ShareAnswer::NONE) {
            ShareAnswer::Units(s) => (s, s.valid_ms),
            ShareAnswer::NoUnits { ask_again_ms } => (WorkerShare { units: 0, valid_ms: 0, remaining: 0 }, ask_again_ms),
        };
        METRICS.lease_share(share.units);
        if let (Some(p), true) = (item.policy, share.units > 0) {
            p.counters.shared(share.units);
        }
        Response {
            decision: Decision::Allowed,
            source: Source::Redis,
            count: share.units,
            remaining: share.remaining,
            retry_after_ms,
            reset_ms: item.window_ms,
            ..Response::error(id, op, ErrorCode::None, "".into())
        }
    }

    /// Resolves every item of a multi-item check or a refund; the first
    /// refused one answers for the whole request.
    fn resolve_all<'a>(&'a self, op: u8, header: Header, items: &'a [PolicyItem], kind: Kind) -> Result<Vec<Item<'a>>, Rejected<'a>> {
        items.iter().map(|i| self.resolve(&named(op, &header, i), kind)).collect()
    }
}

/// A policy item of request `header`, to resolve.
fn named<'a>(op: u8, header: &Header, i: &'a PolicyItem) -> Named<'a> {
    Named { id: header.id, op, name: i.name(), key: i.key(), scoped_key: &i.scoped_key, cost: i.cost, on_error: header.on_error, local_limit: header.local_limit }
}

#[cfg(test)]
mod tests {
    //! The pipeline on the memory backend: policies, overrides, shards,
    //! shadow, fail policies.

    use std::borrow::Cow;
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::config::PolicyLimit;
    use crate::local_store::LocalStore;
    use crate::policies::{Outcome, Policies};
    use crate::protocol::{Algorithm, CheckRequest, ErrorCode, FailPolicy};
    use crate::window::{LimitSpec, StoreError};
    use bytes::Bytes;

    fn req(key: &'static str, limit: u32, on_error: FailPolicy) -> CheckRequest {
        CheckRequest { header: Header { id: 1, on_error, local_limit: 2 }, limit, window_ms: 1000, cost: 1, key: Bytes::from_static(key.as_bytes()), algorithm: crate::protocol::Algorithm::Log }
    }

    fn policy_req(name: &'static str, key: &'static str) -> PolicyCheckRequest {
        let mut scoped = vec![name.len() as u8];
        scoped.extend_from_slice(name.as_bytes());
        scoped.extend_from_slice(key.as_bytes());
        let scoped = Bytes::from(scoped);
        PolicyCheckRequest {
            header: Header { id: 3, on_error: FailPolicy::Closed, local_limit: 0 },
            item: PolicyItem { cost: 1, scoped_key: scoped },
        }
    }

    fn policies(shadow: bool) -> Arc<Policies> {
        use crate::config::{PolicyConfig, PolicyRule};
        let order = PolicyConfig {
            name: "order".into(),
            rule: PolicyRule { shadow, ..PolicyRule::rate(2, 60_000) },
            overrides: [("big".to_string(), PolicyLimit::Limit(3)), ("free".to_string(), PolicyLimit::Unlimited)].into_iter().collect(),
        };
        Arc::new(Policies::build(&[order], None))
    }

    #[tokio::test]
    async fn policies_resolve_limits_overrides_and_unknown_names() {
        let l = Arc::new(Limiter::memory(Arc::new(LocalStore::new(1000))).with_policies(policies(false)));
        let run = |key| {
            let l = &l;
            async move {
                let mut got = Vec::new();
                for _ in 0..4 {
                    got.push(l.clone().decide(Request::PolicyCheck(policy_req("order", key))).await.decision);
                }
                got
            }
        };
        use Decision::{Allowed as A, Denied as D};
        assert_eq!(run("t1").await, [A, A, D, D]);
        assert_eq!(run("big").await, [A, A, A, D], "the override's limit");
        let r = l.clone().decide(Request::PolicyCheck(policy_req("order", "free"))).await;
        assert_eq!((r.decision, r.source, r.op), (A, Source::Exempt, OP_CHECK_POLICY));
        // The policy's window is scoped: an inline check of the same key is not charged.
        assert_eq!(l.clone().decide(Request::Check(req("t1", 2, FailPolicy::Closed))).await.decision, A);
        let r = l.clone().decide(Request::PolicyCheck(policy_req("nope", "t1"))).await;
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
        use crate::config::{PolicyConfig, PolicyRule};
        let hot = PolicyConfig { name: "hot".into(), rule: PolicyRule { shards: 3, ..PolicyRule::rate(10, 60_000) }, overrides: Default::default() };
        let l = Arc::new(Limiter::memory(Arc::new(LocalStore::new(1000))).with_policies(Arc::new(Policies::build(&[hot], None))));
        let mut admitted = 0;
        for n in 0..25 {
            let r = l.clone().decide(Request::PolicyCheck(policy_req("hot", "t1"))).await;
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
            let key = crate::redis::shard_key(&policy_req("hot", "t1").item.scoped_key, i, 3);
            let v = l.local.check(&LimitSpec { key: &key, limit: part, window_ms: 60_000, cost: 1 }, Algorithm::Log).unwrap();
            assert_eq!((v.allowed, v.count), (false, part), "shard {i}");
        }
        let mut big = policy_req("hot", "t2");
        big.item.cost = 5;
        let r = l.clone().decide(Request::PolicyCheck(big)).await;
        assert_eq!(r.error, ErrorCode::InvalidCost, "{r:?}");
        assert!(r.message.contains("largest shard"), "{}", r.message);
    }

    #[tokio::test]
    async fn shadow_policies_report_refusals_and_admit() {
        let l = Arc::new(Limiter::memory(Arc::new(LocalStore::new(1000))).with_policies(policies(true)));
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(l.clone().decide(Request::PolicyCheck(policy_req("order", "t1"))).await.decision);
        }
        // Marked either way, so that no client shows a shadow policy.
        assert_eq!(got, [Decision::ShadowAllowed, Decision::ShadowAllowed, Decision::ShadowDenied, Decision::ShadowDenied]);
        assert_eq!(l.policies().get(b"order").unwrap().counters.get(Outcome::ShadowRefused), 2);
        assert_eq!(l.policies().get(b"order").unwrap().counters.get(Outcome::Admitted), 2);
    }

    #[tokio::test]
    async fn memory_backend_answers_with_source_memory() {
        let l = Arc::new(Limiter::memory(Arc::new(LocalStore::new(1000))));
        let r = l.clone().decide(Request::Check(req("a", 1, FailPolicy::Closed))).await;
        assert_eq!((r.decision, r.source, r.count, r.remaining), (Decision::Allowed, Source::Memory, 1, 0));
        let r = l.clone().decide(Request::Check(req("a", 1, FailPolicy::Closed))).await;
        assert_eq!(r.decision, Decision::Denied);
        assert_eq!(r.error, ErrorCode::None);
    }

    #[test]
    fn fail_policies_decide_on_backend_errors() {
        let l = Arc::new(Limiter::memory(Arc::new(LocalStore::new(1000))));
        let e = || StoreError::Timeout(Duration::from_millis(20));
        let item = |r: &'static CheckRequest| Item::inline(r);
        let open: &'static CheckRequest = Box::leak(Box::new(req("k", 10, FailPolicy::Open)));
        let r = l.on_store_error(1, OP_CHECK, &item(open), 10, e());
        assert_eq!((r.decision, r.source, r.error), (Decision::Allowed, Source::FailOpen, ErrorCode::RedisTimeout));

        let closed: &'static CheckRequest = Box::leak(Box::new(req("k", 10, FailPolicy::Closed)));
        let r = l.on_store_error(1, OP_CHECK, &item(closed), 10, e());
        assert_eq!((r.decision, r.source, r.retry_after_ms), (Decision::Denied, Source::FailClosed, 1000));

        let local: &'static CheckRequest = Box::leak(Box::new(req("k", 10, FailPolicy::Local)));
        let got: Vec<_> = (0..3).map(|_| l.on_store_error(1, OP_CHECK, &item(local), 10, e()).decision).collect();
        assert_eq!(got, [Decision::Allowed, Decision::Allowed, Decision::Denied]);

        let r = l.on_store_error(1, OP_CHECK, &item(closed), 10, StoreError::Overloaded(64));
        assert_eq!((r.decision, r.source, r.error), (Decision::Denied, Source::FailClosed, ErrorCode::Overloaded));
        assert!(matches!(r.message, Cow::Borrowed(_)), "shedding allocates no message");
    }
}
