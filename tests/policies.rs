//! Named policies (docs/POLICIES.md) with real processes: HTTP -> nginx (Lua
//! module) -> ratelimitd -> redis-server. The daemon's `[[policy]]` tables
//! decide; nginx names the policy and the key.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::http::{agent, get_as, Reply};
use common::ops::{metrics, sample};
use common::{wait_until, Daemon, Nginx, RedisServer};

const POLICIES: &str = r#"
[[policy]]
name = "order"
limit = 3
window = "60s"
allowlist = ["vip"]
[policy.overrides]
"tenant-big" = 5
"tenant-free" = "unlimited"

[[policy]]
name = "shadowed"
limit = 2
window = "60s"
shadow = true

[[policy]]
name = "tight"
limit = 2
window = "60s"
"#;

/// Each location names a policy; the typo locations name one the daemon
/// does not have, with each fail policy.
fn locations() -> String {
    common::ops::tenant_locations(&[
        ("/order", r#"("order")"#),
        ("/shadow", r#"{ policy = "shadowed", on_error = "closed" }"#),
        ("/tight", r#"("tight")"#),
        ("/typo-open", r#"{ policy = "ordr", on_error = "open" }"#),
        ("/typo-closed", r#"{ policy = "ordr", on_error = "closed" }"#),
    ]) + INLINE
}

const INLINE: &str = r#"
    location /inline {
        access_by_lua_block {
            require("resty.ratelimitd").limit{ key = ngx.var.http_x_tenant_id, limit = 3, window_ms = 60000 }
        }
        content_by_lua_block { ngx.say("ok") }
    }
"#;

fn gateway(socket: &std::path::Path) -> Nginx {
    common::ops::gateway(socket, "", &locations())
}

/// Redis, a daemon on it with POLICIES and nginx with LOCATIONS in front.
fn started() -> (RedisServer, Daemon, Nginx) {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let nginx = gateway(&d.socket);
    (redis, d, nginx)
}

fn daemon(redis: &RedisServer) -> Daemon {
    common::ops::daemon_with_metrics(redis, POLICIES)
}

fn statuses(a: &ureq::Agent, url: &str, tenant: &str, n: usize) -> Vec<u16> {
    (0..n).map(|_| get_as(a, url, tenant).status).collect()
}

/// A counter's sample in `text`, as the whole number it is.
fn sample_u64(text: &str, line_start: &str) -> u64 {
    sample(text, line_start) as u64
}

fn policy_sample(text: &str, policy: &str, outcome: &str) -> u64 {
    sample_u64(text, &format!("ratelimitd_policy_requests_total{{policy=\"{policy}\",outcome=\"{outcome}\"}} "))
}

#[test]
fn overrides_allowlist_shadow_and_unknown_names_through_nginx() {
    let (redis, d, nginx) = started();
    let a = agent();

    // The policy's limit, with its headers; the limit comes from the daemon.
    let replies: Vec<Reply> = (0..4).map(|_| get_as(&a, &nginx.url("/order"), "t1")).collect();
    assert_eq!(replies.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 200, 200, 429]);
    assert_eq!(replies[0].header("RateLimit-Limit"), "3");
    assert_eq!(replies[2].header("RateLimit-Remaining"), "0");
    assert!(!replies[3].header("Retry-After").is_empty());
    // An override raises the limit of one key.
    assert_eq!(statuses(&a, &nginx.url("/order"), "tenant-big", 6), [200, 200, 200, 200, 200, 429]);
    // Allowlisted and unlimited keys pass without a count, and without headers.
    let vip: Vec<Reply> = (0..10).map(|_| get_as(&a, &nginx.url("/order"), "vip")).collect();
    assert!(vip.iter().all(|r| r.status == 200 && r.header("RateLimit-Remaining").is_empty()));
    assert_eq!(statuses(&a, &nginx.url("/order"), "tenant-free", 5), [200; 5]);
    // The policy's window is its own: the inline form on the same key is not charged.
    assert_eq!(statuses(&a, &nginx.url("/inline"), "t1", 4), [200, 200, 200, 429]);

    // Shadow: refuses nothing, reports the refusals in metrics; the refused
    // requests record nothing (the window holds the 2 admissions only), and
    // another policy on the same key is not charged.
    let shadow: Vec<Reply> = (0..5).map(|_| get_as(&a, &nginx.url("/shadow"), "t2")).collect();
    assert!(shadow.iter().all(|r| r.status == 200), "a shadow policy refuses nothing");
    assert!(shadow[4].header("RateLimit-Remaining").is_empty(), "a shadow refusal sets no header");
    let mut conn = redis.conn();
    let shadow_key = b"ratelimitd:{\x08shadowedt2}:60000ms".to_vec();
    let members: u64 = redis::Commands::zcard(&mut conn, shadow_key).unwrap();
    assert_eq!(members, 2, "the shadow window holds what enforcing would have admitted, nothing more");
    assert_eq!(statuses(&a, &nginx.url("/order"), "t2", 4), [200, 200, 200, 429]);

    // Unknown name: the location's fail policy decides, logged loudly, counted.
    assert_eq!(statuses(&a, &nginx.url("/typo-open"), "t3", 3), [200; 3]);
    assert_eq!(statuses(&a, &nginx.url("/typo-closed"), "t3", 2), [503; 2]);
    wait_until("the unknown policy logged by nginx", Duration::from_secs(5), || nginx.error_log().contains("ratelimitd: unknown_policy"));
    let log = nginx.error_log();
    assert!(log.contains("unknown_policy policy=ordr key=t3 reason=\"no policy named 'ordr'"), "the line names the policy: {log}");
    for line in log.lines().filter(|l| l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]")) {
        assert!(line.contains("unknown_policy") || line.contains("fail_open") || line.contains("fail_closed"), "unexpected error: {line}");
    }
    assert!(d.log().contains("request names a policy that is not configured"), "{}", d.log());

    let text = metrics(&d);
    assert_eq!(sample_u64(&text, "ratelimitd_errors_total{code=\"UNKNOWN_POLICY\"} "), 5);
    assert_eq!(policy_sample(&text, "order", "admitted"), 3 + 5 + 3);
    assert_eq!(policy_sample(&text, "order", "refused") + policy_sample(&text, "order", "refused_from_cache"), 3);
    assert_eq!(policy_sample(&text, "order", "exempt"), 15);
    assert_eq!(policy_sample(&text, "shadowed", "admitted"), 2);
    assert_eq!(policy_sample(&text, "shadowed", "shadow_refused"), 3);
    assert_eq!(policy_sample(&text, "order", "fail_open") + policy_sample(&text, "order", "fail_closed"), 0);
    assert!(!text.contains("policy=\"ordr\""), "label values come from the configuration only");
    // The first refusal from Redis, the later ones from the daemon's denial cache.
    let shadow_denied = |source: &str| sample_u64(&text, &format!("ratelimitd_decisions_total{{decision=\"shadow_denied\",source=\"{source}\"}} "));
    assert_eq!(shadow_denied("redis") + shadow_denied("denial_cache"), 3);
}

#[test]
fn reload_under_load_changes_a_policy_limit_without_a_failed_request() {
    let (_redis, d, nginx) = started();
    let a = agent();
    assert_eq!(statuses(&a, &nginx.url("/tight"), "r", 3), [200, 200, 429]);

    // Load on an allowlisted key and on keys far from their limit: every
    // one of these requests must pass, before, during and after the reload.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..3)
        .map(|t| {
            let (url, stop, sent) = (nginx.url("/order"), stop.clone(), sent.clone());
            std::thread::spawn(move || {
                let a = agent();
                let mut bad = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let tenant = if i % 2 == 0 { "vip".to_string() } else { format!("load-{t}-{i}") };
                    let r = get_as(&a, &url, &tenant);
                    if r.status != 200 {
                        bad.push((tenant, r.status));
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                bad
            })
        })
        .collect();
    wait_until("load running", Duration::from_secs(5), || sent.load(Ordering::Relaxed) >= 50);

    let before = sent.load(Ordering::Relaxed);
    d.rewrite_config(&d.config_text().replace("name = \"tight\"\nlimit = 2", "name = \"tight\"\nlimit = 4"));
    d.signal(nix::sys::signal::Signal::SIGHUP);
    wait_until("configuration reloaded", Duration::from_secs(5), || d.log().contains("configuration reloaded"));
    // The raised limit is in force at once: the same window admits 2 more.
    assert_eq!(statuses(&a, &nginx.url("/tight"), "r", 3), [200, 200, 429]);
    wait_until("load after the reload", Duration::from_secs(5), || sent.load(Ordering::Relaxed) >= before + 100);
    stop.store(true, Ordering::Relaxed);
    let bad: Vec<_> = load.into_iter().flat_map(|t| t.join().unwrap()).collect();
    assert!(bad.is_empty(), "requests failed across the reload: {bad:?}");

    let text = metrics(&d);
    assert_eq!(sample_u64(&text, "ratelimitd_config_reloads_total "), 1);
    assert_eq!(policy_sample(&text, "tight", "admitted"), 4, "the counters carried over the reload");
    assert_eq!(policy_sample(&text, "tight", "refused") + policy_sample(&text, "tight", "refused_from_cache"), 2);
    for outcome in ["fail_open", "fail_closed", "error"] {
        assert_eq!(policy_sample(&text, "order", outcome), 0, "{outcome}");
    }
    assert!(policy_sample(&text, "order", "exempt") > 0 && policy_sample(&text, "order", "admitted") > 0);
    let log = nginx.error_log();
    assert!(!log.contains("[error]") && !log.contains("[crit]"), "nginx error log:\n{log}");
}

#[test]
fn the_headers_show_the_limit_in_force_after_a_reload_lowers_it() {
    let (_redis, d, nginx) = started();
    let a = agent();
    d.rewrite_config(&d.config_text().replace("name = \"tight\"\nlimit = 2", "name = \"tight\"\nlimit = 5"));
    d.signal(nix::sys::signal::Signal::SIGHUP);
    wait_until("configuration reloaded", Duration::from_secs(5), || d.log().matches("configuration reloaded").count() == 1);
    assert_eq!(statuses(&a, &nginx.url("/tight"), "low", 4), [200; 4]);
    // Lowered to 2 with 4 in the window: the client is told 2, not the 4
    // the window holds (count + remaining, docs/PROTOCOL.md section 7).
    d.rewrite_config(&d.config_text().replace("name = \"tight\"\nlimit = 5", "name = \"tight\"\nlimit = 2"));
    d.signal(nix::sys::signal::Signal::SIGHUP);
    wait_until("configuration reloaded again", Duration::from_secs(5), || d.log().matches("configuration reloaded").count() == 2);
    let r = get_as(&a, &nginx.url("/tight"), "low");
    assert_eq!(r.status, 429);
    assert_eq!((r.header("RateLimit-Limit"), r.header("RateLimit-Remaining")), ("2", "0"));
}
