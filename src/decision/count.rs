//! Counting: the one place where an answered request is counted
//! (SEMANTICS S9): the decisions metric, the per-policy counters and the top
//! refused keys, once per request, from its response alone.

use crate::metrics::METRICS;
use crate::policies::{count_unknown, Outcome, Policy};
use crate::protocol::{Decision, PolicyItem, Response, Source};
use crate::top_refused::TOP_REFUSED;

/// What a request is counted against, besides the decisions metric.
#[derive(Debug)]
pub(super) enum Charge<'a> {
    /// Nothing but the decisions metric.
    Nobody,
    /// A name no policy has: the unknown-policy counter.
    Unknown,
    /// One request of one policy (or of an inline limit, `None`): the
    /// response's outcome; `top`: the key `ratelimitd top` lists when a
    /// limit refused it.
    One { policy: Option<&'a Policy>, top: Option<&'a [u8]> },
    /// A multi-item check: each item's policy, by its result in the
    /// response's extension.
    Items { policies: Vec<&'a Policy>, items: &'a [PolicyItem] },
    /// A REFUND carried out: not a decision; its own counters.
    Refund { removed: u64 },
    /// A SETTLE carried out in Redis (`matched`: its reserve was found).
    Settle { matched: bool },
    /// A DESCRIBE_POLICY answered: no decision, counted nowhere.
    Described,
}

impl<'a> Charge<'a> {
    pub fn one(policy: Option<&'a Policy>, top: Option<&'a [u8]>) -> Self {
        Self::One { policy, top }
    }
}

/// Counts the answer to a frame that is no request (invalid, too large,
/// cut off by the end of the stream): the server's decode outcomes, counted
/// here like every decided request.
pub(crate) fn count_undecoded(r: &Response) {
    account(r, &Charge::Nobody);
}

/// Counts one answered request: the one place (SEMANTICS S9).
pub(super) fn account(r: &Response, charge: &Charge<'_>) {
    match charge {
        Charge::Refund { removed } => {
            METRICS.refunded(*removed);
            return;
        }
        Charge::Settle { matched } => {
            METRICS.settled(*matched);
            return;
        }
        Charge::Described => return,
        Charge::Nobody => {}
        Charge::Unknown => count_unknown(),
        Charge::One { policy, top } => {
            if let Some(key) = top.filter(|_| refused_by_a_limit(r.decision, r.source)) {
                // The inline key, or the policy-scoped one (shadow refusals too).
                TOP_REFUSED.record(key);
            }
            if let Some(p) = policy {
                p.counters.count(outcome_of(r.decision, r.source));
            }
        }
        Charge::Items { policies, items } => {
            let results = r.extension.as_ref().map_or(&[][..], |e| &e.items[..]);
            for ((p, item), res) in policies.iter().zip(items.iter()).zip(results) {
                if refused_by_a_limit(res.decision, res.source) {
                    TOP_REFUSED.record(&item.scoped_key);
                }
                let outcome = match (res.decision, res.source) {
                    // Not evaluated: another item's cached refusal decided.
                    (Decision::Denied, Source::None) => None,
                    (_, Source::Exempt) => Some(Outcome::Exempt),
                    // Had room, but another item refused: charged nothing, counted nowhere.
                    (Decision::Allowed | Decision::ShadowAllowed, _) if r.decision != Decision::Allowed => None,
                    (d, s) => Some(outcome_of(d, s)),
                };
                if let Some(o) = outcome {
                    p.counters.count(o);
                }
            }
        }
    }
    METRICS.decided(r.decision, r.source, r.error);
}

/// The per-policy outcome of a decision.
pub(super) fn outcome_of(decision: Decision, source: Source) -> Outcome {
    match (decision, source) {
        (Decision::Error, _) => Outcome::Error,
        (Decision::ShadowDenied, _) => Outcome::ShadowRefused,
        // A shadow policy with room is counted as any admission.
        (Decision::ShadowAllowed, s) => outcome_of(Decision::Allowed, s),
        (_, Source::Exempt) => Outcome::Exempt,
        (Decision::Denied, Source::DenialCache) => Outcome::RefusedFromCache,
        (_, Source::FailOpen) => Outcome::FailOpen,
        (_, Source::FailClosed) => Outcome::FailClosed,
        (Decision::Allowed, Source::LocalFallback) => Outcome::FailLocalAdmitted,
        (_, Source::LocalFallback) => Outcome::FailLocalRefused,
        (Decision::Allowed, _) => Outcome::Admitted,
        _ => Outcome::Refused,
    }
}

/// Whether a response is a refusal by a limit (a store, the denial cache,
/// the local fallback's quota), as `top` lists them: not fail-closed, not
/// an error. Shadow refusals too.
#[inline]
pub(super) fn refused_by_a_limit(decision: Decision, source: Source) -> bool {
    matches!(decision, Decision::Denied | Decision::ShadowDenied) && matches!(source, Source::Redis | Source::DenialCache | Source::Memory | Source::LocalFallback)
}
