//! A first day with ratelimitd on a host without systemd, as
//! docs/OPERATIONS.md tells it: the daemon started by hand makes its
//! socket's directory, logs one line per event and never ends its log on a
//! Redis failure that is over; `check-config` names the field of a TOML
//! error and the nearest valid name, and refuses limiter options the Lua
//! client's `new()` refuses. Real processes: the `ratelimitd` binary,
//! redis-server, luajit.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{args, wait_until, ChildGuard, Daemon, RedisServer};
use nix::sys::signal::Signal;
use ratelimitd::protocol::{CheckArgs, FailPolicy, Source};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");
const DOC: &str = include_str!("../docs/OPERATIONS.md");
const PACKAGE: &str = include_str!("../debian/ratelimitd.toml");

fn ratelimitd(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).env("LUA_PATH", concat!(env!("CARGO_MANIFEST_DIR"), "/lua/?.lua;;")).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The shell lines of OPERATIONS.md's "Without systemd" section.
fn without_systemd_lines() -> Vec<&'static str> {
    let at = DOC.find("### Without systemd").expect("OPERATIONS.md has a start without systemd");
    let section = &DOC[at..at + DOC[at + 4..].find("\n### ").unwrap() + 4];
    let block = section.split("```").nth(1).expect("a shell block");
    assert!(block.starts_with("sh\n"), "{block}");
    block.lines().skip(1).collect()
}

/// The `server {}` of the section's first limited location.
fn without_systemd_nginx_server() -> &'static str {
    let at = DOC.find("### Without systemd").unwrap();
    let section = &DOC[at..at + DOC[at + 4..].find("\n### ").unwrap() + 4];
    let block = section.split("```nginx\n").nth(1).expect("a first location").split("```").next().unwrap();
    // Indented under its list item in the doc.
    Box::leak(block.lines().map(|l| l.strip_prefix("  ").unwrap_or(l)).collect::<Vec<_>>().join("\n").into_boxed_str())
}

/// The package's configuration as `serve` reads it on a fresh host, but
/// for Redis (the test's), the metrics port (none: 9464 may be taken) and
/// the socket, in a directory that does not exist yet (`/run/ratelimitd`
/// after a reboot): `dir/run/ratelimitd/ratelimitd.sock`, `dir/run` made.
fn package_config(dir: &std::path::Path, redis: &RedisServer) -> String {
    std::fs::create_dir(dir.join("run")).unwrap();
    let socket = dir.join("run").join("ratelimitd").join("ratelimitd.sock");
    assert!(PACKAGE.contains("\nlisten = \"/run/ratelimitd/ratelimitd.sock\"\n"));
    // The nginx workers' group: www-data on Debian, the tests' workers'
    // group here.
    let group = if common::is_root() { format!("socket_group = \"{}\"", common::WORKER_GROUP) } else { String::new() };
    PACKAGE
        .replacen("socket_group = \"www-data\"", &group, 1)
        .replacen("listen = \"/run/ratelimitd/ratelimitd.sock\"", &format!("listen = \"{}\"", socket.display()), 1)
        .replacen("url = \"redis://127.0.0.1:6379/0\"", &format!("url = \"{}\"", redis.url()), 1)
        .replacen("[metrics]\nlisten = \"127.0.0.1:9464\"\n", "", 1)
}

/// Before: `serve` exited 2 with `bind: No such file or directory` and no
/// hint, since nothing but systemd's socket unit made /run/ratelimitd.
/// Now the documented commands, run as written (but for the config's
/// path), check the file, start the daemon, which makes the directory with
/// the mode its socket asks for, answer a query, reload on `kill -HUP`
/// and stop on `kill -TERM`.
#[test]
fn the_documented_start_without_systemd_makes_the_socket_s_directory_and_serves() {
    let lines = without_systemd_lines();
    let serve = lines.iter().find(|l| l.starts_with("ratelimitd serve ")).expect("the serve line");
    let check = lines.iter().find(|l| l.starts_with("ratelimitd check-config ")).expect("the check-config line");
    assert!(lines.iter().any(|l| l.starts_with("kill -HUP $(pidof ratelimitd)")), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("kill -TERM $(pidof ratelimitd)")), "{lines:?}");

    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.path().join("ratelimitd.toml");
    // An admin socket (0600) beside the request socket: the directory must
    // still let the socket's group in.
    let admin = dir.path().join("run").join("ratelimitd").join("admin.sock");
    std::fs::write(&config, format!("{}\n[admin]\nlisten = \"{}\"\n", package_config(dir.path(), &redis), admin.display())).unwrap();
    let as_written = |line: &str| -> Vec<String> {
        let command = line.split(" 2>>").next().unwrap().split(" #").next().unwrap();
        command.split_whitespace().skip(1).map(|w| if w == "/etc/ratelimitd/ratelimitd.toml" { config.display().to_string() } else { w.to_string() }).collect()
    };

    let check_args = as_written(check);
    let (code, out, err) = ratelimitd(&check_args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{check}: {out}{err}");

    let log = dir.path().join("ratelimitd.log");
    let stderr = std::fs::File::create(&log).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(as_written(serve)).stderr(stderr);
    let mut daemon = ChildGuard::spawn("ratelimitd", &mut cmd, Some(log.clone()));
    let socket = dir.path().join("run").join("ratelimitd").join("ratelimitd.sock");
    daemon.wait_until("the socket accepts", Duration::from_secs(10), || std::os::unix::net::UnixStream::connect(&socket).is_ok());
    let run = socket.parent().unwrap();
    assert_eq!(std::fs::metadata(run).unwrap().permissions().mode() & 0o7777, 0o750, "socket_mode 0660: the directory lets the group search it");
    assert!(daemon.log().contains("made the socket's directory"), "{}", daemon.log());
    assert!(admin.exists(), "the admin socket is served in the same directory");

    let (code, out, err) = ratelimitd(&["query", "--socket", socket.to_str().unwrap(), "--key", "first-day", "--limit", "1", "--window-ms", "60000"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("allowed (source redis)"), "{out}");
    let (code, out, _) = ratelimitd(&["query", "--socket", socket.to_str().unwrap(), "--key", "first-day", "--limit", "1", "--window-ms", "60000"]);
    assert_eq!(code, 1, "the second is over the limit: {out}");

    daemon.signal(Signal::SIGHUP);
    daemon.wait_until("kill -HUP reloads", Duration::from_secs(10), || std::fs::read_to_string(&log).unwrap_or_default().contains("configuration reloaded"));
    // The section's first limited location, through real nginx (its
    // workers in the socket's group), as written but for its port.
    let location = without_systemd_nginx_server();
    let nginx = common::Nginx::start(&format!("{}\n{}", common::ops::snippet(&socket), location.replacen("listen 8080;", "listen 127.0.0.1:{PORT};", 1)));
    let agent = common::http::agent();
    let statuses: Vec<u16> = (0..3).map(|_| common::http::get(&agent, &nginx.url("/hello"), &[]).status).collect();
    assert_eq!(statuses, [200, 200, 429], "two a minute, then refused\n{}", nginx.error_log());
    let refused = common::http::get(&agent, &nginx.url("/hello"), &[]);
    assert_eq!(refused.header("ratelimit-remaining"), "0", "{:?}", refused.status);

    let status = daemon.terminate(Duration::from_secs(10));
    assert!(status.success(), "kill -TERM stops it cleanly: {status}\n{}", daemon.log());
    assert!(!socket.exists(), "the socket file is removed on exit");
}

/// Before: the line saying Redis is back ("redis link up") was held back
/// when it came within 10 s of the previous one (at start), so a log ended
/// on "cannot reach redis" while /healthz said ok. A recovery that follows
/// a logged failure is now always logged.
#[tokio::test]
async fn the_recovery_line_follows_a_logged_failure_however_soon_after_start() {
    let mut redis = RedisServer::start_unix();
    let d = Daemon::start(Some(&redis.url()), "timeout_ms = 500");
    let started = Instant::now();
    let mut c = d.client().await;
    let check = CheckArgs { on_error: FailPolicy::Open, ..args("recovery", 1_000_000, 60_000) };
    assert_eq!(c.check(&check).await.unwrap().source, Source::Redis);
    redis.kill();
    let failure = |log: &str| log.rfind("cannot reach redis").max(log.rfind("breaker open"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while failure(&d.log()).is_none() {
        assert!(Instant::now() < deadline, "the daemon logs the failure:\n{}", d.log());
        let _ = c.check(&check).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.check(&check).await.ok().map(|r| r.source) != Some(Source::Redis) {
        assert!(Instant::now() < deadline, "Redis decides again:\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let back_at = started.elapsed();
    wait_until("a recovery line after the last failure line", Duration::from_secs(5), || {
        let log = d.log();
        log.rfind("redis link up") > failure(&log)
    });
    eprintln!("Redis back {back_at:?} after the daemon's start");
}

/// Before: a reload error with several bad fields was one event written as
/// several lines (the second looked like an event of its own, without a
/// timestamp or level). Now one line, the fields separated by " | ".
#[test]
fn a_reload_error_is_one_log_line() {
    let d = Daemon::start(None, "");
    d.rewrite_config(&format!("{}\n[limits]\nmax_local_keys = 10\n[log]\nlevel = \"infoo\"\n", d.config_text()));
    d.signal(Signal::SIGHUP);
    wait_until("the reload is refused", Duration::from_secs(10), || d.log().contains("configuration reload failed"));
    let log = d.log();
    let line = log.lines().find(|l| l.contains("configuration reload failed")).unwrap();
    assert!(line.contains("limits.max_local_keys: 10 is below the minimum of 64") && line.contains(" | ") && line.contains("log.level: 'infoo'"), "{line}");
    let config = d.config.display().to_string();
    assert!(!log.lines().any(|l| l.starts_with(&config)), "no line is the rest of another:\n{log}");
}

/// Before: `line 2: invalid type: string "5", expected usize`, the first
/// error only, and an unknown field with the list of every valid one. Now
/// every error of the file, each with its line, its field (and policy) and,
/// for a misspelled name, the nearest valid one.
#[test]
fn a_toml_error_names_its_field_and_the_nearest_valid_name_and_every_error_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("typo.toml");
    std::fs::write(&file, "[server]\nmax_connections = \"5\"\nsocket_mod = \"0660\"\n\n[[policy]]\nname = \"login\"\nlimt = 5\nwindow = \"1m\"\n\n[redis]\nurl = \"redis://127.0.0.1:6379/0\"\nclock = \"redsi\"\n").unwrap();
    let (code, out, err) = ratelimitd(&["check-config", "--config", file.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}{err}");
    let f = file.display();
    assert_eq!(
        err,
        format!(
            "ratelimitd: {f}: line 2: server.max_connections: invalid type: string \"5\", expected an integer\n\
             {f}: line 3: server.socket_mod: unknown field `socket_mod`; did you mean `socket_mode`?\n\
             {f}: line 7: policy.limt: policy 'login': unknown field `limt`; did you mean `limit`?\n\
             {f}: line 12: redis.clock: unknown value `redsi`; did you mean `redis`?\n"
        )
    );
    // A name near none: serde's list of the valid ones stays.
    std::fs::write(&file, "[server]\nbacklog = 5\n").unwrap();
    let (code, _, err) = ratelimitd(&["check-config", "--config", file.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.starts_with(&format!("ratelimitd: {f}: line 2: server.backlog: unknown field `backlog`, expected one of `listen`, ")), "{err}");
}

/// Before: `check-config --nginx` passed `on_error = "close"`, and the
/// location then answered 500 (new() returns nil). Now every limiter built
/// from a literal table is checked by the Lua client's own validation.
#[test]
fn check_config_refuses_limiter_options_the_lua_client_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("ratelimitd.toml");
    std::fs::write(&toml, "[[policy]]\nname = \"login\"\nlimit = 5\nwindow = \"1m\"\n").unwrap();
    let conf = dir.path().join("nginx.conf");
    let nginx = |on_error: &str| {
        format!(
            "events {{}}\nhttp {{\n    init_worker_by_lua_block {{\n        local ratelimitd = require \"resty.ratelimitd\"\n        \
             login = ratelimitd.new{{ policy = \"login\", on_error = \"{on_error}\" }}\n        \
             slots = ratelimitd.concurrency({{ limit = 4, lease_ms = 30000 }})\n        \
             named = ratelimitd.new{{ policy = ngx.var.policy }}\n    }}\n}}\n"
        )
    };
    std::fs::write(&conf, nginx("close")).unwrap();
    let (code, out, err) = ratelimitd(&["check-config", "--config", toml.to_str().unwrap(), "--nginx", conf.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains(&format!("{}:5: new{{...}}: on_error must be 'open', 'closed' or 'local': the limiter is not built", conf.display())), "{out}{err}");
    assert!(out.contains("1 limiters have options new() refuses"), "{out}");

    std::fs::write(&conf, nginx("closed")).unwrap();
    let (code, out, err) = ratelimitd(&["check-config", "--config", toml.to_str().unwrap(), "--nginx", conf.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");

    // Without the client on luajit's path: said, and the rest checked.
    std::fs::write(&conf, nginx("close")).unwrap();
    let out = Command::new(BIN).args(["check-config", "--config", toml.to_str().unwrap(), "--nginx", conf.to_str().unwrap()]).env("LUA_PATH", "/nonexistent/?.lua").output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stderr.contains("is not on luajit's path") && stderr.contains("limiter options not checked"), "{stderr}");
    assert!(stdout.contains("policy \"login\": ok"), "{stdout}");
}

/// Before: `scripts/demo` built with `cargo build --quiet`, silent for the
/// whole first build (13 minutes on a fresh clone). Now it says a build
/// is starting and lets cargo show its progress.
#[test]
fn scripts_demo_shows_the_build_s_progress() {
    let demo = include_str!("../scripts/demo");
    let build = demo.lines().find(|l| l.starts_with("cargo build")).expect("the demo builds");
    assert!(!build.contains("--quiet") && !build.contains(" -q"), "{build}");
    assert!(demo.contains("building the release binary"), "a first build is announced");
}

/// Before: on a host without systemd the package's postinst started nothing
/// and said nothing. Now it says how to start the daemon. Run with stand-ins
/// for the commands that would change the host (user, owners, units).
#[test]
fn the_package_says_how_to_start_the_daemon_where_systemd_does_not_run() {
    if std::path::Path::new("/run/systemd/system").is_dir() {
        eprintln!("systemd runs here: postinst starts the units instead");
        return;
    }
    let stubs = tempfile::tempdir().unwrap();
    for cmd in ["getent", "adduser", "chown", "chmod", "deb-systemd-helper"] {
        let path = stubs.path().join(cmd);
        std::fs::write(&path, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = Command::new("sh")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/debian/postinst"))
        .arg("configure")
        .env("PATH", format!("{}:/usr/bin:/bin", stubs.path().display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("systemd is not running, so the daemon was not started") && stderr.contains("ratelimitd serve --config /etc/ratelimitd/ratelimitd.toml"), "{stderr}");
}
