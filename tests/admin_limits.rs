//! The admin API's listener against a hostile or careless peer, through the
//! real daemon binary: a second `serve` with the running daemon's
//! configuration leaves its sockets alone; idle TCP connections to the
//! admin API cannot take the descriptors the data plane needs (a daemon
//! started with a low RLIMIT_NOFILE);
//! every phase of an admin request, the body included, has a read timeout.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::ops::sample;
use common::ports::{listens_on, on_own_ports};
use common::wait::{poll, Waited};
use common::{args, Daemon};
use ratelimitd::admin_api::client::request;
use ratelimitd::config::AdminListen;
use ratelimitd::protocol::Decision;

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");
const TOKEN: &str = "s3cret-admin-token";

#[test]
fn a_second_serve_with_the_running_daemons_config_leaves_its_sockets_alone() {
    let dir = tempfile::tempdir().unwrap();
    let admin = dir.path().join("admin.sock");
    let d = Daemon::start_config_with_metrics(&format!("socket_mode = \"0600\"\n[admin]\nlisten = \"{}\"\n", admin.display()));
    let listen = AdminListen::Unix { path: admin.clone(), mode: 0o600 };
    assert_eq!(request(&listen, None, "GET", "/v1/bans", None).unwrap().status, 200);
    let text = d.config_text();
    // The same file (its metrics port taken: the second exits), and the same
    // without [metrics] (it gets as far as the sockets).
    let without_metrics = dir.path().join("no-metrics.toml");
    std::fs::write(&without_metrics, &text[..text.find("[metrics]").expect("a [metrics] table")]).unwrap();
    for config in [d.config.as_path(), without_metrics.as_path()] {
        let out = Command::new(BIN).args(["serve", "--config"]).arg(config).env("RUST_LOG", "ratelimitd=info").output().unwrap();
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "the second daemon started:\n{log}");
        assert!(UnixStream::connect(&admin).is_ok(), "the running daemon's admin socket is gone after {}:\n{log}", config.display());
        assert!(UnixStream::connect(&d.socket).is_ok(), "the running daemon's socket is gone after {}:\n{log}", config.display());
        assert!(!log.contains("removing stale socket file"), "{log}");
        assert_eq!(request(&listen, None, "GET", "/v1/bans", None).unwrap().status, 200, "after {}", config.display());
    }
    assert!(without_metrics.exists());
    let second = String::from_utf8_lossy(&Command::new(BIN).args(["serve", "--config"]).arg(&without_metrics).output().unwrap().stderr).into_owned();
    assert!(second.contains("another process is listening on this socket"), "{second}");
}

/// A daemon with the admin API on TCP (a token in `dir`) and metrics, both
/// on loopback ports confirmed to be its own; `admin_extra` in `[admin]`.
fn tcp_daemon(dir: &Path, admin_extra: &str) -> (Daemon, u16, u16) {
    let token_file = dir.join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    on_own_ports("ratelimitd admin and metrics", 2, |ports| {
        let (admin, metrics) = (ports[0], ports[1]);
        let d = Daemon::try_start_config(&format!(
            "socket_mode = \"0600\"\n[admin]\nlisten = \"127.0.0.1:{admin}\"\ntoken_file = \"{}\"\n{admin_extra}\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n",
            token_file.display()
        ))?;
        let ok = eventually(Duration::from_secs(5), || listens_on(d.pid(), admin) && listens_on(d.pid(), metrics));
        if ok { Ok((d, admin, metrics)) } else { Err("the ports are not the daemon's".into()) }
    })
}

/// Runs `f` with this process's soft RLIMIT_NOFILE at `soft` (prlimit, from
/// util-linux), then puts the previous one back.
fn with_soft_nofile<T>(soft: u64, f: impl FnOnce() -> T) -> T {
    let me = std::process::id().to_string();
    let out = Command::new("prlimit").args(["--pid", &me, "--nofile", "--raw", "--noheadings", "--output=SOFT"]).output().unwrap();
    let before = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(out.status.success() && !before.is_empty(), "prlimit: {}", String::from_utf8_lossy(&out.stderr));
    let set = |to: &str| assert!(Command::new("prlimit").args(["--pid", &me, &format!("--nofile={to}:")]).status().unwrap().success());
    set(&soft.to_string());
    let result = f();
    set(&before);
    result
}

fn eventually(limit: Duration, ready: impl FnMut() -> bool) -> bool {
    poll(limit, None, ready) == Waited::Ready
}

fn metrics_of(port: u16) -> String {
    common::http::get(&common::http::agent(), &format!("http://127.0.0.1:{port}/metrics"), &[]).body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_admin_connections_leave_the_data_plane_its_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    // The daemon started with 256 descriptors, as a small LimitNOFILE gives:
    // this process's soft limit lowered while it spawns (the child inherits
    // it), then given back for the 600 connections below.
    let (d, admin, metrics) = with_soft_nofile(256, || tcp_daemon(dir.path(), ""));
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", d.pid())).unwrap();
    let nofile = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    assert_eq!(nofile.split_whitespace().nth(3), Some("256"), "{nofile}");
    // 600 connections that send nothing (no token, no byte): more than the
    // daemon has descriptors.
    let mut idle = Vec::new();
    for _ in 0..600 {
        if let Ok(s) = TcpStream::connect_timeout(&([127, 0, 0, 1], admin).into(), Duration::from_millis(500)) {
            idle.push(s);
        }
    }
    assert!(idle.len() >= 300, "only {} connections opened", idle.len());
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Every data-plane check is answered, each on a new connection.
    let mut answered = 0;
    for i in 0..5 {
        let key = format!("fd-{i}");
        let check = async {
            let mut c = ratelimitd::client::Client::connect(&d.socket).await.ok()?;
            c.check(&args(&key, 5, 60_000)).await.ok()
        };
        if let Ok(Some(r)) = tokio::time::timeout(Duration::from_secs(3), check).await {
            assert_eq!(r.decision, Decision::Allowed);
            answered += 1;
        }
    }
    assert_eq!(answered, 5, "data-plane checks answered while {} admin connections were open\n{}", idle.len(), d.log());
    // The refusals are counted, and logged at most about once a second.
    let m = metrics_of(metrics);
    let refused = sample(&m, "ratelimitd_admin_connections_refused_total");
    assert!(refused >= 300.0, "refused {refused}\n{m}");
    let lines = d.log().matches("admin connection refused").count();
    eprintln!("{} idle admin connections under RLIMIT_NOFILE 256: 5 of 5 checks answered, {refused} refused, {lines} log lines", idle.len());
    assert!((1..=5).contains(&lines), "{lines} lines\n{}", d.log());
    // With the idle ones gone, the API answers again.
    drop(idle);
    let listen = AdminListen::Tcp(([127, 0, 0, 1], admin).into());
    let ok = eventually(Duration::from_secs(5), || request(&listen, Some(TOKEN), "GET", "/v1/bans", None).is_ok_and(|r| r.status == 200));
    assert!(ok, "the admin API does not answer after the idle connections closed\n{}", d.log());
}

/// Writes `head`, then `drip` one byte at a time every 200 ms until the
/// daemon closes the connection or answers; how long that took after `head`.
fn time_to_cut(port: u16, head: &str, drip: &[u8]) -> Duration {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    for b in drip {
        match s.read(&mut buf) {
            Ok(_) => return start.elapsed(), // an answer (a 408) or the end
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return start.elapsed(),
        }
        if s.write_all(&[*b]).is_err() {
            return start.elapsed();
        }
    }
    panic!("the connection was held for {:?} while {} bytes dripped in", start.elapsed(), drip.len());
}

#[test]
fn every_phase_of_an_admin_request_has_a_read_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, admin, _) = tcp_daemon(dir.path(), "read_timeout = \"1s\"");
    let bound = Duration::from_millis(3000);
    // The body of an authenticated PUT, one byte every 200 ms (of 100).
    let head = format!("PUT /v1/overrides HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n");
    let took = time_to_cut(admin, &head, &[b' '; 60]);
    assert!(took < bound, "body: {took:?}");
    // The headers.
    let took = time_to_cut(admin, "GET /v1/bans HTTP/1.1\r\n", &[b'X'; 60]);
    assert!(took < bound, "headers: {took:?}");
    // Nothing at all after connecting.
    let mut s = TcpStream::connect(("127.0.0.1", admin)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let start = Instant::now();
    let _ = s.read(&mut [0u8; 16]);
    assert!(start.elapsed() < bound, "silent peer: {:?}", start.elapsed());
}
