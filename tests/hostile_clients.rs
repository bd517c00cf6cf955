//! Hostile clients against the real daemon: each must be cut off within a
//! stated bound (docs/FAILURES.md, "Bad input"), and must not keep other
//! clients from being served.
//!
//! - a client that writes requests and never reads the answers;
//! - a client that sends part of a frame and stops;
//! - more idle connections than `server.max_connections`;
//! - requests the daemon refuses as invalid (a configuration bug on the
//!   nginx side): logged at ERROR, rate-limited, counted.
//!
//! Bounds are asserted both ways (not cut early, cut in time) with slack for
//! a loaded 2-core machine.

mod common;

use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::{args, Daemon};
use ratelimitd::client::{Client, ClientError};
use ratelimitd::protocol::{encode_request, Decision, ErrorCode};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Waits for the daemon to close `c`; returns how long that took from `since`.
async fn closed_after(c: &mut Client, since: Instant, give_up: Duration) -> Duration {
    match tokio::time::timeout(give_up, c.read_response()).await {
        Ok(Err(ClientError::Closed)) => since.elapsed(),
        Ok(Err(ClientError::Io(e))) if e.kind() == std::io::ErrorKind::ConnectionReset => since.elapsed(),
        Ok(other) => panic!("expected the daemon to close the connection, got {other:?}"),
        Err(_) => panic!("connection still open after {give_up:?}"),
    }
}

/// Four clients fill every connection slot, each writes 30,000 CHECK frames
/// and never reads an answer. Each is closed `write_timeout_ms` (default
/// 2 s) after the daemon's writes stop making progress, and a fifth client
/// is then served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_is_closed_after_the_write_timeout() {
    let d = Daemon::start_with("socket_mode = \"0600\"\nmax_connections = 4\nidle_timeout_ms = 3000", None, "");
    let mut burst = BytesMut::new();
    for id in 0..30_000u32 {
        encode_request(id, &args("stalled", 1_000_000, 60_000), &mut burst);
    }
    let burst = burst.freeze();
    let t0 = Instant::now();
    let mut writers = Vec::new();
    for _ in 0..4 {
        let mut s = UnixStream::connect(&d.socket).await.unwrap();
        let burst = burst.clone();
        // Writes everything, reads nothing; keeps the stream (and so its
        // read side) open until the daemon closes it under the write.
        writers.push(tokio::spawn(async move {
            let r = s.write_all(&burst).await;
            (t0.elapsed(), r.is_err(), s)
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut fifth = d.client().await;
    let served = tokio::time::timeout(Duration::from_secs(8), fifth.check(&args("fifth", 10, 60_000))).await;
    let served_at = t0.elapsed();
    let r = served.unwrap_or_else(|_| panic!("fifth client not served after {:.1} s: the stalled readers hold every slot", secs(served_at)));
    assert_eq!(r.unwrap().decision, Decision::Allowed);
    println!("stalled readers: fifth client served {:.3} s after the stall began", secs(served_at));
    assert!(served_at >= Duration::from_millis(1800), "a slot was freed before the 2 s write timeout: {served_at:?}");
    assert!(served_at <= Duration::from_millis(4500), "fifth client served only after {served_at:?}");
    for w in writers {
        let (at, failed, _stream) = tokio::time::timeout(Duration::from_secs(5), w).await.expect("stalled writer cut off").unwrap();
        println!("stalled reader closed after {:.3} s", secs(at));
        assert!(failed, "the daemon read all 30,000 frames of a client that reads nothing");
        assert!((Duration::from_millis(1800)..=Duration::from_millis(4500)).contains(&at), "closed after {at:?}, bound 2 s");
    }
    // The daemon is still fine.
    assert_eq!(d.client().await.check(&args("after", 10, 60_000)).await.unwrap().decision, Decision::Allowed);
}

/// A client that reads slowly but steadily is not a stalled one: it gets
/// every answer of a large pipelined burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_gets_every_answer() {
    let d = Daemon::start_with("socket_mode = \"0600\"\nwrite_timeout_ms = 1000", None, "");
    let mut burst = BytesMut::new();
    for id in 0..20_000u32 {
        encode_request(id, &args("burst", 1_000_000, 60_000), &mut burst);
    }
    let mut c = d.client().await;
    let (mut rd, mut wr) = {
        // Write on one task, read (with pauses) on this one.
        let s = UnixStream::connect(&d.socket).await.unwrap();
        s.into_split()
    };
    let writer = tokio::spawn(async move { wr.write_all(&burst).await.map(|_| wr) });
    let mut buf = BytesMut::new();
    let mut got = 0;
    let t0 = Instant::now();
    while got < 20_000 {
        use tokio::io::AsyncReadExt;
        if got % 5000 == 0 {
            // Stalls shorter than the write timeout.
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        while let Some(r) = ratelimitd::protocol::decode_response(&mut buf).unwrap() {
            assert_eq!(r.decision, Decision::Allowed);
            got += 1;
        }
        if got < 20_000 {
            let n = tokio::time::timeout(Duration::from_secs(5), rd.read_buf(&mut buf)).await.expect("answers keep coming").unwrap();
            assert!(n > 0, "closed after {got} answers");
        }
    }
    println!("slow reader: 20,000 answers in {:.3} s", secs(t0.elapsed()));
    writer.await.unwrap().unwrap();
    assert_eq!(c.check(&args("other", 10, 60_000)).await.unwrap().decision, Decision::Allowed);
}

/// Sends the first ten bytes of `whole` on `c` and nothing more: the
/// daemon closes the connection 0.5 s (its frame timeout) after them,
/// within 0.4 to 1.5 s.
async fn partial_frame_cut_off(c: &mut ratelimitd::client::Client, whole: &[u8], when: &str) {
    let t0 = Instant::now();
    c.send_raw(&whole[..10]).await.unwrap();
    let took = closed_after(c, t0, Duration::from_secs(5)).await;
    println!("partial frame {when}: closed after {:.3} s (frame timeout 0.5 s, idle 3 s)", secs(took));
    assert!((Duration::from_millis(400)..=Duration::from_millis(1500)).contains(&took), "{when}: closed after {took:?}, bound 0.5 s");
}

/// Ten bytes of a frame and nothing more: closed `frame_timeout_ms` after
/// the first byte, not after the idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_frame_is_cut_off_after_the_frame_timeout() {
    let d = Daemon::start_with("socket_mode = \"0600\"\nframe_timeout_ms = 500\nidle_timeout_ms = 3000", None, "");
    let mut whole = BytesMut::new();
    encode_request(7, &args("partial", 10, 60_000), &mut whole);

    // On a fresh connection.
    let mut c = d.client().await;
    partial_frame_cut_off(&mut c, &whole, "on a fresh connection").await;

    // After earlier traffic and a pause: the clock starts at the partial
    // frame's first byte, not at the last complete frame.
    let mut c = d.client().await;
    assert_eq!(c.check(&args("partial", 10, 60_000)).await.unwrap().decision, Decision::Allowed);
    tokio::time::sleep(Duration::from_millis(800)).await;
    partial_frame_cut_off(&mut c, &whole, "after a pause").await;

    // A frame that arrives in pieces within the bound is answered.
    let mut c = d.client().await;
    c.send_raw(&whole[..3]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    c.send_raw(&whole[3..20]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    c.send_raw(&whole[20..]).await.unwrap();
    let r = c.read_response().await.unwrap();
    assert_eq!((r.id, r.decision), (7, Decision::Allowed));
    // And an idle connection still lasts the idle timeout.
    let t0 = Instant::now();
    let took = closed_after(&mut c, t0, Duration::from_secs(6)).await;
    println!("idle connection: closed after {:.3} s (idle timeout 3 s)", secs(took));
    assert!((Duration::from_millis(2800)..=Duration::from_millis(4500)).contains(&took), "idle close after {took:?}, bound 3 s");
}

/// Eight idle connections fill `max_connections = 8`: a ninth client is
/// served at once, and the connection idle the longest is the one closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_the_longest_idle_connection_makes_room() {
    let d = Daemon::start_with("socket_mode = \"0600\"\nmax_connections = 8", None, "");
    let mut idle = Vec::new();
    for i in 0..8 {
        let mut c = d.client().await;
        // One exchange each, oldest first, so the order of last activity is known.
        assert_eq!(c.check(&args(&format!("idle-{i}"), 10, 60_000)).await.unwrap().decision, Decision::Allowed);
        idle.push(c);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // All idle for more than the 1 s a connection must be idle to be closed
    // for a newcomer.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let t0 = Instant::now();
    let mut ninth = d.client().await;
    let r = tokio::time::timeout(Duration::from_secs(1), ninth.check(&args("ninth", 10, 60_000))).await.expect("ninth client served within 1 s").unwrap();
    let took = t0.elapsed();
    println!("cap of 8 reached by idle connections: ninth served after {:.3} s", secs(took));
    assert_eq!(r.decision, Decision::Allowed);
    let oldest_closed = closed_after(&mut idle[0], t0, Duration::from_secs(1)).await;
    println!("the oldest idle connection saw EOF after {:.3} s", secs(oldest_closed));
    // The others are still served (which makes them busy again, so the
    // tenth client must wait for the next-oldest idle one: idle[1]).
    for c in &mut idle[2..] {
        assert_eq!(c.check(&args("still-open", 1000, 60_000)).await.unwrap().decision, Decision::Allowed);
    }
    let mut tenth = d.client().await;
    let r = tokio::time::timeout(Duration::from_secs(1), tenth.check(&args("tenth", 10, 60_000))).await.expect("tenth client served within 1 s").unwrap();
    assert_eq!(r.decision, Decision::Allowed);
    closed_after(&mut idle[1], t0, Duration::from_secs(1)).await;
}

/// When the cap is reached by connections used within the last second, the
/// newcomer waits, but only until the longest-idle of them has been idle for
/// 1 s: the wait is bounded, whatever the idle timeout (300 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_a_newcomer_waits_at_most_about_a_second() {
    let d = Daemon::start_with("socket_mode = \"0600\"\nmax_connections = 8", None, "");
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(d.client().await);
    }
    let t0 = Instant::now();
    let mut ninth = d.client().await;
    let r = tokio::time::timeout(Duration::from_secs(3), ninth.check(&args("ninth", 10, 60_000))).await.expect("ninth client served within 3 s").unwrap();
    let took = t0.elapsed();
    println!("cap of 8 reached by fresh connections: ninth served after {:.3} s", secs(took));
    assert_eq!(r.decision, Decision::Allowed);
    assert!((Duration::from_millis(800)..=Duration::from_millis(2000)).contains(&took), "served after {took:?}, bound 1 s");
    closed_after(&mut idle[0], t0, Duration::from_secs(1)).await;
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn metric(port: u16, line_prefix: &str) -> u64 {
    let mut r = ureq::get(&format!("http://127.0.0.1:{port}/metrics")).call().unwrap();
    let text = r.body_mut().read_to_string().unwrap();
    let line = text.lines().find(|l| l.starts_with(line_prefix)).unwrap_or_else(|| panic!("no {line_prefix} in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// A request refused as invalid is a configuration bug on the client's side
/// (e.g. a location whose limit is above `limits.max_limit`): logged at
/// ERROR with code, message and key, at most once a second per code with the
/// number held back, and counted in `ratelimitd_errors_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_logged_as_errors_rate_limited_and_counted() {
    let port = free_port();
    let d = Daemon::start_config(&format!("socket_mode = \"0600\"\n[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
    let mut c = d.client().await;
    let too_high = args("cfg-bug-key", 2_000_000, 60_000);
    let t0 = Instant::now();
    for _ in 0..21 {
        let r = c.check(&too_high).await.unwrap();
        assert_eq!((r.decision, r.error), (Decision::Error, ErrorCode::InvalidLimit));
    }
    // Another kind gets its own line within the same second.
    let r = c.check(&args("cfg-bug-window", 10, 90_000_000)).await.unwrap();
    assert_eq!(r.error, ErrorCode::InvalidWindow);
    assert!(t0.elapsed() < Duration::from_millis(900), "the burst took too long for this test: {:?}", t0.elapsed());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = c.check(&too_high).await.unwrap();
    assert_eq!(r.error, ErrorCode::InvalidLimit);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let log = d.log();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR") && l.contains("invalid request")).collect();
    println!("{}", errors.join("\n"));
    let limit_lines: Vec<&&str> = errors.iter().filter(|l| l.contains("INVALID_LIMIT")).collect();
    assert_eq!(limit_lines.len(), 2, "one line a second for 22 requests with INVALID_LIMIT:\n{log}");
    assert!(limit_lines[0].contains("cfg-bug-key") && limit_lines[0].contains("limit 2000000 is outside 1..=1000000"), "{}", limit_lines[0]);
    assert!(limit_lines[0].contains("suppressed=0"), "{}", limit_lines[0]);
    assert!(limit_lines[1].contains("suppressed=20"), "the 20 held back are counted: {}", limit_lines[1]);
    let window_lines: Vec<&&str> = errors.iter().filter(|l| l.contains("INVALID_WINDOW")).collect();
    assert_eq!(window_lines.len(), 1, "{log}");
    assert!(window_lines[0].contains("cfg-bug-window"), "{}", window_lines[0]);

    let counts = tokio::task::spawn_blocking(move || {
        ["ratelimitd_errors_total{code=\"INVALID_LIMIT\"}", "ratelimitd_errors_total{code=\"INVALID_WINDOW\"}", "ratelimitd_decisions_total{decision=\"error\",source=\"none\"}"].map(|m| metric(port, m))
    })
    .await
    .unwrap();
    assert_eq!(counts, [22, 1, 23], "INVALID_LIMIT, INVALID_WINDOW, decisions error/none");
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A flood of distinct keys (each a new window in the per-host store) must
/// not keep its memory once the keys have left their window: the sweeper
/// drops them, shrinks the maps, and the allocator (jemalloc, with a
/// background thread and 1 s decay) gives the pages back. Before, a
/// 200,000-key flood kept ~44 MB resident for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_keys_gives_its_memory_back_once_they_expire() {
    let d = Daemon::start(None, "");
    let idle = rss_kib(d.pid());
    const KEYS: u32 = 200_000;
    let flood_start = Instant::now();
    let mut writers = Vec::new();
    for part in 0..4u32 {
        let socket = d.socket.clone();
        writers.push(tokio::spawn(async move {
            let s = UnixStream::connect(&socket).await.unwrap();
            let (mut rd, mut wr) = s.into_split();
            let reader = tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut buf = BytesMut::new();
                let mut got = 0;
                while got < KEYS / 4 {
                    while let Some(r) = ratelimitd::protocol::decode_response(&mut buf).unwrap() {
                        assert_eq!(r.decision, Decision::Allowed);
                        got += 1;
                    }
                    if got < KEYS / 4 {
                        assert!(rd.read_buf(&mut buf).await.unwrap() > 0, "closed after {got}");
                    }
                }
            });
            let mut frames = BytesMut::new();
            for i in 0..KEYS / 4 {
                let key = format!("flood:{part}:{i}");
                encode_request(i, &args(&key, 10, 2000), &mut frames);
                if frames.len() > 64 * 1024 {
                    wr.write_all(&frames).await.unwrap();
                    frames.clear();
                }
            }
            wr.write_all(&frames).await.unwrap();
            reader.await.unwrap();
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let flooded = rss_kib(d.pid());
    let flood_end = Instant::now();
    assert!(flooded > idle + 10 * 1024, "the flood should have cost memory: {idle} KiB idle, {flooded} KiB after");
    // Keys leave their 2 s window, the sweeper runs every second, jemalloc
    // decays in 1 s: back within a few seconds (bound generous for CI).
    let target = idle + (flooded - idle) / 4;
    let mut now_kib = flooded;
    while now_kib > target && flood_end.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        now_kib = rss_kib(d.pid());
    }
    println!(
        "key flood: {KEYS} keys in {:.2} s; RSS {:.1} MB idle, {:.1} MB after the flood, {:.1} MB {:.1} s later",
        secs(flood_end - flood_start),
        idle as f64 / 1024.0,
        flooded as f64 / 1024.0,
        now_kib as f64 / 1024.0,
        secs(flood_end.elapsed())
    );
    assert!(now_kib <= target, "RSS still {now_kib} KiB after 15 s (idle {idle}, flooded {flooded})");
    // Not given back before the keys could have expired (window 2 s).
    assert!(flood_end.elapsed() >= Duration::from_millis(1000));
    let mut c = d.client().await;
    assert_eq!(c.check(&args("after-flood", 1, 1000)).await.unwrap().decision, Decision::Allowed);
}
