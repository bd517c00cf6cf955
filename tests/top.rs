//! `ratelimitd top` and `GET /top.json` with real processes: HTTP -> nginx
//! (Lua module) -> ratelimitd -> redis-server; one key hammered over its
//! limit among light traffic on others. Also: the Grafana dashboard names
//! only metrics the daemon exports.

mod common;

use std::collections::BTreeSet;
use std::process::{Command, Output};
use std::time::Duration;

use common::http::agent;
use common::ops::metrics;
use common::{Daemon, Nginx, RedisServer};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

fn policies() -> String {
    common::rate_policies(&[("order", 5, "60s"), ("search", 1000, "60s")])
}

fn locations() -> String {
    common::ops::tenant_locations(&[("/order", r#"("order")"#), ("/search", r#"("search")"#), ("/typo", r#"{ policy = "ordr", on_error = "open" }"#)]) + INLINE
}

const INLINE: &str = r#"
    location /inline {
        access_by_lua_block {
            -- Without the Lua-side denial cache, every refusal reaches the daemon.
            local lim = assert(require("resty.ratelimitd").new{ limit = 3, window_ms = 60000, denial_cache = false })
            lim:limit("inline:" .. ngx.var.http_x_tenant_id)
        }
        content_by_lua_block { ngx.say("ok") }
    }
"#;

fn daemon(redis: &RedisServer) -> Daemon {
    common::ops::daemon_with_metrics(redis, &policies())
}

fn gateway(socket: &std::path::Path) -> Nginx {
    common::ops::gateway(socket, "", &locations())
}

/// `n` requests for `tenant`; the number answered 200 and 429.
fn send(url: &str, tenant: &str, n: usize) -> (usize, usize) {
    let a = agent();
    let mut got = (0, 0);
    for _ in 0..n {
        match common::http::get(&a, url, &[("X-Tenant-Id", tenant)]).status {
            200 => got.0 += 1,
            429 => got.1 += 1,
            s => panic!("{url} {tenant}: HTTP {s}"),
        }
    }
    got
}

/// The daemon's metrics endpoint as host:port.
fn metrics_addr(d: &Daemon) -> String {
    d.metrics_url().trim_start_matches("http://").trim_end_matches("/metrics").to_string()
}

fn top(args: &[&str]) -> Output {
    Command::new(BIN).arg("top").args(args).output().unwrap()
}

fn total(policy: &Value, outcome: &str) -> u64 {
    policy["total"][outcome].as_u64().unwrap_or_else(|| panic!("no {outcome} in {policy}"))
}

#[test]
fn top_json_lists_the_hammered_key_first_with_its_policy_and_counts_match() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let nginx = gateway(&d.socket);

    // The attack: 300 requests for one tenant (limit 5) over 3 connections,
    // while light traffic for others goes on.
    let url = nginx.url("/order");
    let attack: Vec<_> = (0..3).map(|_| {
        let url = url.clone();
        std::thread::spawn(move || send(&url, "attacker", 100))
    }).collect();
    let mut light = (0, 0);
    for i in 0..10 {
        let (ok, refused) = send(&url, &format!("light-{i}"), 3);
        light = (light.0 + ok, light.1 + refused);
    }
    let noisy = send(&url, "noisy", 8);
    let search = send(&nginx.url("/search"), "s1", 20);
    let inline = send(&nginx.url("/inline"), "k", 6);
    let typo = send(&nginx.url("/typo"), "t", 2);
    let attacked = attack.into_iter().map(|t| t.join().unwrap()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert_eq!(attacked, (5, 295));
    assert_eq!((light, noisy, search, inline, typo), ((30, 0), (5, 3), (20, 0), (3, 3), (2, 0)));

    // The units /search's workers did not use go back before their share's
    // deadline (100 ms at most).
    std::thread::sleep(std::time::Duration::from_millis(300));
    let addr = metrics_addr(&d);
    let out = top(&["--json", "--metrics", &addr, "--interval", "0.2", "--count", "1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "one JSON line: {stdout}");
    let v: Value = serde_json::from_str(&stdout).unwrap();

    // The hammered key first, with its policy; fewer keys than the summary
    // holds, so the counts are exact (error 0).
    let keys = v["top_refused"]["keys"].as_array().unwrap();
    let row = |i: usize| (keys[i]["policy"].as_str().map(String::from), keys[i]["key"].as_str().unwrap().to_string(), keys[i]["refused"].as_u64().unwrap(), keys[i]["error"].as_u64().unwrap());
    assert_eq!(row(0), (Some("order".into()), "attacker".into(), 295, 0), "{v}");
    let rest: BTreeSet<_> = (1..keys.len()).map(row).collect();
    assert_eq!(rest, BTreeSet::from([(None, "inline:k".into(), 3, 0), (Some("order".into()), "noisy".into(), 3, 0)]), "{v}");
    assert_eq!(v["top_refused"]["recorded"], 301);
    assert!(v["top_refused"]["window_ms"].as_u64().unwrap() > 0);

    // The counters per policy match the requests sent. /search's 20 turn
    // its key hot: nginx admits the later ones from a worker share (on by
    // default), never sent to the daemon, which counts them as the share's
    // units handed less those given back (admitted_from_shares).
    let policies = v["policies"].as_array().unwrap();
    let order = policies.iter().find(|p| p["name"] == "order").unwrap();
    let search_p = policies.iter().find(|p| p["name"] == "search").unwrap();
    assert_eq!(total(order, "admitted"), 5 + 30 + 5);
    assert_eq!(total(order, "refused") + total(order, "refused_from_cache"), 295 + 3);
    assert!(total(order, "refused_from_cache") > 0, "the daemon's denial cache answered the attack: {order}");
    assert_eq!(total(search_p, "admitted") + total(search_p, "admitted_from_shares"), 20, "{search_p}");
    assert!(total(search_p, "admitted_from_shares") > 0, "the hot key was admitted from a share: {search_p}");
    assert_eq!(total(order, "admitted_from_shares"), 0, "/order's keys are refused or cold: {order}");
    for p in [order, search_p] {
        for o in ["shadow_refused", "exempt", "fail_open", "fail_closed", "fail_local_admitted", "fail_local_refused", "error"] {
            assert_eq!(total(p, o), 0, "{o}: {p}");
        }
    }
    assert_eq!(v["unknown_policy_total"], 2, "a location naming no configured policy is counted");
    let text = metrics(&d);
    assert!(text.contains("\nratelimitd_policy_unknown_requests_total 2\n"), "{text}");
    assert_eq!(v["breaker_open"], false);
    assert!(v["interval_s"].as_f64().unwrap() >= 0.15, "{v}");
    // Nothing was sent during the interval.
    assert_eq!(v["decisions_per_s"]["allowed"], 0.0);

    // Without a terminal and without --json: plain text snapshots.
    let out = top(&["--metrics", &addr, "--interval", "0.2", "--count", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.contains('\x1b'), "no terminal escapes in plain output: {text:?}");
    assert_eq!(text.matches("TOP REFUSED KEYS").count(), 2, "{text}");
    let first_key_line = text.lines().skip_while(|l| !l.contains("REFUSED  ERROR")).nth(1).unwrap();
    assert!(first_key_line.contains("295") && first_key_line.contains("order") && first_key_line.ends_with("attacker"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("order ")), "{text}");
}

#[test]
fn top_reports_a_daemon_down_or_without_metrics_clearly() {
    // A port nothing listens on (just released).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let out = top(&["--json", "--metrics", &addr]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot reach the daemon's metrics endpoint at {addr}")), "{err}");
    assert_eq!(err.matches("os error").count(), 1, "the cause once: {err}");
    assert!(out.stdout.is_empty());

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ratelimitd.toml");
    std::fs::write(&config, "[server]\nlisten = \"/tmp/x.sock\"\n").unwrap();
    let out = top(&["--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no [metrics] listen"), "{err}");
}

/// The metric names a PromQL expression uses.
fn metric_names(expr: &str, out: &mut BTreeSet<String>) {
    let mut rest = expr;
    while let Some(i) = rest.find("ratelimitd_") {
        let name: String = rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        rest = &rest[i + name.len()..];
        out.insert(name);
    }
}

fn walk(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "query", Value::String(s)) => metric_names(s, out),
                    _ => walk(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
        _ => {}
    }
}

#[test]
fn grafana_dashboard_parses_and_names_only_exported_metrics() {
    let dashboard: Value = serde_json::from_str(include_str!("../grafana/ratelimitd.json")).expect("grafana/ratelimitd.json is JSON");
    let mut used = BTreeSet::new();
    walk(&dashboard, &mut used);
    let ids: Vec<u64> = dashboard["panels"].as_array().unwrap().iter().map(|p| p["id"].as_u64().unwrap()).collect();
    assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), ids.len(), "panel ids are unique");

    // What a daemon with Redis and policies exports.
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let text = metrics(&d);
    let mut exported = BTreeSet::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let mut parts = line.split(' ');
        let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
        exported.insert(name.to_string());
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                exported.insert(format!("{name}{suffix}"));
            }
        }
    }
    let unknown: Vec<_> = used.difference(&exported).collect();
    assert!(unknown.is_empty(), "the dashboard names metrics the daemon does not export: {unknown:?}");
    for name in ["ratelimitd_policy_requests_total", "ratelimitd_policy_unknown_requests_total", "ratelimitd_redis_call_seconds_bucket", "ratelimitd_breaker_open"] {
        assert!(used.contains(name), "the dashboard shows {name}");
    }
}

/// The example output in docs/OPERATIONS.md ("ratelimitd top"): one tenant
/// hammering /order over 2 connections while others search, `top` taken
/// during the traffic. Run with
/// `cargo test --test top example_output -- --ignored --nocapture`.
#[test]
#[ignore = "the example output of docs/OPERATIONS.md: scripts/measure top-example runs it"]
fn example_output_for_the_docs() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let nginx = gateway(&d.socket);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // (path, the one tenant hammering, or None: 300 tenants in turn, paced).
    let traffic: Vec<_> = [("/order", Some("tenant-4711")), ("/order", Some("tenant-4711")), ("/search", None), ("/order", None)]
        .into_iter()
        .map(|(path, hammer)| {
            let (url, stop) = (nginx.url(path), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match hammer {
                        Some(tenant) => drop(send(&url, tenant, 1)),
                        None => {
                            send(&url, &format!("tenant-{}", 100 + i % 300), 1);
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                    i += 1;
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    let out = top(&["--metrics", &metrics_addr(&d), "--count", "1", "--keys", "6"]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    traffic.into_iter().for_each(|t| t.join().unwrap());
    println!("{}", String::from_utf8_lossy(&out.stdout));
    let out = top(&["--metrics", &metrics_addr(&d), "--json"]);
    println!("{}", String::from_utf8_lossy(&out.stdout));
}
