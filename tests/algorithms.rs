//! Algorithm selection (docs/ALGORITHMS.md) through the real daemon, on a
//! real redis-server and on the in-memory backend: a CHECK's algorithm bits
//! and a policy's `algorithm` pick the store's script and key; each
//! algorithm keeps windows of its own; the denial cache and coalescing stay
//! exact for each (checked against a serial reference: the log).

mod common;

use common::{args, Daemon, RedisServer, Setup};
use ratelimitd::protocol::{Algorithm, CheckArgs, Decision, FailPolicy, PolicyCheckArgs, Source};

fn with_cost<'a>(a: &CheckArgs<'a>, cost: u32) -> CheckArgs<'a> {
    CheckArgs { cost, ..a.clone() }
}

/// `calls` of `cmdstat_evalsha` in `INFO commandstats`.
fn evalsha_calls(r: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut r.conn()).unwrap();
    info.lines().find_map(|l| l.strip_prefix("cmdstat_evalsha:calls=")).map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// The ring decides every request exactly as the log (same decision,
/// count and remaining; retry-after within the time between the two
/// calls), on both backends, and the two never share a window.
async fn ring_matches_the_log(setup: &Setup) {
    let mut c = setup.daemon().client().await;
    // A minute: nothing leaves the window during the test, so the two
    // sequences see the same state.
    let costs = [1, 3, 2, 5, 1, 1, 4, 2, 1, 6, 1, 1, 3];
    let mut admitted = 0;
    for (i, &cost) in costs.iter().enumerate() {
        let log = c.check_with(&with_cost(&args("same", 12, 60_000), cost), Algorithm::Log).await.unwrap();
        let ring = c.check_with(&with_cost(&args("same", 12, 60_000), cost), Algorithm::Ring).await.unwrap();
        // A refusal again at no smaller cost: the denial cache, for both.
        assert!(log.source == setup.source() || log.source == Source::DenialCache, "request {i}: {log:?}");
        assert_eq!((ring.decision, ring.source, ring.count, ring.remaining), (log.decision, log.source, log.count, log.remaining), "request {i} (cost {cost})");
        assert!(log.retry_after_ms.abs_diff(ring.retry_after_ms) <= 1000, "request {i}: {log:?} vs {ring:?}");
        admitted += u32::from(log.decision == Decision::Allowed) * cost;
    }
    assert_eq!(admitted, 12, "both filled the limit, each in its own window");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ring_decides_as_the_log_on_redis_in_a_key_of_its_own() {
    let setup = Setup::redis();
    ring_matches_the_log(&setup).await;
    let Setup::Redis(redis, _) = &setup else { unreachable!() };
    let mut conn = redis.conn();
    let kind = |k: &str, conn: &mut redis::Connection| -> String { redis::cmd("TYPE").arg(k).query(conn).unwrap() };
    assert_eq!(kind("ratelimitd:{same}:60000ms", &mut conn), "zset", "the log's key is the seed's");
    assert_eq!(kind("ratelimitd:{same}:60000ms:ring", &mut conn), "string");
    let usage = |k: &str, conn: &mut redis::Connection| -> u64 { redis::cmd("MEMORY").arg("USAGE").arg(k).query(conn).unwrap() };
    let (log, ring) = (usage("ratelimitd:{same}:60000ms", &mut conn), usage("ratelimitd:{same}:60000ms:ring", &mut conn));
    assert!(ring < log, "ring {ring} B, log {log} B for 12 admissions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ring_decides_as_the_log_in_memory() {
    ring_matches_the_log(&Setup::memory()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_algorithm_bits_are_refused_and_the_stream_stays_in_sync() {
    let d = Daemon::start(None, "");
    let mut c = d.client().await;
    let mut frame = bytes::BytesMut::new();
    ratelimitd::protocol::encode_request(5, &args("k", 10, 1000), &mut frame);
    frame[10] = 0x0F; // flags 0x0F00: no such algorithm
    c.send_raw(&frame).await.unwrap();
    let r = c.read_response().await.unwrap();
    assert_eq!((r.id, r.decision, r.error.as_str()), (5, Decision::Error, "UNKNOWN_ALGORITHM"), "{r:?}");
    assert_eq!(c.check_with(&args("k", 10, 1000), Algorithm::Ring).await.unwrap().decision, Decision::Allowed);
}

/// Coalescing and the denial cache with the ring: 60 concurrent requests
/// against a limit of 10 admit exactly 10 (batches are judged in order by
/// the script, as the serial log would); then a refusal is answered again
/// by the denial cache without a Redis call, and the log's window of the
/// same key is untouched by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalescing_and_the_denial_cache_stay_exact_for_the_ring() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n[denial_cache]\nmax_ms = 10000\n", redis.url()));
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            for _ in 0..10 {
                got.push(c.check_with(&args("burst", 10, 60_000), Algorithm::Ring).await.unwrap());
            }
            got
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let allowed = all.iter().filter(|r| r.decision == Decision::Allowed).count();
    assert_eq!(allowed, 10, "exactly the limit under concurrency");
    assert!(all.iter().all(|r| r.decision != Decision::Error), "{all:?}");

    let mut c = d.client().await;
    let first = c.check_with(&args("burst", 10, 60_000), Algorithm::Ring).await.unwrap();
    assert_eq!(first.decision, Decision::Denied);
    let calls = evalsha_calls(&redis);
    for _ in 0..20 {
        let r = c.check_with(&args("burst", 10, 60_000), Algorithm::Ring).await.unwrap();
        assert_eq!((r.decision, r.source), (Decision::Denied, Source::DenialCache), "{r:?}");
        assert!(r.retry_after_ms > 50_000, "{r:?}");
    }
    assert_eq!(evalsha_calls(&redis), calls, "refused without Redis");
    // The log's window of the same key is another window, and another cache entry.
    let log = c.check_with(&args("burst", 10, 60_000), Algorithm::Log).await.unwrap();
    assert_eq!((log.decision, log.source, log.count), (Decision::Allowed, Source::Redis, 1));
}

/// Redis down: the `local` fail policy decides a ring request with the
/// per-host window, and the client's algorithm does not change that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_fallback_serves_the_ring() {
    let mut redis = RedisServer::start_unix();
    let d = Daemon::start(Some(&redis.url()), "timeout_ms = 100");
    let mut c = d.client().await;
    let ring = CheckArgs { on_error: FailPolicy::Local, local_limit: 2, ..args("fb", 100, 60_000) };
    assert_eq!(c.check_with(&ring, Algorithm::Ring).await.unwrap().source, Source::Redis);
    redis.kill();
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = c.check_with(&ring, Algorithm::Ring).await.unwrap();
        assert_eq!(r.source, Source::LocalFallback, "{r:?}");
        got.push(r.decision);
    }
    assert_eq!(got, [Decision::Allowed, Decision::Allowed, Decision::Denied]);
}

/// `algorithm = "ring"` in a `[[policy]]`: CHECK_POLICY requests count in
/// the ring (its key has the `:ring` suffix), with the policy's limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_counts_with_its_algorithm() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start_config(&format!(
        "socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n[[policy]]\nname = \"lean\"\nlimit = 3\nwindow = \"60s\"\nalgorithm = \"ring\"\n",
        redis.url()
    ));
    let mut c = d.client().await;
    let ask = PolicyCheckArgs { policy: b"lean", key: b"t1", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(c.check_policy(&ask).await.unwrap().decision);
    }
    assert_eq!(got, [Decision::Allowed, Decision::Allowed, Decision::Allowed, Decision::Denied]);
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("ratelimitd:*").query(&mut redis.conn()).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].ends_with(b":60000ms:ring"), "{}", String::from_utf8_lossy(&keys[0]));
    let t: String = redis::cmd("TYPE").arg(&keys[0]).query(&mut redis.conn()).unwrap();
    assert_eq!(t, "string");
}
