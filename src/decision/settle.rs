//! Costs known after the response (docs/PROTOCOL.md 4f): a reserve is a
//! CHECK_POLICY with the settle flag of one item or several (a tenant's
//! tokens per minute and per month), decided all or nothing like a check
//! of the estimates, which also leaves a settle record per item recorded,
//! named by one fresh 16-byte handle; a SETTLE (op 9) moves each item's
//! window by actual - estimate and deletes its record, in one atomic call
//! per item. The record, not the daemon, holds the estimate: a settle after
//! a restart, or on another daemon, works; a forged or replayed handle finds
//! no record and changes nothing. Both go through resolve (Kind::Reserve,
//! Kind::Settle: O(1) algorithms only), the stores, respond and count.
//!
//! How a store reserves several items all or nothing is the store's
//! (`Store::reserve`, src/window_store.rs): in Redis each item is its own
//! script call, all sent at once, and a refused request's reserves are
//! cancelled (a refusal too many, never an admission too many, while one is
//! held); in memory every item is decided under the windows' locks. A
//! settle that meets a Redis failure is retried by the store in the
//! background (src/settle_retry.rs).

use std::borrow::Cow;

use futures_util::future::join_all;

use crate::protocol::{Decision, ErrorCode, Header, ItemResult, ReserveRequest, Response, SettleRequest, Source, FailPolicy, OP_CHECK_POLICY, OP_SETTLE};
use crate::window::{LimitSpec, StoreError, Verdict};
use crate::window_store::{ReserveAsk, Reserved};

use super::count::Charge;
use super::limiter::Limiter;
use super::plan::Planned;
use super::resolve::{Item, Kind};
use super::respond::{self, error_code, verdict_item, Executed};

/// The window an item reserves in (its limit known: not exempt).
fn spec_of<'a>(item: &Item<'a>) -> LimitSpec<'a> {
    LimitSpec { key: item.key, limit: item.limit.unwrap_or(0), window_ms: item.window_ms, cost: item.cost }
}

/// An item's result from its verdict, with its limit.
fn result_of(item: &Item<'_>, v: Verdict, source: Source) -> ItemResult {
    verdict_item(v, source, item.limit.unwrap_or(0), item.window_ms)
}

impl Limiter {
    /// A reserve: every item's estimate checked and, when the request is
    /// admitted, recorded under one new handle (the response's extension
    /// carries it). Redis failing: the fail policies decide and no handle
    /// is given; what a failed call may have charged is taken back in the
    /// background (`take_back_later`).
    pub(super) async fn reserve<'a>(&'a self, r: &'a ReserveRequest) -> (Response, Charge<'a>) {
        let op = OP_CHECK_POLICY;
        let id = r.header.id;
        let items = match self.resolve_all(op, r.header, &r.items, Kind::Reserve) {
            Ok(items) => items,
            Err(rejected) => return rejected.into(),
        };
        let charge = Charge::Items { policies: items.iter().filter_map(|i| i.policy).collect(), items: &r.items };
        let mut results = vec![ItemResult::NOT_EVALUATED; items.len()];
        let mut stored = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match item.limit {
                Some(_) => stored.push(i),
                None => results[i] = ItemResult { decision: Decision::Allowed, source: Source::Exempt, window_ms: item.window_ms, ..ItemResult::NOT_EVALUATED },
            }
        }
        let done = if stored.is_empty() {
            Executed { results, handle: None, failure: None }
        } else {
            let handle: [u8; 16] = rand::random();
            let asks: Vec<ReserveAsk<'_>> = stored.iter().map(|&i| ReserveAsk { spec: spec_of(&items[i]), algorithm: items[i].algorithm, shadow: items[i].shadow }).collect();
            match self.store.reserve(&asks, &handle).await {
                Ok(Reserved { failure: Some(e), .. }) => self.reserve_failed(&items, &stored, results, e),
                Ok(Reserved { committed, verdicts, failure: None }) => {
                    for (&i, v) in stored.iter().zip(&verdicts) {
                        if let Some(v) = v {
                            results[i] = result_of(&items[i], *v, self.store.origin());
                        }
                    }
                    let recorded = committed && verdicts.iter().any(|v| matches!(v, Some(v) if v.allowed));
                    Executed { results, handle: recorded.then_some(handle), failure: None }
                }
                Err(full) => return (self.capacity_error(id, op, Source::Memory, full), Charge::Nobody),
            }
        };
        if let Some(e) = &done.failure {
            if let Some(suppressed) = self.failure_log.permit() {
                tracing::warn!(error = %e, suppressed, "redis failed; a reserve's fail policies decide");
            }
        }
        (respond::aggregate(id, op, &items, done), charge)
    }

    /// Redis failed: the items' fail policies decide (no handle).
    fn reserve_failed(&self, items: &[Item<'_>], stored: &[usize], mut results: Vec<ItemResult>, e: StoreError) -> Executed {
        let planned: Vec<(usize, Planned<'_>)> = stored.iter().filter_map(|&i| Planned::first(&items[i], items[i].limit.unwrap_or(0)).map(|p| (i, p))).collect();
        self.fail_policies(items, &planned, &mut results);
        Executed { results, handle: None, failure: Some(e) }
    }

    /// A SETTLE: each item's record found and deleted, its window moved by
    /// actual - estimate (debt if past the limit). Count 0 and the
    /// unmatched counter when no item had a record. A Redis error is the
    /// answer (no fail policy): the items that answered are settled, and
    /// the client may retry with the same handle, which settles each item
    /// at most once. The fixed fields: the enforced settled item with the
    /// least room left (none enforced: the shadow one with the least).
    pub(super) async fn settle<'a>(&'a self, r: &'a SettleRequest) -> (Response, Charge<'a>) {
        let op = OP_SETTLE;
        let items = match self.resolve_all(op, Header { id: r.id, on_error: FailPolicy::Closed, local_limit: 0 }, &r.items, Kind::Settle) {
            Ok(items) => items,
            Err(rejected) => return rejected.into(),
        };
        let done = |source, count, remaining, reset_ms| Response { decision: Decision::Allowed, source, count, remaining, reset_ms, ..Response::error(r.id, op, ErrorCode::None, Cow::Borrowed("")) };
        let stored: Vec<usize> = (0..items.len()).filter(|&i| items[i].limit.is_some()).collect();
        if stored.is_empty() {
            return (done(Source::Exempt, 0, 0, 0), Charge::Nobody);
        }
        let source = self.store.origin();
        // A failed call is retried by the store in the background.
        let outcomes: Vec<Result<Option<Verdict>, StoreError>> = join_all(stored.iter().map(|&i| {
            let items = &items;
            async move { self.store.settle(&spec_of(&items[i]), items[i].algorithm, &r.handle).await }
        }))
        .await;
        let matched = outcomes.iter().any(|o| matches!(o, Ok(Some(_))));
        if let Some(e) = outcomes.iter().find_map(|o| o.as_ref().err()) {
            return (Response { source, ..Response::error(r.id, op, error_code(e), Cow::Owned(e.to_string())) }, Charge::Settle { matched });
        }
        let settled = stored.iter().zip(&outcomes).filter_map(|(&i, o)| match o {
            Ok(Some(v)) => Some((items[i].shadow, *v)),
            _ => None,
        });
        let main = settled.clone().filter(|(shadow, _)| !shadow).min_by_key(|(_, v)| v.remaining).or_else(|| settled.clone().min_by_key(|(_, v)| v.remaining));
        match main {
            Some((_, v)) => (Response { retry_after_ms: v.retry_after_ms, ..done(source, v.count, v.remaining, v.reset_ms) }, Charge::Settle { matched }),
            None => (done(source, 0, 0, 0), Charge::Settle { matched }),
        }
    }
}

#[cfg(test)]
mod tests {
    //! What is refused before any store (the log, a sharded policy), an
    //! exempt key's handle-less answer, and reserve and settle on the
    //! memory backend: several policies all or nothing, debt, a handle
    //! settled once.

    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::config::{PolicyConfig, PolicyLimit, PolicyRule};
    use crate::local_store::LocalStore;
    use crate::policies::Policies;
    use crate::protocol::{Algorithm, FailPolicy, PolicyItem, Request};

    fn policy(name: &str, algorithm: Algorithm, shards: u32, limit: u32) -> PolicyConfig {
        let overrides = [("free".to_string(), PolicyLimit::Unlimited)].into_iter().collect();
        PolicyConfig { name: name.into(), rule: PolicyRule { algorithm, shards, ..PolicyRule::rate(limit, 60_000) }, overrides }
    }

    fn item(name: &str, key: &str, cost: u32) -> PolicyItem {
        let mut scoped = vec![name.len() as u8];
        scoped.extend_from_slice(name.as_bytes());
        scoped.extend_from_slice(key.as_bytes());
        let scoped = Bytes::from(scoped);
        PolicyItem { cost, scoped_key: scoped }
    }

    fn reserve(names: &[&str], key: &str, cost: u32) -> Request {
        Request::Reserve(ReserveRequest { header: Header { id: 1, on_error: FailPolicy::Closed, local_limit: 0 }, items: names.iter().map(|n| item(n, key, cost)).collect() })
    }

    fn settle(handle: [u8; 16], names: &[&str], key: &str, actual: u32) -> Request {
        Request::Settle(SettleRequest { id: 2, handle, items: names.iter().map(|n| item(n, key, actual)).collect() })
    }

    fn limiter(policies: &[PolicyConfig]) -> Arc<Limiter> {
        Arc::new(Limiter::memory(Arc::new(LocalStore::new(1000))).with_policies(Arc::new(Policies::build(policies, None))))
    }

    fn handle(r: &Response) -> Option<[u8; 16]> {
        r.extension.as_ref().and_then(|e| e.handle)
    }

    #[tokio::test]
    async fn reserves_and_settles_are_refused_loudly_where_they_cannot_be_exact() {
        let l = limiter(&[policy("fixed", Algorithm::Fixed, 1, 100), policy("log", Algorithm::Log, 1, 100), policy("sharded", Algorithm::Gcra, 3, 100)]);
        let code = |r: Response| (r.decision, r.error);
        assert_eq!(code(l.clone().decide(reserve(&["log"], "t", 10)).await), (Decision::Error, ErrorCode::UnsupportedCombination));
        assert_eq!(code(l.clone().decide(reserve(&["sharded"], "t", 10)).await), (Decision::Error, ErrorCode::UnsupportedCombination));
        assert_eq!(code(l.clone().decide(reserve(&["fixed", "log"], "t", 10)).await), (Decision::Error, ErrorCode::UnsupportedCombination), "one item that cannot compose refuses the request");
        let exempt = l.clone().decide(reserve(&["fixed"], "free", 10)).await;
        assert_eq!((exempt.decision, exempt.source, handle(&exempt)), (Decision::Allowed, Source::Exempt, None), "no handle: nothing to settle");
        assert_eq!(code(l.clone().decide(settle([1; 16], &["log"], "t", 0)).await), (Decision::Error, ErrorCode::UnsupportedCombination));
    }

    #[tokio::test]
    async fn the_memory_backend_reserves_every_policy_or_none_and_settles_each_with_debt() {
        let l = limiter(&[policy("minute", Algorithm::Gcra, 1, 100), policy("month", Algorithm::Fixed, 1, 1000)]);
        let both = ["minute", "month"];
        let r = l.clone().decide(reserve(&both, "t", 60)).await;
        assert_eq!((r.decision, r.source, r.remaining), (Decision::Allowed, Source::Memory, 40), "the minute is the tighter");
        let h = handle(&r).expect("a handle");
        // 60 more do not fit the minute: the month must not keep them either.
        let refused = l.clone().decide(reserve(&both, "t", 60)).await;
        let items = &refused.extension.as_ref().unwrap().items;
        assert_eq!((refused.decision, items[0].decision, items[1].decision), (Decision::Denied, Decision::Denied, Decision::Allowed));
        assert_eq!((items[1].count, items[1].remaining), (60, 940), "the month as it stands without the refused request");
        assert_eq!(handle(&refused), None);
        // Settled above the estimate: the minute goes into debt (130 of 100).
        let s = l.clone().decide(settle(h, &both, "t", 130)).await;
        assert_eq!((s.decision, s.source, s.count, s.remaining), (Decision::Allowed, Source::Memory, 130, 0));
        let again = l.clone().decide(settle(h, &both, "t", 130)).await;
        assert_eq!((again.decision, again.count), (Decision::Allowed, 0), "a handle settles once");
        let debt = l.clone().decide(reserve(&both, "t", 1)).await;
        assert_eq!(debt.decision, Decision::Denied, "debt refuses every cost");
        let month = &debt.extension.as_ref().unwrap().items[1];
        assert_eq!(month.count, 130, "the month was charged the actual, and nothing of the refused reserves");
        let forged = l.clone().decide(settle([9; 16], &both, "t", 0)).await;
        assert_eq!((forged.decision, forged.count), (Decision::Allowed, 0));
    }
}
