//! An idle daemon costs its host nothing (issue 34, item 4): whatever the
//! request path does to answer sooner at low load (a spin before parking,
//! say), it must stop when the requests stop. A real daemon serves cold
//! keys and a hot key on one connection, which it keeps open as an nginx
//! worker's pool does; then, over 20 s without a request, the daemon's
//! whole process (every thread, `/proc/<pid>/stat` utime + stime) is
//! charged no CPU tick. CPU ticks, not a duration: the assertion holds on a
//! loaded machine.
//!
//! Neither holds today, so both are ignored (run them with `--ignored`):
//! the daemon's periodic tasks wake it even when no request comes. With
//! in-memory windows 3.5 times a second (35 `epoll_wait` in 10 s under
//! `strace -c -f`: the policies' use clock and the per-host keys' sweep,
//! each every second; the refused keys' rotation every 10 s): 1-2 ticks in
//! 20 s for this debug build on a loaded 2-core host. With a real
//! `redis-server` and quota leases it also talks to Redis about 4 times a
//! second (44 `writev` + `recvfrom` pairs and 104 `epoll_wait` in 10 s: the
//! admin overrides' refresh every `[admin] overrides_refresh`, 1 s, and the
//! link's keepalive PING every 500 ms): 5 ticks in 20 s for the debug
//! build, 1-2 for the release build. Unignore them when the periodic work
//! sleeps with the daemon.

mod common;

use std::time::Duration;

use common::{Daemon, RedisServer};
use ratelimitd::protocol::{CheckArgs, Decision, FailPolicy};

/// utime + stime of the whole process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the name.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Serves 500 cold keys and a hot key on one connection, lets 2 s pass,
/// then asserts no CPU tick in 20 s, and that the connection still serves.
async fn idle_after_load(d: &Daemon) {
    let mut c = d.client().await;
    let check = |key: &'static [u8]| CheckArgs { key, limit: 1_000_000, window_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
    let cold: Vec<String> = (0..500).map(|i| format!("idle:cold:{i}")).collect();
    for (i, key) in cold.iter().enumerate() {
        let key: &'static [u8] = Box::leak(key.clone().into_bytes().into_boxed_slice());
        for k in [key, b"idle:hot".as_slice()] {
            let r = c.check(&check(k)).await.unwrap();
            assert_eq!(r.decision, Decision::Allowed, "request {i} for {:?}", String::from_utf8_lossy(k));
        }
    }
    // Leases the hot key took (with Redis) are given back or left to expire
    // in their life (250 ms): let that and any answer still in flight pass.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = cpu_ticks(d.pid());
    tokio::time::sleep(Duration::from_secs(20)).await;
    let used = cpu_ticks(d.pid()) - before;
    assert_eq!(used, 0, "the idle daemon used {used} CPU ticks in 20 s (its connection open, no request)");
    // The connection still serves.
    assert_eq!(c.check(&check(b"idle:hot")).await.unwrap().decision, Decision::Allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fails today: the use clock and the per-host keys' sweep, each every second, cost 1-2 ticks in 20 s (debug build)"]
async fn an_idle_daemon_with_in_memory_windows_uses_no_cpu_tick_in_20_seconds() {
    let d = Daemon::start(None, "");
    idle_after_load(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fails today: the overrides' refresh (1 s) and the Redis keepalive PING (500 ms) cost 1-5 ticks in 20 s"]
async fn an_idle_daemon_on_redis_with_quota_leases_uses_no_cpu_tick_in_20_seconds() {
    let redis = RedisServer::start();
    let d = Daemon::start(Some(&redis.url()), "quota_leases = true");
    idle_after_load(&d).await;
}
