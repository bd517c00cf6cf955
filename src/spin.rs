//! A bounded spin before the runtime's worker parks, while requests keep
//! arriving (docs/PERFORMANCE.md, "Latency at one connection (issue 34,
//! item 4)").
//!
//! A cold key at one connection costs two process wake-ups more than the
//! direct path: the daemon sleeps in `epoll_wait` between the client's frame
//! and Redis's reply, and again until the next frame. While `spin` has not
//! passed since the last frame, a task here yields to the scheduler in a
//! loop: each yield makes the worker poll its I/O driver without blocking
//! (tokio defers a yielded task until the driver is polled), so a reply or
//! a frame that arrives meanwhile is taken on a running thread. Once the
//! spin has passed with nothing new, the task waits on a `Notify` and the
//! worker parks as before: an idle daemon uses no CPU.
//!
//! Only at low load: frames that come within `BUSY_GAP_US` of the ones
//! before stop the spin (the worker has work anyway, and on a host whose
//! cores nginx and Redis share, spinning through the short gaps between
//! them took 25 % of the throughput at 64 connections).
//!
//! Off by default (`server.spin_us = 0`): while requests arrive at one
//! connection the spin keeps a core busy. The request path then pays one
//! relaxed load per batch of frames read; with it on, a clock read and an
//! atomic swap, and the notify only when the spinner is parked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The time of the last batch of frames, in µs since `EPOCH`.
static LAST_US: AtomicU64 = AtomicU64::new(0);
/// Whether the spinner is parked (waiting for `WAKE`).
static PARKED: AtomicBool = AtomicBool::new(false);
/// Whether a spinner runs at all (`spin` > 0).
static ENABLED: AtomicBool = AtomicBool::new(false);
static WAKE: Notify = Notify::const_new();
static EPOCH: OnceLock<Instant> = OnceLock::new();

fn now_us() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// Frames closer than this to the ones before are load: the worker has
/// work without spinning, and a spin would only take the core from nginx
/// and Redis (docs/PERFORMANCE.md, "Latency at one connection (issue 34,
/// item 4)").
const BUSY_GAP_US: u64 = 50;
/// Whether the last frames came within `BUSY_GAP_US` of the ones before.
static BUSY: AtomicBool = AtomicBool::new(false);

/// Frames were read: keep the worker spinning for the next `spin`, unless
/// frames are arriving faster than a spin could help.
#[inline]
pub fn frames_read() {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let now = now_us();
    let busy = now.saturating_sub(LAST_US.swap(now, Ordering::Relaxed)) < BUSY_GAP_US;
    BUSY.store(busy, Ordering::Relaxed);
    if !busy && PARKED.load(Ordering::Relaxed) && PARKED.swap(false, Ordering::AcqRel) {
        WAKE.notify_one();
    }
}

/// The spinner: runs until `token` is cancelled. `spin` zero: returns at
/// once and `frames_read` does nothing.
pub async fn run(spin: Duration, token: CancellationToken) {
    if spin.is_zero() {
        return;
    }
    let spin_us = spin.as_micros() as u64;
    ENABLED.store(true, Ordering::Relaxed);
    loop {
        PARKED.store(true, Ordering::Release);
        tokio::select! {
            _ = WAKE.notified() => {}
            _ = token.cancelled() => break,
        }
        while !BUSY.load(Ordering::Relaxed) && now_us().saturating_sub(LAST_US.load(Ordering::Relaxed)) < spin_us {
            tokio::task::yield_now().await;
        }
    }
    ENABLED.store(false, Ordering::Relaxed);
}
