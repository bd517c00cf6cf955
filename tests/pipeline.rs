//! The daemon's one decision pipeline (issue 22, daemon side), through the
//! real daemon with the in-memory backend and with a real redis-server:
//! sharded policies in every kind of check (SEMANTICS S1), shard keys no
//! client key reaches (S2), lease renewal (S4), a shadow concurrency
//! refusal counted once (S5), UNSUPPORTED_COMBINATION (S7), and the
//! decisions metric equal to the decisions made (S9).

mod common;

use std::time::Duration;

use common::redis_cluster::RedisCluster;
use common::{Daemon, RedisServer};
use ratelimitd::client::Client;
use ratelimitd::protocol::{CheckArgs, Decision, ErrorCode, FailPolicy, ItemArgs, LeaseArgs, PolicyCheckArgs, PolicyLeaseArgs, Response, Source, OP_ACQUIRE, OP_RELEASE};

const POLICIES: &str = r#"
[[policy]]
name = "hot"
limit = 6
window = "60s"
shards = 3

[[policy]]
name = "tri"
limit = 3
window = "60s"
shards = 3

[[policy]]
name = "quad"
limit = 4
window = "60s"
shards = 4

[[policy]]
name = "shade"
limit = 4
window = "60s"
shards = 4
shadow = true

[[policy]]
name = "ip"
limit = 100
window = "60s"

[[policy]]
name = "paced"
limit = 5
window = "1s"
algorithm = "gcra"

[[policy]]
name = "slots"
limit = 1
algorithm = "concurrency"
lease = "30s"
shadow = true

[[policy]]
name = "free"
limit = 1
window = "60s"
[policy.overrides]
"vip" = "unlimited"
"#;

/// Where the daemon decides.
#[derive(Clone, Copy, Debug)]
enum Store {
    Memory,
    Redis,
    /// A real Redis Cluster: a sharded key's shards in different slots.
    Cluster,
}

/// A daemon serving `POLICIES` and metrics, and the Redis it uses (kept
/// alive with it).
struct Setup {
    daemon: Daemon,
    _redis: Option<RedisServer>,
    _cluster: Option<RedisCluster>,
}

/// One test per store of one async body (`body(Store::X)`), each named:
/// `store_tests! { body: name_in_memory => Memory, name_on_redis => Redis }`.
macro_rules! store_tests {
    ($body:ident: $($name:ident => $store:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $body(Store::$store).await;
            }
        )+
    };
}

fn setup(store: Store) -> Setup {
    match store {
        Store::Memory => Setup { daemon: Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n{POLICIES}")), _redis: None, _cluster: None },
        Store::Redis => {
            let redis = RedisServer::start_unix();
            let daemon = Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 1000\n{POLICIES}", redis.url()));
            Setup { daemon, _redis: Some(redis), _cluster: None }
        }
        Store::Cluster => {
            let cluster = RedisCluster::start();
            let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
            let daemon = Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 1000\n{POLICIES}", seeds.join(", ")));
            Setup { daemon, _redis: None, _cluster: Some(cluster) }
        }
    }
}

fn policy<'a>(name: &'a str, key: &'a str) -> PolicyCheckArgs<'a> {
    PolicyCheckArgs { policy: name.as_bytes(), key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

fn item<'a>(name: &'a str, key: &'a str) -> ItemArgs<'a> {
    ItemArgs { policy: name.as_bytes(), key: key.as_bytes(), cost: 1 }
}

fn metrics(d: &Daemon) -> String {
    let agent = common::http::agent();
    agent.get(&d.metrics_url()).call().unwrap().body_mut().read_to_string().unwrap()
}

/// The sum of every sample of the metric `name` (all label sets).
fn total(text: &str, name: &str) -> u64 {
    text.lines().filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} "))).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum()
}

fn sample(text: &str, line_start: &str) -> u64 {
    let line = text.lines().find(|l| l.starts_with(line_start)).unwrap_or_else(|| panic!("no {line_start} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

fn policy_sample(text: &str, policy: &str, outcome: &str) -> u64 {
    sample(text, &format!("ratelimitd_policy_requests_total{{policy=\"{policy}\",outcome=\"{outcome}\"}} "))
}

fn admitted(r: &Response) -> bool {
    assert_eq!(r.error, ErrorCode::None, "{r:?}");
    r.decision == Decision::Allowed
}

/// Defect 2 (S1): limit 6 over 3 shards admits exactly 6 per window
/// across single, multi-item and refundable checks together.
async fn sharded_limit_holds_across_kinds(store: Store) {
    let s = setup(store);
    let mut c = s.daemon.client().await;
    let mut got = 0;
    for _ in 0..6 {
        got += u32::from(admitted(&c.check_policy(&policy("hot", "k1")).await.unwrap()));
    }
    assert_eq!(got, 6, "{store:?}: six single checks fill the key");
    for _ in 0..6 {
        let r = c.check_multi(FailPolicy::Closed, 0, true, &[item("hot", "k1")]).await.unwrap();
        assert!(!admitted(&r), "{store:?}: a refundable check of a full sharded key is refused: {r:?}");
    }
    for _ in 0..6 {
        let r = c.check_multi(FailPolicy::Closed, 0, false, &[item("hot", "k1"), item("ip", "x")]).await.unwrap();
        assert!(!admitted(&r), "{store:?}: a multi-item check of a full sharded key is refused: {r:?}");
    }
    // The other order: multi-item checks first, then single ones.
    let mut got = 0;
    for _ in 0..6 {
        got += u32::from(admitted(&c.check_multi(FailPolicy::Closed, 0, false, &[item("hot", "k2"), item("ip", "y")]).await.unwrap()));
    }
    assert_eq!(got, 6, "{store:?}: six multi-item checks fill the key (the daemon tries the other shards)");
    for _ in 0..6 {
        let r = c.check_policy(&policy("hot", "k2")).await.unwrap();
        assert!(!admitted(&r), "{store:?}: a single check after six multi-item admissions is refused: {r:?}");
    }
    // Cost above the largest shard's part (2): INVALID_COST in every kind.
    let big = ItemArgs { cost: 5, ..item("hot", "k3") };
    let r = c.check_multi(FailPolicy::Closed, 0, false, &[big, item("ip", "z")]).await.unwrap();
    assert_eq!(r.error, ErrorCode::InvalidCost, "{store:?}: {r:?}");
    let r = c.check_multi(FailPolicy::Closed, 0, true, &[big]).await.unwrap();
    assert_eq!(r.error, ErrorCode::InvalidCost, "{store:?}: {r:?}");
    let r = c.check_policy(&PolicyCheckArgs { cost: 5, ..policy("hot", "k3") }).await.unwrap();
    assert_eq!(r.error, ErrorCode::InvalidCost, "{store:?}: {r:?}");
}

store_tests! { sharded_limit_holds_across_kinds:
    a_sharded_policy_admits_its_limit_across_single_multi_item_and_refundable_checks_in_memory => Memory,
    a_sharded_policy_admits_its_limit_across_single_multi_item_and_refundable_checks_on_redis => Redis,
}

/// S1: a multi-item check a shard refused is tried again on the item's
/// next shard. The round robin is the policy's, not the key's: two keys
/// taking turns over 4 shards of one unit each send each key to the same
/// two shards, so each key's third request finds its shard full and must
/// move on. Shadow items are placed wherever they fit, as a single check
/// places them.
async fn refused_shards_are_tried_again(store: Store) {
    let s = setup(store);
    let mut c = s.daemon.client().await;
    for name in ["quad", "shade"] {
        for n in 0..8 {
            let key = ["k1", "k2"][n % 2];
            let r = c.check_multi(FailPolicy::Closed, 0, false, &[item(name, key), item("ip", key)]).await.unwrap();
            assert!(admitted(&r), "{store:?}: {name} {key} request {n}: {r:?}");
            let items = &r.extension.as_ref().unwrap().items;
            let fitted = if name == "quad" { Decision::Allowed } else { Decision::ShadowAllowed };
            assert_eq!(items[0].decision, fitted, "{store:?}: {name} {key} request {n}: every unit found a shard: {r:?}");
            assert_eq!(items[0].count + items[0].remaining, 4, "{store:?}: the key's limit in count + remaining: {r:?}");
        }
        for key in ["k1", "k2"] {
            let r = c.check_policy(&policy(name, key)).await.unwrap();
            let refused = if name == "quad" { Decision::Denied } else { Decision::ShadowDenied };
            assert_eq!((r.decision, r.count, r.remaining), (refused, 4, 0), "{store:?}: {name} {key} holds exactly its limit: {r:?}");
        }
    }
}

store_tests! { refused_shards_are_tried_again:
    a_multi_item_check_refused_by_one_shard_is_tried_on_the_next_in_memory => Memory,
    a_multi_item_check_refused_by_one_shard_is_tried_on_the_next_on_redis => Redis,
}

/// The same on a Redis Cluster, where a sharded key's shards sit in
/// different slots: a multi-item check is one call per slot group, and a
/// refused group's reservations are taken back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_policy_admits_its_limit_across_kinds_and_retries_shards_on_a_cluster() {
    sharded_limit_holds_across_kinds(Store::Cluster).await;
    refused_shards_are_tried_again(Store::Cluster).await;
}

/// Defect 2, refunds (S1): a refund of a sharded item frees the one unit
/// it took, whichever shard took it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_of_a_sharded_item_frees_the_unit_it_took() {
    let s = setup(Store::Redis);
    let mut c = s.daemon.client().await;
    let mut handles = Vec::new();
    for _ in 0..6 {
        let r = c.check_multi(FailPolicy::Closed, 0, true, &[item("hot", "r1")]).await.unwrap();
        assert!(admitted(&r), "{r:?}");
        handles.push(r.extension.as_ref().and_then(|e| e.handle).expect("a refundable admission has a handle"));
    }
    assert!(!admitted(&c.check_policy(&policy("hot", "r1")).await.unwrap()), "full after six");
    let r = c.refund(&handles[2], &[item("hot", "r1")]).await.unwrap();
    assert_eq!((r.error, r.count), (ErrorCode::None, 1), "{r:?}");
    let mut again = 0;
    for _ in 0..3 {
        again += u32::from(admitted(&c.check_policy(&policy("hot", "r1")).await.unwrap()));
    }
    assert_eq!(again, 1, "the refund freed exactly one unit");
}

/// Defect 2, the collision (S2): a client key that looks like a shard
/// ("a#<n>") never touches the shards of key "a".
async fn shard_lookalike_keys_stay_apart(store: Store) {
    let s = setup(store);
    let mut c = s.daemon.client().await;
    // "tri": limit 3 over 3 shards, one unit each. One admission under
    // every key "a#0".."a#63" (a shard's number is the smallest n >= i
    // whose key hashes into shard i's slot range, so it is among these).
    for n in 0..64 {
        let key = format!("a#{n}");
        let r = c.check_multi(FailPolicy::Closed, 0, true, &[item("tri", &key)]).await.unwrap();
        assert!(admitted(&r), "{store:?}: {key}: {r:?}");
    }
    let mut got = 0;
    for _ in 0..3 {
        got += u32::from(admitted(&c.check_policy(&policy("tri", "a")).await.unwrap()));
    }
    assert_eq!(got, 3, "{store:?}: key \"a\" has its whole limit: no other key was counted in its shards");
}

store_tests! { shard_lookalike_keys_stay_apart:
    a_client_key_never_reaches_another_keys_shard_in_memory => Memory,
    a_client_key_never_reaches_another_keys_shard_on_redis => Redis,
}

fn lease<'a>(id: &'a str, limit: u32) -> LeaseArgs<'a> {
    LeaseArgs { key: b"conn", lease: id.as_bytes(), limit, lease_ms: 30_000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// Defect 11 (S4): acquiring a lease id the key holds renews it.
async fn reacquire_renews(store: Store) {
    let s = setup(store);
    let mut c = s.daemon.client().await;
    for n in 0..4 {
        let r = c.lease(OP_ACQUIRE, &lease("L1", 3)).await.unwrap();
        assert_eq!((r.decision, r.count, r.remaining), (Decision::Allowed, 1, 2), "{store:?}: acquire {n} of one id holds one slot: {r:?}");
    }
    let r = c.lease(OP_ACQUIRE, &lease("L2", 3)).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 2), "{store:?}: {r:?}");
    // A renewal with a higher cost: allowed iff the others' slots + cost fit.
    let r = c.lease(OP_ACQUIRE, &LeaseArgs { cost: 2, ..lease("L1", 3) }).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 3), "{store:?}: L1 now holds 2: {r:?}");
    let r = c.lease(OP_ACQUIRE, &LeaseArgs { cost: 3, ..lease("L1", 3) }).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Denied, 3), "{store:?}: L2's slot + 3 > 3; the old lease stays: {r:?}");
    let r = c.lease(OP_RELEASE, &lease("L1", 3)).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 1), "{store:?}: releasing L1 frees its 2 slots: {r:?}");
    // Limit 1: a second acquire of the id held is a renewal, allowed.
    let one = |id| LeaseArgs { key: b"single", ..lease(id, 1) };
    assert_eq!(c.lease(OP_ACQUIRE, &one("A")).await.unwrap().decision, Decision::Allowed);
    let r = c.lease(OP_ACQUIRE, &one("A")).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 1), "{store:?}: {r:?}");
    assert_eq!(c.lease(OP_ACQUIRE, &one("B")).await.unwrap().decision, Decision::Denied, "{store:?}");
}

store_tests! { reacquire_renews:
    acquiring_a_lease_id_already_held_renews_it_in_memory => Memory,
    acquiring_a_lease_id_already_held_renews_it_on_redis => Redis,
}

/// S4 in the `local` fallback: with Redis gone, ACQUIREs of one lease id
/// held in the daemon's per-host leases renew it there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquiring_a_lease_id_already_held_renews_it_in_the_local_fallback() {
    let mut redis = RedisServer::start_unix();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 200\n", redis.url()));
    let mut c = d.client().await;
    redis.kill();
    let local = |id| LeaseArgs { on_error: FailPolicy::Local, local_limit: 2, ..lease(id, 5) };
    for n in 0..3 {
        let r = c.lease(OP_ACQUIRE, &local("L1")).await.unwrap();
        assert_eq!((r.decision, r.source, r.count), (Decision::Allowed, Source::LocalFallback, 1), "acquire {n} of one id: {r:?}");
    }
    let r = c.lease(OP_ACQUIRE, &local("L2")).await.unwrap();
    assert_eq!((r.decision, r.source, r.count), (Decision::Allowed, Source::LocalFallback, 2), "{r:?}");
    let r = c.lease(OP_ACQUIRE, &local("L3")).await.unwrap();
    assert_eq!((r.decision, r.source, r.count), (Decision::Denied, Source::LocalFallback, 2), "the local quota of 2 holds: {r:?}");
}

/// Defect 9 (S5): a shadow concurrency refusal is counted once, in the
/// policy's counters and in the decisions metric.
async fn shadow_lease_refusal_counted_once(store: Store) {
    let s = setup(store);
    let mut c = s.daemon.client().await;
    let acquire = |id: &'static str| PolicyLeaseArgs { check: PolicyCheckArgs { policy: b"slots", key: b"k", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }, lease: id.as_bytes() };
    assert_eq!(c.policy_lease(false, &acquire("one")).await.unwrap().decision, Decision::ShadowAllowed);
    let r = c.policy_lease(false, &acquire("two")).await.unwrap();
    assert_eq!(r.decision, Decision::ShadowDenied, "{store:?}: {r:?}");
    // The client admitted the request, so it releases the lease it never
    // got: a release of a lease not held, not a second shadow refusal.
    let r = c.policy_lease(true, &acquire("two")).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Denied, 1), "{store:?}: nothing held under \"two\": {r:?}");
    let text = metrics(&s.daemon);
    assert_eq!(policy_sample(&text, "slots", "shadow_refused"), 1, "{store:?}\n{text}");
    assert_eq!(policy_sample(&text, "slots", "admitted"), 1, "{store:?}\n{text}");
    assert_eq!(policy_sample(&text, "slots", "refused"), 1, "{store:?}: the release of a lease not held\n{text}");
    let shadow = total(&text.lines().filter(|l| l.contains("decision=\"shadow_denied\"")).collect::<Vec<_>>().join("\n"), "ratelimitd_decisions_total");
    assert_eq!(shadow, 1, "{store:?}\n{text}");
    assert_eq!(total(&text, "ratelimitd_decisions_total"), 3, "{store:?}: three requests, three decisions\n{text}");
}

store_tests! { shadow_lease_refusal_counted_once:
    a_shadow_concurrency_refusal_is_counted_once_in_memory => Memory,
    a_shadow_concurrency_refusal_is_counted_once_on_redis => Redis,
}

/// S7: a policy of another algorithm than log in a multi-item or
/// refundable check is UNSUPPORTED_COMBINATION (19), a decision error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gcra_policy_in_a_multi_item_or_refundable_check_is_an_unsupported_combination() {
    let s = setup(Store::Redis);
    let mut c = s.daemon.client().await;
    for (refundable, items) in [(false, &[item("ip", "a"), item("paced", "a")][..]), (true, &[item("paced", "a")][..])] {
        let r = c.check_multi(FailPolicy::Open, 0, refundable, items).await.unwrap();
        assert_eq!((r.decision, r.error as u16), (Decision::Error, 19), "{r:?}");
        assert!(r.message.contains("paced"), "{}", r.message);
    }
    let r = c.refund(&[0; 16], &[item("paced", "a")]).await.unwrap();
    assert_eq!((r.decision, r.error as u16), (Decision::Error, 19), "{r:?}");
    // A single check of it is fine.
    assert!(admitted(&c.check_policy(&policy("paced", "a")).await.unwrap()));
}

/// What one request of the mixed sequence was.
struct Tally {
    /// Responses that are decisions (everything but a refund carried out).
    decisions: u64,
    /// REFUNDs carried out in Redis.
    refunds: u64,
}

async fn send_every_op(c: &mut Client, store: Store) -> Tally {
    let mut t = Tally { decisions: 0, refunds: 0 };
    let inline = CheckArgs { key: b"inline", limit: 2, window_ms: 60_000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
    for _ in 0..3 {
        c.check(&inline).await.unwrap();
        t.decisions += 1;
    }
    for key in ["a", "b", "a"] {
        c.check_policy(&policy("hot", key)).await.unwrap();
        c.check_policy(&policy("free", key)).await.unwrap();
        t.decisions += 2;
    }
    // Exempt, unknown policy, wrong kind, a cost above the limit.
    for args in [policy("free", "vip"), policy("nope", "a"), policy("slots", "a"), PolicyCheckArgs { cost: 9, ..policy("free", "a") }] {
        c.check_policy(&args).await.unwrap();
        t.decisions += 1;
    }
    for _ in 0..3 {
        c.check_multi(FailPolicy::Closed, 0, false, &[item("hot", "m"), item("free", "m"), item("ip", "m")]).await.unwrap();
        t.decisions += 1;
    }
    c.check_multi(FailPolicy::Closed, 0, false, &[item("ip", "m"), item("paced", "m")]).await.unwrap();
    t.decisions += 1;
    let r = c.check_multi(FailPolicy::Closed, 0, true, &[item("ip", "r"), item("hot", "r")]).await.unwrap();
    t.decisions += 1;
    let handle = r.extension.as_ref().and_then(|e| e.handle).unwrap_or([7; 16]);
    let r = c.refund(&handle, &[item("ip", "r"), item("hot", "r")]).await.unwrap();
    match store {
        // The memory backend answers REFUND_UNSUPPORTED: an error, counted as one.
        Store::Memory => t.decisions += 1,
        Store::Redis | Store::Cluster => {
            assert_eq!(r.error, ErrorCode::None, "{r:?}");
            t.refunds += 1;
        }
    }
    c.refund(&handle, &[item("nope", "r")]).await.unwrap();
    t.decisions += 1;
    for op in [OP_ACQUIRE, OP_ACQUIRE, OP_RELEASE, OP_RELEASE] {
        c.lease(op, &lease("x", 1)).await.unwrap();
        t.decisions += 1;
    }
    let pl = PolicyLeaseArgs { check: PolicyCheckArgs { policy: b"slots", key: b"k", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }, lease: b"p1" };
    for (release, id) in [(false, b"p1"), (false, b"p2"), (true, b"p1"), (true, b"p2")] {
        c.policy_lease(release, &PolicyLeaseArgs { lease: id, ..pl.clone() }).await.unwrap();
        t.decisions += 1;
    }
    c.policy_lease(false, &PolicyLeaseArgs { check: PolicyCheckArgs { policy: b"hot", ..pl.check }, ..pl }).await.unwrap();
    t.decisions += 1;
    // Invalid requests: refused at decoding, decisions of source none.
    c.check(&CheckArgs { limit: 0, ..inline }).await.unwrap();
    t.decisions += 1;
    c.check_policy(&PolicyCheckArgs { cost: 0, ..policy("ip", "a") }).await.unwrap();
    t.decisions += 1;
    t
}

/// S9: the decisions metric totals equal the decisions made, and each
/// policy request is counted once in its policy's counters.
async fn metrics_equal_decisions(store: Store) {
    let s = setup(store);
    let mut c = s.daemon.client().await;
    let t = send_every_op(&mut c, store).await;
    let text = metrics(&s.daemon);
    assert_eq!(total(&text, "ratelimitd_decisions_total"), t.decisions, "{store:?}\n{text}");
    assert_eq!(total(&text, "ratelimitd_refunds_total"), t.refunds, "{store:?}\n{text}");
    let per_policy = |p: &str| text.lines().filter(|l| l.starts_with(&format!("ratelimitd_policy_requests_total{{policy=\"{p}\""))).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum::<u64>();
    // An item that had room in a multi-item check another item refused is
    // charged nothing and counted nowhere. hot: 3 single + 1 multi (the
    // first; "free" refuses the others) + 1 refundable + 1 wrong kind;
    // free: 3 + exempt + cost error + 3 multi; slots: wrong kind + 4 lease
    // ops; paced: the refused combination.
    assert_eq!(per_policy("hot"), 6, "{store:?}\n{text}");
    assert_eq!(per_policy("free"), 8, "{store:?}\n{text}");
    assert_eq!(per_policy("slots"), 5, "{store:?}\n{text}");
    assert_eq!(per_policy("paced"), 1, "{store:?}\n{text}");
}

store_tests! { metrics_equal_decisions:
    the_decisions_metric_equals_the_decisions_made_in_memory => Memory,
    the_decisions_metric_equals_the_decisions_made_on_redis => Redis,
}

/// S1, S3, S6: a sharded shadow item whose first shard had no room in a
/// refundable admission is recorded on a shard where it fits, and that
/// unit belongs to the admission: its refund frees it with the others.
/// The round robin is stepped 0..4 times before each refundable check
/// (a check of another key), so the check starts on a full shard in at
/// least three of the four rounds, whatever the round robin's start.
async fn refund_frees_a_placed_shadow_unit(store: Store) {
    let s = setup(store);
    let mut c = s.daemon.client().await;
    for steps in 0..4 {
        // "shade": limit 4 over 4 shards, one unit each; three units taken.
        let key = format!("s{steps}");
        for n in 0..3 {
            let r = c.check_policy(&policy("shade", &key)).await.unwrap();
            assert_eq!(r.decision, Decision::ShadowAllowed, "{store:?}: {key} unit {n}: {r:?}");
        }
        for _ in 0..steps {
            c.check_policy(&policy("shade", "elsewhere")).await.unwrap();
        }
        let items = [item("ip", &key), item("shade", &key)];
        let r = c.check_multi(FailPolicy::Closed, 0, true, &items).await.unwrap();
        assert!(admitted(&r), "{store:?}: {key}: {r:?}");
        assert_eq!(r.extension.as_ref().unwrap().items[1].decision, Decision::ShadowAllowed, "{store:?}: {key}: the shadow unit found the free shard: {r:?}");
        let handle = r.extension.as_ref().and_then(|e| e.handle).expect("a refundable admission has a handle");
        let r = c.refund(&handle, &items).await.unwrap();
        assert_eq!((r.error, r.count), (ErrorCode::None, 2), "{store:?}: {key}: the refund frees the ip unit and the shadow unit: {r:?}");
        let r = c.check_policy(&policy("shade", &key)).await.unwrap();
        assert_eq!((r.decision, r.count, r.remaining), (Decision::ShadowAllowed, 4, 0), "{store:?}: {key}: the refunded shard has room again: {r:?}");
    }
}

store_tests! { refund_frees_a_placed_shadow_unit:
    a_refund_frees_the_shadow_unit_its_admission_placed_on_another_shard_on_redis => Redis,
    a_refund_frees_the_shadow_unit_its_admission_placed_on_another_shard_on_a_cluster => Cluster,
}

/// S1, S8: a refused multi-item check reports a sharded item that has a
/// shard it never tried as not evaluated (or admitted), never as refused:
/// its key has room. "quad" (4 shards of one unit) holds three units on
/// the three shards its next check starts on, so its item is refused by
/// those three while "tri/full" (3 shards, all full) runs out of shards:
/// the request ends with "quad"'s item moved to its free shard, untried.
async fn untried_shard_is_not_a_refusal(store: Store) {
    let s = setup(store);
    let mut c = s.daemon.client().await;
    for n in 0..3 {
        assert!(admitted(&c.check_policy(&policy("tri", "full")).await.unwrap()), "{store:?}: tri unit {n}");
        assert!(admitted(&c.check_policy(&policy("quad", "b")).await.unwrap()), "{store:?}: quad unit {n}");
    }
    // One more step of quad's round robin: its next check starts on a full shard of "b".
    assert!(admitted(&c.check_policy(&policy("quad", "step")).await.unwrap()));
    let r = c.check_multi(FailPolicy::Closed, 0, false, &[item("tri", "full"), item("quad", "b")]).await.unwrap();
    assert!(!admitted(&r), "{store:?}: tri/full has no room: {r:?}");
    let ext = r.extension.as_ref().unwrap();
    assert_eq!(ext.refused, 1, "{store:?}: {r:?}");
    let b = &ext.items[1];
    assert!(b.decision == Decision::Allowed || (b.decision == Decision::Denied && b.source == Source::None), "{store:?}: quad/b has a free shard it did not try: not evaluated, not refused: {b:?}");
    assert_eq!(r.retry_after_ms, ext.items[0].retry_after_ms, "{store:?}: only tri/full's refusal counts for Retry-After: {r:?}");
    let r = c.check_policy(&policy("quad", "b")).await.unwrap();
    assert_eq!((r.decision, r.count, r.remaining), (Decision::Allowed, 4, 0), "{store:?}: quad/b had room: {r:?}");
}

store_tests! { untried_shard_is_not_a_refusal:
    a_refused_multi_item_check_never_reports_a_sharded_item_with_an_untried_shard_as_refused_in_memory => Memory,
    a_refused_multi_item_check_never_reports_a_sharded_item_with_an_untried_shard_as_refused_on_redis => Redis,
}

/// Quota leases and cold-key batching in the pipeline (issue 23): a hot
/// single-check key leases (one Redis call for many admissions), a
/// sharded key leases per shard, and single, multi-item and refundable
/// checks and refunds of the same keys together never admit more than the
/// limit; once the leases are settled they admit exactly the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_keys_admit_their_limit_across_single_multi_item_refundable_checks_and_refunds() {
    let redis = RedisServer::start_unix();
    let config = format!(
        "socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 1000\nquota_leases = true\nbatch_cold_keys = true\n\
         [[policy]]\nname = \"wide\"\nlimit = 60\nwindow = \"60s\"\n\
         [[policy]]\nname = \"split\"\nlimit = 60\nwindow = \"60s\"\nshards = 2\n\
         [[policy]]\nname = \"ip\"\nlimit = 1000\nwindow = \"60s\"\n",
        redis.url()
    );
    let d = Daemon::start_config(&config);
    let mut c = d.client().await;
    for name in ["wide", "split"] {
        let evalsha = || {
            let info: String = redis::cmd("INFO").arg("commandstats").query(&mut redis.conn()).unwrap();
            info.lines().find_map(|l| l.strip_prefix("cmdstat_evalsha:calls=")).map_or(0, |rest| rest.split(',').next().unwrap().parse::<u64>().unwrap())
        };
        let calls_before = evalsha();
        let mut got = 0;
        for _ in 0..30 {
            got += u32::from(admitted(&c.check_policy(&policy(name, "k")).await.unwrap()));
        }
        assert_eq!(got, 30, "{name}: room for all");
        let calls = evalsha() - calls_before;
        assert!(calls < 25, "{name}: 30 admissions in {calls} Redis calls: no lease was used");
        // A refundable check and a multi-item check while leases may be out,
        // then a refund.
        let r = c.check_multi(FailPolicy::Closed, 0, true, &[item(name, "k")]).await.unwrap();
        let refundable = admitted(&r);
        let multi = admitted(&c.check_multi(FailPolicy::Closed, 0, false, &[item(name, "k"), item("ip", name)]).await.unwrap());
        if refundable {
            let handle = r.extension.as_ref().and_then(|e| e.handle).expect("an admitted refundable check has a handle");
            let back = c.refund(&handle, &[item(name, "k")]).await.unwrap();
            assert_eq!(back.count, 1, "{name}: {back:?}");
        }
        // The leases settle within their life (1 s for a 60 s window).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut more = 0;
        for _ in 0..40 {
            more += u32::from(admitted(&c.check_policy(&policy(name, "k")).await.unwrap()));
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for _ in 0..5 {
            more += u32::from(admitted(&c.check_policy(&policy(name, "k")).await.unwrap()));
        }
        assert_eq!(30 + u32::from(multi) + more, 60, "{name}: exactly the limit (refundable {refundable}, multi {multi})");
    }
}
