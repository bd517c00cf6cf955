//! Settles that must not be lost (docs/PROTOCOL.md 4f, docs/FAILURES.md
//! "Settles during a failure"): a SETTLE item whose Redis
//! call failed (an error, a timeout, the breaker open) and the take-back
//! of a reserve that could not be confirmed (its call failed: Redis may
//! have charged it and written its record all the same) are settled again
//! here, in the background, until Redis answers or until their record's
//! life (24 h, `SETTLE_LIFE` in the scripts) is over.
//!
//! Retrying is safe because a settle applies at most once: the script
//! reads and deletes the record in the same atomic call, so a retry after
//! a call that was applied but not answered finds no record and changes
//! nothing, and so does one whose reserve never reached Redis.
//!
//! Bounded: at most `MAX_PENDING` settles wait (each its key, window and
//! handle); one more is dropped, counted and logged (rate-limited), its
//! estimate left charged as before this module. Each is tried again after
//! a backoff doubling from `FIRST_DELAY` to `MAX_DELAY`; `MAX_AT_ONCE` of
//! them per round. Pending settles are lost when the daemon exits; they are
//! retried on the daemon's current Redis backend (a reload's fresh link:
//! `use_backend`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::log_limit::RateLimitedLog;
use crate::metrics::METRICS;
use crate::protocol::Algorithm;
use crate::redis::RedisWindow;
use crate::window::{LimitSpec, StoreError};

/// Settles waiting at most (about 100 bytes and the key each).
pub const MAX_PENDING: usize = 16_384;
/// The first retry's delay, doubled at each failure up to `MAX_DELAY`.
const FIRST_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_secs(5);
/// Settles sent at once in one round (each a Redis call).
const MAX_AT_ONCE: usize = 64;
/// A record's life in Redis (the scripts' SETTLE_LIFE): past it a settle
/// finds nothing, so there is nothing left to retry.
const RECORD_LIFE: Duration = Duration::from_secs(86_400);

/// One settle of one item to `cost`, owned.
struct Pending {
    key: Box<[u8]>,
    limit: u32,
    window_ms: u32,
    cost: u32,
    algorithm: Algorithm,
    handle: [u8; 16],
    /// When it is due, its next delay, and when its record is gone anyway.
    due: Instant,
    delay: Duration,
    until: Instant,
}

struct Retries {
    pending: Mutex<VecDeque<Pending>>,
    /// The Redis backend of the latest settle queued: a reload replaces
    /// the backend (a fresh link; the old one stops after the shutdown
    /// grace), and every pending settle is retried on the newest one.
    backend: Mutex<Option<Arc<RedisWindow>>>,
    wake: Notify,
    dropped_log: RateLimitedLog,
    failed_log: RateLimitedLog,
}

static RETRIES: OnceLock<Retries> = OnceLock::new();

/// The queue, its worker started on first use (on the caller's runtime).
fn retries() -> &'static Retries {
    let mut started = false;
    let r = RETRIES.get_or_init(|| {
        started = true;
        Retries { pending: Mutex::new(VecDeque::new()), backend: Mutex::new(None), wake: Notify::new(), dropped_log: RateLimitedLog::new(Duration::from_secs(10)), failed_log: RateLimitedLog::new(Duration::from_secs(10)) }
    });
    if started {
        tokio::spawn(run(r));
    }
    r
}

/// The daemon's Redis backend is now `redis` (a reload replaced it): the
/// settles waiting are retried on it from now on.
pub fn use_backend(redis: &Arc<RedisWindow>) {
    if let Some(r) = RETRIES.get() {
        *r.backend.lock().unwrap_or_else(|e| e.into_inner()) = Some(redis.clone());
    }
}

/// Whether a call that failed with `e` may have run in Redis all the
/// same: it was sent (a timeout, a connection lost, an error reply). The
/// breaker open and the in-flight limit refuse before sending: nothing to
/// take back then (an outage would otherwise fill the queue with
/// take-backs of reserves Redis never saw, and drop real settles).
pub fn may_have_run(e: &StoreError) -> bool {
    !matches!(e, StoreError::CircuitOpen | StoreError::Overloaded(_))
}

/// Settles `spec` (its cost the actual; 0 to take a reserve back) under
/// `handle` again later, `why` being the failure its call met. Never
/// blocks; the queue full, it is dropped (counted, logged).
pub fn settle_later(redis: &Arc<RedisWindow>, spec: &LimitSpec<'_>, algorithm: Algorithm, handle: &[u8; 16], why: &StoreError) {
    let r = retries();
    let now = Instant::now();
    let p = Pending { key: spec.key.into(), limit: spec.limit, window_ms: spec.window_ms, cost: spec.cost, algorithm, handle: *handle, due: now + FIRST_DELAY, delay: FIRST_DELAY, until: now + RECORD_LIFE };
    {
        let mut q = r.pending.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= MAX_PENDING {
            drop(q);
            METRICS.settle_retry_dropped();
            if let Some(suppressed) = r.dropped_log.permit() {
                tracing::warn!(error = %why, pending = MAX_PENDING, suppressed, "a settle to retry was dropped: too many wait already; its reserve stays charged its estimate until its window ends");
            }
            return;
        }
        // The backend first: the worker finds it for every entry it sees.
        *r.backend.lock().unwrap_or_else(|e| e.into_inner()) = Some(redis.clone());
        q.push_back(p);
    }
    METRICS.settle_retry_queued();
    r.wake.notify_one();
}

/// Round after round: the settles due, sent at once; those that failed
/// again wait their doubled delay.
async fn run(r: &'static Retries) {
    loop {
        let now = Instant::now();
        let (due, next) = {
            let mut q = r.pending.lock().unwrap_or_else(|e| e.into_inner());
            let mut due = Vec::new();
            let mut kept = VecDeque::with_capacity(q.len());
            for p in q.drain(..) {
                if p.due <= now && due.len() < MAX_AT_ONCE {
                    due.push(p);
                } else {
                    kept.push_back(p);
                }
            }
            *q = kept;
            (due, q.iter().map(|p| p.due).min())
        };
        if due.is_empty() {
            match next {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = r.wake.notified() => {}
                    }
                }
                None => r.wake.notified().await,
            }
            continue;
        }
        let current = r.backend.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(redis) = current else {
            // Not reached: set before any entry is queued.
            r.pending.lock().unwrap_or_else(|e| e.into_inner()).extend(due);
            continue;
        };
        let answers = join_all(due.iter().map(|p| {
            let (spec, redis) = (LimitSpec { key: &p.key, limit: p.limit, window_ms: p.window_ms, cost: p.cost }, &redis);
            async move { redis.settle_reserve(&spec, p.algorithm, &p.handle).await.map(|_| ()) }
        }))
        .await;
        let mut again = Vec::new();
        for (mut p, answer) in due.into_iter().zip(answers) {
            match answer {
                Ok(()) => METRICS.settle_retry_applied(),
                Err(e) => {
                    let now = Instant::now();
                    if now >= p.until {
                        METRICS.settle_retry_dropped();
                        continue;
                    }
                    if let Some(suppressed) = r.failed_log.permit() {
                        tracing::warn!(error = %e, suppressed, "a settle retried in the background failed again; retrying");
                    }
                    p.delay = (p.delay * 2).min(MAX_DELAY);
                    p.due = now + p.delay;
                    again.push(p);
                }
            }
        }
        r.pending.lock().unwrap_or_else(|e| e.into_inner()).extend(again);
    }
}
