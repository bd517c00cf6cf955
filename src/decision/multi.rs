//! Execution of several items all or nothing (PROTOCOL.md 4b), of a
//! refundable one, and of refunds (4c), on the plan's windows: every item
//! fits and all are recorded, or none is. A sharded item a shard refused is
//! tried again on its next untried shard, the whole request again, all or
//! nothing each time (SEMANTICS S1), until it is admitted or a refusing
//! item has no shard left.

use std::borrow::Cow;

use crate::protocol::{Decision, ErrorCode, ItemResult, Response, Source};
use crate::redis::{MultiAsk, RefundItem};
use crate::window::{LimitSpec, Verdict};

use crate::window_store::{ManyVerdicts, NoVerdict, RefundUnsupported};

use super::execute::{merge_refusals, whole_key};
use super::fail::{fallback, Fallback};
use super::limiter::Limiter;
use super::plan::{refund_windows, Planned};
use super::resolve::Item;
use super::respond::{error_code, verdict_item, Executed};

impl Limiter {
    /// Decides `items` all or nothing. `Err`: the in-memory windows are
    /// full (no decision).
    pub(super) async fn check_items(&self, id: u32, op: u8, items: &[Item<'_>], refundable: bool) -> Result<Executed, Response> {
        let n = items.len();
        let mut results = vec![ItemResult::NOT_EVALUATED; n];
        // The items a store decides, with their windows; exempt ones are
        // admitted here.
        let mut stored: Vec<(usize, Planned<'_>)> = Vec::with_capacity(n);
        for (i, item) in items.iter().enumerate() {
            match item.limit {
                Some(limit) => match Planned::first(item, limit) {
                    Some(p) => stored.push((i, p)),
                    // Resolution refuses such a cost already.
                    None => return Err(Response::error(id, op, ErrorCode::InvalidCost, Cow::Borrowed("cost above every shard's limit"))),
                },
                None => results[i] = ItemResult { decision: Decision::Allowed, source: Source::Exempt, window_ms: item.window_ms, ..ItemResult::NOT_EVALUATED },
            }
        }
        if stored.is_empty() {
            return Ok(Executed { results, handle: None, failure: None });
        }
        loop {
            let attempt = match self.attempt(items, &stored, None).await {
                Ok(a) => a,
                Err(NoVerdict::Full(full)) => return Err(self.capacity_error(id, op, Source::Memory, full)),
                Err(NoVerdict::Store(e)) => {
                    // The response says whether they admitted (no enforced item refused).
                    self.fail_policies(items, &stored, &mut results);
                    return Ok(Executed { results, handle: None, failure: Some(e) });
                }
            };
            // The enforced items that refused: when each is sharded and has
            // a shard left, the request is tried again on those shards.
            let mut again = true;
            let mut any = false;
            // Per planned item: moved to a shard not tried yet.
            let mut moved = vec![false; stored.len()];
            for (((i, p), v), moved) in stored.iter_mut().zip(&attempt.verdicts).zip(&mut moved) {
                if let Some((source, v)) = *v {
                    if !v.allowed && p.rest.is_some() {
                        p.refusals = Some(merge_refusals(p.refusals.map(|r| (source, r)), source, v).1);
                    }
                    if !v.allowed && !items[*i].shadow {
                        any = true;
                        *moved = p.advance(&items[*i]);
                        again &= *moved;
                    }
                }
            }
            if !attempt.committed && any && again {
                // Tried again anyway: a sharded shadow item that did not fit
                // moves on too (it is recorded where it fits, S1, S3).
                for ((i, p), v) in stored.iter_mut().zip(&attempt.verdicts) {
                    if matches!(v, Some((_, v)) if !v.allowed) && items[*i].shadow {
                        p.advance(&items[*i]);
                    }
                }
                continue;
            }
            for (((i, p), v), moved) in stored.iter().zip(&attempt.verdicts).zip(moved) {
                if let Some((source, v)) = *v {
                    // A sharded item refused by its shard while shards of
                    // it are left untried (another item refused the
                    // request, so they were not asked) is not evaluated:
                    // its key may have room, and its refusal must not
                    // reach the response's numbers or Retry-After. An
                    // enforced item that just moved on stands on such a
                    // shard (one the request never asked).
                    let untried = moved || p.rest.is_some_and(|mut rest| rest.next().is_some());
                    if attempt.committed || v.allowed || !untried {
                        results[*i] = item_result(&items[*i], p, source, v);
                    }
                }
            }
            if attempt.committed {
                self.place_shadow_shards(items, &mut stored, &attempt.verdicts, attempt.handle, &mut results).await;
            }
            return Ok(Executed { results, handle: attempt.handle.filter(|_| attempt.committed && refundable), failure: None });
        }
    }

    /// After an admission: a sharded shadow item whose shard had no room is
    /// tried alone on its other shards, so that it is recorded wherever it
    /// fits, as a single check of it would be (S1, S3). Shadow only:
    /// nothing enforced depends on it; a store error leaves it reported as
    /// refused. Such a unit is recorded under the admission's handle
    /// (`handle`; the admission wrote nothing under this item's number), so
    /// a refund of the admission frees it too: a refund of a sharded item
    /// frees the unit it took (S1, S6).
    async fn place_shadow_shards(&self, items: &[Item<'_>], stored: &mut [(usize, Planned<'_>)], verdicts: &[Option<(Source, Verdict)>], handle: Option<[u8; 16]>, results: &mut [ItemResult]) {
        for (k, v) in verdicts.iter().enumerate() {
            let i = stored[k].0;
            if !(items[i].shadow && matches!(v, Some((_, v)) if !v.allowed)) {
                continue;
            }
            while stored[k].1.advance(&items[i]) {
                let Ok(one) = self.attempt(items, std::slice::from_ref(&stored[k]), handle).await else { break };
                let Some(Some((source, v))) = one.verdicts.first().copied() else { break };
                let p = &mut stored[k].1;
                if !v.allowed {
                    p.refusals = Some(merge_refusals(p.refusals.map(|r| (source, r)), source, v).1);
                }
                results[i] = item_result(&items[i], p, source, v);
                if v.allowed {
                    break;
                }
            }
        }
    }

    /// One all-or-nothing try of the planned windows, through the cache
    /// layers to the store (`layers::many_verdicts`), its members named by
    /// `under` (an admission's handle) or a fresh handle.
    async fn attempt(&self, items: &[Item<'_>], stored: &[(usize, Planned<'_>)], under: Option<[u8; 16]>) -> Result<ManyVerdicts, NoVerdict> {
        let asks: Vec<MultiAsk<'_>> = stored
            .iter()
            .map(|(i, p)| MultiAsk { key: &p.window.key, window_ms: items[*i].window_ms, limit: p.window.limit, cost: items[*i].cost, shadow: items[*i].shadow, number: (*i + 1) as u8 })
            .collect();
        self.many_verdicts(&asks, under.as_ref()).await
    }

    /// The store could not decide a multi-item check: each item's fail
    /// policy decides (`fail::fallback`), all or nothing: a refusal refuses
    /// the request; `local` items are checked together in the per-host
    /// windows of their keys (a sharded key's own, not a shard's) with
    /// their local quota.
    pub(super) fn fail_policies(&self, items: &[Item<'_>], stored: &[(usize, Planned<'_>)], results: &mut [ItemResult]) {
        let mut refused = false;
        let mut local: Vec<(usize, u32)> = Vec::new();
        for (i, _) in stored {
            let (i, item) = (*i, &items[*i]);
            let limit = item.limit.unwrap_or(0);
            match fallback(item, limit) {
                Fallback::Decided(source, v) => {
                    refused |= !v.allowed && !item.shadow;
                    let limit = if source == Source::LocalFallback { item.local_limit } else { limit };
                    results[i] = verdict_item(v, source, limit, item.window_ms);
                }
                Fallback::Local(local_limit) => {
                    results[i] = ItemResult { limit, window_ms: item.window_ms, ..ItemResult::NOT_EVALUATED };
                    local.push((i, local_limit));
                }
            }
        }
        if refused || local.is_empty() {
            return;
        }
        let specs: Vec<(LimitSpec<'_>, bool)> = local.iter().map(|&(i, l)| (LimitSpec { key: items[i].key, limit: l, window_ms: items[i].window_ms, cost: items[i].cost }, items[i].shadow)).collect();
        match self.local.check_multi(&specs) {
            Ok((_, verdicts)) => {
                for ((&(i, _), v), (s, _)) in local.iter().zip(verdicts).zip(&specs) {
                    results[i] = verdict_item(v, Source::LocalFallback, s.limit, s.window_ms);
                }
            }
            Err(full) => {
                if let Some(suppressed) = self.capacity_log.permit() {
                    tracing::warn!(error = %full, suppressed, "in-memory windows full: a multi-item check's local fallback refuses");
                }
                for &(i, _) in &local {
                    results[i].source = Source::LocalFallback;
                }
            }
        }
    }

    /// Takes back what a refundable check recorded (REFUND, op 3): exact
    /// and idempotent with Redis (the members are removed; gone ones are
    /// not found); a sharded item names every shard's window. The in-memory
    /// backend keeps no member ids: `REFUND_UNSUPPORTED`.
    pub(super) async fn refund_items(&self, id: u32, op: u8, handle: &[u8; 16], items: &[Item<'_>]) -> Result<u64, Response> {
        // Per item its windows (a sharded item: every shard's).
        let windows: Vec<(usize, bytes::Bytes)> =
            items.iter().enumerate().flat_map(|(i, item)| refund_windows(item, item.limit.unwrap_or(0)).into_iter().map(move |(k, _)| (i, k))).collect();
        let refund: Vec<RefundItem<'_>> = windows.iter().map(|(i, k)| RefundItem { key: k, window_ms: items[*i].window_ms, cost: items[*i].cost, number: (*i + 1) as u8 }).collect();
        // The store tells the denial cache of every window it touched,
        // refunded or not (docs/PROTOCOL.md 4c).
        let outcome = self.store.refund(handle, &refund).await.map_err(|RefundUnsupported| {
            Response::error(id, op, ErrorCode::RefundUnsupported, Cow::Borrowed("the in-memory backend keeps no member ids: refunds need the Redis backend"))
        })?;
        match outcome.failure {
            None => Ok(outcome.removed),
            // The slots that answered were refunded: `count` says how much (PROTOCOL.md 4c).
            Some(e) => {
                let count = outcome.removed.min(u64::from(u32::MAX)) as u32;
                Err(Response { source: Source::Redis, count, ..Response::error(id, op, error_code(&e), Cow::Owned(e.to_string())) })
            }
        }
    }
}

/// An item's result from its last verdict: a sharded item's as the key's
/// (count and remaining estimated, the refusals of its tried shards merged).
fn item_result(item: &Item<'_>, p: &Planned<'_>, source: Source, v: Verdict) -> ItemResult {
    let limit = item.limit.unwrap_or(0);
    if p.rest.is_none() {
        return verdict_item(v, source, limit, item.window_ms);
    }
    let v = match (v.allowed, p.refusals) {
        (true, _) => whole_key(v, limit, item.cost, item.shards),
        (false, Some(r)) => {
            let remaining = r.remaining.min(limit);
            Verdict { remaining, count: limit - remaining, ..r }
        }
        (false, None) => v,
    };
    verdict_item(v, source, limit, item.window_ms)
}
