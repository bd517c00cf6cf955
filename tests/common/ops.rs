//! The daemon behind nginx as an operator runs it, for the tests of
//! operations, named policies, DESCRIBE_POLICY and `top`: the shipped
//! snippet pointed at a test daemon, a daemon with `[[policy]]` tables on a
//! socket nginx's workers may use, and the samples of its metrics.

use std::path::Path;

use super::{is_root, Daemon, Nginx, RedisServer, WORKER_GROUP};

/// The shipped snippet (nginx/ratelimitd.conf), as installed.
pub const SNIPPET: &str = include_str!("../../nginx/ratelimitd.conf");

/// The shipped snippet with the test daemon's socket and a read timeout of
/// 1000 ms instead of the shipped 50: loaded CI machines stall processes,
/// and these tests are about decisions, counts and reloads (the restart
/// tests keep the shipped timeouts, from `SNIPPET`).
pub fn snippet(socket: &Path) -> String {
    SNIPPET
        .replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", socket.display()), 1)
        .replacen("read_timeout = 50,", "read_timeout = 1000,", 1)
}

/// nginx with `snippet(socket)`, the http-level lines `http` (an
/// init_worker_by_lua_block, ...) and one server on a free port holding
/// `locations`.
pub fn gateway(socket: &Path, http: &str, locations: &str) -> Nginx {
    Nginx::start(&format!("{}\n{http}\nserver {{\n listen 127.0.0.1:{{PORT}};\n{locations}\n}}\n", snippet(socket)))
}

/// Locations, one per (path, arguments of `new`): each limits the
/// request's `X-Tenant-Id` with the limiter `require("resty.ratelimitd").new`
/// makes of its arguments (`("order")`, `{ policy = "login", on_error =
/// "closed" }`) and answers "ok".
pub fn tenant_locations(list: &[(&str, &str)]) -> String {
    list.iter()
        .map(|(path, new)| {
            format!(
                "    location {path} {{\n        access_by_lua_block {{\n            local lim = assert(require(\"resty.ratelimitd\").new{new})\n            lim:limit(ngx.var.http_x_tenant_id)\n        }}\n        content_by_lua_block {{ ngx.say(\"ok\") }}\n    }}\n"
            )
        })
        .collect()
}

/// `[server]` lines for a socket nginx's workers may connect to (their
/// group's when the tests run as root).
pub fn socket_access() -> String {
    if is_root() {
        format!("socket_mode = \"0660\"\nsocket_group = \"{WORKER_GROUP}\"")
    } else {
        "socket_mode = \"0660\"".into()
    }
}

/// The configuration of a daemon on `redis` (Redis timeout 500 ms) with
/// `policies` (`[[policy]]` tables).
fn config(redis: &RedisServer, policies: &str) -> String {
    format!("{}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n{policies}", socket_access(), redis.url())
}

/// A daemon on `redis` with `policies`.
pub fn daemon(redis: &RedisServer, policies: &str) -> Daemon {
    Daemon::start_config(&config(redis, policies))
}

/// A daemon on `redis` with `policies`, and metrics on a loopback port.
pub fn daemon_with_metrics(redis: &RedisServer, policies: &str) -> Daemon {
    Daemon::start_config_with_metrics(&config(redis, policies))
}

/// The daemon's metrics, as Prometheus scrapes them.
pub fn metrics(d: &Daemon) -> String {
    super::http::get(&super::http::agent(), &d.metrics_url(), &[]).body
}

/// The value of the sample `line_start` (name and labels) in `text`.
pub fn sample(text: &str, line_start: &str) -> f64 {
    let line = text.lines().find(|l| l.starts_with(line_start)).unwrap_or_else(|| panic!("no {line_start} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}
