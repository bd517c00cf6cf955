//! The penalty box (docs/POLICIES.md, "Penalty box") against the real
//! daemon binary and a real Redis (and a real Redis Cluster): a ban engages
//! after N refusals within W on one daemon and is honoured by another that
//! never saw the key, with Retry-After the ban's end; while banned the
//! daemons answer from their ban cache with no Redis call; a lift through
//! the admin API reaches every daemon within the refresh bound; a shadow
//! policy's ban is recorded and counted, never enforced; the memory
//! backend bans too; a penalty policy in a multi-item check is refused
//! loudly.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::redis_cluster::RedisCluster;
use common::{Daemon, Nginx, RedisServer};
use ratelimitd::admin_api::client::{request, Reply};
use ratelimitd::config::AdminListen;
use ratelimitd::protocol::{Decision, ErrorCode, FailPolicy, ItemArgs, PolicyCheckArgs, Source};
use serde_json::json;

/// The admin state's refresh (overrides and lifts), and the bound on a lift
/// reaching another daemon: one refresh plus a round trip, with 400 ms of
/// slack for a loaded 2-core machine.
const REFRESH_MS: u64 = 200;
const LIFT_BOUND: Duration = Duration::from_millis(REFRESH_MS + 400);

/// `login`: 2 per second; 3 refusals within 10 s ban the key for 3 s.
/// `login_shadow`: the same, in shadow.
const POLICIES: &str = "[[policy]]\nname = \"login\"\nlimit = 2\nwindow = \"1s\"\npenalty = { after = 3, within = \"10s\", ban = \"3s\" }\n\
    [[policy]]\nname = \"login_shadow\"\nlimit = 2\nwindow = \"1s\"\nshadow = true\npenalty = { after = 3, within = \"10s\", ban = \"3s\" }\n\
    [[policy]]\nname = \"plain\"\nlimit = 5\nwindow = \"1s\"\n";

fn daemon(redis: &str, dir: Option<&Path>, metrics: bool) -> Daemon {
    let listen = dir.map(|d| format!("listen = \"{}\"\n", admin_socket(d).display())).unwrap_or_default();
    let text = format!("socket_mode = \"0600\"\n{redis}\n[admin]\n{listen}overrides_refresh = \"{REFRESH_MS}ms\"\n{POLICIES}");
    if metrics {
        Daemon::start_config_with_metrics(&text)
    } else {
        Daemon::start_config(&text)
    }
}

fn admin_socket(dir: &Path) -> PathBuf {
    dir.join("admin.sock")
}

fn call(dir: &Path, method: &str, path: &str) -> Reply {
    request(&AdminListen::Unix { path: admin_socket(dir), mode: 0o600 }, None, method, path, None).unwrap()
}

fn login<'a>(policy: &'a str, key: &'a str) -> PolicyCheckArgs<'a> {
    PolicyCheckArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }
}

/// EVALSHA calls Redis has run so far (every primary of a Cluster).
type Calls = Box<dyn Fn() -> u64>;

fn evalsha_in(info: &str) -> u64 {
    info.lines().find_map(|l| l.strip_prefix("cmdstat_evalsha:calls=")).and_then(|rest| rest.split(',').next()).and_then(|n| n.parse().ok()).unwrap_or(0)
}

async fn a_ban_engages_after_n_refusals_on_one_daemon_and_is_honoured_by_another(what: &str, redis: &str, evalsha_calls: Calls) {
    let dir = tempfile::tempdir().unwrap();
    let a = daemon(redis, Some(dir.path()), true);
    let b = daemon(redis, None, false);
    let (mut ca, mut cb) = (a.client().await, b.client().await);

    // On A: 2 admitted, 2 refusals by the window (retry within the 1 s window)...
    for _ in 0..2 {
        assert_eq!(ca.check_policy(&login("login", "u1")).await.unwrap().decision, Decision::Allowed);
    }
    for _ in 0..2 {
        let r = ca.check_policy(&login("login", "u1")).await.unwrap();
        assert_eq!((r.decision, r.source), (Decision::Denied, Source::Redis), "{r:?}");
        assert!(r.retry_after_ms <= 1000, "a window's refusal: {r:?}");
    }
    // ... and the third refusal engages the ban: Retry-After is its end.
    let r = ca.check_policy(&login("login", "u1")).await.unwrap();
    let banned_at = Instant::now();
    assert_eq!((r.decision, r.source, r.remaining), (Decision::Denied, Source::Redis, 0), "{r:?}");
    assert_eq!(r.retry_after_ms, 3000, "the ban's end: {r:?}");
    // A's next answer comes from its cache.
    let r = ca.check_policy(&login("login", "u1")).await.unwrap();
    assert_eq!((r.decision, r.source), (Decision::Denied, Source::DenialCache), "{r:?}");
    assert!(r.retry_after_ms > 2500 && r.retry_after_ms <= 3000, "{r:?}");
    // Another key and another policy are untouched.
    assert_eq!(ca.check_policy(&login("login", "u2")).await.unwrap().decision, Decision::Allowed);
    assert_eq!(ca.check_policy(&login("plain", "u1")).await.unwrap().decision, Decision::Allowed);

    // After the 1 s window the window alone would admit: B, which never saw
    // the key, is refused by the ban in Redis, Retry-After the ban's end.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = cb.check_policy(&login("login", "u1")).await.unwrap();
    let left = 3000u64.saturating_sub(banned_at.elapsed().as_millis() as u64);
    assert_eq!((r.decision, r.source, r.remaining), (Decision::Denied, Source::Redis, 0), "{r:?}");
    assert!(u64::from(r.retry_after_ms) <= left + 50 && u64::from(r.retry_after_ms) + 600 >= left, "retry {} ms, the ban has {left} ms left", r.retry_after_ms);
    // While banned, B answers from its cache: no Redis call at all.
    let before = evalsha_calls();
    for _ in 0..20 {
        let r = cb.check_policy(&login("login", "u1")).await.unwrap();
        assert_eq!((r.decision, r.source), (Decision::Denied, Source::DenialCache), "{r:?}");
    }
    assert_eq!(evalsha_calls(), before, "a banned key's requests made Redis calls");
    eprintln!("{what}: 20 requests of a banned key on the other daemon, EVALSHA calls in Redis before and after: {before} and {}", evalsha_calls());

    // Listed by the admin API, fleet-wide; one key's state with its strikes.
    let list = call(dir.path(), "GET", "/v1/bans");
    assert_eq!(list.status, 200, "{:?}", list.body);
    let bans = list.body["bans"].as_array().unwrap();
    assert_eq!(bans.len(), 1, "{:?}", list.body);
    assert_eq!((&bans[0]["policy"], &bans[0]["key"]), (&json!("login"), &json!("u1")));
    let one = call(dir.path(), "GET", "/v1/bans?policy=login&key=u1");
    assert_eq!(one.body["banned"], json!(true), "{:?}", one.body);
    let peek = call(dir.path(), "GET", "/v1/keys?policy=login&key=u1");
    assert!(peek.body["banned_for_ms"].as_u64().is_some_and(|ms| ms > 0 && ms <= 3000), "the peek shows the ban: {:?}", peek.body);
    let one = call(dir.path(), "GET", "/v1/bans?policy=login&key=u2");
    assert_eq!((&one.body["banned"], &one.body["strikes"]), (&json!(false), &json!(0)), "{:?}", one.body);

    // Visible in metrics and top.
    let metrics = common::http::get(&common::http::agent(), &a.metrics_url(), &[]).body;
    assert!(metrics.contains("ratelimitd_penalty_bans_total{policy=\"login\"} 1"), "{metrics}");
    assert!(metrics.contains("ratelimitd_penalty_banned_requests_total{policy=\"login\"} 2"), "{metrics}");
    let top = common::http::get(&common::http::agent(), &a.metrics_url().replace("/metrics", "/top.json"), &[]).body;
    let top: serde_json::Value = serde_json::from_str(&top).unwrap();
    assert_eq!((&top["bans"][0]["policy"], &top["bans"][0]["key"], &top["bans_known"]), (&json!("login"), &json!("u1"), &json!(1)), "{top}");

    // Lifted through A's API: A admits at once, B within the bound.
    let lift = call(dir.path(), "DELETE", "/v1/bans?policy=login&key=u1");
    assert_eq!(lift.status, 200, "{:?}", lift.body);
    let lifted = Instant::now();
    assert_eq!(ca.check_policy(&login("login", "u1")).await.unwrap().decision, Decision::Allowed, "A, at once");
    loop {
        let r = cb.check_policy(&login("login", "u1")).await.unwrap();
        if r.decision == Decision::Allowed {
            break;
        }
        assert!(lifted.elapsed() < LIFT_BOUND, "B still refuses {:?} after the lift: {r:?}", lifted.elapsed());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("{what}: lift applied by the other daemon after {:?} (bound {LIFT_BOUND:?})", lifted.elapsed());
    assert!(a.log().contains("op=\"ban_lift\""), "the lift is an audited write: {}", a.log());
    assert_eq!(call(dir.path(), "GET", "/v1/bans").body["bans"], json!([]));
    assert_eq!(call(dir.path(), "DELETE", "/v1/bans?policy=login&key=u1").status, 404, "lifted already");
}

fn single_calls(redis: &RedisServer) -> Calls {
    let url = redis.url();
    Box::new(move || {
        let mut conn = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
        let info: String = redis::cmd("INFO").arg("commandstats").query(&mut conn).unwrap();
        evalsha_in(&info)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_redis_a_ban_engages_after_n_refusals_and_another_daemon_honours_it_from_its_cache() {
    let redis = RedisServer::start_unix();
    let calls = single_calls(&redis);
    a_ban_engages_after_n_refusals_on_one_daemon_and_is_honoured_by_another("one redis", &format!("[redis]\nurl = \"{}\"", redis.url()), calls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_ban_engages_after_n_refusals_and_another_daemon_honours_it_from_its_cache() {
    let cluster = std::sync::Arc::new(RedisCluster::start());
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("\"{s}\"")).collect();
    let c = cluster.clone();
    let calls: Calls = Box::new(move || c.primaries().iter().map(|&p| evalsha_in(&c.cli(p, &["INFO", "commandstats"]))).sum());
    a_ban_engages_after_n_refusals_on_one_daemon_and_is_honoured_by_another("cluster", &format!("[redis]\ncluster = [{}]", seeds.join(", ")), calls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_policys_ban_is_recorded_and_counted_but_never_refuses() {
    let redis = RedisServer::start_unix();
    let d = daemon(&format!("[redis]\nurl = \"{}\"", redis.url()), None, true);
    let mut c = d.client().await;
    let mut got = Vec::new();
    for _ in 0..8 {
        let r = c.check_policy(&login("login_shadow", "s1")).await.unwrap();
        got.push(r.decision);
        assert_ne!(r.decision, Decision::Denied, "a shadow policy refused: {r:?}");
    }
    use Decision::{ShadowAllowed as A, ShadowDenied as D};
    assert_eq!(got, [A, A, D, D, D, D, D, D], "the 3rd refusal bans; the ban shows as shadow refusals only");
    // Recorded in Redis: the key's ban, for the shadow policy's 3 s.
    let mut conn = redis.conn();
    let bans: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*:penalty:ban").query(&mut conn).unwrap();
    assert_eq!(bans.len(), 1, "{bans:?}");
    let pttl: i64 = redis::cmd("PTTL").arg(&bans[0]).query(&mut conn).unwrap();
    assert!(pttl > 2000 && pttl <= 3000, "{pttl}");
    // Counted.
    let metrics = common::http::get(&common::http::agent(), &d.metrics_url(), &[]).body;
    assert!(metrics.contains("ratelimitd_penalty_bans_total{policy=\"login_shadow\"} 1"), "{metrics}");
    assert!(metrics.contains("ratelimitd_policy_requests_total{policy=\"login_shadow\",outcome=\"shadow_refused\"} 6"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_backend_bans_too_and_its_ban_is_lifted_through_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon("", Some(dir.path()), false);
    let mut c = d.client().await;
    for _ in 0..2 {
        assert_eq!(c.check_policy(&login("login", "m1")).await.unwrap().decision, Decision::Allowed);
    }
    for n in 1..=3 {
        let r = c.check_policy(&login("login", "m1")).await.unwrap();
        assert_eq!((r.decision, r.source), (Decision::Denied, Source::Memory), "{r:?}");
        if n == 3 {
            assert_eq!((r.retry_after_ms, r.remaining), (3000, 0), "the ban's end: {r:?}");
        }
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = c.check_policy(&login("login", "m1")).await.unwrap();
    assert_eq!(r.decision, Decision::Denied, "banned beyond the window: {r:?}");
    assert!(r.retry_after_ms > 1000 && r.retry_after_ms < 2000, "{r:?}");
    let list = call(dir.path(), "GET", "/v1/bans?policy=login");
    assert_eq!(list.body["bans"][0]["key"], json!("m1"), "{:?}", list.body);
    assert_eq!(call(dir.path(), "DELETE", "/v1/bans?policy=login&key=m1").status, 200);
    assert_eq!(c.check_policy(&login("login", "m1")).await.unwrap().decision, Decision::Allowed, "lifted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_penalty_policy_in_a_multi_item_check_is_refused_loudly_and_bad_ban_requests_change_nothing() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(&format!("[redis]\nurl = \"{}\"", redis.url()), Some(dir.path()), false);
    let mut c = d.client().await;
    let items = [ItemArgs { policy: b"login", key: b"k", cost: 1 }, ItemArgs { policy: b"plain", key: b"k", cost: 1 }];
    let r = c.check_multi(FailPolicy::Closed, 0, false, &items).await.unwrap();
    assert_eq!((r.decision, r.error), (Decision::Error, ErrorCode::UnsupportedCombination), "{r:?}");
    assert!(r.message.contains("penalty box"), "{}", r.message);
    let r = c.check_multi(FailPolicy::Closed, 0, true, &items[..1]).await.unwrap();
    assert_eq!(r.error, ErrorCode::UnsupportedCombination, "refundable: {r:?}");

    for (method, path, status, says) in [
        ("DELETE", "/v1/bans?policy=plain&key=k", 400, "has no penalty box"),
        ("DELETE", "/v1/bans?policy=nope&key=k", 404, "no [[policy]] named"),
        ("DELETE", "/v1/bans?policy=login", 400, "missing parameter 'key'"),
        ("GET", "/v1/bans?key=k", 400, "a key needs its 'policy'"),
        ("DELETE", "/v1/bans?policy=login&key=never", 404, "is not banned"),
    ] {
        let r = call(dir.path(), method, path);
        assert_eq!(r.status, status, "{method} {path}: {:?}", r.body);
        assert!(r.body["error"].as_str().unwrap_or("").contains(says), "{method} {path}: {:?}", r.body);
    }
    let huge = format!("/v1/bans?policy=login&key={}", "x".repeat(5000));
    assert_eq!(call(dir.path(), "DELETE", &huge).status, 400, "a huge key");
    let mut conn = redis.conn();
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("*penalty*").query(&mut conn).unwrap();
    assert!(keys.is_empty(), "bad requests wrote {keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_lists_shows_and_lifts_bans_through_the_api() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(&format!("[redis]\nurl = \"{}\"", redis.url()), Some(dir.path()), false);
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd")).arg(args[0]).arg("--config").arg(&d.config).args(&args[1..]).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    let (ok, out) = run(&["ban", "list"]);
    assert!(ok && out.contains("no key is banned"), "{out}");
    let mut c = d.client().await;
    for _ in 0..4 {
        c.check_policy(&login("login", "cli user")).await.unwrap();
    }
    let (ok, out) = run(&["ban", "show", "--policy", "login", "--key", "cli user"]);
    assert!(ok && out.contains("not banned; 2 of 3 refusals within 10000 ms"), "{out}");
    assert_eq!(c.check_policy(&login("login", "cli user")).await.unwrap().retry_after_ms, 3000, "the third refusal bans");
    // The ban's index is written off the request path: give it a moment.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (ok, out) = run(&["ban", "list"]);
    assert!(ok && out.contains("login cli user banned until "), "{out}");
    let (ok, out) = run(&["ban", "lift", "--policy", "login", "--key", "cli user"]);
    assert!(ok && out.contains("ban lifted"), "{out}");
    let (ok, out) = run(&["ban", "lift", "--policy", "login", "--key", "cli user"]);
    assert!(!ok && out.contains("404") && out.contains("is not banned"), "{out}");
    // The window (1 s) still holds its 2 admissions: refused by it, not by a ban.
    let r = c.check_policy(&login("login", "cli user")).await.unwrap();
    assert_eq!(r.source, Source::Redis, "{r:?}");
    assert!(r.retry_after_ms <= 1000, "the window's refusal, not the ban's: {r:?}");
}

/// Through nginx and the shipped Lua client: a 429 from the window says
/// Retry-After within the window (1 s); the refusal that bans and every one
/// after say the ban's end (30 s), also on a second nginx with a daemon of
/// its own sharing the Redis.
#[test]
fn through_nginx_the_retry_after_of_a_banned_key_is_the_bans_end() {
    const SNIPPET: &str = include_str!("../nginx/ratelimitd.conf");
    let redis = RedisServer::start_unix();
    let server = common::ops::socket_access();
    let policy = "[[policy]]\nname = \"login\"\nlimit = 2\nwindow = \"1s\"\npenalty = { after = 2, within = \"1m\", ban = \"30s\" }\n";
    let daemon = || Daemon::start_config(&format!("{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{policy}", redis.url()));
    let site = r#"
init_worker_by_lua_block {
    login = assert(require("resty.ratelimitd").new{ policy = "login" })
}
server {
    listen 127.0.0.1:{PORT};
    location /login {
        access_by_lua_block { login:limit(ngx.var.arg_user) }
        content_by_lua_block { ngx.say("ok") }
    }
}
"#;
    let gateway = |d: &Daemon| {
        let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1).replacen("read_timeout = 50,", "read_timeout = 1000,", 1);
        Nginx::start(&format!("{snippet}\n{site}"))
    };
    let (d1, d2) = (daemon(), daemon());
    let (n1, n2) = (gateway(&d1), gateway(&d2));
    let a = common::http::agent();
    let retry = |r: &common::http::Reply| r.headers.get("Retry-After").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let statuses: Vec<u16> = (0..2).map(|_| common::http::get(&a, &n1.url("/login?user=eve"), &[]).status).collect();
    assert_eq!(statuses, [200, 200]);
    let first = common::http::get(&a, &n1.url("/login?user=eve"), &[]);
    assert_eq!((first.status, retry(&first)), (429, Some(1)), "the window's refusal: {:?}", first.headers);
    let banning = common::http::get(&a, &n1.url("/login?user=eve"), &[]);
    assert_eq!((banning.status, retry(&banning)), (429, Some(30)), "the refusal that bans: {:?}", banning.headers);
    std::thread::sleep(Duration::from_millis(1100));
    // The window is empty again; the ban is not, on the other gateway too.
    for n in [&n1, &n2] {
        let r = common::http::get(&a, &n.url("/login?user=eve"), &[]);
        assert_eq!(r.status, 429, "{:?}", r.headers);
        let s = retry(&r).unwrap();
        assert!((27..=29).contains(&s), "Retry-After {s}: the ban's end");
    }
    assert_eq!(common::http::get(&a, &n2.url("/login?user=bob"), &[]).status, 200, "another user");
    for n in [&n1, &n2] {
        let log = n.error_log();
        assert!(!log.contains("[error]") && !log.contains("[crit]"), "{log}");
    }
}
