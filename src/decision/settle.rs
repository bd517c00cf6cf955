//! Costs known after the response (docs/PROTOCOL.md 4f): a reserve is a
//! CHECK_POLICY of one item with the settle flag, decided all or nothing
//! like a check of its estimate, which also leaves a settle record in Redis
//! named by a fresh 16-byte handle; a SETTLE (op 9) moves the window by
//! actual - estimate and deletes the record, in one atomic call. The
//! record, not the daemon, holds the estimate: a settle after a restart,
//! or on another daemon, works; a forged or replayed handle finds no
//! record and changes nothing. Both go through resolve (Kind::Reserve,
//! Kind::Settle: O(1) algorithms only), the stores, respond and count.

use std::borrow::Cow;

use crate::protocol::{Decision, ErrorCode, Extension, ItemResult, PolicyCheckRequest, Response, SettleRequest, Source, OP_CHECK_POLICY, OP_SETTLE};
use crate::window::LimitSpec;

use super::count::Charge;
use super::limiter::{Backend, Limiter};
use super::resolve::{Kind, Named};
use super::respond::{self, error_code, verdict_item, verdict_response};

const NEEDS_REDIS: &str = "reserve and settle need the Redis backend: the settle record lives in Redis";

impl Limiter {
    /// A reserve: the estimate checked and, when admitted, recorded under a
    /// new handle (the response's extension carries it). Redis failing: the
    /// fail policy decides and no handle is given (nothing to settle).
    pub(super) async fn reserve<'a>(&'a self, r: &'a PolicyCheckRequest) -> (Response, Charge<'a>) {
        let op = OP_CHECK_POLICY;
        let named = Named { id: r.id, op, name: &r.name, key: &r.key, scoped_key: &r.scoped_key, cost: r.cost, on_error: r.on_error, local_limit: r.local_limit };
        let item = match self.resolve(&named, Kind::Reserve) {
            Ok(item) => item,
            Err(rejected) => return rejected.into(),
        };
        let charge = Charge::one(item.policy, Some(&r.scoped_key[..]));
        let Some(limit) = item.limit else { return (respond::exempt(r.id, op), charge) };
        let Backend::Redis(redis) = &self.backend else {
            return (Response::error(r.id, op, ErrorCode::RefundUnsupported, Cow::Borrowed(NEEDS_REDIS)), charge);
        };
        let handle: [u8; 16] = rand::random();
        let spec = LimitSpec { key: item.key, limit, window_ms: item.window_ms, cost: item.cost };
        match redis.reserve(&spec, item.algorithm, &handle).await {
            Ok(v) => {
                let result = ItemResult { limit, ..verdict_item(v, Source::Redis, item.window_ms) };
                let mut response = respond::shadowed(verdict_response(r.id, op, Source::Redis, v), &item);
                response.extension = Some(Box::new(Extension { refused: u8::from(!v.allowed), handle: v.allowed.then_some(handle), items: vec![result] }));
                (response, charge)
            }
            Err(e) => (self.on_store_error(r.id, op, &item, limit, e), charge),
        }
    }

    /// A SETTLE: the reserve's record found and deleted, the window moved
    /// by actual - estimate (debt if past the limit). Count 0 and the
    /// unmatched counter for a handle with no record. A Redis error is the
    /// answer (no fail policy): the client may retry with the same handle,
    /// which settles at most once.
    pub(super) async fn settle<'a>(&'a self, r: &'a SettleRequest) -> (Response, Charge<'a>) {
        let op = OP_SETTLE;
        let i = &r.item;
        let named = Named { id: r.id, op, name: &i.name, key: &i.key, scoped_key: &i.scoped_key, cost: i.cost, on_error: crate::protocol::FailPolicy::Closed, local_limit: 0 };
        let item = match self.resolve(&named, Kind::Settle) {
            Ok(item) => item,
            Err(rejected) => return rejected.into(),
        };
        let done = |count, remaining, reset_ms| Response { decision: Decision::Allowed, source: Source::Redis, count, remaining, reset_ms, ..Response::error(r.id, op, ErrorCode::None, Cow::Borrowed("")) };
        let Some(limit) = item.limit else { return (Response { source: Source::Exempt, ..done(0, 0, 0) }, Charge::Nobody) };
        let Backend::Redis(redis) = &self.backend else {
            return (Response::error(r.id, op, ErrorCode::RefundUnsupported, Cow::Borrowed(NEEDS_REDIS)), Charge::Nobody);
        };
        let spec = LimitSpec { key: item.key, limit, window_ms: item.window_ms, cost: item.cost };
        let outcome = redis.settle_reserve(&spec, item.algorithm, &r.handle).await;
        // A surplus given back may end a refusal the cache holds.
        if let Some(d) = &self.denials {
            d.forget_window(item.key, item.window_ms);
        }
        match outcome {
            Ok(Some(v)) => (Response { retry_after_ms: v.retry_after_ms, ..done(v.count, v.remaining, v.reset_ms) }, Charge::Settle { matched: true }),
            Ok(None) => (done(0, 0, 0), Charge::Settle { matched: false }),
            Err(e) => (Response { source: Source::Redis, ..Response::error(r.id, op, error_code(&e), Cow::Owned(e.to_string())) }, Charge::Nobody),
        }
    }
}

#[cfg(test)]
mod tests {
    //! What is refused before any store: the memory backend, the log, a
    //! sharded policy; an exempt key reserves nothing.

    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;
    use crate::config::{PolicyConfig, PolicyLimit};
    use crate::local_store::LocalStore;
    use crate::policies::Policies;
    use crate::protocol::{Algorithm, FailPolicy, PolicyItem, Request};

    fn policy(name: &str, algorithm: Algorithm, shards: u32) -> PolicyConfig {
        let overrides = [("free".to_string(), PolicyLimit::Unlimited)].into_iter().collect();
        PolicyConfig { name: name.into(), limit: 100, window: Duration::from_secs(60), calendar_window_ms: None, fail_policy: None, local_limit: None, shadow: false, algorithm, lease_ms: None, shards, penalty: None, overrides }
    }

    fn item(name: &str, key: &str, cost: u32) -> PolicyItem {
        let mut scoped = vec![name.len() as u8];
        scoped.extend_from_slice(name.as_bytes());
        scoped.extend_from_slice(key.as_bytes());
        let scoped = Bytes::from(scoped);
        PolicyItem { cost, name: scoped.slice(1..1 + name.len()), key: scoped.slice(1 + name.len()..), scoped_key: scoped }
    }

    fn reserve(name: &str, key: &str) -> Request {
        let PolicyItem { cost, name, key, scoped_key } = item(name, key, 10);
        Request::Reserve(PolicyCheckRequest { id: 1, on_error: FailPolicy::Closed, local_limit: 0, cost, name, key, scoped_key })
    }

    #[tokio::test]
    async fn reserves_and_settles_are_refused_loudly_where_they_cannot_be_exact() {
        let policies = [policy("fixed", Algorithm::Fixed, 1), policy("log", Algorithm::Log, 1), policy("sharded", Algorithm::Gcra, 3)];
        let l = Arc::new(Limiter::new(Backend::Local, Arc::new(LocalStore::new(1000))).with_policies(Arc::new(Policies::build(&policies, None))));
        let code = |r: Response| (r.decision, r.error);
        assert_eq!(code(l.clone().decide(reserve("log", "t")).await), (Decision::Error, ErrorCode::UnsupportedCombination));
        assert_eq!(code(l.clone().decide(reserve("sharded", "t")).await), (Decision::Error, ErrorCode::UnsupportedCombination));
        assert_eq!(code(l.clone().decide(reserve("fixed", "t")).await), (Decision::Error, ErrorCode::RefundUnsupported), "the memory backend keeps no settle records");
        let exempt = l.clone().decide(reserve("fixed", "free")).await;
        assert_eq!((exempt.decision, exempt.source, exempt.extension.is_none()), (Decision::Allowed, Source::Exempt, true), "no handle: nothing to settle");
        let settle = Request::Settle(SettleRequest { id: 2, handle: [1; 16], item: item("log", "t", 0) });
        assert_eq!(code(l.clone().decide(settle).await), (Decision::Error, ErrorCode::UnsupportedCombination));
        let settle = Request::Settle(SettleRequest { id: 3, handle: [1; 16], item: item("fixed", "t", 5) });
        assert_eq!(code(l.clone().decide(settle).await), (Decision::Error, ErrorCode::RefundUnsupported));
    }
}
