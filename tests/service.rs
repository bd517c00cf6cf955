//! Running as a service: systemd socket activation across a restart under
//! load, sd_notify, the metrics endpoint, log formats, and the admin
//! commands, all with the real binary.

mod common;

use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use command_fds::{CommandFdExt, FdMapping};
use common::{args, ChildGuard, Daemon, RedisServer};
use ratelimitd::client::{Client, ClientError};
use ratelimitd::protocol::{Decision, Source};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

/// Starts the daemon the way systemd does with a socket unit: the listening
/// socket is fd 3 and LISTEN_FDS=1.
fn spawn_activated(listener: &UnixListener, config: &std::path::Path, log: &std::path::Path) -> ChildGuard {
    let fd: OwnedFd = listener.try_clone().unwrap().into();
    let file = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--config"]).arg(config).env("LISTEN_FDS", "1").env_remove("LISTEN_PID").stderr(file);
    cmd.fd_mappings(vec![FdMapping { parent_fd: fd, child_fd: 3 }]).unwrap();
    ChildGuard::spawn("ratelimitd (socket-activated)", &mut cmd, Some(log.to_path_buf()))
}

/// How long the daemon may take to exit on SIGTERM.
const EXIT_LIMIT: Duration = Duration::from_secs(10);

/// One request on a fresh connection; a connection the old daemon closed
/// before reading the request is retried once, as the Lua client does.
async fn one_request(path: &std::path::Path) -> Result<Decision, String> {
    for _ in 0..2 {
        let mut c = Client::connect(path).await.map_err(|e| format!("connect: {e}"))?;
        // Bounded: a daemon that ignored the passed socket would leave it unserved.
        match tokio::time::timeout(Duration::from_secs(5), c.check(&args("activated", 1_000_000, 60_000))).await {
            Err(_) => return Err("no answer within 5 s".into()),
            Ok(Ok(r)) => return Ok(r.decision),
            Ok(Err(ClientError::Closed)) => continue,
            Ok(Err(ClientError::Io(e))) if matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset) => continue,
            Ok(Err(e)) => return Err(e.to_string()),
        }
    }
    Err("closed twice".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_activation_restart_under_load_loses_no_connection() {
    let redis = RedisServer::start_unix();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("activated.sock");
    // The socket unit's part: bind and listen, once, for the whole test.
    let listener = UnixListener::bind(&path).unwrap();
    let config = dir.path().join("ratelimitd.toml");
    // server.listen names another path: with LISTEN_FDS it must not be used.
    std::fs::write(&config, format!("[server]\nlisten = \"{}\"\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n", dir.path().join("unused.sock").display(), redis.url())).unwrap();
    let log = dir.path().join("daemon.log");
    let mut daemon = spawn_activated(&listener, &config, &log);

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(std::sync::Mutex::new(Vec::new())));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (stop, ok, errors, path) = (stop.clone(), ok.clone(), errors.clone(), path.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match one_request(&path).await {
                    Ok(Decision::Allowed) => ok.fetch_add(1, Ordering::Relaxed),
                    Ok(other) => panic!("unexpected decision {other:?}"),
                    Err(e) => {
                        errors.lock().unwrap().push(e);
                        0
                    }
                };
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = ok.load(Ordering::Relaxed);
    // Restart twice: stop the old daemon, then start a new one on the same socket.
    for _ in 0..2 {
        daemon.terminate(EXIT_LIMIT);
        tokio::time::sleep(Duration::from_millis(100)).await; // attempts queue in the kernel meanwhile
        daemon = spawn_activated(&listener, &config, &log);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let errors = errors.lock().unwrap();
    assert!(errors.is_empty(), "{} failed requests, e.g. {:?}", errors.len(), errors.first());
    assert!(ok.load(Ordering::Relaxed) > before + 100, "requests kept flowing across the restarts");
    assert!(path.exists(), "the daemon leaves systemd's socket file alone");
    assert!(!dir.path().join("unused.sock").exists());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("LISTEN_FDS"), "{text}");
    daemon.terminate(EXIT_LIMIT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sd_notify_ready_reloading_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let socket = dir.path().join("d.sock");
    let config = dir.path().join("c.toml");
    std::fs::write(&config, format!("[server]\nlisten = \"{}\"\n", socket.display())).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--config"]).arg(&config).env("NOTIFY_SOCKET", &notify_path).stderr(Stdio::null());
    let mut child = ChildGuard::spawn("ratelimitd", &mut cmd, None);
    let mut buf = [0u8; 512];
    let mut next = || {
        let n = notify.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let ready = next();
    assert!(ready.contains("READY=1"), "{ready}");
    assert!(socket.exists(), "READY only once the socket is there");
    child.signal(nix::sys::signal::Signal::SIGHUP);
    let reloading = next();
    assert!(reloading.contains("RELOADING=1") && reloading.contains("MONOTONIC_USEC="), "{reloading}");
    assert!(next().contains("READY=1"));
    child.terminate(EXIT_LIMIT);
    assert!(next().contains("STOPPING=1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_decisions_failures_and_breaker() {
    let mut redis = RedisServer::start_unix();
    // The metrics port is confirmed to be held by this daemon.
    let d = Daemon::start_config_with_metrics(&format!("[redis]\nurl = \"{}\"\ntimeout_ms = 500\n", redis.url()));
    let mut c = d.client().await;
    for _ in 0..3 {
        assert_eq!(c.check(&args("m", 2, 60_000)).await.unwrap().source, Source::Redis);
    }
    c.send_raw(&[0, 0, 0, 0]).await.unwrap(); // an empty frame: MALFORMED
    let _ = c.read_response().await.unwrap();
    let url = d.metrics_url();
    let scrape = move || -> String {
        let mut r = ureq::get(&url).call().unwrap();
        assert_eq!(r.headers().get("content-type").unwrap().to_str().unwrap(), "text/plain; version=0.0.4; charset=utf-8");
        r.body_mut().read_to_string().unwrap()
    };
    let text = tokio::task::spawn_blocking(scrape.clone()).await.unwrap();
    for line in [
        "ratelimitd_decisions_total{decision=\"allowed\",source=\"redis\"} 2",
        "ratelimitd_decisions_total{decision=\"denied\",source=\"redis\"} 1",
        "ratelimitd_errors_total{code=\"MALFORMED\"} 1",
        "ratelimitd_breaker_open 0",
        "ratelimitd_connections_open 1",
        "ratelimitd_redis_call_seconds_count 3",
        "ratelimitd_requests_in_flight 0",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    redis.kill();
    // Another key: "m" is refused by the denial cache, Redis or not.
    let r = c.check(&ratelimitd::protocol::CheckArgs { on_error: ratelimitd::protocol::FailPolicy::Open, ..args("m2", 2, 60_000) }).await.unwrap();
    assert_eq!(r.source, Source::FailOpen);
    let text = tokio::task::spawn_blocking(scrape).await.unwrap();
    assert!(text.contains("ratelimitd_fail_policy_total{on_error=\"open\"} 1"), "{text}");
    assert!(text.contains("ratelimitd_breaker_open 1"), "{text}");
    assert!(text.contains("ratelimitd_breaker_opened_total 1"), "{text}");
}

#[test]
fn json_logs_and_no_doubled_timestamps_under_journald() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &str, journald: bool| -> String {
        let socket = dir.path().join("l.sock");
        let config = dir.path().join("l.toml");
        std::fs::write(&config, format!("[server]\nlisten = \"{}\"\n[log]\n{extra}\n", socket.display())).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--config"]).arg(&config).env_remove("RUST_LOG").stderr(Stdio::piped());
        if journald {
            cmd.env("JOURNAL_STREAM", "8:12345");
        } else {
            cmd.env_remove("JOURNAL_STREAM");
        }
        let mut child = ChildGuard::spawn("ratelimitd", &mut cmd, None);
        child.wait_until("socket bound", Duration::from_secs(10), || socket.exists());
        child.terminate(EXIT_LIMIT);
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.take_stderr().unwrap(), &mut out).unwrap();
        out
    };
    let json = run("format = \"json\"", false);
    for line in json.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v.get("level").is_some() && v.get("fields").is_some(), "{line}");
    }
    assert!(json.contains("in-memory backend"));
    let journal = run("format = \"text\"", true);
    assert!(journal.lines().count() > 2);
    for line in journal.lines() {
        assert!(!line.starts_with("20"), "a timestamp under journald: {line}");
        assert!(!line.contains('\u{1b}'), "colour codes under journald: {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_reset_use_the_daemons_keys() {
    let redis = RedisServer::start_unix();
    let d = Daemon::start(Some(&redis.url()), "timeout_ms = 500\nkey_prefix = \"gw:\"");
    let mut c = d.client().await;
    for _ in 0..3 {
        c.check(&args("order:t1", 10, 60_000)).await.unwrap();
    }
    let out = Command::new(BIN).args(["inspect", "--config"]).arg(&d.config).args(["--key", "order:t1", "--window-ms", "60000", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let v = &all[0];
    assert_eq!(v["redis_key"], "gw:{order:t1}:60000ms");
    assert_eq!((v["window_ms"].as_u64(), v["members"].as_u64(), v["in_window"].as_u64()), (Some(60_000), Some(3), Some(3)));
    assert!(v["ttl_ms"].as_i64().unwrap() > 59_000);
    // Without --window-ms: every window of the key, found by SCAN.
    c.check(&args("order:t1", 10, 1000)).await.unwrap();
    let out = Command::new(BIN).args(["inspect", "--config"]).arg(&d.config).args(["--key", "order:t1", "--scan", "--json"]).output().unwrap();
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let windows: Vec<u64> = all.as_array().unwrap().iter().map(|w| w["window_ms"].as_u64().unwrap()).collect();
    assert_eq!(windows, [1000, 60_000]);
    let out = Command::new(BIN).args(["reset", "--config"]).arg(&d.config).args(["--key", "order:t1", "--scan"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "gw:{order:t1}:1000ms: deleted\ngw:{order:t1}:60000ms: deleted");
    let r = c.check(&args("order:t1", 10, 60_000)).await.unwrap();
    assert_eq!((r.decision, r.count), (Decision::Allowed, 1), "the quota is whole again");
}
