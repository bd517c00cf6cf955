//! The Lua client's object API (`ratelimitd.new{...}`, `lim:limit(key,
//! cost)`, `lim:check(key, cost)`) against the table form, in real nginx with
//! the Lua module, a real `ratelimitd` and a real `redis-server`. nginx runs
//! the shipped `nginx/ratelimitd.conf` (socket path and read timeout
//! changed, as in tests/nginx.rs) and the servers below.

mod common;

use std::time::Duration;

use common::http::{agent, Reply};
use common::{Daemon, Nginx, RedisServer};

const SNIPPET: &str = include_str!("../nginx/ratelimitd.conf");

/// One options table per name, used for both forms: the object is made from
/// it once (`limiters[name]`), and the table form copies it and adds key and
/// cost on every request. So the two forms cannot differ in their options.
const LIMITERS: &str = r#"
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    OPTS = {
        eq = { limit = 5, window_ms = 60000 },
        draft = { limit = 5, window_ms = 10000, header_style = "draft" },
        x = { limit = 5, window_ms = 10000, header_style = "x" },
        quiet = { limit = 2, window_ms = 60000, headers = false, status = 403 },
        dry = { limit = 1, window_ms = 60000, dry_run = true },
        cost = { limit = 5, window_ms = 60000 },
        open = { limit = 100, window_ms = 1000, on_error = "open" },
        closed = { limit = 100, window_ms = 60000, on_error = "closed", fail_closed_status = 507 },
        loc = { limit = 100, window_ms = 1000, on_error = "local", local_limit = 10 },
        deny = { limit = 3, window_ms = 1500 },
    }
    limiters = {}
    for name, opts in pairs(OPTS) do
        limiters[name] = assert(ratelimitd.new(opts))
    end
}
"#;

/// `/obj/NAME?t=T&cost=C` and `/tbl/NAME?t=T&cost=C` limit the key
/// `NAME-obj:T` / `NAME-tbl:T` (two windows, so both start empty).
const LOCATIONS: &str = r#"
    location ~ ^/obj/(\w+)$ {
        access_by_lua_block {
            local name = ngx.var[1]
            limiters[name]:limit(name .. "-obj:" .. ngx.var.arg_t, tonumber(ngx.var.arg_cost))
        }
        content_by_lua_block { ngx.print("ok") }
    }
    location ~ ^/tbl/(\w+)$ {
        access_by_lua_block {
            local name = ngx.var[1]
            local opts = {}
            for k, v in pairs(OPTS[name]) do
                opts[k] = v
            end
            opts.key = name .. "-tbl:" .. ngx.var.arg_t
            opts.cost = tonumber(ngx.var.arg_cost)
            require("resty.ratelimitd").limit(opts)
        }
        content_by_lua_block { ngx.print("ok") }
    }
    # new() with bad options: one line per case, "ok" or the message.
    location /new-errors {
        content_by_lua_block {
            local ratelimitd = require "resty.ratelimitd"
            local cases = {
                { limit = 0, window_ms = 1000 },
                { limit = 1.5, window_ms = 1000 },
                { limit = "10", window_ms = 1000 },
                { limit = 10 },
                { limit = 10, window_ms = 0 },
                { limit = 10, window_ms = 1000, on_error = "maybe" },
                { limit = 10, window_ms = 1000, on_error = "local" },
                { limit = 10, window_ms = 1000, local_limit = 0 },
                { limit = 10, window_ms = 1000, header_style = "y" },
                { limit = 10, window_ms = 1000, status = 99 },
                { limit = 10, window_ms = 1000, fail_closed_status = 600 },
                { limit = 10, window_ms = 1000, headers = "yes" },
                { limit = 10, window_ms = 1000, dry_run = 1 },
                { limit = 10, window_ms = 1000, windows_ms = 1000 },
                { limit = 10, window_ms = 1000, key = "k" },
                { limit = 10, window_ms = 1000, cost = 2 },
                { limit = 10, window_ms = 1000, on_error = "local", local_limit = 3, dry_run = false },
            }
            for _, opts in ipairs(cases) do
                local lim, err = ratelimitd.new(opts)
                ngx.say(lim and "ok" or ("nil " .. tostring(err)))
            end
            -- Not a table at all: a bug in the code, raised like configure()
            -- does. (No tail calls: the message names the calling line.)
            local ok, err = pcall(function() local lim = ratelimitd.new("limit=10"); return lim end)
            ngx.say(ok and "no error" or err)
            ok, err = pcall(function() local lim = ratelimitd:new{ limit = 10, window_ms = 1000 }; return lim end)
            ngx.say(ok and "no error" or err)
        }
    }
    # Per-call arguments of lim:check / lim:limit: one line per case.
    location /call-errors {
        content_by_lua_block {
            local lim = limiters.cost
            -- No tail calls: the message names the calling line.
            local function try(f)
                local ok, err = pcall(f)
                ngx.say(ok and "no error" or err)
            end
            for _, cost in ipairs({ 0, -1, 1.5, 6, "2", 0 / 0, math.huge }) do
                try(function() local res = lim:check("check-obj:call-errors", cost); return res end)
            end
            -- Keys come from request data: an empty one, a number, an
            -- absent header (nil) never raise (sent hashed, limited);
            -- only a key no request can make does.
            for _, key in ipairs({ "", 42 }) do
                try(function() local res = lim:check(key); return res end)
            end
            try(function() local res = lim:check(nil); return res end)
            try(function() local res = lim:check(true); return res end)
            try(function() local res = lim.check("check-obj:call-errors"); return res end)
        }
    }
    # lim:check and check{} on the same options: the result tables, one
    # sorted "k=v" line each, or "nil <err>".
    location /check {
        content_by_lua_block {
            local ratelimitd = require "resty.ratelimitd"
            local function show(res, err)
                if not res then
                    return ngx.say("nil ", err)
                end
                local keys = {}
                for k in pairs(res) do
                    keys[#keys + 1] = k
                end
                table.sort(keys)
                local out = {}
                for _, k in ipairs(keys) do
                    out[#out + 1] = k .. "=" .. tostring(res[k])
                end
                ngx.say(table.concat(out, " "))
            end
            local t = ngx.var.arg_t
            local cost = tonumber(ngx.var.arg_cost)
            show(limiters.eq:check("check-obj:" .. t, cost))
            show(ratelimitd.check{ key = "check-tbl:" .. t, limit = 5, window_ms = 60000, cost = cost })
        }
    }
    # The table form's limiters are cached by their options, at most 256:
    # 300 option sets, twice, roll the cache over; every answer must still
    # carry its own limit.
    location /many {
        content_by_lua_block {
            local ratelimitd = require "resty.ratelimitd"
            for i = 1, 600 do
                local n = i % 300
                local res = assert(ratelimitd.check{ key = "many:" .. n, limit = 1000 + n, window_ms = 60000 + n })
                local count = i <= 300 and 1 or 2
                if res.limit ~= 1000 + n or res.count ~= count or res.remaining ~= 1000 + n - count then
                    return ngx.say("wrong answer at ", i, ": limit ", res.limit, " count ", res.count)
                end
            end
            ngx.say("ok")
        }
    }
    # lim:check of the deny limiter: "decision source retry_after_ms".
    location /decide {
        content_by_lua_block {
            local res = assert(limiters.deny:check("deny-obj:" .. ngx.var.arg_t, tonumber(ngx.var.arg_cost)))
            ngx.say(res.decision, " ", res.source, " ", res.retry_after_ms)
        }
    }
    # Keys with control bytes are sent hashed, others as they are: each key
    # is checked, then its md5 form, which is hashed again (it begins with
    # md5:), so it never shares the window of the key it is the hash of.
    location /keys {
        content_by_lua_block {
            local lim = limiters.eq
            for _, key in ipairs({ "ctl\tkey", "nul\0key", "del\127key", "utf8-ключ", "plain-key" }) do
                local a = assert(lim:check(key))
                local b = assert(lim:check("md5:" .. ngx.md5(key)))
                ngx.say(a.source, " ", a.count, " ", b.count)
            end
        }
    }
"#;

fn http_body(socket: &std::path::Path) -> String {
    assert!(SNIPPET.contains("read_timeout = 50,"), "the shipped snippet no longer sets read_timeout = 50");
    // Loaded CI machines stall processes for tens of ms (see tests/nginx.rs).
    let snippet = common::ops::snippet(socket);
    format!("{snippet}\n{LIMITERS}\nserver {{\n listen 127.0.0.1:{{PORT}};\n{LOCATIONS}\n}}\n")
}

/// A daemon whose socket nginx's unprivileged workers can reach.
fn daemon(redis: &RedisServer) -> Daemon {
    Daemon::start_with(&common::ops::socket_access(), Some(&redis.url()), "timeout_ms = 500")
}

/// Redis, a daemon on it and nginx with this file's limiters in front.
fn gateway() -> (RedisServer, Daemon, Nginx) {
    let redis = RedisServer::start();
    let d = daemon(&redis);
    let nginx = Nginx::start(&http_body(&d.socket));
    (redis, d, nginx)
}

fn get(agent: &ureq::Agent, url: &str) -> Reply {
    common::http::get(agent, url, &[])
}

/// Headers whose value is a number of seconds computed from the time left in
/// the window: two requests a few ms apart may round to different seconds.
fn same_headers(a: &Reply, b: &Reply, what: &str) {
    let (ha, hb) = (a.limit_headers(), b.limit_headers());
    assert_eq!(ha.iter().map(|h| &h.0).collect::<Vec<_>>(), hb.iter().map(|h| &h.0).collect::<Vec<_>>(), "{what}: header names");
    for ((name, va), (_, vb)) in ha.iter().zip(&hb) {
        if name == "retry-after" || name.ends_with("-reset") {
            let (x, y): (i64, i64) = (va.parse().unwrap(), vb.parse().unwrap());
            assert!((x - y).abs() <= 1, "{what}: {name} {va} vs {vb}");
        } else {
            assert_eq!(va, vb, "{what}: {name}");
        }
    }
}

#[test]
fn object_and_table_forms_give_the_same_decisions_and_headers() {
    let (_redis, _d, nginx) = gateway();
    let a = agent();
    // Interleaved, so that both windows are as old at each step.
    let mut pairs = Vec::new();
    for _ in 0..7 {
        let o = get(&a, &nginx.url("/obj/eq?t=1"));
        let t = get(&a, &nginx.url("/tbl/eq?t=1"));
        pairs.push((o, t));
    }
    for (i, (o, t)) in pairs.iter().enumerate() {
        assert_eq!(o.status, t.status, "request {i}");
        same_headers(o, t, &format!("eq request {i}"));
        if i < 5 {
            assert_eq!((o.status, o.number("RateLimit-Limit"), o.number("RateLimit-Remaining")), (200, 5, 4 - i as u64));
            assert_eq!(o.number("RateLimit-Reset"), 60);
            assert_eq!(o.body, "ok");
        } else {
            assert_eq!((o.status, o.number("RateLimit-Remaining")), (429, 0), "request {i}");
            assert!((1..=60).contains(&o.number("Retry-After")));
        }
    }

    // The other header styles, headers off with another status, dry run.
    for (name, n, statuses) in [
        ("draft", 6, vec![200, 200, 200, 200, 200, 429]),
        ("x", 6, vec![200, 200, 200, 200, 200, 429]),
        ("quiet", 3, vec![200, 200, 403]),
        ("dry", 3, vec![200, 200, 200]),
    ] {
        let mut got = Vec::new();
        for i in 0..n {
            let o = get(&a, &nginx.url(&format!("/obj/{name}?t=1")));
            let t = get(&a, &nginx.url(&format!("/tbl/{name}?t=1")));
            assert_eq!(o.status, t.status, "{name} request {i}");
            same_headers(&o, &t, &format!("{name} request {i}"));
            got.push(o);
        }
        assert_eq!(got.iter().map(|r| r.status).collect::<Vec<_>>(), statuses, "{name}");
        match name {
            "draft" => {
                assert_eq!(got[0].value("RateLimit-Policy"), Some("\"default\";q=5;w=10"));
                assert_eq!(got[0].value("RateLimit"), Some("\"default\";r=4;t=10"));
            }
            "x" => assert_eq!((got[0].number("X-RateLimit-Limit"), got[0].number("X-RateLimit-Remaining")), (5, 4)),
            "quiet" => assert!(got.iter().all(|r| r.limit_headers().is_empty()), "headers = false: none, not even Retry-After"),
            _ => assert_eq!(got[2].number("RateLimit-Remaining"), 0, "dry run: counted, never blocked"),
        }
    }
    nginx.assert_no_errors();
}

#[test]
fn new_returns_nil_and_a_message_on_bad_options() {
    let (_redis, _d, nginx) = gateway();
    let r = get(&agent(), &nginx.url("/new-errors"));
    assert_eq!(r.status, 200, "{}", nginx.error_log());
    let lines: Vec<&str> = r.body.lines().collect();
    assert_eq!(
        lines[..17],
        [
            "nil new: limit must be a positive integer",
            "nil new: limit must be a positive integer",
            "nil new: limit must be a positive integer",
            "nil new: window_ms must be a positive integer",
            "nil new: window_ms must be a positive integer",
            "nil new: on_error must be 'open', 'closed' or 'local'",
            "nil new: on_error = 'local' needs a positive integer local_limit",
            "nil new: local_limit must be a positive integer",
            "nil new: header_style must be 'ratelimit', 'draft' or 'x'",
            "nil new: status must be an HTTP status (200-599)",
            "nil new: fail_closed_status must be an HTTP status (200-599)",
            "nil new: headers must be a boolean",
            "nil new: dry_run must be a boolean",
            "nil new: unknown option 'windows_ms'",
            "nil new: key is given per request: lim:limit(key, cost)",
            "nil new: cost is given per request: lim:limit(key, cost)",
            "ok",
        ]
    );
    // Not a table: raised, at the caller's line.
    assert!(lines[17].starts_with("content_by_lua(nginx.conf:"), "{}", lines[17]);
    assert!(lines[17].ends_with("new: expects a policy name or a table of options: ratelimitd.new(\"order\"), ratelimitd.new{ limit = ..., window_ms = ... }"), "{}", lines[17]);
    assert!(lines[18].ends_with("new: expects a policy name or a table of options: ratelimitd.new(\"order\"), ratelimitd.new{ limit = ..., window_ms = ... }"), "{}", lines[18]);
    assert_eq!(lines.len(), 19);
    nginx.assert_no_errors();
}

#[test]
fn per_call_cost_is_checked_against_the_limit() {
    let (_redis, _d, nginx) = gateway();
    let a = agent();

    // Bad arguments raise, at the caller's line, with a message.
    let r = get(&a, &nginx.url("/call-errors"));
    let lines: Vec<&str> = r.body.lines().collect();
    let cost_msg = "cost must be an integer from 1 to the limit (5)";
    assert_eq!(lines.len(), 12, "{}", r.body);
    for l in &lines[..7] {
        assert!(l.starts_with("content_by_lua(nginx.conf:") && l.ends_with(cost_msg), "{l}");
    }
    assert_eq!(lines[7..10], ["no error", "no error", "no error"], "{}", r.body);
    assert!(lines[10].starts_with("content_by_lua(nginx.conf:") && lines[10].ends_with("key must be a string (or nil, a number, a list of strings), not a boolean"), "{}", r.body);
    assert!(lines[11].ends_with("call it as lim:limit(key, cost) / lim:check(key, cost), with a colon, on an object from new()"), "{}", r.body);
    // None of the raised ones reached the daemon: the window is untouched.
    let c = get(&a, &nginx.url("/check?t=call-errors"));
    assert!(c.body.starts_with("allowed=true count=1 "), "{}", c.body);

    // Good costs are counted: 3 + 2 fill a limit of 5, in both forms.
    for form in ["obj", "tbl"] {
        let r3 = get(&a, &nginx.url(&format!("/{form}/cost?t=a&cost=3")));
        assert_eq!((r3.status, r3.number("RateLimit-Remaining")), (200, 2), "{form}");
        let r2 = get(&a, &nginx.url(&format!("/{form}/cost?t=a&cost=2")));
        assert_eq!((r2.status, r2.number("RateLimit-Remaining")), (200, 0), "{form}");
        let r1 = get(&a, &nginx.url(&format!("/{form}/cost?t=a")));
        assert_eq!(r1.status, 429, "{form}");
    }
    // cost = limit is allowed on an empty window.
    assert_eq!(get(&a, &nginx.url("/obj/cost?t=b&cost=5")).number("RateLimit-Remaining"), 0);
    nginx.assert_no_errors();

    // Above the limit: the object form raises (500, the message in the log)...
    let over = get(&a, &nginx.url("/obj/cost?t=c&cost=6"));
    assert_eq!(over.status, 500);
    let log = nginx.error_log();
    assert!(log.contains(cost_msg), "{log}");
    // ...while the table form sends it: the daemon refuses the request
    // (INVALID_COST), a configuration bug answered with invalid_status (500),
    // not by the location's fail policy.
    let over = get(&a, &nginx.url("/tbl/cost?t=c&cost=6"));
    assert_eq!(over.status, 500);
    let log = nginx.error_log();
    assert!(log.contains("ratelimitd: invalid_request key=cost-tbl:c reason=\"INVALID_COST"), "{log}");
    assert!(!log.contains("ratelimitd: fail_closed key=cost-tbl:c"), "{log}");
}

#[test]
fn check_gives_the_same_table_in_both_forms_and_hashes_odd_keys() {
    let (_redis, _d, nginx) = gateway();
    let a = agent();
    for i in 0..6u32 {
        let r = get(&a, &nginx.url("/check?t=same&cost=1"));
        let lines: Vec<&str> = r.body.lines().collect();
        assert_eq!(lines.len(), 2, "{}", r.body);
        if i < 5 {
            assert_eq!(lines[0], lines[1], "check {i}");
            let expected = format!(
                "allowed=true count={} decision=allowed error=OK error_code=0 limit=5 message= remaining={} reset_ms=60000 retry_after_ms=0 source=redis",
                i + 1,
                4 - i
            );
            assert_eq!(lines[0], expected, "check {i}");
        } else {
            // Denied: the times left differ by the ms between the two calls.
            let expected = "allowed=false count=5 decision=denied error=OK error_code=0 limit=5 message= remaining=0 reset_ms=";
            assert!(lines[0].starts_with(expected) && lines[1].starts_with(expected), "{}", r.body);
            assert!(lines[0].ends_with(" source=redis") && lines[1].ends_with(" source=redis"), "{}", r.body);
        }
    }
    assert_eq!(get(&a, &nginx.url("/many")).body, "ok\n");
    // TAB, NUL and DEL are control bytes: hashed; UTF-8 and plain keys are
    // sent as they are; no key's md5 form, sent literally, shares its window.
    let r = get(&a, &nginx.url("/keys"));
    assert_eq!(r.body, "redis 1 1\nredis 1 1\nredis 1 1\nredis 1 1\nredis 1 1\n");
    nginx.assert_no_errors();
}

#[test]
fn daemon_down_object_form_applies_its_policy() {
    let (_redis, mut d, nginx) = gateway();
    let a = agent();
    assert_eq!(get(&a, &nginx.url("/obj/closed?t=1")).number("RateLimit-Remaining"), 99);
    assert!(d.terminate().success());

    for form in ["obj", "tbl"] {
        let closed = get(&a, &nginx.url(&format!("/{form}/closed?t=1")));
        assert_eq!(closed.status, 507, "{form}: closed, with the limiter's fail_closed_status");
        assert_eq!(closed.value("Retry-After"), Some("1"), "{form}");
        assert!(closed.value("RateLimit-Remaining").is_none(), "{form}: nothing was counted");
        let open = get(&a, &nginx.url(&format!("/{form}/open?t=1")));
        assert_eq!((open.status, open.limit_headers().len()), (200, 0), "{form}: open, no quota promised");
        let loc: Vec<Reply> = (0..15).map(|_| get(&a, &nginx.url(&format!("/{form}/loc?t=1")))).collect();
        let ok = loc.iter().filter(|r| r.status == 200).count();
        // The Lua fallback is an approximate sliding window (tests/nginx.rs).
        assert!((10..=11).contains(&ok) && loc.iter().all(|r| r.status == 200 || r.status == 429), "{form}: {:?}", loc.iter().map(|r| r.status).collect::<Vec<_>>());
        assert_eq!(loc[0].number("RateLimit-Limit"), 10, "{form}: the local quota");
    }
    // check: nil and the reason, no policy.
    let c = get(&a, &nginx.url("/check?t=down"));
    assert!(c.body.starts_with("nil connect: "), "{}", c.body);

    // A long key is logged as sent (hashed), not as given.
    let long = "x".repeat(600);
    assert_eq!(get(&a, &nginx.url(&format!("/obj/open?t={long}"))).status, 200);
    std::thread::sleep(Duration::from_millis(1100)); // past log_interval
    assert_eq!(get(&a, &nginx.url(&format!("/obj/open?t={long}"))).status, 200);
    let log = nginx.error_log();
    assert!(log.contains("ratelimitd: fail_closed key=closed-obj:1 "), "{log}");
    assert!(log.contains("ratelimitd: fail_open key=open-obj:1 ") || log.contains("ratelimitd: fail_open key=open-tbl:1 "), "{log}");
    assert!(log.contains("ratelimitd: local_fallback key=loc-"), "{log}");
    assert!(log.contains("ratelimitd: fail_open key=md5:"), "{log}");
    // (nginx itself appends the request line, which holds it.)
    assert!(!log.contains(&format!("key=open-obj:{}", "x".repeat(100))), "the long key was logged as given");

    // A worker whose connects failed pauses before it tries the daemon again
    // (at most 1 s; docs/NGINX.md section 8): counting resumes within it.
    d.start_again();
    let back_at = std::time::Instant::now();
    let back = loop {
        let r = get(&a, &nginx.url("/obj/closed?t=1"));
        if r.status == 200 || back_at.elapsed() > Duration::from_secs(5) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!((back.status, back.number("RateLimit-Remaining")), (200, 98), "counting resumed in Redis");
    assert!(back_at.elapsed() < Duration::from_millis(2500), "resumed after {:?}", back_at.elapsed());
}

/// Every decision the daemon made, whoever made it (its metrics).
fn daemon_decisions(d: &Daemon) -> u64 {
    let text = agent().get(&d.metrics_url()).call().unwrap().body_mut().read_to_string().unwrap();
    text.lines().filter(|l| l.starts_with("ratelimitd_decisions_total{")).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum()
}

#[test]
fn a_refused_key_costs_no_round_trip_until_it_can_pass() {
    let redis = RedisServer::start();
    let d = Daemon::start_config_with_metrics(&format!("{}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n", common::ops::socket_access(), redis.url()));
    let nginx = Nginx::start(&http_body(&d.socket));
    let a = agent();
    for i in 0..3 {
        assert_eq!(get(&a, &nginx.url("/obj/deny?t=1")).status, 200, "request {i}");
    }
    let first = get(&a, &nginx.url("/decide?t=1"));
    let refused_at = std::time::Instant::now(); // the refusal ran in Redis before
    let retry_ms: u64 = first.body.strip_prefix("denied redis ").and_then(|r| r.trim().parse().ok()).unwrap_or_else(|| panic!("{}", first.body));
    let deadline = refused_at + Duration::from_millis(retry_ms);
    let decided = daemon_decisions(&d);

    // Hammered: refused in nginx with the headers of a refusal, the daemon
    // not asked; a larger cost too.
    for i in 0..30 {
        let r = get(&a, &nginx.url("/obj/deny?t=1"));
        assert_eq!((r.status, r.number("RateLimit-Limit"), r.number("RateLimit-Remaining")), (429, 3, 0), "request {i}");
        assert!((1..=2).contains(&r.number("Retry-After")) && r.number("Retry-After") <= retry_ms.div_ceil(1000), "{:?}", r.headers);
        assert!((1..=2).contains(&r.number("RateLimit-Reset")), "{:?}", r.headers);
    }
    let r = get(&a, &nginx.url("/decide?t=1&cost=2"));
    assert!(r.body.starts_with("denied lua_denial_cache "), "a larger cost: {}", r.body);
    assert_eq!(daemon_decisions(&d), decided, "the daemon was asked about a cached refusal");

    // Polled until it passes: no refusal (cached or not) of a request sent a
    // ms after Redis could admit, and the key passes then.
    let mut answers = Vec::new();
    loop {
        let sent = std::time::Instant::now();
        let r = get(&a, &nginx.url("/decide?t=1"));
        let mut words = r.body.split_whitespace();
        let (decision, source) = (words.next().unwrap().to_string(), words.next().unwrap().to_string());
        answers.push((sent, source.clone()));
        if decision == "allowed" {
            assert_eq!(source, "redis");
            break;
        }
        assert!(sent < deadline + Duration::from_millis(1), "refused ({source}) {:?} after Redis could admit", sent - deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    let cached = answers.iter().filter(|(_, s)| s == "lua_denial_cache").count();
    assert!(cached * 2 >= answers.len(), "{cached} of {} answers from the cache", answers.len());
    // An entry lives at most max_ms (1 s): a few daemon calls over the wait.
    let asked = daemon_decisions(&d) - decided;
    assert!(asked <= 12, "{asked} daemon decisions while the key was refused");
    nginx.assert_no_errors();
}
