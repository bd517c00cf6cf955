//! The penalty box on the request path (docs/POLICIES.md, "Penalty box"):
//! a policy's key banned is refused from the ban table (`penalty_box`)
//! with no store call; otherwise the store decides the window, counts a
//! refusal as a strike and engages the ban, in one call (Redis:
//! src/redis/penalty.lua; memory: the local window and the table's
//! strikes). Every refusal while banned has `retry_after` = the ban's end.

use std::sync::atomic::Ordering;

use crate::config::Penalty;
use crate::penalty_box::BANS;
use crate::protocol::{Response, Source};
use crate::window::{LimitSpec, Verdict};

use super::execute::NoVerdict;
use super::limiter::{Backend, Limiter};
use super::respond::verdict_response;
use super::resolve::Item;

impl Limiter {
    /// Decides one item of a policy with a penalty (log, unsharded: the
    /// configuration checks it). Never fails: store errors become the fail
    /// policy's response (a ban known here still refuses first).
    pub(super) async fn check_penalized(&self, id: u32, op: u8, item: &Item<'_>, limit: u32, penalty: Penalty) -> Response {
        let policy = item.policy.expect("a penalty belongs to a policy");
        let local = matches!(self.backend, Backend::Local);
        if let Some(left) = BANS.banned_ms(item.key) {
            policy.penalty_counters.banned.fetch_add(1, Ordering::Relaxed);
            let source = if local { Source::Memory } else { Source::DenialCache };
            return verdict_response(id, op, source, banned(left));
        }
        let spec = LimitSpec { key: item.key, limit, window_ms: item.window_ms, cost: item.cost };
        let sent = BANS.ticket();
        let answer = match &self.backend {
            Backend::Local => self.local.check(&spec, item.algorithm).map_err(NoVerdict::Full).map(|v| {
                if !v.allowed && BANS.strike(item.key, sent.sent_ns, penalty.after, penalty.within_ms) {
                    // The ban itself (no Redis to outlive): from now, whatever was lifted meanwhile.
                    BANS.ban(item.key, BANS.ticket(), penalty.ban_ms.saturating_add(1));
                    policy.penalty_counters.bans.fetch_add(1, Ordering::Relaxed);
                    policy.penalty_counters.banned.fetch_add(1, Ordering::Relaxed);
                    return (Source::Memory, Verdict { remaining: 0, retry_after_ms: penalty.ban_ms, reset_ms: v.reset_ms.max(penalty.ban_ms), ..v });
                }
                (Source::Memory, v)
            }),
            Backend::Redis(redis) => match redis.check_penalized(&spec, penalty.after, penalty.within_ms, penalty.ban_ms).await {
                Ok((v, state)) => {
                    if state.banned_ms > 0 {
                        BANS.ban(item.key, sent, state.banned_ms);
                        policy.penalty_counters.banned.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(ends_at_ms) = state.engaged {
                        policy.penalty_counters.bans.fetch_add(1, Ordering::Relaxed);
                        // Listed by the admin API: one write per ban, off the request path.
                        let (redis, scoped) = (redis.clone(), item.key.clone());
                        tokio::spawn(async move {
                            let index = redis.penalty_index_key();
                            if let Err(e) = redis.note_ban(&index, &scoped, ends_at_ms).await {
                                tracing::debug!(error = %e, "could not add a ban to the admin index");
                            }
                        });
                    }
                    Ok((Source::Redis, v))
                }
                Err(e) => Err(NoVerdict::Store(e)),
            },
        };
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
