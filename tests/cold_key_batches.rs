//! Different keys in one script call (src/redis/scripts/sliding_window.lua, mode
//! 'B') against the same requests one by one: random traces on a real
//! redis-server, on virtual time. Every reply must be the same field by
//! field, and every key's log the same afterwards (members' count and
//! scores), as if each request had been a call of its own at that instant.

mod common;

use common::RedisServer;

const LOG: &str = common::scripts::LOG;

use common::rng::Rng;
use common::redis_server::evalsha_calls;

fn scores(conn: &mut redis::Connection, key: &str) -> Vec<u64> {
    let v: Vec<(String, u64)> = redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).arg("WITHSCORES").query(conn).unwrap();
    v.into_iter().map(|(_, s)| s).collect()
}

/// One trace: returns (decisions compared, admitted).
fn run_trace(conn: &mut redis::Connection, sha: &str, seed: u64, steps: usize) -> (usize, usize) {
    let mut rng = Rng(seed | 1);
    let keys = 2 + rng.below(8);
    let windows = [60_000u64, 90_000, 120_000];
    let max_limit = [3u64, 10, 50][rng.below(3) as usize];
    let mut now = 1_700_000_000_000u64;
    let (mut decisions, mut admitted) = (0, 0);
    for step in 0..steps {
        now += match rng.below(12) {
            0 => 0,
            1 => 30_000 + rng.below(90_000),
            _ => rng.below(2_000),
        };
        // A batch of 1-6 requests, keys drawn with repetition now and then.
        let n = 1 + rng.below(6);
        let asks: Vec<(u64, u64, u64, u64)> = (0..n)
            .map(|_| {
                let k = rng.below(keys);
                let limit = 1 + rng.below(max_limit);
                let cost = if rng.below(4) == 0 { 1 + rng.below(limit) } else { 1 };
                (k, windows[(k % 3) as usize], limit, cost)
            })
            .collect();
        let mut batch = redis::cmd("EVALSHA");
        batch.arg(sha).arg(asks.len());
        for (k, w, _, _) in &asks {
            batch.arg(format!("b:{{t{seed}k{k}}}:{w}"));
        }
        batch.arg("B").arg(now).arg(format!("m{step}"));
        for (_, w, limit, cost) in &asks {
            batch.arg(w).arg(limit).arg(cost);
        }
        let got: Vec<i64> = batch.query(conn).unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
        assert_eq!(got.len(), 5 * asks.len());
        for (i, (k, w, limit, cost)) in asks.iter().enumerate() {
            let one: Vec<i64> = redis::cmd("EVALSHA").arg(sha).arg(1).arg(format!("s:{{t{seed}k{k}}}:{w}")).arg(w).arg(now).arg(format!("m{step}.{i}")).arg(limit).arg(cost).query(conn).unwrap();
            assert_eq!(&got[5 * i..5 * i + 5], &one[..], "seed {seed} step {step} request {i} of {asks:?} at {now}");
            decisions += 1;
            admitted += one[0] as usize;
        }
        for (k, w, _, _) in &asks {
            assert_eq!(scores(conn, &format!("b:{{t{seed}k{k}}}:{w}")), scores(conn, &format!("s:{{t{seed}k{k}}}:{w}")), "seed {seed} step {step}: key {k}'s log");
        }
    }
    (decisions, admitted)
}

#[test]
fn a_batch_of_different_keys_decides_exactly_as_calls_one_by_one() {
    let r = RedisServer::start_unix();
    let mut conn = r.conn();
    let sha = common::scripts::load(&mut conn, LOG);
    let base = common::rng::base_seed("BATCH_SEED");
    let (mut decisions, mut admitted) = (0, 0);
    for t in 0..40u64 {
        let (d, a) = run_trace(&mut conn, &sha, base + t, 200);
        decisions += d;
        admitted += a;
    }
    eprintln!("base seed {base}: {decisions} decisions compared, {admitted} admitted, 0 mismatches");
    assert!(admitted > decisions / 10 && admitted < decisions * 9 / 10, "traces must mix admissions and refusals: {admitted} of {decisions}");
}

/// A real daemon with `batch_cold_keys`: 16 clients, each checking 150 keys
/// of its own twice (limit 1): every first check admitted, every second
/// refused, as one by one; and Redis ran fewer calls than there were checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_batching_cold_keys_decides_each_key_exactly_in_fewer_calls() {
    use ratelimitd::protocol::Decision;
    let redis = RedisServer::start_unix();
    let d = common::Daemon::start(Some(&redis.url()), "timeout_ms = 2000\nbatch_cold_keys = true\n[denial_cache]\nenabled = false");
    let before = evalsha_calls(&redis);
    let mut tasks = Vec::new();
    for c in 0..16 {
        let mut client = d.client().await;
        tasks.push(tokio::spawn(async move {
            for i in 0..150 {
                let key = format!("cold{c}-{i}");
                for expect in [Decision::Allowed, Decision::Denied] {
                    let r = client.check(&common::args(&key, 1, 60_000)).await.unwrap();
                    assert_eq!(r.decision, expect, "{key}: {r:?}");
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let calls = evalsha_calls(&redis) - before;
    eprintln!("4800 checks of 2400 keys in {calls} Redis calls");
    assert!(calls < 4800 * 9 / 10, "{calls} calls for 4800 checks: nothing was batched");
}
