//! Execution of one item: the verdict of the layers and the store on its
//! window (`layers::verdict`), on its shards one after another, or on its
//! concurrency lease; and its fail policy (`fail::fallback`) when the store
//! cannot answer.

use std::borrow::Cow;

use crate::local_store::LocalStoreFull;
use crate::metrics::METRICS;
use crate::protocol::{ErrorCode, Response, Source};
use crate::window_store::NoVerdict;
use crate::window::{LimitSpec, StoreError, Verdict};

use super::fail::{acquire_fallback, fallback, Fallback};
use super::limiter::Limiter;
use super::plan::ShardOrder;
use super::respond::{error_code, verdict_response, OVERLOADED_MESSAGE};
use super::resolve::Item;

impl Limiter {
    /// Decides one item with a limit: its window, or its shards. Never
    /// fails: store errors become the fail policy's response.
    pub(super) async fn check_item(&self, id: u32, op: u8, item: &Item<'_>, limit: u32) -> Response {
        if let Some(penalty) = item.policy.and_then(|p| p.rule.penalty) {
            return self.check_penalized(id, op, item, limit, penalty).await;
        }
        if item.shards > 1 {
            return self.check_shards(id, op, item, limit).await;
        }
        let spec = LimitSpec { key: item.key, limit, window_ms: item.window_ms, cost: item.cost };
        match self.verdict(&spec, item.algorithm).await {
            Ok((source, v)) => verdict_response(id, op, source, v.under(limit)),
            Err(NoVerdict::Full(full)) => self.capacity_error(id, op, Source::Memory, full),
            Err(NoVerdict::Store(e)) => self.on_store_error(id, op, item, limit, e),
        }
    }

    /// A sharded item (docs/SCALING.md, hot keys): the shards are tried one
    /// after another in the plan's order until one admits: a request is
    /// refused only when every shard that can hold its cost refused it (or
    /// was unreachable). A shard whose Redis answered with an error at once
    /// (node down, CLUSTERDOWN) is skipped; a timeout, an open breaker or
    /// overload ends the tries and the fail policy decides, as for one
    /// window, so a request waits for at most one deadline. The fail
    /// policy's local window is the key's own, not a shard's.
    async fn check_shards(&self, id: u32, op: u8, item: &Item<'_>, limit: u32) -> Response {
        let shards = item.shards;
        // The refusals so far, merged: room left summed, earliest retry.
        let mut refused: Option<(Source, Verdict)> = None;
        let mut skipped: Option<StoreError> = None;
        for (i, part) in ShardOrder::of(item, limit) {
            let key = crate::redis::shard_key(item.key, i, shards);
            let spec = LimitSpec { key: &key, limit: part, window_ms: item.window_ms, cost: item.cost };
            match self.verdict(&spec, item.algorithm).await {
                Ok((source, v)) if v.allowed => return verdict_response(id, op, source, whole_key(v, limit, item.cost, shards)),
                Ok((source, v)) => refused = Some(merge_refusals(refused, source, v)),
                Err(NoVerdict::Store(e @ (StoreError::Unavailable(_) | StoreError::Redis(_)))) => {
                    skipped.get_or_insert(e);
                }
                Err(NoVerdict::Store(e)) => return self.on_store_error(id, op, item, limit, e),
                Err(NoVerdict::Full(full)) => return self.capacity_error(id, op, Source::Memory, full),
            }
        }
        match (refused, skipped) {
            (Some((source, v)), _) => {
                let remaining = v.remaining.min(limit);
                verdict_response(id, op, source, Verdict { allowed: false, remaining, count: limit - remaining, ..v })
            }
            (None, Some(e)) => self.on_store_error(id, op, item, limit, e),
            // Resolution refuses a cost above every shard's part.
            (None, None) => Response::error(id, op, ErrorCode::InvalidCost, Cow::Borrowed("cost above every shard's limit")),
        }
    }

    /// No decision: the in-memory windows are full; the client's policy decides.
    pub(super) fn capacity_error(&self, id: u32, op: u8, source: Source, full: LocalStoreFull) -> Response {
        if let Some(suppressed) = self.capacity_log.permit() {
            tracing::warn!(error = %full, suppressed, "in-memory windows full: new keys get LOCAL_CAPACITY; raise limits.max_local_keys or look for a flood of unique keys");
        }
        Response { source, ..Response::error(id, op, ErrorCode::LocalCapacity, Cow::Owned(full.to_string())) }
    }

    /// The store could not decide one item: its fail policy does.
    pub(super) fn on_store_error(&self, id: u32, op: u8, item: &Item<'_>, limit: u32, e: StoreError) -> Response {
        self.log_store_error(&e, item);
        let (source, v) = match fallback(item, limit) {
            Fallback::Decided(source, v) => (source, v),
            Fallback::Local(local_limit) => match self.local.check(&LimitSpec { key: item.key, limit: local_limit, window_ms: item.window_ms, cost: item.cost }, item.algorithm) {
                Ok(v) => (Source::LocalFallback, v),
                Err(full) => return self.capacity_error(id, op, Source::LocalFallback, full),
            },
        };
        with_error(verdict_response(id, op, source, v), e)
    }

    fn log_store_error(&self, e: &StoreError, item: &Item<'_>) {
        if let StoreError::Overloaded(limit) = e {
            // Load shed by design, not a failure of Redis: a line of its own
            // at most every 10 s, so that the failure line stays about Redis.
            if let Some(suppressed) = self.overload_log.permit() {
                tracing::warn!(in_flight_limit = limit, on_error = item.on_error.as_str(), policy = logged_policy(item), suppressed, "redis calls at their adaptive in-flight limit: the excess gets OVERLOADED and its fail policy decides");
            }
        } else if let Some(suppressed) = self.failure_log.permit() {
            tracing::warn!(error = %e, on_error = item.on_error.as_str(), policy = logged_policy(item), key = %logged_key(item), suppressed, "redis failed; the request's fail policy decides");
        }
    }

    /// ACQUIRE or RELEASE of a concurrency lease (SEMANTICS S4: an acquire
    /// of an id held renews it). Never coalesced, never answered by the
    /// denial cache (a release frees a slot at any moment). An ACQUIRE the
    /// store cannot decide follows its fail policy (`local`: the per-host
    /// leases, with `local_limit`); a RELEASE is also applied to the
    /// per-host leases, which hold it if the fallback acquired it.
    pub(super) async fn lease(&self, id: u32, op: u8, acquire: bool, item: &Item<'_>, limit: u32, lease: &[u8]) -> Response {
        match self.store.lease(acquire, item.key, lease, limit, item.window_ms, item.cost).await {
            Ok(v) => {
                if !acquire {
                    self.local.release(item.key, lease);
                }
                verdict_response(id, op, self.store.origin(), v.under(limit))
            }
            Err(NoVerdict::Full(full)) => self.capacity_error(id, op, Source::Memory, full),
            Err(NoVerdict::Store(e)) => {
                if let Some(suppressed) = self.failure_log.permit() {
                    tracing::warn!(error = %e, on_error = item.on_error.as_str(), policy = logged_policy(item), key = %logged_key(item), suppressed, "redis failed on a concurrency lease; the request's fail policy decides");
                }
                if !acquire {
                    METRICS.fail_policy_applied(item.on_error);
                    return with_error(verdict_response(id, op, Source::LocalFallback, self.local.release(item.key, lease)), e);
                }
                let (source, v) = match acquire_fallback(item, limit) {
                    Fallback::Decided(source, v) => (source, v),
                    Fallback::Local(local_limit) => match self.local.acquire(item.key, lease, local_limit, item.window_ms, item.cost) {
                        Ok(v) => (Source::LocalFallback, v),
                        Err(full) => return self.capacity_error(id, op, Source::LocalFallback, full),
                    },
                };
                with_error(verdict_response(id, op, source, v), e)
            }
        }
    }
}

/// A fail policy's response with the store's error it answers for.
fn with_error(mut r: Response, e: StoreError) -> Response {
    r.error = error_code(&e);
    r.message = match e {
        StoreError::Overloaded(_) => Cow::Borrowed(OVERLOADED_MESSAGE),
        e => Cow::Owned(e.to_string()),
    };
    r
}

/// An admitting shard's verdict as the key's: count and remaining
/// estimated from the shard's, the round robin filling shards evenly.
pub(super) fn whole_key(v: Verdict, limit: u32, cost: u32, shards: u32) -> Verdict {
    let remaining = v.remaining.saturating_mul(shards).min(limit - cost.min(limit));
    Verdict { remaining, count: limit - remaining, ..v }
}

/// Two shards' refusals as one: room left summed, the earliest retry, the
/// latest reset; a Redis source wins over the denial cache's.
pub(super) fn merge_refusals(so_far: Option<(Source, Verdict)>, source: Source, v: Verdict) -> (Source, Verdict) {
    match so_far {
        None => (source, v),
        Some((s, m)) => (
            if s == Source::DenialCache { source } else { s },
            Verdict { remaining: m.remaining + v.remaining, retry_after_ms: m.retry_after_ms.min(v.retry_after_ms), reset_ms: m.reset_ms.max(v.reset_ms), ..m },
        ),
    }
}

/// The policy an item is checked under, for a log line ("-" for an inline limit).
fn logged_policy<'a>(item: &Item<'a>) -> &'a str {
    item.policy.map_or("-", |p| &p.name)
}

/// The key as the client sent it (a policy's scoped key without its length
/// byte and name), escaped for the log: no control byte reaches it.
fn logged_key(item: &Item<'_>) -> String {
    let key: &[u8] = match item.policy {
        Some(p) => item.key.get(1 + p.name.len()..).unwrap_or(item.key),
        None => item.key,
    };
    crate::terminal::escape_bytes(key)
}
