//! Admission control towards Redis: an adaptive limit on the calls in
//! flight on the link, so that the daemon's own queue stays short enough
//! for admitted calls to meet their deadline. A call over the limit is not
//! queued: it is refused at once (`OVERLOADED`) and its fail policy decides.
//!
//! Why: all calls share one multiplexed connection, which Redis answers in
//! order. When more arrive than Redis answers, they queue in that pipeline,
//! and past a depth of (deadline x Redis's rate) every one of them misses
//! the deadline: a spike turns into timeouts for everybody instead of
//! refusals for the excess. The right depth depends on Redis, the network
//! and the host's load, so it is found at run time, in the spirit of TCP
//! Vegas and Netflix's concurrency-limits gradient:
//!
//! - Samples (the round trip of each answered call) are gathered in windows
//!   of `WINDOW` (at least `MIN_SAMPLES` samples, or any timeout).
//! - `no_load` estimates the round trip without our own queueing: the
//!   lowest sample of a window, followed down at once and up slowly (1/32 of
//!   the gap per window), so that a Redis that got farther away is learned;
//!   but up only from windows with at most `min` calls in flight: under a
//!   standing queue even the fastest call waits behind others, and learning
//!   that as "no load" would let the queue grow without end (the classic
//!   Vegas trap).
//! - Our queueing delay is the window's mean round trip minus `no_load`.
//!   While it stays within half the budget (the budget is 1/4 of the
//!   deadline: 5 ms of 20 ms) and the calls in flight reached half the limit
//!   in the window (there is demand to grow for), the limit grows by half:
//!   after a spike or a stall shrank it, a normal load gets its room back
//!   within tens of ms instead of being shed. Within the budget, it grows
//!   by its square root (gently, near the knee).
//! - When the mean rises above `no_load + budget`, the limit is multiplied
//!   by the gradient `(no_load + budget) / mean`, at least 1/2: the queue
//!   shrinks in proportion to how far latency is over.
//! - A window with a timeout of a call that waited in our own queue (Redis
//!   was answering the calls ahead of it) halves the limit: the queue was
//!   far too long. Timeouts during which Redis answered nothing at all, or
//!   whose timer fired late, are not reported here: a stall of Redis or of
//!   the host is not cured by a shorter queue, and halving on it would shed
//!   the arrivals of a quiet host after every hiccup (the breaker judges
//!   stalls, see `link`).
//!
//! A mean queueing delay of 1/4 of the deadline leaves room for the tail
//! (p99 at 2 to 3 times the mean) while a local Redis at 30k calls/s still
//! gets a pipeline of about 150 calls, near its full rate.
//!
//! The request path is atomics only: one `fetch_add` to enter (and a
//! `fetch_sub` on the way out, by the permit's drop), and per answer two
//! `fetch_add`s and a clock comparison; a `fetch_min`/`fetch_max` only when
//! a new extreme is seen. Once per window one caller wins a compare-and-swap
//! on the window's end and computes the new limit; the others go on. A
//! sample racing with that swap may land in the next window: harmless.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The limit of a fresh link: a burst of a few hundred calls (128 pipelined
/// on one connection, the server's cap, or a spike from many workers) is
/// not shed before anything is measured, and a local Redis answers 256 in
/// about 10 ms, within the default deadline. The first windows correct it.
const INITIAL_LIMIT: u32 = 256;
/// Length of a sampling window.
const WINDOW: Duration = Duration::from_millis(10);
/// A window with fewer answers (and no timeout) is extended: a handful of
/// samples says nothing about a queue.
const MIN_SAMPLES: u64 = 16;
/// `no_load` rises by 1/NO_LOAD_RISE of the gap per window.
const NO_LOAD_RISE: u64 = 32;
/// The queueing delay accepted on average, as a fraction of the deadline.
const BUDGET_DIVISOR: u32 = 4;
/// The most one window can shrink the limit by latency (not by timeouts).
const MIN_GRADIENT: f64 = 0.5;

/// The adaptive limit and the calls in flight.
#[derive(Debug)]
pub struct InFlightLimit {
    in_flight: AtomicU32,
    limit: AtomicU32,
    min: u32,
    max: u32,
    budget_us: u64,
    epoch: Instant,
    /// End of the current window, µs since `epoch`.
    window_end_us: AtomicU64,
    sum_us: AtomicU64,
    samples: AtomicU64,
    lowest_us: AtomicU64,
    timeouts: AtomicU64,
    /// Most calls in flight seen in the window.
    peak: AtomicU32,
    /// Round trip without our own queueing, µs (u64::MAX: none seen yet).
    no_load_us: AtomicU64,
    /// The window before this one closed long after its end (a stall).
    after_stall: AtomicBool,
}

/// A call admitted: holds its place until dropped.
#[derive(Debug)]
pub struct Permit<'a> {
    limit: &'a InFlightLimit,
    /// When it was admitted, µs since the limit's epoch.
    pub admitted_us: u64,
    /// Calls of ours in flight when it was admitted: the queue before it.
    pub ahead: u32,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.limit.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl InFlightLimit {
    /// A limit between `min` and `max`, starting at `INITIAL_LIMIT` (within
    /// them).
    pub fn new(min: u32, max: u32, deadline: Duration) -> Self {
        let min = min.max(1);
        let max = max.max(min);
        Self {
            in_flight: AtomicU32::new(0),
            limit: AtomicU32::new(INITIAL_LIMIT.clamp(min, max)),
            min,
            max,
            budget_us: (deadline / BUDGET_DIVISOR).as_micros() as u64,
            epoch: Instant::now(),
            window_end_us: AtomicU64::new(WINDOW.as_micros() as u64),
            sum_us: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            lowest_us: AtomicU64::new(u64::MAX),
            timeouts: AtomicU64::new(0),
            peak: AtomicU32::new(0),
            no_load_us: AtomicU64::new(u64::MAX),
            after_stall: AtomicBool::new(false),
        }
    }

    /// µs since the epoch at `at` (no clock read).
    #[inline]
    pub fn micros(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// A queue shorter than this is no queue: the limit never goes below it.
    #[inline]
    pub fn min(&self) -> u32 {
        self.min
    }

    /// Calls of ours in flight now.
    #[inline]
    pub fn current(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The current limit.
    #[inline]
    pub fn limit(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    /// A place for a call that started at `now`, or `None` when the limit
    /// is reached.
    #[inline]
    pub fn admit(&self, now: Instant) -> Option<Permit<'_>> {
        let ahead = self.in_flight.fetch_add(1, Ordering::Relaxed);
        if ahead >= self.limit.load(Ordering::Relaxed) {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if ahead + 1 > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(ahead + 1, Ordering::Relaxed);
        }
        Some(Permit { limit: self, admitted_us: self.micros(now), ahead })
    }

    /// A call answered (a result or an error reply) after `took`; `at` is now.
    #[inline]
    pub fn answered(&self, took: Duration, at: Instant) {
        let us = took.as_micros() as u64;
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.samples.fetch_add(1, Ordering::Relaxed);
        if us < self.lowest_us.load(Ordering::Relaxed) {
            self.lowest_us.fetch_min(us, Ordering::Relaxed);
        }
        self.maybe_adjust(self.micros(at));
    }

    /// A call that waited out its deadline in our own queue; `at` is now.
    pub fn timed_out(&self, at: Instant) {
        self.timeouts.fetch_add(1, Ordering::Relaxed);
        self.maybe_adjust(self.micros(at));
    }

    #[inline]
    fn maybe_adjust(&self, now_us: u64) {
        let end = self.window_end_us.load(Ordering::Relaxed);
        if now_us < end {
            return;
        }
        if self.window_end_us.compare_exchange(end, now_us + WINDOW.as_micros() as u64, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return; // another caller closes this window
        }
        // A window that closes more than the budget after its end saw no
        // answer for that long: the host (or Redis) stalled (see below).
        let stalled = now_us.saturating_sub(end) > self.budget_us;
        if stalled {
            self.after_stall.store(true, Ordering::Relaxed);
        }
        let samples = self.samples.load(Ordering::Relaxed);
        let timeouts = self.timeouts.load(Ordering::Relaxed);
        if samples < MIN_SAMPLES && timeouts == 0 {
            return; // too few to judge: the window goes on
        }
        let sum = self.sum_us.swap(0, Ordering::Relaxed);
        let samples = self.samples.swap(0, Ordering::Relaxed);
        let lowest = self.lowest_us.swap(u64::MAX, Ordering::Relaxed);
        let timeouts = self.timeouts.swap(0, Ordering::Relaxed);
        let peak = self.peak.swap(self.in_flight.load(Ordering::Relaxed), Ordering::Relaxed);
        let no_load = match (self.no_load_us.load(Ordering::Relaxed), lowest) {
            (old, u64::MAX) => old,
            (u64::MAX, new) => new,
            (old, new) if new <= old => new,
            (old, new) if peak <= self.min => old + (new - old) / NO_LOAD_RISE,
            (old, _) => old,
        };
        self.no_load_us.store(no_load, Ordering::Relaxed);
        let limit = self.limit();
        let mut next = next_limit(limit, Window { mean_us: sum.checked_div(samples), timeouts, peak }, no_load, self.budget_us);
        // After a stall, the round trips of the calls caught in it, and of
        // those answered just after it, measure the stall, not our queue,
        // and a shorter queue would not cure it: the stalled window and the
        // next do not shrink the limit by latency (a timeout of a queued
        // call still halves it). Without this, a 100 ms stall of a CI host
        // at half of Redis's capacity shed the burst that followed it. Under
        // real overload answers arrive all the time, so windows close on
        // time.
        let after_stall = self.after_stall.swap(stalled, Ordering::Relaxed);
        if after_stall && timeouts == 0 && next < limit {
            next = limit;
        }
        let next = next.clamp(self.min, self.max);
        if next != limit {
            self.limit.store(next, Ordering::Relaxed);
        }
        tracing::trace!(limit, next, samples, mean_us = sum.checked_div(samples), lowest_us = lowest, no_load_us = no_load, timeouts, peak, "in-flight limit window");
        crate::metrics::METRICS.redis_in_flight_limit(next);
    }
}

/// What one window saw.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// Mean round trip of the answered calls (None: none answered).
    mean_us: Option<u64>,
    timeouts: u64,
    peak: u32,
}

/// The limit after a window (before clamping to min and max).
fn next_limit(limit: u32, w: Window, no_load_us: u64, budget_us: u64) -> u32 {
    if w.timeouts > 0 {
        return limit / 2;
    }
    let Some(mean) = w.mean_us else { return limit };
    let target = no_load_us.saturating_add(budget_us);
    if mean > target {
        let gradient = (target as f64 / mean as f64).max(MIN_GRADIENT);
        return (limit as f64 * gradient) as u32;
    }
    if w.peak.saturating_mul(2) < limit {
        return limit; // no demand to grow for
    }
    if mean <= no_load_us.saturating_add(budget_us / 2) {
        return limit + (limit / 2).max(1);
    }
    limit + ((limit as f64).sqrt() as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: u64 = 5_000;

    fn w(mean_us: u64, timeouts: u64, peak: u32) -> Window {
        Window { mean_us: Some(mean_us), timeouts, peak }
    }

    #[test]
    fn grows_only_with_demand_while_latency_is_near_the_minimum() {
        assert_eq!(next_limit(64, w(300, 0, 40), 200, BUDGET), 96, "in demand, near the minimum: + half");
        assert_eq!(next_limit(64, w(300, 0, 20), 200, BUDGET), 64, "not in demand: unchanged");
        assert_eq!(next_limit(64, w(5_200, 0, 64), 200, BUDGET), 72, "within the budget: + sqrt");
    }

    #[test]
    fn shrinks_in_proportion_when_latency_rises_and_halves_on_timeouts() {
        assert_eq!(next_limit(100, w(10_400, 0, 100), 200, BUDGET), 50, "twice the target: half");
        assert_eq!(next_limit(100, w(6_500, 0, 100), 200, BUDGET), 80, "(200+5000)/6500 = 0.8");
        assert_eq!(next_limit(100, w(50_000, 0, 100), 200, BUDGET), 50, "at most halved by latency");
        assert_eq!(next_limit(100, w(300, 1, 100), 200, BUDGET), 50, "a timeout halves");
        assert_eq!(next_limit(100, Window { mean_us: None, timeouts: 0, peak: 0 }, 200, BUDGET), 100);
    }

    #[test]
    fn admits_up_to_the_limit_and_frees_places_on_drop() {
        let l = InFlightLimit::new(2, 8, Duration::from_millis(20));
        assert_eq!(l.limit(), 8, "starts at 256 within the bounds");
        assert_eq!(InFlightLimit::new(16, 1024, Duration::from_millis(20)).limit(), 256);
        let now = Instant::now();
        let held: Vec<_> = (0..8).map(|_| l.admit(now).expect("under the limit")).collect();
        assert!(l.admit(now).is_none(), "the ninth is refused");
        drop(held);
        assert!(l.admit(now).is_some());
        assert_eq!(l.in_flight.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_window_of_slow_answers_shrinks_the_limit_and_fast_ones_grow_it_back() {
        let l = InFlightLimit::new(4, 1000, Duration::from_millis(20));
        l.limit.store(16, Ordering::Relaxed);
        let t0 = l.epoch;
        let held: Vec<_> = (0..16).map(|_| l.admit(t0).unwrap()).collect();
        // Window 1 (ends at 10 ms): fast answers, with demand.
        for _ in 0..20 {
            l.answered(Duration::from_micros(200), t0 + Duration::from_millis(1));
        }
        assert_eq!(l.limit(), 16, "nothing decided before the window ends");
        l.answered(Duration::from_micros(200), t0 + Duration::from_millis(10));
        assert_eq!(l.limit(), 24, "16 + 16 / 2");
        assert_eq!(l.no_load_us.load(Ordering::Relaxed), 200);
        // Window 2: 15 ms mean, far over 0.2 + 5 ms: halved (at most).
        let held: Vec<_> = held.into_iter().chain((0..8).map(|_| l.admit(t0).unwrap())).collect();
        for _ in 0..20 {
            l.answered(Duration::from_millis(15), t0 + Duration::from_millis(12));
        }
        l.answered(Duration::from_millis(15), t0 + Duration::from_millis(20));
        assert_eq!(l.limit(), 12);
        assert_eq!(l.no_load_us.load(Ordering::Relaxed), 200, "24 in flight, above min: slow answers are queueing, not a farther Redis");
        // A timeout halves at its window's end, never below min.
        l.timed_out(t0 + Duration::from_millis(30));
        assert_eq!(l.limit(), 6);
        l.timed_out(t0 + Duration::from_millis(40));
        assert_eq!(l.limit(), 4);
        drop(held);
    }

    #[test]
    fn slow_answers_right_after_a_stall_do_not_shrink_the_limit() {
        let l = InFlightLimit::new(4, 1000, Duration::from_millis(20));
        l.limit.store(64, Ordering::Relaxed);
        let t0 = l.epoch;
        let held: Vec<_> = (0..40).map(|_| l.admit(t0).unwrap()).collect();
        for _ in 0..20 {
            l.answered(Duration::from_micros(200), t0 + Duration::from_millis(1));
        }
        l.answered(Duration::from_micros(200), t0 + Duration::from_millis(10));
        let base = l.limit();
        // The host stalls 100 ms: the next answers come 90 ms after the
        // window's end, slow. Neither that window nor the next shrinks.
        for _ in 0..20 {
            l.answered(Duration::from_millis(100), t0 + Duration::from_millis(110));
        }
        assert_eq!(l.limit(), base, "the window closed 90 ms late: a stall, not a queue");
        for _ in 0..20 {
            l.answered(Duration::from_millis(60), t0 + Duration::from_millis(115));
        }
        l.answered(Duration::from_millis(60), t0 + Duration::from_millis(121));
        assert_eq!(l.limit(), base, "the window after a stall still holds its backlog");
        // Slow answers in a window that closes on time do shrink it.
        for _ in 0..20 {
            l.answered(Duration::from_millis(60), t0 + Duration::from_millis(125));
        }
        l.answered(Duration::from_millis(60), t0 + Duration::from_millis(131));
        assert!(l.limit() < base, "{} vs {base}", l.limit());
        drop(held);
    }
}
