//! Failure behaviour with real processes under load: Redis killed, hung,
//! its connections killed; the daemon signalled. Every request must still be
//! answered, by Redis or by its fail policy, within its deadline plus a
//! margin, and Redis-backed limiting must come back by itself.
//!
//! The measured figures are printed (run with `--nocapture` to see them);
//! the assertions use generous bounds so that a loaded CI machine does not
//! fail them, yet a request that waits on a hung Redis would.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{args, Daemon, Deadline, RedisServer};
use ratelimitd::protocol::{CheckArgs, Decision, ErrorCode, FailPolicy, Response, Source};
use tokio::sync::Notify;

/// The daemon's Redis deadline in these tests: the product default.
const DEADLINE_MS: u64 = 20;
/// What a loaded 2-core CI machine may add on top (scheduling, the client).
const MARGIN_MS: u64 = 250;

struct Sample {
    at: Duration,
    latency: Duration,
    resp: Response,
}

/// `conns` connections sending checks (policy open) back to back until `stop`.
async fn load(d: &Daemon, conns: usize, key: &'static str, start: Instant, stop: Arc<Notify>) -> Vec<tokio::task::JoinHandle<Vec<Sample>>> {
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let mut c = d.client().await;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let a = CheckArgs { on_error: FailPolicy::Open, ..args(key, 1_000_000, 1000) };
            let mut samples = Vec::new();
            let stopped = stop.notified();
            tokio::pin!(stopped);
            loop {
                let sent = Instant::now();
                let resp = tokio::select! {
                    _ = &mut stopped => return samples,
                    r = c.check(&a) => r.expect("every request gets an answer"),
                };
                samples.push(Sample { at: sent - start, latency: sent.elapsed(), resp });
            }
        }));
    }
    tasks
}

async fn collect(tasks: Vec<tokio::task::JoinHandle<Vec<Sample>>>) -> Vec<Sample> {
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort_by_key(|s| s.at);
    all
}

fn max_latency(samples: &[Sample]) -> Duration {
    samples.iter().map(|s| s.latency).max().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_every_request_is_answered_in_time() {
    let mut r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), &format!("timeout_ms = {DEADLINE_MS}"));
    let start = Instant::now();
    let stop = Arc::new(Notify::new());
    let tasks = load(&d, 16, "killed", start, stop.clone()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed_at = start.elapsed();
    r.kill();
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.notify_waiters();
    let samples = collect(tasks).await;
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at > killed_at + Duration::from_millis(50)).collect();
    assert!(samples.iter().any(|s| s.at < killed_at && s.resp.source == Source::Redis));
    assert!(after.len() > 100, "{} requests after the kill", after.len());
    for s in &after {
        assert_eq!((s.resp.decision, s.resp.source), (Decision::Allowed, Source::FailOpen), "{:?}", s.resp);
        assert!(matches!(s.resp.error, ErrorCode::CircuitOpen | ErrorCode::RedisUnavailable | ErrorCode::RedisTimeout));
    }
    let worst = after.iter().map(|s| s.latency).max().unwrap();
    eprintln!("redis killed: {} requests after the kill, worst latency {worst:?}, worst overall {:?}", after.len(), max_latency(&samples));
    assert!(max_latency(&samples) < Duration::from_millis(DEADLINE_MS + MARGIN_MS), "worst {:?}", max_latency(&samples));
    assert!(d.log().contains("breaker open"), "{}", d.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_hung_breaker_opens_latency_stays_bounded_and_limiting_resumes() {
    let r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), &format!("timeout_ms = {DEADLINE_MS}\nbreaker_failures = 5"));
    let start = Instant::now();
    let stop = Arc::new(Notify::new());
    let tasks = load(&d, 16, "hung", start, stop.clone()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let paused_at = start.elapsed();
    r.pause();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let resumed_at = start.elapsed();
    r.resume();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.notify_waiters();
    let samples = collect(tasks).await;

    // In flight at the pause or sent while Redis was stopped.
    let hung: Vec<&Sample> = samples.iter().filter(|s| s.at + s.latency > paused_at && s.at < resumed_at).collect();
    assert!(hung.iter().any(|s| s.resp.error == ErrorCode::RedisTimeout), "the first requests wait out the deadline");
    let open = hung.iter().filter(|s| s.resp.error == ErrorCode::CircuitOpen).count();
    assert!(open > hung.len() / 2, "the breaker answers most of them at once: {open} of {}", hung.len());
    let worst_hung = hung.iter().map(|s| s.latency).max().unwrap();
    assert!(worst_hung < Duration::from_millis(DEADLINE_MS + MARGIN_MS), "worst while hung {worst_hung:?}");

    let back = samples.iter().find(|s| s.at > resumed_at && s.resp.source == Source::Redis).expect("Redis-backed decisions resume");
    let recovery = back.at - resumed_at;
    let tail: Vec<&Sample> = samples.iter().filter(|s| s.at > back.at + Duration::from_millis(100)).collect();
    // A loaded 2-core machine can stall one request past the 20 ms deadline
    // now and then (seen: 48 ms); staying on Redis means the breaker does
    // not go back to answering, not that no single call is ever late.
    let on_redis = tail.iter().filter(|s| s.resp.source == Source::Redis).count();
    assert!(!tail.is_empty() && on_redis * 100 >= tail.len() * 98, "stays on Redis after recovery: {on_redis} of {}", tail.len());
    eprintln!(
        "redis hung {:?}: {} requests meanwhile, {open} answered by the open breaker, worst latency {worst_hung:?}; Redis-backed again {recovery:?} after SIGCONT",
        resumed_at - paused_at,
        hung.len()
    );
    assert!(recovery < Duration::from_secs(2), "recovery took {recovery:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_kill_and_restart_recover_within_a_second() {
    let mut r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), &format!("timeout_ms = {DEADLINE_MS}"));
    let mut c = d.client().await;
    let a = CheckArgs { on_error: FailPolicy::Open, ..args("recover", 1_000_000, 1000) };
    assert_eq!(c.check(&a).await.unwrap().source, Source::Redis);
    for what in ["CLIENT KILL", "restart"] {
        if what == "restart" {
            r.restart();
        } else {
            let mut conn = r.conn();
            let _: redis::Value = redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal").query(&mut conn).unwrap();
        }
        let back = Deadline::start(format!("{what}: back on Redis"), Duration::from_secs(3));
        loop {
            let resp = c.check(&a).await.unwrap();
            if resp.source == Source::Redis {
                break;
            }
            back.retry_in(Duration::from_millis(5), || resp.message.clone()).await;
        }
        eprintln!("{what}: Redis-backed again after {:?}", back.elapsed());
        assert!(back.elapsed() < Duration::from_millis(1500), "{what}: {:?}", back.elapsed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_at_start_then_up() {
    // An address with no server yet: the daemon starts anyway and answers by
    // policy. A socket path in our own dir, so that no other test's server
    // can be there first.
    let late = tempfile::tempdir().unwrap();
    let socket = late.path().join("redis.sock");
    let d = Daemon::start(Some(&format!("redis+unix://{}", socket.display())), &format!("timeout_ms = {DEADLINE_MS}"));
    let mut c = d.client().await;
    let closed = c.check(&args("late", 5, 1000)).await.unwrap();
    assert_eq!((closed.decision, closed.source, closed.error), (Decision::Denied, Source::FailClosed, ErrorCode::CircuitOpen));
    let _r = RedisServer::start_unix_at(&socket);
    let reached = Deadline::start("reached the late Redis", Duration::from_secs(3));
    while c.check(&args("late", 5, 1000)).await.unwrap().source != Source::Redis {
        reached.retry_in(Duration::from_millis(10), String::new).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_answers_in_flight_and_exits_zero() {
    let r = RedisServer::start_unix();
    let mut d = Daemon::start(Some(&r.url()), "timeout_ms = 500");
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut c = d.client().await;
        tasks.push(tokio::spawn(async move {
            let (mut answered, mut closed) = (0u32, false);
            loop {
                match c.check(&args("term", 1_000_000, 1000)).await {
                    Ok(r) => {
                        assert_ne!(r.decision, Decision::Error);
                        answered += 1;
                    }
                    // After the drain the daemon closes the connection: the
                    // next request meets EOF, EPIPE or a reset, never half a
                    // response.
                    Err(ratelimitd::client::ClientError::Closed) => closed = true,
                    Err(ratelimitd::client::ClientError::Io(e))
                        if matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset) =>
                    {
                        closed = true
                    }
                    Err(e) => panic!("unexpected client error: {e}"),
                }
                if closed || start.elapsed() > Duration::from_secs(5) {
                    return (answered, closed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        let s = d.terminate();
        (s, d)
    })
    .await
    .unwrap();
    let took = t0.elapsed();
    assert!(status.0.success(), "{:?}", status.0);
    assert!(!status.1.socket.exists(), "socket removed");
    for t in tasks {
        let (answered, closed) = t.await.unwrap();
        assert!(answered > 0 && closed);
    }
    eprintln!("SIGTERM under load: exited 0 after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_under_load_reloads_without_dropping_a_request() {
    let r = RedisServer::start_unix();
    let r2 = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), "timeout_ms = 500");
    let start = Instant::now();
    let stop = Arc::new(Notify::new());
    let tasks = load(&d, 8, "hup", start, stop.clone()).await;
    let mut long_key = d.client().await;
    let key = "k".repeat(300);
    assert_eq!(long_key.check(&args(&key, 5, 1000)).await.unwrap().decision, Decision::Allowed);

    // 1. A broken file is refused; the running configuration keeps serving.
    let good = d.config_text();
    d.rewrite_config(&format!("{good}\n[nonsense]\n"));
    d.signal(nix::sys::signal::Signal::SIGHUP);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(d.log().contains("configuration reload failed"), "{}", d.log());

    // 2. New limits and a new Redis, in force for an existing connection.
    let moved = good.replace(&r.url(), &r2.url());
    d.rewrite_config(&format!("{moved}\n[limits]\nmax_key_len = 100\n"));
    d.signal(nix::sys::signal::Signal::SIGHUP);
    let applied = Deadline::start("new limits applied", Duration::from_secs(5));
    loop {
        let resp = long_key.check(&args(&key, 5, 1000)).await.unwrap();
        if resp.error == ErrorCode::InvalidKey {
            break;
        }
        applied.retry_in(Duration::from_millis(20), || resp.message.clone()).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.notify_waiters();
    let samples = collect(tasks).await;
    assert!(samples.iter().all(|s| s.resp.source == Source::Redis && s.resp.error == ErrorCode::None), "no request fell to its policy");
    let mut conn2 = r2.conn();
    let moved_keys: bool = redis::Commands::exists(&mut conn2, "ratelimitd:{hup}:1000ms").unwrap();
    assert!(moved_keys, "decisions moved to the new Redis");
    assert!(d.log().contains("configuration reloaded"));
    eprintln!("SIGHUP under load: {} requests, none failed", samples.len());
}
