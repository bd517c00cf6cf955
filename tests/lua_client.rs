//! Defects of the Lua client found by issue 22, each through real nginx
//! (the shipped `nginx/ratelimitd.conf`, socket and read timeout changed),
//! a real `ratelimitd` and a real `redis-server`:
//! - a concurrency lease outlived its request after an internal redirect
//!   (`error_page`, `try_files`, `ngx.exec`), with or without a client abort;
//! - a shadow policy showed in the RateLimit headers;
//! - a GCRA named policy was never paced;
//! - an empty key from client input raised a Lua error (HTTP 500 and a
//!   stack trace per request).

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::http::{agent, get};
use common::{wait_until, Daemon, Nginx, RedisServer};

const SNIPPET: &str = include_str!("../nginx/ratelimitd.conf");

/// A daemon on `redis` with `policies` (TOML `[[policy]]` tables), on a
/// socket nginx's unprivileged workers can reach.
fn daemon(redis: &RedisServer, policies: &str) -> Daemon {
    let server = common::ops::socket_access();
    Daemon::start_config(&format!("{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{policies}", redis.url()))
}

/// nginx with the shipped snippet pointed at `d`, then `body` (inside http {}).
fn nginx(d: &Daemon, body: &str) -> Nginx {
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1);
    let snippet = snippet.replacen("read_timeout = 50,", "read_timeout = 1000,", 1);
    Nginx::start(&format!("{snippet}\n{body}"))
}

fn error_lines(nginx: &Nginx) -> Vec<String> {
    nginx.error_log().lines().filter(|l| l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]")).map(str::to_string).collect()
}

fn zcard(redis: &RedisServer, key: &str) -> u64 {
    redis::cmd("ZCARD").arg(format!("ratelimitd:{{{key}}}:concurrency")).query(&mut redis.conn()).unwrap()
}

/// Every redirect kind nginx has, with `enter()` before it and `leave()` at
/// server level (so in every location the request can end in). Limits of
/// 1: a request that took a second slot, or whose slot was not released,
/// gets 429.
const REDIRECTS: &str = r#"
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    conns = {}
    for _, name in ipairs({ "ep", "tf", "ex", "ab" }) do
        conns[name] = assert(ratelimitd.concurrency{ limit = 1, lease_ms = 30000 })
    end
}
server {
    listen 127.0.0.1:{PORT:up};
    location / { content_by_lua_block { ngx.sleep(5) ngx.say("late") } }
}
server {
    listen 127.0.0.1:{PORT:front};
    root /nonexistent;
    # The usual front controller: the slot is taken at server level, so in
    # the first location and again after try_files' internal redirect.
    access_by_lua_block { conns.tf:enter("tf") }
    log_by_lua_block { require("resty.ratelimitd").leave() }
    location / { try_files $uri /index.php; }
    location = /index.php { content_by_lua_block { ngx.say("front controller") } }
}
server {
    listen 127.0.0.1:{PORT};
    root /nonexistent;
    log_not_found off;
    log_by_lua_block { require("resty.ratelimitd").leave() }
    # error_page: the static file is missing (404), served by @fallback.
    location /ep {
        access_by_lua_block { conns.ep:enter("ep") }
        error_page 404 = @fallback;
    }
    location @fallback { content_by_lua_block { ngx.say("fallback") } }
    # ngx.exec: an internal redirect from Lua.
    location /ex {
        access_by_lua_block { conns.ex:enter("ex") }
        content_by_lua_block { return ngx.exec("/target") }
    }
    location /target { content_by_lua_block { ngx.say("target") } }
    # A client abort after an error_page redirect to a slow upstream.
    location /ab {
        access_by_lua_block { conns.ab:enter("ab") }
        error_page 404 = @slow;
    }
    location @slow { proxy_pass http://127.0.0.1:{PORT:up}; }
}
"#;

/// Four requests one after the other through `url` (redirected inside
/// nginx): each finds the slot free, holds one, and its lease is gone
/// after it (the release runs in a timer after the log phase: it may land
/// just after the response).
fn each_request_holds_one_slot_and_releases_it(what: &str, url: impl Fn(&Nginx) -> String, key: &str, body: &str) {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis, "");
    let n = nginx(&d, REDIRECTS);
    let a = agent();
    for i in 0..4 {
        let r = get(&a, &url(&n), &[]);
        assert_eq!((r.status, r.body.as_str()), (200, body), "{what}: request {i} holds one slot and finds it free\n{}", n.error_log());
        wait_until(&format!("{what}: request {i}'s lease released"), Duration::from_secs(3), || zcard(&redis, key) == 0);
    }
    assert!(error_lines(&n).is_empty(), "{:?}", error_lines(&n));
}

#[test]
fn a_lease_is_released_after_an_error_page_redirect() {
    each_request_holds_one_slot_and_releases_it("error_page", |n| n.url("/ep"), "ep", "fallback\n");
}

#[test]
fn a_lease_taken_at_server_level_is_taken_once_and_released_after_try_files() {
    each_request_holds_one_slot_and_releases_it("try_files", |n| format!("http://127.0.0.1:{}/app/page", n.named_port("front")), "tf", "front controller\n");
}

#[test]
fn a_lease_is_released_after_ngx_exec() {
    each_request_holds_one_slot_and_releases_it("ngx.exec", |n| n.url("/ex"), "ex", "target\n");
}

#[test]
fn a_client_abort_after_a_redirect_releases_its_lease() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis, "");
    let n = nginx(&d, REDIRECTS);
    let a = agent();
    let mut slow = std::net::TcpStream::connect(("127.0.0.1", n.port)).unwrap();
    slow.write_all(b"GET /ab HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
    wait_until("the slow request holds its lease", Duration::from_secs(5), || zcard(&redis, "ab") == 1);
    assert_eq!(get(&a, &n.url("/ab"), &[]).status, 429, "one in flight: the slot is taken");
    slow.shutdown(std::net::Shutdown::Both).unwrap();
    drop(slow);
    let aborted = Instant::now();
    wait_until("the aborted request's lease released", Duration::from_secs(3), || zcard(&redis, "ab") == 0);
    assert!(aborted.elapsed() < Duration::from_secs(3), "released by the abort, not by the upstream (5 s) or the lease (30 s)");
    assert!(error_lines(&n).iter().all(|l| !l.contains("ratelimitd")), "{:?}", error_lines(&n));
}

/// Policies of the shadow test: two enforced, one in shadow that refuses
/// from the second request on.
fn shadow_policies() -> String {
    common::rate_policies(&[("per_ip", 10, "60s"), ("per_tenant", 5, "60s")]) + &common::rate_policy("next", 1, "60s", &["shadow = true"])
}

/// Not told which policy is in shadow mode: its decisions (the wire marks
/// them, shadow_allowed or shadow_denied) must still not show.
const UNDECLARED_SHADOW: &str = r#"
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    shadow_lims = { plain = assert(ratelimitd.new{ policies = { "per_ip", "next", "per_tenant" }, header_style = "draft" }) }
}
"#;

/// Told (`shadow = { ... }`): the policy never shows, even when it had room.
const DECLARED_SHADOW: &str = r#"
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    shadow_lims = {
        draft = assert(ratelimitd.new{ policies = { "per_ip", "next", "per_tenant" }, header_style = "draft", shadow = { "next" } }),
        legacy = assert(ratelimitd.new{ policies = { "per_ip", "next", "per_tenant" }, header_style = "ratelimit", shadow = { "next" } }),
        one = assert(ratelimitd.new{ policy = "next", header_style = "draft", shadow = { "next" } }),
    }
}
"#;

const SHADOW_SITE: &str = r#"
server {
    listen 127.0.0.1:{PORT};
    location ~ ^/(\w+)$ {
        access_by_lua_block {
            local name = ngx.var[1]
            local lim = shadow_lims[name]
            if name == "one" then
                return lim:limit(ngx.var.arg_k)
            end
            lim:limit({ "ip-" .. name .. ngx.var.arg_k, "shadow-" .. name .. ngx.var.arg_k, "tenant-" .. name .. ngx.var.arg_k })
        }
        content_by_lua_block { ngx.say("ok") }
    }
}
"#;

const ENFORCED_POLICY: &str = r#""per_ip";q=10;w=60, "per_tenant";q=5;w=60"#;

/// nginx with `limiters` and the shadow site, its daemon with the shadow
/// policies, their Redis (stopped in that order).
fn shadow_setup(limiters: &str) -> (Nginx, Daemon, RedisServer) {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis, &shadow_policies());
    (nginx(&d, &format!("{limiters}{SHADOW_SITE}")), d, redis)
}

#[test]
fn a_shadow_refusal_never_shows_in_the_draft_fields() {
    let (n, _d, _redis) = shadow_setup(UNDECLARED_SHADOW);
    let a = agent();
    // The shadow policy refuses from request 2 on: it is not listed.
    assert_eq!(get(&a, &n.url("/plain?k=1"), &[]).status, 200, "{}", n.error_log());
    for i in 2..=3 {
        let r = get(&a, &n.url("/plain?k=1"), &[]);
        assert_eq!(r.status, 200, "{}", n.error_log());
        assert_eq!(r.header("RateLimit-Policy"), ENFORCED_POLICY, "request {i}");
        assert_eq!(r.header("RateLimit"), format!(r#""per_ip";r={};t=60, "per_tenant";r={};t=60"#, 10 - i, 5 - i), "request {i}");
    }
    assert!(error_lines(&n).is_empty(), "{:?}", error_lines(&n));
}

#[test]
fn a_declared_shadow_policy_never_shows_in_any_header_style() {
    let (n, _d, _redis) = shadow_setup(DECLARED_SHADOW);
    let a = agent();
    let enforced_policy = ENFORCED_POLICY;
    // Declared: not even the first response (the shadow policy had room)
    // lists it; the option is redundant with a daemon that marks
    // shadow_allowed, and still hides it from an older one.
    for i in 1..=3 {
        let r = get(&a, &n.url("/draft?k=1"), &[]);
        assert_eq!(r.status, 200, "{}", n.error_log());
        assert_eq!(r.header("RateLimit-Policy"), enforced_policy, "request {i}");
        assert_eq!(r.header("RateLimit"), format!(r#""per_ip";r={};t=60, "per_tenant";r={};t=60"#, 10 - i, 5 - i), "request {i}");
    }
    // The legacy fields show the most constrained enforced policy
    // (per_tenant), never the shadow one (limit 1, remaining 0).
    for i in 1..=3 {
        let r = get(&a, &n.url("/legacy?k=1"), &[]);
        assert_eq!((r.status, r.header("RateLimit-Limit"), r.header("RateLimit-Remaining")), (200, "5", (5 - i).to_string().as_str()), "request {i}");
    }
    // A one-policy limiter of a shadow policy: no quota fields at all.
    for i in 1..=3 {
        let r = get(&a, &n.url("/one?k=1"), &[]);
        assert_eq!((r.status, r.header("RateLimit-Policy"), r.header("RateLimit")), (200, "", ""), "request {i}");
    }
    // The enforced policies still refuse: per_tenant after 5.
    let statuses: Vec<u16> = (0..6).map(|_| get(&a, &n.url("/draft?k=2"), &[]).status).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);
    assert!(error_lines(&n).is_empty(), "{:?}", error_lines(&n));
}

/// Not told which policy is in shadow mode, in every header style, and a
/// one-policy limiter of the shadow policy.
const UNDECLARED_SHADOW_EVERY_STYLE: &str = r#"
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    local policies = { "per_ip", "next", "per_tenant" }
    shadow_lims = {
        legacy = assert(ratelimitd.new{ policies = policies, header_style = "ratelimit" }),
        x = assert(ratelimitd.new{ policies = policies, header_style = "x" }),
        draft = assert(ratelimitd.new{ policies = policies, header_style = "draft" }),
        one = assert(ratelimitd.new{ policy = "next", header_style = "ratelimit" }),
    }
}
"#;

/// Issue 22, defect 3: an undeclared shadow policy (next, limit 1) with
/// room on the first request is marked shadow_allowed by the daemon, so the
/// legacy fields show the enforced per_tenant (limit 5, remaining 4), not
/// the shadow policy as the most constrained (limit 1, remaining 0).
#[test]
fn an_undeclared_shadow_policy_with_room_never_shows_in_any_header_style() {
    let (n, _d, _redis) = shadow_setup(UNDECLARED_SHADOW_EVERY_STYLE);
    let a = agent();
    for i in 1..=3 {
        let r = get(&a, &n.url("/legacy?k=1"), &[]);
        let remaining = (5 - i).to_string();
        assert_eq!((r.status, r.header("RateLimit-Limit"), r.header("RateLimit-Remaining")), (200, "5", remaining.as_str()), "legacy, request {i}");
        let r = get(&a, &n.url("/x?k=1"), &[]);
        assert_eq!((r.status, r.header("X-RateLimit-Limit"), r.header("X-RateLimit-Remaining")), (200, "5", remaining.as_str()), "x, request {i}");
        let r = get(&a, &n.url("/draft?k=1"), &[]);
        assert_eq!((r.status, r.header("RateLimit-Policy")), (200, ENFORCED_POLICY), "draft, request {i}");
        assert_eq!(r.header("RateLimit"), format!(r#""per_ip";r={};t=60, "per_tenant";r={};t=60"#, 10 - i, 5 - i), "draft, request {i}");
        // A one-policy limiter of the shadow policy: no quota fields, with
        // room (request 1) or without.
        let r = get(&a, &n.url("/one?k=1"), &[]);
        assert_eq!((r.status, r.header("RateLimit-Limit"), r.header("RateLimit-Remaining")), (200, "", ""), "one, request {i}");
    }
    assert!(error_lines(&n).is_empty(), "{:?}", error_lines(&n));
}

/// A GCRA named policy (5 per second, one token every 200 ms) is paced as
/// an inline GCRA limiter is: 5 requests at once reach the upstream about
/// 200 ms apart; with `nodelay` at once.
#[test]
fn a_gcra_named_policy_is_paced() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis, "[[policy]]\nname = \"paced\"\nalgorithm = \"gcra\"\nlimit = 5\nwindow = \"1s\"\n");
    let n = nginx(
        &d,
        r#"
lua_shared_dict arrivals 1m;
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    paced = assert(ratelimitd.new("paced"))
    at_once = assert(ratelimitd.new{ policy = "paced", nodelay = true })
}
server {
    listen 127.0.0.1:{PORT:up};
    location / {
        content_by_lua_block {
            ngx.update_time()
            ngx.shared.arrivals:rpush(ngx.var.uri, ngx.now())
            ngx.say("ok")
        }
    }
}
server {
    listen 127.0.0.1:{PORT};
    location /paced { access_by_lua_block { paced:limit("k1") } proxy_pass http://127.0.0.1:{PORT:up}; }
    location /nodelay { access_by_lua_block { at_once:limit("k2") } proxy_pass http://127.0.0.1:{PORT:up}; }
    location /arrivals {
        content_by_lua_block {
            local out = {}
            while true do
                local t = ngx.shared.arrivals:lpop(ngx.var.arg_path)
                if not t then break end
                out[#out + 1] = string.format("%.3f", t)
            end
            ngx.say(table.concat(out, " "))
        }
    }
}
"#,
    );
    let burst = |path: &str| -> Vec<u16> {
        let threads: Vec<_> = (0..5)
            .map(|_| {
                let url = n.url(path);
                std::thread::spawn(move || agent().get(&url).call().unwrap().status().as_u16())
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    };
    let arrivals = |path: &str| -> Vec<f64> {
        let mut v: Vec<f64> = get(&agent(), &n.url(&format!("/arrivals?path={path}")), &[]).body.split_whitespace().map(|t| t.parse().unwrap()).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    assert_eq!(burst("/paced"), [200; 5], "{}", n.error_log());
    let paced = arrivals("/paced");
    assert_eq!(paced.len(), 5);
    // Arrival i at least i * 200 ms after the first (60 ms of slack for the
    // first one's own trip), and not slower than the rate by much.
    for (i, t) in paced.iter().enumerate() {
        let after_ms = (t - paced[0]) * 1000.0;
        assert!(after_ms >= 200.0 * i as f64 - 60.0, "arrival {i} only {after_ms:.0} ms after the first: {paced:?}");
    }
    assert!((paced[4] - paced[0]) * 1000.0 < 3000.0, "{paced:?}");

    assert_eq!(burst("/nodelay"), [200; 5]);
    let at_once = arrivals("/nodelay");
    assert!((at_once[4] - at_once[0]) * 1000.0 < 500.0, "nodelay: the burst at once, not over 800 ms: {at_once:?}");
    assert!(error_lines(&n).is_empty(), "{:?}", error_lines(&n));
}

/// The shipped tenant-api example with an empty or missing X-Tenant-Id:
/// limited (one shared bucket for "no tenant"), never a Lua error.
#[test]
fn an_empty_tenant_header_is_limited_not_a_lua_error() {
    let redis = RedisServer::start_unix();
    let toml = include_str!("../examples/tenant-api/ratelimitd.toml");
    let d = daemon(&redis, &toml[toml.find("[[policy]]").unwrap()..]);
    let site = include_str!("../examples/tenant-api/nginx.conf").replacen("listen 8080;", "listen 127.0.0.1:{PORT};", 1);
    let n = nginx(&d, &site);
    let a = agent();
    for i in 0..3 {
        let r = get(&a, &n.url("/api/orders"), &[("X-Tenant-Id", "")]);
        assert_eq!(r.status, 200, "request {i}: {}", n.error_log());
        assert!(r.header("RateLimit").contains(&format!(r#""per_tenant";r={};"#, 99 - i)), "limited: {}", r.header("RateLimit"));
    }
    let log = n.error_log();
    assert!(!log.contains("stack traceback") && error_lines(&n).is_empty(), "{log}");
}
