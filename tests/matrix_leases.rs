//! Quota leases and worker shares crossed with the feature matrix's
//! dimensions (tests/common/model.rs draws them for tests/matrix.rs): every
//! algorithm, shadow, shards, an override, an allowlisted and an unlimited
//! key, single checks, worker shares (op 10), multi-item refundable checks
//! and their refunds, with `quota_leases` off and on, against a real daemon
//! and Redis.
//!
//! Under leases the serial model's numbers differ by design (a lease's
//! units are counted before they are used), so this is checked by bounds,
//! from the serial count of what was admitted: an enforced key never admits
//! more than its limit (its override's), and once the leases settled
//! exactly its limit; a shadow policy never refuses; an exempt key is always
//! admitted as exempt; units are shared only where docs/PERFORMANCE.md
//! ("Worker shares") says (log, not shadow, not sharded, not exempt); a
//! multi-item check of another algorithm than the log is
//! `UNSUPPORTED_COMBINATION` (S7).

mod common;

use std::time::{Duration, Instant};

use common::model::{code, Config, Kind, Limit, PolicySpec};
use common::{Daemon, RedisServer};
use ratelimitd::client::Client;
use ratelimitd::protocol::{Algorithm, Decision, FailPolicy, ItemArgs, PolicyCheckArgs, Source};

const LIMIT: u32 = 40;
const KEYS: [&str; 4] = ["plain", "low", "vip", "free"];

fn policies() -> Vec<PolicySpec> {
    let mut out = Vec::new();
    for algorithm in Algorithm::ALL.iter().copied() {
        for shadow in [false, true] {
            for shards in [1, 3] {
                out.push(PolicySpec {
                    name: format!("{}{}{}", algorithm.as_str(), if shadow { "_s" } else { "" }, if shards > 1 { "_x3" } else { "" }),
                    kind: Kind::Rate { algorithm, shards },
                    limit: LIMIT,
                    shadow,
                    overrides: vec![("low".into(), Limit::N(LIMIT / 2)), ("free".into(), Limit::Unlimited)],
                    allowlist: vec!["vip".into()],
                    fail_policy: None,
                    removed: false,
                });
            }
        }
    }
    // The other item of the multi-item checks.
    out.push(PolicySpec { name: "aux".into(), kind: Kind::Rate { algorithm: Algorithm::Log, shards: 1 }, limit: 100_000, shadow: false, overrides: vec![], allowlist: vec![], fail_policy: None, removed: false });
    out
}

fn args<'a>(policy: &'a str, key: &'a str) -> PolicyCheckArgs<'a> {
    PolicyCheckArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// What one (policy, key) pair admitted, serially, as its client saw it.
struct Pair<'a> {
    p: &'a PolicySpec,
    key: &'static str,
    admitted: u32,
}

impl Pair<'_> {
    fn what(&self, leases: bool) -> String {
        format!("quota_leases {leases}, policy {}, key {}", self.p.name, self.key)
    }

    /// One single check: counted when it enforces and admits.
    async fn check(&mut self, c: &mut Client, leases: bool) -> Decision {
        let r = c.check_policy(&args(&self.p.name, self.key)).await.unwrap();
        let what = self.what(leases);
        match (self.p.shadow, self.p.limit_for(self.key)) {
            (false, None) => assert_eq!((r.decision, r.source), (Decision::Allowed, Source::Exempt), "{what}: {}", r.message),
            (true, None) => assert_eq!((r.decision, r.source), (Decision::ShadowAllowed, Source::Exempt), "{what}: {}", r.message),
            (true, Some(_)) => assert!(matches!(r.decision, Decision::ShadowAllowed | Decision::ShadowDenied), "{what}: a shadow policy never refuses: {:?} {}", r.decision, r.message),
            (false, Some(limit)) => {
                assert!(matches!(r.decision, Decision::Allowed | Decision::Denied), "{what}: {:?} {}", r.decision, r.message);
                self.admitted += u32::from(r.decision == Decision::Allowed);
                assert!(self.admitted <= limit, "{what}: {} admitted, limit {limit}", self.admitted);
            }
        }
        r.decision
    }
}

async fn run(leases: bool) {
    let redis = RedisServer::start_unix();
    let config = Config { policies: policies(), inline: vec![], inline_leases: vec![], denial_cache: true };
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 2000\nquota_leases = {leases}\n{}", redis.url(), config.policies_toml()));
    let mut c = d.client().await;
    let mut pairs: Vec<Pair<'_>> = config.policies.iter().filter(|p| p.name != "aux").flat_map(|p| KEYS.map(|key| Pair { p, key, admitted: 0 })).collect();
    let mut shared_pairs = 0;
    for pair in &mut pairs {
        let what = pair.what(leases);
        // Hot: enough single checks for the daemon to lease the key.
        for _ in 0..12 {
            pair.check(&mut c, leases).await;
        }
        // A worker's share, used at once (well within its validity).
        let sent = Instant::now();
        let s = c.lease_share(&PolicyCheckArgs { cost: 8, ..args(&pair.p.name, pair.key) }).await.unwrap();
        assert_eq!(s.decision, Decision::Allowed, "{what}: {}", s.message);
        let shareable = leases && pair.p.algorithm() == Some(Algorithm::Log) && !pair.p.shadow && pair.p.shards() == 1 && pair.p.limit_for(pair.key).is_some();
        assert_eq!(s.count > 0, shareable, "{what}: {} units shared", s.count);
        if s.count > 0 {
            assert!(Instant::now() < sent + Duration::from_millis(u64::from(s.retry_after_ms)), "{what}: the share outlived its use");
            pair.admitted += s.count;
            shared_pairs += 1;
            assert!(pair.admitted <= pair.p.limit_for(pair.key).unwrap(), "{what}: {} admitted with the share", pair.admitted);
        }
        // A refundable multi-item check, then its refund.
        let items = [ItemArgs { policy: pair.p.name.as_bytes(), key: pair.key.as_bytes(), cost: 1 }, ItemArgs { policy: b"aux", key: pair.key.as_bytes(), cost: 1 }];
        let m = c.check_multi(FailPolicy::Closed, 0, true, &items).await.unwrap();
        if pair.p.algorithm() != Some(Algorithm::Log) {
            assert_eq!((m.decision, m.error as u16), (Decision::Error, code::UNSUPPORTED_COMBINATION), "{what}: {}", m.message);
        } else if m.decision == Decision::Allowed {
            let handle = m.extension.as_deref().and_then(|e| e.handle).unwrap_or_else(|| panic!("{what}: a refundable admission has a handle"));
            let refund = c.refund(&handle, &items).await.unwrap();
            assert_eq!(refund.decision, Decision::Allowed, "{what}: {}", refund.message);
        } else {
            assert!(!pair.p.shadow && pair.p.limit_for(pair.key).is_some(), "{what}: only an enforced key refuses a multi-item check: {:?} {}", m.decision, m.message);
        }
        // Up to its limit (or a fixed number for the others).
        for _ in 0..2 * LIMIT {
            if pair.check(&mut c, leases).await == Decision::Denied {
                break;
            }
        }
    }
    assert_eq!(shared_pairs > 0, leases, "shares only with quota_leases");
    // Every lease settles within its life (1 s for these windows): then
    // each enforced key admits exactly the rest of its limit.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for pair in pairs.iter_mut().filter(|p| !p.p.shadow) {
        let Some(limit) = pair.p.limit_for(pair.key) else { continue };
        while pair.admitted < limit + 1 && pair.check(&mut c, leases).await == Decision::Allowed {}
        assert_eq!(pair.admitted, limit, "{}: after the settles exactly the limit is admitted", pair.what(leases));
    }
    eprintln!("quota_leases {leases}: {} pairs, {shared_pairs} with a worker share", pairs.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_combination_with_quota_leases_admits_exactly_the_limit_and_shares_only_where_sound() {
    run(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_combination_without_quota_leases_admits_exactly_the_limit_and_shares_nothing() {
    run(false).await;
}
