//! Reserve and settle (docs/PROTOCOL.md 4f) on a real Redis Cluster
//! (`common::redis_cluster`): a tenant's hour and month policies, whose
//! keys lie in different slots on different primaries, reserved all or
//! nothing in one request and settled with one handle; refused by one,
//! nothing held in the other; concurrent reserves over both never admitted
//! past a limit, and the budget audited from the primaries.

mod common;

use common::redis_cluster::{key_slot, RedisCluster};
use common::Daemon;
use ratelimitd::protocol::{Decision, ErrorCode, FailPolicy, ItemArgs, Response, HANDLE_LEN};

const POLICIES: &str = r#"
[limits]
max_limit = 1000000000

[[policy]]
name = "tokens_hour"
algorithm = "fixed"
limit = 1000
window = "3600s"

[[policy]]
name = "tokens_month"
algorithm = "fixed"
limit = 1500
window = "month"
"#;

fn cluster_daemon(cluster: &RedisCluster) -> Daemon {
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 2000\n{POLICIES}", seeds.join(", ")))
}

fn scoped(policy: &str, key: &str) -> String {
    format!("{}{policy}{key}", policy.len() as u8 as char)
}

/// The primary serving `slot` now.
fn owner(cluster: &RedisCluster, slot: u16) -> u16 {
    cluster.primaries().into_iter().find(|&p| cluster.slot_ranges(p).iter().any(|&(a, b)| a <= slot && slot <= b)).expect("every slot is served")
}

fn primary_of(cluster: &RedisCluster, policy: &str, key: &str) -> u16 {
    owner(cluster, key_slot(format!("ratelimitd:{{{}}}:x", scoped(policy, key)).as_bytes()))
}

/// A tenant whose hour and month keys are on different primaries.
fn tenant_across_primaries(cluster: &RedisCluster, stem: &str) -> String {
    (0..10_000).map(|i| format!("{stem}{i}")).find(|t| primary_of(cluster, "tokens_hour", t) != primary_of(cluster, "tokens_month", t)).expect("a tenant split over two primaries")
}

/// The count of `key`'s fixed window under `policy`, read from the primary
/// that serves it (0: no window), and how many settle records it holds.
fn held(cluster: &RedisCluster, policy: &str, key: &str) -> (u64, usize) {
    let p = primary_of(cluster, policy, key);
    let keys = cluster.cli(p, &["KEYS", &format!("ratelimitd:{{{}}}:*", scoped(policy, key))]);
    let (records, windows): (Vec<&str>, Vec<&str>) = keys.lines().filter(|l| !l.is_empty()).partition(|k| k.contains(":settle:"));
    assert!(windows.len() <= 1, "{windows:?}");
    let count = windows.first().map_or(0, |k| cluster.cli(p, &["GET", k]).trim().split(' ').nth(1).unwrap().parse().unwrap());
    (count, records.len())
}

fn item<'a>(policy: &'a str, key: &'a str, cost: u32) -> ItemArgs<'a> {
    ItemArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost }
}

fn handle(r: &Response) -> Option<[u8; HANDLE_LEN]> {
    r.extension.as_ref().and_then(|e| e.handle)
}

/// The whole story on one tenant split over two primaries, then
/// concurrent reserves on another: all or nothing across slots, one
/// settle, nothing left of what was refused, and Redis holding exactly
/// the settled units.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserves_across_cluster_slots_are_all_or_nothing_and_settle_with_one_handle() {
    let cluster = RedisCluster::start();
    let d = cluster_daemon(&cluster);
    let mut c = d.client().await;
    let t = tenant_across_primaries(&cluster, "tenant-");
    let both = |cost: u32| [item("tokens_hour", &t, cost), item("tokens_month", &t, cost)];

    let r = c.reserve_items(FailPolicy::Closed, 0, &both(600)).await.unwrap();
    assert_eq!((r.decision, r.error, r.remaining), (Decision::Allowed, ErrorCode::None, 400), "{r:?}");
    let h = handle(&r).expect("one handle");
    assert_eq!((held(&cluster, "tokens_hour", &t), held(&cluster, "tokens_month", &t)), ((600, 1), (600, 1)), "a reserve and its record on each primary");

    let s = c.settle_items(&h, &both(900)).await.unwrap();
    assert_eq!((s.decision, s.error, s.count, s.remaining), (Decision::Allowed, ErrorCode::None, 900, 100), "{s:?}");
    assert_eq!((held(&cluster, "tokens_hour", &t), held(&cluster, "tokens_month", &t)), ((900, 0), (900, 0)));

    // 200 more: the hour refuses (900 + 200 > 1000); the month, on the other primary, holds nothing of it.
    let refused = c.reserve_items(FailPolicy::Closed, 0, &both(200)).await.unwrap();
    let ext = refused.extension.as_ref().unwrap();
    assert_eq!((refused.decision, ext.refused, handle(&refused)), (Decision::Denied, 1, None), "{refused:?}");
    assert_eq!((ext.items[1].decision, ext.items[1].count, ext.items[1].remaining), (Decision::Allowed, 900, 600), "the month as it stands: {refused:?}");
    assert_eq!(held(&cluster, "tokens_month", &t), (900, 0), "the month's reserve was cancelled, its record deleted");
    let again = c.settle_items(&h, &both(5000)).await.unwrap();
    assert_eq!((again.decision, again.count), (Decision::Allowed, 0), "settled once");

    // Concurrent reserves of 100 on a fresh tenant, from 8 connections, 3
    // each: at most 10 fit the hour (1000); every admitted one is settled to
    // 150 (a shortfall), and the month (1500) ends exactly at the sum.
    let u = tenant_across_primaries(&cluster, "busy-");
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let u = u.clone();
            let mut connect = connector(&d);
            tokio::spawn(async move {
                let mut c = connect.connect().await;
                let mut admitted = Vec::new();
                for _ in 0..3 {
                    let r = c.reserve_items(FailPolicy::Closed, 0, &[item("tokens_hour", &u, 100), item("tokens_month", &u, 100)]).await.unwrap();
                    assert_ne!(r.decision, Decision::Error, "{r:?}");
                    if r.decision == Decision::Allowed {
                        admitted.push(handle(&r).unwrap());
                    }
                }
                admitted
            })
        })
        .collect();
    let mut handles = Vec::new();
    for task in tasks {
        handles.extend(task.await.unwrap());
    }
    let n = handles.len() as u64;
    assert!((1..=10).contains(&n), "{n} reserves of 100 admitted on limits 1000 and 1500");
    assert_eq!((held(&cluster, "tokens_hour", &u).0, held(&cluster, "tokens_month", &u).0), (100 * n, 100 * n), "nothing of a refused or cancelled reserve stayed");
    for h in &handles {
        let s = c.settle_items(h, &[item("tokens_hour", &u, 150), item("tokens_month", &u, 150)]).await.unwrap();
        assert_eq!(s.error, ErrorCode::None, "{s:?}");
    }
    assert_eq!(held(&cluster, "tokens_hour", &u), (150 * n, 0), "Redis holds every settled unit, debt included");
    assert_eq!(held(&cluster, "tokens_month", &u), (150 * n, 0));
    eprintln!("cluster audit: {n} of 24 concurrent reserves of 100 admitted (hour 1000, month 1500), settled to 150 each: both windows hold {}", 150 * n);
}

/// A client to connect from a spawned task.
struct Connect(std::path::PathBuf);

impl Connect {
    async fn connect(&mut self) -> ratelimitd::client::Client {
        ratelimitd::client::Client::connect(&self.0).await.unwrap()
    }
}

fn connector(d: &Daemon) -> Connect {
    Connect(d.socket.clone())
}

/// A reserve over a tenant's hour and month, whose month primary is
/// paused past the daemon's deadline (`CLIENT PAUSE`: Redis runs the
/// call when the pause ends, charging the estimate and writing its
/// record): the request gets no handle, the hour's reserve is cancelled
/// at once, and the month's is taken back by the daemon once its primary
/// answers (issue 33 item 7d; src/settle_retry.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_whose_call_timed_out_on_one_primary_is_taken_back() {
    let cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 300\nbreaker_failures = 1000\n{POLICIES}", seeds.join(", ")));
    let mut c = d.client().await;
    let t = tenant_across_primaries(&cluster, "paused-");
    let month = primary_of(&cluster, "tokens_month", &t);
    assert_eq!(cluster.cli(month, &["CLIENT", "PAUSE", "1500", "ALL"]).trim(), "OK");
    let r = c.reserve_items(FailPolicy::Closed, 0, &[item("tokens_hour", &t, 500), item("tokens_month", &t, 500)]).await.unwrap();
    assert_eq!(handle(&r), None, "{r:?}");
    assert_ne!(r.decision, Decision::Allowed, "{r:?}");
    let start = std::time::Instant::now();
    loop {
        let now = (held(&cluster, "tokens_hour", &t), held(&cluster, "tokens_month", &t));
        if now == ((0, 0), (0, 0)) {
            break;
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(20), "after 20 s the primaries hold (count, records) {now:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    eprintln!("a reserve timed out on a paused primary: taken back {:?} after the answer", start.elapsed());
}
