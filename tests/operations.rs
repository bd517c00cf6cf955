//! Operating the daemon (docs/OPERATIONS.md): reloads that cannot silently
//! break traffic, /healthz, build and configuration metrics, the
//! configuration dump. Real processes: HTTP -> nginx (Lua module) ->
//! ratelimitd -> redis-server.

mod common;

use std::process::Command;
use std::time::Duration;

use common::http::agent;
use common::ops::{metrics, sample, snippet, SNIPPET};
use common::{is_root, wait_until, Daemon, Nginx, RedisServer, WORKER_GROUP};
use nix::sys::signal::Signal;

fn policies() -> String {
    common::rate_policies(&[("login", 100, "60s"), ("spare", 5, "60s")])
}

fn locations() -> String {
    common::ops::tenant_locations(&[("/login", r#"{ policy = "login", on_error = "closed" }"#)])
}

fn gateway(socket: &std::path::Path) -> Nginx {
    common::ops::gateway(socket, "", &locations())
}

fn daemon(redis: &RedisServer) -> Daemon {
    common::ops::daemon_with_metrics(redis, &policies())
}

fn status(url: &str) -> u16 {
    common::http::get(&agent(), url, &[("X-Tenant-Id", "t1")]).status
}

fn body(url: &str) -> (u16, String) {
    let r = common::http::get(&agent(), url, &[]);
    (r.status, r.body)
}

fn endpoint(d: &Daemon, path: &str) -> String {
    d.metrics_url().replace("/metrics", path)
}

fn config_hash(text: &str) -> String {
    let line = text.lines().find(|l| l.starts_with("ratelimitd_config_info{hash=\"")).unwrap_or_else(|| panic!("no config_info in\n{text}"));
    line["ratelimitd_config_info{hash=\"".len()..].split('"').next().unwrap().to_string()
}

#[test]
fn a_reload_renaming_a_policy_in_use_is_refused_with_its_reason_and_sigusr1_forces_it() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let nginx = gateway(&d.socket);
    assert_eq!(status(&nginx.url("/login")), 200);
    let first = metrics(&d);
    let original = d.config_text();

    // Rename `login` (in use) and drop `spare` (never used): refused, for `login` only.
    let renamed = original.replace("name = \"login\"", "name = \"logins\"");
    d.rewrite_config(&renamed.replace("name = \"spare\"\nlimit = 5\nwindow = \"60s\"\n", "name = \"spare2\"\nlimit = 5\nwindow = \"60s\"\n"));
    d.signal(Signal::SIGHUP);
    wait_until("reload refused", Duration::from_secs(5), || d.log().contains("configuration reload refused"));
    let log = d.log();
    let line = log.lines().find(|l| l.contains("configuration reload refused")).unwrap();
    assert!(line.contains("login (last request") && !line.contains("spare"), "{line}");
    assert!(line.contains("SIGUSR1"), "the line says how to force it: {line}");
    assert!(!log.contains("configuration reloaded"), "{log}");
    // The old configuration serves on: /login still decided by its policy.
    assert_eq!(status(&nginx.url("/login")), 200);
    let text = metrics(&d);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_refused_total{reason=\"policy_in_use\"} "), 1.0);
    assert_eq!(sample(&text, "ratelimitd_config_last_reload_successful "), 0.0);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_total "), 0.0);
    assert_eq!(sample(&text, "ratelimitd_policy_requests_total{policy=\"login\",outcome=\"admitted\"} "), 2.0);
    assert_eq!(config_hash(&text), config_hash(&first), "the configuration in force did not change");

    // Removing a policy that decided nothing is a plain reload.
    d.rewrite_config(&original.replace("name = \"spare\"", "name = \"spare2\""));
    d.signal(Signal::SIGHUP);
    wait_until("reload applied", Duration::from_secs(5), || d.log().contains("configuration reloaded"));
    let text = metrics(&d);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_total "), 1.0);
    assert_eq!(sample(&text, "ratelimitd_config_last_reload_successful "), 1.0);
    assert_ne!(config_hash(&text), config_hash(&first));

    // SIGUSR1 forces the rename: /login now names a policy the daemon lacks
    // and gets its fail policy (closed: 503), as the refusal warned.
    d.rewrite_config(&renamed);
    d.signal(Signal::SIGUSR1);
    wait_until("forced reload applied", Duration::from_secs(5), || d.log().matches("configuration reloaded").count() == 2);
    assert!(d.log().contains("forced reload removes policies in use"), "{}", d.log());
    assert_eq!(status(&nginx.url("/login")), 503);
    let text = metrics(&d);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_total "), 2.0);
    assert_eq!(sample(&text, "ratelimitd_policy_unknown_requests_total "), 1.0);
}

#[test]
fn a_reload_removing_a_policy_nginx_described_at_worker_start_is_refused_before_its_first_request() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    // `spare` is named by a limiter built at worker start, and never asked a decision.
    let init = "init_worker_by_lua_block { spare = require(\"resty.ratelimitd.limiters\").build{ spare = { policy = \"spare\", on_error = \"open\" } } }";
    let nginx = common::ops::gateway(&d.socket, init, &locations());
    wait_until("nginx described spare", Duration::from_secs(10), || nginx.error_log().contains("policy \"spare\" described by the daemon"));
    let text = metrics(&d);
    assert_eq!(sample(&text, "ratelimitd_policy_requests_total{policy=\"spare\",outcome=\"admitted\"} "), 0.0, "spare decided nothing");
    let original = d.config_text();

    let without_spare = original.replace("name = \"spare\"", "name = \"spare2\"");
    d.rewrite_config(&without_spare);
    d.signal(Signal::SIGHUP);
    wait_until("reload refused", Duration::from_secs(5), || d.log().contains("configuration reload refused"));
    let log = d.log();
    let line = log.lines().find(|l| l.contains("configuration reload refused")).unwrap();
    assert!(line.contains("spare (no request yet, named by nginx: described") && !line.contains("login"), "{line}");
    assert!(!log.contains("configuration reloaded"), "{log}");
    let text = metrics(&d);
    assert_eq!(sample(&text, "ratelimitd_config_reloads_refused_total{reason=\"policy_in_use\"} "), 1.0);

    // SIGUSR1 forces it.
    d.signal(Signal::SIGUSR1);
    wait_until("forced reload applied", Duration::from_secs(5), || d.log().contains("configuration reloaded"));
    assert!(d.log().contains("forced reload removes policies in use"), "{}", d.log());
}

#[test]
fn healthz_follows_the_backend_and_the_new_metrics_pass_promtool() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    assert_eq!(body(&endpoint(&d, "/healthz")), (200, "ok\n".to_string()));

    let (code, dump) = body(&endpoint(&d, "/config"));
    assert_eq!(code, 200);
    // In the file's own terms (was a Rust Debug dump: `socket_mode: 432`,
    // `timeout: 500ms` as a Duration): TOML that reads back.
    assert!(dump.contains("[[policy]]\nname = \"login\"\nlimit = 100\nwindow = \"60s\"\n"), "durations as written: {dump}");
    assert!(dump.contains("[server]\n") && dump.contains("\nsocket_mode = \"0660\"\n") && dump.contains("\ntimeout = \"500ms\"\n"), "{dump}");
    let shown = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(shown.path(), &dump).unwrap();
    let (code, out) = ratelimitd(&["check-config", "--config", shown.path().to_str().unwrap()]);
    assert_eq!(code, 0, "GET /config reads back as a configuration: {out}\n{dump}");

    let text = metrics(&d);
    assert_eq!(sample(&text, &format!("ratelimitd_build_info{{version=\"{}\",protocol=\"1\"}} ", env!("CARGO_PKG_VERSION"))), 1.0);
    assert_eq!(sample(&text, "ratelimitd_config_last_reload_successful "), 1.0);
    let loaded = sample(&text, "ratelimitd_config_last_reload_success_timestamp_seconds ");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(loaded <= now && loaded > now - 120.0, "loaded at {loaded}, now {now}");
    let hash = config_hash(&text);
    assert_eq!(hash.len(), 16, "{hash}");

    match Command::new("promtool").args(["check", "metrics"]).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn() {
        Ok(mut child) => {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
            let out = child.wait_with_output().unwrap();
            let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "promtool check metrics: {said}");
            // Lint remarks are style; any remark about the new metrics is a defect.
            for name in ["build_info", "config_info", "config_last_reload", "config_reloads_refused"] {
                assert!(!said.contains(name), "promtool about {name}: {said}");
            }
        }
        Err(e) => panic!("promtool not found ({e}): apt-get install prometheus (scripts/lib.sh apt_install promtool:prometheus)"),
    }

    // Redis gone: not ready, with the reason, once the daemon knows.
    drop(redis);
    let mut client_errors = 0;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    wait_until("healthz 503", Duration::from_secs(10), || {
        // Requests are what notice a dead link soonest.
        rt.block_on(async {
            let mut c = d.client().await;
            if c.check(&common::args("k", 10, 1000)).await.is_err() {
                client_errors += 1;
            }
        });
        body(&endpoint(&d, "/healthz")).0 == 503
    });
    let (_, why) = body(&endpoint(&d, "/healthz"));
    assert!(why.starts_with("not ready: "), "{why}");
    assert_eq!(client_errors, 0, "the daemon answered every request with its fail policy");
}

fn ratelimitd(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn check_config_with_nginx_lists_the_names_nginx_uses_and_fails_on_a_missing_one() {
    let root = env!("CARGO_MANIFEST_DIR");
    let (toml, conf) = (format!("{root}/examples/tenant-api/ratelimitd.toml"), format!("{root}/examples/tenant-api/nginx.conf"));
    let (code, out) = ratelimitd(&["check-config", "--config", &toml, "--nginx", &conf]);
    assert_eq!(code, 0, "{out}");
    for name in ["per_ip", "per_tenant", "global", "per_tenant_next", "login_failures"] {
        assert!(out.contains(&format!("policy \"{name}\": ok")), "{name}: {out}");
    }
    assert!(out.contains("all 5 policy names used by"), "{out}");

    // The same nginx side against a TOML where login_failures was renamed.
    let dir = tempfile::tempdir().unwrap();
    let renamed = dir.path().join("ratelimitd.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    assert!(text.contains("name = \"login_failures\""));
    std::fs::write(&renamed, text.replace("name = \"login_failures\"", "name = \"logins\"")).unwrap();
    let (code, out) = ratelimitd(&["check-config", "--config", renamed.to_str().unwrap(), "--nginx", &conf]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("nginx.conf:31: policy \"login_failures\": NOT in the ratelimitd configuration"), "{out}");
    assert!(out.contains("1 of 5 policy names used by"), "{out}");

    // `config show` prints what GET /config serves, from the file.
    let (code, out) = ratelimitd(&["config-show", "--config", &toml]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("name = \"login_failures\""), "{out}");
}

#[test]
fn metrics_are_moved_by_a_reload_and_a_taken_port_keeps_the_running_endpoint() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let old = d.metrics_url();
    assert_eq!(body(&endpoint(&d, "/healthz")).0, 200);
    // A port held by this test: the reload cannot take it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let old_port: u16 = old.trim_start_matches("http://127.0.0.1:").trim_end_matches("/metrics").parse().unwrap();
    let text = d.config_text();
    d.rewrite_config(&text.replace(&format!("127.0.0.1:{old_port}"), &format!("127.0.0.1:{taken_port}")));
    d.signal(Signal::SIGHUP);
    wait_until("bind refused", Duration::from_secs(5), || d.log().contains("the new [metrics] listen address cannot be bound"));
    assert_eq!(body(&endpoint(&d, "/healthz")).0, 200, "the running endpoint kept");

    // A free port (released by the test just before): moved there.
    drop(taken);
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let new_port = free.local_addr().unwrap().port();
    drop(free);
    d.rewrite_config(&text.replace(&format!("127.0.0.1:{old_port}"), &format!("127.0.0.1:{new_port}")));
    d.signal(Signal::SIGHUP);
    wait_until("second reload", Duration::from_secs(5), || d.log().matches("configuration reloaded").count() == 2);
    let (code, _) = body(&format!("http://127.0.0.1:{new_port}/healthz"));
    assert_eq!(code, 200);
    wait_until("old endpoint closed", Duration::from_secs(5), || agent().get(&old).call().is_err());
}

#[test]
fn a_limiter_that_cannot_be_built_answers_500_in_its_own_location_while_the_others_serve() {
    const EXAMPLE: &str = include_str!("../nginx/example.conf");
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let snippet = snippet(&d.socket);
    // The shipped example with one mistake: `pay` fails over to `local` without its quota.
    assert!(EXAMPLE.contains("            local_limit = 10,\n"));
    let example = EXAMPLE.replacen("            local_limit = 10,\n", "", 1).replacen("listen 8080;", "listen 127.0.0.1:{PORT};", 1).replacen("server 127.0.0.1:9000;", "server 127.0.0.1:{PORT:app};", 1);
    let nginx = Nginx::start(&format!("{snippet}\n{example}\nserver {{ listen 127.0.0.1:{{PORT:app}}; location / {{ return 200 \"ok\\n\"; }} }}\n"));
    assert_eq!(status(&nginx.url("/order")), 200);
    assert_eq!(status(&nginx.url("/search")), 200);
    assert_eq!(status(&nginx.url("/pay")), 500);
    assert_eq!(status(&nginx.url("/order")), 200, "still serving after the broken location");
    let log = nginx.error_log();
    let crit: Vec<&str> = log.lines().filter(|l| l.contains("[crit]")).collect();
    assert!(!crit.is_empty() && crit.iter().all(|l| l.contains("ratelimitd: limiter \"pay\" not built: ") && l.contains("local_limit")), "{log}");
    assert!(log.contains("limiter_not_built key=pay"), "each request of the broken location is logged (rate-limited): {log}");
    assert!(!log.contains("attempt to index"), "{log}");
}

#[test]
fn a_bare_number_window_says_which_unit_to_write_and_fail_policy_is_read_as_on_error_with_a_deprecation_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ratelimitd.toml");
    let policy = |window: &str, fail: &str| format!("[server]\nlisten = \"{}/s.sock\"\n[[policy]]\nname = \"login\"\nlimit = 5\nwindow = {window}\n{fail}\nlocal_limit = 2\n", dir.path().display());
    std::fs::write(&file, policy("60000", "on_error = \"local\"")).unwrap();
    let (code, out) = ratelimitd(&["check-config", "--config", file.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("policy.window: policy 'login': 60000 has no unit: write \"60000ms\" (or \"60s\""), "{out}");

    std::fs::write(&file, policy("\"60s\"", "fail_policy = \"local\"")).unwrap();
    let (code, out) = ratelimitd(&["check-config", "--config", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("deprecated: policy 'login': fail_policy is the old name of on_error"), "{out}");

    std::fs::write(&file, policy("\"60s\"", "fail_policy = \"local\"\non_error = \"local\"")).unwrap();
    let (code, out) = ratelimitd(&["check-config", "--config", file.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("policy.on_error: policy 'login': give on_error only"), "{out}");
}

#[test]
fn a_redis_failure_line_names_the_policy_and_the_fail_policy_and_escapes_the_key() {
    use ratelimitd::protocol::{FailPolicy, PolicyCheckArgs};
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    drop(redis);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let key = "tenant-\u{202e}1";
    rt.block_on(async {
        let mut c = d.client().await;
        c.check_policy(&PolicyCheckArgs { policy: b"login", key: key.as_bytes(), cost: 1, on_error: FailPolicy::Open, local_limit: 0 }).await.unwrap();
    });
    wait_until("failure line", Duration::from_secs(5), || d.log().contains("the request's fail policy decides"));
    let log = d.log();
    let line = log.lines().find(|l| l.contains("the request's fail policy decides")).unwrap();
    assert!(line.contains("on_error=\"open\"") && line.contains("policy=\"login\""), "{line}");
    assert!(line.contains(" key=tenant-\\u{202e}1 "), "the bidi override is shown, not obeyed: {line}");
    assert!(!line.contains("\u{5}login"), "no raw length byte: {line}");
}

/// Load through nginx at the shipped snippet's timeouts (connect and send
/// 20 ms, read 50 ms) and the shipped `redis.timeout_ms = 20`, across one
/// restart of the daemon; returns (requests, failed) and the first failures.
/// Requests sent through nginx while the daemon restarts: how many were
/// sent, each failure's time and status, and when the daemon went down and
/// was serving again (all from the load's start).
fn restart_under_load(activated: bool) -> (u64, Vec<(Duration, u16)>, Duration, Duration) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let socket = dir.path().join("ratelimitd.sock");
    let config = dir.path().join("ratelimitd.toml");
    let group = if is_root() { format!("socket_group = \"{WORKER_GROUP}\"\n") } else { String::new() };
    std::fs::write(&config, format!("[server]\nlisten = \"{}\"\nsocket_mode = \"0666\"\n{group}[redis]\nurl = \"{}\"\ntimeout = \"20ms\"\n", socket.display(), redis.url())).unwrap();
    let log = dir.path().join("daemon.log");
    // The socket unit's part, for the activated case: bound once, kept across the restart.
    let listener = activated.then(|| {
        let l = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
        l
    });
    let spawn = || {
        use command_fds::{CommandFdExt, FdMapping};
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
        cmd.args(["serve", "--config"]).arg(&config).stderr(file);
        if let Some(l) = &listener {
            let fd: std::os::fd::OwnedFd = l.try_clone().unwrap().into();
            cmd.env("LISTEN_FDS", "1").env_remove("LISTEN_PID").fd_mappings(vec![FdMapping { parent_fd: fd, child_fd: 3 }]).unwrap();
        }
        let child = common::ChildGuard::spawn("ratelimitd", &mut cmd, Some(log.clone()));
        wait_until("daemon serving", Duration::from_secs(10), || std::os::unix::net::UnixStream::connect(&socket).is_ok() && std::fs::read_to_string(&log).unwrap_or_default().matches("redis backend ready").count() >= 1);
        child
    };
    let mut daemon = spawn();
    // The shipped snippet, unchanged but for the socket path.
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", socket.display()), 1);
    assert!(snippet.contains("read_timeout = 50,") && snippet.contains("connect_timeout = 20,"));
    let nginx = Nginx::start(&format!(
        "{snippet}\nserver {{\n listen 127.0.0.1:{{PORT}};\n location /r {{ access_by_lua_block {{ require(\"resty.ratelimitd\").limit{{ key = ngx.var.arg_k, limit = 1000000, window_ms = 60000, on_error = \"closed\" }} }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n}}\n"
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(Mutex::new(Vec::new())));
    let t0 = std::time::Instant::now();
    let load: Vec<_> = (0..8)
        .map(|t| {
            let (url, stop, sent, failed) = (nginx.url(&format!("/r?k=c{t}")), stop.clone(), sent.clone(), failed.clone());
            std::thread::spawn(move || {
                let a = agent();
                while !stop.load(Ordering::Relaxed) {
                    let code = a.get(&url).call().map(|r| r.status().as_u16()).unwrap_or(0);
                    if code != 200 {
                        failed.lock().unwrap().push((t0.elapsed(), code));
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    wait_until("load running", Duration::from_secs(10), || sent.load(Ordering::Relaxed) >= 500);
    let down = t0.elapsed();
    daemon.terminate(Duration::from_secs(10));
    daemon = spawn();
    let up = t0.elapsed();
    // 500 answered after the restart: a slow start under a load spike
    // lengthens the gap, not the part of the run measured after it.
    let answered = || sent.load(Ordering::Relaxed) - failed.lock().unwrap().len() as u64;
    let after = answered();
    wait_until("load after the restart", Duration::from_secs(10), || answered() >= after + 500);
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    daemon.terminate(Duration::from_secs(10));
    for l in nginx.error_log().lines().filter(|l| l.contains("ratelimitd: ")).take(5) {
        eprintln!("nginx: {l}");
    }
    let failed = failed.lock().unwrap().clone();
    (sent.load(Ordering::Relaxed), failed, down, up)
}

#[test]
fn a_socket_activated_restart_under_load_at_the_shipped_timeouts_is_measured() {
    let (sent, failed, down, up) = restart_under_load(true);
    eprintln!("socket-activated restart at the shipped timeouts: {} of {sent} requests failed ({:?}); down at {down:?}, serving again at {up:?}", failed.len(), &failed[..failed.len().min(10)]);
    // Measured 0 of about 1020 in 10 of 10 runs (8 clients, the debug
    // build, a 2-core host at load 7-10 from other builds); while the fix
    // was under way, up to 9: requests queued in the socket longer than the
    // 50 ms read timeout while the new daemon starts ("receive: timeout"),
    // and Redis calls past the 20 ms deadline under that load. The connections the old daemon closed unanswered are
    // sent again by the client (conn.lua). Each failure gets its fail policy
    // (closed: 503), never a 500 (docs/OPERATIONS.md §3).
    assert!(failed.iter().all(|&(_, c)| c == 503), "only fail-closed answers: {failed:?}");
    // The socket stays bound, so a client never sees it refused: each of
    // the 8 fails about once per 50 ms read timeout while no daemon
    // answers (from the stop until 100 ms after the new one serves; 8-16
    // in a 125-140 ms gap beside a parallel build), and the bound allows
    // twice that. A bound on the gap's length, not on the host's load,
    // which only lengthens the gap; failures outside it are Redis calls
    // past the 20 ms deadline under load (printed).
    let window = (up + Duration::from_millis(100)).saturating_sub(down);
    let during: Vec<_> = failed.iter().filter(|&&(at, _)| at >= down && at <= up + Duration::from_millis(100)).collect();
    let most = 2 * 8 * (window.as_millis() as usize / 50 + 1);
    eprintln!("{} failures in the {window:?} around the restart (at most {most}), {} outside it", during.len(), failed.len() - during.len());
    assert!(during.len() <= most, "{} failures in the {window:?} around the restart: more than twice one per client per read timeout ({most}): {during:?}", during.len());
}

#[test]
fn a_restart_under_load_without_socket_activation_is_measured() {
    let (sent, failed, down, up) = restart_under_load(false);
    eprintln!("restart without socket activation at the shipped timeouts: {} of {sent} requests failed ({:?}); down at {down:?}, serving again at {up:?}", failed.len(), &failed[..failed.len().min(10)]);
    // Between the old daemon's exit and the new one's bind the socket is
    // absent: the client tries again for up to connect + read timeout
    // (70 ms) within 1 s of its last good connect, instead of pausing
    // connects for 50 ms. Measured 0 of about 1025 in 7 of 10 runs, 1, 3
    // and 303 in the others (before: 103 to 178 of about 1090): a gap
    // longer than 70 ms (the debug build takes 16-36 ms from exec to bind
    // on this host, plus this harness's 10 ms poll; the 303 was a load
    // spike, load average 10 on 2 cores, that kept the new daemon from its
    // socket for about a second), and read timeouts under load. A count
    // says how fast nginx answers 503 while the socket is absent (once the
    // client pauses its connects, each is a few hundred µs: 463-728 in a
    // 136 ms gap beside a parallel build), so the test holds what does not
    // depend on the host's load: the service comes back (500 answered
    // after the restart, within 10 s, in `restart_under_load`), and every
    // failure is its fail policy (closed: 503), never a 500. Failures
    // outside the gap are Redis calls past the shipped 20 ms deadline
    // under load, the same 503; their count is printed.
    assert!(failed.iter().all(|&(_, c)| c == 503), "only fail-closed answers, never a 500: {failed:?}");
    let late = up + Duration::from_secs(1);
    let outside = failed.iter().filter(|&&(at, _)| at < down || at > late).count();
    eprintln!("{} failures during the gap (or within 1 s after it), {outside} outside it (the 20 ms Redis deadline under load)", failed.len() - outside);
}

#[test]
fn inspect_and_reset_of_an_inline_key_without_a_window_are_refused_instead_of_scanning_the_whole_redis() {
    let redis = RedisServer::start_unix();
    let d = daemon(&redis);
    let config = d.config.to_str().unwrap();
    let scans = || -> bool {
        let stats: String = redis::cmd("INFO").arg("commandstats").query(&mut redis.conn()).unwrap();
        stats.contains("cmdstat_scan:")
    };
    for cmd in ["inspect", "reset"] {
        let (code, out) = ratelimitd(&[cmd, "--config", config, "--key", "t1"]);
        assert_eq!(code, 2, "{cmd}: {out}");
        assert!(out.contains("--key t1 names no window: give --policy NAME (the policy's window), or --window-ms MS"), "{cmd}: {out}");
    }
    assert!(!scans(), "refused before any SCAN");
    // The policy's window, or the inline one named: no SCAN either.
    assert_eq!(ratelimitd(&["inspect", "--config", config, "--policy", "login", "--key", "t1", "--json"]).0, 0);
    assert_eq!(ratelimitd(&["inspect", "--config", config, "--key", "t1", "--window-ms", "60000", "--json"]).0, 0);
    assert!(!scans());
    // Asked for: every window of the key, found by SCAN.
    let (code, out) = ratelimitd(&["inspect", "--config", config, "--key", "t1", "--scan", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert!(scans());
}

#[test]
fn a_socket_activated_daemon_started_while_redis_is_down_answers_queued_requests_at_once() {
    use command_fds::{CommandFdExt, FdMapping};
    use ratelimitd::protocol::{Decision, ErrorCode, Source};
    use std::time::Instant;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("ratelimitd.sock");
    let config = dir.path().join("ratelimitd.toml");
    // Redis is down: nothing listens on its socket, every connect is refused.
    std::fs::write(&config, format!("[server]\nlisten = \"{}\"\n[redis]\nurl = \"unix://{}/redis.sock\"\ntimeout_ms = 20\n", socket.display(), dir.path().display())).unwrap();
    // The socket unit's part: bound and listening before the daemon starts.
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let log = dir.path().join("daemon.log");
    let fd: std::os::fd::OwnedFd = listener.try_clone().unwrap().into();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
    cmd.args(["serve", "--config"]).arg(&config).stderr(std::fs::File::create(&log).unwrap());
    cmd.env("LISTEN_FDS", "1").env_remove("LISTEN_PID").fd_mappings(vec![FdMapping { parent_fd: fd, child_fd: 3 }]).unwrap();
    let started = Instant::now();
    let _daemon = common::ChildGuard::spawn("ratelimitd", &mut cmd, Some(log.clone()));
    // A request queued in the socket as the daemon starts, as nginx's are.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let r = rt.block_on(async {
        let mut c = ratelimitd::client::Client::connect(&socket).await.unwrap();
        c.check(&common::args("k", 10, 1000)).await.unwrap()
    });
    let answered = started.elapsed();
    eprintln!("answered {answered:?} after the daemon was started with Redis down");
    // Its fail policy (closed) at once: the breaker is open until Redis answers.
    assert_eq!((r.decision, r.source, r.error), (Decision::Denied, Source::FailClosed, ErrorCode::CircuitOpen));
    // It used to wait READY_WAIT (2 s) for a Redis that refuses. The bound
    // is the process's start on a loaded 2-core host, not a Redis wait.
    assert!(answered < Duration::from_millis(1000), "answered after {answered:?}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    assert!(std::fs::read_to_string(&log).unwrap().contains("redis not reachable yet"));
}

/// The shell lines of docs/OPERATIONS.md's first day ("Start here" and §1)
/// that run `ratelimitd` or `curl`, as an operator copies them: without
/// `sudo ` and without the trailing comment; each with the comment line
/// under it, if any (the output the doc shows).
fn first_day_commands(doc: &str) -> Vec<(String, Option<String>)> {
    let first_day = &doc[doc.find("## Start here").unwrap()..doc.find("\n## 2. ").unwrap()];
    let mut out = Vec::new();
    for block in first_day.split("```").skip(1).step_by(2).filter(|b| b.starts_with("sh\n")) {
        let lines: Vec<&str> = block.lines().skip(1).collect();
        for (i, line) in lines.iter().enumerate() {
            let line = line.strip_prefix("sudo ").unwrap_or(line);
            if line.starts_with("ratelimitd ") || line.starts_with("curl ") {
                let command = line.split(" #").next().unwrap().trim().to_string();
                let shown = lines.get(i + 1).and_then(|l| l.strip_prefix("# ")).map(str::to_string);
                out.push((command, shown));
            }
        }
    }
    out
}

#[test]
fn the_first_day_commands_of_operations_md_work_with_the_package_config() {
    const PACKAGE: &str = include_str!("../debian/ratelimitd.toml");
    const DOC: &str = include_str!("../docs/OPERATIONS.md");
    // The package's config as installed, but for the socket, Redis and the
    // metrics port (the test's own; the doc's 9464 is checked below).
    assert!(PACKAGE.contains("[server]\n") && PACKAGE.contains("\nlisten = \"/run/ratelimitd/ratelimitd.sock\"\n"));
    assert!(PACKAGE.contains("\n[metrics]\nlisten = \"127.0.0.1:9464\"\n"), "metrics on loopback in the package's config");
    let redis = RedisServer::start_unix();
    let mut config = PACKAGE.replacen("[server]\n", "", 1).replacen("listen = \"/run/ratelimitd/ratelimitd.sock\"\n", "", 1).replacen("[metrics]\nlisten = \"127.0.0.1:9464\"\n", "", 1);
    config = config.replacen("url = \"redis://127.0.0.1:6379/0\"", &format!("url = \"{}\"", redis.url()), 1);
    if !is_root() {
        config = config.replacen(&format!("socket_group = \"{WORKER_GROUP}\"\n"), "", 1);
    }
    let d = Daemon::start_config_with_metrics(&config);
    let old_spellings: Vec<String> = d.log().lines().filter(|l| l.contains("old spelling")).map(str::to_string).collect();
    assert!(old_spellings.is_empty(), "the package's config uses no old spelling: {old_spellings:?}");
    let dir = tempfile::tempdir().unwrap();
    let nginx_conf = dir.path().join("nginx.conf");
    std::fs::write(dir.path().join("ratelimitd.conf"), SNIPPET).unwrap();
    std::fs::write(&nginx_conf, format!("events {{}}\nhttp {{\n include {}/ratelimitd.conf;\n}}\n", dir.path().display())).unwrap();

    let commands = first_day_commands(DOC);
    assert!(commands.len() >= 5, "{commands:?}");
    let mut ran = Vec::new();
    for (command, shown) in &commands {
        let words: Vec<&str> = command.split_whitespace().collect();
        match words[0] {
            "curl" if command.contains("http://127.0.0.1:9464/") => {
                let path = &command[command.find("http://127.0.0.1:9464").unwrap() + "http://127.0.0.1:9464".len()..];
                let (code, text) = body(&endpoint(&d, path));
                assert_eq!((code, text.as_str()), (200, "ok\n"), "{command}");
            }
            // Through nginx and the example server: tests/rock.rs and tests/nginx.rs.
            "curl" => assert!(command.contains("http://localhost/order"), "a first-day command this test does not know: {command}"),
            _ => {
                let mut args: Vec<String> = words[1..].iter().map(|w| w.to_string()).collect();
                for a in args.iter_mut().filter(|a| *a == "/etc/nginx/nginx.conf") {
                    *a = nginx_conf.display().to_string();
                }
                match args[0].as_str() {
                    "query" => args.extend(["--socket".to_string(), d.socket.display().to_string()]),
                    _ => args.extend(["--config".to_string(), d.config.display().to_string()]),
                }
                let out = Command::new(env!("CARGO_BIN_EXE_ratelimitd")).args(&args).output().unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert!(out.status.success(), "{command}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
                if let Some(shown) = shown {
                    // The doc's output, but for the reset time (ms the run takes).
                    let stable = shown.split(" reset_ms=").next().unwrap();
                    assert!(stdout.starts_with(stable), "{command}: the doc shows {shown:?}, the daemon says {stdout:?}");
                }
            }
        }
        ran.push(words[..2].join(" "));
    }
    for needed in ["ratelimitd query", "ratelimitd reset", "ratelimitd check-config", "curl -s"] {
        assert!(ran.iter().any(|r| r == needed), "{needed} not among {ran:?}");
    }
    // `systemctl reload ratelimitd` is SIGHUP; `systemctl kill -s USR1` the forced reload.
    let unit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/systemd/ratelimitd.service")).unwrap();
    assert!(unit.contains("\nExecReload=/bin/kill -HUP $MAINPID\n"), "{unit}");
}
