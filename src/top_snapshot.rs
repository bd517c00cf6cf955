//! The document of `GET /top.json`: what `ratelimitd top` shows, as the
//! daemon's cumulative counters at one instant (the viewer turns two of
//! them into rates) and the keys refused most in the last minute.
//!
//! Bounded: the policies of the configuration, `top_refused::K` keys of at
//! most `top_refused::KEY_BYTES` bytes each, fixed-size rest.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::PolicyLimit;
use crate::live_overrides::{split_scoped, LiveOverrides};
use crate::metrics::METRICS;
use crate::policies::{self, Outcome, Policies};
use crate::top_refused::{uptime_ms, TopKey, K, KEY_BYTES, TOP_REFUSED};

/// The document's format; a viewer refuses another.
pub const FORMAT: u32 = 1;

/// One `GET /top.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TopDoc {
    pub format: u32,
    /// Ms since the daemon started, on a monotonic clock (rates: the
    /// difference of two documents' counters over the difference of these;
    /// a smaller value than before means a restart).
    pub uptime_ms: u64,
    #[serde(flatten)]
    pub gauges: Gauges,
    /// Every response by decision and source (all requests, both ops).
    pub decisions: Vec<DecisionCount>,
    pub redis_latency: Histogram,
    /// The configured policies, in configuration order.
    pub policies: Vec<PolicyCounts>,
    /// CHECK_POLICY requests naming a policy that is not configured.
    pub unknown_policy_requests: u64,
    #[serde(flatten)]
    pub keys: KeyLists,
}

/// The daemon's gauges at the document's instant: shown as they are by
/// the viewer (not turned into rates).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Gauges {
    /// Whether the circuit breaker to Redis is open; null without Redis.
    pub breaker_open: Option<bool>,
    pub requests_in_flight: i64,
    pub connections_open: i64,
    /// The adaptive limit on Redis calls in flight (0 without Redis).
    pub redis_in_flight_limit: i64,
}

/// The keys the document names, each list bounded by `K`: shown as they
/// are by the viewer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KeyLists {
    pub top_refused: TopRefusedDoc,
    /// The penalty box's bans this daemon knows (its cache of Redis's, or
    /// the memory backend's), longest first, at most `K`; absent from a
    /// daemon that predates them.
    #[serde(default)]
    pub bans: Vec<BanDoc>,
    /// Bans this daemon knows in all (`bans` shows the first `K`).
    #[serde(default)]
    pub bans_known: usize,
    /// The admin API's overrides in force on this daemon, soonest expiry
    /// first, at most `K`.
    #[serde(default)]
    pub overrides: Vec<OverrideDoc>,
    /// Overrides in force in all.
    #[serde(default)]
    pub overrides_in_force: usize,
}

/// A key in the penalty box.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BanDoc {
    pub policy: String,
    pub key: String,
    /// What is left of the ban, ms (this daemon's cache: never later than Redis's).
    pub ends_in_ms: u64,
}

/// A key running under an admin API override.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OverrideDoc {
    pub policy: String,
    pub key: String,
    /// `None`: unlimited.
    pub limit: Option<u32>,
    /// Unix ms, Redis's clock.
    pub expires_at_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DecisionCount {
    pub decision: String,
    pub source: String,
    pub count: u64,
}

/// The Redis call latency histogram, cumulative since start.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Histogram {
    /// Upper bounds of the buckets in µs; `counts` has one more (above the last).
    pub bounds_us: Vec<u64>,
    /// Calls per bucket (not cumulative).
    pub counts: Vec<u64>,
    pub sum_us: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PolicyCounts {
    pub name: String,
    pub limit: u32,
    pub window_ms: u32,
    pub shadow: bool,
    /// Requests by outcome (`policies::Outcome` names), cumulative.
    pub outcomes: BTreeMap<String, u64>,
    /// Units of worker shares handed to nginx, and given back unused,
    /// cumulative: nginx admitted the difference (absent from a daemon
    /// that predates shares).
    #[serde(default)]
    pub share_units: u64,
    #[serde(default)]
    pub share_units_given_back: u64,
}

/// The most refused keys of the window (space-saving summaries: see
/// docs/OPERATIONS.md, "ratelimitd top").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TopRefusedDoc {
    /// How far back the window reaches (50 to 60 s once the daemon has run a minute).
    pub window_ms: u64,
    /// Refusals recorded in the window: a key's `error` is at most
    /// `recorded / k`, and any key refused more than that is tracked.
    pub recorded: u64,
    /// Refusals not recorded (a shard busy), since start.
    pub skipped: u64,
    /// Keys tracked per summary.
    pub k: usize,
    /// Most refused first.
    pub keys: Vec<RefusedKey>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RefusedKey {
    /// The policy, or null for an inline check.
    pub policy: Option<String>,
    /// The key as sent by nginx (UTF-8, else with `\xNN` escapes).
    pub key: String,
    /// Only the key's first bytes are kept.
    pub key_truncated: bool,
    /// Refusals in the window: an upper bound.
    pub refused: u64,
    /// `refused - error` is a lower bound.
    pub error: u64,
}

fn text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => bytes.escape_ascii().to_string(),
    }
}

/// Splits a recorded key: a policy's keys are `<name length><name><key>`
/// (a control byte first, which an inline key never has).
fn refused_key(k: &TopKey) -> RefusedKey {
    let truncated = k.key_len > KEY_BYTES;
    match k.key.first() {
        Some(&n) if n < 0x20 && k.key.len() > n as usize => RefusedKey {
            policy: Some(text(&k.key[1..=n as usize])),
            key: text(&k.key[1 + n as usize..]),
            key_truncated: truncated,
            refused: k.refused,
            error: k.error,
        },
        _ => RefusedKey { policy: None, key: text(&k.key), key_truncated: truncated, refused: k.refused, error: k.error },
    }
}

/// The bans this daemon knows, longest first, at most `K`, and how many.
fn bans() -> (Vec<BanDoc>, usize) {
    let mut all = crate::penalty_box::BANS.entries();
    let known = all.len();
    all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let docs = all
        .iter()
        .take(K)
        .filter_map(|(scoped, left)| {
            let (policy, key) = split_scoped(scoped)?;
            Some(BanDoc { policy: policy.to_string(), key: text(key), ends_in_ms: u64::from(*left) })
        })
        .collect();
    (docs, known)
}

/// The overrides in force, soonest expiry first, at most `K`, and how many.
fn overrides(live: &LiveOverrides) -> (Vec<OverrideDoc>, usize) {
    let mut all = live.entries();
    let n = all.len();
    all.sort_by(|a, b| a.1.expires_at_ms.cmp(&b.1.expires_at_ms).then_with(|| a.0.cmp(&b.0)));
    let docs = all
        .iter()
        .take(K)
        .filter_map(|(scoped, o)| {
            let (policy, key) = split_scoped(scoped)?;
            let limit = match o.limit {
                PolicyLimit::Limit(l) => Some(l),
                PolicyLimit::Unlimited => None,
            };
            Some(OverrideDoc { policy: policy.to_string(), key: text(key), limit, expires_at_ms: o.expires_at_ms })
        })
        .collect();
    (docs, n)
}

/// The document now.
pub fn build(breaker_open: Option<bool>, policies: &Policies, live: &LiveOverrides) -> TopDoc {
    let f = METRICS.figures();
    let top = TOP_REFUSED.snapshot(K);
    let (bans, bans_known) = bans();
    let (overrides, overrides_in_force) = overrides(live);
    TopDoc {
        format: FORMAT,
        uptime_ms: uptime_ms(),
        gauges: Gauges { breaker_open, requests_in_flight: f.requests_in_flight, connections_open: f.connections_open, redis_in_flight_limit: f.redis_in_flight_limit },
        decisions: f.decisions.iter().map(|(d, s, n)| DecisionCount { decision: d.as_str().into(), source: s.as_str().into(), count: *n }).collect(),
        redis_latency: Histogram { bounds_us: f.redis_latency_bounds_us.to_vec(), counts: f.redis_latency_counts, sum_us: f.redis_latency_sum_us },
        policies: policies
            .iter()
            .map(|p| PolicyCounts {
                name: p.name.to_string(),
                limit: p.rule.limit,
                // A calendar month as 31 days (src/window.rs).
                window_ms: crate::window::nominal_window_ms(p.rule.window_ms),
                shadow: p.rule.shadow,
                outcomes: Outcome::ALL.iter().map(|o| (o.as_str().to_string(), p.counters.get(*o))).collect(),
                share_units: p.counters.share_units().0,
                share_units_given_back: p.counters.share_units().1,
            })
            .collect(),
        unknown_policy_requests: policies::unknown_requests(),
        keys: KeyLists {
            top_refused: TopRefusedDoc { window_ms: top.window_ms, recorded: top.recorded, skipped: top.skipped, k: K, keys: top.keys.iter().map(refused_key).collect() },
            bans,
            bans_known,
            overrides,
            overrides_in_force,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_split_into_policy_and_key() {
        let k = |key: &[u8], key_len| TopKey { key: key.to_vec(), key_len, refused: 3, error: 1 };
        let r = refused_key(&k(b"\x05ordert1", 8));
        assert_eq!((r.policy.as_deref(), r.key.as_str(), r.key_truncated), (Some("order"), "t1", false));
        let r = refused_key(&k(b"login:1.2.3.4", 13));
        assert_eq!((r.policy, r.key.as_str()), (None, "login:1.2.3.4"));
        let r = refused_key(&k(b"\x01ab\xff", 400));
        assert_eq!((r.policy.as_deref(), r.key.as_str(), r.key_truncated, r.refused, r.error), (Some("a"), "b\\xff", true, 3, 1));
    }

    #[test]
    fn document_round_trips_through_json() {
        let doc = build(Some(false), &Policies::default(), &LiveOverrides::default());
        let text = serde_json::to_string(&doc).unwrap();
        assert_eq!(serde_json::from_str::<TopDoc>(&text).unwrap(), doc);
        assert_eq!(doc.redis_latency.counts.len(), doc.redis_latency.bounds_us.len() + 1);
    }
}
