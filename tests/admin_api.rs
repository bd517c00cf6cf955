//! The admin API (docs/ADMIN.md) against the real daemon binary, a real
//! Redis (a real Redis Cluster for the fleet-wide bound) and a second
//! daemon sharing it: peeks record nothing, overrides set on one daemon
//! are applied by another within the stated bound, survive a restart and
//! leave at their expiry, and bad input changes nothing.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::redis_cluster::RedisCluster;
use common::{Daemon, RedisServer};
use common::clock::now_ms;
use ratelimitd::admin_api::client::{encode, request, Reply};
use ratelimitd::config::AdminListen;
use ratelimitd::protocol::{Decision, FailPolicy, PolicyCheckArgs};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

/// The refresh interval of the tests' daemons, and the stated bound on
/// applying a new override: one refresh plus one Redis round trip (given
/// 400 ms of slack on a loaded 2-core machine).
const REFRESH_MS: u64 = 200;
const APPLY_BOUND: Duration = Duration::from_millis(REFRESH_MS + 400);

const POLICIES: &str = "[[policy]]\nname = \"per_tenant\"\nlimit = 2\nwindow = \"60s\"\n\
    [[policy]]\nname = \"hot\"\nlimit = 6\nwindow = \"60s\"\nshards = 3\n";

fn admin_socket(dir: &Path) -> PathBuf {
    dir.join("admin.sock")
}

/// A daemon on `redis` (the `[redis]` lines), with the admin API on a
/// socket in `dir` when `dir` is given, and `admin_extra` in `[admin]`.
fn daemon(redis: &str, dir: Option<&Path>, admin_extra: &str) -> Daemon {
    let listen = dir.map(|d| format!("listen = \"{}\"\n", admin_socket(d).display())).unwrap_or_default();
    Daemon::start_config(&format!("socket_mode = \"0600\"\n{redis}\ntimeout_ms = 500\nkey_prefix = \"gw:\"\n[admin]\n{listen}overrides_refresh = \"{REFRESH_MS}ms\"\n{admin_extra}\n{POLICIES}"))
}

fn unix(dir: &Path) -> AdminListen {
    AdminListen::Unix { path: admin_socket(dir), mode: 0o600 }
}

fn call(dir: &Path, token: Option<&str>, method: &str, path: &str, body: Option<serde_json::Value>) -> Reply {
    request(&unix(dir), token, method, path, body.map(|b| b.to_string()).as_deref()).unwrap()
}

fn policy<'a>(name: &'a str, key: &'a str) -> PolicyCheckArgs<'a> {
    PolicyCheckArgs { policy: name.as_bytes(), key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// Checks `key` on `d` every 10 ms until the answer is `want`; how long it took.
async fn until(d: &Daemon, key: &str, want: Decision, limit: Duration) -> Duration {
    let mut c = d.client().await;
    let start = Instant::now();
    loop {
        let r = c.check_policy(&policy("per_tenant", key)).await.unwrap();
        if r.decision == want {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "still {:?} after {limit:?}, wanted {want:?}", r.decision);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn fill(d: &Daemon, key: &str) {
    let mut c = d.client().await;
    for _ in 0..2 {
        assert_eq!(c.check_policy(&policy("per_tenant", key)).await.unwrap().decision, Decision::Allowed);
    }
    assert_eq!(c.check_policy(&policy("per_tenant", key)).await.unwrap().decision, Decision::Denied);
}

/// The fleet: daemon A serves the API, daemon B only shares the Redis.
async fn an_override_set_on_one_daemon_is_applied_by_another_within_the_bound_and_leaves_at_its_expiry(redis: &str) {
    let dir = tempfile::tempdir().unwrap();
    let a = daemon(redis, Some(dir.path()), "");
    let mut b = daemon(redis, None, "");
    fill(&b, "tenant-x").await;

    // Unlimited for 2 s: B admits within the bound.
    let set = call(dir.path(), None, "PUT", "/v1/overrides", Some(json!({ "policy": "per_tenant", "key": "tenant-x", "limit": "unlimited", "ttl": "2s", "note": "ticket 1" })));
    assert_eq!(set.status, 200, "{:?}", set.body);
    let expires_at_ms = set.body["after"]["expires_at_ms"].as_u64().unwrap();
    assert_eq!(set.body["before_limit"], json!(2));
    let took = until(&b, "tenant-x", Decision::Allowed, Duration::from_secs(5)).await;
    eprintln!("override applied by the other daemon after {took:?} (bound {APPLY_BOUND:?})");
    assert!(took <= APPLY_BOUND, "applied after {took:?}, bound {APPLY_BOUND:?}");

    // At its expiry (Redis's clock: this host's), the file's limit again.
    let mut c = b.client().await;
    let left = until(&b, "tenant-x", Decision::Denied, Duration::from_secs(5)).await;
    let late = now_ms().saturating_sub(expires_at_ms);
    eprintln!("override left after {left:?}, {late} ms after its expiry");
    assert!(now_ms() + 5 >= expires_at_ms, "refused again before the expiry");
    assert!(late <= 400, "still applied {late} ms after its expiry");

    // A numeric override: exactly 4 in the window, on B, and after B restarts.
    let set = call(dir.path(), None, "PUT", "/v1/overrides", Some(json!({ "policy": "per_tenant", "key": "tenant-x", "limit": 4, "ttl": "1h" })));
    assert_eq!(set.status, 200, "{:?}", set.body);
    until(&b, "tenant-x", Decision::Allowed, APPLY_BOUND).await; // the 3rd
    assert_eq!(c.check_policy(&policy("per_tenant", "tenant-x")).await.unwrap().decision, Decision::Allowed, "the 4th");
    assert_eq!(c.check_policy(&policy("per_tenant", "tenant-x")).await.unwrap().decision, Decision::Denied, "the 5th");
    drop(c);
    b.terminate();
    b.start_again();
    tokio::time::sleep(Duration::from_millis(REFRESH_MS + 200)).await;
    fill(&b, "tenant-y").await; // other keys keep the file's limit
    let list = call(dir.path(), None, "GET", "/v1/overrides", None);
    assert_eq!(list.body["overrides"].as_array().unwrap().len(), 1, "{:?}", list.body);
    assert_eq!(list.body["overrides"][0]["limit"], json!(4));

    // Deleted: the file's limit (2) applies; the window holds 4 already.
    let del = call(dir.path(), None, "DELETE", "/v1/overrides?policy=per_tenant&key=tenant-x", None);
    assert_eq!(del.status, 200, "{:?}", del.body);
    assert_eq!(del.body["limit_now"], json!(2));
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_set_through_the_api_is_applied_by_another_daemon_within_the_bound_and_leaves_at_its_expiry() {
    let redis = RedisServer::start_unix();
    an_override_set_on_one_daemon_is_applied_by_another_within_the_bound_and_leaves_at_its_expiry(&format!("[redis]\nurl = \"{}\"", redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_an_override_is_applied_fleet_wide_within_the_bound_and_leaves_at_its_expiry() {
    let cluster = RedisCluster::start();
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    an_override_set_on_one_daemon_is_applied_by_another_within_the_bound_and_leaves_at_its_expiry(&format!("[redis]\ncluster = [{}]", seeds.join(", "))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peek_shows_count_remaining_and_reset_and_records_nothing_in_redis() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(&format!("[redis]\nurl = \"{}\"", redis.url()), Some(dir.path()), "");
    let mut conn = redis.conn();

    // A key never seen: the peek creates nothing.
    let peek = call(dir.path(), None, "GET", "/v1/keys?policy=per_tenant&key=fresh", None);
    assert_eq!(peek.status, 200, "{:?}", peek.body);
    assert_eq!(peek.body["count"], json!(0));
    assert_eq!(peek.body["remaining"], json!(2));
    let keys: Vec<String> = redis::cmd("KEYS").arg("gw:*").query(&mut conn).unwrap();
    assert!(keys.is_empty(), "a peek created {keys:?}");

    let mut c = d.client().await;
    assert_eq!(c.check_policy(&policy("per_tenant", "t")).await.unwrap().decision, Decision::Allowed);
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("gw:*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let window = keys[0].clone();
    let before: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE").arg(&window).arg(0).arg(-1).arg("WITHSCORES").query(&mut conn).unwrap();
    assert_eq!(before.len(), 1);
    for _ in 0..5 {
        let peek = call(dir.path(), None, "GET", "/v1/keys?policy=per_tenant&key=t", None);
        assert_eq!(peek.body["count"], json!(1), "{:?}", peek.body);
        assert_eq!(peek.body["remaining"], json!(1));
        assert_eq!(peek.body["limit_from"], json!("policy"));
        let reset = peek.body["windows"][0]["reset_in_ms"].as_u64().unwrap();
        assert!(reset > 59_000 && reset <= 60_000, "{reset}");
    }
    let after: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE").arg(&window).arg(0).arg(-1).arg("WITHSCORES").query(&mut conn).unwrap();
    assert_eq!(before, after, "peeks changed the window");
    let r = c.check_policy(&policy("per_tenant", "t")).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 2), "the next check counts only the one admission before");

    // A sharded policy: one window per shard, each with its part of 6.
    let peek = call(dir.path(), None, "GET", "/v1/keys?policy=hot&key=k", None);
    let limits: Vec<u64> = peek.body["windows"].as_array().unwrap().iter().map(|w| w["limit"].as_u64().unwrap()).collect();
    assert_eq!(limits, vec![2, 2, 2]);

    // A reset through the API: the quota is whole again, and it is logged.
    let reset = call(dir.path(), None, "DELETE", "/v1/keys?policy=per_tenant&key=t", None);
    assert_eq!(reset.status, 200, "{:?}", reset.body);
    assert_eq!(reset.body["before_in_window"], json!(2));
    let peek = call(dir.path(), None, "GET", "/v1/keys?policy=per_tenant&key=t", None);
    assert_eq!(peek.body["count"], json!(0));
    assert!(d.log().contains("admin write") && d.log().contains("op=\"reset\""), "{}", d.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_error_and_changes_nothing() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("write.token"), "w-secret\n").unwrap();
    std::fs::write(dir.path().join("read.token"), "r-secret\n").unwrap();
    let tokens = format!("token_file = \"{}\"\nread_token_file = \"{}\"\n", dir.path().join("write.token").display(), dir.path().join("read.token").display());
    let d = Daemon::start_config_with_metrics(&format!(
        "socket_mode = \"0600\"\n[redis]\nurl = \"{}\"\nkey_prefix = \"gw:\"\n[admin]\nlisten = \"{}\"\noverrides_refresh = \"{REFRESH_MS}ms\"\n{tokens}\n{POLICIES}",
        redis.url(),
        admin_socket(dir.path()).display()
    ));
    let good = json!({ "policy": "per_tenant", "key": "k", "limit": 10, "ttl": "1h" });
    let put = |token: Option<&str>, body: serde_json::Value| call(dir.path(), token, "PUT", "/v1/overrides", Some(body));
    let w = Some("w-secret");

    let cases: Vec<(Reply, u16, &str)> = vec![
        (put(None, good.clone()), 401, "Bearer"),
        (put(Some("nope"), good.clone()), 401, "wrong token"),
        (put(Some("r-secret"), good.clone()), 403, "read scope"),
        (call(dir.path(), Some("r-secret"), "DELETE", "/v1/keys?policy=per_tenant&key=k", None), 403, "read scope"),
        (request(&unix(dir.path()), w, "PUT", "/v1/overrides", Some("{\"policy\": ")).unwrap(), 400, "malformed override"),
        (put(w, json!({ "policy": "per_tenant", "key": "k", "limit": 10, "ttl": "1h", "colour": "red" })), 400, "unknown field"),
        (put(w, json!({ "policy": "nope", "key": "k", "limit": 10, "ttl": "1h" })), 404, "no [[policy]] named \"nope\""),
        (put(w, json!({ "policy": "per_tenant", "key": "k", "limit": 10, "expires_at": "2001-01-01T00:00:00Z" })), 400, "not in the future"),
        (put(w, json!({ "policy": "per_tenant", "key": "k", "limit": 10, "expires_at": "tomorrow" })), 400, "not a UTC time"),
        (put(w, json!({ "policy": "per_tenant", "key": "k", "limit": 10 })), 400, "exactly one of expires_at"),
        (put(w, json!({ "policy": "per_tenant", "key": "k", "limit": 10, "ttl": "400d" })), 400, "366 days"),
        (put(w, json!({ "policy": "per_tenant", "key": "x".repeat(600), "limit": 10, "ttl": "1h" })), 400, "longer than limits.max_key_len"),
        (put(w, json!({ "policy": "per_tenant", "key": "k", "limit": 0, "ttl": "1h" })), 400, "not between 1"),
        (put(w, json!({ "policy": "per_tenant", "key": "k", "limit": -3, "ttl": "1h" })), 400, "not between 1"),
        (put(w, json!({ "policy": "per_tenant", "key": "k", "limit": "lots", "ttl": "1h" })), 400, "not a number or \"unlimited\""),
        (put(w, json!({ "policy": "hot", "key": "k", "limit": 2, "ttl": "1h" })), 400, "below the 3 shards"),
        (request(&unix(dir.path()), w, "PUT", "/v1/overrides", Some(&format!("{{\"note\": \"{}\"}}", "x".repeat(70_000)))).unwrap(), 413, "larger than"),
        (call(dir.path(), w, "GET", &format!("/v1/keys?policy=per_tenant&key={}", encode(&"k".repeat(513))), None), 400, "longer than limits.max_key_len"),
        (call(dir.path(), w, "GET", "/v1/keys?policy=nope&key=k", None), 404, "no [[policy]]"),
        (call(dir.path(), w, "GET", "/v1/keys?policy=per_tenant&key=%ff", None), 400, "percent-encoded UTF-8"),
        (call(dir.path(), w, "DELETE", "/v1/overrides?policy=per_tenant&key=never", None), 404, "no override"),
        (call(dir.path(), w, "POST", "/v1/overrides", None), 404, "no such endpoint"),
    ];
    for (reply, status, message) in &cases {
        assert_eq!(reply.status, *status, "{reply:?}");
        assert!(reply.body["error"].as_str().unwrap_or("").contains(message), "{:?} lacks {message:?}", reply.body);
    }
    let mut conn = redis.conn();
    let stored: u64 = redis::cmd("HLEN").arg("gw:admin:overrides").query(&mut conn).unwrap();
    assert_eq!(stored, 0, "a refused write stored something");

    // The read token reads; the write token writes; both are counted.
    assert_eq!(call(dir.path(), Some("r-secret"), "GET", "/v1/overrides", None).status, 200);
    assert_eq!(put(w, good).status, 200);
    let metrics = common::http::get(&common::http::agent(), &d.metrics_url(), &[]).body;
    for line in ["ratelimitd_admin_requests_total{op=\"override_set\",result=\"unauthorized\"} 2", "ratelimitd_admin_requests_total{op=\"override_set\",result=\"forbidden\"} 1", "ratelimitd_admin_requests_total{op=\"override_set\",result=\"done\"} 1", "ratelimitd_admin_requests_total{op=\"override_list\",result=\"done\"} 1"] {
        assert!(metrics.contains(line), "no {line} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_sets_lists_and_deletes_overrides_and_inspects_through_the_api() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(&format!("[redis]\nurl = \"{}\"", redis.url()), Some(dir.path()), "");
    let run = |args: &[&str]| {
        let out = Command::new(BIN).arg(args[0]).arg("--config").arg(&d.config).args(&args[1..]).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    let (ok, out) = run(&["override", "set", "--policy", "per_tenant", "--key", "tenant-a", "--limit", "5000", "--until", "2099-01-01T09:00:00Z", "--note", "incident 42"]);
    assert!(!ok && out.contains("366 days"), "{out}");
    let (ok, out) = run(&["override", "set", "--policy", "per_tenant", "--key", "tenant-a", "--limit", "5000", "--for", "1d", "--note", "incident 42"]);
    assert!(ok, "{out}");
    assert!(out.contains("limit 2 -> 5000"), "{out}");
    let (ok, out) = run(&["override", "list"]);
    assert!(ok && out.contains("per_tenant tenant-a limit 5000") && out.contains("incident 42"), "{out}");
    tokio::time::sleep(APPLY_BOUND).await;
    let (ok, out) = run(&["inspect", "--policy", "per_tenant", "--key", "tenant-a"]);
    assert!(ok && out.contains("limit:        5000 (api_override)"), "{out}");
    let (ok, out) = run(&["override", "delete", "--policy", "per_tenant", "--key", "tenant-a"]);
    assert!(ok && out.contains("limit now 2"), "{out}");
    let (ok, out) = run(&["override", "delete", "--policy", "per_tenant", "--key", "tenant-a"]);
    assert!(!ok && out.contains("404") && out.contains("no override"), "{out}");
    let (ok, out) = run(&["reset", "--policy", "nope", "--key", "k"]);
    assert!(!ok && out.contains("no [[policy]] named"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reload_the_api_knows_the_new_policies() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(&format!("[redis]\nurl = \"{}\"", redis.url()), Some(dir.path()), "");
    let body = json!({ "policy": "added", "key": "k", "limit": 9, "ttl": "1h" });
    assert_eq!(call(dir.path(), None, "PUT", "/v1/overrides", Some(body.clone())).status, 404);
    d.rewrite_config(&format!("{}[[policy]]\nname = \"added\"\nlimit = 1\nwindow = \"60s\"\n", d.config_text()));
    d.signal(nix::sys::signal::Signal::SIGHUP);
    let start = Instant::now();
    while call(dir.path(), None, "PUT", "/v1/overrides", Some(body.clone())).status != 200 {
        assert!(start.elapsed() < Duration::from_secs(5), "the API never saw the reloaded policy\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_key_without_a_window_is_refused_with_a_400_and_no_scan_runs_unless_scan_1_asks_for_it() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(&format!("[redis]\nurl = \"{}\"", redis.url()), Some(dir.path()), "");
    let scans = || -> u64 {
        let stats: String = redis::cmd("INFO").arg("commandstats").query(&mut redis.conn()).unwrap();
        stats.lines().find_map(|l| l.strip_prefix("cmdstat_scan:calls=")).map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
    };
    let w = None;
    for method in ["GET", "DELETE"] {
        let reply = call(dir.path(), w, method, "/v1/keys?key=tenant-a", None);
        assert_eq!(reply.status, 400, "{method}: {reply:?}");
        let error = reply.body["error"].as_str().unwrap_or("");
        assert!(error.contains("key tenant-a names no window: give policy=NAME") && error.contains("scan=1"), "{method}: {error}");
        for bad in ["/v1/keys?key=tenant-a&scan=yes", "/v1/keys?key=tenant-a&scan=1&window_ms=60000"] {
            assert_eq!(call(dir.path(), w, method, bad, None).status, 400, "{method} {bad}");
        }
    }
    assert_eq!(scans(), 0, "refused before any SCAN");
    // A window named, or the policy's: answered without a SCAN.
    assert_eq!(call(dir.path(), w, "GET", "/v1/keys?key=tenant-a&window_ms=60000", None).status, 200);
    assert_eq!(call(dir.path(), w, "GET", "/v1/keys?policy=per_tenant&key=tenant-a", None).status, 200);
    assert_eq!(scans(), 0);
    // Asked for: every window of the key, by SCAN; the CLI's --scan sends scan=1.
    assert_eq!(call(dir.path(), w, "GET", "/v1/keys?key=tenant-a&scan=1", None).status, 200);
    let after_get = scans();
    assert!(after_get > 0);
    let out = Command::new(BIN).args(["inspect", "--config"]).arg(&d.config).args(["--key", "tenant-a", "--scan", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(scans() > after_get);
}

/// Issue 35 item 4: a key no request can carry (a control byte) was stored
/// by `PUT /v1/overrides` and counted toward the cap, while check-config
/// refuses the same key in `[policy.overrides]`: one rule for both now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_no_request_can_carry_is_refused_by_the_api_as_check_config_refuses_it() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(&format!("[redis]\nurl = \"{}\"", redis.url()), Some(dir.path()), "");
    for key in ["a\u{0}b", "tab\tkey", "del\u{7f}"] {
        let reply = call(dir.path(), None, "PUT", "/v1/overrides", Some(json!({ "policy": "per_tenant", "key": key, "limit": 10, "ttl": "1h" })));
        assert_eq!(reply.status, 400, "{key:?}: {reply:?}");
        assert!(reply.body["error"].as_str().unwrap_or("").contains("control character"), "{key:?}: {:?}", reply.body);
    }
    let stored: u64 = redis::cmd("HLEN").arg("gw:admin:overrides").query(&mut redis.conn()).unwrap();
    assert_eq!(stored, 0, "an override no request can match was stored");
    // check-config refuses the same key in the file, by the same rule.
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, format!("{}[policy.overrides]\n\"a\\u0000b\" = 10\n", d.config_text())).unwrap();
    let out = Command::new(BIN).arg("check-config").arg("--config").arg(&file).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("can never be sent"), "{text}");
}
