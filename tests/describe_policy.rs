//! DESCRIBE_POLICY (op 8, docs/PROTOCOL.md section 4g) with real processes:
//! the daemon describes the policies of the configuration in force (and a
//! reload changes the answer); hostile frames get codes and leave the
//! stream in sync; nginx (Lua module) verifies the names its limiters use
//! when a worker starts, says each unknown one once, and a policy limiter
//! counts its own fallback with the policy's window and local quota.

mod common;

use std::time::Duration;

use common::http::agent;
use common::{wait_until, Daemon, Nginx, RedisServer};
use nix::sys::signal::Signal;
use ratelimitd::protocol::{Algorithm, Decision, ErrorCode, FailPolicy, PolicyDescription, PolicyKind, OP_DESCRIBE_POLICY};

fn policies() -> String {
    use common::rate_policy;
    let local = r#"on_error = "local""#;
    [
        rate_policy("login", 100, "60s", &[]),
        rate_policy("pay", 1000, "60s", &[local, "local_limit = 2"]),
        rate_policy("basket", 1000, "30s", &[local, "local_limit = 3"]),
        rate_policy("search.v2", 7, "10s", &[r#"algorithm = "gcra""#, "shadow = true"]),
        common::concurrency_policy("uploads", 3, "30s"),
    ]
    .concat()
}

fn daemon(redis: &RedisServer) -> Daemon {
    common::ops::daemon(redis, &policies())
}

async fn describe(c: &mut ratelimitd::client::Client, name: &str) -> Option<PolicyDescription> {
    let r = c.describe(name.as_bytes()).await.unwrap();
    assert_eq!(r.op, OP_DESCRIBE_POLICY);
    PolicyDescription::from_response(&r).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_describes_each_policy_in_force_and_a_reload_changes_the_answer() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let mut c = d.client().await;
    let rate = |algorithm, limit, window_ms, on_error, local_limit, shadow| PolicyDescription { kind: PolicyKind::Rate, algorithm, limit, window_ms, on_error, local_limit, shadow };
    assert_eq!(describe(&mut c, "login").await, Some(rate(Algorithm::Log, 100, 60_000, None, 0, false)));
    assert_eq!(describe(&mut c, "pay").await, Some(rate(Algorithm::Log, 1000, 60_000, Some(FailPolicy::Local), 2, false)));
    assert_eq!(describe(&mut c, "search.v2").await, Some(rate(Algorithm::Gcra, 7, 10_000, None, 0, true)));
    assert_eq!(
        describe(&mut c, "uploads").await,
        Some(PolicyDescription { kind: PolicyKind::Concurrency, algorithm: Algorithm::Log, limit: 3, window_ms: 30_000, on_error: None, local_limit: 0, shadow: false })
    );
    assert_eq!(describe(&mut c, "logins").await, None);
    let unknown = c.describe(b"logins").await.unwrap();
    assert_eq!((unknown.decision, unknown.error), (Decision::Error, ErrorCode::UnknownPolicy));
    assert!(!unknown.message.contains("logins"), "the name sent is not echoed: {}", unknown.message);

    // Nothing decided, but `login` is named by a client: in use for the
    // reload refusal (docs/OPERATIONS.md), so a rename needs SIGUSR1.
    let text = d.config_text();
    d.rewrite_config(&text.replace("name = \"login\"", "name = \"logins\""));
    d.signal(Signal::SIGHUP);
    wait_until("reload refused", Duration::from_secs(5), || d.log().contains("configuration reload refused"));
    assert!(d.log().contains("login (no request yet, named by nginx: described"), "{}", d.log());
    assert_eq!(describe(&mut c, "login").await.map(|p| p.limit), Some(100), "the old configuration serves on");
    d.signal(Signal::SIGUSR1);
    wait_until("reload applied", Duration::from_secs(5), || d.log().contains("configuration reloaded"));
    // The same connection, the frames after the reload: the new configuration.
    assert_eq!(describe(&mut c, "login").await, None);
    assert_eq!(describe(&mut c, "logins").await, Some(rate(Algorithm::Log, 100, 60_000, None, 0, false)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_describe_frames_get_their_codes_and_the_stream_stays_in_sync() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let mut c = d.client().await;
    let frame = |body: &[u8]| {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    };
    let cases: Vec<(Vec<u8>, ErrorCode)> = vec![
        (frame(&[1, 8, 0, 0, 0, 42, 0, 0]), ErrorCode::Malformed),
        (frame(&[1, 8, 0, 0, 0, 42, 0, 2, 5, b'l', b'o', b'g', b'i', b'n']), ErrorCode::UnsupportedFlags),
        // The uses flag (0x0001) without its byte after the name; a uses byte without the flag.
        (frame(&[1, 8, 0, 0, 0, 42, 0, 1, 5, b'l', b'o', b'g', b'i', b'n']), ErrorCode::Malformed),
        (frame(&[1, 8, 0, 0, 0, 42, 0, 0, 5, b'l', b'o', b'g', b'i', b'n', 2]), ErrorCode::Malformed),
        (frame(&[1, 8, 0, 0, 0, 42, 0, 0, 0, b'x']), ErrorCode::UnknownPolicy),
        (frame(&[1, 8, 0, 0, 0, 42, 0, 0, 200, b'x']), ErrorCode::UnknownPolicy),
        (frame(&[1, 8, 0, 0, 0, 42, 0, 0, 9, b'l', b'o', b'g', b'i', b'n']), ErrorCode::Malformed),
        // A scoped key's length byte, a control byte, a quote: no name has them.
        (frame(&[1, 8, 0, 0, 0, 42, 0, 0, 6, 5, b'l', b'o', b'g', b'i', b'n']), ErrorCode::UnknownPolicy),
        (frame(&[1, 8, 0, 0, 0, 42, 0, 0, 6, b'l', b'o', b'g', b'i', b'n', 0x1f]), ErrorCode::UnknownPolicy),
        (frame(&[1, 8, 0, 0, 0, 42, 0, 0, 6, b'l', b'o', b'g', b'i', b'n', b'"']), ErrorCode::UnknownPolicy),
    ];
    for (bytes, want) in &cases {
        c.send_raw(bytes).await.unwrap();
        let r = c.read_response().await.unwrap();
        assert_eq!((r.id, r.op, r.decision, r.error), (42, OP_DESCRIBE_POLICY, Decision::Error, *want), "{bytes:02x?}: {}", r.message);
    }
    // In sync after all of them, and the daemon logged none of it.
    assert_eq!(describe(&mut c, "login").await.map(|p| p.limit), Some(100));
    assert!(!d.log().contains("login\u{1f}") && !d.log().contains("panic"), "{}", d.log());
}

fn gateway(socket: &std::path::Path, limiters: &str, locations: &str) -> Nginx {
    common::ops::gateway(socket, &format!("init_worker_by_lua_block {{\n limiters = require(\"resty.ratelimitd.limiters\").build{{\n{limiters}\n }}\n}}"), locations)
}

fn location(path: &str, limiter: &str) -> String {
    format!("location {path} {{ access_by_lua_block {{ limiters.{limiter}:limit(ngx.var.http_x_tenant_id or \"-\") }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n")
}

fn status(url: &str, tenant: &str) -> u16 {
    common::http::get(&agent(), url, &[("X-Tenant-Id", tenant)]).status
}

#[test]
fn nginx_says_each_unknown_policy_name_once_and_a_policy_limiter_falls_back_with_the_policys_window_and_quota() {
    let redis = RedisServer::start_unix();
    let mut d = daemon(&redis);
    let limiters = r#"
        login = "login",
        typo = "logni",
        pay = { policy = "pay", on_error = "local" },
        paced = { policy = "search.v2", window_ms = 1000, on_error = "open" },
        open_by_default = { limit = 1000, window_ms = 1000 },
    "#;
    let locations = [location("/login", "login"), location("/typo", "typo"), location("/pay", "pay"), location("/paced", "paced")].concat();
    let nginx = gateway(&d.socket, limiters, &locations);

    // Both workers describe their limiters' policies right after they start.
    wait_until("both workers described pay", Duration::from_secs(10), || nginx.error_log().matches("policy \"pay\" described by the daemon").count() == 2);
    let log = nginx.error_log();
    let unknown: Vec<&str> = log.lines().filter(|l| l.contains("logni")).collect();
    assert_eq!(unknown.len(), 1, "one line per unknown name, not one per worker: {unknown:?}");
    assert!(unknown[0].contains("[error]") && unknown[0].contains("policy \"logni\" is not in the daemon's configuration"), "{}", unknown[0]);
    assert!(!log.lines().any(|l| l.contains("\"login\" is not")), "{log}");
    // The policy's window and quota, not repeated in nginx; its on_error (the location chose local).
    assert!(log.contains("policy \"pay\" described by the daemon: rate log limit=1000 window_ms=60000 on_error=local local_limit=2; this limiter's fallback: on_error=local window_ms=60000 local_limit=2"), "{log}");
    // A window given in nginx that is not the policy's: said, once.
    let mismatch: Vec<&str> = log.lines().filter(|l| l.contains("window_ms = 1000 in nginx differs from the policy's window of 10000")).collect();
    assert_eq!(mismatch.len(), 1, "{log}");
    // Limiters without on_error (nor one in the policy): open, said once each.
    assert_eq!(log.lines().filter(|l| l.contains("[warn]") && l.contains("inline limiter has no on_error")).count(), 1, "{log}");
    assert_eq!(log.lines().filter(|l| l.contains("[warn]") && l.contains("policy \"login\" limiter has no on_error")).count(), 1, "{log}");
    assert!(!log.contains("policy \"pay\" limiter has no on_error"), "pay's policy chose local: {log}");

    assert_eq!(status(&nginx.url("/login"), "t1"), 200);
    assert_eq!(status(&nginx.url("/pay"), "t1"), 200);
    // The unknown name: the location's on_error (open by default), and the line names the policy.
    assert_eq!(status(&nginx.url("/typo"), "t1"), 200);
    wait_until("unknown_policy line", Duration::from_secs(5), || nginx.error_log().contains("unknown_policy policy=logni key=t1"));

    // The daemon gone: /pay counts in this host's own window, with the
    // policy's local_limit (2) over the policy's window (60 s: no refill
    // during the test), though nginx named neither.
    d.terminate();
    let got: Vec<u16> = (0..4).map(|_| status(&nginx.url("/pay"), "t2")).collect();
    assert_eq!(got, [200, 200, 429, 429]);
    let log = nginx.error_log();
    assert!(log.contains("local_fallback policy=pay key=t2"), "the failure line names the policy: {log}");
    assert!(!log.contains("attempt to"), "{log}");
}

#[test]
fn a_multi_policy_limiter_falls_back_with_each_policys_own_window_and_quota_from_the_daemon() {
    let redis = RedisServer::start_unix();
    let mut d = daemon(&redis);
    // Neither window_ms nor local_limit in nginx; `given` repeats a window that is not pay's.
    let limiters = r#"
        both = { policies = { "pay", "basket" }, on_error = "local" },
        given = { policies = { "pay", "basket" }, on_error = "local", window_ms = 1000 },
    "#;
    let locations = "location /both { access_by_lua_block { limiters.both:limit({ ngx.var.arg_p, ngx.var.arg_b }) } content_by_lua_block { ngx.say(\"ok\") } }\n";
    let nginx = gateway(&d.socket, limiters, locations);
    wait_until("both workers described pay and basket", Duration::from_secs(10), || nginx.error_log().matches("policies \"pay,basket\" described by the daemon").count() == 4);
    let log = nginx.error_log();
    assert!(log.contains("policies \"pay,basket\" described by the daemon; this limiter's fallback: on_error=local window_ms=60000,30000 local_limit=2,3"), "{log}");
    assert!(log.contains("window_ms=1000,1000 local_limit=2,3"), "nginx's window wins for every policy: {log}");
    // The mismatch: once per policy whose window differs, not once per worker.
    for (name, window) in [("pay", 60000), ("basket", 30000)] {
        let line = format!("policy \"{name}\": window_ms = 1000 in nginx differs from the policy's window of {window} ms");
        assert_eq!(log.matches(&line).count(), 1, "{line}: {log}");
    }
    // Through the daemon: the frame carries a valid local quota.
    let url = |p: &str, b: &str| format!("{}?p={p}&b={b}", nginx.url("/both"));
    assert_eq!(status(&url("warm", "warm"), "-"), 200, "{}", nginx.error_log());

    // The daemon gone: each policy counts in this host's own window with
    // its own quota (pay 2, basket 3), all or nothing.
    d.terminate();
    let got: Vec<u16> = [("x", "y"), ("x", "y"), ("x", "z"), ("w", "y"), ("v", "y")].iter().map(|(p, b)| status(&url(p, b), "-")).collect();
    assert_eq!(got, [200, 200, 429, 200, 429], "pay's key x refused at its 3rd, basket's key y at its 4th");
    let log = nginx.error_log();
    assert!(log.contains("local_fallback policy=pay,basket key=x,y"), "{log}");
    assert!(!log.contains("attempt to") && !log.contains("fail_open"), "{log}");
}
