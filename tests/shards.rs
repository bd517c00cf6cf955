//! Hot-key shards (`shards = S` on a `[[policy]]`, docs/SCALING.md) against
//! a real Redis and a real Redis Cluster, through the real daemon: the key's
//! limit split over S windows never admits more than the limit in any
//! window of Redis's own record, reaches it under overload, and on the
//! cluster puts the shards on different primaries.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis_cluster::RedisCluster;
use common::{Daemon, RedisServer};
use ratelimitd::protocol::{Decision, FailPolicy, PolicyCheckArgs, Source};

const LIMIT: u32 = 300;
const WINDOW_MS: f64 = 1000.0;
const SHARDS: usize = 3;
const POLICY: &str = "[[policy]]\nname = \"hot\"\nlimit = 300\nwindow = \"1s\"\nshards = 3\n";
/// How long the load runs: a few windows.
const LOAD: Duration = Duration::from_millis(2500);

/// What a test reads of Redis: the shard windows' keys, and one's members
/// with their scores (admission times, ms).
trait Record: Send + Sync + 'static {
    fn shard_keys(&self) -> Vec<Vec<u8>>;
    fn members(&self, key: &[u8]) -> Vec<(Vec<u8>, f64)>;
}

struct Single(RedisServer);

impl Record for Single {
    fn shard_keys(&self) -> Vec<Vec<u8>> {
        redis::cmd("KEYS").arg("*hott1\x1f*").query(&mut self.0.conn()).unwrap()
    }
    fn members(&self, key: &[u8]) -> Vec<(Vec<u8>, f64)> {
        redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES").query(&mut self.0.conn()).unwrap()
    }
}

/// The cluster, and which primary each shard key was found on.
struct Cluster(RedisCluster, std::sync::Mutex<HashMap<Vec<u8>, u16>>);

impl Cluster {
    /// The primary the shard key was last found on by `shard_keys`.
    fn owner(&self, key: &[u8]) -> u16 {
        self.1.lock().unwrap()[key]
    }
}

impl Record for Cluster {
    fn shard_keys(&self) -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        for p in self.0.primaries() {
            for k in self.0.cli(p, &["--scan", "--pattern", "*hott1\x1f*"]).lines().filter(|l| !l.is_empty()) {
                self.1.lock().unwrap().insert(k.as_bytes().to_vec(), p);
                keys.push(k.as_bytes().to_vec());
            }
        }
        keys
    }
    fn members(&self, key: &[u8]) -> Vec<(Vec<u8>, f64)> {
        let out = self.0.cli(self.owner(key), &["ZRANGE", std::str::from_utf8(key).unwrap(), "0", "-1", "WITHSCORES"]);
        let lines: Vec<&str> = out.lines().collect();
        lines.chunks(2).filter(|c| c.len() == 2).map(|c| (c[0].as_bytes().to_vec(), c[1].parse().unwrap())).collect()
    }
}

/// 8 connections sending CHECK_POLICY "hot"/"t1" for `LOAD` while a thread
/// copies every shard window's members every 100 ms (a member stays in its
/// window for 1 s, so none is missed unless a copy takes that long).
/// Checks Redis's record and returns it per shard key.
async fn overload_and_check(d: &Daemon, record: Arc<dyn Record>) -> HashMap<Vec<u8>, usize> {
    let stop = Arc::new(AtomicBool::new(false));
    let copier = std::thread::spawn({
        let (stop, record) = (stop.clone(), record.clone());
        move || {
            let mut seen: HashMap<Vec<u8>, (Vec<u8>, f64)> = HashMap::new();
            let mut worst_gap = Duration::ZERO;
            let mut last = Instant::now();
            loop {
                let done = stop.load(Ordering::Relaxed);
                for key in record.shard_keys() {
                    for (m, score) in record.members(&key) {
                        seen.insert(m, (key.clone(), score));
                    }
                }
                worst_gap = worst_gap.max(last.elapsed());
                last = Instant::now();
                if done {
                    return (seen, worst_gap);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    });
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let a = PolicyCheckArgs { policy: b"hot", key: b"t1", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
            let start = Instant::now();
            let mut admitted = 0u32;
            while start.elapsed() < LOAD {
                let r = c.check_policy(&a).await.unwrap();
                assert!(matches!(r.source, Source::Redis | Source::DenialCache), "{r:?}");
                assert_eq!(r.count + r.remaining, LIMIT, "the key's limit in count + remaining: {r:?}");
                admitted += u32::from(r.decision == Decision::Allowed);
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            admitted
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let (seen, worst_gap) = copier.join().unwrap();

    let mut times: Vec<f64> = seen.values().map(|(_, t)| *t).collect();
    times.sort_by(f64::total_cmp);
    // Every window of Redis's record: the admissions in (t - 1 s, t].
    let mut most = 0;
    let mut from = 0;
    for (i, &t) in times.iter().enumerate() {
        while times[from] <= t - WINDOW_MS {
            from += 1;
        }
        most = most.max(i + 1 - from);
    }
    let mut per_shard: HashMap<Vec<u8>, usize> = HashMap::new();
    for (key, _) in seen.values() {
        *per_shard.entry(key.clone()).or_default() += 1;
    }
    eprintln!(
        "{admitted} admitted in {LOAD:?}, {} in Redis's record over {} shards, most in one window {most}, worst copy gap {worst_gap:?}",
        times.len(),
        per_shard.len()
    );
    assert_eq!(per_shard.len(), SHARDS, "{:?}", per_shard.keys().collect::<Vec<_>>());
    assert!(most <= LIMIT as usize, "a window holds {most} admissions, over the limit {LIMIT}");
    assert_eq!(most, LIMIT as usize, "under overload some window reaches the limit");
    if worst_gap < Duration::from_millis(900) {
        assert_eq!(times.len(), admitted as usize, "Redis's record holds every admission");
    }
    // Over 2.5 windows of overload at least two limits' worth pass.
    assert!(admitted >= 2 * LIMIT, "{admitted} admitted");
    per_shard
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_hold_the_limit_on_one_redis() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{POLICY}", redis.url()));
    let record = Arc::new(Single(redis));
    overload_and_check(&d, record.clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_hold_the_limit_on_different_primaries_of_a_cluster() {
    let cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 500\n{POLICY}", seeds.join(", ")));
    let record = Arc::new(Cluster(cluster, Default::default()));
    let per_shard = overload_and_check(&d, record.clone()).await;
    let owners: BTreeSet<u16> = per_shard.keys().map(|k| record.owner(k)).collect();
    assert_eq!(owners.len(), SHARDS, "the {SHARDS} shards on {SHARDS} different primaries: {owners:?}");
}
