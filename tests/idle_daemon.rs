//! An idle daemon costs its host nothing (issue 34, item 4): whatever the
//! request path does to answer sooner at low load, it must stop when the
//! requests stop. A real daemon serves cold keys and a hot key on one
//! connection, which it keeps open as an nginx worker's pool does; after
//! the keys' windows have ended and its periodic tasks have parked
//! (src/park.rs: 12 s covers the refused keys' 10 s rotation and tokio's
//! 10 s blocking-thread keep-alive), 20 s without a request follow.
//!
//! With in-memory windows nothing wakes it at all: no thread of the
//! process is switched in (per-thread context switches, the deterministic
//! measure) and the process is charged no CPU tick. Before src/park.rs the
//! policies' use clock and the per-host keys' sweep each woke it every
//! second (30 `epoll_wait` in 10 s under `strace -c -f`).
//!
//! With Redis the link is kept alive on purpose: a PING every 500 ms when
//! idle (a Redis `timeout` or a proxy's idle timeout must never close it
//! under us) and the admin overrides' refresh every `[admin]
//! overrides_refresh` (one script and one prune: an override reaches every
//! daemon within it). That test asserts those are the only commands the
//! idle daemon sends, at those rates.

mod common;

use std::collections::HashMap;
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

/// Context switches (voluntary and not) of each thread of the process.
fn switches(pid: u32) -> HashMap<u32, u64> {
    let mut all = HashMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let Ok(tid) = task.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else { continue };
        let n: u64 = status.lines().filter(|l| l.contains("ctxt_switches:")).filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).sum();
        all.insert(tid, n);
    }
    all
}

/// What the process did while idle: CPU ticks, and the threads alive at
/// both ends that were switched in (thread id, switches).
struct Idle {
    ticks: u64,
    woken: Vec<(u32, u64)>,
}

const SETTLE: Duration = Duration::from_secs(12);
const IDLE: Duration = Duration::from_secs(20);

fn check(key: &[u8]) -> CheckArgs<'_> {
    CheckArgs { key, limit: 1_000_000, window_ms: 1000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// Serves 500 cold keys and a hot key on one connection, lets `SETTLE`
/// pass, then runs `during` for `IDLE` without a request; checks that the
/// connection still serves afterwards.
async fn idle_after_load(d: &Daemon, during: impl std::future::Future<Output = ()>) -> Idle {
    let mut c = d.client().await;
    for i in 0..500 {
        let key = format!("idle:cold:{i}");
        for k in [key.as_bytes(), b"idle:hot".as_slice()] {
            let r = c.check(&check(k)).await.unwrap();
            assert_eq!(r.decision, Decision::Allowed, "request {i} for {:?}", String::from_utf8_lossy(k));
        }
    }
    // Leases the hot key took (with Redis) are given back or left to expire
    // in their life (250 ms); the keys' windows end; the tasks park.
    tokio::time::sleep(SETTLE).await;
    let (ticks_before, switches_before) = (cpu_ticks(d.pid()), switches(d.pid()));
    tokio::join!(tokio::time::sleep(IDLE), during);
    let (ticks_after, switches_after) = (cpu_ticks(d.pid()), switches(d.pid()));
    let woken = switches_after.iter().filter_map(|(tid, n)| Some((*tid, n - switches_before.get(tid)?))).filter(|(_, n)| *n > 0).collect();
    // The connection still serves.
    assert_eq!(c.check(&check(b"idle:hot")).await.unwrap().decision, Decision::Allowed);
    Idle { ticks: ticks_after - ticks_before, woken }
}

/// With in-memory windows, and the same with `server.spin_us`, which keeps
/// the worker polling after each frame (src/spin.rs): the 1,000 requests of
/// the load are served by a spinning worker, and once they stop the
/// spinner parks like every other task. The two daemons are watched over
/// the same 20 s (each process's own threads and ticks are counted), so
/// that the suite waits for the idle time once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_daemon_with_in_memory_windows_is_never_woken_spinning_or_not() {
    let plain = Daemon::start(None, "");
    let spinning = Daemon::start_with("socket_mode = \"0600\"\nspin_us = 300", None, "");
    let (plain_idle, spinning_idle) = tokio::join!(idle_after_load(&plain, async {}), idle_after_load(&spinning, async {}));
    for (what, idle) in [("the idle daemon", plain_idle), ("the idle daemon with spin_us = 300", spinning_idle)] {
        assert!(idle.woken.is_empty(), "threads of {what} were switched in (thread id, switches) in {IDLE:?}: {:?}", idle.woken);
        assert_eq!(idle.ticks, 0, "{what} used {} CPU ticks in {IDLE:?} (its connection open, no request)", idle.ticks);
    }
}

/// `INFO commandstats` as command -> calls.
fn command_calls(redis: &RedisServer) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut redis.conn()).unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(":calls=")?;
            Some((name.to_string(), rest.split(',').next()?.parse().ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_daemon_on_redis_sends_only_its_keepalive_and_the_overrides_refresh() {
    let redis = RedisServer::start();
    let d = Daemon::start(Some(&redis.url()), "quota_leases = true");
    let mut counted = HashMap::new();
    idle_after_load(&d, async {
        let before = command_calls(&redis);
        tokio::time::sleep(IDLE).await;
        let after = command_calls(&redis);
        counted = after.into_iter().map(|(k, n)| (k.clone(), n - before.get(&k).copied().unwrap_or(0))).filter(|(k, n)| *n > 0 && k != "info").collect();
    })
    .await;
    let secs = IDLE.as_secs();
    // A PING every 500 ms, one refresh a second: the change log's read
    // (src/redis/scripts/change_log_read.lua: TIME, EXISTS, ZRANGE,
    // ZRANGEBYSCORE) and the ban index's prune (ZREMRANGEBYSCORE); one of
    // each more for the edges of the measurement.
    let ping = counted.remove("ping").unwrap_or(0);
    assert!((secs..=2 * secs + 2).contains(&ping), "{ping} PINGs in {IDLE:?}");
    for refresh in ["evalsha", "eval", "time", "exists", "zrange", "zrangebyscore", "zremrangebyscore"] {
        let n = counted.remove(refresh).unwrap_or(0);
        assert!(n <= secs + 1, "{n} {refresh} in {IDLE:?}: more than the overrides refresh's one a second");
    }
    assert!(counted.is_empty(), "the idle daemon sent other commands: {counted:?}");
}
