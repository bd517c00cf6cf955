//! The Lua client as the OpenResty ecosystem installs it: the rockspec
//! (lua-resty-ratelimitd-*.rockspec) installed with `luarocks make` into a
//! clean tree holds exactly the modules under lua/resty/, and nginx with
//! only that tree on its Lua path runs the seed scenario (the shipped
//! snippet and example, /order at 1000 per minute) against the real daemon
//! and Redis. Skipped with a message when luarocks is not installed
//! (Debian: apt-get install luarocks).

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{is_root, Daemon, Nginx, RedisServer, WORKER_GROUP};

const SNIPPET: &str = include_str!("../nginx/ratelimitd.conf");
const EXAMPLE: &str = include_str!("../nginx/example.conf");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The .lua files under `dir`, relative to it.
fn lua_files(dir: &Path) -> BTreeSet<String> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else if p.extension().is_some_and(|x| x == "lua") {
                out.insert(p.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(dir, dir, &mut out);
    out
}

#[test]
fn the_rock_installs_into_a_clean_tree_and_serves_the_seed_scenario() {
    // scripts/test installs luarocks (scripts/lib.sh LUA_TEST_PACKAGES): a
    // missing one is a broken setup, not a reason to pass.
    assert!(Command::new("luarocks").arg("--version").output().is_ok(), "luarocks is not installed (apt-get install luarocks; scripts/test installs it)");
    let rockspec = std::fs::read_dir(ROOT).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|x| x == "rockspec")).expect("a rockspec at the root");
    let tree = tempfile::tempdir().unwrap();
    let out = Command::new("luarocks").current_dir(ROOT).args(["--lua-version", "5.1", "--tree"]).arg(tree.path()).arg("make").arg(&rockspec).output().unwrap();
    assert!(out.status.success(), "luarocks make: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));

    // Exactly the checkout's modules: none missing, no test files.
    let installed = tree.path().join("share/lua/5.1");
    assert_eq!(lua_files(&installed), lua_files(&Path::new(ROOT).join("lua")).into_iter().filter(|f| f.starts_with("resty/")).collect::<BTreeSet<_>>());

    // The seed scenario with the rock's files only.
    let redis = RedisServer::start_unix();
    let server = if is_root() { format!("socket_mode = \"0660\"\nsocket_group = \"{WORKER_GROUP}\"") } else { "socket_mode = \"0660\"".into() };
    let d = Daemon::start_with(&server, Some(&redis.url()), "timeout_ms = 500");
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1).replacen("read_timeout = 50,", "read_timeout = 1000,", 1);
    let example = EXAMPLE.replacen("listen 8080;", "listen 127.0.0.1:{PORT};", 1).replacen("server 127.0.0.1:9000;", "server 127.0.0.1:{PORT:app};", 1).replacen("window_ms = 1000,", "window_ms = 60000,", 1);
    let body = format!("{snippet}\n{example}\nserver {{ listen 127.0.0.1:{{PORT:app}}; location / {{ return 200 \"ok\\n\"; }} }}\n");
    let nginx = Nginx::start_with_lua(&body, &installed.join("resty"));
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(5))).build().into();
    let mut statuses = Vec::new();
    let mut remaining = Vec::new();
    for _ in 0..1005 {
        let mut r = agent.get(&nginx.url("/order")).header("X-Tenant-Id", "tenant-1001").call().unwrap();
        let _ = r.body_mut().read_to_string();
        statuses.push(r.status().as_u16());
        remaining.push(r.headers().get("RateLimit-Remaining").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok()));
    }
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 1000);
    assert!(statuses[1000..].iter().all(|&s| s == 429), "{:?}", &statuses[1000..]);
    assert_eq!((remaining[0], remaining[999], remaining[1000]), (Some(999), Some(0), Some(0)));
    let log = nginx.error_log();
    assert!(!log.contains("[error]") && !log.contains("[alert]"), "{log}");
}
