//! A Redis that misbehaves without being down, with real processes: it
//! becomes a replica, runs out of memory, pauses writes, or closes idle
//! connections. Each must give the documented answer without a reconnect
//! storm or a log flood, and must not pass as an outage when it is not one.

mod common;

use std::time::{Duration, Instant};

use common::{args, Daemon, RedisServer};
use ratelimitd::protocol::{CheckArgs, Decision, ErrorCode, FailPolicy, Source};
use ratelimitd::client::Client;
use redis::Commands;

const DEADLINE_MS: u64 = 20;

fn info_field(conn: &mut redis::Connection, section: &str, field: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg(section).query(conn).unwrap();
    info.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))).and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("no {field} in INFO {section}"))
}

fn warn_lines(d: &Daemon) -> usize {
    d.log().lines().filter(|l| l.contains("WARN")).count()
}

/// Sends requests on `conns` connections until `until`; returns every response.
async fn load(d: &Daemon, conns: usize, key: &str, until: Instant) -> Vec<ratelimitd::protocol::Response> {
    let mut tasks = Vec::new();
    for i in 0..conns {
        let mut c: Client = d.client().await;
        let key = format!("{key}-{i}");
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while Instant::now() < until {
                let a = CheckArgs { on_error: FailPolicy::Open, ..args(&key, 1_000_000, 1000) };
                out.push(c.check(&a).await.unwrap());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Redis, a daemon on it (its deadline DEADLINE_MS) that Redis has
/// answered, and an admin connection to Redis.
async fn daemon_on_redis() -> (RedisServer, Daemon, redis::Connection) {
    let r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), &format!("timeout_ms = {DEADLINE_MS}"));
    back_on_redis(&d, Duration::from_secs(2)).await;
    let admin = r.conn();
    (r, d, admin)
}

/// Until a request is decided by Redis again; panics after `limit`.
async fn back_on_redis(d: &Daemon, limit: Duration) -> Duration {
    let mut c = d.client().await;
    let t0 = Instant::now();
    loop {
        let a = CheckArgs { on_error: FailPolicy::Open, ..args("back", 1_000_000, 1000) };
        if c.check(&a).await.unwrap().source == Source::Redis {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < limit, "not back on Redis after {limit:?}:\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Item: the daemon's Redis becomes a replica (REPLICAOF) under load.
/// Before: every reconnect "succeeded" (SCRIPT LOAD works on a replica) and
/// closed the breaker, the next request met READONLY: ~700 connections and
/// ~500 WARN lines a second. Now ROLE is checked at connect and the
/// supervisor backs off: a handful of connections, bounded logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_behind_the_url_is_not_a_reconnect_storm() {
    let master = RedisServer::start();
    let (_r, d, mut admin) = daemon_on_redis().await;
    let conns_before = info_field(&mut admin, "stats", "total_connections_received");
    let warns_before = warn_lines(&d);
    let _: () = redis::cmd("REPLICAOF").arg("127.0.0.1").arg(master.port).query(&mut admin).unwrap();
    let responses = load(&d, 4, "replica", Instant::now() + Duration::from_secs(2)).await;
    let conns = info_field(&mut admin, "stats", "total_connections_received") - conns_before;
    let warns = warn_lines(&d) - warns_before;
    eprintln!("replica for 2 s: {} requests, {conns} new connections to it, {warns} WARN lines", responses.len());
    assert!(responses.len() > 100);
    assert!(responses.iter().all(|r| r.decision == Decision::Allowed), "policy open answers every request");
    assert!(responses.iter().filter(|r| r.source == Source::Redis).count() < 10, "a replica decides nothing");
    assert!(conns <= 12, "{conns} connections in 2 s: a reconnect storm");
    assert!(warns <= 6, "{warns} WARN lines in 2 s:\n{}", d.log());
    let _: () = redis::cmd("REPLICAOF").arg("NO").arg("ONE").query(&mut admin).unwrap();
    let back = back_on_redis(&d, Duration::from_secs(3)).await;
    eprintln!("master again: Redis-backed after {back:?}");
}

/// Item: Redis over maxmemory (noeviction). Before: the script's first
/// command is a write, after which Redis checks no memory, so admissions
/// kept being written past the cap. Now the script is declared (shebang)
/// and Redis refuses to start it: REDIS_ERROR, the fail policy decides, and
/// nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_is_refused_and_decided_by_the_fail_policy() {
    let r = RedisServer::start_unix();
    let d = Daemon::start(Some(&r.url()), "timeout_ms = 500");
    let mut c = d.client().await;
    let a = CheckArgs { on_error: FailPolicy::Open, ..args("oom", 100, 60_000) };
    assert_eq!(c.check(&a).await.unwrap().source, Source::Redis);
    let mut admin = r.conn();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("noeviction").query(&mut admin).unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1").query(&mut admin).unwrap();
    for _ in 0..20 {
        let resp = c.check(&a).await.unwrap();
        assert_eq!((resp.decision, resp.source, resp.error), (Decision::Allowed, Source::FailOpen, ErrorCode::RedisError), "{}", resp.message);
        assert!(resp.message.contains("OOM"), "{}", resp.message);
    }
    let new_key = c.check(&CheckArgs { key: b"oom-new", ..a.clone() }).await.unwrap();
    assert_eq!(new_key.error, ErrorCode::RedisError);
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0").query(&mut admin).unwrap();
    let members: u64 = admin.zcard("ratelimitd:{oom}:60000ms").unwrap();
    assert_eq!(members, 1, "nothing was written while over maxmemory");
    let exists: bool = admin.exists("ratelimitd:{oom-new}:60000ms").unwrap();
    assert!(!exists, "no new key while over maxmemory");
    let resp = c.check(&a).await.unwrap();
    assert_eq!((resp.source, resp.count), (Source::Redis, 2), "Redis decides again once under the cap");
    assert!(!d.log().contains("breaker open"), "OOM is an answer, not a lost link:\n{}", d.log());
}

/// Item: `CLIENT PAUSE 2000 WRITE`. Before: 41 breaker trips, 41 log lines
/// and 41 new connections in 2 s, because a reconnect only ran SCRIPT LOAD
/// (not paused) and closed the breaker at once. Now the probe is a real
/// call of the script, which the pause holds: the breaker stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_writes_do_not_cycle_the_breaker() {
    let (_r, d, mut admin) = daemon_on_redis().await;
    let conns_before = info_field(&mut admin, "stats", "total_connections_received");
    let warns_before = warn_lines(&d);
    let opened_before = d.log().matches("breaker open").count();
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(2000).arg("WRITE").query(&mut admin).unwrap();
    let paused_at = Instant::now();
    let responses = load(&d, 4, "paused", paused_at + Duration::from_millis(1900)).await;
    let conns = info_field(&mut admin, "stats", "total_connections_received") - conns_before;
    let warns = warn_lines(&d) - warns_before;
    let trips_logged = d.log().matches("breaker open").count() - opened_before;
    let waited = responses.iter().filter(|r| r.error == ErrorCode::RedisTimeout).count();
    eprintln!("writes paused 2 s: {} requests, {waited} waited out the deadline, {conns} new connections, {warns} WARN lines, {trips_logged} breaker lines", responses.len());
    assert!(responses.iter().all(|r| r.decision == Decision::Allowed));
    assert!(conns <= 6, "{conns} connections while paused");
    // At most one line of each kind (rate-limited): the first timeout, the
    // admission shedding calls behind a Redis silent past the deadline
    // (OVERLOADED), the breaker opening, the repeat of the fail-policy line,
    // the probe's failure.
    assert!(warns <= 5, "{warns} WARN lines while paused:\n{}", d.log());
    assert!(waited <= 4 * 8, "{waited} requests waited the full deadline: the breaker cycled");
    back_on_redis(&d, Duration::from_secs(4)).await;
    eprintln!("writes resumed: Redis-backed {:?} after the pause began", paused_at.elapsed());
}

/// Item: Redis closes idle connections (`CONFIG SET timeout 1`). Before:
/// after 3 s idle, the first requests met the dead connection: code 31,
/// then 33 (503 for `closed` locations) while Redis was healthy. Now the
/// link PINGs while idle, and a request that finds the link dead is sent
/// again on the fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_timeout_is_not_an_outage() {
    let (r, d, mut admin) = daemon_on_redis().await;
    let _: () = redis::cmd("CONFIG").arg("SET").arg("timeout").arg(1).query(&mut admin).unwrap();
    let mut c = d.client().await;
    for round in 0..2 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        for i in 0..50 {
            let resp = c.check(&args(&format!("idle-{round}-{i}"), 10, 1000)).await.unwrap();
            assert_eq!((resp.source, resp.error), (Source::Redis, ErrorCode::None), "round {round}, request {i}: {}", resp.message);
        }
    }
    // The daemon's connection was killed while idle: the next request is
    // still decided by Redis, on the fresh connection. (The test's own
    // connection was closed by the idle timeout too: a new one.)
    let mut admin = r.conn();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("timeout").arg(0).query(&mut admin).unwrap();
    let _: redis::Value = redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal").arg("SKIPME").arg("yes").query(&mut admin).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let resp = c.check(&args("after-kill", 10, 1000)).await.unwrap();
    assert_eq!((resp.source, resp.error), (Source::Redis, ErrorCode::None), "{}", resp.message);
}
