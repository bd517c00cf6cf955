//! Admission control towards Redis: a call is refused at once
//! (`OVERLOADED`, its fail policy decides) only when waiting in line would
//! make it miss its deadline. Nothing is queued in the daemon itself.
//!
//! Why: all calls share one multiplexed connection, which Redis answers in
//! order. When more arrive than Redis answers, they queue in that pipeline,
//! and past a depth of (deadline x Redis's rate) every one of them misses
//! the deadline: a spike turns into timeouts for everybody instead of
//! refusals for the excess. Below that depth a queue costs latency, not
//! decisions: a healthy Redis that answers within the deadline must not cost
//! a request its decision (issue 23: the earlier latency-gradient limit,
//! which kept the mean queueing delay within 1/4 of the deadline, shed
//! 0.2 % of a 400-deep burst that Redis would have answered in time).
//!
//! A call is shed when one of two estimates says it would miss:
//!
//! ```text
//! queue:    no_load + ahead x service > 7/8 x deadline   (ahead >= limit)
//! silence:  no_load + silent_for      > deadline         (ahead >= 1)
//! ```
//!
//! - `service`: the observed time Redis (with the network and our own reply
//!   handling) takes per call while our pipeline is busy: the gap between
//!   two consecutive answers, counted only when the later call was already
//!   in flight at the earlier answer (it was waiting: the gap is service,
//!   not idleness). Answers read in one batch have gaps of 0 and count too.
//!   `service` is the drain rate over the last `RECENT` (5) sampling
//!   windows (`WINDOW`, each at least `MIN_SAMPLES` such answers): all
//!   their gaps over all their busy answers, so a hiccup weighs what it
//!   cost the queue, no more (a median of per-window means overweighted
//!   the short windows that hold a stall, and shed a healthy 800-deep
//!   queue). The gaps include the host's short stalls (a loaded host that
//!   deschedules Redis or the daemon drains the queue that much slower, and
//!   a queue sized for the ideal pace times out wholesale: measured, 2x
//!   overload then left Redis deciding 11k/s of 49k/s); one gap counts at
//!   most a quarter of the deadline (a longer silence is the silence
//!   estimate's business). A call that times out although it was queued behind calls
//!   Redis was answering (`queued`) suggests `service >= (deadline -
//!   no_load) / ahead`: its window counts at least that, for the timed-out
//!   call with the MOST calls ahead (the weakest bound): when a host stall
//!   times out every call in flight at once, those near the head of the
//!   queue prove nothing about it (at 20 ms, one with 16 ahead would claim
//!   1.2 ms per call and shed nearly everything).
//! - `no_load`: the round trip without our own queueing, the lowest sample
//!   of a window, followed down at once and up slowly (1/32 of the gap per
//!   window), and up only from windows with at most `min` calls in flight
//!   (under a standing queue even the fastest call waits behind others).
//! - `silent_for`: how long Redis has answered nothing while calls of ours
//!   were waiting (since the later of the last answer and the moment the
//!   link last became busy after a quiet spell). A stalled Redis (DEBUG
//!   SLEEP, SIGSTOP, a black hole) makes it grow: once the calls ahead have
//!   waited a deadline with no answer (they are lost already, and a call
//!   behind them is answered after them), every call arriving behind a
//!   waiting one is shed at once,
//!   whatever `min_in_flight` says; the first call of an empty pipeline is
//!   always admitted, as a probe. The timeouts of the stall keep the silence
//!   going: the link counts as busy again only after a deadline with no
//!   timeout, so a stall does not admit a fresh deadline's worth of doomed
//!   calls every time its queue empties.
//!
//! The depth part is kept as a limit, `(target - no_load) / service` with
//! `target` = 7/8 of the deadline (room for the estimate's error), clamped
//! to `min_in_flight..=max_in_flight`, recomputed once per window
//! (exported as `ratelimitd_redis_in_flight_limit`). Until `service` has
//! been measured the limit is `max_in_flight`: with nothing measured there
//! is no ground to say a call would miss its deadline.
//!
//! Where it is not exact: `service` is a mean; a queue at the limit waits
//! about 7/8 of the deadline on average and its tail may time out (those
//! `queued` timeouts raise the estimate). Several Cluster nodes answer in
//! parallel: the gaps are those of all nodes together, so `ahead x service`
//! is the wait of an evenly spread queue.
//!
//! The request path is atomics only: one `fetch_add` to enter (and a
//! `fetch_sub` on the way out, by the permit's drop), four loads when calls
//! are ahead; per answer a `fetch_max` and, for
//! a busy answer, two `fetch_add`s. Once per window one caller wins a
//! compare-and-swap on the window's end and computes the new limit; the
//! others go on. A sample racing with that swap may land in the next
//! window: harmless.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Length of a sampling window.
const WINDOW: Duration = Duration::from_millis(10);
/// A window with fewer busy answers (and no queued timeout) is extended: a
/// handful of samples says nothing about Redis's pace.
const MIN_SAMPLES: u64 = 16;
/// `no_load` rises by 1/NO_LOAD_RISE of the gap per window.
const NO_LOAD_RISE: u64 = 32;
/// A gap between answers counts at most deadline / STALL_DIVISOR.
const STALL_DIVISOR: u64 = 4;
/// The service time is the drain rate over the last RECENT windows: all
/// their gaps over all their busy answers.
const RECENT: usize = 5;
/// The queue is allowed a mean wait of deadline x TARGET_EIGHTHS / 8.
const TARGET_EIGHTHS: u64 = 7;
/// `no_load` and timestamps: none seen yet.
const NONE: u64 = u64::MAX;

/// The admission state of one link: calls in flight, the depth limit and
/// the estimates it comes from.
#[derive(Debug)]
pub struct InFlightLimit {
    in_flight: AtomicU32,
    limit: AtomicU32,
    min: u32,
    max: u32,
    deadline_us: u64,
    epoch: Instant,
    /// End of the current window, µs since `epoch`.
    window_end_us: AtomicU64,
    /// Answers of the window, and the lowest round trip among them.
    samples: AtomicU64,
    lowest_us: AtomicU64,
    /// Busy answers of the window (see the module doc) and their gaps.
    busy_answers: AtomicU64,
    busy_gap_us: AtomicU64,
    /// Queued timeouts of the window, and the most calls ahead of one.
    queued_timeouts: AtomicU64,
    deepest_ahead: AtomicU32,
    /// Most calls in flight seen in the window.
    peak: AtomicU32,
    /// Round trip without our own queueing, µs (NONE: none seen yet).
    no_load_us: AtomicU64,
    /// Time per call while the pipeline is busy, ns (0: not measured yet).
    service_ns: AtomicU64,
    /// The busy answers and their gaps (µs) of the last windows, written by
    /// the window's closer only, at `recent_next`.
    recent_answers: [AtomicU64; RECENT],
    recent_gaps_us: [AtomicU64; RECENT],
    recent_next: AtomicU32,
    /// When Redis last answered a call of ours, µs since `epoch`.
    last_answer_us: AtomicU64,
    /// When the link last became busy after a quiet spell.
    busy_since_us: AtomicU64,
    /// When a call last waited out its deadline (NONE: never).
    last_timeout_us: AtomicU64,
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
    /// A limit between `min` and `max` for calls with `deadline`, starting
    /// at `max` (nothing measured yet).
    pub fn new(min: u32, max: u32, deadline: Duration) -> Self {
        let min = min.max(1);
        let max = max.max(min);
        Self {
            in_flight: AtomicU32::new(0),
            limit: AtomicU32::new(max),
            min,
            max,
            deadline_us: deadline.as_micros() as u64,
            epoch: Instant::now(),
            window_end_us: AtomicU64::new(WINDOW.as_micros() as u64),
            samples: AtomicU64::new(0),
            lowest_us: AtomicU64::new(NONE),
            busy_answers: AtomicU64::new(0),
            busy_gap_us: AtomicU64::new(0),
            queued_timeouts: AtomicU64::new(0),
            deepest_ahead: AtomicU32::new(0),
            peak: AtomicU32::new(0),
            no_load_us: AtomicU64::new(NONE),
            service_ns: AtomicU64::new(0),
            recent_answers: Default::default(),
            recent_gaps_us: Default::default(),
            recent_next: AtomicU32::new(0),
            last_answer_us: AtomicU64::new(0),
            busy_since_us: AtomicU64::new(0),
            last_timeout_us: AtomicU64::new(NONE),
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

    /// The current depth limit.
    #[inline]
    pub fn limit(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    /// When Redis last answered a call of ours, µs since the epoch: the
    /// breaker's evidence of a live Redis.
    #[inline]
    pub fn last_answer_us(&self) -> u64 {
        self.last_answer_us.load(Ordering::Relaxed)
    }

    /// The estimated time per call of a busy pipeline, ns (0: not yet).
    #[cfg(test)]
    fn service_ns(&self) -> u64 {
        self.service_ns.load(Ordering::Relaxed)
    }

    /// A place for a call that started at `now`, or `None` when waiting
    /// would miss the deadline (see the module doc).
    #[inline]
    pub fn admit(&self, now: Instant) -> Option<Permit<'_>> {
        let ahead = self.in_flight.fetch_add(1, Ordering::Relaxed);
        let now_us = self.micros(now);
        if ahead == 0 {
            // The first call of an empty pipeline: a probe, always
            // admitted. The link is busy from now, unless a call timed out
            // within the last deadline (Redis may still be silent).
            let last_timeout = self.last_timeout_us.load(Ordering::Relaxed);
            if last_timeout == NONE || now_us.saturating_sub(last_timeout) > self.deadline_us {
                self.busy_since_us.store(now_us, Ordering::Relaxed);
            }
        } else if ahead >= self.limit.load(Ordering::Relaxed) || self.silent_past_deadline(now_us) {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if ahead + 1 > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(ahead + 1, Ordering::Relaxed);
        }
        Some(Permit { limit: self, admitted_us: now_us, ahead })
    }

    /// Whether Redis has been silent for a deadline (less the no-load round
    /// trip) while calls of ours were waiting, at `now_us`: the calls ahead
    /// already missed their deadline, and a call behind them would too
    /// unless the stall ended at this very moment.
    #[inline]
    fn silent_past_deadline(&self, now_us: u64) -> bool {
        let quiet_from = self.last_answer_us.load(Ordering::Relaxed).max(self.busy_since_us.load(Ordering::Relaxed));
        let no_load = match self.no_load_us.load(Ordering::Relaxed) {
            NONE => 0,
            n => n,
        };
        now_us.saturating_sub(quiet_from) + no_load > self.deadline_us
    }

    /// A call admitted at `admitted_us` answered (a result or an error
    /// reply) after `took`; `at` is now.
    #[inline]
    pub fn answered(&self, took: Duration, at: Instant, admitted_us: u64) {
        let at_us = self.micros(at);
        let us = took.as_micros() as u64;
        self.samples.fetch_add(1, Ordering::Relaxed);
        if us < self.lowest_us.load(Ordering::Relaxed) {
            self.lowest_us.fetch_min(us, Ordering::Relaxed);
        }
        let previous = self.last_answer_us.fetch_max(at_us, Ordering::Relaxed);
        if admitted_us < previous {
            // In flight at the previous answer: the gap is Redis serving
            // the pipeline (unless it is a stall).
            let gap = at_us.saturating_sub(previous).min(self.deadline_us / STALL_DIVISOR);
            self.busy_answers.fetch_add(1, Ordering::Relaxed);
            self.busy_gap_us.fetch_add(gap, Ordering::Relaxed);
        }
        self.maybe_adjust(at_us);
    }

    /// A call that waited out its deadline; `queued`: behind `ahead` calls
    /// that Redis was answering (our own queue was too long). `at` is now.
    pub fn timed_out(&self, at: Instant, ahead: u32, queued: bool) {
        let at_us = self.micros(at);
        self.last_timeout_us.store(at_us, Ordering::Relaxed);
        if queued {
            self.queued_timeouts.fetch_add(1, Ordering::Relaxed);
            self.deepest_ahead.fetch_max(ahead.max(1), Ordering::Relaxed);
        }
        self.maybe_adjust(at_us);
    }

    #[inline]
    fn maybe_adjust(&self, now_us: u64) {
        let end = self.window_end_us.load(Ordering::Relaxed);
        if now_us < end {
            return;
        }
        if self.busy_answers.load(Ordering::Relaxed) < MIN_SAMPLES && self.queued_timeouts.load(Ordering::Relaxed) == 0 {
            return; // too few to judge: the window goes on
        }
        if self.window_end_us.compare_exchange(end, now_us + WINDOW.as_micros() as u64, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return; // another caller closes this window
        }
        let lowest = self.lowest_us.swap(NONE, Ordering::Relaxed);
        let samples = self.samples.swap(0, Ordering::Relaxed);
        let busy = self.busy_answers.swap(0, Ordering::Relaxed);
        let gaps = self.busy_gap_us.swap(0, Ordering::Relaxed);
        let queued_timeouts = self.queued_timeouts.swap(0, Ordering::Relaxed);
        let deepest_ahead = self.deepest_ahead.swap(0, Ordering::Relaxed);
        let peak = self.peak.swap(self.in_flight.load(Ordering::Relaxed), Ordering::Relaxed);
        let no_load = match (self.no_load_us.load(Ordering::Relaxed), lowest) {
            (old, NONE) => old,
            (NONE, new) => new,
            (old, new) if new <= old => new,
            (old, new) if peak <= self.min => old + (new - old) / NO_LOAD_RISE,
            (old, _) => old,
        };
        self.no_load_us.store(no_load, Ordering::Relaxed);
        let no_load = if no_load == NONE { 0 } else { no_load };
        if busy >= MIN_SAMPLES {
            let at = self.recent_next.fetch_add(1, Ordering::Relaxed) as usize % RECENT;
            self.recent_answers[at].store(busy, Ordering::Relaxed);
            self.recent_gaps_us[at].store(gaps, Ordering::Relaxed);
        }
        let answers: u64 = self.recent_answers.iter().map(|a| a.load(Ordering::Relaxed)).sum();
        let gaps: u64 = self.recent_gaps_us.iter().map(|a| a.load(Ordering::Relaxed)).sum();
        let drain_ns = (answers > 0).then(|| (gaps * 1000 / answers).max(1));
        let timed_out_ahead = (queued_timeouts > 0).then_some(deepest_ahead);
        let service = window_service(drain_ns, timed_out_ahead, self.deadline_us.saturating_sub(no_load)).unwrap_or(0);
        self.service_ns.store(service, Ordering::Relaxed);
        let limit = self.limit();
        let next = depth_limit(service, self.deadline_us, no_load).map_or(limit, |d| d.clamp(self.min, self.max));
        if next != limit {
            self.limit.store(next, Ordering::Relaxed);
        }
        tracing::trace!(limit, next, samples, busy, service_ns = service, lowest_us = lowest, no_load_us = no_load, queued_timeouts, peak, "in-flight limit window");
        crate::metrics::METRICS.redis_in_flight_limit(next);
    }
}

/// The service time: the drain rate `window_ns` of the recent windows' busy answers,
/// raised to what a queued timeout behind `timed_out_ahead` calls proves:
/// `room_us` (deadline - no_load) / ahead. None: the window says nothing.
fn window_service(window_ns: Option<u64>, timed_out_ahead: Option<u32>, room_us: u64) -> Option<u64> {
    let proven = timed_out_ahead.map(|ahead| room_us * 1000 / ahead.max(1) as u64);
    match (window_ns, proven) {
        (None, None) => None,
        (w, p) => Some(w.unwrap_or(0).max(p.unwrap_or(0)).max(1)),
    }
}

/// The queue depth whose estimated wait is the target (7/8 of the
/// deadline), or None while the service time is unknown.
fn depth_limit(service_ns: u64, deadline_us: u64, no_load_us: u64) -> Option<u32> {
    if service_ns == 0 {
        return None;
    }
    let target_us = deadline_us * TARGET_EIGHTHS / 8;
    Some((target_us.saturating_sub(no_load_us) * 1000 / service_ns).min(u32::MAX as u64) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_windows_service_time_is_its_mean_gap_raised_by_a_queued_timeout() {
        assert_eq!(window_service(Some(40_000), None, 19_000), Some(40_000));
        assert_eq!(window_service(None, None, 19_000), None, "nothing to say");
        assert_eq!(window_service(Some(40_000), Some(100), 19_000), Some(190_000), "100 ahead took more than 19 ms: >= 190 µs each");
        assert_eq!(window_service(Some(400_000), Some(100), 19_000), Some(400_000), "never lowered by a timeout");
        assert_eq!(window_service(None, Some(100), 19_000), Some(190_000));
    }

    #[test]
    fn the_depth_limit_is_the_queue_that_waits_seven_eighths_of_the_deadline() {
        assert_eq!(depth_limit(0, 20_000, 200), None);
        assert_eq!(depth_limit(30_000, 20_000, 500), Some(566), "(17.5 ms - 0.5 ms) / 30 µs");
        assert_eq!(depth_limit(1_000_000, 20_000, 500), Some(17));
    }

    #[test]
    fn admits_up_to_the_limit_and_frees_places_on_drop() {
        let l = InFlightLimit::new(2, 8, Duration::from_millis(20));
        assert_eq!(l.limit(), 8, "starts at max: nothing measured");
        let now = Instant::now();
        let held: Vec<_> = (0..8).map(|_| l.admit(now).expect("under the limit")).collect();
        assert!(l.admit(now).is_none(), "the ninth is refused");
        drop(held);
        assert!(l.admit(now).is_some());
        assert_eq!(l.in_flight.load(Ordering::Relaxed), 0);
    }

    /// Answers of a busy pipeline: `n` calls admitted at `from`, answered
    /// `gap` apart starting at `first`.
    fn busy_answers(l: &InFlightLimit, from: Instant, first: Instant, n: u32, gap: Duration) {
        let held: Vec<_> = (0..n).map(|_| l.admit(from).expect("admitted")).collect();
        for (i, p) in held.iter().enumerate() {
            let at = first + gap * i as u32;
            l.answered(at - from, at, p.admitted_us);
        }
    }

    #[test]
    fn a_deep_queue_that_redis_answers_in_time_is_never_shed() {
        // 30 µs per call, 20 ms deadline: 400 in flight wait 12 ms.
        let l = InFlightLimit::new(16, 1024, Duration::from_millis(20));
        let t0 = l.epoch;
        busy_answers(&l, t0, t0 + MS, 200, Duration::from_micros(30));
        busy_answers(&l, t0 + 11 * MS, t0 + 12 * MS, 200, Duration::from_micros(30));
        assert_eq!(l.service_ns(), 30_000);
        assert!(l.limit() > 400, "{}", l.limit());
        let now = t0 + 20 * MS;
        let held: Vec<_> = (0..400).map(|i| l.admit(now).unwrap_or_else(|| panic!("call {i} of 400 shed"))).collect();
        drop(held);
    }

    #[test]
    fn a_queue_redis_cannot_answer_in_time_is_shed_at_its_depth() {
        // 200 µs per call: 20 ms hold about 85 calls (17.5 ms - 0.5 ms).
        let l = InFlightLimit::new(16, 1024, Duration::from_millis(20));
        let t0 = l.epoch;
        busy_answers(&l, t0, t0 + MS / 2, 40, Duration::from_micros(200));
        busy_answers(&l, t0 + 12 * MS, t0 + 13 * MS, 40, Duration::from_micros(200));
        assert_eq!(l.service_ns(), 200_000);
        assert_eq!(l.limit(), 85);
        let now = t0 + 30 * MS;
        let held: Vec<_> = (0..85).map(|_| l.admit(now).unwrap()).collect();
        assert!(l.admit(now).is_none());
        drop(held);
    }

    #[test]
    fn a_silent_redis_sheds_every_call_behind_a_waiting_one_after_a_deadline() {
        let l = InFlightLimit::new(16, 1024, Duration::from_millis(20));
        let t0 = l.epoch;
        let probe = l.admit(t0 + MS).expect("the first call is a probe");
        let waiting: Vec<_> = (1..=10).map(|i| l.admit(t0 + MS + MS * i).expect("within the deadline")).collect();
        assert!(l.admit(t0 + 22 * MS).is_none(), "silent for 21 ms: shed at once");
        // The calls time out; a new probe goes through, the rest is shed
        // while the silence goes on.
        l.timed_out(t0 + 21 * MS, 0, false);
        drop(waiting);
        drop(probe);
        let probe = l.admit(t0 + 23 * MS).expect("an empty pipeline: a probe");
        assert!(l.admit(t0 + 23 * MS).is_none(), "still silent since 1 ms");
        drop(probe);
        // An answer ends the silence.
        let p = l.admit(t0 + 30 * MS).unwrap();
        l.answered(MS / 2, t0 + 30 * MS + MS / 2, p.admitted_us);
        let q = l.admit(t0 + 31 * MS).unwrap();
        assert!(l.admit(t0 + 31 * MS).is_some(), "Redis answers again");
        drop((p, q));
    }

    #[test]
    fn a_hiccup_of_the_host_weighs_what_it_cost_the_queue_and_passes() {
        let l = InFlightLimit::new(16, 1024, Duration::from_millis(200));
        let t0 = l.epoch;
        for w in 0..3u32 {
            busy_answers(&l, t0 + 11 * MS * w, t0 + 11 * MS * w + MS, 40, Duration::from_micros(30));
        }
        assert_eq!(l.service_ns(), 30_000);
        // The host stalls 3 ms between each of 20 answers (57 ms in all).
        busy_answers(&l, t0 + 33 * MS, t0 + 34 * MS, 20, 3 * MS);
        busy_answers(&l, t0 + 100 * MS, t0 + 101 * MS, 40, Duration::from_micros(30));
        // 57 ms of stall over about 150 busy answers of these windows: the
        // queue drained at about 0.4 ms per call meanwhile, not 3 ms.
        let s = l.service_ns();
        assert!((300_000..600_000).contains(&s), "{s}");
        // Five more ordinary windows and it is gone.
        for w in 0..5u32 {
            busy_answers(&l, t0 + 112 * MS + 11 * MS * w, t0 + 113 * MS + 11 * MS * w, 40, Duration::from_micros(30));
        }
        busy_answers(&l, t0 + 200 * MS, t0 + 201 * MS, 40, Duration::from_micros(30));
        assert_eq!(l.service_ns(), 30_000);
    }
}
