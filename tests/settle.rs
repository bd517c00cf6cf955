//! Reserve and settle (docs/PROTOCOL.md 4f) through the real daemon and a
//! real redis-server: the window moved by actual - estimate, debt refused
//! until repaid, forged and replayed handles changing nothing, a settle
//! after a daemon restart, costs up to 10^9, and a serial model audited
//! against Redis across estimate errors of -90 % to +300 %, for one policy
//! and for several in one reserve (all or nothing, one settle).

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, RedisServer};
use ratelimitd::protocol::{Decision, ErrorCode, FailPolicy, ItemArgs, Response, Source, HANDLE_LEN};

const POLICIES: &str = r#"
[limits]
max_limit = 2000000000

[[policy]]
name = "fixed_min"
algorithm = "fixed"
limit = 1000
window = "600s"

[[policy]]
name = "fixed_1s"
algorithm = "fixed"
limit = 100
window = "1s"

[[policy]]
name = "gcra_2s"
algorithm = "gcra"
limit = 1000
window = "2s"

[[policy]]
name = "counter"
algorithm = "sliding_counter"
limit = 1000
window = "600s"

[[policy]]
name = "month"
algorithm = "fixed"
limit = 1000000000
window = "month"

[[policy]]
name = "log"
limit = 10
window = "60s"

[[policy]]
name = "budget"
algorithm = "fixed"
limit = 1500
window = "3600s"

[[policy]]
name = "gcra_min"
algorithm = "gcra"
limit = 1000
window = "600s"

[[policy]]
name = "leases"
algorithm = "concurrency"
limit = 10
lease = "10s"
"#;

fn start(redis: &RedisServer) -> Daemon {
    Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 1000\n{POLICIES}", redis.url()))
}

fn item<'a>(policy: &'a str, key: &'a str, cost: u32) -> ItemArgs<'a> {
    ItemArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost }
}

fn handle(r: &Response) -> Option<[u8; HANDLE_LEN]> {
    r.extension.as_ref().and_then(|e| e.handle)
}

/// The one stored value of a policy's key (its window's key), as text.
fn stored(redis: &RedisServer, policy: &str, key: &str) -> Option<String> {
    let pattern = format!("ratelimitd:{{{}{policy}{key}}}:*", policy.len() as u8 as char);
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg(pattern.as_bytes()).query(&mut redis.conn()).unwrap();
    let windows: Vec<&Vec<u8>> = keys.iter().filter(|k| !k.windows(8).any(|w| w == b":settle:")).collect();
    assert!(windows.len() <= 1, "{keys:?}");
    windows.first().map(|k| redis::cmd("GET").arg(k.as_slice()).query::<String>(&mut redis.conn()).unwrap())
}

/// The count of a fixed window's stored "<start> <count>".
fn fixed_count(redis: &RedisServer, policy: &str, key: &str) -> u64 {
    stored(redis, policy, key).map_or(0, |s| s.split(' ').nth(1).unwrap().parse().unwrap())
}

fn settle_records(redis: &RedisServer) -> usize {
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("ratelimitd:*:settle:*").query(&mut redis.conn()).unwrap();
    keys.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_gives_back_the_surplus_and_a_replayed_or_forged_handle_changes_nothing() {
    let redis = RedisServer::start_unix();
    let d = start(&redis);
    let mut c = d.client().await;
    let r = c.reserve(FailPolicy::Closed, 0, &item("fixed_min", "t1", 300)).await.unwrap();
    assert_eq!((r.decision, r.source, r.count, r.remaining), (Decision::Allowed, Source::Redis, 300, 700), "{r:?}");
    let h = handle(&r).expect("an admitted reserve carries a handle");
    assert_eq!(settle_records(&redis), 1);
    assert_eq!(fixed_count(&redis, "fixed_min", "t1"), 300);

    let s = c.settle(&h, &item("fixed_min", "t1", 120)).await.unwrap();
    assert_eq!((s.decision, s.error, s.count, s.remaining), (Decision::Allowed, ErrorCode::None, 120, 880), "{s:?}");
    assert_eq!(fixed_count(&redis, "fixed_min", "t1"), 120);
    assert_eq!(settle_records(&redis), 0, "a settle deletes its record");

    // Replayed (the record is gone), forged, or another key's: count 0, nothing moves.
    let again = c.settle(&h, &item("fixed_min", "t1", 999)).await.unwrap();
    assert_eq!((again.decision, again.error, again.count), (Decision::Allowed, ErrorCode::None, 0), "{again:?}");
    let forged = c.settle(&[7; HANDLE_LEN], &item("fixed_min", "t1", 0)).await.unwrap();
    assert_eq!((forged.decision, forged.count), (Decision::Allowed, 0));
    let r2 = c.reserve(FailPolicy::Closed, 0, &item("fixed_min", "t2", 10)).await.unwrap();
    let other = c.settle(&handle(&r2).unwrap(), &item("fixed_min", "t1", 500)).await.unwrap();
    assert_eq!(other.count, 0, "t2's handle does not settle t1");
    assert_eq!(fixed_count(&redis, "fixed_min", "t1"), 120);
    assert_eq!(fixed_count(&redis, "fixed_min", "t2"), 10);

    // A refused reserve gets no handle; the log and shards are refused loudly.
    let big = c.reserve(FailPolicy::Closed, 0, &item("fixed_min", "t1", 881)).await.unwrap();
    assert_eq!((big.decision, handle(&big)), (Decision::Denied, None), "{big:?}");
    let log = c.reserve(FailPolicy::Closed, 0, &item("log", "t1", 1)).await.unwrap();
    assert_eq!((log.decision, log.error), (Decision::Error, ErrorCode::UnsupportedCombination), "{log:?}");
    let log = c.settle(&h, &item("log", "t1", 1)).await.unwrap();
    assert_eq!(log.error, ErrorCode::UnsupportedCombination);
}

/// A shortfall past the limit is debt on GCRA: every cost refused until
/// the bucket has drained back, and admitted from then on (checked when).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shortfall_past_the_limit_is_debt_refused_until_repaid() {
    let redis = RedisServer::start_unix();
    let d = start(&redis);
    let mut c = d.client().await;
    // 1000 per 2 s: one token every 2 ms.
    let r = c.reserve(FailPolicy::Closed, 0, &item("gcra_2s", "t", 100)).await.unwrap();
    let h = handle(&r).unwrap();
    let settled_at = Instant::now();
    let s = c.settle(&h, &item("gcra_2s", "t", 1500)).await.unwrap();
    assert_eq!(s.error, ErrorCode::None);
    assert!(s.count >= 1499 && s.remaining == 0, "{s:?}");
    // TAT = now + 3000 ms: a cost of 1 fits once TAT - now + 2 <= 2000, about 1 s on.
    let refused = c.reserve(FailPolicy::Closed, 0, &item("gcra_2s", "t", 1)).await.unwrap();
    assert_eq!(refused.decision, Decision::Denied);
    assert!((900..=1010).contains(&refused.retry_after_ms), "{refused:?}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(c.reserve(FailPolicy::Closed, 0, &item("gcra_2s", "t", 1)).await.unwrap().decision, Decision::Denied, "still in debt at 0.7 s");
    tokio::time::sleep(Duration::from_millis(1200).saturating_sub(settled_at.elapsed())).await;
    let ok = c.reserve(FailPolicy::Closed, 0, &item("gcra_2s", "t", 1)).await.unwrap();
    assert_eq!(ok.decision, Decision::Allowed, "repaid by 1.2 s: {ok:?}");

    // A surplus never fills the bucket past full.
    let r = c.reserve(FailPolicy::Closed, 0, &item("gcra_2s", "u", 10)).await.unwrap();
    let s = c.settle(&handle(&r).unwrap(), &item("gcra_2s", "u", 0)).await.unwrap();
    assert_eq!((s.count, s.remaining), (0, 1000), "{s:?}");
    assert_eq!(stored(&redis, "gcra_2s", "u"), None, "a full bucket keeps no key");
}

/// A fixed window's debt carries into the next windows: 250 settled on a
/// limit of 100 leaves 150 at the next window (every cost refused) and 50
/// at the one after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_windows_debt_is_paid_out_of_the_next_windows() {
    let redis = RedisServer::start_unix();
    let d = start(&redis);
    let mut c = d.client().await;
    // Start early in a second, so that reserve and settle share one window.
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    tokio::time::sleep(Duration::from_millis(1000 - ms % 1000 + 20)).await;
    let r = c.reserve(FailPolicy::Closed, 0, &item("fixed_1s", "t", 10)).await.unwrap();
    let s = c.settle(&handle(&r).unwrap(), &item("fixed_1s", "t", 250)).await.unwrap();
    assert_eq!((s.count, s.remaining), (250, 0), "{s:?}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let next = c.reserve(FailPolicy::Closed, 0, &item("fixed_1s", "t", 1)).await.unwrap();
    assert_eq!((next.decision, next.count), (Decision::Denied, 150), "{next:?}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(c.reserve(FailPolicy::Closed, 0, &item("fixed_1s", "t", 51)).await.unwrap().decision, Decision::Denied);
    let last = c.reserve(FailPolicy::Closed, 0, &item("fixed_1s", "t", 50)).await.unwrap();
    assert_eq!((last.decision, last.count), (Decision::Allowed, 100), "{last:?}");
}

/// A month of tokens: costs of 10^9 reserved and settled exactly, and a
/// settle after the daemon restarted (the record lives in Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costs_up_to_a_billion_settle_across_a_daemon_restart() {
    let redis = RedisServer::start_unix();
    let mut d = start(&redis);
    let mut c = d.client().await;
    let r = c.reserve(FailPolicy::Closed, 0, &item("month", "t", 1_000_000_000)).await.unwrap();
    assert_eq!((r.decision, r.count, r.remaining), (Decision::Allowed, 1_000_000_000, 0), "{r:?}");
    assert_eq!(c.reserve(FailPolicy::Closed, 0, &item("month", "t", 1)).await.unwrap().decision, Decision::Denied);
    let h = handle(&r).unwrap();
    drop(c);
    d.terminate();
    d.start_again();
    let mut c = d.client().await;
    let s = c.settle(&h, &item("month", "t", 400_000_000)).await.unwrap();
    assert_eq!((s.error, s.count, s.remaining), (ErrorCode::None, 400_000_000, 600_000_000), "{s:?}");
    assert_eq!(fixed_count(&redis, "month", "t"), 400_000_000);
    let over = c.reserve(FailPolicy::Closed, 0, &item("month", "t", 1_000_000_001)).await.unwrap();
    assert_eq!(over.error, ErrorCode::InvalidCost, "{over:?}");
}

/// The budget audited from Redis: random estimates, actual costs from -90 %
/// to +300 % of them, reserved and settled one after another against a
/// serial model of the window. Every decision is the model's, Redis holds
/// the model's count exactly (debt included), nothing is admitted once the
/// count reached the limit, and the units admitted over the limit are only
/// the last shortfalls (never a reserve's estimate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_holds_across_estimate_errors_from_minus_90_to_plus_300_percent() {
    let redis = RedisServer::start_unix();
    let d = start(&redis);
    let mut c = d.client().await;
    // xorshift64: the same sequence every run.
    let mut state = 25u64;
    let mut next = move |lo: u64, hi: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        lo + state % (hi - lo + 1)
    };
    for policy in ["fixed_min", "counter"] {
        for tenant in 0..4 {
            let key = format!("tenant-{tenant}");
            let limit = 1000u64;
            let mut count = 0u64;
            let (mut admitted, mut refused) = (0, 0);
            for _ in 0..60 {
                let estimate = next(10, 80) as u32;
                // -90 % to +300 %, in tenths.
                let actual = (u64::from(estimate) * next(1, 40)).div_ceil(10) as u32;
                let r = c.reserve(FailPolicy::Closed, 0, &item(policy, &key, estimate)).await.unwrap();
                let fits = count + u64::from(estimate) <= limit;
                assert_eq!(r.decision == Decision::Allowed, fits, "{policy} {key}: count {count}, estimate {estimate}: {r:?}");
                if !fits {
                    refused += 1;
                    continue;
                }
                admitted += 1;
                assert!(count + u64::from(estimate) <= limit, "admitted over the budget");
                let s = c.settle(&handle(&r).unwrap(), &item(policy, &key, actual)).await.unwrap();
                count += u64::from(actual);
                assert_eq!((s.error, u64::from(s.count)), (ErrorCode::None, count), "{policy} {key}: {s:?}");
            }
            assert!(admitted > 5 && refused > 5, "{policy} {key}: {admitted} admitted, {refused} refused");
            let in_redis: u64 = match policy {
                "fixed_min" => fixed_count(&redis, policy, &key),
                _ => stored(&redis, policy, &key).unwrap().split(' ').nth(1).unwrap().parse().unwrap(),
            };
            assert_eq!(in_redis, count, "{policy} {key}: Redis holds every settled unit, debt included");
        }
    }
    assert_eq!(settle_records(&redis), 0, "every reserve was settled");
}

/// The issue's main case: a tenant's tokens per minute AND per month in one
/// reserve. All or nothing: refused by either, nothing is held in the
/// other (its reserve cancelled, its record deleted, its numbers as they
/// stand without the request); admitted, one handle settles both, each to
/// the actual (debt on each), once, after a daemon restart too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_reserve_of_a_minute_and_a_month_is_all_or_nothing_and_one_settle_charges_both() {
    let redis = RedisServer::start_unix();
    let mut d = start(&redis);
    let mut c = d.client().await;
    let both = |key: &'static str, cost: u32| [item("gcra_min", key, cost), item("month", key, cost)];
    let r = c.reserve_items(FailPolicy::Closed, 0, &both("t", 600)).await.unwrap();
    assert_eq!((r.decision, r.count, r.remaining), (Decision::Allowed, 600, 400), "the tighter policy's numbers: {r:?}");
    let h = handle(&r).expect("one handle for both");
    assert_eq!(settle_records(&redis), 2, "a record per policy");
    assert_eq!(fixed_count(&redis, "month", "t"), 600);

    // 600 more: the minute refuses; the month keeps nothing of it.
    let refused = c.reserve_items(FailPolicy::Closed, 0, &both("t", 600)).await.unwrap();
    let ext = refused.extension.as_ref().unwrap();
    assert_eq!((refused.decision, ext.refused, handle(&refused)), (Decision::Denied, 1, None), "{refused:?}");
    assert_eq!((ext.items[1].decision, ext.items[1].count), (Decision::Allowed, 600), "the month as it stands without the request: {refused:?}");
    assert_eq!(fixed_count(&redis, "month", "t"), 600, "the month's reserve was cancelled");
    assert_eq!(settle_records(&redis), 2, "the cancelled reserve left no record");

    // A restart between reserve and settle; then 1100 actual: debt on the minute.
    drop(c);
    d.terminate();
    d.start_again();
    let mut c = d.client().await;
    let s = c.settle_items(&h, &both("t", 1100)).await.unwrap();
    assert_eq!((s.decision, s.error, s.remaining), (Decision::Allowed, ErrorCode::None, 0), "{s:?}");
    assert!(s.count >= 1099, "the minute in debt: {s:?}");
    assert_eq!(fixed_count(&redis, "month", "t"), 1100, "the month charged the actual");
    assert_eq!(settle_records(&redis), 0);
    let again = c.settle_items(&h, &both("t", 5000)).await.unwrap();
    assert_eq!((again.decision, again.count), (Decision::Allowed, 0), "settled once: {again:?}");
    assert_eq!(fixed_count(&redis, "month", "t"), 1100);
    let debt = c.reserve_items(FailPolicy::Closed, 0, &both("t", 1)).await.unwrap();
    assert_eq!(debt.decision, Decision::Denied, "the minute's debt refuses every cost: {debt:?}");
    assert_eq!(fixed_count(&redis, "month", "t"), 1100, "and the month keeps nothing of the refusal");

    // What cannot compose is refused loudly, the whole request.
    let log = c.reserve_items(FailPolicy::Closed, 0, &[item("month", "u", 1), item("log", "u", 1)]).await.unwrap();
    assert_eq!((log.decision, log.error), (Decision::Error, ErrorCode::UnsupportedCombination), "{log:?}");
    let lease = c.reserve_items(FailPolicy::Closed, 0, &[item("month", "u", 1), item("leases", "u", 1)]).await.unwrap();
    assert_eq!((lease.decision, lease.error), (Decision::Error, ErrorCode::WrongPolicyKind), "{lease:?}");
    assert_eq!(fixed_count(&redis, "month", "u"), 0, "refused before any store");
}

/// The audit of several policies per reserve: each tenant's minute (1000)
/// and its organisation's budget (1500, shared by two tenants) reserved in
/// one request, actual costs -90 % to +300 % of the estimates, against a
/// serial model: every decision is the model's (admitted iff both fit),
/// Redis holds the model's counts exactly, and no reserve was admitted
/// past either limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_of_two_policies_per_reserve_holds_across_estimate_errors() {
    let redis = RedisServer::start_unix();
    let d = start(&redis);
    let mut c = d.client().await;
    let mut state = 2525u64;
    let mut next = move |lo: u64, hi: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        lo + state % (hi - lo + 1)
    };
    let mut minute = std::collections::HashMap::<String, u64>::new();
    let mut budget = std::collections::HashMap::<String, u64>::new();
    let (mut admitted, mut by_minute, mut by_budget) = (0, 0, 0);
    for _ in 0..240 {
        let tenant = next(0, 3);
        let (key, org) = (format!("tenant-{tenant}"), format!("org-{}", tenant / 2));
        let estimate = next(10, 80) as u32;
        let actual = (u64::from(estimate) * next(1, 40)).div_ceil(10) as u32;
        let (m, b) = (*minute.get(&key).unwrap_or(&0), *budget.get(&org).unwrap_or(&0));
        let r = c.reserve_items(FailPolicy::Closed, 0, &[item("fixed_min", &key, estimate), item("budget", &org, estimate)]).await.unwrap();
        let (fits_m, fits_b) = (m + u64::from(estimate) <= 1000, b + u64::from(estimate) <= 1500);
        assert_eq!(r.decision == Decision::Allowed, fits_m && fits_b, "{key} {m}/1000, {org} {b}/1500, estimate {estimate}: {r:?}");
        if !(fits_m && fits_b) {
            by_minute += usize::from(!fits_m);
            by_budget += usize::from(fits_m && !fits_b);
            assert_eq!(handle(&r), None);
            continue;
        }
        admitted += 1;
        let s = c.settle_items(&handle(&r).unwrap(), &[item("fixed_min", &key, actual), item("budget", &org, actual)]).await.unwrap();
        assert_eq!(s.error, ErrorCode::None, "{s:?}");
        *minute.entry(key.clone()).or_default() += u64::from(actual);
        *budget.entry(org.clone()).or_default() += u64::from(actual);
    }
    let over: Vec<u64> = minute.values().map(|&m| m.saturating_sub(1000)).chain(budget.values().map(|&b| b.saturating_sub(1500))).collect();
    eprintln!("audit, two policies per reserve: {admitted} admitted, {by_minute} refused by a minute, {by_budget} by a budget alone; units owed past a limit (debt, the last shortfall): {over:?}");
    assert!(over.iter().all(|&o| o <= 3 * 80), "past a limit by at most one shortfall (3 x the largest estimate): {over:?}");
    assert!(admitted > 20 && by_minute > 3 && by_budget > 3, "{admitted} admitted, {by_minute} refused by a minute, {by_budget} by a budget alone");
    for (key, want) in &minute {
        assert_eq!(fixed_count(&redis, "fixed_min", key), *want, "{key}: Redis holds every settled unit");
    }
    for (org, want) in &budget {
        assert_eq!(fixed_count(&redis, "budget", org), *want, "{org}: nothing of a refused reserve stayed");
    }
    assert_eq!(settle_records(&redis), 0, "every reserve was settled or cancelled");
}

/// check-config --nginx refuses loudly, before any request, a settle = true
/// limiter naming a policy a reserve cannot take (the same rule the daemon
/// applies: UNSUPPORTED_COMBINATION), and passes the llm-proxy example.
#[test]
fn check_config_refuses_a_settle_limiter_naming_a_log_or_sharded_policy() {
    let root = env!("CARGO_MANIFEST_DIR");
    let run = |toml: &str, conf: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(["check-config", "--config", toml, "--nginx", conf]).output().unwrap();
        (out.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    };
    let (toml, conf) = (format!("{root}/examples/llm-proxy/ratelimitd.toml"), format!("{root}/examples/llm-proxy/nginx.conf"));
    let (code, out) = run(&toml, &conf);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("all 2 policy names used by") && !out.contains("settle = true limiter"), "{out}");

    // The month made a log, the minute sharded: both refused, with the line.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("ratelimitd.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    let text = text.replacen("name = \"tokens_month\"\nalgorithm = \"fixed\"", "name = \"tokens_month\"\nalgorithm = \"log\"", 1).replacen("name = \"tokens_minute\"\nalgorithm = \"fixed\"", "name = \"tokens_minute\"\nalgorithm = \"gcra\"\nshards = 2", 1);
    std::fs::write(&bad, text.replace("limit = 100000\nwindow = \"month\"", "limit = 1000\nwindow = \"24h\"")).unwrap();
    let (code, out) = run(bad.to_str().unwrap(), &conf);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("policy \"tokens_month\" in a settle = true limiter: every request refused with UNSUPPORTED_COMBINATION: the log keeps one Redis member per unit"), "{out}");
    assert!(out.contains("policy \"tokens_minute\" in a settle = true limiter: every request refused with UNSUPPORTED_COMBINATION: a sharded key"), "{out}");
    assert!(out.contains("0 of 2 policy names used by") && out.contains("2 cannot be reserved"), "{out}");
}
