//! A coarse clock for "when was this policy last used": seconds since the
//! daemon started, plus one (0 = never used). The request path reads an
//! atomic instead of the time; a background task (`run`) advances it once
//! a second while it is read, and parks once a whole second passed with no
//! reader, so an idle daemon has no timer firing for it. The first reader
//! after that reads the time itself (once), sets the clock and wakes the
//! task.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::park::Parking;

/// Set by the task at each tick and cleared by the first reader after it:
/// still set at the next tick, nobody read the clock for a second.
const UNREAD: u64 = 1 << 63;
/// The task is parked: the clock is stale until a reader sets it.
const STOPPED: u64 = 1 << 62;
const FLAGS: u64 = UNREAD | STOPPED;

static SECS: AtomicU64 = AtomicU64::new(STOPPED);
static START: OnceLock<Instant> = OnceLock::new();
static TASK: Parking = Parking::new();

fn fresh() -> u64 {
    START.get_or_init(Instant::now).elapsed().as_secs() + 1
}

/// The clock's reading now.
#[inline]
pub fn now() -> u64 {
    let s = SECS.load(Ordering::Relaxed);
    if s & FLAGS == 0 {
        return s;
    }
    read_flagged(s)
}

#[cold]
fn read_flagged(s: u64) -> u64 {
    // Acquire pairs with the task's Release of STOPPED: seeing it, this
    // thread also sees the task marked parked, and wakes it.
    let s = if s & STOPPED != 0 { SECS.load(Ordering::Acquire) } else { s };
    if s & STOPPED != 0 {
        let secs = fresh();
        SECS.store(secs, Ordering::Relaxed);
        TASK.work_arrived();
        return secs;
    }
    SECS.store(s & !UNREAD, Ordering::Relaxed);
    s & !FLAGS
}

/// Advances the clock once a second while it is read, until `shutdown`.
/// Every 10 s of running, and before it parks, it calls `housekeeping`
/// (the daemon sweeps the penalty box's ended bans there).
pub async fn run(shutdown: CancellationToken, housekeeping: impl Fn()) {
    START.get_or_init(Instant::now);
    let mut ticks = 0u64;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        ticks += 1;
        if ticks % 10 == 0 {
            housekeeping();
        }
        TASK.about_to_park();
        let s = SECS.load(Ordering::Relaxed);
        if s & UNREAD == 0 {
            // Read during the last second (or set by a reader): go on.
            TASK.stay_awake();
            SECS.store(fresh() | UNREAD, Ordering::Relaxed);
            continue;
        }
        // A second without a reader: stop until the next one.
        SECS.store(STOPPED, Ordering::Release);
        housekeeping();
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = TASK.parked() => {}
        }
    }
}
