//! The worked example of docs/POLICIES.md (examples/tenant-api/) through
//! real nginx, ratelimitd and redis-server: four policies on one request,
//! all or nothing; a premium override; a shadow policy; failed logins
//! counted by refunding the others from log_by_lua; the draft's RateLimit
//! fields, Retry-After and the problem+json body; $ratelimitd_status in the
//! access log.

mod common;

use std::time::Duration;

use common::http::{agent, get, Reply};
use common::{wait_until, Daemon, Nginx, RedisServer};

const SNIPPET: &str = include_str!("../nginx/ratelimitd.conf");
const EXAMPLE_TOML: &str = include_str!("../examples/tenant-api/ratelimitd.toml");
const EXAMPLE_NGINX: &str = include_str!("../examples/tenant-api/nginx.conf");

fn zcard(redis: &RedisServer, policy: &str, key: &str, window_ms: u32) -> u64 {
    let k = format!("ratelimitd:{{{}{policy}{key}}}:{window_ms}ms", policy.len() as u8 as char);
    redis::Commands::zcard(&mut redis.conn(), k.as_bytes()).unwrap()
}

fn sample(text: &str, policy: &str, outcome: &str) -> u64 {
    let start = format!("ratelimitd_policy_requests_total{{policy=\"{policy}\",outcome=\"{outcome}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&start)).unwrap_or_else(|| panic!("no {start} in\n{text}")).parse().unwrap()
}

#[test]
fn tenant_api_example_through_nginx() {
    let redis = RedisServer::start_unix();
    // The example's policies verbatim; its [server] and [redis] point at this test's.
    let policies = &EXAMPLE_TOML[EXAMPLE_TOML.find("[[policy]]").unwrap()..];
    let server = common::ops::socket_access();
    let mut d = Daemon::start_config_with_metrics(&format!("{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{policies}", redis.url()));
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1).replacen("read_timeout = 50,", "read_timeout = 1000,", 1);
    let site = EXAMPLE_NGINX.replacen("listen 8080;", "listen 127.0.0.1:{PORT};", 1);
    let nginx = Nginx::start(&format!("{snippet}\n{site}"));
    let a = agent();
    let t1 = [("X-Tenant-Id", "t1")];

    // 100 requests of tenant t1 pass; the shadow policy would have refused
    // the last 50 and refuses nothing.
    let first = get(&a, &nginx.url("/api/orders"), &t1);
    assert_eq!(first.status, 200);
    // The draft's fields, one list member per enforced policy, w in whole
    // seconds; the shadow policy never shows (SEMANTICS S3).
    let enforced = r#""per_ip";q=300;w=60, "per_tenant";q=100;w=60, "global";q=10000;w=60"#;
    assert_eq!(first.header("RateLimit-Policy"), enforced);
    assert_eq!(first.header("RateLimit"), r#""per_ip";r=299;t=60, "per_tenant";r=99;t=60, "global";r=9999;t=60"#);
    for i in 1..100 {
        let r = get(&a, &nginx.url("/api/orders"), &t1);
        assert_eq!((r.status, r.header("RateLimit-Policy")), (200, enforced), "request {}: the shadow policy refuses from 51 on", i + 1);
    }
    // The 101st: per_tenant (the second policy) refuses; nothing is charged
    // to per_ip, global or the shadow policy.
    let refused = get(&a, &nginx.url("/api/orders"), &t1);
    assert_eq!(refused.status, 429);
    assert_eq!(zcard(&redis, "per_tenant", "t1", 60_000), 100);
    assert_eq!(zcard(&redis, "per_ip", "127.0.0.1", 60_000), 100, "the refused request charged per_ip nothing");
    assert_eq!(zcard(&redis, "global", "all", 60_000), 100, "the refused request charged global nothing");
    assert_eq!(zcard(&redis, "per_tenant_next", "t1", 60_000), 50, "the shadow window holds what it would have admitted");
    // t of the refusing policy is its retry-after, and Retry-After says the same.
    let retry: u64 = refused.header("Retry-After").parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let state = refused.header("RateLimit");
    assert!(state.contains(&format!(r#""per_tenant";r=0;t={retry}"#)), "{state}");
    assert!(state.starts_with(r#""per_ip";r=200;"#), "the others' remaining: {state}");
    assert_eq!(refused.header("Content-Type"), "application/problem+json");
    assert!(refused.body.contains(r#""type":"https://iana.org/assignments/http-problem-types#quota-exceeded""#), "{}", refused.body);
    assert!(refused.body.contains(r#""violated-policies":["per_tenant"]"#), "{}", refused.body);

    // The premium tenant's override: 150 pass.
    for i in 0..150 {
        assert_eq!(get(&a, &nginx.url("/api/orders"), &[("X-Tenant-Id", "tenant-premium")]).status, 200, "premium request {i}");
    }
    assert_eq!(zcard(&redis, "per_tenant", "tenant-premium", 60_000), 150);

    // Failed logins only: successful ones are refunded from log_by_lua.
    let login = |password: &str| get(&a, &nginx.url("/login"), &[("X-User", "alice"), ("X-Password", password)]).status;
    for _ in 0..3 {
        assert_eq!(login("right"), 200);
        wait_until("the successful login refunded", Duration::from_secs(5), || zcard(&redis, "login_failures", "alice", 300_000) == 0);
    }
    for _ in 0..5 {
        assert_eq!(login("wrong"), 401);
    }
    assert_eq!(login("wrong"), 429, "the sixth failure is refused");
    assert_eq!(login("right"), 429, "so is the right password, until failures leave the window");
    assert_eq!(zcard(&redis, "login_failures", "alice", 300_000), 5);

    // Which policy fired, in metrics; what happened, in the access log.
    let text = agent().get(&d.metrics_url()).call().unwrap().body_mut().read_to_string().unwrap();
    assert_eq!(sample(&text, "per_tenant", "refused"), 1);
    assert_eq!(sample(&text, "per_ip", "refused"), 0);
    // t1's requests 51 to 101 and the premium tenant's 51 to 150 (the
    // override is per_tenant's, not the shadow policy's).
    assert_eq!(sample(&text, "per_tenant_next", "shadow_refused"), 51 + 100);
    assert_eq!(sample(&text, "login_failures", "refused") + sample(&text, "login_failures", "refused_from_cache"), 2);
    let plain = |name: &str| text.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap_or_else(|| panic!("no {name}")).to_string();
    assert_eq!((plain("ratelimitd_refunds_total"), plain("ratelimitd_refunded_units_total")), ("3".to_string(), "3".to_string()));
    let log_path = nginx.prefix.path().join("logs/tenant_api.access.log");
    wait_until("the access log written", Duration::from_secs(5), || std::fs::read_to_string(&log_path).is_ok_and(|l| l.lines().count() >= 261));
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains("\"GET /api/orders HTTP/1.1\" 429 tenant=t1 ratelimit=REJECTED"), "{log}");
    assert!(log.contains("\"GET /api/orders HTTP/1.1\" 200 tenant=t1 ratelimit=PASSED\n"), "{log}");
    assert!(log.contains("\"GET /api/orders HTTP/1.1\" 200 tenant=t1 ratelimit=PASSED_SHADOW"), "the shadow policy's refusals, reported: {log}");
    let elog = nginx.error_log();
    let errors: Vec<&str> = elog.lines().filter(|l| l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]")).collect();
    assert!(errors.is_empty(), "nginx errors: {errors:?}");

    // The daemon gone: on_error = "closed" refuses the whole request with
    // fail_closed_status, without quota fields or a problem body.
    d.terminate();
    let down = get(&a, &nginx.url("/api/orders"), &[("X-Tenant-Id", "t3")]);
    assert_eq!((down.status, down.header("Retry-After"), down.header("RateLimit")), (503, "1", ""));
    assert!(!down.body.contains("quota-exceeded"));
    // The line names the limiter's policies (issue 27), then the keys.
    wait_until("the fail-closed logged", Duration::from_secs(5), || nginx.error_log().lines().any(|l| l.contains("ratelimitd: fail_closed policy=") && l.contains(" key=127.0.0.1,t3,all,t3 ")));
}

/// The daemon unreachable: a multi-policy limiter with on_error = "local"
/// checks each key in the Lua fallback and gives back what it took when a
/// later one refuses.
#[test]
fn multi_policy_limiter_falls_back_locally_all_or_nothing() {
    let nowhere = tempfile::tempdir().unwrap();
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}/none.sock", nowhere.path().display()), 1);
    let site = r#"
init_worker_by_lua_block {
    both = assert(require("resty.ratelimitd").new{ policies = { "a", "b" }, on_error = "local", local_limit = 2, window_ms = 60000 })
}
server {
    listen 127.0.0.1:{PORT};
    location / {
        access_by_lua_block { both:limit({ ngx.var.http_x_a, ngx.var.http_x_b }) }
        content_by_lua_block { ngx.say("ok") }
    }
}
"#;
    let nginx = Nginx::start(&format!("{snippet}\n{site}"));
    let a = agent();
    let req = |ka: &str, kb: &str| get(&a, &nginx.url("/"), &[("X-A", ka), ("X-B", kb)]).status;
    assert_eq!([req("x", "y"), req("x", "y"), req("x", "y")], [200, 200, 429]);
    // b/y is full: a/z is given back each time, so it still has room for 2.
    assert_eq!([req("z", "y"), req("z", "y")], [429, 429]);
    assert_eq!([req("z", "w"), req("z", "w"), req("z", "w")], [200, 200, 429]);
    assert!(nginx.error_log().contains("ratelimitd: local_fallback"), "{}", nginx.error_log());
}

/// The draft's fields for one limiter: `w` only for a whole number of
/// seconds, and a refusal's `t` equal to `Retry-After`
/// (draft-ietf-httpapi-ratelimit-headers-12: the client should not retry
/// before `t`).
#[test]
fn draft_fields_leave_out_w_for_partial_seconds_and_match_retry_after() {
    let d = Daemon::start_config("socket_mode = \"0666\"\n[[policy]]\nname = \"burst\"\nlimit = 2\nwindow = \"1500ms\"\n");
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1).replacen("read_timeout = 50,", "read_timeout = 1000,", 1);
    let site = r#"
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    inline = assert(ratelimitd.new{ limit = 2, window_ms = 1500, header_style = "draft" })
    burst = assert(ratelimitd.new{ policies = { "burst" }, header_style = "draft" })
}
server {
    listen 127.0.0.1:{PORT};
    location /inline { access_by_lua_block { inline:limit("k") } content_by_lua_block { ngx.say("ok") } }
    location /burst { access_by_lua_block { burst:limit({ "k" }) } content_by_lua_block { ngx.say("ok") } }
}
"#;
    let nginx = Nginx::start(&format!("{snippet}\n{site}"));
    let a = agent();
    for (path, name) in [("/inline", "default"), ("/burst", "burst")] {
        let r: Vec<Reply> = (0..3).map(|_| get(&a, &nginx.url(path), &[])).collect();
        assert_eq!(r.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 200, 429], "{path}");
        assert_eq!(r[0].header("RateLimit-Policy"), format!("\"{name}\";q=2"), "{path}: no w for a 1.5 s window");
        assert_eq!(r[0].header("RateLimit"), format!("\"{name}\";r=1;t=2"), "{path}");
        let retry = r[2].header("Retry-After");
        assert_eq!(r[2].header("RateLimit"), format!("\"{name}\";r=0;t={retry}"), "{path}: t is Retry-After");
        assert!(r[2].header("RateLimit-Limit").is_empty(), "no legacy fields in the draft style");
    }
}
