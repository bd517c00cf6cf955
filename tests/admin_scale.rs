//! The admin state at scale (issue 35 item 3), against real daemons and a
//! real Redis: a refresh with nothing changed reads no override (each
//! daemon read the whole overrides hash every `overrides_refresh`: at the
//! cap a 23.5 MB HGETALL, 30-71 ms in Redis, and its JSON parse on the
//! request path's threads); a change is read alone and still reaches the
//! other daemon within the bound. The figures at the caps (10,000
//! overrides, 100,000 bans) come from the `#[ignore]`d
//! `measure_the_admin_state_at_its_caps` (docs/ADMIN.md, "At the caps").

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Daemon, Deadline, RedisServer};
use ratelimitd::admin_api::client::Reply;
use ratelimitd::protocol::{Decision, FailPolicy, PolicyCheckArgs};
use serde_json::json;

const REFRESH_MS: u64 = 100;

/// `per_tenant`: 1 per minute, so one admission tells whether an
/// override raised it. `ban`: the first refusal bans for 10 minutes.
const POLICIES: &str = "[[policy]]\nname = \"per_tenant\"\nlimit = 1\nwindow = \"60s\"\n\
    [[policy]]\nname = \"ban\"\nlimit = 1\nwindow = \"10s\"\npenalty = { after = 1, within = \"10s\", ban = \"10m\" }\n";

fn daemon(redis: &RedisServer, dir: Option<&Path>, refresh: &str) -> Daemon {
    let listen = dir.map(|d| format!("listen = \"{}\"\n", d.join("admin.sock").display())).unwrap_or_default();
    // A generous Redis timeout: the checks below must be Redis's answers, not the fail policy's.
    Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\nkey_prefix = \"gw:\"\ntimeout_ms = 500\n[admin]\n{listen}overrides_refresh = \"{refresh}\"\n{POLICIES}", redis.url()))
}

fn put(dir: &Path, body: serde_json::Value) -> Reply {
    common::admin::admin(&dir.join("admin.sock"), "PUT", "/v1/overrides", Some(body))
}

fn tenant(key: &str) -> PolicyCheckArgs<'_> {
    PolicyCheckArgs { policy: b"per_tenant", key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// `cmdstat_<command>`'s calls and µs in all, from INFO commandstats.
fn commandstat(info: &str, command: &str) -> (u64, u64) {
    let line = info.lines().find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:"))).unwrap_or("");
    let field = |name: &str| line.split(',').find_map(|f| f.strip_prefix(name)).and_then(|v| v.parse().ok()).unwrap_or(0);
    (field("calls="), field("usec="))
}

fn info(redis: &RedisServer) -> String {
    redis::cmd("INFO").arg("commandstats").query(&mut redis.conn()).unwrap()
}

/// Checks `key` on `d` every 5 ms until it is admitted; how long it took.
async fn until_admitted(d: &Daemon, key: &str, limit: Duration) -> Duration {
    let mut c = d.client().await;
    let deadline = Deadline::start(format!("{key} admitted"), limit);
    loop {
        if c.check_policy(&tenant(key)).await.unwrap().decision == Decision::Allowed {
            return deadline.elapsed();
        }
        deadline.retry_in(Duration::from_millis(5), || "still refused: the override did not reach this daemon").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_with_nothing_changed_reads_no_override_and_a_change_is_read_alone() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let a = daemon(&redis, Some(dir.path()), &format!("{REFRESH_MS}ms"));
    for i in 0..50 {
        let r = put(dir.path(), json!({ "policy": "per_tenant", "key": format!("tenant-{i}"), "limit": 1000, "ttl": "1h", "note": "x".repeat(1000) }));
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    let b = daemon(&redis, None, &format!("{REFRESH_MS}ms"));
    // B has read the 50 at its start.
    let deadline = Instant::now() + Duration::from_secs(3);
    while !common::http::get(&common::http::agent(), &b.metrics_url(), &[]).body.contains("ratelimitd_live_overrides 50") {
        assert!(Instant::now() < deadline, "B did not read the 50 overrides at its start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(3 * REFRESH_MS)).await;

    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut redis.conn()).unwrap();
    tokio::time::sleep(Duration::from_millis(10 * REFRESH_MS)).await;
    let idle = info(&redis);
    let (hgetall, hgetall_us) = commandstat(&idle, "hgetall");
    let (reads, reads_us) = commandstat(&idle, "eval");
    eprintln!("two daemons, 50 overrides of 1 KB notes, {} ms idle: HGETALL {hgetall} calls {hgetall_us} us; EVAL (the change log read) {reads} calls {reads_us} us", 10 * REFRESH_MS);
    assert_eq!(hgetall, 0, "a refresh with nothing changed read the whole overrides hash: {idle}");
    assert_eq!(commandstat(&idle, "hmget").0, 0, "a refresh with nothing changed read overrides: {idle}");

    // A change: B reads that one field and applies it within the bound.
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut redis.conn()).unwrap();
    let mut cb = b.client().await;
    assert_eq!(cb.check_policy(&tenant("new")).await.unwrap().decision, Decision::Allowed);
    assert_eq!(cb.check_policy(&tenant("new")).await.unwrap().decision, Decision::Denied);
    let r = put(dir.path(), json!({ "policy": "per_tenant", "key": "new", "limit": 1000, "ttl": "1h" }));
    assert_eq!(r.status, 200, "{:?}", r.body);
    let took = until_admitted(&b, "new", Duration::from_millis(REFRESH_MS + 400)).await;
    eprintln!("a new override reached the other daemon in {took:?} (refresh {REFRESH_MS} ms)");
    tokio::time::sleep(Duration::from_millis(2 * REFRESH_MS)).await;
    let after = info(&redis);
    let (hmget, _) = commandstat(&after, "hmget");
    assert!((1..=2).contains(&hmget), "the change is read by one HMGET per daemon that had not written it: {after}");
    drop(a);
}

/// CPU time (user + system, in clock ticks) and RSS (kB) of process `pid`.
fn cpu_and_rss(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let cpu = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok()).unwrap_or(0);
    (cpu, rss)
}

/// The figures of docs/ADMIN.md, "At the caps": 10,000 overrides with
/// 500-byte keys and 1 KB notes (the 23.5 MB hash), 100,000 bans
/// cached by one daemon, two daemons refreshing every second. Redis's time
/// per refresh (commandstats and SLOWLOG), the daemons' CPU and RSS while
/// idle, and the time a new override takes to reach the other daemon.
/// `cargo test --release --test admin_scale -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement (minutes, 1 GB of Redis traffic at start): scripts/measure admin-scale runs it"]
async fn measure_the_admin_state_at_its_caps() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    // The 10,000 overrides, as the API stores them (written straight into
    // Redis: 10,000 PUTs would measure the API, not the refresh).
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let mut conn = redis.conn();
    let mut pipe = redis::pipe();
    // 9,990 of them: the 10 PUTs of the propagation below make 10,000.
    for i in 0..9_990 {
        let key = format!("{i:05}-{}", "k".repeat(494));
        let mut field = vec![b"per_tenant".len() as u8];
        field.extend_from_slice(b"per_tenant");
        field.extend_from_slice(key.as_bytes());
        let value = json!({ "policy": "per_tenant", "key": key, "limit": 1000, "expires_at_ms": now + 3_600_000, "set_by": "measure", "set_at_ms": now, "note": "n".repeat(1024) });
        pipe.cmd("HSET").arg("gw:admin:overrides").arg(field).arg(value.to_string()).ignore();
    }
    let _: () = pipe.query(&mut conn).unwrap();
    let bytes: u64 = redis::cmd("MEMORY").arg("USAGE").arg("gw:admin:overrides").query(&mut conn).unwrap();
    eprintln!("overrides hash: 9990 fields, {:.1} MB in Redis", bytes as f64 / 1e6);

    let a = daemon(&redis, Some(dir.path()), "1s");
    let b = daemon(&redis, None, "1s");
    // 100,000 bans learnt by B (the cap of its ban cache).
    let mut cb = b.client().await;
    let started = Instant::now();
    for i in 0..100_000 {
        let key = format!("banned-{i}");
        let args = PolicyCheckArgs { policy: b"ban", key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
        cb.check_policy(&args).await.unwrap();
        cb.check_policy(&args).await.unwrap();
    }
    eprintln!("100000 bans engaged through B in {:?}", started.elapsed());
    tokio::time::sleep(Duration::from_secs(3)).await;

    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut conn).unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("slowlog-log-slower-than").arg("0").query(&mut conn).unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("slowlog-max-len").arg("10000").query(&mut conn).unwrap();
    let (ca0, cb0) = (cpu_and_rss(a.pid()), cpu_and_rss(b.pid()));
    const IDLE: u64 = 20;
    tokio::time::sleep(Duration::from_secs(IDLE)).await;
    let (ca1, cb1) = (cpu_and_rss(a.pid()), cpu_and_rss(b.pid()));
    let stats = info(&redis);
    let ticks = 100.0; // USER_HZ
    for (name, (c0, _), (c1, rss)) in [("A", ca0, ca1), ("B (100000 bans cached)", cb0, cb1)] {
        eprintln!("daemon {name}: idle CPU {:.2} % of a core over {IDLE} s, RSS {:.1} MB", (c1 - c0) as f64 / ticks / IDLE as f64 * 100.0, rss as f64 / 1024.0);
    }
    for command in ["evalsha", "eval", "hmget", "hgetall", "zremrangebyscore"] {
        let (calls, usec) = commandstat(&stats, command);
        if calls > 0 {
            eprintln!("redis {command}: {calls} calls in {IDLE} s, {:.1} us per call", usec as f64 / calls as f64);
        }
    }
    let slow: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").arg(10_000).query(&mut conn).unwrap();
    let mut micros: Vec<u64> = slow
        .iter()
        .filter_map(|e| match e {
            redis::Value::Array(f) => match (&f[2], &f[3]) {
                (redis::Value::Int(us), redis::Value::Array(args)) if matches!(args.first(), Some(redis::Value::BulkString(c)) if c.eq_ignore_ascii_case(b"eval") || c.eq_ignore_ascii_case(b"zremrangebyscore")) => Some(*us as u64),
                _ => None,
            },
            _ => None,
        })
        .collect();
    micros.sort_unstable();
    if !micros.is_empty() {
        let q = |p: f64| micros[((micros.len() - 1) as f64 * p) as usize];
        eprintln!("redis time per refresh command (SLOWLOG, {} entries): median {} us, p99 {} us, max {} us", micros.len(), q(0.5), q(0.99), micros[micros.len() - 1]);
    }

    // The whole read, for comparison: what a daemon does at its start, or
    // when it lost its place in the change log.
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let whole = Instant::now();
    let _: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL").arg("gw:admin:overrides").query(&mut conn).unwrap();
    let slow: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").arg(1).query(&mut conn).unwrap();
    let in_redis = match slow.first() {
        Some(redis::Value::Array(f)) => match &f[2] {
            redis::Value::Int(us) => *us,
            _ => -1,
        },
        _ => -1,
    };
    eprintln!("one HGETALL of the hash (a daemon's start): {in_redis} us in Redis, {:?} to the test", whole.elapsed());

    // Propagation: an override PUT on A, admitted by B.
    let mut times = Vec::new();
    for i in 0..10 {
        let key = format!("fresh-{i}");
        let mut cbk = b.client().await;
        assert_eq!(cbk.check_policy(&tenant(&key)).await.unwrap().decision, Decision::Allowed);
        assert_eq!(cbk.check_policy(&tenant(&key)).await.unwrap().decision, Decision::Denied);
        let r = put(dir.path(), json!({ "policy": "per_tenant", "key": key, "limit": 1000, "ttl": "1h" }));
        assert_eq!(r.status, 200, "{:?}", r.body);
        times.push(until_admitted(&b, &key, Duration::from_secs(3)).await);
        tokio::time::sleep(Duration::from_millis(137)).await;
    }
    times.sort();
    eprintln!("a PUT on A reached B in: min {:?}, median {:?}, max {:?} (refresh 1 s)", times[0], times[times.len() / 2], times[times.len() - 1]);
}

/// `n` overrides of `per_tenant` stored as the API stores them, expiring
/// at `expires_at_ms` (straight into Redis: n PUTs would take minutes).
fn store_overrides(redis: &RedisServer, n: usize, expires_at_ms: u64) {
    let mut pipe = redis::pipe();
    for i in 0..n {
        let key = format!("stored-{i}");
        let mut field = vec![b"per_tenant".len() as u8];
        field.extend_from_slice(b"per_tenant");
        field.extend_from_slice(key.as_bytes());
        let value = json!({ "policy": "per_tenant", "key": key, "limit": 1000, "expires_at_ms": expires_at_ms, "set_by": "test", "set_at_ms": 0 });
        pipe.cmd("HSET").arg("gw:admin:overrides").arg(field).arg(value.to_string()).ignore();
    }
    let _: () = pipe.query(&mut redis.conn()).unwrap();
}

/// Each PUT read the whole overrides hash (HGETALL: 24.7 MB at the cap)
/// to count those in force, and parsed it on the request path's threads.
/// Now a PUT below the cap reads one field and the hash's length; at the
/// cap it reads the whole hash, deletes the expired fields and counts; the
/// 10,001st override in force is refused, an expired one makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_below_the_cap_reads_no_whole_hash_and_the_cap_holds_at_ten_thousand() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    store_overrides(&redis, 100, now + 3_600_000);
    // Refreshing once an hour: the only whole read is at its start.
    let _a = daemon(&redis, Some(dir.path()), "1h");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query(&mut redis.conn()).unwrap();
    let r = put(dir.path(), json!({ "policy": "per_tenant", "key": "one-more", "limit": 10, "ttl": "1h" }));
    assert_eq!(r.status, 200, "{:?}", r.body);
    let stats = info(&redis);
    assert_eq!(commandstat(&stats, "hgetall").0, 0, "a PUT below the cap read the whole hash: {stats}");

    // The cap: 10,000 in force (9,999 more stored + "one-more").
    let _: () = redis::cmd("DEL").arg("gw:admin:overrides").query(&mut redis.conn()).unwrap();
    store_overrides(&redis, 9_999, now + 3_600_000);
    let r = put(dir.path(), json!({ "policy": "per_tenant", "key": "one-more", "limit": 11, "ttl": "1h" }));
    assert_eq!(r.status, 200, "rewriting one in force is no new one: {:?}", r.body);
    let r = put(dir.path(), json!({ "policy": "per_tenant", "key": "over-the-cap", "limit": 10, "ttl": "1h" }));
    assert_eq!(r.status, 400, "{:?}", r.body);
    assert!(r.body["error"].as_str().unwrap().contains("10000 overrides are in force already"), "{:?}", r.body);
    // One of them expired: it is deleted and its place taken.
    store_overrides(&redis, 1, now.saturating_sub(1));
    let r = put(dir.path(), json!({ "policy": "per_tenant", "key": "over-the-cap", "limit": 10, "ttl": "1h" }));
    assert_eq!(r.status, 200, "{:?}", r.body);
    let stored: u64 = redis::cmd("HLEN").arg("gw:admin:overrides").query(&mut redis.conn()).unwrap();
    assert_eq!(stored, 10_000);
}
