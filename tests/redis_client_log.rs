//! The Redis client library's own log lines, under the daemon's rate limit
//! (src/log_limit.rs `LibraryLog`): a real six-node Cluster, the real
//! daemon with the log filter it ships with (`log.level = "info"`: the
//! harness's usual `ratelimitd=debug` hides every library line), a primary
//! SIGKILLed under load, and the daemon's log counted.
//!
//! This file holds one test: it sets `DAEMON_RUST_LOG` for the daemons it
//! starts, which would change the log of any other test in the process.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis_cluster::{key_slot, RedisCluster};
use common::{args, Daemon};
use ratelimitd::protocol::{CheckArgs, FailPolicy};
use tokio::sync::Notify;

/// The module path of every log line the Redis client library writes
/// (redis-rs logs through `log`, under its module's path).
const LIBRARY: &str = " redis::";

/// One primary killed under about 1,000 checks a second: before the limit,
/// 2,206-2,228 lines in 3.4 s, about two per request ("Failed to connect to
/// node", "beginning slot refresh"). Now each of the library's modules
/// writes at most one line a second, and before a line that follows lines
/// held back, one line saying how many (`held_back=N`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_logs_the_redis_client_at_most_once_a_second() {
    std::env::set_var("DAEMON_RUST_LOG", "info");
    let mut cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    // A deadline above the product's 20 ms: the 2-core machine also runs
    // six redis-servers and the failover.
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 60\n", seeds.join(", ")));

    // A key on each primary, picked by slot (the daemon's key for a 1 s
    // inline window is `ratelimitd:{KEY}:1000ms`).
    let mut keys: Vec<(&'static str, u16)> = Vec::new();
    for i in 0.. {
        let key: &'static str = Box::leak(format!("flood-{i}").into_boxed_str());
        let owner = cluster.owner(key_slot(key.as_bytes()));
        if !keys.iter().any(|&(_, o)| o == owner) {
            keys.push((key, owner));
        }
        if keys.len() == 3 {
            break;
        }
    }
    let victim = keys[0].1;

    let stop = Arc::new(Notify::new());
    let mut tasks = Vec::new();
    for conn in 0..12 {
        let mut c = d.client().await;
        let stop = stop.clone();
        let key = keys[conn % 3].0;
        tasks.push(tokio::spawn(async move {
            let a = CheckArgs { on_error: FailPolicy::Open, ..args(key, 1_000_000, 1000) };
            let stopped = stop.notified();
            tokio::pin!(stopped);
            let mut sent = 0u64;
            loop {
                tokio::select! {
                    _ = &mut stopped => return sent,
                    r = c.check(&a) => { r.expect("every request gets an answer"); }
                }
                sent += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines_before = d.log().lines().count();
    let killed = Instant::now();
    cluster.kill(victim);
    assert!(cluster.wait_ok(Duration::from_secs(20)), "the replica is promoted");
    // And a second of load on the new map.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.notify_waiters();
    let mut requests = 0;
    for t in tasks {
        requests += t.await.unwrap();
    }
    let secs = killed.elapsed().as_secs_f64();

    let log = d.log();
    let after: Vec<&str> = log.lines().skip(lines_before).collect();
    // Per module of the library: its lines, and the notes of lines held back.
    let mut lines: BTreeMap<&str, usize> = BTreeMap::new();
    let mut notes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut held_back = 0u64;
    for l in &after {
        if let Some(at) = l.find("library=") {
            let module = l[at + "library=".len()..].split_whitespace().next().unwrap_or_default().trim_matches('"');
            *notes.entry(module).or_default() += 1;
            held_back += l.split("held_back=").nth(1).and_then(|n| n.split_whitespace().next()).and_then(|n| n.parse::<u64>().ok()).expect("a note says how many lines it held back");
        } else if let Some(at) = l.find(LIBRARY) {
            let rest = &l[at + 1..];
            *lines.entry(&rest[..rest.find(": ").unwrap_or(rest.len())]).or_default() += 1;
        }
    }
    let library_lines: usize = lines.values().sum();
    let shown: Vec<&str> = after.iter().map(|l| &l[..l.len().min(300)]).take(60).collect();
    eprintln!(
        "{requests} checks in {secs:.1} s ({:.0}/s) from the kill of {victim}: {} log lines, {library_lines} from the Redis client library {lines:?}, \
         {} notes of lines held back {notes:?} holding back {held_back}",
        requests as f64 / (secs + 0.5),
        after.len(),
        notes.values().sum::<usize>()
    );
    // A load at all (about 1,000 a second on a quiet machine, 340 seen on a
    // loaded one; the library wrote about two lines per check before).
    assert!(requests as f64 / (secs + 0.5) > 100.0, "the load is a load: {requests} checks");
    assert!(library_lines > 0, "the library's lines still come through:\n{}", shown.join("\n"));
    // At most once a second per module: one at the start of each second
    // from the first, so ceil(secs) + 1 at most over the run.
    let per_module = secs.ceil() as usize + 1;
    for (module, n) in lines.iter().chain(notes.iter()) {
        assert!(*n <= per_module, "{module}: {n} lines in {secs:.1} s (at most {per_module}):\n{}", shown.join("\n"));
    }
    assert!(after.len() <= 60, "{} log lines in {secs:.1} s after the kill:\n{}", after.len(), shown.join("\n"));
}
