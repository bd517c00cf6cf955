//! The fail policies (docs/PROTOCOL.md section 7): what an item gets when
//! the store cannot decide it, written once for single checks, concurrency
//! leases and multi-item checks.

use crate::metrics::METRICS;
use crate::protocol::{FailPolicy, Source};
use crate::window::{nominal_window_ms, Verdict};

use super::resolve::Item;

/// An item's fail policy's answer.
pub(super) enum Fallback {
    /// Decided without a store: who decided, and the numbers.
    Decided(Source, Verdict),
    /// The per-host windows decide, with this limit (the local quota).
    Local(u32),
}

/// The fail policy of a check of `item` (limit `limit` in force), counted once.
pub(super) fn fallback(item: &Item<'_>, limit: u32) -> Fallback {
    of(item, limit, false)
}

/// The fail policy of a concurrency lease's acquire: as a check's, except
/// that `local` always asks the per-host leases, whose acquire answers a
/// cost above the local quota itself (docs/PROTOCOL.md 4d).
pub(super) fn acquire_fallback(item: &Item<'_>, limit: u32) -> Fallback {
    of(item, limit, true)
}

fn of(item: &Item<'_>, limit: u32, acquire: bool) -> Fallback {
    METRICS.fail_policy_applied(item.on_error);
    match item.on_error {
        FailPolicy::Open => Fallback::Decided(Source::FailOpen, Verdict { allowed: true, remaining: limit, ..Verdict::default() }),
        // Ask clients to come back once, not to hammer a failing store.
        FailPolicy::Closed => Fallback::Decided(Source::FailClosed, Verdict { retry_after_ms: item.window_ms.min(1000), ..Verdict::default() }),
        // Can never fit the local quota: refused without recording.
        FailPolicy::Local if item.cost > item.local_limit && !acquire => {
            Fallback::Decided(Source::LocalFallback, Verdict { remaining: item.local_limit, retry_after_ms: nominal_window_ms(item.window_ms), ..Verdict::default() })
        }
        FailPolicy::Local => Fallback::Local(item.local_limit),
    }
}
