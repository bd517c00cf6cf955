//! The daemon's denial cache against a real `redis-server`: a refused key is
//! refused again without a Redis call (source `denial_cache`, Redis's
//! EVALSHA count unchanged) until Redis could admit it, and no later; a
//! limit change or a smaller cost goes to Redis; a daemon without the cache
//! agrees with it. (Two daemons sharing one limit, with the cache on by
//! default: tests/redis.rs.)

mod common;

use std::time::{Duration, Instant};

use common::{args, Daemon, RedisServer};
use common::redis_server::evalsha_calls;
use ratelimitd::protocol::{CheckArgs, Decision, Source};

fn cost<'a>(a: &CheckArgs<'a>, cost: u32) -> CheckArgs<'a> {
    CheckArgs { cost, ..a.clone() }
}

fn metric(d: &Daemon, line_start: &str) -> u64 {
    let text = ureq::get(&d.metrics_url()).call().unwrap().body_mut().read_to_string().unwrap();
    text.lines().find_map(|l| l.strip_prefix(line_start)).unwrap_or_else(|| panic!("no {line_start} in\n{text}")).trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_key_is_refused_without_redis_until_redis_would_admit_it() {
    const LIMIT: u32 = 3;
    const WINDOW: u32 = 1500;
    let redis = RedisServer::start_unix();
    // max_ms above the window: one entry covers the whole wait.
    let cached = Daemon::start_config_with_metrics(&format!(
        "socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n[denial_cache]\nmax_ms = 10000\n",
        redis.url()
    ));
    let plain = Daemon::start(Some(&redis.url()), "timeout_ms = 500\n[denial_cache]\nenabled = false");
    let (mut c, mut p) = (cached.client().await, plain.client().await);
    let key = args("hot", LIMIT, WINDOW);

    for i in 0..LIMIT {
        let r = c.check(&key).await.unwrap();
        assert_eq!((r.decision, r.source), (Decision::Allowed, Source::Redis), "request {i}");
    }
    let refused_sent = Instant::now(); // before the daemon sent it to Redis
    let refused = c.check(&key).await.unwrap();
    let refused_at = Instant::now(); // after Redis ran it
    assert_eq!((refused.decision, refused.source), (Decision::Denied, Source::Redis));
    let retry = Duration::from_millis(refused.retry_after_ms.into());
    assert!(retry > Duration::from_millis(500), "{refused:?}");
    let calls = evalsha_calls(&redis);

    // Hammered: refused here, Redis not asked; a larger cost too.
    for i in 0..200 {
        let r = c.check(&key).await.unwrap();
        assert_eq!((r.decision, r.source, r.count, r.remaining), (Decision::Denied, Source::DenialCache, LIMIT, 0), "request {i}");
        assert!(r.retry_after_ms >= 1 && r.retry_after_ms <= refused.retry_after_ms, "{r:?}");
        assert!(r.reset_ms >= r.retry_after_ms, "{r:?}");
    }
    assert_eq!(c.check(&cost(&key, 2)).await.unwrap().source, Source::DenialCache);
    assert_eq!(evalsha_calls(&redis), calls, "no Redis call for a cached refusal");
    assert_eq!(metric(&cached, "ratelimitd_decisions_total{decision=\"denied\",source=\"denial_cache\"}"), 201);

    // Another limit is another entry: Redis decides (and refuses: 3 > 2).
    let other = c.check(&args("hot", 2, WINDOW)).await.unwrap();
    assert_eq!((other.decision, other.source), (Decision::Denied, Source::Redis));
    // The daemon without the cache asks Redis, which agrees.
    let r = p.check(&key).await.unwrap();
    assert_eq!((r.decision, r.source), (Decision::Denied, Source::Redis));
    let calls = evalsha_calls(&redis);

    // Until the retry time: still refused here. Polled every ms; each
    // answer's send time on this host's monotonic clock (the daemon's).
    let mut answers = Vec::new();
    loop {
        let sent = Instant::now();
        let r = c.check(&key).await.unwrap();
        answers.push((sent, r.decision, r.source));
        if r.decision == Decision::Allowed {
            break;
        }
        assert!(sent < refused_at + retry + Duration::from_secs(5), "never admitted again: {r:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Never late: no cached refusal of a request sent after Redis could
    // admit (the refusal ran in Redis before `refused_at`).
    let deadline = refused_at + retry;
    for &(sent, decision, source) in &answers {
        if source == Source::DenialCache {
            assert!(sent < deadline, "cached refusal {:?} after the retry time", sent - deadline);
        }
        // Sent a ms past it (Redis reads whole ms), Redis admits.
        if sent >= deadline + Duration::from_millis(1) {
            assert_eq!(decision, Decision::Allowed, "{:?} past the retry time", sent - deadline);
        }
    }
    // Not early either: everything sent well before the retry time was
    // answered by the cache (the entry lives until 1.75 ms before the send
    // time + retry; 100 ms allow for a stalled daemon).
    let redis_answers: Vec<_> = answers.iter().filter(|a| a.2 == Source::Redis).map(|a| a.0).collect();
    assert!(redis_answers.iter().all(|&sent| sent + Duration::from_millis(100) >= refused_sent + retry), "asked Redis early");
    assert!(evalsha_calls(&redis) - calls <= redis_answers.len() as u64);
    assert!(redis_answers.len() <= 10, "{} Redis calls around the retry time", redis_answers.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_live_at_most_max_ms_so_a_reset_is_seen_within_it() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start(Some(&redis.url()), "timeout_ms = 500\n[denial_cache]\nmax_ms = 200");
    let mut c = d.client().await;
    let key = args("reset-me", 1, 60_000);
    assert_eq!(c.check(&key).await.unwrap().decision, Decision::Allowed);
    assert_eq!(c.check(&key).await.unwrap().source, Source::Redis);
    assert_eq!(c.check(&key).await.unwrap().source, Source::DenialCache);
    // A smaller cost than the refused one may fit: asked again. (Cost 1 is
    // the smallest, so this needs a refusal of cost 2 first.)
    let big = args("small-after-big", 3, 60_000);
    assert_eq!(c.check(&cost(&big, 2)).await.unwrap().decision, Decision::Allowed);
    assert_eq!(c.check(&cost(&big, 2)).await.unwrap().source, Source::Redis);
    assert_eq!(c.check(&cost(&big, 3)).await.unwrap().source, Source::DenialCache);
    let small = c.check(&big).await.unwrap();
    assert_eq!((small.decision, small.source), (Decision::Allowed, Source::Redis), "a cost of 1 fits 2 of 3");

    // An admin reset (DEL) is not seen by the cache, but within max_ms.
    let reset_at = Instant::now();
    let _: () = redis::cmd("DEL").arg("ratelimitd:{reset-me}:60000ms").query(&mut redis.conn()).unwrap();
    loop {
        let sent = Instant::now();
        let r = c.check(&key).await.unwrap();
        if r.decision == Decision::Allowed {
            assert_eq!(r.count, 1);
            break;
        }
        // The entry was made before the reset: it ends within 200 ms of it.
        assert_eq!(r.source, Source::DenialCache);
        assert!(sent < reset_at + Duration::from_millis(200), "refused {:?} after the reset", sent - reset_at);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
