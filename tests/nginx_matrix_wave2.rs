//! The feature matrix through real nginx, ratelimitd and redis-server, for
//! what came this session: a `share_dict` limiter (on an enforced and on a
//! shadow policy), a settle limiter over two policies (with and without a
//! shadow third), a penalty-box policy (Retry-After is the ban's end), a
//! policy limiter without `window_ms` (its window and local quota from
//! DESCRIBE_POLICY), and a live override set through the admin API; crossed
//! with every header style and redirect kind (none, `error_page` to a named
//! location, `try_files`, `ngx.exec`), and with every fail policy with the
//! daemon or Redis down. Asserted from the headers, `$ratelimitd_status`
//! and Redis's record. The combinations that cannot work are refused the
//! same way by `check-config --nginx`, by the Lua `new()` where it can see
//! them, and by the daemon (UNSUPPORTED_COMBINATION: the location's 500).

mod common;

use std::fmt::Write as _;
use std::time::Duration;

use common::http::{agent, get, Reply};
use common::nginx_cases::{self, recorded, REDIRECTS};
use common::{wait_until, Daemon, Nginx, RedisServer};
use ratelimitd::admin_api::client::Reply as AdminReply;

/// Every enforced policy of a case admits 2 per minute.
const LIMIT: u64 = 2;

/// Every policy has a local quota of 2 (the daemon's with Redis down, and
/// what a policy limiter without window_ms takes from DESCRIBE_POLICY).
const POLICIES: &str = "\
[[policy]]\nname = \"shared\"\nlimit = 2\nwindow = \"60s\"\non_error = \"local\"\nlocal_limit = 2\n\
[[policy]]\nname = \"shared_shadow\"\nlimit = 2\nwindow = \"60s\"\nshadow = true\n\
[[policy]]\nname = \"tok_min\"\nalgorithm = \"fixed\"\nlimit = 2\nwindow = \"60s\"\non_error = \"local\"\nlocal_limit = 2\n\
[[policy]]\nname = \"tok_day\"\nalgorithm = \"fixed\"\nlimit = 10\nwindow = \"1d\"\non_error = \"local\"\nlocal_limit = 10\n\
[[policy]]\nname = \"tok_next\"\nalgorithm = \"fixed\"\nlimit = 1\nwindow = \"60s\"\nshadow = true\n\
[[policy]]\nname = \"pen\"\nlimit = 2\nwindow = \"60s\"\non_error = \"local\"\nlocal_limit = 2\npenalty = { after = 1, within = \"60s\", ban = \"90s\" }\n\
[[policy]]\nname = \"described\"\nlimit = 2\nwindow = \"60s\"\non_error = \"local\"\nlocal_limit = 2\n\
[[policy]]\nname = \"ov\"\nlimit = 5\nwindow = \"60s\"\non_error = \"local\"\nlocal_limit = 2\n";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// `share_dict` on the enforced policy `shared`.
    Shared,
    /// `share_dict` on the shadow policy `shared_shadow`: never refuses,
    /// never shows.
    SharedShadow,
    /// A reserve of 1 in `tok_min` and `tok_day` (and with `true` the
    /// shadow `tok_next`), settled to 1 in the server's log phase through
    /// `decision()`.
    Settle(bool),
    /// The penalty-box policy `pen`: its first refusal bans for 90 s.
    Penalty,
    /// A policy limiter without window_ms.
    Described,
    /// The policy `ov` (limit 5 in the file) with a live override of 2 for
    /// the case's key, set through the admin API.
    Override,
}

const KINDS: [Kind; 7] = [Kind::Shared, Kind::SharedShadow, Kind::Settle(false), Kind::Settle(true), Kind::Penalty, Kind::Described, Kind::Override];

impl Kind {
    fn policy(self) -> &'static str {
        match self {
            Kind::Shared => "shared",
            Kind::SharedShadow => "shared_shadow",
            Kind::Settle(_) => "tok_min",
            Kind::Penalty => "pen",
            Kind::Described => "described",
            Kind::Override => "ov",
        }
    }
    /// The Lua expression of the limiter, with `extra` options.
    fn limiter(self, extra: &str) -> String {
        match self {
            Kind::Shared | Kind::SharedShadow => format!("ratelimitd.new{{ policy = \"{}\", share_dict = \"ratelimitd\"{extra} }}", self.policy()),
            Kind::Settle(false) => format!("ratelimitd.new{{ policies = {{ \"tok_min\", \"tok_day\" }}, settle = true{extra} }}"),
            Kind::Settle(true) => format!("ratelimitd.new{{ policies = {{ \"tok_min\", \"tok_next\", \"tok_day\" }}, shadow = {{ \"tok_next\" }}, settle = true{extra} }}"),
            _ => format!("ratelimitd.new{{ policy = \"{}\"{extra} }}", self.policy()),
        }
    }
    /// The Lua call in the access phase for `key`.
    fn call(self, lim: &str, key: &str) -> String {
        match self {
            Kind::Settle(false) => format!("{lim}:limit({{ \"{key}\", \"{key}\" }}, 1)"),
            Kind::Settle(true) => format!("{lim}:limit({{ \"{key}\", \"{key}\", \"{key}\" }}, 1)"),
            _ => format!("{lim}:limit(\"{key}\")"),
        }
    }
    /// Whether Redis keeps one sorted-set member per admission (the log).
    fn logged(self) -> bool {
        !matches!(self, Kind::Settle(_))
    }
}

type Case = nginx_cases::Case<Kind>;

impl nginx_cases::Case<Kind> {
    fn key(&self) -> String {
        format!("w2case{}", self.id)
    }
}

fn cases() -> Vec<Case> {
    nginx_cases::cases(&KINDS)
}

/// The http {} body: `limiters` (Lua statements filling `lims`) and the
/// locations; the server's log phase settles every reserve to 1, found by
/// `decision()` wherever the request ended.
fn site(limiters: &str, locations: &str) -> String {
    format!(
        "map \"\" $ratelimitd_status {{ default \"-\"; }}\n\
         init_worker_by_lua_block {{\n    local ratelimitd = require \"resty.ratelimitd\"\n    ratelimitd.configure{{ log_var = \"ratelimitd_status\" }}\n    lims = {{}}\n{limiters}    ratelimitd.verify_policies()\n}}\n\
         server {{\n    listen 127.0.0.1:{{PORT}};\n    root /nonexistent;\n    log_not_found off;\n\
         \x20   add_header X-Ratelimitd-Status $ratelimitd_status always;\n\
         \x20   log_by_lua_block {{\n        local ratelimitd = require \"resty.ratelimitd\"\n        local res = ratelimitd.decision()\n\
         \x20       if res and res.handle then ratelimitd.settle(res.handle, 1) end\n    }}\n\
         \x20   location @ok {{ content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         \x20   location = /ok {{ content_by_lua_block {{ ngx.say(\"ok\") }} }}\n{locations}}}\n"
    )
}

fn daemon_toml(redis: &RedisServer, admin: &std::path::Path, redis_timeout_ms: u32) -> String {
    let server = common::ops::socket_access();
    format!(
        "{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = {redis_timeout_ms}\nquota_leases = true\n[admin]\nlisten = \"{}\"\noverrides_refresh = \"50ms\"\n{POLICIES}",
        redis.url(),
        admin.join("admin.sock").display()
    )
}

fn start_nginx(d: &Daemon, body: &str) -> Nginx {
    let snippet = common::ops::snippet(&d.socket);
    Nginx::start(&format!("{snippet}\n{body}"))
}

fn admin(dir: &std::path::Path, method: &str, path: &str, body: Option<serde_json::Value>) -> AdminReply {
    common::admin::admin(&dir.join("admin.sock"), method, path, body)
}

/// Sets a live override of 2 for (ov, key) and waits until the daemon
/// applies it.
fn override_to_two(dir: &std::path::Path, key: &str) {
    let r = admin(dir, "PUT", "/v1/overrides", Some(serde_json::json!({ "policy": "ov", "key": key, "limit": LIMIT, "ttl": "1h" })));
    assert!(r.status / 100 == 2, "PUT override: {} {:?}", r.status, r.body);
    wait_until(&format!("the override of {key} applied"), Duration::from_secs(5), || {
        admin(dir, "GET", &format!("/v1/keys?policy=ov&key={key}"), None).body["limit_from"] == serde_json::json!("api_override")
    });
}

/// The units a fixed window of `policy` holds for `key` in Redis (the
/// counter's second field; its reserves are kept apart, under `:settle:`).
fn fixed_units(redis: &RedisServer, policy: &str, key: &str) -> u64 {
    let mut conn = redis.conn();
    let pattern = format!("ratelimitd:{{{}{policy}{key}}}:*", policy.len() as u8 as char);
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg(pattern.as_bytes()).query(&mut conn).unwrap();
    let mut units = 0;
    for k in keys.iter().filter(|k| !k.windows(8).any(|w| w == b":settle:")) {
        if redis::cmd("TYPE").arg(k.as_slice()).query::<String>(&mut conn).unwrap() == "string" {
            let v: String = redis::cmd("GET").arg(k.as_slice()).query(&mut conn).unwrap();
            units += v.split(' ').nth(1).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    units
}

/// The quota fields a reply shows in `style`: (limit, remaining, reset or t)
/// of policy `name`; None when it shows none.
fn quota(r: &Reply, style: &str, name: &str) -> Option<(u64, u64, u64)> {
    match style {
        "draft" => {
            let policy = r.header("RateLimit-Policy");
            let member = r.header("RateLimit").split(", ").find(|m| m.starts_with(&format!("\"{name}\";")))?.to_string();
            let q = policy.split(", ").find(|m| m.starts_with(&format!("\"{name}\";")))?.split(";q=").nth(1)?.split(';').next()?.parse().ok()?;
            let rem = member.split(";r=").nth(1)?.split(';').next()?.parse().ok()?;
            let t = member.rsplit(";t=").next()?.parse().ok()?;
            Some((q, rem, t))
        }
        style => {
            let prefix = if style == "x" { "X-RateLimit" } else { "RateLimit" };
            Some((r.num(&format!("{prefix}-Limit"))?, r.num(&format!("{prefix}-Remaining"))?, r.num(&format!("{prefix}-Reset"))?))
        }
    }
}

/// Any quota field at all in the reply.
fn shows_quota(r: &Reply) -> bool {
    r.headers.keys().any(|k| k.as_str().contains("ratelimit") && k.as_str() != "x-ratelimitd-status")
}

/// What case `c`'s request `i` (0-based) must get with the daemon and
/// Redis up.
fn check(c: &Case, i: u64, r: &Reply, failures: &mut Vec<String>) {
    let mut fail = |what: String| failures.push(format!("case {} {:?} {} {:?} request {}: {what}; headers {:?}", c.id, c.kind, c.style, c.redirect, i + 1, r.headers));
    if c.kind == Kind::SharedShadow {
        // A shadow policy never refuses and never shows (S3).
        let want = if i < LIMIT { "PASSED" } else { "PASSED_SHADOW" };
        if r.status != 200 || r.header("X-Ratelimitd-Status") != want || shows_quota(r) {
            fail(format!("status {}, {:?} (want 200, {want}, no quota fields)", r.status, r.header("X-Ratelimitd-Status")));
        }
        return;
    }
    let admitted = i < LIMIT;
    let status = if admitted { 200 } else { 429 };
    let shadow_refused = c.kind == Kind::Settle(true) && i >= 1;
    let outcome = match (admitted, shadow_refused) {
        (false, _) => "REJECTED",
        (true, true) => "PASSED_SHADOW",
        (true, false) => "PASSED",
    };
    if r.status != status || r.header("X-Ratelimitd-Status") != outcome {
        return fail(format!("status {} {:?} (want {status} {outcome})", r.status, r.header("X-Ratelimitd-Status")));
    }
    if r.header("RateLimit-Policy").contains("tok_next") || r.header("RateLimit").contains("tok_next") {
        fail("the shadow policy listed".into());
    }
    let name = c.kind.policy();
    let Some((limit, remaining, reset)) = quota(r, c.style, name) else { return fail(format!("no quota fields of {name}")) };
    if (limit, remaining) != (LIMIT, LIMIT - (i + 1).min(LIMIT)) {
        fail(format!("limit {limit}, remaining {remaining} (want {LIMIT}, {})", LIMIT - (i + 1).min(LIMIT)));
    }
    if admitted {
        if !(1..=60).contains(&reset) {
            fail(format!("reset {reset} (want 1..=60)"));
        }
        return;
    }
    // A refusal: Retry-After, the draft's t the same; the penalty box's is
    // the ban's end (90 s), past anything the 60 s window could say.
    let retry = r.num("Retry-After");
    let want = if c.kind == Kind::Penalty { 61..=90 } else { 1..=60 };
    match retry {
        Some(s) if want.contains(&s) => {}
        other => fail(format!("Retry-After {other:?} (want {want:?})")),
    }
    if c.style == "draft" && Some(reset) != retry {
        fail(format!("t={reset} is not Retry-After"));
    }
}

fn errors(nginx: &Nginx) -> Vec<String> {
    nginx.error_log().lines().filter(|l| l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]")).map(str::to_string).collect()
}

#[test]
fn every_new_limiter_kind_header_style_and_redirect_through_nginx() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_config(&daemon_toml(&redis, dir.path(), 500));
    let cases = cases();
    let mut limiters = String::new();
    let mut locations = String::new();
    for c in &cases {
        let _ = writeln!(limiters, "    lims[{}] = assert({})", c.id, c.kind.limiter(&format!(", header_style = \"{}\"", c.style)));
        let _ = writeln!(locations, "    location = /c/{} {{\n        access_by_lua_block {{ {} }}\n        {}\n    }}", c.id, c.kind.call(&format!("lims[{}]", c.id), &c.key()), c.redirect.then());
    }
    let nginx = start_nginx(&d, &site(&limiters, &locations));
    let agent = agent();
    let mut failures = Vec::new();
    for c in &cases {
        if c.kind == Kind::Override {
            override_to_two(dir.path(), &c.key());
        }
        for i in 0..=LIMIT {
            let reply = get(&agent, &nginx.url(&format!("/c/{}", c.id)), &[]);
            check(c, i, &reply, &mut failures);
        }
        // Redis's record: each admission once, whatever the redirect (the
        // shadow policy's too: recorded while it fits).
        if c.kind.logged() {
            let stored = recorded(&redis, &c.key());
            if stored != LIMIT {
                failures.push(format!("case {} {:?} {} {:?}: {stored} admissions recorded in Redis (want {LIMIT})", c.id, c.kind, c.style, c.redirect));
            }
        } else {
            // Each admitted reserve of 1, settled to 1 in the log phase
            // wherever the request ended: 2 units in each window.
            let key = c.key();
            let settled = || fixed_units(&redis, "tok_min", &key) == LIMIT && fixed_units(&redis, "tok_day", &key) == LIMIT;
            if common::wait::poll(Duration::from_secs(3), None, settled) != common::wait::Waited::Ready {
                failures.push(format!(
                    "case {} {:?} {} {:?}: Redis holds {} units in tok_min, {} in tok_day (want {LIMIT})",
                    c.id, c.kind, c.style, c.redirect, fixed_units(&redis, "tok_min", &key), fixed_units(&redis, "tok_day", &key)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{} wrong:\n{}", failures.len(), failures.join("\n"));
    assert!(errors(&nginx).is_empty(), "{:?}", errors(&nginx));
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Outage {
    DaemonStopped,
    RedisStopped,
}

const FAIL_KINDS: [Kind; 5] = [Kind::Shared, Kind::Settle(false), Kind::Penalty, Kind::Described, Kind::Override];
const ON_ERROR: [&str; 3] = ["open", "closed", "local"];

/// Each new kind x each location fail policy, the daemon or Redis down.
/// The daemon stopped: open passes with no quota shown, closed answers 503
/// with Retry-After, local admits the local quota of 2 (a policy limiter's
/// from DESCRIBE_POLICY, a settle limiter's from its own options) and
/// refuses the third, with the quota headers of its most constrained item.
/// Redis stopped: the daemon decides, and the policies' own on_error
/// (local, 2) replaces the location's, whatever it says. Each case behind
/// another redirect kind.
fn each_new_kind_follows_its_fail_policy(outage: Outage) {
    let mut redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    // Redis down costs each request up to the daemon's deadline: short.
    let mut d = Daemon::start_config(&daemon_toml(&redis, dir.path(), 50));
    let mut cases = Vec::new();
    for kind in FAIL_KINDS {
        for on_error in ON_ERROR {
            cases.push((cases.len(), kind, on_error, REDIRECTS[cases.len() % REDIRECTS.len()]));
        }
    }
    let mut limiters = String::new();
    let mut locations = String::new();
    for &(id, kind, on_error, redirect) in &cases {
        let local = if matches!(kind, Kind::Settle(_)) && on_error == "local" { ", local_limit = 2" } else { "" };
        let _ = writeln!(limiters, "    lims[{id}] = assert({})", kind.limiter(&format!(", on_error = \"{on_error}\"{local}")));
        let _ = writeln!(
            locations,
            "    location = /c/{id} {{\n        access_by_lua_block {{ {} }}\n        {}\n    }}",
            kind.call(&format!("lims[{id}]"), "w2fail-$arg_k").replace("\"w2fail-$arg_k\"", "\"w2fail-\" .. ngx.var.arg_k"),
            redirect.then()
        );
    }
    let nginx = start_nginx(&d, &site(&limiters, &locations));
    let agent = agent();
    // Up: both workers have described the policies (verify_policies() at
    // worker start), and each override is in force.
    wait_until("both workers described the policies", Duration::from_secs(10), || {
        nginx.error_log().matches("policy \"described\" described by the daemon").count() >= 2
    });
    for &(id, kind, ..) in &cases {
        if kind == Kind::Override {
            override_to_two(dir.path(), &format!("w2fail-{id}"));
        }
        let r = get(&agent, &nginx.url(&format!("/c/{id}?k=warm{id}")), &[]);
        assert_eq!(r.status, 200, "case {id} before the outage: {:?}", r.headers);
    }
    match outage {
        Outage::DaemonStopped => {
            d.terminate();
        }
        Outage::RedisStopped => redis.kill(),
    }
    let mut failures = Vec::new();
    for &(id, kind, on_error, redirect) in &cases {
        for i in 0..3u64 {
            let r = get(&agent, &nginx.url(&format!("/c/{id}?k={id}")), &[]);
            let mut fail = |what: String| failures.push(format!("{outage:?} case {id} {kind:?} on_error={on_error} {redirect:?} request {}: {what}; headers {:?}", i + 1, r.headers));
            let outcome = r.header("X-Ratelimitd-Status");
            // With Redis down the daemon decides, and a policy's own
            // on_error (local, in every policy here) replaces the
            // location's (docs/POLICIES.md): the location's only decides
            // when the daemon itself cannot be reached.
            let effective = if outage == Outage::RedisStopped { "local" } else { on_error };
            match effective {
                "open" => {
                    if r.status != 200 || outcome != "FAIL_OPEN" || shows_quota(&r) {
                        fail(format!("status {} {outcome:?} (want 200 FAIL_OPEN, no quota fields)", r.status));
                    }
                }
                "closed" => {
                    if r.status != 503 || r.num("Retry-After").is_none() {
                        fail(format!("status {} Retry-After {:?} (want 503 and one)", r.status, r.num("Retry-After")));
                    }
                }
                _ => {
                    let (status, want) = if i < LIMIT { (200, "PASSED") } else { (429, "REJECTED") };
                    let shown = quota(&r, "ratelimit", kind.policy()).map(|(l, rem, _)| (l, rem));
                    if r.status != status || outcome != want || shown != Some((LIMIT, LIMIT - (i + 1).min(LIMIT))) {
                        fail(format!("status {} {outcome:?}, limit/remaining {shown:?} (want {status} {want}, the local quota of {LIMIT})", r.status));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} wrong:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn each_new_kind_follows_its_fail_policy_with_the_daemon_stopped() {
    each_new_kind_follows_its_fail_policy(Outage::DaemonStopped);
}

#[test]
fn each_new_kind_follows_its_fail_policy_with_redis_stopped() {
    each_new_kind_follows_its_fail_policy(Outage::RedisStopped);
}

/// The limiters of the combinations that cannot work, as an operator would
/// write them (init_worker_by_lua), and the refusals of the Lua new().
const REFUSED_LIMITERS: &str = r#"
init_worker_by_lua_block {
    local ratelimitd = require "resty.ratelimitd"
    bad = {
        settle_log = assert(ratelimitd.new{ policies = { "log_pol", "tok_min" }, settle = true }),
        multi_penalty = assert(ratelimitd.new{ policies = { "pen", "log_pol" } }),
        refund_penalty = assert(ratelimitd.new{ policy = "pen", refundable = true }),
        multi_fixed = assert(ratelimitd.new{ policies = { "tok_min", "log_pol" } }),
    }
    refusals = {}
    for _, opts in ipairs{
        { policy = "tok_min", settle = true, refundable = true },
        { policies = { "log_pol", "pen" }, share_dict = "ratelimitd" },
        { policy = "log_pol", refundable = true, share_dict = "ratelimitd" },
    } do
        local lim, err = ratelimitd.new(opts)
        refusals[#refusals + 1] = lim and "built" or err
    end
}
"#;

#[test]
fn each_combination_that_cannot_work_is_refused_by_check_config_the_lua_client_and_the_daemon() {
    let toml = "[[policy]]\nname = \"log_pol\"\nlimit = 5\nwindow = \"60s\"\n\
        [[policy]]\nname = \"tok_min\"\nalgorithm = \"fixed\"\nlimit = 100\nwindow = \"60s\"\n\
        [[policy]]\nname = \"pen\"\nlimit = 5\nwindow = \"60s\"\npenalty = { after = 1, within = \"60s\", ban = \"90s\" }\n";
    let body = format!(
        "{REFUSED_LIMITERS}server {{\n    listen 127.0.0.1:{{PORT}};\n\
         \x20   location = /refusals {{ content_by_lua_block {{ ngx.say(table.concat(refusals, \"\\n\")) }} }}\n\
         \x20   location = /settle_log {{ access_by_lua_block {{ bad.settle_log:limit({{ \"k\", \"k\" }}, 1) }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         \x20   location = /multi_penalty {{ access_by_lua_block {{ bad.multi_penalty:limit({{ \"k\", \"k\" }}) }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         \x20   location = /refund_penalty {{ access_by_lua_block {{ bad.refund_penalty:limit(\"k\") }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         \x20   location = /multi_fixed {{ access_by_lua_block {{ bad.multi_fixed:limit({{ \"k\", \"k\" }}) }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         }}\n"
    );

    // check-config --nginx, before anything runs: each one named, exit 1.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ratelimitd.toml"), toml).unwrap();
    std::fs::write(dir.path().join("nginx.conf"), format!("http {{\n{body}}}\n")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(["check-config", "--config"])
        .arg(dir.path().join("ratelimitd.toml"))
        .arg("--nginx")
        .arg(dir.path().join("nginx.conf"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    for want in [
        "policy \"log_pol\" in a settle = true limiter: every request refused with UNSUPPORTED_COMBINATION",
        "policy \"pen\" in a multi-item or refundable limiter: every request refused with UNSUPPORTED_COMBINATION: a penalty box is checked alone",
        "policy \"tok_min\" in a multi-item or refundable limiter: every request refused with UNSUPPORTED_COMBINATION: several policies in one request",
    ] {
        assert!(said.contains(want), "check-config lacks {want:?}:\n{said}");
    }
    assert_eq!(said.matches("policy \"pen\" in a multi-item").count(), 2, "both limiters naming pen: {said}");
    assert!(!said.contains("policy \"log_pol\" in a multi-item"), "log_pol can be checked with others: {said}");

    // The daemon at request time: UNSUPPORTED_COMBINATION (19), which the
    // Lua client answers with the location's invalid_status (500), logged
    // as a misconfiguration, never its on_error.
    let redis = RedisServer::start_unix();
    let server = common::ops::socket_access();
    let d = Daemon::start_config(&format!("{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{toml}", redis.url()));
    let nginx = start_nginx(&d, &body);
    let agent = agent();
    for (path, policy) in [("settle_log", "log_pol"), ("multi_penalty", "pen"), ("refund_penalty", "pen"), ("multi_fixed", "tok_min")] {
        // The client logs each kind of failure at most once a second per
        // worker: asked again until this location's line is written.
        let mut line = None;
        wait_until(&format!("{path}: an invalid_request line"), Duration::from_secs(5), || {
            let r = get(&agent, &nginx.url(&format!("/{path}")), &[]);
            assert_eq!(r.status, 500, "{path}: {:?}", r.headers);
            line = nginx.error_log().lines().find(|l| l.contains("ratelimitd: invalid_request") && l.contains(&format!("/{path} "))).map(str::to_string);
            if line.is_none() {
                std::thread::sleep(Duration::from_millis(100));
            }
            line.is_some()
        });
        let line = line.unwrap();
        assert!(line.contains("UNSUPPORTED_COMBINATION") && line.contains(&format!("policy '{policy}'")), "{path}: {line}");
    }
    // Nothing was recorded for any of them.
    assert_eq!(recorded(&redis, "k"), 0);

    // The Lua new(), where the options alone show it: nil and why.
    let r = get(&agent, &nginx.url("/refusals"), &[]);
    let lines: Vec<&str> = r.body.lines().collect();
    assert_eq!(lines.len(), 3, "{}", r.body);
    assert!(lines[0].contains("settle = true reserves and settles: without refundable"), "{}", lines[0]);
    for l in &lines[1..] {
        assert!(l.contains("share_dict") && l.contains("one-policy"), "{l}");
    }
}
