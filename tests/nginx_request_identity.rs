//! One request, one decision, through real nginx, ratelimitd and
//! redis-server: an `access_by_lua` `limit()` at server level that runs again
//! after an internal redirect (`try_files`, `ngx.exec`, `error_page` to a
//! named location) reuses its first answer, and the refund and settle
//! handles of a request survive the redirect (`ratelimitd.decision()`), both
//! by the request's identity (the address of nginx's request object,
//! `$connection`, `$connection_requests`; docs/NGINX.md, "Internal
//! redirects"), and no request takes another's decision.

mod common;

use std::time::Duration;

use common::http::{agent, get};
use common::nginx_cases::recorded;
use common::{wait_until, Daemon, Nginx, RedisServer};

const SNIPPET: &str = include_str!("../nginx/ratelimitd.conf");
const REDIRECTS: [&str; 4] = ["none", "try_files", "exec", "error_page"];

const POLICIES: &str = "[[policy]]\nname = \"login\"\nlimit = 3\nwindow = \"60s\"\n\
    [[policy]]\nname = \"tok_min\"\nalgorithm = \"fixed\"\nlimit = 100\nwindow = \"60s\"\n\
    [[policy]]\nname = \"tok_day\"\nalgorithm = \"fixed\"\nlimit = 1000\nwindow = \"1d\"\n";

/// The locations of every redirect kind under `prefix`, each ending in `@ok`
/// or `/ok`; `access` (may be empty) is each location's own access phase.
fn redirect_locations(prefix: &str, access: &str) -> String {
    format!(
        "    location = /{prefix}/none {{ {access} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         \x20   location = /{prefix}/try_files {{ {access} try_files $uri /ok; }}\n\
         \x20   location = /{prefix}/exec {{ {access} content_by_lua_block {{ return ngx.exec(\"/ok\") }} }}\n\
         \x20   location = /{prefix}/error_page {{ {access} error_page 404 = @ok; }}\n"
    )
}

fn start(redis: &RedisServer, server_access: &str, locations: &str) -> (Daemon, Nginx) {
    start_with(redis, SNIPPET, server_access, locations)
}

/// The shipped snippet's line that indexes `$request_id`.
const MAP_LINE: &str = "map $request_id $ratelimitd_request_id { default $request_id; }\n";

/// `start` with another snippet than the shipped one.
fn start_with(redis: &RedisServer, snippet: &str, server_access: &str, locations: &str) -> (Daemon, Nginx) {
    let server = common::ops::socket_access();
    let d = Daemon::start_config(&format!("{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{POLICIES}", redis.url()));
    let snippet = snippet.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1).replacen("read_timeout = 50,", "read_timeout = 1000,", 1);
    let nginx = Nginx::start(&format!(
        r#"{snippet}
init_worker_by_lua_block {{
    local ratelimitd = require "resty.ratelimitd"
    per_key = assert(ratelimitd.new{{ limit = 10, window_ms = 60000 }})
    login = assert(ratelimitd.new{{ policy = "login", refundable = true }})
    tokens = assert(ratelimitd.new{{ policies = {{ "tok_min", "tok_day" }}, settle = true }})
    slots = assert(ratelimitd.concurrency{{ limit = 4, lease_ms = 30000 }})
}}
server {{
    listen 127.0.0.1:{{PORT}};
    root /nonexistent;
    log_not_found off;
    {server_access}
    location @ok {{ content_by_lua_block {{ ngx.say("ok") }} }}
    location = /ok {{ content_by_lua_block {{ ngx.say("ok") }} }}
{locations}}}
"#
    ));
    (d, nginx)
}

fn errors(nginx: &Nginx) -> Vec<String> {
    nginx.error_log().lines().filter(|l| l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]")).map(str::to_string).collect()
}

#[test]
fn a_server_level_limit_counts_a_request_once_whatever_internal_redirect_it_takes() {
    counts_once(SNIPPET);
}

/// The same without the snippet's `map $request_id` line: the request's
/// identity is what nginx keeps for it (request.lua). Before, each redirect
/// was counted again (`RateLimit-Remaining` 8, then 6).
#[test]
fn without_the_map_line_a_server_level_limit_counts_a_request_once() {
    counts_once(&SNIPPET.replacen(MAP_LINE, "", 1));
}

/// Sends `requests` requests to `/<path>/<kind>` for each redirect kind,
/// one agent (its requests follow each other on one pooled connection),
/// the key `<key>-<kind>`: the n-th passes with n counted (10 - n
/// remaining, n admissions recorded in Redis), and nginx logs no error.
fn each_counted_once(redis: &RedisServer, nginx: &Nginx, path: &str, key: &str, kinds: &[&str], requests: u64) {
    let agent = agent();
    let mut failures = Vec::new();
    for kind in kinds {
        let key = format!("{key}-{kind}");
        for n in 1..=requests {
            let r = get(&agent, &nginx.url(&format!("/{path}/{kind}")), &[("X-Key", &key)]);
            let stored = recorded(redis, &key);
            if r.status != 200 || r.num("RateLimit-Remaining") != Some(10 - n) || stored != n {
                failures.push(format!("{kind} request {n}: status {}, RateLimit-Remaining {:?}, {stored} recorded in Redis (want 200, {}, {n})", r.status, r.num("RateLimit-Remaining"), 10 - n));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(errors(nginx).is_empty(), "{:?}", errors(nginx));
}

fn counts_once(snippet: &str) {
    let redis = RedisServer::start_unix();
    let (_d, nginx) = start_with(&redis, snippet, "access_by_lua_block { per_key:limit(ngx.var.http_x_key) }", &redirect_locations("a", ""));
    each_counted_once(&redis, &nginx, "a", "once", &REDIRECTS, 2);
}

#[test]
fn a_refund_and_a_settle_after_every_internal_redirect_find_their_handle() {
    let redis = RedisServer::start_unix();
    // The log phase runs in whichever location the request ends: the handle
    // must come from the request, not from the location's ngx.ctx.
    let log = r#"log_by_lua_block {
        local ratelimitd = require "resty.ratelimitd"
        local res = ratelimitd.decision()
        if not res or not res.handle then
            ngx.log(ngx.ERR, "test: no handle after ", ngx.var.uri)
        elseif ngx.var.http_x_actual then
            ratelimitd.settle(res.handle, tonumber(ngx.var.http_x_actual))
        else
            ratelimitd.refund(res.handle)
        end
    }"#;
    let mut locations = redirect_locations("login", "access_by_lua_block { login:limit(ngx.var.http_x_key) }");
    locations.push_str(&redirect_locations("tokens", "access_by_lua_block { tokens:limit({ ngx.var.http_x_key, ngx.var.http_x_key }, 50) }"));
    let (_d, nginx) = start(&redis, log, &locations);
    let agent = agent();
    let mut failures = Vec::new();
    for kind in REDIRECTS {
        // limit 3: four requests pass only if each is refunded.
        let key = format!("refund-{kind}");
        for n in 1..=4 {
            let r = get(&agent, &nginx.url(&format!("/login/{kind}")), &[("X-Key", &key)]);
            if r.status != 200 {
                failures.push(format!("login {kind} request {n}: status {}", r.status));
            }
            wait_until(&format!("login {kind} request {n} refunded"), Duration::from_secs(3), || recorded(&redis, &key) == 0);
        }
        // Reserve 50 of 100, settle to 10: the next request sees 100 - 10 - 50.
        let key = format!("settle-{kind}");
        let first = get(&agent, &nginx.url(&format!("/tokens/{kind}")), &[("X-Key", &key), ("X-Actual", "10")]);
        let mut second = None;
        wait_until(&format!("tokens {kind}: the first reserve settled to 10"), Duration::from_secs(3), || {
            let r = get(&agent, &nginx.url(&format!("/tokens/{kind}")), &[("X-Key", &key), ("X-Actual", "0")]);
            let settled = r.num("RateLimit-Remaining") == Some(100 - 10 - 50);
            second = Some(r);
            settled
        });
        let second = second.unwrap();
        if first.status != 200 || first.num("RateLimit-Remaining") != Some(50) || second.status != 200 {
            failures.push(format!("tokens {kind}: {} {:?}, then {} {:?}", first.status, first.num("RateLimit-Remaining"), second.status, second.num("RateLimit-Remaining")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(errors(&nginx).is_empty(), "{:?}", errors(&nginx));
}

/// A configuration without the snippet's `map $request_id` line (written
/// before it, or by hand). Before: every redirected request leaked its
/// concurrency slot for the 30 s lease (limit 4: the fifth request of a
/// redirect kind got 429, 4 slots held after the requests had finished),
/// with an error line per worker. Now a request is known by what nginx
/// keeps for it across redirects: each of 6 requests per redirect kind
/// holds one slot, taken at server level and again after the redirect,
/// and released when it ends; no error line.
#[test]
fn without_the_map_line_a_lease_survives_every_internal_redirect_and_is_released() {
    assert!(SNIPPET.contains(MAP_LINE));
    let redis = RedisServer::start_unix();
    let server = "access_by_lua_block { slots:enter(\"slot-\" .. ngx.var.http_x_kind) }\n    log_by_lua_block { require(\"resty.ratelimitd\").leave() }";
    let (_d, nginx) = start_with(&redis, &SNIPPET.replacen(MAP_LINE, "", 1), server, &redirect_locations("s", ""));
    let agent = agent();
    for kind in REDIRECTS {
        let key = format!("slot-{kind}");
        for n in 1..=6 {
            let r = get(&agent, &nginx.url(&format!("/s/{kind}")), &[("X-Kind", kind)]);
            assert_eq!((r.status, r.body.as_str()), (200, "ok\n"), "{kind} request {n}: one slot free for it\n{:?}", errors(&nginx));
            wait_until(&format!("{kind} request {n}'s slot released"), Duration::from_secs(3), || recorded(&redis, &key) == 0);
        }
    }
    assert!(errors(&nginx).is_empty(), "{:?}", errors(&nginx));
}

/// The client finds a request's earlier decisions by the address of nginx's
/// request object, which the next request of a keepalive connection usually
/// takes over, checked against `$connection` and `$connection_requests`
/// (resty/ratelimitd/request.lua). A request that meets the limiter only
/// after a redirect must never take the decision of the connection's
/// previous request at that address: every one of them is counted.
#[test]
fn each_request_of_a_keepalive_connection_that_meets_its_limit_after_a_redirect_is_counted() {
    let redis = RedisServer::start_unix();
    let late = "location = /late-ok { access_by_lua_block { per_key:limit(ngx.var.http_x_key) } content_by_lua_block { ngx.say(\"ok\") } }\n\
        \x20   location = /late/try_files { try_files $uri /late-ok; }\n\
        \x20   location = /late/exec { content_by_lua_block { return ngx.exec(\"/late-ok\") } }\n";
    let (_d, nginx) = start(&redis, "", late);
    each_counted_once(&redis, &nginx, "late", "late", &["try_files", "exec"], 6);
}
