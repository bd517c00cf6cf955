//! Algorithm selection (docs/ALGORITHMS.md) through the real daemon, on a
//! real redis-server and on the in-memory backend: a CHECK's algorithm bits
//! and a policy's `algorithm` pick the store's script and key; each
//! algorithm keeps windows of its own; the denial cache and coalescing stay
//! exact for each (checked against a serial reference: the log).

mod common;

use std::time::Duration;

use common::{args, Daemon, RedisServer, Setup};
use common::redis_server::evalsha_calls;
use ratelimitd::protocol::{Algorithm, CheckArgs, Decision, FailPolicy, ItemArgs, LeaseArgs, PolicyCheckArgs, PolicyLeaseArgs, Source, OP_ACQUIRE, OP_ACQUIRE_POLICY, OP_RELEASE};

fn with_cost<'a>(a: &CheckArgs<'a>, cost: u32) -> CheckArgs<'a> {
    CheckArgs { cost, ..a.clone() }
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
    let mut conn = setup.redis_conn();
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

/// GCRA (src/redis/scripts/gcra.lua, and the memory store's copy): a bucket of
/// `limit` tokens refilled at `limit` per window. From a full bucket the
/// burst passes, each admission carrying its pacing delay (0, T, 2T, ...);
/// the next is refused with the time until a token is back; one token per
/// T comes back.
async fn gcra_bursts_paces_and_refills(setup: &Setup) {
    let mut c = setup.daemon().client().await;
    // 10 per 1000 ms: T = 100 ms.
    let a = args("bucket", 10, 1000);
    let mut delays = Vec::new();
    for i in 0..10 {
        let r = c.check_with(&a, Algorithm::Gcra).await.unwrap();
        assert_eq!((r.decision, r.source, r.count, r.remaining), (Decision::Allowed, setup.source(), i + 1, 9 - i), "{r:?}");
        delays.push(r.retry_after_ms);
    }
    // Requests take a few ms each: delay i is i*100 less the time gone.
    for (i, &d) in delays.iter().enumerate() {
        let ideal = 100 * i as u32;
        assert!(d <= ideal && d + 400 >= ideal, "pacing delay {i}: {d} ms ({delays:?})");
    }
    let refused = c.check_with(&a, Algorithm::Gcra).await.unwrap();
    assert_eq!((refused.decision, refused.count, refused.remaining), (Decision::Denied, 10, 0), "{refused:?}");
    assert!((1..=100).contains(&refused.retry_after_ms), "{refused:?}");
    assert!(refused.reset_ms > 500 && refused.reset_ms <= 1000, "{refused:?}");
    // A cost of 3 needs three tokens back (the denial cache answers it
    // with the cost-1 refusal's retry-after: true, and documented as a
    // lower bound for larger costs).
    let three = c.check_with(&with_cost(&a, 3), Algorithm::Gcra).await.unwrap();
    assert_eq!(three.decision, Decision::Denied, "{three:?}");
    assert!(three.source == Source::DenialCache || three.retry_after_ms > 200, "{three:?}");
    tokio::time::sleep(Duration::from_millis(u64::from(refused.retry_after_ms) + 5)).await;
    let again = c.check_with(&a, Algorithm::Gcra).await.unwrap();
    assert_eq!(again.decision, Decision::Allowed, "a token came back: {again:?} (refused {refused:?}, three {three:?})");
    // The log's window of the same key never saw any of it.
    assert_eq!(c.check_with(&a, Algorithm::Log).await.unwrap().count, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_on_redis() {
    let setup = Setup::redis();
    gcra_bursts_paces_and_refills(&setup).await;
    let mut conn = setup.redis_conn();
    let tat: String = redis::cmd("GET").arg("ratelimitd:{bucket}:1000ms:gcra").query(&mut conn).unwrap();
    assert!(tat.parse::<f64>().unwrap() > 1.7e12, "one number, the TAT in ms: {tat}");
    let ttl: i64 = redis::cmd("PTTL").arg("ratelimitd:{bucket}:1000ms:gcra").query(&mut conn).unwrap();
    assert!((1..=1000).contains(&ttl), "kept until the bucket is full: {ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_in_memory() {
    gcra_bursts_paces_and_refills(&Setup::memory()).await;
}

/// With nginx: `limit_req`-style pacing. 20 requests at once against
/// 10/s with a burst of 20 (limit 20 per 2000 ms): all pass, and reach the
/// upstream one every 100 ms (arrival i at least i*100 ms after the first,
/// as the upstream's own clock sees it); with `nodelay` they reach it at
/// once; beyond the burst, 429.
#[test]
fn gcra_paces_a_burst_through_nginx() {
    let redis = RedisServer::start_unix();
    let d = common::ops::daemon(&redis, "");
    let snippet = common::ops::snippet(&d.socket);
    let nginx = common::Nginx::start(&format!(
        r#"{snippet}
lua_shared_dict arrivals 1m;
server {{
    listen 127.0.0.1:{{PORT:up}};
    location / {{
        content_by_lua_block {{
            ngx.update_time()
            ngx.shared.arrivals:rpush(ngx.var.uri, ngx.now())
            ngx.say("ok")
        }}
    }}
}}
server {{
    listen 127.0.0.1:{{PORT}};
    location /paced {{
        access_by_lua_block {{
            local lim = assert(require("resty.ratelimitd").new{{ algorithm = "gcra", limit = 20, window_ms = 2000 }})
            lim:limit("paced")
        }}
        proxy_pass http://127.0.0.1:{{PORT:up}};
    }}
    location /nodelay {{
        access_by_lua_block {{
            local lim = assert(require("resty.ratelimitd").new{{ algorithm = "gcra", limit = 20, window_ms = 2000, nodelay = true }})
            lim:limit("nodelay")
        }}
        proxy_pass http://127.0.0.1:{{PORT:up}};
    }}
    location /arrivals {{
        content_by_lua_block {{
            local d = ngx.shared.arrivals
            local path = ngx.var.arg_path
            local out = {{}}
            while true do
                local t = d:lpop(path)
                if not t then break end
                out[#out + 1] = string.format("%.3f", t)
            end
            ngx.say(table.concat(out, " "))
        }}
    }}
}}
"#
    ));
    let burst = |path: &str, n: usize| -> Vec<u16> {
        let url = nginx.url(path);
        let threads: Vec<_> = (0..n)
            .map(|_| {
                let url = url.clone();
                std::thread::spawn(move || {
                    let agent = common::http::agent();
                    agent.get(&url).call().unwrap().status().as_u16()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    };
    let arrivals = |path: &str| -> Vec<f64> {
        let mut r = ureq::get(&nginx.url(&format!("/arrivals?path={path}"))).call().unwrap();
        let mut v: Vec<f64> = r.body_mut().read_to_string().unwrap().split_whitespace().map(|t| t.parse().unwrap()).collect();
        v.sort_by(f64::total_cmp);
        v
    };

    let statuses = burst("/paced", 20);
    assert!(statuses.iter().all(|&s| s == 200), "paced, not refused: {statuses:?}\n{}", nginx.error_log());
    let paced = arrivals("/paced");
    assert_eq!(paced.len(), 20);
    // Arrival j is at least j * 100 ms after the first decision; the first
    // arrival is that decision plus its own trip to the upstream (a few ms,
    // more on a loaded machine): 60 ms of slack for it.
    for (i, t) in paced.iter().enumerate() {
        let after_ms = (t - paced[0]) * 1000.0;
        assert!(after_ms >= 100.0 * i as f64 - 60.0, "arrival {i} only {after_ms:.0} ms after the first: {paced:?}");
    }
    let span = (paced[19] - paced[0]) * 1000.0;
    assert!(span < 6000.0, "paced at the rate, not slower: {span:.0} ms");

    let statuses = burst("/nodelay", 25);
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    assert!((20..=22).contains(&ok) && statuses.iter().all(|&s| s == 200 || s == 429), "burst of 20, then refused: {statuses:?}");
    let at_once = arrivals("/nodelay");
    let span = (at_once[at_once.len() - 1] - at_once[0]) * 1000.0;
    assert!(span < 1000.0, "nodelay: the burst reaches the upstream at once, not paced over 1900 ms: {span:.0} ms");
}

fn lease_args<'a>(key: &'a str, lease: &'a str, limit: u32, lease_ms: u32) -> LeaseArgs<'a> {
    LeaseArgs { key: key.as_bytes(), lease: lease.as_bytes(), limit, lease_ms, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// Concurrency leases (ACQUIRE and RELEASE, src/redis/scripts/concurrency_slots.lua and
/// the memory store's): at most `limit` held; a release frees its slot at
/// once; a lease never released stops counting when it expires.
async fn leases_hold_release_and_expire(setup: &Setup) {
    let mut c = setup.daemon().client().await;
    let mut got = Vec::new();
    for lease in ["a", "b", "c"] {
        got.push(c.lease(OP_ACQUIRE, &lease_args("conns", lease, 2, 60_000)).await.unwrap());
    }
    let decisions: Vec<_> = got.iter().map(|r| (r.decision, r.count)).collect();
    assert_eq!(decisions, [(Decision::Allowed, 1), (Decision::Allowed, 2), (Decision::Denied, 2)], "{got:?}");
    assert_eq!(got[0].source, setup.source());
    assert!(got[2].retry_after_ms > 59_000, "until the earliest lease expires: {:?}", got[2]);
    let r = c.lease(OP_RELEASE, &lease_args("conns", "a", 2, 60_000)).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 1), "{r:?}");
    let r = c.lease(OP_RELEASE, &lease_args("conns", "a", 2, 60_000)).await.unwrap();
    assert_eq!(r.decision, Decision::Denied, "released already: {r:?}");
    assert_eq!(c.lease(OP_ACQUIRE, &lease_args("conns", "d", 2, 60_000)).await.unwrap().decision, Decision::Allowed, "the released slot");

    // A lost release: the lease stops counting when it expires, not before.
    let held = c.lease(OP_ACQUIRE, &lease_args("lost", "x", 1, 400)).await.unwrap();
    assert_eq!(held.decision, Decision::Allowed);
    let started = std::time::Instant::now();
    let refused = c.lease(OP_ACQUIRE, &lease_args("lost", "y", 1, 400)).await.unwrap();
    assert_eq!(refused.decision, Decision::Denied, "{refused:?}");
    assert!((1..=400).contains(&refused.retry_after_ms), "{refused:?}");
    tokio::time::sleep(Duration::from_millis(u64::from(refused.retry_after_ms) + 20)).await;
    let after = c.lease(OP_ACQUIRE, &lease_args("lost", "y", 1, 400)).await.unwrap();
    assert_eq!(after.decision, Decision::Allowed, "expired after {:?}: {after:?}", started.elapsed());
    let mut bad = lease_args("lost", "has space", 1, 400);
    assert_eq!(c.lease(OP_ACQUIRE, &bad).await.unwrap().error.as_str(), "INVALID_LEASE");
    bad.lease = b"ok";
    bad.lease_ms = 0;
    assert_eq!(c.lease(OP_ACQUIRE, &bad).await.unwrap().error.as_str(), "INVALID_LEASE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_on_redis() {
    let setup = Setup::redis();
    leases_hold_release_and_expire(&setup).await;
    let n: u64 = redis::cmd("ZCARD").arg("ratelimitd:{conns}:concurrency").query(&mut setup.redis_conn()).unwrap();
    assert_eq!(n, 2, "one member per lease held (b, d)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_in_memory() {
    leases_hold_release_and_expire(&Setup::memory()).await;
}

/// A named concurrency policy (`algorithm = "concurrency"`, op 7) on a real
/// Redis: up to its limit in flight, then refused until a release; an
/// override's limit for its key; an allowlisted key exempt; leases counted
/// under the policy-scoped key (not the inline one); an unknown name is
/// UNKNOWN_POLICY; a check of a concurrency policy, or a lease of a rate
/// policy, WRONG_POLICY_KIND; the per-policy counters count each outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_policy_acquires_refuses_and_releases() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start_config_with_metrics(&format!(
        "socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n\
         [[policy]]\nname = \"uploads\"\nalgorithm = \"concurrency\"\nlimit = 2\nlease = \"30s\"\nallowlist = [\"ops\"]\n[policy.overrides]\nbig = 3\n\
         [[policy]]\nname = \"rate\"\nlimit = 5\nwindow = \"1s\"\n",
        redis.url()
    ));
    let mut c = d.client().await;
    let ask = |key: &'static str, lease: &'static str| PolicyLeaseArgs { check: PolicyCheckArgs { policy: b"uploads", key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }, lease: lease.as_bytes() };
    let mut got = Vec::new();
    for lease in ["a", "b", "c"] {
        let r = c.policy_lease(false, &ask("t1", lease)).await.unwrap();
        assert_eq!((r.op, r.source), (OP_ACQUIRE_POLICY, Source::Redis), "{r:?}");
        got.push(r.decision);
    }
    assert_eq!(got, [Decision::Allowed, Decision::Allowed, Decision::Denied], "the policy's limit of 2 in flight");
    let refused = c.policy_lease(false, &ask("t1", "c")).await.unwrap();
    assert!(refused.retry_after_ms > 29_000 && refused.retry_after_ms <= 30_000, "until the first lease (the policy's 30 s) expires: {refused:?}");
    let zcard = |key: &[u8]| -> u64 { redis::cmd("ZCARD").arg(key).query(&mut redis.conn()).unwrap() };
    assert_eq!(zcard(b"ratelimitd:{\x07uploadst1}:concurrency"), 2, "held under the policy-scoped key");
    assert_eq!(zcard(b"ratelimitd:{t1}:concurrency"), 0, "not the inline key's");

    let r = c.policy_lease(true, &ask("t1", "a")).await.unwrap();
    assert_eq!(r.decision, Decision::Allowed, "released: {r:?}");
    assert_eq!(c.policy_lease(true, &ask("t1", "a")).await.unwrap().decision, Decision::Denied, "released already");
    assert_eq!(c.policy_lease(false, &ask("t1", "c")).await.unwrap().decision, Decision::Allowed, "the released slot");
    assert_eq!(zcard(b"ratelimitd:{\x07uploadst1}:concurrency"), 2);

    let mut big = Vec::new();
    for lease in ["a", "b", "c", "d"] {
        big.push(c.policy_lease(false, &ask("big", lease)).await.unwrap().decision);
    }
    assert_eq!(big, [Decision::Allowed, Decision::Allowed, Decision::Allowed, Decision::Denied], "the override's limit of 3");
    for lease in ["a", "b", "c"] {
        let r = c.policy_lease(false, &ask("ops", lease)).await.unwrap();
        assert_eq!((r.decision, r.source), (Decision::Allowed, Source::Exempt), "allowlisted");
    }

    let of_policy = |policy: &'static [u8]| {
        let a = ask("t1", "z");
        PolicyLeaseArgs { check: PolicyCheckArgs { policy, ..a.check }, ..a }
    };
    let unknown = of_policy(b"upload");
    assert_eq!(c.policy_lease(false, &unknown).await.unwrap().error.as_str(), "UNKNOWN_POLICY");
    let check = c.check_policy(&PolicyCheckArgs { policy: b"uploads", key: b"t1", cost: 1, on_error: FailPolicy::Open, local_limit: 0 }).await.unwrap();
    assert_eq!((check.decision, check.error.as_str()), (Decision::Error, "WRONG_POLICY_KIND"), "not a silent window check: {check:?}");
    assert!(check.message.contains("concurrency policy"), "{check:?}");
    let items = [ItemArgs { policy: b"rate", key: b"t1", cost: 1 }, ItemArgs { policy: b"uploads", key: b"t1", cost: 1 }];
    let multi = c.check_multi(FailPolicy::Open, 0, false, &items).await.unwrap();
    assert_eq!((multi.decision, multi.error.as_str()), (Decision::Error, "WRONG_POLICY_KIND"), "nor as one item of several: {multi:?}");
    let rate = of_policy(b"rate");
    assert_eq!(c.policy_lease(false, &rate).await.unwrap().error.as_str(), "WRONG_POLICY_KIND");
    let mut bad = ask("t1", "has space");
    assert_eq!(c.policy_lease(false, &bad).await.unwrap().error.as_str(), "INVALID_LEASE");
    bad.lease = b"ok";
    bad.check.cost = 3;
    assert_eq!(c.policy_lease(false, &bad).await.unwrap().error.as_str(), "INVALID_COST", "above the limit of 2");
    let still = c.policy_lease(false, &ask("t1", "e")).await.unwrap();
    assert_eq!(still.decision, Decision::Denied, "the stream is in sync after the errors: {still:?}");

    let agent = common::http::agent();
    let text = agent.get(&d.metrics_url()).call().unwrap().body_mut().read_to_string().unwrap();
    let sample = |outcome: &str| -> u64 {
        let start = format!("ratelimitd_policy_requests_total{{policy=\"uploads\",outcome=\"{outcome}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(start.as_str())).unwrap_or_else(|| panic!("no {start} in\n{text}")).parse().unwrap()
    };
    // Admitted: a, b, release a, c, big a-c. Refused: c, c, release a again, big d, e.
    // Errors: the check, the item of several, the cost above the limit.
    assert_eq!((sample("admitted"), sample("refused"), sample("exempt"), sample("error")), (7, 5, 3, 3), "{text}");
}

/// nginx with the snippet pointed at `d`, an upstream server (`/slow`
/// answers after 5 s, anything else at once) and a front server holding
/// `front`, its locations (`{PORT:up}` is the upstream's port).
fn behind_a_slow_upstream(d: &Daemon, front: &str) -> common::Nginx {
    let snippet = common::ops::snippet(&d.socket);
    common::Nginx::start(&format!(
        r#"{snippet}
server {{
    listen 127.0.0.1:{{PORT:up}};
    location /slow {{ content_by_lua_block {{ ngx.sleep(5) ngx.say("late") }} }}
    location / {{ content_by_lua_block {{ ngx.say("ok") }} }}
}}
server {{
    listen 127.0.0.1:{{PORT}};
{front}}}
"#
    ))
}

/// The status nginx answers `GET path` with.
fn status_of(nginx: &common::Nginx, path: &str) -> u16 {
    common::http::get(&common::http::agent(), &nginx.url(path), &[]).status
}

/// `GET /slow` sent on a raw connection, which the test shuts down to
/// abort the request.
fn slow_request(nginx: &common::Nginx) -> std::net::TcpStream {
    use std::io::Write;
    let mut slow = std::net::TcpStream::connect(("127.0.0.1", nginx.port)).unwrap();
    slow.write_all(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
    slow
}

/// Through nginx: a request holds its slot while its upstream works; the
/// client aborts it; nginx finalizes it (499), log_by_lua releases the
/// lease, and the next request passes at once, long before the lease
/// (30 s) or the upstream (5 s) would have freed it.
#[test]
fn a_client_abort_releases_its_slot() {
    let redis = RedisServer::start_unix();
    let d = common::ops::daemon(&redis, "");
    let nginx = behind_a_slow_upstream(
        &d,
        r#"
    location / {
        access_by_lua_block {
            local conns = assert(require("resty.ratelimitd").concurrency{ limit = 1, lease_ms = 30000 })
            conns:enter("tenant-1")
        }
        log_by_lua_block { require("resty.ratelimitd").leave() }
        proxy_pass http://127.0.0.1:{PORT:up};
    }
"#,
    );
    let status = |path: &str| status_of(&nginx, path);
    let slow = slow_request(&nginx);
    let zcard = || -> u64 { redis::cmd("ZCARD").arg("ratelimitd:{tenant-1}:concurrency").query(&mut redis.conn()).unwrap() };
    common::wait_until("the slow request holds its lease", Duration::from_secs(5), || zcard() == 1);
    assert_eq!(status("/fast"), 429, "one in flight: the slot is taken");

    slow.shutdown(std::net::Shutdown::Both).unwrap();
    drop(slow);
    let aborted = std::time::Instant::now();
    while zcard() != 0 && aborted.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let released_after = aborted.elapsed();
    let members: Vec<String> = redis::cmd("ZRANGE").arg("ratelimitd:{tenant-1}:concurrency").arg(0).arg(-1).query(&mut redis.conn()).unwrap();
    assert_eq!(zcard(), 0, "the aborted request's lease is released at once {members:?}\n{}\n{}", nginx.error_log(), d.log());
    assert_eq!(status("/fast"), 200, "the slot is free again");
    assert!(released_after < Duration::from_secs(3), "released by the abort, not by the upstream or the lease: {released_after:?}");
    // Released from a zero-delay timer after the log phase: it may land
    // just after the client has its response.
    common::wait_until("the fast request released its own", Duration::from_secs(3), || zcard() == 0);
    let log = nginx.error_log();
    assert!(!log.contains("ratelimitd: release"), "{log}");
}

/// Redis unreachable: a concurrency policy's own `fail_policy` replaces
/// the location's (closed: refused though the location says open); a policy
/// without one follows the location's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_policy_applies_its_own_fail_policy() {
    let gone = RedisServer::start_unix().url(); // stopped and removed at once
    let d = Daemon::start_config(&format!(
        "socket_mode = \"0600\"\n[redis]\nurl = \"{gone}\"\ntimeout_ms = 200\n\
         [[policy]]\nname = \"strict\"\nalgorithm = \"concurrency\"\nlimit = 2\nlease = \"30s\"\nfail_policy = \"closed\"\n\
         [[policy]]\nname = \"lax\"\nalgorithm = \"concurrency\"\nlimit = 2\nlease = \"30s\"\n"
    ));
    let mut c = d.client().await;
    let ask = |policy: &'static [u8]| PolicyLeaseArgs { check: PolicyCheckArgs { policy, key: b"t1", cost: 1, on_error: FailPolicy::Open, local_limit: 0 }, lease: b"a" };
    let strict = c.policy_lease(false, &ask(b"strict")).await.unwrap();
    assert_eq!((strict.decision, strict.source), (Decision::Denied, Source::FailClosed), "the policy's fail_policy: {strict:?}");
    let lax = c.policy_lease(false, &ask(b"lax")).await.unwrap();
    assert_eq!((lax.decision, lax.source), (Decision::Allowed, Source::FailOpen), "the location's: {lax:?}");
}

/// A named concurrency policy through nginx: `concurrency{ policy = ... }`
/// holds the policy's one slot while a slow request is in flight (429 for
/// the next), under the policy-scoped key; the client aborts; log_by_lua
/// releases it and the next request passes. A location naming a rate
/// policy gets the invalid status (WRONG_POLICY_KIND), not a silent pass;
/// a limit given to a policy limiter is refused when it is built.
#[test]
fn a_concurrency_policy_holds_and_releases_through_nginx() {
    let redis = RedisServer::start_unix();
    let d = common::ops::daemon(&redis, &(common::concurrency_policy("uploads", 1, "30s") + &common::rate_policies(&[("rate", 5, "1s")])));
    let nginx = behind_a_slow_upstream(
        &d,
        r#"
    location /bad-options {
        content_by_lua_block {
            local lim, err = require("resty.ratelimitd").concurrency{ policy = "uploads", limit = 3 }
            ngx.say(tostring(lim), " ", err)
        }
    }
    location /rate {
        access_by_lua_block {
            local conns = assert(require("resty.ratelimitd").concurrency{ policy = "rate", on_error = "open" })
            conns:enter("tenant-1")
        }
        log_by_lua_block { require("resty.ratelimitd").leave() }
        proxy_pass http://127.0.0.1:{PORT:up};
    }
    location / {
        access_by_lua_block {
            local conns = assert(require("resty.ratelimitd").concurrency{ policy = "uploads", on_error = "closed" })
            conns:enter("tenant-1")
        }
        log_by_lua_block { require("resty.ratelimitd").leave() }
        proxy_pass http://127.0.0.1:{PORT:up};
    }
"#,
    );
    let status = |path: &str| status_of(&nginx, path);
    let body = common::http::get(&common::http::agent(), &nginx.url("/bad-options"), &[]).body;
    assert!(body.starts_with("nil concurrency: limit is not an option of a policy limiter"), "{body}");

    let scoped = b"ratelimitd:{\x07uploadstenant-1}:concurrency";
    let zcard = || -> u64 { redis::cmd("ZCARD").arg(&scoped[..]).query(&mut redis.conn()).unwrap() };
    assert_eq!(status("/fast"), 200, "{}\n{}", nginx.error_log(), d.log());
    // Released from a zero-delay timer after the log phase: it may land
    // just after the client has its response.
    common::wait_until("released after the request", Duration::from_secs(3), || zcard() == 0);
    let slow = slow_request(&nginx);
    common::wait_until("the slow request holds the policy's slot", Duration::from_secs(5), || zcard() == 1);
    assert_eq!(status("/fast"), 429, "the policy's limit of 1 in flight");
    slow.shutdown(std::net::Shutdown::Both).unwrap();
    drop(slow);
    common::wait_until("the aborted request's lease is released", Duration::from_secs(3), || zcard() == 0);
    assert_eq!(status("/fast"), 200, "the slot is free again");

    assert_eq!(status("/rate"), 500, "a rate policy named as a concurrency one is a configuration error, not a pass");
    let log = nginx.error_log();
    assert!(log.contains("WRONG_POLICY_KIND"), "{log}");
    assert!(!log.contains("ratelimitd: release"), "{log}");
}

/// Every algorithm and the leases on a real Redis Cluster (six nodes), with
/// `SCRIPT FLUSH` on every primary first: each node that lost the scripts
/// gets the right script's EVAL on NOSCRIPT, per algorithm, and every
/// request is decided by Redis as on a single Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_on_a_cluster_after_script_flush() {
    let cluster = common::redis_cluster::RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\ncluster = [{}]\ntimeout_ms = 1000\n", seeds.join(", ")));
    let mut c = d.client().await;
    assert_eq!(c.check(&args("warm", 10, 60_000)).await.unwrap().source, Source::Redis);
    for p in cluster.primaries() {
        assert_eq!(cluster.cli(p, &["SCRIPT", "FLUSH"]).trim(), "OK");
    }
    for &algorithm in Algorithm::ALL {
        // Keys over several slots, so every primary sees each script.
        for k in 0..6 {
            let key = format!("{algorithm}-{k}");
            let mut allowed = 0;
            for _ in 0..4 {
                let r = c.check_with(&args(&key, 3, 60_000), algorithm).await.unwrap();
                assert!(matches!(r.source, Source::Redis | Source::DenialCache), "{algorithm}: {r:?}");
                allowed += u32::from(r.decision == Decision::Allowed);
            }
            assert_eq!(allowed, 3, "{algorithm} {key}");
        }
    }
    for k in 0..6 {
        let key = format!("conns-{k}");
        let a = c.lease(OP_ACQUIRE, &lease_args(&key, "l1", 1, 60_000)).await.unwrap();
        let b = c.lease(OP_ACQUIRE, &lease_args(&key, "l2", 1, 60_000)).await.unwrap();
        let r = c.lease(OP_RELEASE, &lease_args(&key, "l1", 1, 60_000)).await.unwrap();
        assert_eq!((a.decision, b.decision, r.decision, a.source), (Decision::Allowed, Decision::Denied, Decision::Allowed, Source::Redis), "{key}");
    }
}

/// `ratelimitd inspect` and `reset` see every algorithm's key of a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_reset_see_every_algorithm() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start(Some(&redis.url()), "timeout_ms = 500");
    let mut c = d.client().await;
    for &algorithm in Algorithm::ALL {
        for _ in 0..2 {
            assert_eq!(c.check_with(&args("t1", 10, 60_000), algorithm).await.unwrap().decision, Decision::Allowed);
        }
    }
    let bin = env!("CARGO_BIN_EXE_ratelimitd");
    let out = std::process::Command::new(bin).args(["inspect", "--config"]).arg(&d.config).args(["--key", "t1", "--scan", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let seen: Vec<(String, u64)> = all.as_array().unwrap().iter().map(|w| (w["algorithm"].as_str().unwrap().to_string(), w["in_window"].as_u64().unwrap())).collect();
    let expected: Vec<(String, u64)> = [("log", 2), ("ring", 2), ("gcra", 1), ("sliding_counter", 2), ("fixed", 2)].iter().map(|(a, n)| (a.to_string(), *n)).collect();
    assert_eq!(seen, expected, "{all}");
    let out = std::process::Command::new(bin).args(["reset", "--config"]).arg(&d.config).args(["--key", "t1", "--window-ms", "60000"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 5, "{}", String::from_utf8_lossy(&out.stdout));
    for &algorithm in Algorithm::ALL {
        assert_eq!(c.check_with(&args("t1", 10, 60_000), algorithm).await.unwrap().count, 1, "{algorithm}: whole again");
    }
}

/// Through nginx, the three other algorithms chosen in the Lua client
/// (`new{ algorithm = ... }`): each admits its limit and refuses the rest,
/// in a Redis key of its own (`...:<window>ms:<algorithm>`); the fixed
/// window's refusal says when the UTC hour ends (the real reset).
#[test]
fn ring_sliding_counter_and_fixed_through_nginx() {
    let redis = RedisServer::start_unix();
    let d = common::ops::daemon(&redis, "");
    let snippet = common::ops::snippet(&d.socket);
    let mut locations = String::new();
    for (name, window_ms) in [("ring", 60_000), ("sliding_counter", 60_000), ("fixed", 3_600_000)] {
        locations += &format!(
            r#"
    location /{name} {{
        access_by_lua_block {{
            local lim = assert(require("resty.ratelimitd").new{{ algorithm = "{name}", limit = 5, window_ms = {window_ms} }})
            lim:limit("nginx-{name}")
        }}
        content_by_lua_block {{ ngx.say("ok") }}
    }}"#
        );
    }
    let nginx = common::Nginx::start(&format!("{snippet}\nserver {{\n    listen 127.0.0.1:{{PORT}};{locations}\n}}\n"));
    let agent = common::http::agent();
    for (name, window_ms) in [("ring", 60_000u64), ("sliding_counter", 60_000), ("fixed", 3_600_000)] {
        let mut statuses = Vec::new();
        let mut retry_after = None;
        for _ in 0..7 {
            let r = agent.get(&nginx.url(&format!("/{name}"))).call().unwrap();
            statuses.push(r.status().as_u16());
            if r.status().as_u16() == 429 {
                retry_after = r.headers().get("Retry-After").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
            }
        }
        assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429], "{name}: the limit, then refusals\n{}\n{}", nginx.error_log(), d.log());
        let key = format!("ratelimitd:{{nginx-{name}}}:{window_ms}ms:{name}");
        let exists: u32 = redis::cmd("EXISTS").arg(&key).query(&mut redis.conn()).unwrap();
        assert_eq!(exists, 1, "{name}: its own Redis key {key}");
        let retry = retry_after.expect("a 429 carries Retry-After");
        if name == "fixed" {
            // The hour's end on the wall clock (Redis TIME is this host's).
            let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
            let to_end = 3600 - now_s % 3600;
            assert!(retry.abs_diff(to_end) <= 2, "fixed: Retry-After {retry} s, the UTC hour ends in {to_end} s");
        } else if name == "ring" {
            assert!((1..=60).contains(&retry), "ring: Retry-After {retry} s within the 60 s window");
        } else {
            // The counter's refusal lasts until the current fixed window's
            // admissions weigh little enough: up to the end of the next
            // fixed window (docs/ALGORITHMS.md, "Response fields").
            assert!((1..=120).contains(&retry), "sliding_counter: Retry-After {retry} s within two 60 s windows");
        }
    }
}
