//! Multi-item checks whose items sit in several Redis Cluster slots
//! (docs/PROTOCOL.md 4b): the reservations they make in each slot never
//! outlive their request, whatever happens to the request (a client gone, a
//! shutdown, a failed or timed-out call, a killed primary); one deadline per
//! decision; ASK followed during a slot move; refunds that say what they took
//! back; the same per-item numbers as on one Redis; refund handles nobody
//! can forge. Each test is one case of issue 26 (and item 5 of issue 22) on
//! a real six-node Cluster (`common::redis_cluster`), through the real
//! daemon.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::keys::policy_key;
use common::redis_cluster::{key_slot, RedisCluster};
use common::{args, Daemon, RedisServer};
use ratelimitd::protocol::{encode_multi_request, encode_policy_request, Decision, ErrorCode, FailPolicy, ItemArgs, PolicyCheckArgs, Response, Source};
use tokio::io::AsyncWriteExt;

/// `[redis]` for a daemon on `cluster`, with `extra` lines, and `policies`.
fn cluster_daemon(cluster: &RedisCluster, extra: &str, policies: &str) -> Daemon {
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\n{extra}\n{policies}", seeds.join(", ")))
}

/// `[[policy]]` tables: each (name, limit) with a 60 s window.
fn policies(list: &[(&str, u32)]) -> String {
    list.iter().map(|(name, limit)| format!("[[policy]]\nname = \"{name}\"\nlimit = {limit}\nwindow = \"60s\"\n")).collect()
}

fn slot_of(name: &str, key: &str) -> u16 {
    key_slot(policy_key(name, key).as_bytes())
}

/// The primary serving `slot` now.
fn owner(cluster: &RedisCluster, slot: u16) -> u16 {
    cluster.primaries().into_iter().find(|&p| cluster.slot_ranges(p).iter().any(|&(a, b)| a <= slot && slot <= b)).expect("every slot is served")
}

/// A key (`stem` and a number) whose window under `policy` is on `primary`
/// and whose slot passes `slot_ok`.
fn key_on(cluster: &RedisCluster, policy: &str, stem: &str, primary: u16, slot_ok: impl Fn(u16) -> bool) -> String {
    key_in(&cluster.slot_ranges(primary), policy, stem, slot_ok)
}

/// A key (`stem` and a number) whose window under `policy` is in one of
/// `ranges` of slots and whose slot passes `slot_ok`.
fn key_in(ranges: &[(u16, u16)], policy: &str, stem: &str, slot_ok: impl Fn(u16) -> bool) -> String {
    (0..100_000)
        .map(|i| format!("{stem}{i}"))
        .find(|k| {
            let s = slot_of(policy, k);
            ranges.iter().any(|&(a, b)| a <= s && s <= b) && slot_ok(s)
        })
        .expect("a key on that primary")
}

/// Keys of policies `a` (on `pa`) and `b` (on `pb`), A's slot lower than
/// B's: the first slot of the global order is A's.
fn a_below_b(cluster: &RedisCluster, pa: u16, pb: u16) -> (String, String) {
    let key_b = key_on(cluster, "b", "kb", pb, |s| s > 8000);
    let sb = slot_of("b", &key_b);
    (key_on(cluster, "a", "ka", pa, |s| s < sb), key_b)
}

/// The members of `key`'s 60 s window under `policy` that count now, by
/// the primary's clock (score > now - window, as the script counts; a
/// reservation past its life stays in the ZSET until the next call cleans
/// it, but no longer counts).
fn zcard(cluster: &RedisCluster, policy: &str, key: &str) -> u64 {
    zcard_on(cluster, owner(cluster, slot_of(policy, key)), policy, key)
}

/// `zcard` on the primary `p` known to serve the key's slot.
fn zcard_on(cluster: &RedisCluster, p: u16, policy: &str, key: &str) -> u64 {
    let time = cluster.cli(p, &["TIME"]);
    let mut t = time.lines().map(|l| l.trim().parse::<u64>().unwrap());
    let now_ms = t.next().unwrap() * 1000 + t.next().unwrap() / 1000;
    cluster.cli(p, &["ZCOUNT", &policy_key(policy, key), &format!("({}", now_ms - 60_000), "+inf"]).trim().parse().unwrap()
}

fn item<'a>(policy: &'a str, key: &'a str, cost: u32) -> ItemArgs<'a> {
    ItemArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost }
}

fn ext(r: &Response) -> &ratelimitd::protocol::Extension {
    r.extension.as_deref().unwrap_or_else(|| panic!("no extension: {r:?}"))
}

/// `CLIENT PAUSE ms ALL` on `port`: every command waits until it ends.
fn pause(cluster: &RedisCluster, port: u16, ms: u64) {
    assert_eq!(cluster.cli(port, &["CLIENT", "PAUSE", &ms.to_string(), "ALL"]).trim(), "OK");
}

/// A lone check of one policy item (its own slot: one atomic call).
async fn lone(c: &mut ratelimitd::client::Client, policy: &str, key: &str) -> Response {
    c.check_policy(&PolicyCheckArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }).await.unwrap()
}

/// Case 1: `[A, B]` with B full reserves A, then takes it back. A lone check
/// of A sent while the reservation stands is refused by Redis; that refusal
/// must not be remembered once the reservation is gone: the next lone
/// check of A, sent after `[A, B]` was answered, is admitted by Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_caused_by_a_cancelled_reservation_is_not_remembered() {
    let cluster = RedisCluster::start();
    let d = cluster_daemon(&cluster, "timeout_ms = 2000", &policies(&[("a", 1), ("b", 1)]));
    let prim = cluster.primaries();
    // A in a lower slot than B: A is reserved first, in any order of taking.
    let (key_a, key_b) = a_below_b(&cluster, prim[0], prim[1]);
    let mut c = d.client().await;
    assert_eq!(lone(&mut c, "b", &key_b).await.decision, Decision::Allowed, "B is full now");

    pause(&cluster, prim[1], 600);
    let mut c1 = d.client().await;
    let (ka, kb) = (key_a.clone(), key_b.clone());
    let multi = tokio::spawn(async move { c1.check_multi(FailPolicy::Closed, 0, false, &[item("a", &ka, 1), item("b", &kb, 1)]).await.unwrap() });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let during = lone(&mut c, "a", &key_a).await;
    let r = multi.await.unwrap();
    assert_eq!((r.decision, ext(&r).refused), (Decision::Denied, 2), "B refused the request: {r:?}");
    eprintln!("lone check during the reservation: {:?} from {:?}", during.decision, during.source);
    let after = lone(&mut c, "a", &key_a).await;
    assert_eq!((after.decision, after.source), (Decision::Allowed, Source::Redis), "A's window is empty again: no cached refusal may answer: {after:?}");
    assert_eq!(zcard(&cluster, "a", &key_a), 1, "only the lone check's admission is in A's window");
}

/// Case 1, concurrent: limit 1 on A and B, 8 clients sending `[A, B]` and
/// `[B, A]` at once. Groups are taken in one order, so the requests cannot
/// cross: each trial admits exactly one request, its window holds exactly
/// that one, and no refusal answered from the cache meets an empty window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_item_orders_never_cross() {
    let cluster = RedisCluster::start();
    let d = cluster_daemon(&cluster, "timeout_ms = 2000", &policies(&[("a", 1), ("b", 1)]));
    // The primaries and their slots, read once (no slot moves here).
    let prim = cluster.primaries();
    let (ranges_a, ranges_b) = (cluster.slot_ranges(prim[0]), cluster.slot_ranges(prim[1]));
    let mut nobody = 0;
    for trial in 0..20 {
        let key_a = key_in(&ranges_a, "a", &format!("t{trial}a"), |_| true);
        let key_b = key_in(&ranges_b, "b", &format!("t{trial}b"), |_| true);
        let mut tasks = Vec::new();
        for n in 0..8 {
            let mut c = d.client().await;
            let (ka, kb) = (key_a.clone(), key_b.clone());
            tasks.push(tokio::spawn(async move {
                let items = if n % 2 == 0 { [item("a", &ka, 1), item("b", &kb, 1)] } else { [item("b", &kb, 1), item("a", &ka, 1)] };
                c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap()
            }));
        }
        let mut admitted = 0;
        for t in tasks {
            let r = t.await.unwrap();
            assert_eq!(r.error, ErrorCode::None, "{r:?}");
            admitted += (r.decision == Decision::Allowed) as u32;
        }
        nobody += (admitted == 0) as u32;
        assert!(admitted <= 1, "trial {trial}: {admitted} admitted over a limit of 1");
        let (za, zb) = (zcard_on(&cluster, prim[0], "a", &key_a), zcard_on(&cluster, prim[1], "b", &key_b));
        assert_eq!((za, zb), (u64::from(admitted), u64::from(admitted)), "trial {trial}: the windows hold exactly what was admitted");
        // A refusal now is true: the windows are full, or else admitted.
        let mut c = d.client().await;
        let r = lone(&mut c, "a", &key_a).await;
        assert_eq!(r.decision == Decision::Allowed, admitted == 0, "trial {trial}: {r:?}");
    }
    assert_eq!(nobody, 0, "trials that admitted nobody although both windows were empty");
}

/// Case 1, three slots and more (docs/PROTOCOL.md 4b, "Crossing
/// requests"): limit 1 on every item, 8 clients each sending one check over
/// `slots` slots at once, in rotated and reversed item orders. Of crossing
/// requests that could each be admitted alone, at least one is: every trial
/// admits exactly one, and the windows hold exactly it.
/// With `roomy_lowest`, the item of the lowest slot has room for all 8
/// (limit 8): every request gets past it, and the crossing happens on the
/// later slots only.
async fn crossing_requests_over(clients: usize, slots: usize, trials: usize, roomy_lowest: bool) {
    let cluster = RedisCluster::start();
    let names = ["a", "b", "c", "d", "e"];
    let list: Vec<(&str, u32)> = names[..slots].iter().enumerate().map(|(i, n)| (*n, if roomy_lowest && i == 0 { 8 } else { 1 })).collect();
    let d = cluster_daemon(&cluster, "timeout_ms = 2000", &policies(&list));
    // Read once: no slot moves here, and reading them per key and per
    // window (a redis-cli process for each primary's ROLE and slots) cost
    // this test most of its time.
    let owners: Vec<(u16, Vec<(u16, u16)>)> = cluster.primaries().into_iter().map(|p| (p, cluster.slot_ranges(p))).collect();
    let owner_of = |slot: u16| owners.iter().find(|(_, r)| r.iter().any(|&(a, b)| a <= slot && slot <= b)).map(|(p, _)| *p).expect("every slot is served");
    let mut nobody = Vec::new();
    let mut took = Vec::new();
    for trial in 0..trials {
        let mut keys: Vec<String> = (0..slots).map(|i| key_in(&owners[i % 3].1, names[i], &format!("t{trial}k{i}_"), |_| true)).collect();
        if roomy_lowest {
            let lowest = (1..slots).map(|i| slot_of(names[i], &keys[i])).min().unwrap();
            keys[0] = key_in(&owners[0].1, names[0], &format!("t{trial}k0_"), |s| s < lowest);
        }
        let mut tasks = Vec::new();
        for n in 0..clients {
            let mut c = d.client().await;
            let keys = keys.clone();
            tasks.push(tokio::spawn(async move {
                // Rotated by n, reversed for odd n: every pair of clients
                // disagrees on the order of some slots.
                let mut order: Vec<usize> = (0..slots).map(|i| (i + n) % slots).collect();
                if n % 2 == 1 {
                    order.reverse();
                }
                let items: Vec<ItemArgs<'_>> = order.iter().map(|&i| item(names[i], &keys[i], 1)).collect();
                let started = Instant::now();
                let r = c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap();
                (r, started.elapsed())
            }));
        }
        let mut admitted = 0;
        for t in tasks {
            let (r, elapsed) = t.await.unwrap();
            assert_eq!(r.error, ErrorCode::None, "{r:?}");
            admitted += (r.decision == Decision::Allowed) as u32;
            took.push(elapsed);
        }
        if admitted == 0 {
            nobody.push(trial);
        }
        assert!(admitted <= 1, "trial {trial}: {admitted} admitted over a limit of 1");
        for (i, k) in keys.iter().enumerate().skip(usize::from(roomy_lowest)) {
            let held = zcard_on(&cluster, owner_of(slot_of(names[i], k)), names[i], k);
            assert_eq!(held, u64::from(admitted), "trial {trial}: window {} holds exactly what was admitted", names[i]);
        }
    }
    took.sort();
    eprintln!("{slots} slots (roomy lowest: {roomy_lowest}), {trials} trials of {clients} crossing requests: {} admitted nobody; per request p50 {:?} p99 {:?} max {:?}", nobody.len(), took[took.len() / 2], took[took.len() * 99 / 100], took[took.len() - 1]);
    assert!(nobody.is_empty(), "trials {nobody:?} admitted nobody although every window was empty");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_requests_over_three_slots_admit_one() {
    crossing_requests_over(8, 3, 40, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_requests_over_five_slots_admit_one() {
    crossing_requests_over(8, 5, 30, false).await;
}

/// The case PROTOCOL.md 4b admitted before: requests that all pass the
/// lowest slot cross on the later ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossing_requests_past_a_roomy_lowest_slot_admit_one() {
    crossing_requests_over(2, 3, 60, true).await;
    crossing_requests_over(8, 4, 30, true).await;
}

/// Case 2: a check dropped half-way (its client gone while a slot's primary
/// is slow, and the connection handler dropping the decision) leaves no
/// reservation in the first slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_dropped_half_way_leaves_nothing_behind() {
    let cluster = RedisCluster::start();
    let d = cluster_daemon(&cluster, "timeout_ms = 2500", &policies(&[("a", 5), ("b", 1), ("c", 100)]));
    let prim = cluster.primaries();
    let (key_a, key_b) = a_below_b(&cluster, prim[0], prim[1]);
    let key_c = key_on(&cluster, "c", "kc", prim[2], |_| true);
    let mut c = d.client().await;
    assert_eq!(lone(&mut c, "b", &key_b).await.decision, Decision::Allowed, "B is full now");

    // Two checks pipelined on one connection, which closes at once: the
    // first (C's primary paused 300 ms) is answered into a closed socket,
    // so the handler drops the second while it waits for B's primary.
    pause(&cluster, prim[2], 300);
    pause(&cluster, prim[1], 1200);
    let mut frames = BytesMut::new();
    encode_policy_request(1, &PolicyCheckArgs { policy: b"c", key: key_c.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }, &mut frames);
    encode_multi_request(2, FailPolicy::Closed, 0, false, &[item("a", &key_a, 1), item("b", &key_b, 1)], &mut frames);
    let mut s = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
    s.write_all(&frames).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(s);
    // Past B's pause, and past a reservation's own short life.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(zcard(&cluster, "a", &key_a), 0, "the dropped check's reservation of A is gone\n{}", d.log());
}

/// Case 2, shutdown: a check cut by SIGTERM (it waits for a paused primary
/// longer than `shutdown_grace`, 2 s) leaves nothing in the first slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_cut_by_shutdown_leaves_nothing_behind() {
    let cluster = RedisCluster::start();
    let mut d = cluster_daemon(&cluster, "timeout_ms = 2500", &policies(&[("a", 5), ("b", 1)]));
    let prim = cluster.primaries();
    let (key_a, key_b) = a_below_b(&cluster, prim[0], prim[1]);
    let mut c = d.client().await;
    assert_eq!(lone(&mut c, "b", &key_b).await.decision, Decision::Allowed, "B is full now");
    pause(&cluster, prim[1], 3000);
    let mut c1 = d.client().await;
    let (ka, kb) = (key_a.clone(), key_b.clone());
    let multi = tokio::spawn(async move { c1.check_multi(FailPolicy::Closed, 0, false, &[item("a", &ka, 1), item("b", &kb, 1)]).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let (_, d) = tokio::task::spawn_blocking(move || (d.terminate(), d)).await.unwrap();
    eprintln!("daemon stopped {:?} after SIGTERM; the check: {:?}", started.elapsed(), multi.await.unwrap());
    tokio::time::sleep(Duration::from_millis(3000).saturating_sub(started.elapsed())).await;
    assert_eq!(zcard(&cluster, "a", &key_a), 0, "the check cut by the shutdown left nothing in A\n{}", d.log());
}

/// Case 3: a primary killed while 3-slot checks run, with the default
/// `cluster-require-full-coverage yes` (every primary answers CLUSTERDOWN
/// until the replica is promoted): no member is left on the healthy
/// primaries beyond the admitted requests'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_leaves_no_orphans_on_healthy_primaries() {
    let mut cluster = RedisCluster::start();
    let d = cluster_daemon(&cluster, "timeout_ms = 200", &policies(&[("a", 1_000_000), ("b", 1_000_000), ("c", 1_000_000)]));
    let prim = cluster.primaries();
    let key_a = key_on(&cluster, "a", "ka", prim[0], |_| true);
    let key_b = key_on(&cluster, "b", "kb", prim[1], |_| true);
    let key_c = key_on(&cluster, "c", "kc", prim[2], |_| true);
    let stop = Arc::new(AtomicBool::new(false));
    let admitted = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for n in 0..8 {
        let mut c = d.client().await;
        let (ka, kb, kc, stop, admitted) = (key_a.clone(), key_b.clone(), key_c.clone(), stop.clone(), admitted.clone());
        tasks.push(tokio::spawn(async move {
            let mut answers = HashMap::new();
            while !stop.load(Ordering::Relaxed) {
                // Both orders, so the killed slot is reached first or last.
                let items = if n % 2 == 0 { [item("a", &ka, 1), item("b", &kb, 1), item("c", &kc, 1)] } else { [item("c", &kc, 1), item("b", &kb, 1), item("a", &ka, 1)] };
                let r = c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap();
                if r.decision == Decision::Allowed {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
                *answers.entry(format!("{:?}/{:?}", r.decision, r.error)).or_insert(0u32) += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            answers
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.kill(prim[2]);
    tokio::time::sleep(Duration::from_millis(3000)).await;
    stop.store(true, Ordering::Relaxed);
    let mut answers: HashMap<String, u32> = HashMap::new();
    for t in tasks {
        for (k, v) in t.await.unwrap() {
            *answers.entry(k).or_default() += v;
        }
    }
    assert!(cluster.wait_ok(Duration::from_secs(20)), "the replica is promoted");
    // Past any reservation's own life.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let admitted = u64::from(admitted.load(Ordering::Relaxed));
    let (za, zb) = (zcard(&cluster, "a", &key_a), zcard(&cluster, "b", &key_b));
    eprintln!("answers {answers:?}; admitted {admitted}; A holds {za}, B holds {zb}");
    assert!(answers.keys().any(|k| k != "Allowed/None"), "the kill failed some checks: {answers:?}");
    assert!(za <= admitted && zb <= admitted, "members left behind on healthy primaries: A {za}, B {zb}, admitted {admitted}\n{}", d.log());
    assert!(za + 20 >= admitted && zb + 20 >= admitted, "admissions lost: A {za}, B {zb}, admitted {admitted}");
}

/// Case 4: one deadline per decision, whatever the number of slots: with
/// one primary at a time busy for 15 ms (`DEBUG SLEEP`, in turn, so every
/// check over 8 slots on 3 primaries meets a slow one), a check over 8 slots answers
/// within `timeout_ms` plus scheduling, and never reports a failure for a
/// decision it recorded: once the reservations' life is over, each window
/// holds exactly the admitted checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_deadline_for_a_check_over_eight_slots() {
    const TIMEOUT_MS: u64 = 30;
    let cluster = RedisCluster::start_with_args(&["--enable-debug-command", "yes"]);
    let names = ["p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8"];
    let list: Vec<(&str, u32)> = names.iter().map(|n| (*n, 1_000_000)).collect();
    let d = cluster_daemon(&cluster, &format!("timeout_ms = {TIMEOUT_MS}"), &policies(&list));
    let prim = cluster.primaries();
    let mut used = std::collections::HashSet::new();
    let keys: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let k = key_on(&cluster, n, &format!("k{i}_"), prim[i % 3], |s| !used.contains(&s));
            used.insert(slot_of(n, &k));
            k
        })
        .collect();
    let items: Vec<ItemArgs<'_>> = names.iter().zip(&keys).map(|(n, k)| item(n, k, 1)).collect();
    let mut c = d.client().await;
    let started = Instant::now();
    let first = c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap();
    eprintln!("8 slots, no pause: {:?}", started.elapsed());
    assert_eq!(first.decision, Decision::Allowed, "{first:?}");

    let stop = Arc::new(AtomicBool::new(false));
    let pauser = {
        let (stop, prim) = (stop.clone(), prim.clone());
        std::thread::spawn(move || {
            let mut conns: Vec<redis::Connection> = prim.iter().map(|p| redis::Client::open(format!("redis://127.0.0.1:{p}")).unwrap().get_connection().unwrap()).collect();
            for i in (0..conns.len()).cycle() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let _: redis::RedisResult<()> = redis::cmd("DEBUG").arg("SLEEP").arg(0.015).query(&mut conns[i]);
            }
        })
    };
    let mut took = Vec::new();
    let (mut admitted, mut failed) = (0u64, HashMap::<String, u32>::new());
    for _ in 0..60 {
        let started = Instant::now();
        let r = c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap();
        took.push(started.elapsed());
        match (r.decision, r.error) {
            (Decision::Allowed, ErrorCode::None) => admitted += 1,
            (_, ErrorCode::None) => panic!("refused under a limit of a million: {r:?}"),
            (_, e) => *failed.entry(format!("{e:?}")).or_default() += 1,
        }
        tokio::time::sleep(Duration::from_millis(7)).await;
    }
    stop.store(true, Ordering::Relaxed);
    pauser.join().unwrap();
    took.sort();
    let (p50, p99, max) = (took[took.len() / 2], took[took.len() * 99 / 100], took[took.len() - 1]);
    eprintln!("8 slots, timeout {TIMEOUT_MS} ms, a primary busy 15 ms in turn: p50 {p50:?} p99 {p99:?} max {max:?}; admitted {admitted}, failed {failed:?}");
    assert!(max <= Duration::from_millis(TIMEOUT_MS + 40), "an 8-slot check took {max:?} against a deadline of {TIMEOUT_MS} ms");
    assert!(admitted >= 30, "most checks are admitted within the deadline: {admitted}, failed {failed:?}");
    // Past any reservation's own life: what stays was admitted.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for (n, k) in names.iter().zip(&keys) {
        assert_eq!(zcard(&cluster, n, k), admitted + 1, "policy {n}: the window holds exactly the admitted checks (failed: {failed:?})");
    }
}

/// Moves `slot` from the primary `from` to `to` as `redis-cli --cluster
/// reshard` does, with `ask_ms` between MIGRATE and the hand-over (the
/// keys on `to`, the slot still `from`'s: every request meets `ASK`).
async fn move_slot(cluster: &RedisCluster, slot: u16, from: u16, to: u16, ask_ms: u64) {
    let id = |p: u16| cluster.cli(p, &["CLUSTER", "MYID"]).trim().to_string();
    let ok = |out: String| assert_eq!(out.trim(), "OK", "{out}");
    let slot = slot.to_string();
    let (from_id, to_id) = (id(from), id(to));
    ok(cluster.cli(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]));
    ok(cluster.cli(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let keys = cluster.cli(from, &["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
    let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
    if !keys.is_empty() {
        let to_port = to.to_string();
        let mut migrate = vec!["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
        migrate.extend(keys.iter().copied());
        ok(cluster.cli(from, &migrate));
    }
    tokio::time::sleep(Duration::from_millis(ask_ms)).await;
    for p in cluster.primaries() {
        ok(cluster.cli(p, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]));
    }
}

/// Case 5: plain checks and multi-item checks at once during manual slot
/// moves (IMPORTING, MIGRATING, MIGRATE, then SETSLOT NODE) of a slot where
/// 16 clients each check a key of their own (one hash tag), other clients
/// busy on the destination primary, and 8 clients send multi-item checks in
/// both orders over a key of the moving slot and a slot of the third
/// primary, while the slot moves there and back: every plain check is
/// decided by Redis (ASK followed), none gets an error or waits out its
/// deadline, except in one case: redis-rs still refreshes its slot map after
/// a `MOVED` and can stall every call meanwhile (under heavy load), which the
/// link's watchdog ends by replacing the connection (a logged line). Then the
/// calls caught on the stalled connection time out, all within one window of
/// at most twice the deadline per replacement; never an ASK or MOVED error.
/// No member is left behind. Many calls redirected at once to one
/// node are what redis-rs's own ASK handling loses, and every `MOVED` it
/// meets stops the whole connection for a slot-map refresh (see
/// `follow_redirect` in src/redis/link.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_redirects_are_followed_during_a_manual_slot_move() {
    let cluster = RedisCluster::start();
    let d = cluster_daemon(&cluster, "timeout_ms = 500", &policies(&[("a", 1_000_000), ("b", 1_000_000)]));
    let prim = cluster.primaries();
    let (src, dst) = (prim[0], prim[1]);
    let ranges = cluster.slot_ranges(dst);
    let on_dst: Vec<String> = (0..).map(|i| format!("busy{i}")).filter(|k| ranges.iter().any(|&(a, b)| (a..=b).contains(&key_slot(format!("ratelimitd:{{{k}}}:60000ms").as_bytes())))).take(8).collect();
    let src_ranges = cluster.slot_ranges(src);
    let tags: Vec<String> = (0..).map(|i| format!("mv{i}")).filter(|t| src_ranges.iter().any(|&(a, b)| (a..=b).contains(&key_slot(t.as_bytes())))).take(2).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(std::sync::Mutex::new(Vec::<(Duration, String)>::new()));
    let count = Arc::new(AtomicU32::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    let moving: Vec<String> = tags.iter().flat_map(|t| (0..16).map(move |i| format!("{{{t}}}c{i}"))).collect();
    for (i, k) in moving.iter().chain(on_dst.iter()).enumerate() {
        let mut c = d.client().await;
        let (k, stop, errors, count) = (k.clone(), stop.clone(), errors.clone(), count.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = c.check(&args(&k, 1_000_000, 60_000)).await.unwrap();
                count.fetch_add(1, Ordering::Relaxed);
                if r.error != ErrorCode::None || r.source != Source::Redis {
                    let at = t0.elapsed();
                    errors.lock().unwrap().push((at, format!("at {at:?} client {i} key {k}: {:?} {:?} {}", r.error, r.source, r.message)));
                }
            }
        }));
    }
    // Multi-item checks, both orders, over a key of the first moving slot
    // and a slot of the third primary, at the same time.
    let key_a = format!("{{{}}}multi", tags[0]);
    let key_b = key_on(&cluster, "b", "kb", prim[2], |_| true);
    let admitted = Arc::new(AtomicU32::new(0));
    let failed = Arc::new(std::sync::Mutex::new(HashMap::<String, u32>::new()));
    for n in 0..8 {
        let mut c = d.client().await;
        let (ka, kb, stop, admitted, failed) = (key_a.clone(), key_b.clone(), stop.clone(), admitted.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let items = if n % 2 == 0 { [item("a", &ka, 1), item("b", &kb, 1)] } else { [item("b", &kb, 1), item("a", &ka, 1)] };
                let r = c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap();
                match (r.decision, r.error) {
                    (Decision::Allowed, ErrorCode::None) => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => *failed.lock().unwrap().entry(format!("{:?}/{:?} {}", r.decision, r.error, r.message)).or_default() += 1,
                };
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for tag in &tags {
        move_slot(&cluster, key_slot(tag.as_bytes()), src, dst, 600).await;
        eprintln!("slot {} moved at {:?}", key_slot(tag.as_bytes()), t0.elapsed());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    move_slot(&cluster, key_slot(tags[0].as_bytes()), dst, src, 600).await;
    eprintln!("slot {} moved back at {:?}", key_slot(tags[0].as_bytes()), t0.elapsed());
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks.drain(..) {
        t.await.unwrap();
    }
    let errors = errors.lock().unwrap().clone();
    let (admitted, failed) = (u64::from(admitted.load(Ordering::Relaxed)), failed.lock().unwrap().clone());
    eprintln!("3 slot moves, {} plain checks, {} not decided by Redis; multi-item checks: {admitted} admitted, failed {failed:?}", count.load(Ordering::Relaxed), errors.len());
    let log = d.log();
    let replaced = log.matches("replaced by a fresh one").count() as u32;
    let shown: Vec<&String> = errors.iter().map(|(_, e)| e).take(5).collect();
    let redirects = errors.iter().filter(|(_, e)| ["Ask", "ASK", "Moved", "MOVED"].iter().any(|w| e.contains(w))).count();
    assert_eq!(redirects, 0, "ASK and MOVED are always followed; e.g. {shown:?}\n{log}");
    if replaced == 0 {
        assert!(errors.is_empty(), "{} plain checks got an error during the moves, e.g. {shown:?}\n{log}", errors.len());
    } else {
        // The watchdog replaced a stalled connection: the calls caught on it
        // time out within one deadline of the stall, and nothing else fails.
        // Counted per stall, not per logged replacement: the replacement's
        // warning is rate-limited (two stalls a second apart log once), so
        // the failures are cut into stalls where they pause for 250 ms; at
        // most one stall per slot move, each over within twice the deadline.
        let mut times: Vec<Duration> = errors.iter().map(|(t, _)| *t).collect();
        times.sort();
        let mut stalls: Vec<(Duration, Duration)> = Vec::new();
        for t in times {
            match stalls.last_mut() {
                Some((_, last)) if t - *last < Duration::from_millis(250) => *last = t,
                _ => stalls.push((t, t)),
            }
        }
        eprintln!("the watchdog replaced the cluster connection (logged) {replaced} time(s); {} plain checks failed in stalls {stalls:?}", errors.len());
        assert!(stalls.len() <= 3, "at most one stall per slot move (3): {stalls:?}, e.g. {shown:?}\n{log}");
        for &(first, last) in &stalls {
            assert!(last - first <= Duration::from_millis(1000), "the failures of a stall last at most twice the deadline: {} from {first:?} to {last:?}, e.g. {shown:?}\n{log}", errors.len());
        }
    }
    assert!(admitted >= 100, "multi-item checks went on during the moves: {admitted} admitted, failed {failed:?}");
    // Past any reservation's life: exactly the admitted ones stay.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!((zcard(&cluster, "a", &key_a), zcard(&cluster, "b", &key_b)), (admitted, admitted), "the windows hold exactly the admitted multi-item checks (failed: {failed:?})");
}

/// Case 6: a REFUND of a 3-slot handle (costs 2, 1, 3) with the second
/// slot's primary paused: the answer is an error, and it says what was
/// taken back (its count); the denial cache is told of it (a check it had
/// refused is admitted at once); a retry once the primary is back takes
/// back the rest, all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_that_fails_on_one_slot_says_what_it_took_back() {
    let cluster = RedisCluster::start();
    let d = cluster_daemon(&cluster, "timeout_ms = 300", &policies(&[("a", 2), ("b", 5), ("c", 5)]));
    let prim = cluster.primaries();
    let key_a = key_on(&cluster, "a", "ka", prim[0], |_| true);
    let key_b = key_on(&cluster, "b", "kb", prim[1], |_| true);
    let key_c = key_on(&cluster, "c", "kc", prim[2], |_| true);
    let items = [item("a", &key_a, 2), item("b", &key_b, 1), item("c", &key_c, 3)];
    let mut c = d.client().await;
    let r = c.check_multi(FailPolicy::Closed, 0, true, &items).await.unwrap();
    assert_eq!(r.decision, Decision::Allowed, "{r:?}");
    let handle = ext(&r).handle.expect("a handle");
    // Past the reservations' own life: confirmed, every unit counts.
    tokio::time::sleep(Duration::from_millis(2300)).await;
    let counted = [zcard(&cluster, "a", &key_a), zcard(&cluster, "b", &key_b), zcard(&cluster, "c", &key_c)];
    assert_eq!(counted, [2, 1, 3], "the admission was confirmed in every slot");
    let refused = lone(&mut c, "a", &key_a).await;
    assert_eq!(refused.decision, Decision::Denied, "A is full: {refused:?}");
    assert_eq!(lone(&mut c, "a", &key_a).await.source, Source::DenialCache, "the refusal is cached");

    pause(&cluster, prim[1], 1000);
    let r = c.refund(&handle, &items).await.unwrap();
    let windows = [zcard(&cluster, "a", &key_a), zcard(&cluster, "c", &key_c)];
    assert_ne!(r.error, ErrorCode::None, "B's slot did not answer: {r:?}");
    assert_eq!(windows, [0, 0], "A's and C's slots answered");
    assert_eq!(r.count, 5, "the failed refund says what it took back: {r:?}");
    let a = lone(&mut c, "a", &key_a).await;
    assert_eq!((a.decision, a.source), (Decision::Allowed, Source::Redis), "the denial cache was told of the refund: {a:?}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // B's call, cut by its deadline, waited in the paused primary and ran
    // when it woke: a slot that did not answer may still have refunded.
    let retry = c.refund(&handle, &items).await.unwrap();
    assert_eq!(retry.error, ErrorCode::None, "{retry:?}");
    assert!(retry.count <= 1, "the retry takes back at most B's unit: {retry:?}");
    assert_eq!(zcard(&cluster, "b", &key_b), 0, "all of it is taken back");
}

/// Case 7: the per-item numbers of a refused multi-item check are the same
/// on one Redis, a Cluster and the memory backend (count = admissions in
/// the window without this request, remaining = limit - count), for every
/// item, whichever refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_reports_the_same_numbers_on_every_topology() {
    let list = policies(&[("ip", 5), ("tenant", 3), ("global", 100)]);
    let redis = RedisServer::start_unix();
    let one = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{list}", redis.url()));
    let memory = Daemon::start_config(&format!("socket_mode = \"0600\"\n{list}"));
    let cluster = RedisCluster::start();
    let on_cluster = cluster_daemon(&cluster, "timeout_ms = 500", &list);
    // Three slots on the Cluster, the refusing item neither first nor last by slot.
    let mut slots: Vec<(u16, &str, &str)> = [("ip", "a"), ("tenant", "b"), ("global", "c")].iter().map(|&(p, k)| (slot_of(p, k), p, k)).collect();
    slots.sort();
    eprintln!("slots by order: {slots:?}");
    let items = [item("ip", "a", 1), item("tenant", "b", 1), item("global", "c", 1)];
    let mut seen: Vec<Vec<(Decision, u32, u32)>> = Vec::new();
    for d in [&one, &memory, &on_cluster] {
        let mut c = d.client().await;
        for _ in 0..3 {
            assert_eq!(c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap().decision, Decision::Allowed);
        }
        let r = c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap();
        assert_eq!((r.decision, ext(&r).refused), (Decision::Denied, 2), "{r:?}");
        assert_eq!((r.count, r.remaining), (3, 0), "the fixed fields are the refusing item's: {r:?}");
        seen.push(ext(&r).items.iter().map(|i| (i.decision, i.count, i.remaining)).collect());
    }
    let want = vec![(Decision::Allowed, 3, 2), (Decision::Denied, 3, 0), (Decision::Allowed, 3, 97)];
    assert_eq!(seen[0], want, "one Redis");
    assert_eq!(seen[1], want, "memory");
    assert_eq!(seen[2], want, "cluster");
}

/// S6: refund handles nobody can forge. Another client on the socket sweeps
/// handles (forged ones, and neighbours of the handle it sees in its own
/// responses): nothing is removed from anybody's window, and every forged
/// handle is counted. A handle issued before a restart still refunds after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_swept_by_another_client_remove_nothing() {
    let cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    let mut d = Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 500\n{}", seeds.join(", "), policies(&[("a", 100), ("b", 100)])));
    let prim = cluster.primaries();
    let key_a = key_on(&cluster, "a", "ka", prim[0], |_| true);
    let key_b = key_on(&cluster, "b", "kb", prim[1], |_| true);
    let items = [item("a", &key_a, 1), item("b", &key_b, 1)];
    let one = [item("a", &key_a, 1)];
    let mut victim = d.client().await;
    let mut handles = Vec::new();
    for _ in 0..5 {
        let r = victim.check_multi(FailPolicy::Closed, 0, true, &items).await.unwrap();
        handles.push(ext(&r).handle.unwrap());
        // Non-refundable admissions of one and two slots, too.
        assert_eq!(victim.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap().decision, Decision::Allowed);
        assert_eq!(victim.check_multi(FailPolicy::Closed, 0, false, &one).await.unwrap().decision, Decision::Allowed);
    }
    assert_eq!((zcard(&cluster, "a", &key_a), zcard(&cluster, "b", &key_b)), (15, 10));

    let mut attacker = d.client().await;
    let r = attacker.check_multi(FailPolicy::Closed, 0, true, &items).await.unwrap();
    let own = ext(&r).handle.unwrap();
    let mut swept = 0;
    for delta in 1..=64u64 {
        for h in [own, handles[0]] {
            let mut forged = h;
            let seq = u64::from_be_bytes(forged[8..].try_into().unwrap());
            forged[8..].copy_from_slice(&seq.wrapping_sub(delta).to_be_bytes());
            for its in [&items[..], &one[..]] {
                let r = attacker.refund(&forged, its).await.unwrap();
                assert_eq!((r.decision, r.error, r.count), (Decision::Allowed, ErrorCode::None, 0), "a forged handle removed something: {r:?}");
                swept += 1;
            }
        }
    }
    let random: [u8; 16] = std::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ 0x5a);
    assert_eq!(attacker.refund(&random, &items).await.unwrap().count, 0);
    swept += 1;
    assert_eq!((zcard(&cluster, "a", &key_a), zcard(&cluster, "b", &key_b)), (16, 11), "the sweep removed nothing");
    let metrics = tokio::task::spawn_blocking({
        let url = d.metrics_url();
        move || ureq::get(&url).call().unwrap().body_mut().read_to_string().unwrap()
    })
    .await
    .unwrap();
    let line = metrics.lines().find(|l| l.starts_with("ratelimitd_refunds_unmatched_total ")).unwrap_or_else(|| panic!("no unmatched refunds counter in\n{metrics}"));
    assert_eq!(line.rsplit(' ').next().unwrap().parse::<u64>().unwrap(), swept, "every forged handle is counted");
    // A replayed handle removes nothing the second time; the owner's works once.
    assert_eq!(victim.refund(&handles[1], &items).await.unwrap().count, 2);
    assert_eq!(attacker.refund(&handles[1], &items).await.unwrap().count, 0, "a replayed handle");

    // A handle issued before a restart still refunds after it.
    let status = tokio::task::spawn_blocking(move || {
        let s = d.terminate();
        d.start_again();
        (s, d)
    })
    .await
    .unwrap();
    let (_, d) = status;
    let mut c = d.client().await;
    let r = c.refund(&handles[2], &items).await.unwrap();
    assert_eq!((r.error, r.count), (ErrorCode::None, 2), "{r:?}");
}
