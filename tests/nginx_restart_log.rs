//! Daemon restarts under load through real nginx at the shipped snippet's
//! timeouts: the client's retry waits without spinning (never an
//! `ngx.sleep` below 1 ms, which nginx without the delayed-events patch
//! logs as `ngx.sleep(0) called without delayed events patch` each time),
//! and an outage costs a bounded number of error-log lines (docs/NGINX.md
//! section 8).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::http::agent;
use common::ops::{socket_access, SNIPPET};
use common::{wait_until, Daemon, Nginx, RedisServer};

/// nginx's workers (tests/common/nginx.rs) and the restarts here.
const WORKERS: usize = 2;
const RESTARTS: usize = 2;
/// Per worker and outage: nginx's own `connect() ... failed` lines (one per
/// probe, 1, 2, 4, ... ms apart within the 70 ms budget: at most 8), the
/// client's failure lines (one per kind per second) and a second outage
/// probe when a load spike keeps the new daemon from its socket.
const LINES_PER_WORKER_AND_OUTAGE: usize = 25;

#[test]
fn restarts_under_load_log_a_bounded_number_of_lines_and_never_sleep_zero() {
    let redis = RedisServer::start_unix();
    let mut d = Daemon::start_config(&format!("{}\n[redis]\nurl = \"{}\"\ntimeout_ms = 500\n", socket_access(), redis.url()));
    // The shipped snippet, unchanged but for the socket path.
    let snippet = SNIPPET.replacen("unix:/run/ratelimitd/ratelimitd.sock", &format!("unix:{}", d.socket.display()), 1);
    let nginx = Nginx::start(&format!(
        "{snippet}\nserver {{\n listen 127.0.0.1:{{PORT}};\n location /r {{ access_by_lua_block {{ require(\"resty.ratelimitd\").limit{{ key = ngx.var.arg_k, limit = 1000000, window_ms = 60000, on_error = \"open\" }} }} content_by_lua_block {{ ngx.say(\"ok\") }} }}\n}}\n"
    ));
    let before = nginx.error_log().lines().count();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let load: Vec<_> = (0..6)
        .map(|t| {
            let (url, stop, sent) = (nginx.url(&format!("/r?k=c{t}")), stop.clone(), sent.clone());
            std::thread::spawn(move || {
                let a = agent();
                while !stop.load(Ordering::Relaxed) {
                    let _ = a.get(&url).call();
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for _ in 0..RESTARTS {
        let at = sent.load(Ordering::Relaxed);
        wait_until("load running", Duration::from_secs(10), || sent.load(Ordering::Relaxed) >= at + 300);
        assert!(d.terminate().success());
        d.start_again();
    }
    let at = sent.load(Ordering::Relaxed);
    wait_until("load after the restarts", Duration::from_secs(10), || sent.load(Ordering::Relaxed) >= at + 300);
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    let log = nginx.error_log();
    let lines: Vec<&str> = log.lines().skip(before).filter(|l| l.contains("[warn]") || l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]")).collect();
    let zero_sleeps = lines.iter().filter(|l| l.contains("ngx.sleep(0)")).count();
    for l in lines.iter().take(12) {
        eprintln!("nginx: {}", l.split(", client:").next().unwrap_or(l));
    }
    eprintln!("{RESTARTS} restarts under {} requests: {} warn-or-worse lines, {zero_sleeps} of them ngx.sleep(0)", sent.load(Ordering::Relaxed), lines.len());
    assert_eq!(zero_sleeps, 0, "the retry spun on ngx.sleep(0):\n{}", lines.iter().take(20).copied().collect::<Vec<_>>().join("\n"));
    let bound = WORKERS * RESTARTS * LINES_PER_WORKER_AND_OUTAGE;
    assert!(lines.len() <= bound, "{} lines (bound {bound}):\n{}", lines.len(), lines.iter().take(40).copied().collect::<Vec<_>>().join("\n"));
}
