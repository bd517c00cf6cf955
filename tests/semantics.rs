//! Sliding-window semantics that both backends must give, through the real
//! daemon: each case runs against Redis and against the in-memory backend.

mod common;

use std::time::{Duration, Instant};

use common::{args, Setup};
use ratelimitd::protocol::{CheckArgs, Decision, ErrorCode, Source};

/// The seed's scenario: 1005 requests in one window, exactly 1000 pass.
async fn seed_scenario(s: Setup) {
    let mut c = s.daemon().client().await;
    let a = args("/order:tenant-1001", 1000, 10_000);
    let start = Instant::now();
    let mut responses = Vec::with_capacity(1005);
    for _ in 0..1005 {
        responses.push(c.check(&a).await.unwrap());
    }
    let elapsed_ms = start.elapsed().as_millis() as u32;
    let allowed: Vec<_> = responses.iter().filter(|r| r.decision == Decision::Allowed).collect();
    assert_eq!(allowed.len(), 1000);
    assert!(responses.iter().all(|r| r.error == ErrorCode::None));
    // With Redis, the refusals after the first come from the denial cache.
    let sources: Vec<Source> = responses.iter().map(|r| r.source).collect();
    let refused_again = if s.source() == Source::Redis { Source::DenialCache } else { s.source() };
    assert_eq!(sources[..1001], vec![s.source(); 1001][..]);
    assert!(sources[1001..].iter().all(|&src| src == refused_again), "{:?}", &sources[1001..]);
    // Counts and remaining follow the admissions one by one.
    for (i, r) in responses[..1000].iter().enumerate() {
        assert_eq!((r.decision, r.count, r.remaining, r.retry_after_ms, r.reset_ms), (Decision::Allowed, i as u32 + 1, 999 - i as u32, 0, 10_000));
    }
    for r in &responses[1000..] {
        assert_eq!((r.decision, r.count, r.remaining), (Decision::Denied, 1000, 0));
        // The first admission leaves the window 10 s after it was made.
        assert!(r.retry_after_ms <= 10_000 && r.retry_after_ms + elapsed_ms + 2 >= 10_000, "retry_after {} after {elapsed_ms} ms", r.retry_after_ms);
        assert!(r.reset_ms >= r.retry_after_ms && r.reset_ms <= 10_000);
    }
}

/// The window slides: after retry_after, exactly the freed quota passes again.
async fn window_slides(s: Setup) {
    let mut c = s.daemon().client().await;
    let a = args("slide", 3, 300);
    for _ in 0..3 {
        assert_eq!(c.check(&a).await.unwrap().decision, Decision::Allowed);
    }
    let denied = c.check(&a).await.unwrap();
    assert_eq!(denied.decision, Decision::Denied);
    assert!(denied.retry_after_ms > 0 && denied.retry_after_ms <= 300);
    tokio::time::sleep(Duration::from_millis(denied.retry_after_ms as u64 + 5)).await;
    assert_eq!(c.check(&a).await.unwrap().decision, Decision::Allowed);
    // Wait out the whole window: the full quota is back.
    tokio::time::sleep(Duration::from_millis(310)).await;
    let r = c.check(&a).await.unwrap();
    assert_eq!((r.decision, r.count, r.remaining), (Decision::Allowed, 1, 2));
}

/// cost > 1 is all or nothing, and a denied request records nothing.
async fn cost_is_all_or_nothing(s: Setup) {
    let mut c = s.daemon().client().await;
    let with_cost = |cost| CheckArgs { cost, ..args("cost", 10, 60_000) };
    let r = c.check(&with_cost(7)).await.unwrap();
    assert_eq!((r.decision, r.count, r.remaining), (Decision::Allowed, 7, 3));
    let r = c.check(&with_cost(4)).await.unwrap();
    assert_eq!((r.decision, r.count, r.remaining), (Decision::Denied, 7, 3));
    assert!(r.retry_after_ms > 59_000, "all 7 were admitted together: {}", r.retry_after_ms);
    let r = c.check(&with_cost(3)).await.unwrap();
    assert_eq!((r.decision, r.count, r.remaining), (Decision::Allowed, 10, 0));
    let r = c.check(&with_cost(1)).await.unwrap();
    assert_eq!(r.decision, Decision::Denied);
}

/// Keys are independent, and limits of different keys do not mix.
async fn keys_are_independent(s: Setup) {
    let mut c = s.daemon().client().await;
    assert_eq!(c.check(&args("tenant-a", 1, 60_000)).await.unwrap().decision, Decision::Allowed);
    assert_eq!(c.check(&args("tenant-a", 1, 60_000)).await.unwrap().decision, Decision::Denied);
    assert_eq!(c.check(&args("tenant-b", 1, 60_000)).await.unwrap().decision, Decision::Allowed);
}

/// Many connections at once on one key never admit more than the limit, and
/// each admission sees its own count (the decision is atomic).
async fn concurrent_connections_hold_the_limit(s: Setup) {
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let mut c = s.daemon().client().await;
        tasks.push(tokio::spawn(async move {
            let mut counts = Vec::new();
            for _ in 0..60 {
                let r = c.check(&args("hot", 1000, 60_000)).await.unwrap();
                assert_ne!(r.decision, Decision::Error);
                if r.decision == Decision::Allowed {
                    counts.push(r.count);
                }
            }
            counts
        }));
    }
    let mut counts = Vec::new();
    for t in tasks {
        counts.extend(t.await.unwrap());
    }
    counts.sort_unstable();
    assert_eq!(counts, (1..=1000).collect::<Vec<u32>>(), "3840 requests: exactly 1000 admitted, each with a distinct count");
}

/// Two locations sharing a key with different windows never interfere: a
/// 100 ms window's cleanup must not erase the 60 s window's history (it did
/// when one sorted set held both: 4 extra requests passed a limit of 5/60 s).
async fn one_key_two_windows_keep_apart(s: Setup) {
    let mut c = s.daemon().client().await;
    for _ in 0..5 {
        assert_eq!(c.check(&args("shared", 5, 60_000)).await.unwrap().decision, Decision::Allowed);
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let short = c.check(&args("shared", 5, 100)).await.unwrap();
    assert_eq!((short.decision, short.count), (Decision::Allowed, 1), "the short window is its own");
    for _ in 0..5 {
        let r = c.check(&args("shared", 5, 60_000)).await.unwrap();
        assert_eq!((r.decision, r.count), (Decision::Denied, 5), "the long window kept its five admissions");
    }
}

macro_rules! both_backends {
    ($($case:ident),* $(,)?) => {
        mod redis_backend {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() { super::$case(super::Setup::redis()).await })*
        }
        mod memory_backend {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() { super::$case(super::Setup::memory()).await })*
        }
    };
}

both_backends!(seed_scenario, window_slides, cost_is_all_or_nothing, keys_are_independent, concurrent_connections_hold_the_limit, one_key_two_windows_keep_apart);
