//! Named policies at run time: the `[[policy]]` tables of the configuration
//! as the request path looks them up (by name, then the key's override),
//! and their per-policy counters.
//!
//! Built whole on each configuration load and swapped in with the limiter,
//! so a request sees one consistent set. The counters of a policy are kept
//! across reloads (matched by name) so that Prometheus sees no reset; a
//! policy removed from the file leaves /metrics with it. Label values are
//! the configured names only: what clients send never becomes a label.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::config::{PolicyConfig, PolicyLimit, PolicyRule};
use crate::protocol::{PolicyUse, PolicyUses};

/// What happened to one policy request; each request counts in exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted by the store (Redis, or the in-memory backend).
    Admitted,
    /// Refused by the store.
    Refused,
    /// Refused by the daemon's denial cache, without a Redis call.
    RefusedFromCache,
    /// A shadow policy would have refused; admitted.
    ShadowRefused,
    /// The key is allowlisted or its override is unlimited; no store asked.
    Exempt,
    /// Redis failed; admitted by fail policy open.
    FailOpen,
    /// Redis failed; refused by fail policy closed.
    FailClosed,
    /// Redis failed; the per-host fallback window admitted.
    FailLocalAdmitted,
    /// Redis failed; the per-host fallback window refused.
    FailLocalRefused,
    /// No decision (a cost above the key's limit, full in-memory windows).
    Error,
}

impl Outcome {
    pub const ALL: [Outcome; 10] = [
        Self::Admitted,
        Self::Refused,
        Self::RefusedFromCache,
        Self::ShadowRefused,
        Self::Exempt,
        Self::FailOpen,
        Self::FailClosed,
        Self::FailLocalAdmitted,
        Self::FailLocalRefused,
        Self::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Refused => "refused",
            Self::RefusedFromCache => "refused_from_cache",
            Self::ShadowRefused => "shadow_refused",
            Self::Exempt => "exempt",
            Self::FailOpen => "fail_open",
            Self::FailClosed => "fail_closed",
            Self::FailLocalAdmitted => "fail_local_admitted",
            Self::FailLocalRefused => "fail_local_refused",
            Self::Error => "error",
        }
    }
}

/// CHECK_POLICY requests naming a policy the configuration does not have:
/// one counter, never labelled by the name sent.
static UNKNOWN_POLICY_REQUESTS: AtomicU64 = AtomicU64::new(0);

/// Counts one request naming an unknown policy.
#[inline]
pub fn count_unknown() {
    UNKNOWN_POLICY_REQUESTS.fetch_add(1, Ordering::Relaxed);
}

/// Requests that named an unknown policy, since start.
pub fn unknown_requests() -> u64 {
    UNKNOWN_POLICY_REQUESTS.load(Ordering::Relaxed)
}

/// One policy's counters: an atomic per outcome, added to with one relaxed
/// operation; and when it was last used (the use clock, 0: never), which a
/// reload reads to refuse removing a policy that serves (docs/OPERATIONS.md).
#[derive(Debug, Default)]
pub struct PolicyCounters {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    /// Units of worker shares handed to nginx and given back unused: the
    /// requests nginx admitted from shares (never sent to the daemon) are
    /// the difference.
    share_units: AtomicU64,
    share_units_given_back: AtomicU64,
    last_used: AtomicU64,
    /// The use clock when nginx last described this policy (DESCRIBE_POLICY
    /// at worker start): nginx names it, so a reload must not drop it even
    /// before its first request.
    last_described: AtomicU64,
    /// The use clock when a client last described each use of this policy
    /// (`PolicyUse` as index): a reload must keep every recent one possible.
    described_uses: [AtomicU64; PolicyUse::ALL.len()],
}

impl PolicyCounters {
    #[inline]
    pub fn count(&self, o: Outcome) {
        self.outcomes[o as usize].fetch_add(1, Ordering::Relaxed);
        // Written once a second at most: a load of a shared line, no store.
        let now = crate::use_clock::now();
        if self.last_used.load(Ordering::Relaxed) != now {
            self.last_used.store(now, Ordering::Relaxed);
        }
    }

    /// The use clock when this policy last decided a request; 0: never
    /// (since the daemon started).
    pub fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }

    /// Marks the policy as named by a client (a DESCRIBE_POLICY), for
    /// `uses`: in use for the reload refusal as a decided request is, and
    /// each use one a reload must keep possible.
    pub fn described(&self, uses: PolicyUses) {
        let now = crate::use_clock::now();
        for slot in std::iter::once(&self.last_described).chain(uses.iter().map(|u| &self.described_uses[u as usize])) {
            if slot.load(Ordering::Relaxed) != now {
                slot.store(now, Ordering::Relaxed);
            }
        }
    }

    /// The use clock when a client last described use `u`; 0: never.
    pub fn last_described_use(&self, u: PolicyUse) -> u64 {
        self.described_uses[u as usize].load(Ordering::Relaxed)
    }

    /// The use clock when a client last described this policy; 0: never.
    pub fn last_described(&self) -> u64 {
        self.last_described.load(Ordering::Relaxed)
    }

    pub fn get(&self, o: Outcome) -> u64 {
        self.outcomes[o as usize].load(Ordering::Relaxed)
    }

    /// `units` of the policy's key handed to a worker's share (op 10).
    pub fn shared(&self, units: u32) {
        self.share_units.fetch_add(u64::from(units), Ordering::Relaxed);
    }

    /// `units` of a worker share given back unused.
    pub fn share_given_back(&self, units: u32) {
        self.share_units_given_back.fetch_add(u64::from(units), Ordering::Relaxed);
    }

    /// (units handed to worker shares, units given back), since start.
    pub fn share_units(&self) -> (u64, u64) {
        (self.share_units.load(Ordering::Relaxed), self.share_units_given_back.load(Ordering::Relaxed))
    }
}

/// A penalty box's counters (`ratelimitd_penalty_*`, docs/OPERATIONS.md §6).
#[derive(Debug, Default)]
pub struct PenaltyCounters {
    /// Bans this daemon's requests engaged (shadow policies' too).
    pub bans: AtomicU64,
    /// Requests refused because their key was banned (by Redis or the cache).
    pub banned: AtomicU64,
}

/// One policy, ready for the request path: its rule as the configuration
/// typed it, the keys' overrides in a map the request's key is looked up
/// in, and what it keeps at run time.
#[derive(Debug)]
pub struct Policy {
    pub name: Box<str>,
    pub rule: PolicyRule,
    /// Kept across reloads, by name, as `counters`.
    pub penalty_counters: Arc<PenaltyCounters>,
    /// Where this daemon's next sharded request starts (round robin, from a
    /// random shard, so daemons do not all begin on the same one).
    next_shard: AtomicU32,
    /// Exact keys (allowlist included, as `Unlimited`).
    overrides: HashMap<Box<[u8]>, PolicyLimit>,
    pub counters: Arc<PolicyCounters>,
}

impl Policy {
    /// The limit for `key`: its override, else the policy's.
    #[inline]
    pub fn limit_for(&self, key: &[u8]) -> PolicyLimit {
        if self.overrides.is_empty() {
            return PolicyLimit::Limit(self.rule.limit);
        }
        self.overrides.get(key).copied().unwrap_or(PolicyLimit::Limit(self.rule.limit))
    }

    /// The shard a sharded request tries first: one relaxed increment.
    #[inline]
    pub fn first_shard(&self) -> u32 {
        self.next_shard.fetch_add(1, Ordering::Relaxed) % self.rule.shards
    }
}

/// A window as a reload's log line names it: a length in ms, or a
/// calendar window (`window::CALENDAR`) by its length and `utc_offset`.
fn window_text(window_ms: u32) -> String {
    if window_ms < crate::window::CALENDAR {
        return format!("{window_ms} ms");
    }
    let code = window_ms - crate::window::CALENDAR;
    let (minutes, offset) = (code >> 12, i64::from(code & 0xFFF) - 2048);
    let length = if minutes == 0 { "month".to_string() } else { format!("{minutes} min") };
    format!("{length} at utc_offset {}{:02}:{:02}", if offset < 0 { '-' } else { '+' }, offset.abs() / 60, offset.abs() % 60)
}

/// What in `new` would restart the counts `old` keeps, or None when they
/// carry over. A rate policy's counts live under a key made of its window
/// (a calendar window's `utc_offset` included), its algorithm and its
/// shards (src/redis/keys.rs `WindowKey`, src/redis/shard.rs; in memory
/// src/local_store.rs `WindowName`): a change of any of them names other
/// keys, which start empty. A concurrency policy's leases are one set per
/// key whatever the lease (`WindowKey::lease_key`): they carry over.
pub fn counts_restart(old: &Policy, new: &Policy) -> Option<String> {
    let (old, new) = (&old.rule, &new.rule);
    let kind = |p: &PolicyRule| if p.lease_ms.is_some() { "concurrency" } else { "rate" };
    if kind(old) != kind(new) {
        return Some(format!("kind {} -> {}", kind(old), kind(new)));
    }
    if old.lease_ms.is_some() {
        return None;
    }
    let mut changes = Vec::new();
    if old.window_ms != new.window_ms {
        changes.push(format!("window {} -> {}", window_text(old.window_ms), window_text(new.window_ms)));
    }
    if old.algorithm != new.algorithm {
        changes.push(format!("algorithm {} -> {}", old.algorithm.as_str(), new.algorithm.as_str()));
    }
    if old.shards != new.shards {
        changes.push(format!("shards {} -> {}", old.shards, new.shards));
    }
    (!changes.is_empty()).then(|| changes.join(", "))
}

/// Shard `i`'s part of `limit` split over `shards`: the first `limit %
/// shards` shards get one more, so the parts sum to `limit` exactly.
#[inline]
pub fn shard_limit(limit: u32, i: u32, shards: u32) -> u32 {
    limit / shards + u32::from(i < limit % shards)
}

/// A start for the round robin; without randomness, 0 (only fairness
/// between daemons depends on it).
fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    getrandom::fill(&mut b).map_or(0, |()| u32::from_le_bytes(b))
}

/// Every configured policy, by name.
#[derive(Debug, Default)]
pub struct Policies {
    list: Vec<Policy>,
    by_name: HashMap<Box<[u8]>, usize>,
}

impl Policies {
    /// The policies of `configs`, keeping the counters of `previous` ones of
    /// the same name. The configuration is validated: names are unique.
    pub fn build(configs: &[PolicyConfig], previous: Option<&Policies>) -> Self {
        let mut list = Vec::with_capacity(configs.len());
        let mut by_name = HashMap::with_capacity(configs.len());
        for c in configs {
            let counters = previous.and_then(|p| p.get(c.name.as_bytes())).map_or_else(Default::default, |p| p.counters.clone());
            let penalty_counters = previous.and_then(|p| p.get(c.name.as_bytes())).map_or_else(Default::default, |p| p.penalty_counters.clone());
            by_name.insert(Box::from(c.name.as_bytes()), list.len());
            list.push(Policy {
                name: c.name.as_str().into(),
                rule: c.rule,
                penalty_counters,
                next_shard: AtomicU32::new(random_u32()),
                overrides: c.overrides.iter().map(|(k, v)| (Box::from(k.as_bytes()), *v)).collect(),
                counters,
            });
        }
        Self { list, by_name }
    }

    /// The policy named `name`: one hash of the name, no allocation.
    #[inline]
    pub fn get(&self, name: &[u8]) -> Option<&Policy> {
        self.by_name.get(name).map(|&i| &self.list[i])
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The policies in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = &Policy> {
        self.list.iter()
    }

    /// The Prometheus text of the per-policy counters, and of requests
    /// naming an unknown policy (also without policies: that is when a
    /// misnamed location is most likely).
    pub fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP ratelimitd_policy_unknown_requests_total CHECK_POLICY and ACQUIRE_POLICY requests naming a policy not in the configuration; the location's fail policy decided.\n# TYPE ratelimitd_policy_unknown_requests_total counter\nratelimitd_policy_unknown_requests_total {}",
            unknown_requests()
        );
        if self.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "# HELP ratelimitd_policy_requests_total CHECK_POLICY and ACQUIRE_POLICY requests by configured policy and outcome; each request counts in one outcome.\n# TYPE ratelimitd_policy_requests_total counter"
        );
        for p in &self.list {
            for o in Outcome::ALL {
                let _ = writeln!(out, "ratelimitd_policy_requests_total{{policy=\"{}\",outcome=\"{}\"}} {}", p.name, o.as_str(), p.counters.get(o));
            }
        }
        let _ = writeln!(
            out,
            "# HELP ratelimitd_policy_share_units_total Units of worker shares of the policy's keys handed to nginx, and given back unused; handed less given back is the requests nginx admitted from shares, which never reach the daemon.\n# TYPE ratelimitd_policy_share_units_total counter"
        );
        for p in &self.list {
            let (handed, given_back) = p.counters.share_units();
            let _ = writeln!(out, "ratelimitd_policy_share_units_total{{policy=\"{}\",outcome=\"handed\"}} {handed}", p.name);
            let _ = writeln!(out, "ratelimitd_policy_share_units_total{{policy=\"{}\",outcome=\"given_back\"}} {given_back}", p.name);
        }
        let penalized = || self.list.iter().filter(|p| p.rule.penalty.is_some());
        if penalized().next().is_some() {
            let _ = writeln!(out, "# HELP ratelimitd_penalty_bans_total Bans of the penalty box engaged by this daemon's requests, by policy (a shadow policy's too: recorded, never enforced).\n# TYPE ratelimitd_penalty_bans_total counter");
            for p in penalized() {
                let _ = writeln!(out, "ratelimitd_penalty_bans_total{{policy=\"{}\"}} {}", p.name, p.penalty_counters.bans.load(Ordering::Relaxed));
            }
            let _ = writeln!(out, "# HELP ratelimitd_penalty_banned_requests_total Requests refused because their key was banned (by Redis, the ban cache or the memory backend), by policy.\n# TYPE ratelimitd_penalty_banned_requests_total counter");
            for p in penalized() {
                let _ = writeln!(out, "ratelimitd_penalty_banned_requests_total{{policy=\"{}\"}} {}", p.name, p.penalty_counters.banned.load(Ordering::Relaxed));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Algorithm;
    use std::collections::BTreeMap;

    fn config(name: &str, limit: u32) -> PolicyConfig {
        PolicyConfig {
            name: name.into(),
            rule: PolicyRule::rate(limit, 1000),
            overrides: BTreeMap::from([("big".into(), PolicyLimit::Limit(50)), ("free".into(), PolicyLimit::Unlimited)]),
        }
    }

    #[test]
    fn lookups_and_overrides() {
        let p = Policies::build(&[config("order", 10)], None);
        let order = p.get(b"order").unwrap();
        assert_eq!(order.rule.window_ms, 1000);
        assert_eq!(order.limit_for(b"t1"), PolicyLimit::Limit(10));
        assert_eq!(order.limit_for(b"big"), PolicyLimit::Limit(50));
        assert_eq!(order.limit_for(b"free"), PolicyLimit::Unlimited);
        assert!(p.get(b"orde").is_none());
    }

    #[test]
    fn only_a_change_of_the_keys_restarts_counts() {
        let build = |c: PolicyConfig| Policies::build(&[c], None);
        let with = |rule: PolicyRule| PolicyConfig { rule, ..config("p", 10) };
        let base = config("p", 10).rule;
        let (old, same) = (build(config("p", 10)), build(PolicyConfig { rule: PolicyRule { limit: 20, shadow: true, ..base }, overrides: Default::default(), ..config("p", 10) }));
        let p = |ps: &Policies| ps.get(b"p").map(|p| counts_restart(old.get(b"p").unwrap(), p));
        assert_eq!(p(&same), Some(None), "limit, shadow and overrides live outside the key");
        let window = build(with(PolicyRule { window_ms: 2000, ..base }));
        assert_eq!(p(&window), Some(Some("window 1000 ms -> 2000 ms".into())));
        let ring = build(with(PolicyRule { algorithm: Algorithm::Ring, shards: 4, ..base }));
        assert_eq!(p(&ring), Some(Some("algorithm log -> ring, shards 1 -> 4".into())));
        let month = |offset| build(with(PolicyRule { algorithm: Algorithm::Fixed, window_ms: crate::window::calendar_window_ms(0, offset), ..base }));
        let (utc, cest) = (month(0), month(120));
        assert_eq!(counts_restart(utc.get(b"p").unwrap(), cest.get(b"p").unwrap()), Some("window month at utc_offset +00:00 -> month at utc_offset +02:00".into()));
        let lease = |ms| build(with(PolicyRule { lease_ms: Some(ms), ..base }));
        assert_eq!(counts_restart(lease(1000).get(b"p").unwrap(), lease(5000).get(b"p").unwrap()), None, "one lease set per key, whatever the lease");
        assert_eq!(p(&lease(1000)), Some(Some("kind rate -> concurrency".into())));
    }

    #[test]
    fn shard_limits_sum_to_the_limit() {
        for (limit, shards) in [(1000, 3), (10, 3), (7, 7), (65, 64), (1, 1)] {
            let parts: Vec<u32> = (0..shards).map(|i| shard_limit(limit, i, shards)).collect();
            assert_eq!(parts.iter().sum::<u32>(), limit, "{parts:?}");
            assert!(parts.iter().all(|&p| p >= limit / shards && p <= limit / shards + 1 && p >= 1), "{parts:?}");
        }
    }

    #[test]
    fn counters_survive_a_reload_by_name_and_render_configured_names_only() {
        let first = Policies::build(&[config("order", 10), config("login", 5)], None);
        first.get(b"order").unwrap().counters.count(Outcome::Refused);
        let second = Policies::build(&[config("order", 20), config("search", 5)], Some(&first));
        assert_eq!(second.get(b"order").unwrap().counters.get(Outcome::Refused), 1);
        assert_eq!(second.get(b"search").unwrap().counters.get(Outcome::Refused), 0);
        let mut text = String::new();
        second.render(&mut text);
        assert!(text.contains("ratelimitd_policy_requests_total{policy=\"order\",outcome=\"refused\"} 1"), "{text}");
        assert!(text.contains("policy=\"search\",outcome=\"shadow_refused\"} 0"), "{text}");
        assert!(!text.contains("login"), "a removed policy leaves /metrics");
        let mut none = String::new();
        Policies::default().render(&mut none);
        assert!(!none.contains("ratelimitd_policy_requests_total"), "{none}");
        assert!(none.contains("\nratelimitd_policy_unknown_requests_total "), "{none}");
    }
}
