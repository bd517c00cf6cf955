//! Overload is not an outage (issue 14): a busy but healthy Redis must not
//! open the breaker. Before the fix, the load (checks of distinct
//! keys over 4 connections, 100 pipelined on each) had 0.4-1.3 % of the
//! requests decided by the fail policy, mostly `CIRCUIT_OPEN`: calls queued
//! behind each other in the daemon's own pipeline missed the 20 ms deadline
//! together and five in a row opened the breaker.
//!
//! Here, with a real redis-server and the product's defaults, the test
//! measures in the same run what this host's Redis sustains through the
//! daemon, then offers 0.5x, 1x and 2x of it at a fixed rate (the crate's
//! own load generator, `ratelimitd bench`'s library), then the issue's
//! burst. At 0.5x no request may get the fail policy; at no load may the
//! breaker open; at 2x the excess is shed with `OVERLOADED` while Redis
//! keeps deciding. The figures
//! are printed (`--nocapture`); the bounds are generous for a loaded 2-core
//! CI machine. Speed itself is scripts/bench-overload's business.

mod common;

use std::time::Duration;

use common::{Daemon, Deadline, RedisServer};
use ratelimitd::bench::{self, BenchArgs, BenchReport};
use ratelimitd::protocol::Source;

/// The daemon's Redis deadline in this test.
const DEADLINE_MS: u64 = 200;
/// Connections of the fixed-rate loads: many workers.
const WORKERS: usize = 16;

async fn scrape(d: &Daemon) -> String {
    let url = d.metrics_url();
    tokio::task::spawn_blocking(move || ureq::get(&url).call().unwrap().body_mut().read_to_string().unwrap()).await.unwrap()
}

/// Breaker openings so far, from the metrics endpoint.
async fn breaker_opened(d: &Daemon) -> u64 {
    let text = scrape(d).await;
    let line = text.lines().find(|l| l.starts_with("ratelimitd_breaker_opened_total ")).unwrap_or_else(|| panic!("no breaker counter in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

fn code(r: &BenchReport, name: &str) -> u64 {
    r.codes.get(name).copied().unwrap_or(0)
}

/// One run of distinct keys over `conns` connections; returns the report
/// and how often the breaker opened meanwhile.
async fn run(d: &Daemon, name: &str, conns: usize, requests: u64, pipeline: usize, rate: Option<f64>) -> (BenchReport, u64) {
    let before = breaker_opened(d).await;
    let args = BenchArgs { pipeline, rate, distinct_keys: true, ..BenchArgs::new(d.socket.clone(), name, 1_000_000, 1000, requests, conns) };
    let r = bench::run(args).await.unwrap_or_else(|e| panic!("{name}: {e}"));
    let opened = breaker_opened(d).await - before;
    let redis = r.requests - r.degraded;
    eprintln!(
        "{name:>6}: offered {:>7.0}/s, answered {:>7.0}/s, by redis {:>7.0}/s, fail policy {:.3} % {:?}, p50 {} µs, p99 {} µs, breaker opened {opened}",
        r.offered_rps,
        r.rps,
        redis as f64 / r.elapsed_s,
        100.0 * r.degraded as f64 / r.requests as f64,
        r.codes,
        r.p50_us,
        r.p99_us
    );
    assert_eq!(r.requests, requests, "{name}: every request is answered");
    (r, opened)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_shed_at_once_and_a_healthy_redis_never_opens_the_breaker() {
    let r = RedisServer::start_unix();
    // A 200 ms deadline: a loaded 2-core machine stalls Redis and the
    // daemon for tens of ms (more than 50 ms seen), which no admission
    // control can prevent; the product's 20 ms is measured by
    // scripts/bench-overload. The 2x load still fails a daemon without
    // admission control: its 16 connections queue up to 16 x 128 calls,
    // about 300 ms of this debug build's Redis rate, and timeouts open the
    // breaker.
    let d = Daemon::start_config_with_metrics(&format!("[redis]\nurl = \"{}\"\ntimeout_ms = {DEADLINE_MS}\n", r.url()));
    let up = Deadline::start("link up", Duration::from_secs(5));
    let mut c = d.client().await;
    while c.check(&common::args("up", 10, 1000)).await.unwrap().source != Source::Redis {
        up.retry_in(Duration::from_millis(10), String::new).await;
    }

    // What Redis sustains through the daemon: 16 in flight keep it busy,
    // and the in-flight limit (redis.min_in_flight) never goes below 16, so
    // nothing is shed.
    let (cap, opened) = run(&d, "capacity", 4, 20_000, 4, None).await;
    assert_eq!((opened, code(&cap, "OVERLOADED")), (0, 0), "{cap:?}");
    let capacity = cap.requests as f64 / cap.elapsed_s;
    assert!(capacity > 500.0, "Redis decided only {capacity:.0}/s through the daemon: {cap:?}");

    // Half of it: room to spare, so Redis decides every request.
    let secs = 2.0;
    let half = capacity * 0.5;
    let (low, opened) = run(&d, "0.5x", WORKERS, (half * secs) as u64, 1000, Some(half)).await;
    assert_eq!(opened, 0);
    assert_eq!(low.degraded, 0, "at 0.5x of capacity every request is decided by Redis: {low:?}");

    let (_, opened) = run(&d, "1x", WORKERS, (capacity * secs) as u64, 1000, Some(capacity)).await;
    assert_eq!(opened, 0, "at 1x the breaker stays closed");

    // Twice as much as Redis sustains: the excess is shed, Redis keeps deciding.
    let (high, opened) = run(&d, "2x", WORKERS, (2.0 * capacity * secs) as u64, 1000, Some(2.0 * capacity)).await;
    assert_eq!(opened, 0, "at 2x the breaker stays closed: {high:?}");
    assert_eq!(code(&high, "CIRCUIT_OPEN"), 0, "{high:?}");
    let by_redis = (high.requests - high.degraded) as f64 / high.elapsed_s;
    assert!(by_redis > capacity * 0.25, "at 2x Redis still decides a good part: {by_redis:.0}/s of {capacity:.0}/s");
    // Most admitted calls meet the deadline: the queue is kept short. (Not
    // all: a loaded host stalls Redis itself now and then.)
    assert!(code(&high, "REDIS_TIMEOUT") * 10 < high.requests, "admitted calls meet the deadline: {high:?}");

    // The load, shorter: 400 in flight over 4 connections, as fast
    // as answered (a closed loop: a shed request is answered in µs and its
    // connection sends the next at once).
    let (burst, opened) = run(&d, "burst", 4, 60_000, 100, None).await;
    assert_eq!(opened, 0, "the issue's burst opened the breaker: {burst:?}");
    assert_eq!(code(&burst, "CIRCUIT_OPEN"), 0, "{burst:?}");
    assert!(burst.requests > burst.degraded, "Redis decided some of the burst: {burst:?}");

    let text = scrape(&d).await;
    eprintln!("{}", text.lines().filter(|l| l.starts_with("ratelimitd_redis_timeouts_total{") || l.starts_with("ratelimitd_redis_in_flight_limit ")).collect::<Vec<_>>().join("\n"));
    assert!(d.log().contains("OVERLOADED") || code(&high, "OVERLOADED") == 0, "shedding is logged:\n{}", d.log());
    assert!(!d.log().contains("breaker open"), "{}", d.log());
}
