//! The whole chain with real processes: HTTP -> nginx (Lua module, workers
//! as an unprivileged user when run as root) -> ratelimitd -> redis-server.
//! nginx runs the shipped `nginx/ratelimitd.conf` and `nginx/example.conf`,
//! with only ports, the socket path and (where a test says so) a window changed.

mod common;

use std::time::{Duration, Instant};

use common::http::{agent, get_as, Reply};
use common::{is_root, Daemon, Nginx, RedisServer};

const SNIPPET: &str = include_str!("../nginx/ratelimitd.conf");
const EXAMPLE: &str = include_str!("../nginx/example.conf");

/// Locations used only by the tests, added to the example's server.
const TEST_LOCATIONS: &str = r#"
    location /slide {
        access_by_lua_block {
            require("resty.ratelimitd").limit{ key = "slide", limit = 3, window_ms = 300 }
        }
        proxy_pass http://app;
    }
    location /dry {
        access_by_lua_block {
            require("resty.ratelimitd").limit{ key = "dry", limit = 1, window_ms = 60000, dry_run = true }
        }
        proxy_pass http://app;
    }
    location /draft {
        access_by_lua_block {
            require("resty.ratelimitd").limit{ key = "draft", limit = 5, window_ms = 10000, header_style = "draft" }
        }
        proxy_pass http://app;
    }
    location /xhdr {
        access_by_lua_block {
            require("resty.ratelimitd").limit{ key = "xhdr", limit = 5, window_ms = 10000, header_style = "x" }
        }
        proxy_pass http://app;
    }
"#;

fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "the shipped config no longer contains {from:?}");
    text.replacen(from, to, 1)
}

/// The `http {}` body: the shipped snippet and example, pointed at `socket`,
/// plus the application the example proxies to, served by the same nginx on
/// a port of its own (`{PORT:app}`).
fn gateway_config(socket: &std::path::Path, order_window_ms: u32) -> String {
    let snippet = replace_once(SNIPPET, "unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", socket.display()));
    // Loaded CI machines stall processes for tens of ms: these tests are about
    // decisions, so the Lua side waits as long as the daemon may take.
    let snippet = replace_once(&snippet, "read_timeout = 50,", "read_timeout = 1000,");
    let mut example = replace_once(EXAMPLE, "listen 8080;", &format!("listen 127.0.0.1:{{PORT}};\n{TEST_LOCATIONS}"));
    example = replace_once(&example, "server 127.0.0.1:9000;", "server 127.0.0.1:{PORT:app};");
    example = replace_once(&example, "window_ms = 1000,", &format!("window_ms = {order_window_ms},"));
    format!("{snippet}\n{example}\nserver {{ listen 127.0.0.1:{{PORT:app}}; location / {{ return 200 \"ok\\n\"; }} }}\n")
}

/// A daemon whose socket nginx's unprivileged workers can reach.
/// Redis, a daemon on it and nginx in front, the `/order` window
/// `order_window_ms` long.
fn gateway(order_window_ms: u32) -> (RedisServer, Daemon, Nginx) {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let nginx = Nginx::start(&gateway_config(&d.socket, order_window_ms));
    (redis, d, nginx)
}

fn daemon(redis: &RedisServer) -> Daemon {
    daemon_with_timeout(redis, 500)
}

/// The Redis deadline stays under the Lua read timeout, so that the daemon's
/// answer, not the Lua timeout, decides when Redis is slow.
fn daemon_with_timeout(redis: &RedisServer, timeout_ms: u32) -> Daemon {
    let server = common::ops::socket_access();
    Daemon::start_with(&server, Some(&redis.url()), &format!("timeout_ms = {timeout_ms}"))
}

#[test]
fn seed_scenario_through_nginx() {
    let (_redis, _d, nginx) = gateway(60_000);
    let a = agent();
    let replies: Vec<Reply> = (0..1005).map(|_| get_as(&a, &nginx.url("/order"), "tenant-1001")).collect();
    assert_eq!(replies.iter().filter(|r| r.status == 200).count(), 1000);
    assert_eq!(replies.iter().filter(|r| r.status == 429).count(), 5);
    for (i, r) in replies[..1000].iter().enumerate() {
        assert_eq!(r.status, 200);
        assert_eq!((r.number("RateLimit-Limit"), r.number("RateLimit-Remaining")), (1000, 999 - i as u64));
        assert_eq!(r.number("RateLimit-Reset"), 60);
    }
    for r in &replies[1000..] {
        assert_eq!((r.status, r.number("RateLimit-Remaining")), (429, 0));
        let retry = r.number("Retry-After");
        assert!((1..=60).contains(&retry), "Retry-After {retry}");
    }
    // Another tenant is unaffected.
    let other = get_as(&a, &nginx.url("/order"), "tenant-1002");
    assert_eq!((other.status, other.number("RateLimit-Remaining")), (200, 999));
    // No tenant header: the example refuses before limiting.
    assert_eq!(get_as(&a, &nginx.url("/order"), "").status, 400);
    // A header too long to be a key is hashed, still counted: no way around
    // the limit, and no push into the fail policy.
    let long = "x".repeat(700);
    let first = get_as(&a, &nginx.url("/order"), &long);
    let second = get_as(&a, &nginx.url("/order"), &long);
    assert_eq!((first.status, first.number("RateLimit-Remaining")), (200, 999));
    assert_eq!((second.status, second.number("RateLimit-Remaining")), (200, 998));
    nginx.assert_no_errors();
}

#[test]
fn window_slides_dry_run_and_header_styles() {
    let (_redis, _d, nginx) = gateway(1000);
    let a = agent();
    let statuses: Vec<u16> = (0..4).map(|_| get_as(&a, &nginx.url("/slide"), "t").status).collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
    std::thread::sleep(Duration::from_millis(320));
    assert_eq!(get_as(&a, &nginx.url("/slide"), "t").status, 200, "the window slid");

    // Dry run: decided and reported, never blocked.
    let dry: Vec<Reply> = (0..3).map(|_| get_as(&a, &nginx.url("/dry"), "t")).collect();
    assert!(dry.iter().all(|r| r.status == 200));
    assert_eq!(dry[2].number("RateLimit-Remaining"), 0);

    let draft = get_as(&a, &nginx.url("/draft"), "t");
    assert_eq!(draft.value("RateLimit-Policy"), Some("\"default\";q=5;w=10"));
    assert_eq!(draft.value("RateLimit"), Some("\"default\";r=4;t=10"));
    assert!(draft.value("RateLimit-Limit").is_none());
    let x = get_as(&a, &nginx.url("/xhdr"), "t");
    assert_eq!((x.number("X-RateLimit-Limit"), x.number("X-RateLimit-Remaining"), x.number("X-RateLimit-Reset")), (5, 4, 10));
    nginx.assert_no_errors();
}

/// Two gateways, each with its own daemon, on one Redis: one global limit.
/// Never more than the limit; during the burst a gateway may refuse while
/// the other holds units of a quota lease or a worker share (both on by
/// default) that its own requests then do not use, so the burst may admit
/// a few less (docs/CONFIG.md, "Fast by default": under-admission, the
/// cost of the defaults); once those are settled or given back, the key
/// admits exactly up to the limit and no further: no unit is lost for good.
#[test]
fn two_gateways_hold_one_global_limit() {
    let redis = RedisServer::start_unix();
    let (d1, d2) = (daemon(&redis), daemon(&redis));
    let (n1, n2) = (Nginx::start(&gateway_config(&d1.socket, 60_000)), Nginx::start(&gateway_config(&d2.socket, 60_000)));
    let urls = [n1.url("/order"), n2.url("/order")];
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let url = urls[t % 2].clone();
            std::thread::spawn(move || {
                let a = agent();
                (0..160).filter(|_| get_as(&a, &url, "global").status == 200).count()
            })
        })
        .collect();
    let allowed: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(allowed <= 1000, "{allowed} of 1280 requests through two gateways admitted where the limit is 1000");
    eprintln!("{allowed} of 1280 admitted in the burst");
    // Leases live 1 s for this window, shares 100 ms at most, and a refusal
    // cached by a daemon or a Lua client 1 s each.
    std::thread::sleep(Duration::from_millis(2500));
    let a = agent();
    let mut tail = 0;
    for i in 0..=(1000 - allowed) {
        let status = get_as(&a, &urls[i % 2], "global").status;
        if status != 200 {
            assert_eq!((status, allowed + tail), (429, 1000), "refused before the limit: {allowed} in the burst, {tail} after it");
            break;
        }
        tail += 1;
        assert!(allowed + tail <= 1000, "{allowed} in the burst, {tail} after it: over the limit");
    }
    assert_eq!(allowed + tail, 1000, "exactly the limit once the units held were settled ({allowed} in the burst)");
    assert_eq!(get_as(&a, &urls[0], "global").status, 429, "and no more");
    n1.assert_no_errors();
    n2.assert_no_errors();
}

/// The daemon stopped: each location follows its own policy on the Lua side;
/// started again: limiting resumes without an nginx reload.
#[test]
fn daemon_down_each_location_follows_its_policy() {
    // A window that outlasts the test: "counting resumed" below reads the
    // first admission back (the first request after the stop now spends up
    // to 70 ms on a possible restart, docs/NGINX.md section 8).
    let (_redis, mut d, nginx) = gateway(60_000);
    let a = agent();
    assert_eq!(get_as(&a, &nginx.url("/order"), "t1").number("RateLimit-Remaining"), 999);
    assert!(d.terminate().success());

    let order = get_as(&a, &nginx.url("/order"), "t1");
    assert_eq!(order.status, 503, "closed");
    assert!(order.value("Retry-After").is_some());
    assert!(order.value("RateLimit-Remaining").is_none(), "nothing was counted");
    assert_eq!(get_as(&a, &nginx.url("/search"), "t1").status, 200, "open");
    let pay: Vec<u16> = (0..15).map(|_| get_as(&a, &nginx.url("/pay"), "t1").status).collect();
    let ok = pay.iter().filter(|&&s| s == 200).count();
    // The Lua fallback is an approximate sliding window: 10 per window, one
    // more at most if the burst straddles a window boundary.
    assert!((10..=11).contains(&ok) && pay.iter().all(|&s| s == 200 || s == 429), "{pay:?}");
    let log = nginx.error_log();
    assert!(log.contains("ratelimitd: fail_closed key=order:t1"), "{log}");
    assert!(log.contains("ratelimitd: fail_open key=search:"), "{log}");

    // A worker whose connects failed pauses before it tries again (at most
    // 1 s; docs/NGINX.md section 8): counting resumes within that.
    d.start_again();
    let back_at = Instant::now();
    let back = loop {
        let r = get_as(&a, &nginx.url("/order"), "t1");
        if r.status == 200 || back_at.elapsed() > Duration::from_secs(5) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(back.status, 200);
    assert!(back.number("RateLimit-Remaining") < 999, "counting resumed in Redis");
    assert!(back_at.elapsed() < Duration::from_millis(2500), "resumed after {:?}", back_at.elapsed());
}

/// Lines of `log` at error level or above.
fn error_lines(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]") || l.contains("[emerg]")).collect()
}

/// `threads` clients sending GETs to `paths` in turn for `run`; returns the
/// statuses seen, by status.
fn hammer(nginx: &Nginx, paths: &[&str], threads: usize, run: Duration) -> std::collections::BTreeMap<u16, usize> {
    let until = Instant::now() + run;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let urls: Vec<String> = paths.iter().map(|p| nginx.url(p)).collect();
            std::thread::spawn(move || {
                let a = agent();
                let mut seen = std::collections::BTreeMap::new();
                let mut i = t;
                while Instant::now() < until {
                    *seen.entry(get_as(&a, &urls[i % urls.len()], "t1").status).or_insert(0) += 1;
                    i += 1;
                }
                seen
            })
        })
        .collect();
    let mut all = std::collections::BTreeMap::new();
    for h in handles {
        for (status, n) in h.join().unwrap() {
            *all.entry(status).or_insert(0) += n;
        }
    }
    all
}

/// The daemon stopped under load: every request still gets its location's
/// policy, and error.log stays bounded. Before, each request wrote nginx's
/// own `connect() failed` line (and, on timeouts, the cosocket layer's):
/// 50,000 lines in 3 s. Now the snippet turns the cosocket lines off and a
/// worker pauses its connects to a missing daemon (50 ms doubling to 1 s),
/// so 2 workers write a few lines a second.
#[test]
fn stopped_daemon_does_not_flood_the_error_log() {
    let (_redis, mut d, nginx) = gateway(1000);
    let a = agent();
    assert_eq!(get_as(&a, &nginx.url("/order"), "t1").status, 200);
    assert!(d.terminate().success());
    let before = error_lines(&nginx.error_log()).len();

    let statuses = hammer(&nginx, &["/order", "/search"], 4, Duration::from_secs(3));
    let total: usize = statuses.values().sum();
    let log = nginx.error_log();
    let lines = error_lines(&log);
    let new_lines = &lines[before..];
    let connect_lines = new_lines.iter().filter(|l| l.contains("connect() to unix:")).count();
    eprintln!("{total} requests in 3 s with the daemon stopped: {statuses:?}; {} error lines, {connect_lines} of them nginx's connect() failed", new_lines.len());
    // Closed for /order, open for /search: every request got its policy.
    assert_eq!(statuses.get(&503).copied().unwrap_or(0) + statuses.get(&200).copied().unwrap_or(0), total, "{statuses:?}");
    assert!(total >= 200, "only {total} requests: the bound below would prove nothing");
    // 2 workers x 3 s: per worker at most ~8 connect lines (pauses of
    // 0.05, 0.1, 0.2, 0.4, 0.8, 1, 1 s) and one module line per kind
    // (fail_closed, fail_open) per second; 80 leaves room for a slow machine.
    assert!(new_lines.len() <= 80, "{} error lines for {total} requests:\n{}", new_lines.len(), new_lines.join("\n"));
    assert!(!log.contains("lua tcp socket"), "cosocket lines are off in the snippet:\n{log}");
    assert!(log.contains("ratelimitd: fail_closed key=order:t1 reason=\"connect: "), "{log}");

    // Back: each worker is using the daemon again within its pause (<= 1 s).
    d.start_again();
    let back_at = Instant::now();
    let mut served = [false; 2];
    while back_at.elapsed() < Duration::from_secs(5) && served.iter().any(|s| !s) {
        for (i, s) in served.iter_mut().enumerate() {
            // A fresh connection per request lands on either worker.
            if get_as(&agent(), &nginx.url("/order"), &format!("back{i}")).status == 200 {
                *s = true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let elapsed = back_at.elapsed();
    assert!(served.iter().all(|&s| s), "not served 5 s after the restart:\n{}", nginx.error_log());
    assert!(elapsed < Duration::from_millis(2500), "served again after {elapsed:?}");
}

/// A location whose limit the daemon refuses (above `limits.max_limit`) is
/// misconfigured, not in an outage: with `on_error = "open"` it used to pass
/// every request unlimited. Now every such request gets `invalid_status`
/// (500), both sides log it at error level (rate-limited), and the daemon
/// counts it.
#[test]
fn misconfigured_location_gets_500_not_its_fail_policy() {
    let redis = RedisServer::start_unix();
    let server = common::ops::socket_access();
    let d = Daemon::start_with(&format!("{server}\n[limits]\nmax_limit = 100"), Some(&redis.url()), "timeout_ms = 500");
    let snippet = replace_once(SNIPPET, "unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()));
    let snippet = replace_once(&snippet, "read_timeout = 50,", "read_timeout = 1000,");
    let body = format!(
        "{snippet}\n\
         init_worker_by_lua_block {{\n\
             local ratelimitd = require \"resty.ratelimitd\"\n\
             too_high = assert(ratelimitd.new{{ limit = 1000, window_ms = 1000, on_error = \"open\" }})\n\
             teapot = assert(ratelimitd.new{{ limit = 1000, window_ms = 1000, on_error = \"open\", invalid_status = 418 }})\n\
             dry = assert(ratelimitd.new{{ limit = 1000, window_ms = 1000, on_error = \"closed\", dry_run = true }})\n\
             fine = assert(ratelimitd.new{{ limit = 100, window_ms = 1000, on_error = \"open\" }})\n\
         }}\n\
         server {{ listen 127.0.0.1:{{PORT}};\n\
             location /open {{ access_by_lua_block {{ too_high:limit(\"open\") }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
             location /teapot {{ access_by_lua_block {{ teapot:limit(\"teapot\") }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
             location /dry {{ access_by_lua_block {{ dry:limit(\"dry\") }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
             location /fine {{ access_by_lua_block {{ fine:limit(\"fine\") }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         }}\n"
    );
    let nginx = Nginx::start(&body);
    let a = agent();
    let open: Vec<u16> = (0..30).map(|_| get_as(&a, &nginx.url("/open"), "t").status).collect();
    assert!(open.iter().all(|&s| s == 500), "on_error = open must not pass a misconfigured request: {open:?}");
    assert_eq!(get_as(&a, &nginx.url("/teapot"), "t").status, 418, "invalid_status per limiter");
    assert_eq!(get_as(&a, &nginx.url("/dry"), "t").status, 200, "dry run never blocks");
    assert_eq!(get_as(&a, &nginx.url("/fine"), "t").status, 200, "a valid location next to it is served");

    let log = nginx.error_log();
    let invalid = log.lines().filter(|l| l.contains("[error]") && l.contains("ratelimitd: invalid_request key=open reason=\"INVALID_LIMIT")).count();
    // 30 requests within about a second, 2 workers: one line per worker per second.
    assert!((1..=4).contains(&invalid), "{invalid} invalid_request lines:\n{log}");
    assert!(!log.contains("fail_open"), "{log}");
    let dlog = d.log();
    assert!(dlog.contains("invalid request refused") && dlog.contains("INVALID_LIMIT"), "{dlog}");
}

/// Redis stopped: the daemon applies the policy each location sent.
#[test]
fn redis_down_daemon_applies_each_policy() {
    let mut redis = RedisServer::start_unix();
    // Redis down costs each request up to the daemon's deadline: keep it short
    // so the 12 requests below fit in one 1 s window.
    let d = daemon_with_timeout(&redis, 20);
    let nginx = Nginx::start(&gateway_config(&d.socket, 1000));
    let a = agent();
    assert_eq!(get_as(&a, &nginx.url("/pay"), "t1").status, 200);
    redis.kill();
    assert_eq!(get_as(&a, &nginx.url("/order"), "t1").status, 503);
    assert_eq!(get_as(&a, &nginx.url("/search"), "t1").status, 200);
    // The daemon's local fallback is exact: 10 per window on this host.
    let pay: Vec<Reply> = (0..12).map(|_| get_as(&a, &nginx.url("/pay"), "t2")).collect();
    let statuses: Vec<u16> = pay.iter().map(|r| r.status).collect();
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 10, "{statuses:?}");
    assert_eq!(pay[0].number("RateLimit-Limit"), 10, "headers show the local quota");
    let log = nginx.error_log();
    assert!(log.contains("ratelimitd: daemon_fail_closed key=order:t1"), "{log}");
}

/// The socket's mode and group decide whether unprivileged workers get in.
#[test]
fn socket_permissions_gate_unprivileged_workers() {
    if !is_root() {
        eprintln!("skipped: needs root to run nginx workers as another user");
        return;
    }
    let redis = RedisServer::start_unix();
    let d = Daemon::start_with("socket_mode = \"0600\"", Some(&redis.url()), "timeout_ms = 500");
    let nginx = Nginx::start(&gateway_config(&d.socket, 1000));
    let a = agent();
    assert_eq!(get_as(&a, &nginx.url("/order"), "t1").status, 503, "workers cannot connect: fail closed");
    let log = nginx.error_log();
    assert!(log.contains("Permission denied") || log.contains("permission denied"), "{log}");
}

/// A daemon restart between two requests: pooled connections to the old
/// daemon are dead, and the client resends on a fresh one, so no request
/// falls to the fail policy.
#[test]
fn daemon_restart_between_requests_fails_no_request() {
    let (_redis, mut d, nginx) = gateway(60_000);
    let a = agent();
    // Fill both workers' pools.
    for _ in 0..20 {
        assert_eq!(get_as(&a, &nginx.url("/order"), "t1").status, 200);
    }
    assert!(d.terminate().success());
    d.start_again();
    let replies: Vec<Reply> = (0..20).map(|_| get_as(&a, &nginx.url("/order"), "t1")).collect();
    for (i, r) in replies.iter().enumerate() {
        assert_eq!(r.status, 200, "request {i} after the restart: {}", nginx.error_log());
        assert_eq!(r.number("RateLimit-Remaining"), 1000 - 21 - i as u64);
    }
}
