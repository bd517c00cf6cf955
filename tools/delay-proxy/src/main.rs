//! ratelimitd-delay-proxy: a TCP proxy that holds every chunk of bytes for a
//! fixed one-way delay before passing it on, in both directions, so that a
//! client on one host reaches a server at a network distance: a round trip
//! through it costs 2 × the delay more than without it.
//!
//! Why it exists: `scripts/fleet` puts Redis at the distance of a region
//! (0.1-1 ms one way) from gateway hosts in network namespaces, and this
//! kernel has no netem qdisc to do it in the kernel.
//!
//! How: per connection and direction, a reader thread stamps each chunk it
//! reads with `now + delay` and queues it; a writer thread sleeps until the
//! stamp and writes the chunk. Order is kept, nothing is batched or split
//! beyond what the kernel's reads return, and a chunk is never early. It
//! can be late by the sleep's own overshoot: the timer slack is set to 1 µs
//! (the default of 50 µs would add up to 50 µs to every hop), and the
//! lateness actually seen is printed every few seconds so that a run can say
//! how far the distance it measured was from the one it asked for.
//!
//! Standard library only; it is a test tool, not part of the daemon.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: ratelimitd-delay-proxy --listen ADDR:PORT --upstream ADDR:PORT --delay-us MICROSECONDS [--report-s SECONDS]";

struct Args {
    listen: String,
    upstream: String,
    delay: Duration,
    report_every: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut listen = None;
    let mut upstream = None;
    let mut delay = None;
    let mut report_every = Duration::from_secs(5);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => listen = Some(value()?),
            "--upstream" => upstream = Some(value()?),
            "--delay-us" => {
                let v = value()?;
                let us: u64 = v.parse().map_err(|_| format!("--delay-us: not a whole number of microseconds: {v:?}"))?;
                delay = Some(Duration::from_micros(us));
            }
            "--report-s" => {
                let v = value()?;
                let s: u64 = v.parse().map_err(|_| format!("--report-s: not a whole number of seconds: {v:?}"))?;
                if s == 0 {
                    return Err("--report-s must be at least 1".into());
                }
                report_every = Duration::from_secs(s);
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(Args {
        listen: listen.ok_or("--listen is required")?,
        upstream: upstream.ok_or("--upstream is required")?,
        delay: delay.ok_or("--delay-us is required")?,
        report_every,
    })
}

/// How late chunks were written, past their due time (lock-free: every
/// writer thread adds to it).
#[derive(Default)]
struct Lateness {
    chunks: AtomicU64,
    sum_us: AtomicU64,
    max_us: AtomicU64,
    /// Chunks written more than 50 µs late.
    over_50us: AtomicU64,
}

impl Lateness {
    fn record(&self, late: Duration) {
        let us = late.as_micros() as u64;
        self.chunks.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.max_us.fetch_max(us, Ordering::Relaxed);
        if us > 50 {
            self.over_50us.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Takes the figures since the last report.
    fn take(&self) -> (u64, u64, u64, u64) {
        (
            self.chunks.swap(0, Ordering::Relaxed),
            self.sum_us.swap(0, Ordering::Relaxed),
            self.max_us.swap(0, Ordering::Relaxed),
            self.over_50us.swap(0, Ordering::Relaxed),
        )
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    // Threads inherit the slack of the thread that creates them.
    if let Err(e) = std::fs::write("/proc/self/timerslack_ns", "1000") {
        eprintln!("warning: could not lower the timer slack ({e}); sleeps may overshoot by up to 50 us");
    }
    let listener = match TcpListener::bind(&args.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {}: {e}", args.listen);
            return ExitCode::from(1);
        }
    };
    eprintln!("listening on {}, forwarding to {}, one-way delay {} us", args.listen, args.upstream, args.delay.as_micros());
    let lateness = Arc::new(Lateness::default());
    {
        let lateness = Arc::clone(&lateness);
        let every = args.report_every;
        thread::spawn(move || loop {
            thread::sleep(every);
            let (n, sum, max, over) = lateness.take();
            if n > 0 {
                eprintln!("lateness over {}s: {n} chunks, mean {} us, max {max} us, {over} over 50 us", every.as_secs(), sum / n);
            }
        });
    }
    for conn in listener.incoming() {
        let client = match conn {
            Ok(c) => c,
            Err(e) => {
                eprintln!("accept: {e}");
                continue;
            }
        };
        let upstream = args.upstream.clone();
        let delay = args.delay;
        let lateness = Arc::clone(&lateness);
        thread::spawn(move || {
            if let Err(e) = proxy(client, &upstream, delay, lateness) {
                eprintln!("connection: {e}");
            }
        });
    }
    ExitCode::SUCCESS
}

fn proxy(client: TcpStream, upstream: &str, delay: Duration, lateness: Arc<Lateness>) -> std::io::Result<()> {
    let server = TcpStream::connect(upstream)?;
    // Both ends write what they have at once: the delay is ours to add, not Nagle's.
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (c_read, s_write) = (client.try_clone()?, server.try_clone()?);
    let up_lateness = Arc::clone(&lateness);
    let up = thread::spawn(move || pipe(c_read, s_write, delay, up_lateness));
    pipe(server, client, delay, lateness);
    let _ = up.join();
    Ok(())
}

/// Copies `from` to `to`, each chunk written `delay` after it was read.
fn pipe(mut from: TcpStream, to: TcpStream, delay: Duration, lateness: Arc<Lateness>) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let mut out = match to.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    };
    let writer = thread::spawn(move || {
        for (due, chunk) in rx {
            let now = Instant::now();
            if due > now {
                thread::sleep(due - now);
            }
            lateness.record(Instant::now().saturating_duration_since(due));
            if out.write_all(&chunk).is_err() {
                break;
            }
        }
        // The reader saw the end of its side: pass the end on, after the
        // data that preceded it.
        let _ = out.shutdown(Shutdown::Write);
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.join();
    // The other side went away: let the peer's reader see it too.
    let _ = to.shutdown(Shutdown::Read);
}
