//! The admin API as the commands call it (`[admin] listen`).

use std::path::Path;

use ratelimitd::admin_api::client;
use ratelimitd::config::{AdminListen, Config};
use ratelimitd::terminal::escape;

/// Where the configuration's admin API listens, if it has one: `inspect`
/// and `reset` then go through it (the daemon's own Redis access), else
/// to Redis directly.
pub fn listen(path: &Path) -> anyhow::Result<Option<AdminListen>> {
    Ok(Config::load(path)?.admin.listen)
}

/// One admin API call; a response other than 200 is an error carrying the
/// API's message. The token: the write token file's if readable, else the
/// read one's.
pub fn call(path: &Path, method: &str, target: &str, body: Option<&str>) -> anyhow::Result<serde_json::Value> {
    let cfg = Config::load(path)?;
    let listen = cfg.admin.listen.ok_or_else(|| anyhow::anyhow!("{}: no [admin] listen: the admin API is off", path.display()))?;
    let token = [&cfg.admin.token_file, &cfg.admin.read_token_file].into_iter().flatten().find_map(|f| client::read_token(f).ok());
    let tls = match (&listen, &cfg.admin.tls) {
        (AdminListen::Tcp(_), Some(t)) => Some(ratelimitd::admin_api::tls::client_config(t)?),
        _ => None,
    };
    let reply = client::request_with(&listen, tls, token.as_deref(), method, target, body)?;
    if reply.status != 200 {
        anyhow::bail!("admin API: {} {}", reply.status, escape(reply.body["error"].as_str().unwrap_or("(no message)")));
    }
    Ok(reply.body)
}

/// `GET PATH` or `PATH?policy=NAME`, a listing of one policy or all:
/// printed as JSON, or as a line per entry of the reply's `field` made by
/// `line` (`none` when there is none).
pub fn list(config: &Path, path: &str, policy: Option<&str>, json: bool, field: &str, none: &str, line: impl Fn(&serde_json::Value) -> String) -> anyhow::Result<()> {
    let target = match policy {
        Some(p) => format!("{path}?policy={}", client::encode(p)),
        None => path.to_string(),
    };
    let reply = call(config, "GET", &target, None)?;
    if json {
        return super::common::print_json(&reply);
    }
    let all = reply[field].as_array().cloned().unwrap_or_default();
    if all.is_empty() {
        println!("{none}");
    }
    for entry in &all {
        println!("{}", line(entry));
    }
    Ok(())
}

/// `PATH?policy=NAME&key=KEY`: one key of one policy.
pub fn one_key(path: &str, policy: &str, key: &str) -> String {
    format!("{path}?policy={}&key={}", client::encode(policy), client::encode(key))
}

/// A field of a reply as text, escaped for the terminal ("-" if absent).
pub fn text(v: &serde_json::Value, field: &str) -> String {
    escape(v[field].as_str().unwrap_or("-")).into_owned()
}
