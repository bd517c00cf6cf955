//! Calendar windows of the `fixed` algorithm (docs/ALGORITHMS.md): months
//! that reset on the 1st at 00:00, and windows aligned to a fixed UTC
//! offset. The Redis script is driven at chosen instants (a caller's clock
//! instead of Redis TIME); the daemon's policies, on Redis and in memory,
//! at the real time, against a next month start computed here.

mod common;


use common::clock::now_ms;
use common::redis_server::window;
use common::{Daemon, RedisServer};
use ratelimitd::protocol::{Algorithm, Decision, FailPolicy, PolicyCheckArgs};
use ratelimitd::window::calendar_window_ms;
use ratelimitd::BatchAsk;
use tokio_util::sync::CancellationToken;

const DAY: u64 = 86_400_000;
const HOUR: u64 = 3_600_000;

/// Midnight UTC of a date, in ms since the epoch, computed without the
/// crate's calendar code: whole days counted year by year, month by month.
fn utc(y: u64, m: u64, d: u64) -> u64 {
    let leap = |y: u64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let mut days = (1970..y).map(|y| if leap(y) { 366 } else { 365 }).sum::<u64>();
    let len = [31, if leap(y) { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    days += len[..(m - 1) as usize].iter().sum::<u64>() + d - 1;
    days * DAY
}

/// The next 1st of a month at 00:00 at `offset_ms` east of UTC, after `now`.
fn next_month_start(now: u64, offset_ms: u64) -> u64 {
    (1970..2200).flat_map(|y| (1..=12).map(move |m| utc(y, m, 1))).find(|&t| t > now + offset_ms).unwrap() - offset_ms
}

/// The script at chosen instants: a month's quota holds until the 1st
/// (leap February included), reset_ms is the time to it, and a new month
/// starts at 0; at +02:00 the month turns at 22:00 UTC on the last day; a
/// day at -05:30 turns at 05:30 UTC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_resets_on_the_first_of_the_month() {
    let r = RedisServer::start_unix();
    let token = CancellationToken::new();
    let w = window(&r, &token).await;
    let ask = |cost| [BatchAsk { limit: 3, cost }];
    let month = calendar_window_ms(0, 0);
    let at = |key: &'static str, window: u32, now: u64, cost: u32| {
        let w = w.clone();
        async move { w.check_batch_at_with(key.as_bytes(), window, Algorithm::Fixed, &ask(cost), now).await.unwrap()[0] }
    };
    // 2028-02-10: three pass, the fourth waits for March 1st.
    let t = utc(2028, 2, 10) + 5 * HOUR;
    let v = at("m", month, t, 3).await;
    assert!(v.allowed && v.remaining == 0 && v.reset_ms as u64 == utc(2028, 3, 1) - t, "{v:?}");
    let t2 = utc(2028, 2, 29) + DAY - 1;
    let v = at("m", month, t2, 1).await;
    assert!(!v.allowed && v.count == 3, "{v:?}");
    assert_eq!((v.reset_ms as u64, v.retry_after_ms as u64), (1, 1), "the last ms of a leap February");
    let v = at("m", month, utc(2028, 3, 1), 1).await;
    assert!(v.allowed && v.count == 1 && v.reset_ms as u64 == 31 * DAY, "{v:?}");
    // December to January.
    let t = utc(2030, 12, 31) + 23 * HOUR;
    assert_eq!(at("dec", month, t, 1).await.reset_ms as u64, HOUR);
    // UTC+02:00: May begins at 2026-04-30 22:00 UTC.
    let plus2 = calendar_window_ms(0, 120);
    let edge = utc(2026, 4, 30) + 22 * HOUR;
    let v = at("p", plus2, edge - 1, 3).await;
    assert!(v.allowed && v.reset_ms == 1, "{v:?}");
    let v = at("p", plus2, edge, 3).await;
    assert!(v.allowed && v.count == 3 && v.reset_ms as u64 == utc(2026, 5, 31) + 22 * HOUR - edge, "{v:?}");
    // A day at UTC-05:30.
    let day = calendar_window_ms(1440, -330);
    let t = utc(2026, 7, 4) + 3 * HOUR;
    let v = at("d", day, t, 1).await;
    assert_eq!(v.reset_ms as u64, utc(2026, 7, 4) + 5 * HOUR + 30 * 60_000 - t);
    // Redis TIME: the reset is the next 1st, as computed here.
    let before = now_ms();
    let v = at("now", month, 0, 1).await;
    let after = now_ms();
    let next = next_month_start(before, 0);
    let reset = v.reset_ms as u64;
    assert!(v.allowed && reset + 1000 >= next - after && reset <= next - before + 1000, "{v:?} next {next}");
    token.cancel();
}

/// `[[policy]] algorithm = "fixed"`, `window = "month"`, `utc_offset`: on
/// Redis and in memory, the quota holds and the reset is the next 1st of
/// the month at the policy's offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_monthly_policy_reports_the_next_first() {
    let redis = RedisServer::start_unix();
    let policies = "[[policy]]\nname = \"monthly\"\nlimit = 2\nwindow = \"month\"\nalgorithm = \"fixed\"\nutc_offset = \"+02:00\"\n";
    for backend in [format!("[redis]\nurl = \"{}\"\ntimeout_ms = 500\n", redis.url()), String::new()] {
        let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n{backend}{policies}"));
        let mut c = d.client().await;
        let ask = PolicyCheckArgs { policy: b"monthly", key: b"tenant", cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
        let before = now_ms();
        let got = [c.check_policy(&ask).await.unwrap(), c.check_policy(&ask).await.unwrap(), c.check_policy(&ask).await.unwrap()];
        let after = now_ms();
        assert_eq!(got.each_ref().map(|r| r.decision), [Decision::Allowed, Decision::Allowed, Decision::Denied], "{backend}");
        let next = next_month_start(before, 2 * HOUR);
        for r in &got {
            let reset = r.reset_ms as u64;
            assert!(reset + 1000 >= next - after && reset <= next - before + 1000, "{backend}: {r:?}, next {next}");
        }
        assert_eq!(got[2].retry_after_ms, got[2].reset_ms);
    }
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("ratelimitd:*").query(&mut redis.conn()).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].ends_with(format!(":{}ms:fixed", calendar_window_ms(0, 120)).as_bytes()), "{}", String::from_utf8_lossy(&keys[0]));
}
