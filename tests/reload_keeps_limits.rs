//! A reload keeps the limit (issue 33): it never silently restarts a
//! policy's counts, and never makes a policy unusable by the nginx
//! limiters that described it. Real processes: the daemon on redis-server
//! and on its in-memory backend; nginx (Lua module) for the described uses.
//! docs/CONFIG.md ("What a reload does to the counts") and
//! docs/OPERATIONS.md ("A reload that breaks how nginx uses a policy").

mod common;

use std::time::Duration;

use common::http::agent;
use common::ops::{metrics, sample, socket_access};
use common::{wait_until, Daemon, Nginx, RedisServer};
use nix::sys::signal::Signal;
use ratelimitd::protocol::{encode_describe_uses, Decision, ErrorCode, FailPolicy, PolicyCheckArgs, PolicyUse, PolicyUses};

/// Two tests of one body, on one Redis and in memory, named as given.
macro_rules! on_redis_and_in_memory {
    ($body:ident: $on_redis:ident, $in_memory:ident) => {
        #[test]
        fn $on_redis() {
            $body(Some(&RedisServer::start_unix()));
        }

        #[test]
        fn $in_memory() {
            $body(None);
        }
    };
}

/// `five`: 5 a minute, the log; `quota`: 5 a calendar month (fixed, UTC);
/// `idle`: never asked.
fn counted() -> String {
    common::rate_policies(&[("idle", 5, "30s"), ("five", 5, "60s")]) + &common::rate_policy("quota", 5, "month", &[r#"algorithm = "fixed""#, r#"utc_offset = "+00:00""#])
}

/// A daemon with metrics on Redis (`Some`) or in memory, with `policies`.
fn daemon(redis: Option<&RedisServer>, policies: &str) -> Daemon {
    let backend = redis.map_or(String::new(), |r| format!("[redis]\nurl = \"{}\"\ntimeout_ms = 500\n", r.url()));
    Daemon::start_config_with_metrics(&format!("{}\n{backend}{policies}", socket_access()))
}

/// `n` CHECK_POLICY requests of `policy` for `key`: how many were admitted.
fn admit(d: &Daemon, policy: &str, key: &str, n: usize) -> usize {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = d.client().await;
        let mut admitted = 0;
        for _ in 0..n {
            let r = c.check_policy(&PolicyCheckArgs { policy: policy.as_bytes(), key: key.as_bytes(), cost: 1, on_error: FailPolicy::Closed, local_limit: 0 }).await.unwrap();
            assert_ne!(r.decision, Decision::Error, "{}", r.message);
            admitted += usize::from(r.decision == Decision::Allowed);
        }
        admitted
    })
}

/// Sends `sig` and waits until the log has `n` lines containing `what`.
fn reload(d: &Daemon, sig: Signal, what: &str, n: usize) {
    d.signal(sig);
    wait_until(what, Duration::from_secs(10), || d.log().matches(what).count() >= n);
}

fn line_with<'a>(log: &'a str, what: &str) -> &'a str {
    log.lines().rev().find(|l| l.contains(what)).unwrap_or_else(|| panic!("no line with {what:?} in\n{log}"))
}

/// limit 5, 5 admitted; a reload that would change the key the counts live
/// under (window 1m -> 2m, log -> ring, a month quota's utc_offset) is
/// refused and the sixth request is still refused; a limit change carries
/// the counts over (exactly one more admitted at limit 6); SIGUSR1 forces a
/// window change, which restarts the counts as the warning says.
fn a_reload_never_silently_restarts_counts(redis: Option<&RedisServer>) {
    let d = daemon(redis, &counted());
    assert_eq!(admit(&d, "five", "t1", 6), 5);
    assert_eq!(admit(&d, "quota", "t1", 6), 5);
    let original = d.config_text();

    let mut refused = 0;
    for (change, edited) in [
        ("window 60000 ms -> 120000 ms", original.replacen("window = \"60s\"", "window = \"2m\"", 1)),
        ("algorithm log -> ring", original.replacen("window = \"60s\"\n", "window = \"60s\"\nalgorithm = \"ring\"\n", 1)),
        ("utc_offset", original.replace("utc_offset = \"+00:00\"", "utc_offset = \"+02:00\"")),
    ] {
        d.rewrite_config(&edited);
        refused += 1;
        reload(&d, Signal::SIGHUP, "configuration reload refused", refused);
        let log = d.log();
        let line = line_with(&log, "configuration reload refused");
        assert!(line.contains("restart") && line.contains(change) && line.contains("SIGUSR1"), "{change}: {line}");
        assert!(!log.contains("configuration reloaded"), "{change}: {log}");
        assert_eq!(admit(&d, "five", "t1", 1), 0, "{change}: the counts of the running policy serve on");
        assert_eq!(admit(&d, "quota", "t1", 1), 0, "{change}: the month's budget serves on");
    }
    let text = metrics(&d);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_refused_total{reason=\"counts_restart\"} "), 3.0);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_total "), 0.0);

    // The key does not change with the limit: the 5 admissions carry over.
    d.rewrite_config(&original.replacen("limit = 5\nwindow = \"60s\"", "limit = 6\nwindow = \"60s\"", 1));
    reload(&d, Signal::SIGHUP, "configuration reloaded", 1);
    assert_eq!(admit(&d, "five", "t1", 3), 1, "limit 6 after 5 admissions: one more");

    // A policy this daemon never counted: in memory it has no counts, and
    // its window changes at once; Redis may hold counts of other daemons,
    // or of this one before its start: refused there too.
    d.rewrite_config(&original.replacen("window = \"30s\"", "window = \"45s\"", 1).replacen("limit = 5\nwindow = \"60s\"", "limit = 6\nwindow = \"60s\"", 1));
    if redis.is_some() {
        reload(&d, Signal::SIGHUP, "configuration reload refused", refused + 1);
        let log = d.log();
        let line = line_with(&log, "configuration reload refused");
        assert!(line.contains("idle (window 30000 ms -> 45000 ms; counted in Redis"), "{line}");
        assert_eq!(sample(&metrics(&d), "ratelimitd_config_reloads_refused_total{reason=\"counts_restart\"} "), 4.0);
    } else {
        reload(&d, Signal::SIGHUP, "configuration reloaded", 2);
    }
    let applied = d.log().matches("configuration reloaded").count();

    // Forced: the warning names the restart, and the new window starts from zero.
    d.rewrite_config(&original.replacen("window = \"60s\"", "window = \"2m\"", 1));
    reload(&d, Signal::SIGUSR1, "configuration reloaded", applied + 1);
    let log = d.log();
    let warning = line_with(&log, "forced reload restarts the counts");
    assert!(warning.contains("five (window 60000 ms -> 120000 ms"), "{warning}");
    assert_eq!(admit(&d, "five", "t1", 6), 5, "forced: the 2m window counts from zero, as the warning said");
}

on_redis_and_in_memory! { a_reload_never_silently_restarts_counts: a_reload_never_silently_restarts_counts_on_redis, a_reload_never_silently_restarts_counts_in_memory }

/// `login` and `per_ip`, both the exact log; `plain` is checked alone.
fn used() -> String {
    common::rate_policies(&[("login", 1000, "60s"), ("per_ip", 1000, "60s"), ("plain", 1000, "60s")])
}

const LIMITERS: &str = r#"
init_worker_by_lua_block {
    limiters = require("resty.ratelimitd.limiters").build{
        both = { policies = { "login", "per_ip" }, on_error = "open" },
        refund = { policy = "login", refundable = true, on_error = "open" },
        plain = { policy = "plain", on_error = "open" },
    }
}
"#;

const LOCATIONS: &str = r#"
    location /both { access_by_lua_block { limiters.both:limit({ "u1", ngx.var.remote_addr }) } content_by_lua_block { ngx.say("ok") } }
    location /refund { access_by_lua_block { limiters.refund:limit("u1") } content_by_lua_block { ngx.say("ok") } }
    location /plain { access_by_lua_block { limiters.plain:limit("u1") } content_by_lua_block { ngx.say("ok") } }
"#;

fn statuses(nginx: &Nginx, path: &str, n: usize) -> Vec<u16> {
    let a = agent();
    (0..n).map(|_| common::http::get(&a, &nginx.url(path), &[]).status).collect()
}

/// nginx describes `login` as an item of a multi-item limiter and of a
/// refundable one: a reload giving `login` a penalty box (which those
/// checks cannot take) is refused, with the policy, the use and why in the
/// log and the metric; the locations keep answering 200. The same change
/// to `plain`, checked alone, is applied. SIGUSR1 forces it, and the
/// locations get what the warning said (UNSUPPORTED_COMBINATION: 500).
fn a_reload_breaking_a_described_use_is_refused(redis: Option<&RedisServer>) {
    let d = daemon(redis, &used());
    let nginx = common::ops::gateway(&d.socket, LIMITERS, LOCATIONS);
    wait_until("nginx described its policies", Duration::from_secs(10), || {
        let log = nginx.error_log();
        log.contains("policies \"login,per_ip\" described by the daemon") && log.contains("policies \"login\" described by the daemon") && log.contains("policy \"plain\" described by the daemon")
    });
    for path in ["/both", "/refund", "/plain"] {
        assert_eq!(statuses(&nginx, path, 2), [200, 200], "{path}: {}", nginx.error_log());
    }
    let original = d.config_text();
    let penalized = |name: &str| original.replacen(&format!("name = \"{name}\"\nlimit = 1000\nwindow = \"60s\"\n"), &format!("name = \"{name}\"\nlimit = 1000\nwindow = \"60s\"\npenalty = {{ after = 3, within = \"10s\", ban = \"3s\" }}\n"), 1);

    d.rewrite_config(&penalized("login"));
    reload(&d, Signal::SIGHUP, "configuration reload refused", 1);
    let log = d.log();
    let line = line_with(&log, "configuration reload refused");
    for want in ["login", "multi-item", "refundable", "penalty box", "SIGUSR1"] {
        assert!(line.contains(want), "{want}: {line}");
    }
    assert!(!log.contains("configuration reloaded"), "{log}");
    for path in ["/both", "/refund", "/plain"] {
        assert_eq!(statuses(&nginx, path, 8), [200; 8], "{path} after the refused reload: {}", nginx.error_log());
    }
    let text = metrics(&d);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_refused_total{reason=\"use_unsupported\"} "), 1.0);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_total "), 0.0);

    // The log -> gcra: both the keys and the uses; one line and one reason each.
    d.rewrite_config(&original.replacen("name = \"login\"\nlimit = 1000\nwindow = \"60s\"\n", "name = \"login\"\nlimit = 1000\nwindow = \"60s\"\nalgorithm = \"gcra\"\n", 1));
    reload(&d, Signal::SIGHUP, "configuration reload refused", 3);
    let log = d.log();
    assert!(log.contains("login: multi-item check (UNSUPPORTED_COMBINATION: policy 'login' (algorithm gcra): several policies in one request, refundable checks and refunds need algorithm log)"), "{log}");
    assert!(log.contains("login (algorithm log -> gcra; last request"), "{log}");
    for path in ["/both", "/refund"] {
        assert_eq!(statuses(&nginx, path, 4), [200; 4], "{path} after the refused reload: {}", nginx.error_log());
    }
    let text = metrics(&d);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_refused_total{reason=\"use_unsupported\"} "), 2.0);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_refused_total{reason=\"counts_restart\"} "), 1.0);

    // `plain` is only checked alone: a penalty box is no problem there.
    d.rewrite_config(&penalized("plain"));
    reload(&d, Signal::SIGHUP, "configuration reloaded", 1);
    assert_eq!(statuses(&nginx, "/plain", 2), [200, 200]);

    // Forced: applied, with the warning; the locations get UNSUPPORTED_COMBINATION.
    d.rewrite_config(&penalized("login"));
    reload(&d, Signal::SIGUSR1, "configuration reloaded", 2);
    let log = d.log();
    let warning = line_with(&log, "forced reload makes policies unusable");
    assert!(warning.contains("login") && warning.contains("multi-item"), "{warning}");
    assert_eq!(statuses(&nginx, "/both", 2), [500, 500], "as the warning said: {}", nginx.error_log());
}

on_redis_and_in_memory! { a_reload_breaking_a_described_use_is_refused: a_reload_breaking_a_use_nginx_described_is_refused_on_redis, a_reload_breaking_a_use_nginx_described_is_refused_in_memory }

/// `check-config --against RUNNING`: without a daemon, every change a
/// reload from RUNNING would refuse for a policy in use, one line each,
/// exit 1; a change that keeps counts and uses (a limit), exit 0.
#[test]
fn check_config_against_the_running_file_lists_what_a_reload_would_break() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, policies: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("[server]\nlisten = \"/tmp/never-bound.sock\"\n{policies}")).unwrap();
        path
    };
    let running = write("running.toml", &format!("{}{}", counted(), used().replace("name = \"plain\"", "name = \"gone\"")));
    let edited = counted().replacen("window = \"60s\"", "window = \"2m\"", 1).replace("utc_offset = \"+00:00\"", "utc_offset = \"+02:00\"")
        + &used().replacen("name = \"login\"\nlimit = 1000\nwindow = \"60s\"\n", "name = \"login\"\nlimit = 1000\nwindow = \"60s\"\npenalty = { after = 3, within = \"10s\", ban = \"3s\" }\n", 1).replace("name = \"plain\"\nlimit = 1000", "name = \"plain\"\nlimit = 5");
    let new = write("new.toml", &edited);
    let run = |config: &std::path::Path, against: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(["check-config", "--config"]).arg(config).arg("--against").arg(against).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    let (code, said) = run(&new, &running);
    assert_eq!(code, Some(1), "{said}");
    for want in [
        "policy \"five\": counts restart from zero (window 60000 ms -> 120000 ms",
        "policy \"quota\": counts restart from zero (window month at utc_offset +00:00 -> month at utc_offset +02:00",
        "policy \"login\": a multi-item check would be refused: UNSUPPORTED_COMBINATION: policy 'login' (algorithm log): a penalty box",
        "policy \"login\": a refundable check would be refused",
        "policy \"gone\": removed or renamed",
        "refuses this reload unless forced with SIGUSR1",
    ] {
        assert!(said.contains(want), "{want}: {said}");
    }
    assert!(!said.contains("policy \"per_ip\"") && !said.contains("policy \"plain\""), "unchanged, or a new limit only: {said}");
    let limit_only = write("limit.toml", &format!("{}{}", counted(), used().replace("limit = 1000", "limit = 7")).replace("name = \"plain\"", "name = \"gone\""));
    let (code, said) = run(&limit_only, &running);
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("keeps every policy's counts and uses"), "{said}");
}

/// A use is checked with the request path's own rule: a client of an
/// earlier release (no uses byte) describes a single check, which a rate
/// policy made a concurrency one would refuse (WRONG_POLICY_KIND); a
/// concurrency acquire is kept the same way; a use the running policy
/// refuses already (a multi-item check of a gcra policy) is not the
/// reload's doing: that policy's algorithm change is refused for its
/// counts only.
#[test]
fn each_described_use_is_judged_by_the_request_paths_rule() {
    let policies = "[[policy]]\nname = \"plain\"\nlimit = 10\nwindow = \"60s\"\n\n[[policy]]\nname = \"uploads\"\nalgorithm = \"concurrency\"\nlimit = 3\nlease = \"30s\"\n\n[[policy]]\nname = \"g\"\nlimit = 10\nwindow = \"60s\"\nalgorithm = \"gcra\"\n";
    let d = daemon(None, policies);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = d.client().await;
        // An earlier client's frame: no uses byte.
        assert_eq!(c.describe(b"plain").await.unwrap().error, ErrorCode::None);
        for (name, u) in [("uploads", PolicyUse::Acquire), ("g", PolicyUse::Multi)] {
            let mut frame = bytes::BytesMut::new();
            encode_describe_uses(9, name.as_bytes(), PolicyUses::default().with(u), &mut frame);
            c.send_raw(&frame).await.unwrap();
            assert_eq!(c.read_response().await.unwrap().error, ErrorCode::None);
        }
    });
    let swapped = d
        .config_text()
        .replace("name = \"plain\"\nlimit = 10\nwindow = \"60s\"\n", "name = \"plain\"\nalgorithm = \"concurrency\"\nlimit = 10\nlease = \"60s\"\n")
        .replace("name = \"uploads\"\nalgorithm = \"concurrency\"\nlimit = 3\nlease = \"30s\"\n", "name = \"uploads\"\nlimit = 3\nwindow = \"30s\"\n")
        .replace("algorithm = \"gcra\"", "algorithm = \"sliding_counter\"");
    d.rewrite_config(&swapped);
    reload(&d, Signal::SIGHUP, "configuration reload refused: policies would refuse", 1);
    let log = d.log();
    let line = line_with(&log, "configuration reload refused: policies would refuse");
    assert!(line.contains("plain: single check (WRONG_POLICY_KIND: policy 'plain' is a concurrency policy"), "{line}");
    assert!(line.contains("uploads: concurrency acquire (WRONG_POLICY_KIND: policy 'uploads' is a rate policy"), "{line}");
    assert!(!line.contains("g:"), "gcra never took a multi-item check: {line}");
    let counts = line_with(&log, "configuration reload refused: it changes the window");
    assert!(counts.contains("g (algorithm gcra -> sliding_counter; no request yet, named by nginx: described"), "{counts}");
    assert!(counts.contains("plain (kind rate -> concurrency") && counts.contains("uploads (kind concurrency -> rate"), "{counts}");
    reload(&d, Signal::SIGUSR1, "configuration reloaded", 1);
    assert!(d.log().contains("forced reload makes policies unusable by the nginx limiters that described them"), "{}", d.log());
}
