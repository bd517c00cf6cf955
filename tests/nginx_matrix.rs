//! The Lua client's feature matrix through real nginx, ratelimitd and
//! redis-server (issue 22, item 4, second part): every limiter kind (inline,
//! one named policy, several policies with and without a shadow one,
//! concurrency inline and of a policy) x every algorithm a kind can have x
//! every header style x every redirect kind (none, `error_page` to a named
//! location, `try_files`, `ngx.exec`), one location per case, generated.
//! Each case sends its limit + 1 requests one after the other and checks
//! status, every quota header, `Retry-After` and `$ratelimitd_status`; for
//! concurrency, that each request holds one slot and no lease outlives its
//! request (and a client abort after each redirect kind).

mod common;

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;

use common::http::{agent, get, Reply};
use common::nginx_cases;
use common::{wait_until, Daemon, Nginx, RedisServer};

const ALGORITHMS: [&str; 5] = ["log", "ring", "gcra", "sliding_counter", "fixed"];
/// Every rate limiter admits 2 per minute; GCRA (one token every 30 s)
/// without pacing, so that the burst of 2 passes at once.
const LIMIT: u64 = 2;

#[derive(Clone, Debug)]
enum Kind {
    Inline(&'static str),
    Policy(&'static str),
    /// Several policies: `per_ip` (limit 10) and `per_key` (limit 2), and
    /// with `Some(declared)` the shadow policy `next` (limit 1) too.
    Multi(Option<bool>),
    ConcurrencyInline,
    ConcurrencyPolicy,
}

type Case = nginx_cases::Case<Kind>;

impl nginx_cases::Case<Kind> {
    fn concurrency(&self) -> bool {
        matches!(self.kind, Kind::ConcurrencyInline | Kind::ConcurrencyPolicy)
    }
    fn key(&self) -> String {
        format!("case{}", self.id)
    }
    fn algorithm(&self) -> &'static str {
        match self.kind {
            Kind::Inline(a) | Kind::Policy(a) => a,
            _ => "log",
        }
    }
    /// The Lua expression of the limiter.
    fn limiter(&self) -> String {
        let style = self.style;
        match &self.kind {
            Kind::Inline("gcra") => format!("ratelimitd.new{{ limit = 2, window_ms = 60000, algorithm = \"gcra\", nodelay = true, header_style = \"{style}\" }}"),
            Kind::Inline(a) => format!("ratelimitd.new{{ limit = 2, window_ms = 60000, algorithm = \"{a}\", header_style = \"{style}\" }}"),
            Kind::Policy("gcra") => format!("ratelimitd.new{{ policy = \"p_gcra\", nodelay = true, header_style = \"{style}\" }}"),
            Kind::Policy(a) => format!("ratelimitd.new{{ policy = \"p_{a}\", header_style = \"{style}\" }}"),
            Kind::Multi(None) => format!("ratelimitd.new{{ policies = {{ \"per_ip\", \"per_key\" }}, header_style = \"{style}\" }}"),
            Kind::Multi(Some(false)) => format!("ratelimitd.new{{ policies = {{ \"per_ip\", \"next\", \"per_key\" }}, header_style = \"{style}\" }}"),
            Kind::Multi(Some(true)) => {
                format!("ratelimitd.new{{ policies = {{ \"per_ip\", \"next\", \"per_key\" }}, shadow = {{ \"next\" }}, header_style = \"{style}\" }}")
            }
            Kind::ConcurrencyInline => format!("ratelimitd.concurrency{{ limit = 1, lease_ms = 30000, header_style = \"{style}\" }}"),
            Kind::ConcurrencyPolicy => format!("ratelimitd.concurrency{{ policy = \"uploads\", header_style = \"{style}\" }}"),
        }
    }
    /// The Lua call in the access phase.
    fn call(&self) -> String {
        let id = self.id;
        let key = self.key();
        match &self.kind {
            Kind::Multi(Some(_)) => format!("lims[{id}]:limit({{ \"ip-{key}\", \"shadow-{key}\", \"{key}\" }})"),
            Kind::Multi(None) => format!("lims[{id}]:limit({{ \"ip-{key}\", \"{key}\" }})"),
            Kind::ConcurrencyInline | Kind::ConcurrencyPolicy => format!("lims[{id}]:enter(\"{key}\")"),
            _ => format!("lims[{id}]:limit(\"{key}\")"),
        }
    }
    fn location(&self) -> String {
        let (id, call) = (self.id, self.call());
        let then = self.redirect.then();
        format!("    location = /c/{id} {{\n        access_by_lua_block {{ {call} }}\n        {then}\n    }}\n")
    }
    /// The Redis key of a concurrency case's leases.
    fn lease_key(&self) -> Vec<u8> {
        match self.kind {
            Kind::ConcurrencyPolicy => format!("ratelimitd:{{\x07uploads{}}}:concurrency", self.key()).into_bytes(),
            _ => format!("ratelimitd:{{{}}}:concurrency", self.key()).into_bytes(),
        }
    }
}

fn cases() -> Vec<Case> {
    let mut kinds: Vec<Kind> = Vec::new();
    kinds.extend(ALGORITHMS.iter().map(|&a| Kind::Inline(a)));
    kinds.extend(ALGORITHMS.iter().map(|&a| Kind::Policy(a)));
    kinds.extend([Kind::Multi(None), Kind::Multi(Some(false)), Kind::Multi(Some(true)), Kind::ConcurrencyInline, Kind::ConcurrencyPolicy]);
    nginx_cases::cases(&kinds)
}

fn policies() -> String {
    let mut toml = String::new();
    for a in ALGORITHMS {
        let _ = write!(toml, "[[policy]]\nname = \"p_{a}\"\nalgorithm = \"{a}\"\nlimit = 2\nwindow = \"60s\"\n");
    }
    toml.push_str(
        "[[policy]]\nname = \"per_ip\"\nlimit = 10\nwindow = \"60s\"\n\
         [[policy]]\nname = \"per_key\"\nlimit = 2\nwindow = \"60s\"\n\
         [[policy]]\nname = \"next\"\nlimit = 1\nwindow = \"60s\"\nshadow = true\n\
         [[policy]]\nname = \"uploads\"\nalgorithm = \"concurrency\"\nlimit = 1\nlease = \"30s\"\n",
    );
    toml
}

fn site(cases: &[Case]) -> String {
    let mut s = String::from(
        "# $ratelimitd_status survives internal redirects only as a variable\n\
         # nothing resets: a server-level `set` runs again after try_files and ngx.exec.\n\
         map \"\" $ratelimitd_status { default \"-\"; }\n\
         init_worker_by_lua_block {\n    local ratelimitd = require \"resty.ratelimitd\"\n    ratelimitd.configure{ log_var = \"ratelimitd_status\" }\n    lims = {}\n",
    );
    for c in cases {
        let _ = writeln!(s, "    lims[{}] = assert({})", c.id, c.limiter());
    }
    s.push_str("}\n");
    let _ = write!(
        s,
        "server {{\n    listen 127.0.0.1:{{PORT:up}};\n    location / {{ content_by_lua_block {{ ngx.sleep(5) ngx.say(\"late\") }} }}\n}}\n\
         server {{\n    listen 127.0.0.1:{{PORT}};\n    root /nonexistent;\n    log_not_found off;\n\
         \x20   add_header X-Ratelimitd-Status $ratelimitd_status always;\n\
         \x20   log_by_lua_block {{ require(\"resty.ratelimitd\").leave() }}\n\
         \x20   location @ok {{ content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         \x20   location = /ok {{ content_by_lua_block {{ ngx.say(\"ok\") }} }}\n\
         \x20   location @slow {{ proxy_pass http://127.0.0.1:{{PORT:up}}; }}\n"
    );
    for c in cases {
        s.push_str(&c.location());
    }
    s.push_str("}\n");
    s
}

/// What case `c`'s request `i` (0-based) must get: status, outcome, the
/// quota fields (limit, remaining, reset range) of the style's headers,
/// the draft's policy names.
fn check(c: &Case, i: u64, r: &Reply, failures: &mut Vec<String>) {
    let mut fail = |what: String| failures.push(format!("case {} {:?} {} {:?} request {}: {what}; headers {:?}", c.id, c.kind, c.style, c.redirect, i + 1, r.headers));
    let concurrency = c.concurrency();
    let shadow = matches!(c.kind, Kind::Multi(Some(_)));
    let admitted = concurrency || i < LIMIT;
    let status = if admitted { 200 } else { 429 };
    if r.status != status {
        fail(format!("status {} (want {status})", r.status));
        return;
    }
    let outcome = match (admitted, shadow && i >= 1) {
        (false, _) => "REJECTED",
        (true, true) => "PASSED_SHADOW",
        (true, false) => "PASSED",
    };
    if r.header("X-Ratelimitd-Status") != outcome {
        fail(format!("$ratelimitd_status {:?} (want {outcome})", r.header("X-Ratelimitd-Status")));
    }
    // The quota shown: the limited policy (per_key, limit 2) of a
    // multi-item limiter, never the shadow one, declared or not, whether it
    // has room (request 1: the daemon marks it shadow_allowed) or refuses
    // (from request 2 on: shadow_denied).
    let (limit, remaining) = if concurrency {
        (1, 0)
    } else {
        (LIMIT, LIMIT - (i + 1).min(LIMIT))
    };
    // Seconds until the window (or bucket, or lease) is empty again.
    let reset = match (concurrency, c.algorithm()) {
        (true, _) => 30..=30,
        (false, "log" | "ring") => 60..=60,
        (false, "gcra") => 1..=60,
        (false, "sliding_counter") => 1..=120,
        (false, _) => 1..=60,
    };
    if !admitted {
        match r.num("Retry-After") {
            Some(s) if (1..=120).contains(&s) => {}
            other => fail(format!("Retry-After {other:?}")),
        }
    }
    let name = match &c.kind {
        Kind::Inline(_) | Kind::ConcurrencyInline => "default".to_string(),
        Kind::Policy(a) => format!("p_{a}"),
        Kind::Multi(_) => "per_key".to_string(),
        Kind::ConcurrencyPolicy => "uploads".to_string(),
    };
    match c.style {
        "draft" => {
            let policy = r.header("RateLimit-Policy");
            let state = r.header("RateLimit");
            if policy.contains("\"next\"") || state.contains("\"next\"") {
                fail("the shadow policy listed".into());
            }
            let member = state.split(", ").find(|m| m.starts_with(&format!("\"{name}\";")));
            let Some(member) = member else { return fail(format!("no {name} in RateLimit {state:?}")) };
            let want_r = format!(";r={remaining};");
            if !member.contains(&want_r) {
                fail(format!("RateLimit {member:?} (want r={remaining})"));
            }
            if !policy.contains(&format!("\"{name}\";q={limit}")) {
                fail(format!("RateLimit-Policy {policy:?} (want q={limit})"));
            }
            if matches!(c.kind, Kind::Multi(_)) && !policy.contains("\"per_ip\";q=10;w=60") {
                fail(format!("RateLimit-Policy {policy:?} lacks per_ip"));
            }
            let t: u64 = member.rsplit(";t=").next().unwrap().parse().unwrap();
            if admitted && !reset.contains(&t) {
                fail(format!("t={t} (want {reset:?})"));
            }
            if !admitted && Some(t) != r.num("Retry-After") {
                fail(format!("t={t} is not Retry-After"));
            }
        }
        style => {
            let prefix = if style == "x" { "X-RateLimit" } else { "RateLimit" };
            let got = (r.num(&format!("{prefix}-Limit")), r.num(&format!("{prefix}-Remaining")));
            if got != (Some(limit), Some(remaining)) {
                fail(format!("{prefix}-Limit/Remaining {got:?} (want {limit}, {remaining})"));
            }
            match r.num(&format!("{prefix}-Reset")) {
                Some(t) if !admitted || reset.contains(&t) => {}
                other => fail(format!("{prefix}-Reset {other:?} (want {reset:?})")),
            }
        }
    }
}

#[test]
fn every_limiter_kind_algorithm_header_style_and_redirect_through_nginx() {
    let redis = RedisServer::start_unix();
    let server = common::ops::socket_access();
    let d = Daemon::start_config(&format!("{server}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{}", redis.url(), policies()));
    let snippet = common::ops::snippet(&d.socket);
    let cases = cases();
    let nginx = Nginx::start(&format!("{snippet}\n{}", site(&cases)));
    let agent = agent();
    let zcard = |key: &[u8]| -> u64 { redis::cmd("ZCARD").arg(key).query(&mut redis.conn()).unwrap() };
    let mut failures = Vec::new();
    for c in &cases {
        for i in 0..=LIMIT {
            let reply = get(&agent, &nginx.url(&format!("/c/{}", c.id)), &[]);
            check(c, i, &reply, &mut failures);
            if c.concurrency() {
                // Released from a timer after the log phase: just after
                // the response at the latest.
                let key = c.lease_key();
                wait_until(&format!("case {} {:?} {:?}: request {}'s lease released", c.id, c.kind, c.redirect, i + 1), Duration::from_secs(3), || zcard(&key) == 0);
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} cases x {} requests wrong:\n{}", failures.len(), cases.len(), LIMIT + 1, failures.join("\n"));
    let log = nginx.error_log();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]")).collect();
    assert!(errors.is_empty(), "{errors:?}");
}

/// A client abort after each redirect kind: the aborted request's lease is
/// released at once (not after the upstream's 5 s or the lease's 30 s).
#[test]
fn a_client_abort_after_every_redirect_kind_releases_the_lease() {
    let redis = RedisServer::start_unix();
    let d = common::ops::daemon(&redis, "");
    let snippet = common::ops::snippet(&d.socket);
    // Each redirect kind ends at the slow upstream.
    let nginx = Nginx::start(&format!(
        r#"{snippet}
init_worker_by_lua_block {{ conns = assert(require("resty.ratelimitd").concurrency{{ limit = 1, lease_ms = 30000, on_error = "closed" }}) }}
server {{
    listen 127.0.0.1:{{PORT:up}};
    location / {{ content_by_lua_block {{ ngx.sleep(5) ngx.say("late") }} }}
}}
server {{
    listen 127.0.0.1:{{PORT}};
    root /nonexistent;
    log_not_found off;
    log_by_lua_block {{ require("resty.ratelimitd").leave() }}
    location = /none {{ access_by_lua_block {{ conns:enter("none") }} proxy_pass http://127.0.0.1:{{PORT:up}}; }}
    location = /error_page {{ access_by_lua_block {{ conns:enter("error_page") }} error_page 404 = @slow; }}
    location = /try_files {{ access_by_lua_block {{ conns:enter("try_files") }} try_files $uri /slow; }}
    location = /exec {{ access_by_lua_block {{ conns:enter("exec") }} content_by_lua_block {{ return ngx.exec("/slow") }} }}
    location @slow {{ proxy_pass http://127.0.0.1:{{PORT:up}}; }}
    location = /slow {{ proxy_pass http://127.0.0.1:{{PORT:up}}; }}
}}
"#
    ));
    for kind in ["none", "error_page", "try_files", "exec"] {
        let key = format!("ratelimitd:{{{kind}}}:concurrency");
        let zcard = || -> u64 { redis::cmd("ZCARD").arg(&key).query(&mut redis.conn()).unwrap() };
        let mut slow = std::net::TcpStream::connect(("127.0.0.1", nginx.port)).unwrap();
        slow.write_all(format!("GET /{kind} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes()).unwrap();
        wait_until(&format!("{kind}: the slow request holds its lease"), Duration::from_secs(5), || zcard() == 1);
        slow.shutdown(std::net::Shutdown::Both).unwrap();
        drop(slow);
        wait_until(&format!("{kind}: the aborted request's lease released"), Duration::from_secs(3), || zcard() == 0);
    }
    let log = nginx.error_log();
    assert!(!log.contains("ratelimitd: "), "{log}");
}
