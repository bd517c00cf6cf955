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

/// Issue 23: a flood of new keys pipelined deep over few connections on a
/// healthy Redis that answers each call well within the deadline:
/// admission sheds only what would miss the deadline, so here nothing. The
/// earlier latency-gradient limit kept the mean queueing within 1/4 of the
/// deadline and shed part of such a burst although Redis answered every
/// call in time. 8 connections x 100 pipelined (800 in flight, about 100 ms
/// of this debug daemon's pace on a loaded 2-core host), a 500 ms deadline
/// (the host's own stalls reach 100-300 ms under the other builds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_redis_answering_within_the_deadline_costs_no_request_its_decision() {
    const HEALTHY_DEADLINE_MS: u64 = 500;
    let r = RedisServer::start_unix();
    let d = Daemon::start_config_with_metrics(&format!("[redis]\nurl = \"{}\"\ntimeout_ms = {HEALTHY_DEADLINE_MS}\nmax_in_flight = 100000\n", r.url()));
    let up = Deadline::start("link up", Duration::from_secs(5));
    let mut c = d.client().await;
    while c.check(&common::args("up", 10, 1000)).await.unwrap().source != Source::Redis {
        up.retry_in(Duration::from_millis(10), String::new).await;
    }
    // A busy pipeline first, so that the service time is measured (with
    // nothing measured nothing is shed at all, which would prove nothing).
    let (warm, _) = run(&d, "warm", 4, 10_000, 16, None).await;
    assert_eq!(code(&warm, "OVERLOADED"), 0, "{warm:?}");
    for round in 0..3 {
        let (burst, opened) = run(&d, &format!("burst{round}"), 8, 24_000, 100, None).await;
        assert_eq!(opened, 0, "{burst:?}");
        // The premise: Redis answered within the deadline.
        assert!(burst.p99_us < HEALTHY_DEADLINE_MS * 1000, "Redis too slow on this host for the premise: {burst:?}");
        assert_eq!(code(&burst, "OVERLOADED"), 0, "a healthy Redis answering in time: nothing shed: {burst:?}");
        assert_eq!(burst.degraded, code(&burst, "REDIS_TIMEOUT"), "only a host stall may cost a decision: {burst:?}");
        assert!(burst.degraded * 1000 <= burst.requests, "{burst:?}");
    }
    let text = scrape(&d).await;
    let limit = text.lines().find(|l| l.starts_with("ratelimitd_redis_in_flight_limit ")).unwrap_or_default().to_string();
    eprintln!("{limit}");
    assert!(!limit.is_empty() && !limit.ends_with(" 100000"), "the service time was measured (the limit left its unmeasured max): {limit}");
}

/// One check's outcome, seen by the client.
struct Seen {
    sent: Duration,
    took: Duration,
    error: ratelimitd::protocol::ErrorCode,
    source: Source,
}

/// A Redis stalled (SIGSTOP) longer than the deadline: once it has been
/// silent for about a deadline, calls are shed at once (µs, not after the
/// deadline), only the one probe of an empty pipeline waits; when it comes
/// back, Redis decides again. Few requests are in flight (4 clients, a check
/// every 10 ms each), far below `min_in_flight`: the old depth limit never
/// shed here and every request waited out the deadline. The breaker is kept
/// out of it (`breaker_failures` high) so that what is seen is admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_stalled_past_the_deadline_is_shed_at_once_not_after_the_deadline() {
    use ratelimitd::protocol::ErrorCode;
    use tokio::time::Instant;
    let r = RedisServer::start_unix();
    let d = Daemon::start_config_with_metrics(&format!("[redis]\nurl = \"{}\"\ntimeout_ms = {DEADLINE_MS}\nbreaker_failures = 1000\n", r.url()));
    let up = Deadline::start("link up", Duration::from_secs(5));
    let mut c = d.client().await;
    while c.check(&common::args("up", 10, 1000)).await.unwrap().source != Source::Redis {
        up.retry_in(Duration::from_millis(10), String::new).await;
    }
    let deadline = Duration::from_millis(DEADLINE_MS);
    let pause_at = Duration::from_millis(300);
    let resume_at = pause_at + 5 * deadline;
    let end = resume_at + 3 * deadline;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..4 {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut i = 0u32;
            while start.elapsed() < end {
                tick.tick().await;
                let key = format!("stall-{t}-{i}");
                i += 1;
                let sent = start.elapsed();
                let res = c.check(&common::args(&key, 10, 1000)).await.expect("answered");
                seen.push(Seen { sent, took: start.elapsed() - sent, error: res.error, source: res.source });
            }
            seen
        }));
    }
    tokio::time::sleep_until(start + pause_at).await;
    r.pause();
    let paused = start.elapsed();
    tokio::time::sleep_until(start + resume_at).await;
    r.resume();
    let resumed = start.elapsed();
    let mut seen = Vec::new();
    for t in tasks {
        seen.extend(t.await.unwrap());
    }
    seen.sort_by_key(|s| s.sent);

    // Sent while Redis had been silent for more than a deadline (and 100 ms
    // of slack for a loaded host), until it came back.
    let stalled: Vec<&Seen> = seen.iter().filter(|s| s.sent > paused + deadline + Duration::from_millis(100) && s.sent + Duration::from_millis(10) < resumed).collect();
    let shed: Vec<&&Seen> = stalled.iter().filter(|s| s.error == ErrorCode::Overloaded).collect();
    let waited = stalled.iter().filter(|s| s.error != ErrorCode::Overloaded).count();
    let slow_shed = shed.iter().filter(|s| s.took > deadline / 4).count();
    let first_shed = seen.iter().find(|s| s.error == ErrorCode::Overloaded).map(|s| s.sent.saturating_sub(paused));
    eprintln!(
        "stall of {:?}: {} requests sent after a deadline of silence: {} shed (slowest {:?}), {} waited (probes); first shed {:?} after the pause; {} requests in all",
        resumed - paused,
        stalled.len(),
        shed.len(),
        shed.iter().map(|s| s.took).max(),
        waited,
        first_shed,
        seen.len()
    );
    assert!(stalled.len() >= 40, "the load went on during the stall: {}", stalled.len());
    // When: shedding starts within a deadline and a bound of the pause.
    let first_shed = first_shed.expect("some request shed");
    assert!(first_shed <= deadline + Duration::from_millis(150), "first shed {first_shed:?} after the pause");
    // At once: a shed request is answered in a fraction of the deadline.
    assert!(slow_shed * 20 <= shed.len().max(1), "{slow_shed} of {} shed requests took over {:?}", shed.len(), deadline / 4);
    // Only probes (one call of an empty pipeline per deadline of silence)
    // wait: 4 clients would otherwise wait out every deadline.
    let probes_bound = ((resumed - paused).as_millis() / deadline.as_millis()) as usize + 2;
    assert!(waited <= probes_bound, "{waited} requests waited out the stall (probes at most {probes_bound}), {} shed", shed.len());
    // Redis decides again once it is back.
    let after: Vec<&Seen> = seen.iter().filter(|s| s.sent > resumed + deadline).collect();
    assert!(!after.is_empty() && after.iter().all(|s| s.source == Source::Redis), "after the stall Redis decides: {:?}", after.iter().map(|s| (s.sent, s.error, s.source)).collect::<Vec<_>>());
    assert!(!d.log().contains("breaker open"), "{}", d.log());
}
