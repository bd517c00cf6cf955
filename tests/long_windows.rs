//! Windows above 24.8 days: the sliding counter's reset (and a refusal's
//! retry) reaches twice the window, more than the response's `u32` of ms
//! holds (49.7 days). Redis and the memory store must report the same:
//! saturated at `u32::MAX`, never wrapped modulo 2^32 (a 58-day reset read
//! as 8.5 days), and exact below it. Through the real daemon, on a real
//! Redis and in memory.

mod common;

use common::{RedisServer, Setup};
use common::clock::now_ms;
use ratelimitd::protocol::{Algorithm, CheckArgs, Decision, FailPolicy};

const DAY_MS: u64 = 86_400_000;

/// A window between `lo` and `hi` ms whose current UTC-aligned fixed window
/// started 5..6 s ago (fixed windows start at multiples of the window since
/// the epoch): the sliding counter's reset is then nearly twice the window.
fn window_started_just_now(lo: u64, hi: u64) -> u32 {
    let t = now_ms() - 5_000;
    let k = t / lo; // the most windows of at least `lo` since the epoch
    let w = t / k; // so t - k * w < k ms (< 1 s)
    assert!((lo..=hi).contains(&w), "{w}");
    u32::try_from(w).unwrap()
}

fn setups() -> Vec<(&'static str, Setup)> {
    // Windows up to the 30 days `limits.max_window_ms` allows.
    let limits = "[limits]\nmax_window_ms = 2592000000\n";
    let redis = RedisServer::start_unix();
    let on_redis = common::Daemon::start_config(&format!("[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{limits}", redis.url()));
    vec![("redis", Setup::Redis(redis, on_redis)), ("memory", Setup::Memory(common::Daemon::start_config(limits)))]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_counter_of_29_days_reports_its_58_day_reset_saturated_on_both_stores() {
    let w = window_started_just_now(29 * DAY_MS, 30 * DAY_MS - 1);
    // The true reset, 2W - elapsed, is about 58 days: above u32::MAX ms.
    assert!(2 * u64::from(w) - 10_000 > u64::from(u32::MAX));
    for (name, setup) in setups() {
        let mut c = setup.daemon().client().await;
        let args = CheckArgs { key: b"monthly", limit: 1, window_ms: w, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
        let first = c.check_with(&args, Algorithm::SlidingCounter).await.unwrap();
        assert_eq!((first.decision, first.source), (Decision::Allowed, setup.source()), "{name}");
        assert_eq!(first.reset_ms, u32::MAX, "{name}: the reset of an admission, ~58 days, saturated (not wrapped to ~8.5 days)");
        let refused = c.check_with(&args, Algorithm::SlidingCounter).await.unwrap();
        assert_eq!(refused.decision, Decision::Denied, "{name}");
        assert_eq!((refused.retry_after_ms, refused.reset_ms), (u32::MAX, u32::MAX), "{name}: a refusal's retry and reset, ~58 days, saturated");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_counter_of_24_days_reports_its_exact_48_day_reset_on_both_stores() {
    let w = window_started_just_now(24 * DAY_MS, 24 * DAY_MS + DAY_MS / 2);
    for (name, setup) in setups() {
        let mut c = setup.daemon().client().await;
        let args = CheckArgs { key: b"long", limit: 1, window_ms: w, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
        let before = now_ms();
        let first = c.check_with(&args, Algorithm::SlidingCounter).await.unwrap();
        let after = now_ms();
        // 2W - elapsed, elapsed read from the wall clock around the call.
        let (lo, hi) = (2 * u64::from(w) - after % u64::from(w) - 1, 2 * u64::from(w) - before % u64::from(w) + 1);
        assert!((lo..=hi).contains(&u64::from(first.reset_ms)), "{name}: reset {} not in {lo}..={hi}", first.reset_ms);
        let refused = c.check_with(&args, Algorithm::SlidingCounter).await.unwrap();
        assert_eq!(refused.decision, Decision::Denied, "{name}");
        assert!(u64::from(refused.retry_after_ms) > 47 * DAY_MS && refused.retry_after_ms < u32::MAX, "{name}: {}", refused.retry_after_ms);
    }
}
