//! Redis-specific behaviour with real `redis-server` processes: atomicity
//! across daemons, unique members, TTLs, script cache and reconnects, the
//! key namespace, and the fail policies when Redis is gone.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::clock::now_ms;
use common::redis_server::window;
use common::{args, Daemon, Deadline, RedisServer};
use common::redis_server::evalsha_calls;
use ratelimitd::protocol::{CheckArgs, Decision, ErrorCode, FailPolicy, Source};
use ratelimitd::window::LimitSpec;
use redis::Commands;
use tokio_util::sync::CancellationToken;

/// 1000 requests stamped with the same millisecond are all counted, and a
/// second daemon instance in that same millisecond adds its own 1000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_millisecond_requests_never_collide() {
    let r = RedisServer::start_unix();
    let token = CancellationToken::new();
    let (a, b) = (window(&r, &token).await, window(&r, &token).await);
    let now = now_ms();
    let spec = LimitSpec { key: b"same-ms", limit: 5000, window_ms: 60_000, cost: 1 };
    let mut tasks = Vec::new();
    for w in [a, b] {
        for _ in 0..4 {
            let w = w.clone();
            tasks.push(tokio::spawn(async move {
                let mut counts = Vec::new();
                for _ in 0..250 {
                    counts.push(w.check_at(&spec, now).await.unwrap().count);
                }
                counts
            }));
        }
    }
    let mut counts = Vec::new();
    for t in tasks {
        counts.extend(t.await.unwrap());
    }
    counts.sort_unstable();
    assert_eq!(counts, (1..=2000).collect::<Vec<u32>>());
    let mut conn = r.conn();
    let members: Vec<(String, u64)> = conn.zrange_withscores("ratelimitd:{same-ms}:60000ms", 0, -1).unwrap();
    assert_eq!(members.len(), 2000);
    assert!(members.iter().all(|(_, score)| *score == now));
    token.cancel();
}

/// Two daemons on one Redis hold one limit exactly, each with its denial
/// cache (on by default) answering the refusals it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_share_one_limit() {
    let r = RedisServer::start_unix();
    let daemons = [Daemon::start(Some(&r.url()), "timeout_ms = 500"), Daemon::start(Some(&r.url()), "timeout_ms = 500")];
    let mut tasks = Vec::new();
    for d in &daemons {
        for _ in 0..16 {
            let mut c = d.client().await;
            tasks.push(tokio::spawn(async move {
                let (mut allowed, mut cached) = (0, 0);
                for _ in 0..100 {
                    let resp = c.check(&args("shared", 1000, 60_000)).await.unwrap();
                    assert!(matches!(resp.source, Source::Redis | Source::DenialCache), "{resp:?}");
                    allowed += (resp.decision == Decision::Allowed) as u32;
                    cached += (resp.source == Source::DenialCache) as u32;
                }
                (allowed, cached)
            }));
        }
    }
    let (mut allowed, mut cached) = (0, 0);
    for t in tasks {
        let (a, c) = t.await.unwrap();
        allowed += a;
        cached += c;
    }
    assert_eq!(allowed, 1000, "3200 requests through two daemons");
    assert!(cached > 0, "no refusal came from a denial cache");
}

/// Under sustained load on a short window, no window of time ever holds more
/// admissions than the limit. Each admission happened (on Redis's clock, the
/// same host clock) between its send and its response; any admissions whose
/// whole [send, response] spans fit inside one window-long interval were in
/// the window together, so there can be at most `limit` of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_window_ever_exceeds_the_limit() {
    let r = RedisServer::start_unix();
    // Two daemons, each with its denial cache (on by default).
    let daemons = [Daemon::start(Some(&r.url()), "timeout_ms = 500"), Daemon::start(Some(&r.url()), "timeout_ms = 500")];
    const LIMIT: u32 = 50;
    const WINDOW: u64 = 200;
    let until = Instant::now() + Duration::from_millis(1200);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let mut c = daemons[i % 2].client().await;
        tasks.push(tokio::spawn(async move {
            let mut spans = Vec::new();
            while Instant::now() < until {
                let sent = now_ms();
                let resp = c.check(&args("sliding", LIMIT, WINDOW as u32)).await.unwrap();
                if resp.decision == Decision::Allowed {
                    spans.push((sent, now_ms()));
                }
            }
            spans
        }));
    }
    let mut spans = Vec::new();
    for t in tasks {
        spans.extend(t.await.unwrap());
    }
    spans.sort_unstable();
    for &(start, _) in &spans {
        let together = spans.iter().filter(|&&(s, e)| s >= start && e < start + WINDOW).count();
        assert!(together <= LIMIT as usize, "{together} admissions within one {WINDOW} ms window starting at {start}");
    }
    // And the window did slide: about LIMIT per WINDOW over 1.2 s were admitted.
    assert!(spans.len() >= 4 * LIMIT as usize && spans.len() <= 8 * LIMIT as usize, "{} admissions", spans.len());
}

/// Keys get a TTL of the window and vanish after it; admissions leave too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_after_the_window() {
    let r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), "timeout_ms = 500");
    let mut c = d.client().await;
    c.check(&args("ttl", 10, 250)).await.unwrap();
    let mut conn = r.conn();
    let ttl: i64 = conn.pttl("ratelimitd:{ttl}:250ms").unwrap();
    assert!(ttl > 0 && ttl <= 250, "pttl {ttl}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let exists: bool = conn.exists("ratelimitd:{ttl}:250ms").unwrap();
    assert!(!exists, "the key outlived its window");
}

/// Every key lands under the configured prefix, whatever the client sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_cannot_leave_the_namespace() {
    let r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), "timeout_ms = 500\nkey_prefix = \"gw1:\"");
    let mut c = d.client().await;
    for key in ["plain", "}escape{", "{tenant-1}:order", "*", "other:{x}", "../x", "a b", "{plain}"] {
        assert_eq!(c.check(&args(key, 5, 60_000)).await.unwrap().decision, Decision::Allowed);
    }
    let mut conn = r.conn();
    // Every key under the prefix; the link's start-up probe (its own key,
    // `{\0probe}`, expiring 1 ms after it) may still be there.
    let keys: HashSet<String> = conn.keys::<_, HashSet<String>>("*").unwrap().into_iter().filter(|k| !k.contains("\0probe")).collect();
    let want: HashSet<String> =
        ["gw1:{plain}", "gw1:~{plain}", "gw1:{}escape{}", "gw1:~{tenant-1}:order", "gw1:{*}", "gw1:~other:{x}", "gw1:{../x}", "gw1:{a b}"].iter().map(|s| format!("{s}:60000ms")).collect();
    assert_eq!(keys, want);
}

/// SCRIPT FLUSH while serving: requests keep being decided by Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_while_serving() {
    let r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), "timeout_ms = 500");
    let until = Instant::now() + Duration::from_millis(800);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let key = format!("flush-{i}");
            let mut n = 0;
            while Instant::now() < until {
                let resp = c.check(&args(&key, 1_000_000, 60_000)).await.unwrap();
                assert_eq!((resp.decision, resp.source, resp.error), (Decision::Allowed, Source::Redis, ErrorCode::None), "{}", resp.message);
                n += 1;
            }
            n
        }));
    }
    let mut conn = r.conn();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(120)).await;
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert!(total > 100, "only {total} requests were served");
    assert!(d.log().contains("script reloaded"), "NOSCRIPT led to a reload: {}", d.log());
}

/// Redis restarted: the daemon reconnects, reloads the script and decides
/// with Redis again, without a restart of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_redis_restart() {
    let mut r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), "timeout_ms = 200");
    let mut c = d.client().await;
    let a = CheckArgs { on_error: FailPolicy::Open, ..args("restart", 100, 60_000) };
    assert_eq!(c.check(&a).await.unwrap().source, Source::Redis);
    // The same socket path: the daemon reconnects to where it was told.
    r.restart();
    let back = Deadline::start("back on Redis", Duration::from_secs(10));
    loop {
        let resp = c.check(&a).await.unwrap();
        if resp.source == Source::Redis {
            // A fresh, empty server: counting starts over.
            assert_eq!(resp.count, 1);
            break;
        }
        assert_eq!(resp.source, Source::FailOpen);
        back.retry_in(Duration::from_millis(20), || resp.message.clone()).await;
    }
}

/// Redis gone: each request's own policy decides, fast, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_policies_apply_when_redis_is_down() {
    let mut r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), "");
    let mut c = d.client().await;
    assert_eq!(c.check(&args("down", 5, 60_000)).await.unwrap().source, Source::Redis);
    r.kill();
    let open = c.check(&CheckArgs { on_error: FailPolicy::Open, ..args("down", 5, 60_000) }).await.unwrap();
    assert_eq!((open.decision, open.source), (Decision::Allowed, Source::FailOpen));
    assert!(matches!(open.error, ErrorCode::RedisUnavailable | ErrorCode::RedisTimeout), "{:?}", open.error);
    let closed = c.check(&CheckArgs { on_error: FailPolicy::Closed, ..args("down", 5, 60_000) }).await.unwrap();
    assert_eq!((closed.decision, closed.source), (Decision::Denied, Source::FailClosed));
    assert!(closed.retry_after_ms > 0);
    let local = CheckArgs { on_error: FailPolicy::Local, local_limit: 2, ..args("down", 5, 60_000) };
    let mut decisions = Vec::new();
    for _ in 0..3 {
        let resp = c.check(&local).await.unwrap();
        assert_eq!(resp.source, Source::LocalFallback);
        decisions.push(resp.decision);
    }
    assert_eq!(decisions, [Decision::Allowed, Decision::Allowed, Decision::Denied]);
    assert!(d.log().contains("fail policy decides"), "fail-open is logged: {}", d.log());
}

/// SIGTERM: the daemon exits 0 and removes its socket file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_removes_the_socket() {
    let r = RedisServer::start_unix();
    let mut d = Daemon::start(Some(&r.url()), "");
    assert!(d.socket.exists());
    let status = d.terminate();
    assert!(status.success(), "{status:?}");
    assert!(!d.socket.exists());
}

/// The serial reference model of the sliding log: what Redis must decide
/// when requests come one by one at `now`.
#[derive(Default)]
struct SerialLog {
    /// (time, cost) of each admission.
    admissions: Vec<(u64, u32)>,
}

impl SerialLog {
    fn check(&mut self, now: u64, window: u64, limit: u32, cost: u32) -> (bool, u32) {
        self.admissions.retain(|&(t, _)| t + window > now);
        let count: u32 = self.admissions.iter().map(|&(_, c)| c).sum();
        if count + cost <= limit {
            self.admissions.push((now, cost));
            (true, count + cost)
        } else {
            (false, count)
        }
    }
}

/// Per-key coalescing sends queued requests in one call; the script must
/// judge them exactly as if they came one by one. Random batches (sizes,
/// costs, limits changing between requests, time moving so the window
/// slides) against real Redis and the serial model: every decision and
/// count must match.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_calls_decide_as_the_serial_model() {
    use ratelimitd::BatchAsk;
    let r = RedisServer::start_unix();
    let token = CancellationToken::new();
    let w = window(&r, &token).await;
    // A small deterministic generator: the same cases on every run.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let (mut decisions, mut mismatches) = (0, Vec::new());
    let mut conn = r.conn();
    for case in 0..40 {
        let key = format!("prop-{case}");
        let window = [50u64, 100, 1000][next(3) as usize];
        let mut model = SerialLog::default();
        let mut now = now_ms();
        for _ in 0..30 {
            now += next(window / 2 + 1);
            let n = 1 + next(12) as usize;
            let asks: Vec<BatchAsk> = (0..n)
                .map(|_| {
                    let limit = 1 + next(8) as u32;
                    BatchAsk { limit, cost: 1 + next(limit as u64) as u32 }
                })
                .collect();
            let got = w.check_batch_at(key.as_bytes(), window as u32, &asks, now).await.unwrap();
            assert_eq!(got.len(), n);
            // The script sets the key's TTL on Redis's real clock, while this
            // test runs its own clock ahead of it: a host stall longer than a
            // window would let Redis expire admissions the model still holds.
            // The window itself slides by the test's clock (the script's
            // cleanup), which is what is checked.
            let _: () = redis::cmd("PERSIST").arg(format!("ratelimitd:{{{key}}}:{window}ms")).query(&mut conn).unwrap();
            for (a, v) in asks.iter().zip(&got) {
                let (allowed, count) = model.check(now, window, a.limit, a.cost);
                decisions += 1;
                if (v.allowed, v.count) != (allowed, count) {
                    mismatches.push(format!("case {case} at {now}: {a:?} -> redis {:?}, model ({allowed}, {count})", (v.allowed, v.count)));
                }
            }
        }
    }
    println!("batched calls against the serial model: {decisions} decisions, {} mismatches", mismatches.len());
    assert!(mismatches.is_empty(), "{mismatches:#?}");
    token.cancel();
}

/// One hot key from 64 connections: requests that arrive while a call for
/// the key is in flight go to Redis together, so Redis runs far fewer calls
/// than there are decisions, and the limit still holds exactly. (Once the
/// key is full, the denial cache answers most refusals.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_is_coalesced_and_its_limit_holds() {
    let r = RedisServer::start_unix();
    // The per-request path (coalescing) is what this counts: with quota
    // leases (the default) a hot key's admissions would bypass Redis
    // (tests/quota_leases.rs counts those).
    let d = Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\nquota_leases = false\n", r.url()));
    let before = evalsha_calls(&r);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let mut allowed = 0u32;
            for _ in 0..100 {
                let resp = c.check(&args("hot", 3000, 60_000)).await.unwrap();
                // Past the limit, refusals come from the denial cache.
                assert!(matches!(resp.source, Source::Redis | Source::DenialCache), "{resp:?}");
                allowed += (resp.decision == Decision::Allowed) as u32;
            }
            allowed
        }));
    }
    let mut allowed = 0;
    for t in tasks {
        allowed += t.await.unwrap();
    }
    let calls = evalsha_calls(&r) - before;
    let metrics = ureq::get(&d.metrics_url()).call().unwrap().body_mut().read_to_string().unwrap();
    let metric = |prefix: &str| -> u64 { metrics.lines().find(|l| l.starts_with(prefix)).map_or(0, |l| l.rsplit(' ').next().unwrap().parse().unwrap()) };
    let coalesced = metric("ratelimitd_coalesced_requests_total ");
    let cached = metric("ratelimitd_decisions_total{decision=\"denied\",source=\"denial_cache\"}");
    println!("hot key, 64 connections: 6400 decisions, {calls} Redis calls ({:.3} per decision), {coalesced} coalesced, {cached} refused by the denial cache, {allowed} admitted", calls as f64 / 6400.0);
    assert_eq!(allowed, 3000, "exactly the limit");
    assert!(calls < 6400 / 4, "{calls} calls for 6400 decisions: not coalesced");
    // Every decision was a call of its own (at most `calls` of them), in a
    // batch, or from the cache.
    assert!(coalesced + cached + calls >= 6400, "{coalesced} coalesced, {cached} cached, {calls} calls");
    assert!(coalesced >= 1000, "the 3000 admissions went in batches: {coalesced} coalesced, {calls} calls");
}
