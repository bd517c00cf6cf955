//! Responding: a verdict as a response, an exempt key's and a shadow
//! refusal's answers, and a multi-item check's results aggregated into one
//! response.

use std::borrow::Cow;

use crate::protocol::{Decision, ErrorCode, Extension, ItemResult, Response, Source};
use crate::window::{StoreError, Verdict};

use super::resolve::Item;

/// What the stores made of a multi-item check, for its response.
pub(super) struct Executed {
    /// Per item: its result (exempt, a verdict, not evaluated).
    pub results: Vec<ItemResult>,
    /// The refund handle of the recorded members (Redis, refundable).
    pub handle: Option<[u8; 16]>,
    /// Redis failed: the items' fail policies decided.
    pub failure: Option<StoreError>,
}

/// The message of an `OVERLOADED` response: static, so that shedding load
/// allocates nothing per request.
pub(super) const OVERLOADED_MESSAGE: &str = "overloaded: too many redis calls in flight; decided at once by the fail policy";

/// The response code of a store failure.
pub(super) fn error_code(e: &StoreError) -> ErrorCode {
    match e {
        StoreError::Timeout(_) => ErrorCode::RedisTimeout,
        StoreError::Unavailable(_) => ErrorCode::RedisUnavailable,
        StoreError::Redis(_) => ErrorCode::RedisError,
        StoreError::CircuitOpen => ErrorCode::CircuitOpen,
        StoreError::Overloaded(_) => ErrorCode::Overloaded,
    }
}

/// A store's verdict as a response.
pub(super) fn verdict_response(id: u32, op: u8, source: Source, v: Verdict) -> Response {
    let decision = if v.allowed { Decision::Allowed } else { Decision::Denied };
    Response { decision, source, count: v.count, remaining: v.remaining, retry_after_ms: v.retry_after_ms, reset_ms: v.reset_ms, ..Response::error(id, op, ErrorCode::None, Cow::Borrowed("")) }
}

/// A store's verdict as one item's result under `limit`, the limit in
/// force (`Verdict::under`).
pub(super) fn verdict_item(v: Verdict, source: Source, limit: u32, window_ms: u32) -> ItemResult {
    let decision = if v.allowed { Decision::Allowed } else { Decision::Denied };
    let v = v.under(limit);
    ItemResult { decision, source, count: v.count, remaining: v.remaining, retry_after_ms: v.retry_after_ms, reset_ms: v.reset_ms, limit, window_ms }
}

/// An exempt key's answer: allowed, nothing asked or recorded.
pub(super) fn exempt(id: u32, op: u8) -> Response {
    Response { decision: Decision::Allowed, source: Source::Exempt, error: ErrorCode::None, ..Response::error(id, op, ErrorCode::None, Cow::Borrowed("")) }
}

/// A shadow policy's decision, reported and never enforced (SEMANTICS S3):
/// a refusal (nothing was recorded for it) or an admission, each marked on
/// the wire so that no client shows it. Releases are never marked.
pub(super) fn shadowed(mut r: Response, item: &Item<'_>) -> Response {
    if item.shadow {
        r.decision = shadow_decision(r.decision);
    }
    r
}

/// The mark of a shadow item's decision: what the client must never show.
/// Errors stay errors (nothing decided).
#[inline]
fn shadow_decision(d: Decision) -> Decision {
    match d {
        Decision::Denied => Decision::ShadowDenied,
        Decision::Allowed => Decision::ShadowAllowed,
        other => other,
    }
}

/// One response for a multi-item check: shadow items marked (refused or
/// fitted, so that the client needs no list of shadow policies), the fixed
/// fields from enforced items only (SEMANTICS S3): the first refusing
/// item's (retry-after: when every refusing item fits), else the most
/// constrained admitted item's.
pub(super) fn aggregate(id: u32, op: u8, items: &[Item<'_>], done: Executed) -> Response {
    let Executed { mut results, handle, failure } = done;
    let mut refused = 0u8;
    for (i, (item, res)) in items.iter().zip(results.iter_mut()).enumerate() {
        // Not evaluated (another item's cached refusal decided) stays as is.
        if item.shadow && res.source != Source::None {
            res.decision = shadow_decision(res.decision);
        } else if res.decision == Decision::Denied && res.source != Source::None && refused == 0 {
            refused = (i + 1) as u8;
        }
    }
    let enforced = || items.iter().zip(results.iter()).filter(|(item, _)| !item.shadow).map(|(_, r)| r);
    let main: ItemResult = if refused > 0 {
        let mut m = results[refused as usize - 1];
        m.retry_after_ms = enforced().filter(|r| r.decision == Decision::Denied && r.source != Source::None).map(|r| r.retry_after_ms).max().unwrap_or(m.retry_after_ms);
        m
    } else {
        enforced()
            .filter(|r| r.source != Source::Exempt && r.decision == Decision::Allowed)
            .min_by_key(|r| r.remaining)
            .copied()
            .or_else(|| enforced().next().copied())
            // Shadow items only: the first one's, as before; its decision
            // is marked in the items, and the client shows none of them.
            .unwrap_or(results[0])
    };
    let mut resp = Response {
        id,
        op,
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
        resp.error = error_code(&e);
        resp.message = Cow::Owned(e.to_string());
    }
    resp
}
