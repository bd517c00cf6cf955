//! A Cluster slot migrating under load (issue 33, 7c): while a slot
//! migrates, a call naming several of its keys gets `TRYAGAIN` from Redis
//! whenever some of them are on one node and some on the other, or do not
//! exist (a penalty box's ban and strike keys, a reserve's settle record).
//! Before, `TRYAGAIN` went straight to the fail policy: during a
//! `--cluster reshard`, 133 of 167 penalty checks `fail_closed`, a key
//! banned in Redis admitted 5/5 under `on_error = "open"`, 92 of 145
//! reserves failed. Now the daemon sends such a call again within the
//! request's deadline; a migration shorter than the deadline reaches no
//! fail policy. Real six-node cluster (`common::redis_cluster`), the slot
//! moved by hand in steps.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis_cluster::{key_slot, RedisCluster};
use common::{args, Daemon};
use ratelimitd::protocol::{CheckArgs, Decision, FailPolicy, ItemArgs, PolicyCheckArgs, Response, Source};

/// `pen`: a penalty box that never bans at this load; `strict`: one
/// admission a minute, the first refusal bans for a minute; `fixed_big`: a
/// fixed window for reserves.
const POLICIES: &str = r#"
[[policy]]
name = "pen"
limit = 100000
window = "60s"
penalty = { after = 1000, within = "60s", ban = "60s" }

[[policy]]
name = "strict"
limit = 1
window = "60s"
penalty = { after = 1, within = "60s", ban = "60s" }

[[policy]]
name = "fixed_big"
algorithm = "fixed"
limit = 100000
window = "600s"
"#;

/// Every key of this test shares the hash tag `{mig}`: one slot.
const TAG: &[u8] = b"mig";

fn daemon(cluster: &RedisCluster) -> Daemon {
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    // A deadline well above the migration's length (about 0.5 s), with room
    // for a loaded machine.
    Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 1500\n{POLICIES}", seeds.join(", ")))
}

fn policy(name: &'static str, key: &'static str, on_error: FailPolicy) -> PolicyCheckArgs<'static> {
    PolicyCheckArgs { policy: name.as_bytes(), key: key.as_bytes(), cost: 1, on_error, local_limit: 0 }
}

fn by_redis(r: &Response) -> bool {
    matches!(r.source, Source::Redis | Source::DenialCache)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrating_slot_sends_no_call_to_the_fail_policy_and_a_ban_holds() {
    let cluster = RedisCluster::start();
    let engaging = daemon(&cluster);
    let d = daemon(&cluster);

    // The ban, engaged through another daemon: `d` has never seen it, so
    // only Redis can refuse the key.
    let mut e = engaging.client().await;
    assert_eq!(e.check_policy(&policy("strict", "{mig}banned", FailPolicy::Closed)).await.unwrap().decision, Decision::Allowed);
    let r = e.check_policy(&policy("strict", "{mig}banned", FailPolicy::Closed)).await.unwrap();
    assert_eq!((r.decision, r.source), (Decision::Denied, Source::Redis), "{r:?}");
    assert!(r.retry_after_ms > 50_000, "the ban engaged: {r:?}");

    // Every kind of call on the slot once, so each has its keys there.
    let mut c = d.client().await;
    let warm = [
        c.check_policy(&policy("pen", "{mig}pen", FailPolicy::Closed)).await.unwrap(),
        c.check(&args("{mig}plain", 100_000, 60_000)).await.unwrap(),
        c.reserve(FailPolicy::Closed, 0, &ItemArgs { policy: b"fixed_big", key: b"{mig}res", cost: 1 }).await.unwrap(),
    ];
    for r in &warm {
        assert_eq!((r.decision, r.source), (Decision::Allowed, Source::Redis), "{r:?}");
    }

    let slot = key_slot(TAG);
    let from = cluster.owner(slot);
    let to = cluster.primaries().into_iter().find(|&p| p != from).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let moving = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for kind in 0..4 {
        let mut c = d.client().await;
        let (stop, moving) = (stop.clone(), moving.clone());
        tasks.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            if kind == 1 {
                // The banned key's first call once the slot migrates (150 ms
                // into a migration of at least 300 ms): that call is the one
                // Redis answers, the next ones are answered from the ban it
                // taught `d`.
                while !moving.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            while !stop.load(Ordering::Relaxed) {
                // When sent: a call sent during the migration may be
                // answered after it, once its retries succeed.
                let sent = start.elapsed();
                let r = match kind {
                    0 => c.check_policy(&policy("pen", "{mig}pen", FailPolicy::Closed)).await,
                    1 => c.check_policy(&policy("strict", "{mig}banned", FailPolicy::Open)).await,
                    2 => c.reserve(FailPolicy::Closed, 0, &ItemArgs { policy: b"fixed_big", key: b"{mig}res", cost: 1 }).await,
                    _ => c.check(&CheckArgs { on_error: FailPolicy::Closed, ..args("{mig}plain", 100_000, 60_000) }).await,
                };
                answers.push((kind, sent, r.expect("answered")));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            answers
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let began = start.elapsed();
    moving.store(true, Ordering::Relaxed);
    // The slot's keys (the penalty boxes' windows, bans and strikes, the
    // plain and fixed windows, the reserves' settle records) in halves, 50 ms
    // apart: about half a second of migration, under the 1.5 s deadline.
    let c2 = Arc::new(cluster);
    let moved = {
        let cl = c2.clone();
        tokio::task::spawn_blocking(move || cl.move_slot_in_halves(slot, from, to, Duration::from_millis(50))).await.unwrap()
    };
    let ended = start.elapsed();
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Relaxed);
    let mut answers = Vec::new();
    for t in tasks {
        answers.extend(t.await.unwrap());
    }
    // Sent while the slot migrated.
    let during = |at: &Duration| *at >= began && *at <= ended;
    let names = ["penalty checks", "checks of the banned key", "reserves", "plain checks"];
    for (kind, name) in names.iter().enumerate() {
        let mine: Vec<&(usize, Duration, Response)> = answers.iter().filter(|(k, _, _)| *k == kind).collect();
        let while_moving = mine.iter().filter(|(_, at, _)| during(at)).count();
        let to_policy: Vec<_> = mine.iter().filter(|(_, _, r)| !by_redis(r)).collect();
        eprintln!("{name}: {} ({while_moving} during the {:?} migration in {moved} steps), {} to the fail policy", mine.len(), ended - began, to_policy.len());
        assert!(while_moving > 0, "{name}: some during the migration");
        assert!(to_policy.is_empty(), "{name}: none to the fail policy: {:?}\n{}", to_policy.first(), d.log());
    }
    let banned: Vec<&(usize, Duration, Response)> = answers.iter().filter(|(k, _, _)| *k == 1).collect();
    let (_, first_at, first) = banned[0];
    assert!(during(first_at) && first.source == Source::Redis, "Redis refused the banned key during the migration (began {began:?}, ended {ended:?}): {first:?} at {first_at:?}");
    for (_, at, r) in banned {
        assert_eq!(r.decision, Decision::Denied, "the banned key at {at:?}: {r:?}");
    }
    assert!(moved >= 2, "the slot's keys moved in steps: {moved}");
    assert_eq!(c2.owner(slot), to);
}
