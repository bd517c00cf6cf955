//! The daemon's admin API over its Unix socket, for the tests that draw
//! admin operations (tests/matrix_admin.rs, tests/matrix_leases.rs): a
//! request, and the wait until a daemon applies an override.

use std::path::Path;
use std::time::{Duration, Instant};

use ratelimitd::admin_api::client::{encode, request, Reply};
use ratelimitd::config::AdminListen;
use serde_json::{json, Value};

/// One request to the admin API listening on `socket`; every status is an answer.
pub fn admin(socket: &Path, method: &str, path: &str, body: Option<Value>) -> Reply {
    request(&AdminListen::Unix { path: socket.to_path_buf(), mode: 0o600 }, None, method, path, body.map(|b| b.to_string()).as_deref()).unwrap()
}

/// The peek of (policy, key): `GET /v1/keys`.
pub fn peek(socket: &Path, policy: &str, key: &str) -> Reply {
    admin(socket, "GET", &format!("/v1/keys?policy={}&key={}", encode(policy), encode(key)), None)
}

/// Waits until the daemon of `socket` applies a live override of (policy,
/// key) (`in_force`: its peek says `limit_from` = `api_override`, with
/// `limit` when given) or none; panics after 10 s with `log()`.
pub async fn until_applied(socket: &Path, policy: &str, key: &str, in_force: bool, limit: Option<u32>, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = peek(socket, policy, key);
        let applied = r.body["limit_from"] == json!("api_override") && limit.map_or(true, |l| r.body["limit"] == json!(l));
        if applied == in_force {
            return;
        }
        assert!(Instant::now() < deadline, "override of {policy}/{key} never {}: {:?}\n{}", if in_force { "applied" } else { "gone" }, r.body, log());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
