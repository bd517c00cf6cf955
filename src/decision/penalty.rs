//! The penalty box on the request path (docs/POLICIES.md, "Penalty box"):
//! a policy's key banned is refused from the ban table (`penalty_box`)
//! with no store call; otherwise the store decides the window, counts a
//! refusal as a strike and engages the ban, in one call (Redis:
//! src/redis/scripts/penalized_check.lua; memory: the local window and the table's
//! strikes). Every refusal while banned has `retry_after` = the ban's end.

use std::sync::atomic::Ordering;

use crate::config::Penalty;
use crate::penalty_box::BANS;
use crate::protocol::{Response, Source};
use crate::window::{LimitSpec, Verdict};

use crate::window_store::NoVerdict;

use super::limiter::Limiter;
use super::respond::verdict_response;
use super::resolve::Item;

impl Limiter {
    /// Decides one item of a policy with a penalty (log, unsharded: the
    /// configuration checks it). Never fails: store errors become the fail
    /// policy's response (a ban known here still refuses first).
    pub(super) async fn check_penalized(&self, id: u32, op: u8, item: &Item<'_>, limit: u32, penalty: Penalty) -> Response {
        let policy = item.policy.expect("a penalty belongs to a policy");
        if let Some(left) = BANS.banned_ms(item.key) {
            policy.penalty_counters.banned.fetch_add(1, Ordering::Relaxed);
            return verdict_response(id, op, self.store.cached_source(), banned(left));
        }
        let spec = LimitSpec { key: item.key, limit, window_ms: item.window_ms, cost: item.cost };
        let sent = BANS.ticket();
        let answer = self.store.check_penalized(&spec, penalty, sent).await.map(|(v, state)| {
            if state.banned_ms > 0 {
                // Redis's ban cached until its end; the memory store's ban.
                BANS.ban(item.key, sent, state.banned_ms);
                policy.penalty_counters.banned.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(ends_at_ms) = state.engaged {
                policy.penalty_counters.bans.fetch_add(1, Ordering::Relaxed);
                self.store.note_ban(item.key, ends_at_ms);
            }
            (self.store.origin(), v)
        });
        match answer {
            Ok((source, v)) => verdict_response(id, op, source, v.under(limit)),
            Err(NoVerdict::Full(full)) => self.capacity_error(id, op, Source::Memory, full),
            Err(NoVerdict::Store(e)) => self.on_store_error(id, op, item, limit, e),
        }
    }
}

/// The refusal of a banned key: nothing left until the ban's end.
fn banned(left_ms: u32) -> Verdict {
    Verdict { allowed: false, count: 0, remaining: 0, retry_after_ms: left_ms, reset_ms: left_ms }
}
