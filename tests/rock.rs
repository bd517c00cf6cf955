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

use common::{Daemon, Nginx, RedisServer};

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
    let server = common::ops::socket_access();
    let d = Daemon::start_with(&server, Some(&redis.url()), "timeout_ms = 500");
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1).replacen("read_timeout = 50,", "read_timeout = 1000,", 1);
    let example = EXAMPLE.replacen("listen 8080;", "listen 127.0.0.1:{PORT};", 1).replacen("server 127.0.0.1:9000;", "server 127.0.0.1:{PORT:app};", 1).replacen("window_ms = 1000,", "window_ms = 60000,", 1);
    let body = format!("{snippet}\n{example}\nserver {{ listen 127.0.0.1:{{PORT:app}}; location / {{ return 200 \"ok\\n\"; }} }}\n");
    let nginx = Nginx::start_with_lua(&body, &installed.join("resty"));
    let agent = common::http::agent();
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

/// The `_VERSION = "..."` of a Lua module's text, if it has one.
fn lua_version(text: &str) -> Option<String> {
    let rest = text.split("_VERSION").nth(1)?.trim_start().strip_prefix('=')?.trim_start();
    let rest = rest.strip_prefix('"').or_else(|| rest.strip_prefix('\''))?;
    Some(rest.split(['"', '\'']).next()?.to_string())
}

/// One release version (docs/PROTOCOL.md §3: the daemon and the Lua client
/// ship together): Cargo's, which the daemon reports (`--version`,
/// `ratelimitd_build_info`) and the Debian package takes, is the rockspec's
/// (`VERSION-REV`, its file name and its source tag), every Lua module's
/// `_VERSION` (what OPM publishes: dist.ini names none of its own) and the
/// rockspec file named in docs/NGINX.md.
#[test]
fn the_daemon_the_rockspec_opm_and_every_lua_module_carry_one_version() {
    let version = env!("CARGO_PKG_VERSION");
    let root = Path::new(ROOT);
    let rockspecs: Vec<_> = std::fs::read_dir(root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "rockspec")).collect();
    assert_eq!(rockspecs.len(), 1, "one rockspec at the root: {rockspecs:?}");
    let file = rockspecs[0].file_name().unwrap().to_str().unwrap().to_string();
    let text = std::fs::read_to_string(&rockspecs[0]).unwrap();
    let rock_version = text.lines().find_map(|l| l.trim().strip_prefix("version = \"")).map(|v| v.trim_end_matches('"').to_string()).expect("version = in the rockspec");
    let (upstream, revision) = rock_version.rsplit_once('-').expect("VERSION-REV");
    assert_eq!(upstream, version, "the rockspec's version {rock_version} is not Cargo's {version}");
    assert!(revision.parse::<u32>().is_ok(), "{rock_version}");
    assert_eq!(file, format!("lua-resty-ratelimitd-{rock_version}.rockspec"), "luarocks wants the file named after its version");
    assert!(text.contains(&format!("tag = \"v{version}\"")), "the rockspec's source tag is not v{version}");

    let modules = lua_files(&root.join("lua/resty"));
    let mut versioned = 0;
    for m in &modules {
        if let Some(v) = lua_version(&std::fs::read_to_string(root.join("lua/resty").join(m)).unwrap()) {
            assert_eq!(v, version, "lua/resty/{m} says _VERSION = {v:?}, Cargo {version}");
            versioned += 1;
        }
    }
    let main = std::fs::read_to_string(root.join("lua/resty/ratelimitd.lua")).unwrap();
    assert_eq!(lua_version(&main).as_deref(), Some(version), "the main module (OPM's version) has its _VERSION");
    assert!(versioned >= 1);
    let dist = std::fs::read_to_string(root.join("dist.ini")).unwrap();
    assert!(!dist.lines().any(|l| l.trim_start().starts_with("version")), "dist.ini must not name a version of its own: OPM takes the main module's _VERSION");

    let nginx_doc = std::fs::read_to_string(root.join("docs/NGINX.md")).unwrap();
    for named in nginx_doc.match_indices("lua-resty-ratelimitd-").map(|(i, _)| &nginx_doc[i..]).filter_map(|s| s.split_once(".rockspec").map(|(n, _)| n)) {
        assert!(!named.contains(' '), "{named}");
        assert_eq!(format!("{named}.rockspec"), file, "docs/NGINX.md names another rockspec");
    }
}
