//! Resolution: every item of a request, inline or named, becomes one
//! `Item` (the key's limit after overrides and the allowlist, the window,
//! the algorithm, shadow, shards, the fail policy that applies), once, by
//! one function per source. A combination the daemon cannot honour is
//! refused here, the same way for every kind of request.

use std::borrow::Cow;

use bytes::Bytes;

use crate::config::{multi_refusal, reserve_refusal, PolicyLimit};
use crate::policies::{shard_limit, Policy};
use crate::protocol::{Algorithm, CheckRequest, ErrorCode, FailPolicy, LeaseRequest, Response};

use super::count::Charge;
use super::limiter::Limiter;

/// One item, resolved: what the stores are asked and what applies when
/// they cannot answer.
#[derive(Clone, Copy, Debug)]
pub(super) struct Item<'a> {
    /// The configured policy; `None` for an inline limit (CHECK, ACQUIRE).
    pub policy: Option<&'a Policy>,
    /// The key the stores count under: the inline key, or the policy's
    /// scoped key (length byte, name, key).
    pub key: &'a Bytes,
    /// The key's limit; `None`: exempt (allowlisted, or override `unlimited`).
    pub limit: Option<u32>,
    pub window_ms: u32,
    pub cost: u32,
    pub algorithm: Algorithm,
    /// Recorded when it fits, never refuses.
    pub shadow: bool,
    /// 1, or the key's limit split over this many windows (plan.rs).
    pub shards: u32,
    /// The policy's own fail policy when it has one, else the request's.
    pub on_error: FailPolicy,
    pub local_limit: u32,
}

impl<'a> Item<'a> {
    /// A CHECK's inline limit: validated by the decoder already.
    pub fn inline(r: &'a CheckRequest) -> Self {
        Self {
            policy: None,
            key: &r.key,
            limit: Some(r.limit),
            window_ms: r.window_ms,
            cost: r.cost,
            algorithm: r.algorithm,
            shadow: false,
            shards: 1,
            on_error: r.header.on_error,
            local_limit: r.header.local_limit,
        }
    }

    /// An ACQUIRE's or RELEASE's inline limit (`window_ms` is the lease).
    pub fn inline_lease(r: &'a LeaseRequest) -> Self {
        Self {
            policy: None,
            key: &r.key,
            limit: Some(r.limit),
            window_ms: r.lease_ms,
            cost: r.cost,
            algorithm: Algorithm::Log,
            shadow: false,
            shards: 1,
            on_error: r.header.on_error,
            local_limit: r.header.local_limit,
        }
    }

    /// The most one request may cost: the key's limit, or with shards its
    /// largest shard's part (an item is admitted by exactly one shard).
    pub fn most(&self) -> Option<u32> {
        self.limit.map(|l| if self.shards > 1 { shard_limit(l, 0, self.shards) } else { l })
    }
}

/// What a request names: a check of a rate policy (one item or several, a
/// refund) or an acquire of a concurrency policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// CHECK_POLICY of one item without flags: every algorithm.
    Check,
    /// CHECK_POLICY of several items, or refundable: the exact log only.
    Multi,
    /// REFUND: the exact log only; no cost check (the admission's cost is
    /// taken back whatever the limit is now).
    Refund,
    /// ACQUIRE_POLICY or its release (`release`: no cost check).
    Lease { release: bool },
    /// CHECK_POLICY with the settle flag: an O(1) algorithm, unsharded.
    Reserve,
    /// SETTLE: as a reserve; no cost check (the actual may pass the limit:
    /// debt).
    Settle,
}

/// Why `policy` refuses every request of `kind`, whatever its key and
/// cost (a policy of the other kind, a combination it cannot take), as
/// the code and message `resolve` answers; None: it takes them. A reload
/// asks it of the uses nginx described (src/policies.rs, `uses_lost`).
pub fn kind_refusal(policy: &Policy, kind: Kind) -> Option<(ErrorCode, String)> {
    let rule = &policy.rule;
    let concurrency = rule.lease_ms.is_some();
    if concurrency != matches!(kind, Kind::Lease { .. }) {
        let msg = if concurrency {
            format!("policy '{}' is a concurrency policy: acquire and release it with op 7 (ratelimitd.concurrency{{policy=...}}), not with a check", policy.name)
        } else {
            format!("policy '{}' is a rate policy, not a concurrency one: check it with op 2 (ratelimitd.new{{policy=...}})", policy.name)
        };
        return Some((ErrorCode::WrongPolicyKind, msg));
    }
    // Several items in one call, and refunds, are written for the
    // exact log's script and windows; another algorithm's policy would
    // be judged by the wrong rule.
    // A ban is decided in the single check's script (src/redis/scripts/penalized_check.lua)
    // and counts the refusals of one key: several items all or nothing,
    // and refunds, have no place for it. The rule check-config --nginx
    // applies too (multi_refusal).
    if matches!(kind, Kind::Multi | Kind::Refund) {
        if let Some(why) = multi_refusal(rule.algorithm, rule.penalty.is_some()) {
            let msg = format!("policy '{}' (algorithm {}): {why}", policy.name, rule.algorithm.as_str());
            return Some((ErrorCode::UnsupportedCombination, msg));
        }
    }
    // Settle moves one counter by the difference: only the O(1)
    // algorithms have one (the rule check-config applies too).
    if matches!(kind, Kind::Reserve | Kind::Settle) {
        if let Some(why) = reserve_refusal(rule.algorithm, rule.shards) {
            let msg = format!("policy '{}' (algorithm {}, {} shards): {why}", policy.name, rule.algorithm.as_str(), rule.shards);
            return Some((ErrorCode::UnsupportedCombination, msg));
        }
    }
    None
}

/// A request the daemon refuses before asking a store: its response and
/// what it is counted against.
pub(super) struct Rejected<'a> {
    pub response: Response,
    pub charge: Charge<'a>,
}

/// The fields of an item as the request names it.
pub(super) struct Named<'a> {
    pub id: u32,
    pub op: u8,
    pub name: &'a [u8],
    pub key: &'a [u8],
    pub scoped_key: &'a Bytes,
    pub cost: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
}

impl Limiter {
    /// A key's limit under `policy` (None: exempt): an admin API override
    /// in force replaces the file's value for this key (one load and
    /// lookup in the background-refreshed table).
    pub(crate) fn limit_in_force(&self, policy: &Policy, key: &[u8], scoped_key: &[u8]) -> Option<u32> {
        match self.live_overrides.limit_for(scoped_key).unwrap_or_else(|| policy.limit_for(key)) {
            PolicyLimit::Limit(l) => Some(l),
            PolicyLimit::Unlimited => None,
        }
    }

    /// Resolves one named item: the policy, the key's limit, and every
    /// combination refused in the order PROTOCOL.md gives (unknown name,
    /// wrong kind, unsupported combination, cost).
    pub(super) fn resolve<'a>(&'a self, n: &Named<'a>, kind: Kind) -> Result<Item<'a>, Rejected<'a>> {
        let Some(policy) = self.policies.get(n.name) else {
            return Err(self.unknown_policy(n));
        };
        let rule = &policy.rule;
        let reject = |code, msg: String| Err(Rejected { response: Response::error(n.id, n.op, code, Cow::Owned(msg)), charge: Charge::one(Some(policy), None) });
        let concurrency = rule.lease_ms.is_some();
        if let Some((code, msg)) = kind_refusal(policy, kind) {
            return reject(code, msg);
        }
        let limit = self.limit_in_force(policy, n.key, n.scoped_key);
        let (on_error, local_limit) = match rule.fail_policy {
            Some(f) => (f, rule.local_limit.unwrap_or(0)),
            None => (n.on_error, n.local_limit),
        };
        let item = Item {
            policy: Some(policy),
            key: n.scoped_key,
            limit,
            window_ms: rule.lease_ms.unwrap_or(rule.window_ms),
            cost: n.cost,
            algorithm: rule.algorithm,
            shadow: rule.shadow,
            // Leases are one set per key: never sharded.
            shards: if concurrency { 1 } else { rule.shards.max(1) },
            on_error,
            local_limit,
        };
        let checks_cost = !matches!(kind, Kind::Refund | Kind::Settle | Kind::Lease { release: true });
        if let (true, Some(limit), Some(most)) = (checks_cost, item.limit, item.most()) {
            if n.cost > most {
                let msg = if most < limit {
                    format!("cost {} is above {most}, the largest shard of the limit {limit} of policy '{}' ({} shards) for this key", n.cost, policy.name, item.shards)
                } else {
                    format!("cost {} is above the limit {limit} of policy '{}' for this key", n.cost, policy.name)
                };
                return reject(ErrorCode::InvalidCost, msg);
            }
        }
        Ok(item)
    }

    /// A name the configuration does not have: a configuration error of the
    /// location (or a reload that removed the policy), logged loudly; the
    /// client's own fail policy decides.
    fn unknown_policy<'a>(&self, n: &Named<'_>) -> Rejected<'a> {
        let name = n.name.escape_ascii().to_string();
        if let Some(suppressed) = self.unknown_policy_log.permit() {
            tracing::error!(policy = %name, known = self.policies.len(), suppressed, "request names a policy that is not configured: the location's fail policy decides; add a [[policy]] of this name or fix the nginx configuration");
        }
        Rejected { response: Response::error(n.id, n.op, ErrorCode::UnknownPolicy, Cow::Owned(format!("no policy named '{name}' in the daemon's configuration"))), charge: Charge::Unknown }
    }
}
