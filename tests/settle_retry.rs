//! Settles and reserve take-backs that meet a Redis failure are retried by
//! the daemon in the background until Redis answers (issue 33 items 7b and
//! 7d; src/settle_retry.rs, docs/FAILURES.md "Settles during a failure"),
//! through the real daemon and a real redis-server stopped with SIGSTOP:
//!
//! - settles refused with `CIRCUIT_OPEN` (never sent) are applied once
//!   Redis answers again: the window holds the actuals, no record is left;
//! - a reserve whose call timed out (Redis ran it on SIGCONT: charged, its
//!   record written) gets no handle, and the daemon takes it back: the
//!   window returns to 0, no record is left.

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, Deadline, RedisServer};
use ratelimitd::protocol::{Decision, ErrorCode, FailPolicy, ItemArgs, PolicyCheckArgs, Response, HANDLE_LEN};

const POLICY: &str = "[[policy]]\nname = \"tokens\"\nalgorithm = \"fixed\"\nlimit = 100000\nwindow = \"1d\"\n";

fn start(redis: &RedisServer, breaker_failures: u32) -> Daemon {
    Daemon::start_config(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 200\nbreaker_failures = {breaker_failures}\n{POLICY}", redis.url()))
}

fn item(key: &str, cost: u32) -> ItemArgs<'_> {
    ItemArgs { policy: b"tokens", key: key.as_bytes(), cost }
}

fn handle(r: &Response) -> Option<[u8; HANDLE_LEN]> {
    r.extension.as_ref().and_then(|e| e.handle)
}

/// The key's fixed window count and the settle records left in Redis.
fn count_and_records(redis: &RedisServer, key: &str) -> (u64, usize) {
    let mut c = redis.conn();
    let pattern = format!("ratelimitd:{{\u{6}tokens{key}}}:*");
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg(pattern.as_bytes()).query(&mut c).unwrap();
    let records = keys.iter().filter(|k| k.windows(8).any(|w| w == b":settle:")).count();
    let count = keys
        .iter()
        .find(|k| !k.windows(8).any(|w| w == b":settle:"))
        .map_or(0, |k| redis::cmd("GET").arg(k.as_slice()).query::<String>(&mut c).unwrap().split(' ').nth(1).unwrap().parse().unwrap());
    (count, records)
}

/// Polls until the key's window holds `want` with no record left; the time
/// Pauses `redis` and checks until the daemon's breaker is open: one
/// timeout opens it (breaker_failures = 1), and from then on nothing is
/// sent to Redis.
async fn pause_until_the_breaker_opens(redis: &RedisServer, c: &mut ratelimitd::client::Client) {
    redis.pause();
    let probe = PolicyCheckArgs { policy: b"tokens", key: b"probe", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
    let opened = Instant::now();
    while c.check_policy(&probe).await.unwrap().error != ErrorCode::CircuitOpen {
        assert!(opened.elapsed() < Duration::from_secs(5), "the breaker never opened");
    }
}

/// Redis, a daemon on it (breaker_failures = 1), a client, and the
/// handles of `n` reserves of 1000 for `key` the client made, each admitted.
async fn with_reserves(key: &str, n: usize) -> (RedisServer, Daemon, ratelimitd::client::Client, Vec<[u8; HANDLE_LEN]>) {
    let redis = RedisServer::start_unix();
    let d = start(&redis, 1);
    let mut c = d.client().await;
    let mut handles = Vec::new();
    for _ in 0..n {
        let r = c.reserve(FailPolicy::Closed, 0, &item(key, 1000)).await.unwrap();
        handles.push(handle(&r).expect("a reserve admitted"));
    }
    (redis, d, c, handles)
}

/// Waits until Redis holds the count `want` for `key` and no reserve's
/// record: how long it took, or a panic with what Redis holds after `limit`.
async fn settled_within(redis: &RedisServer, key: &str, want: u64, limit: Duration) -> Duration {
    let deadline = Deadline::start(format!("{key} settled"), limit);
    loop {
        let got = count_and_records(redis, key);
        if got == (want, 0) {
            return deadline.elapsed();
        }
        deadline.retry_in(Duration::from_millis(50), || format!("Redis holds (count, records) {got:?}, want ({want}, 0)")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settles_refused_while_the_breaker_is_open_are_applied_once_redis_answers() {
    let (redis, _d, mut c, handles) = with_reserves("t", 5).await;
    assert_eq!(count_and_records(&redis, "t"), (5000, 5));
    pause_until_the_breaker_opens(&redis, &mut c).await;
    for h in &handles {
        let s = c.settle(h, &item("t", 100)).await.unwrap();
        assert_eq!((s.decision, s.error), (Decision::Error, ErrorCode::CircuitOpen), "{s:?}");
    }
    redis.resume();
    let took = settled_within(&redis, "t", 500, Duration::from_secs(20)).await;
    eprintln!("5 settles met CIRCUIT_OPEN; applied {took:?} after Redis resumed");
    // Applied once: a client's own retry now finds no record.
    let again = c.settle(&handles[0], &item("t", 100)).await.unwrap();
    assert_eq!((again.decision, again.count), (Decision::Allowed, 0), "{again:?}");
    assert_eq!(count_and_records(&redis, "t"), (500, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_whose_call_timed_out_is_taken_back() {
    let redis = RedisServer::start_unix();
    // The breaker stays closed: every reserve reaches Redis's socket.
    let d = start(&redis, 1000);
    let mut c = d.client().await;
    redis.pause();
    for _ in 0..5 {
        let r = c.reserve(FailPolicy::Closed, 0, &item("t", 1000)).await.unwrap();
        assert_eq!((r.error, handle(&r)), (ErrorCode::RedisTimeout, None), "{r:?}");
    }
    let resumed = Instant::now();
    redis.resume();
    // Redis runs the five reserves now (5000 charged, 5 records), then the
    // daemon's take-backs.
    let took = settled_within(&redis, "t", 0, Duration::from_secs(20)).await;
    eprintln!("5 reserves timed out; taken back {took:?} after Redis resumed ({:?} in all)", resumed.elapsed());
    let r = c.reserve(FailPolicy::Closed, 0, &item("t", 1000)).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 1000), "nothing of the timed-out reserves is left: {r:?}");
}

/// The bound docs/FAILURES.md states: at most 16,384 settles wait
/// (`MAX_PENDING`); one more is dropped and counted. 16,484 settles (with
/// handles of no reserve: queued all the same) while the breaker is open;
/// once Redis answers, every queued one is answered (no record: nothing
/// changes). The counters say so, and the daemon's memory grows by less
/// than 40 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_16384_settles_wait_and_one_more_is_dropped_and_counted() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 200\nbreaker_failures = 1\n{POLICY}", redis.url()));
    let metric = |name: &str| -> u64 {
        let text = common::http::get(&common::http::agent(), &d.metrics_url(), &[]).body;
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or_else(|| panic!("{name} in {text}"))
    };
    let rss_kb = || std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap().lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap().trim().trim_end_matches(" kB").trim().parse::<u64>().unwrap();
    let mut c = d.client().await;
    pause_until_the_breaker_opens(&redis, &mut c).await;
    // Reserves refused before they were sent (the breaker open) have
    // nothing to take back: none is queued (else 50 more would be dropped).
    for _ in 0..50 {
        let r = c.reserve(FailPolicy::Closed, 0, &item("t", 10)).await.unwrap();
        assert_eq!(r.error, ErrorCode::CircuitOpen, "{r:?}");
    }
    let before = rss_kb();
    let tasks: Vec<_> = (0..4u32)
        .map(|t| {
            let socket = d.socket.clone();
            tokio::spawn(async move {
                let mut c = ratelimitd::client::Client::connect(&socket).await.unwrap();
                for i in 0..4121u32 {
                    let mut h = [0u8; HANDLE_LEN];
                    h[..4].copy_from_slice(&t.to_be_bytes());
                    h[4..8].copy_from_slice(&i.to_be_bytes());
                    let s = c.settle(&h, &ItemArgs { policy: b"tokens", key: b"flood", cost: 1 }).await.unwrap();
                    assert_eq!(s.error, ErrorCode::CircuitOpen, "{s:?}");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let grown = rss_kb().saturating_sub(before);
    assert_eq!((metric("ratelimitd_settle_retries_queued_total"), metric("ratelimitd_settle_retries_dropped_total")), (16_384, 100));
    assert!(d.log().contains("a settle to retry was dropped: too many wait already"), "{}", d.log());
    assert!(grown < 40_000, "16,384 settles waiting grew the daemon by {grown} kB");
    redis.resume();
    let resumed = Instant::now();
    while metric("ratelimitd_settle_retries_applied_total") < 16_384 {
        assert!(resumed.elapsed() < Duration::from_secs(60), "applied {} of 16384 after 60 s", metric("ratelimitd_settle_retries_applied_total"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("16,384 settles waited ({grown} kB of daemon memory), 100 dropped; all answered {:?} after Redis resumed", resumed.elapsed());
}

/// Idempotence: a settle sent to a stopped Redis times out, is queued,
/// and runs when Redis resumes (applied, never answered); its retries
/// then find no record. Another reserve held in the same window shows
/// that the surplus was given back once: 1000 + 100, not 1000 + 100 - 900.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_applied_but_unanswered_is_not_applied_again_by_its_retries() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 200\nbreaker_failures = 1000\n{POLICY}", redis.url()));
    let applied = || {
        let text = common::http::get(&common::http::agent(), &d.metrics_url(), &[]).body;
        text.lines().find_map(|l| l.strip_prefix("ratelimitd_settle_retries_applied_total ")?.parse::<u64>().ok()).unwrap()
    };
    let mut c = d.client().await;
    let held = c.reserve(FailPolicy::Closed, 0, &item("t", 1000)).await.unwrap();
    let settled = c.reserve(FailPolicy::Closed, 0, &item("t", 1000)).await.unwrap();
    assert!(handle(&held).is_some());
    redis.pause();
    let s = c.settle(&handle(&settled).unwrap(), &item("t", 100)).await.unwrap();
    assert_eq!(s.error, ErrorCode::RedisTimeout, "{s:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.resume();
    // Redis ran the settle on resuming; the daemon's retry finds no record.
    let resumed = Instant::now();
    while applied() < 1 {
        assert!(resumed.elapsed() < Duration::from_secs(20), "the retry was never answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(count_and_records(&redis, "t"), (1100, 1), "the surplus given back once; the held reserve's record left");
}

/// A reload during the outage replaces the Redis link (the old one stops
/// after the shutdown grace, 2 s here): the settles queued before it are
/// retried on the new link once Redis answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settles_queued_before_a_reload_are_retried_on_the_new_link() {
    let (redis, d, mut c, handles) = with_reserves("r", 3).await;
    pause_until_the_breaker_opens(&redis, &mut c).await;
    for h in &handles {
        assert_eq!(c.settle(h, &item("r", 100)).await.unwrap().error, ErrorCode::CircuitOpen);
    }
    d.signal(nix::sys::signal::Signal::SIGHUP);
    let reloaded = Instant::now();
    while !d.log().contains("configuration reloaded") {
        assert!(reloaded.elapsed() < Duration::from_secs(10), "no reload: {}", d.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The old link is stopped by now.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    redis.resume();
    let took = settled_within(&redis, "r", 300, Duration::from_secs(20)).await;
    eprintln!("3 settles queued before a reload applied {took:?} after Redis resumed");
}
