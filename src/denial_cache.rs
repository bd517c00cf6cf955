//! The exact denial cache: after Redis refuses a request, later requests for
//! the same key, limit and window of at least the same cost are refused here,
//! without a Redis call, until the moment Redis could first admit them.
//!
//! Why it is exact (docs/PERFORMANCE.md, "Denial cache"): the script refuses
//! a request of cost `c` at Redis time `now` when `count + c > limit`, and
//! answers `retry_after = t + window - now`, where `t` is the score of the
//! `(count + c - limit)`-th oldest admission. Until Redis time reaches
//! `t + window`, that admission and every newer one stay in the window: at
//! least `limit - c + 1` of them, so any request of cost `c' >= c` still
//! finds `count' + c' > limit`. A refusal records nothing and counts only
//! fall by expiry, so no request can change that; only a `reset` (DEL), a
//! refund, or a different clock (a failover) can, which `max_age` bounds.
//!
//! The entry is anchored at the time the request was *sent*, on this host's
//! monotonic clock: Redis read its clock later, so the entry can only expire
//! early, never late. It also ends 1 ms early for Redis's millisecond
//! floor, and 0.05 % early for clocks that run at different rates (NTP slews
//! at most 500 ppm).
//!
//! The table is fixed-size and direct-mapped; each slot is a seqlock of
//! atomics: a reader never waits (a slot being written reads as a miss) and
//! a writer never waits (a slot another writer holds keeps its entry). No
//! lock, no allocation. Slots are found by a 128-bit fingerprint of (key,
//! limit, window) from two hashers with per-process random keys, so another
//! client cannot craft a collision; an entry answers only a request whose
//! fingerprint equals it in all 128 bits.
//!
//! What can make a refusal false before its retry-after is something that
//! removes members: a refund, or the cancellation of a multi-item check's
//! reservation in one Cluster slot (docs/PROTOCOL.md 4b). Each of them bumps
//! the generation of the key's window (`forget_window`; a table of
//! generations indexed by a hash of key and window, so every limit and
//! algorithm of that window at once), after the removal is done. An entry
//! carries the generation its request was sent under and answers only while
//! that is still the window's generation; a refusal whose request was sent
//! before a bump is never recorded, so a lone check in flight across a
//! cancellation cannot put back what the cancellation made false.

use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::DenialCacheConfig;
use crate::protocol::Algorithm;
use crate::window::{LimitSpec, Verdict};

const MS: u64 = 1_000_000;

/// Rates of two clocks differ by at most 1/DRIFT_DIVISOR (500 ppm).
const DRIFT_DIVISOR: u64 = 2000;

/// Generations of windows (a power of two): two windows sharing one only
/// forget each other's entries more often (a miss, never a false refusal).
const GENERATIONS: usize = 4096;

/// One entry, as stored in a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    fingerprint: [u64; 2],
    /// When the refused request was sent, in ns since the cache's epoch.
    sent_ns: u64,
    /// Refuse until then (exclusive), in ns since the cache's epoch.
    expires_ns: u64,
    /// The smallest cost the entry refuses: the refused request's.
    cost: u32,
    /// As Redis answered them at `sent_ns`.
    count: u32,
    remaining: u32,
    retry_after_ms: u32,
    reset_ms: u32,
    /// The window's generation when the refused request was sent (low 32
    /// bits: a window bumped 2^32 times within `max_age` is not a concern).
    generation: u32,
}

/// One seqlock-guarded entry: 8 words, one cache line.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    /// Even: stable; odd: a writer is in.
    version: AtomicU64,
    fingerprint: [AtomicU64; 2],
    sent_ns: AtomicU64,
    expires_ns: AtomicU64,
    /// cost << 32 | count
    cost_count: AtomicU64,
    /// retry_after_ms << 32 | reset_ms
    times: AtomicU64,
    /// generation << 32 | remaining
    generation_remaining: AtomicU64,
}

impl Slot {
    /// The entry if no writer was in while it was read.
    fn read(&self) -> Option<Entry> {
        let v1 = self.version.load(Ordering::Acquire);
        if v1 & 1 == 1 {
            return None;
        }
        let fingerprint = [self.fingerprint[0].load(Ordering::Relaxed), self.fingerprint[1].load(Ordering::Relaxed)];
        let sent_ns = self.sent_ns.load(Ordering::Relaxed);
        let expires_ns = self.expires_ns.load(Ordering::Relaxed);
        let cost_count = self.cost_count.load(Ordering::Relaxed);
        let times = self.times.load(Ordering::Relaxed);
        let generation_remaining = self.generation_remaining.load(Ordering::Relaxed);
        // Orders the loads above before the version check below: a torn
        // read shows as a changed version.
        fence(Ordering::Acquire);
        if self.version.load(Ordering::Relaxed) != v1 {
            return None;
        }
        Some(Entry {
            fingerprint,
            sent_ns,
            expires_ns,
            cost: (cost_count >> 32) as u32,
            count: cost_count as u32,
            remaining: generation_remaining as u32,
            retry_after_ms: (times >> 32) as u32,
            reset_ms: times as u32,
            generation: (generation_remaining >> 32) as u32,
        })
    }

    /// Writes `e` unless another writer is in (then its entry stays: either
    /// is a true statement, and a lost write is only a later miss).
    fn write(&self, e: &Entry) -> bool {
        let v = self.version.load(Ordering::Relaxed);
        if v & 1 == 1 || self.version.compare_exchange(v, v + 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return false;
        }
        // No store below may become visible before the odd version.
        fence(Ordering::Release);
        self.fingerprint[0].store(e.fingerprint[0], Ordering::Relaxed);
        self.fingerprint[1].store(e.fingerprint[1], Ordering::Relaxed);
        self.sent_ns.store(e.sent_ns, Ordering::Relaxed);
        self.expires_ns.store(e.expires_ns, Ordering::Relaxed);
        self.cost_count.store(u64::from(e.cost) << 32 | u64::from(e.count), Ordering::Relaxed);
        self.times.store(u64::from(e.retry_after_ms) << 32 | u64::from(e.reset_ms), Ordering::Relaxed);
        self.generation_remaining.store(u64::from(e.generation) << 32 | u64::from(e.remaining), Ordering::Relaxed);
        self.version.store(v + 2, Ordering::Release);
        true
    }
}

/// What a miss hands to `record`: the fingerprint, and the send time the
/// entry will be anchored at (taken before the Redis call).
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    fingerprint: [u64; 2],
    sent_ns: u64,
    /// The window's generation when the request was sent, and its index.
    generation: u32,
    window: usize,
}

/// The answer of a lookup.
#[derive(Debug)]
pub enum Lookup {
    /// Refused here: what Redis would answer, with the times left now.
    Refused(Verdict),
    /// Ask Redis; then `record` its answer with the ticket.
    Miss(Ticket),
}

/// Whether a refusal by `algorithm` stays true, for every request of the
/// same key, limit and window at no smaller cost, until its retry-after:
/// the argument of the module doc. The ring decides exactly as the log
/// (src/redis/scripts/ring.lua; its retry-after names the same admission). GCRA's
/// state only moves on admissions and a larger cost needs more tokens, so
/// its refusals hold as long (src/redis/scripts/gcra.lua). The fixed window's count
/// and the sliding counter's estimate never fall before the retry-after
/// they answer without an admission (src/redis/scripts/fixed_window.lua,
/// sliding_counter.lua).
pub const fn is_exact_for(algorithm: Algorithm) -> bool {
    match algorithm {
        Algorithm::Log | Algorithm::Ring | Algorithm::Gcra | Algorithm::SlidingCounter | Algorithm::Fixed => true,
    }
}

/// The table of recent refusals; shared by every connection.
pub struct DenialCache {
    slots: Box<[Slot]>,
    mask: u64,
    /// Per window (by a hash of key and window): bumped by `forget_window`.
    generations: Box<[AtomicU64]>,
    hashers: [RandomState; 2],
    epoch: Instant,
    max_age_ns: u64,
}

impl std::fmt::Debug for DenialCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenialCache").field("slots", &self.slots.len()).field("max_age_ns", &self.max_age_ns).finish_non_exhaustive()
    }
}

impl DenialCache {
    /// `None` when the configuration turns it off.
    pub fn from_config(cfg: &DenialCacheConfig) -> Option<Self> {
        cfg.enabled.then(|| Self::new(cfg.slots, cfg.max_age))
    }

    /// `slots` is rounded up to a power of two.
    pub fn new(slots: usize, max_age: Duration) -> Self {
        let n = slots.max(1).next_power_of_two();
        Self {
            slots: (0..n).map(|_| Slot::default()).collect(),
            mask: n as u64 - 1,
            generations: (0..GENERATIONS).map(|_| AtomicU64::new(0)).collect(),
            hashers: [RandomState::new(), RandomState::new()],
            epoch: Instant::now(),
            max_age_ns: max_age.as_nanos().min(u64::MAX as u128) as u64,
        }
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// The 128-bit fingerprint of (key, window, limit, algorithm), and the
    /// index of the key's window's generation: the first hasher's state
    /// after key and window, so the key is hashed twice, not three times.
    fn fingerprint(&self, spec: &LimitSpec<'_>, algorithm: Algorithm) -> ([u64; 2], usize) {
        let mut window = 0;
        let fingerprint = std::array::from_fn(|i| {
            let mut h = self.hashers[i].build_hasher();
            h.write(spec.key);
            h.write_u32(spec.window_ms);
            if i == 0 {
                window = h.clone().finish() as usize & (GENERATIONS - 1);
            }
            h.write_u32(spec.limit);
            h.write_u8(algorithm.to_wire());
            h.finish()
        });
        (fingerprint, window)
    }

    /// The index of the generation of `key`'s window of `window_ms` (as
    /// `fingerprint` finds it).
    fn window(&self, key: &[u8], window_ms: u32) -> usize {
        let mut h = self.hashers[0].build_hasher();
        h.write(key);
        h.write_u32(window_ms);
        h.finish() as usize & (GENERATIONS - 1)
    }

    fn generation(&self, window: usize) -> u32 {
        self.generations[window].load(Ordering::Acquire) as u32
    }

    fn slot(&self, fingerprint: [u64; 2]) -> &Slot {
        &self.slots[(fingerprint[0] & self.mask) as usize]
    }

    /// Refuses `spec` if an entry covers it now; else a ticket for `record`.
    /// Each algorithm has entries of its own (its own Redis key); the
    /// caller asks only for algorithms `is_exact_for` accepts.
    pub fn check(&self, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Lookup {
        let (fingerprint, window) = self.fingerprint(spec, algorithm);
        let now = self.now_ns();
        let generation = self.generation(window);
        if let Some(e) = self.slot(fingerprint).read() {
            if let Some(v) = refusal(&e, fingerprint, spec.cost, now).filter(|_| e.generation == generation) {
                return Lookup::Refused(v);
            }
        }
        Lookup::Miss(Ticket { fingerprint, sent_ns: now, generation, window })
    }

    /// Forgets every entry of `spec`'s key and window (any limit): a refund
    /// took admissions back, so Redis may admit sooner than they say.
    pub fn forget(&self, spec: &LimitSpec<'_>) {
        self.forget_window(spec.key, spec.window_ms);
    }

    /// Forgets every entry of `key`'s window of `window_ms`, of any limit
    /// and algorithm, and every refusal of it still in flight (see the
    /// module doc): called after members of that window were removed (a
    /// refund, a reservation taken back), and before, when the removal may
    /// already be running.
    pub fn forget_window(&self, key: &[u8], window_ms: u32) {
        self.generations[self.window(key, window_ms)].fetch_add(1, Ordering::AcqRel);
    }

    /// Remembers Redis's refusal of the request `ticket` was taken for.
    /// Admissions are not recorded: they leave every entry true. Nor is a
    /// refusal of a request sent before its window was forgotten.
    pub fn record(&self, ticket: Ticket, cost: u32, v: &Verdict) {
        if v.allowed || self.generation(ticket.window) != ticket.generation {
            return;
        }
        if let Some(e) = entry(ticket, cost, v, self.max_age_ns) {
            if e.expires_ns > self.now_ns() {
                self.slot(e.fingerprint).write(&e);
            }
        }
    }
}

/// The entry for a refusal, or none if it would not outlive its margin.
fn entry(ticket: Ticket, cost: u32, v: &Verdict, max_age_ns: u64) -> Option<Entry> {
    let retry_ns = u64::from(v.retry_after_ms) * MS;
    // 1 ms for Redis's clock read in whole ms, and the rate drift.
    let life = retry_ns.checked_sub(MS + retry_ns.min(max_age_ns) / DRIFT_DIVISOR)?.min(max_age_ns);
    (life > 0).then(|| Entry {
        fingerprint: ticket.fingerprint,
        sent_ns: ticket.sent_ns,
        expires_ns: ticket.sent_ns + life,
        cost,
        count: v.count,
        remaining: v.remaining,
        retry_after_ms: v.retry_after_ms,
        reset_ms: v.reset_ms,
        generation: ticket.generation,
    })
}

/// The verdict `e` gives a request of `cost` with `fingerprint` at `now`.
fn refusal(e: &Entry, fingerprint: [u64; 2], cost: u32, now: u64) -> Option<Verdict> {
    if e.fingerprint != fingerprint || cost < e.cost || now >= e.expires_ns {
        return None;
    }
    // Less the same 1 ms: never later than Redis's own answer would be.
    let left_ms = |ms: u32| (e.sent_ns + u64::from(ms) * MS).saturating_sub(now + MS).div_ceil(MS) as u32;
    let retry_after_ms = left_ms(e.retry_after_ms).max(1);
    // Reset no sooner than the retry, as Redis answered them; a fixed
    // window in debt is refused past its own reset (its retry is the debt's
    // end), and its reset stays the window's.
    let reset_ms = if e.reset_ms >= e.retry_after_ms { left_ms(e.reset_ms).max(retry_after_ms) } else { left_ms(e.reset_ms) };
    Some(Verdict { allowed: false, count: e.count, remaining: e.remaining, retry_after_ms, reset_ms })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, VecDeque};
    use std::sync::Arc;

    fn denied(retry_after_ms: u32) -> Verdict {
        Verdict { allowed: false, count: 5, remaining: 0, retry_after_ms, reset_ms: retry_after_ms + 100 }
    }

    fn spec(key: &[u8], limit: u32, window_ms: u32, cost: u32) -> LimitSpec<'_> {
        LimitSpec { key, limit, window_ms, cost }
    }

    fn ticket(c: &DenialCache, s: &LimitSpec<'_>) -> Ticket {
        match c.check(s, Algorithm::Log) {
            Lookup::Miss(t) => t,
            Lookup::Refused(v) => panic!("refused: {v:?}"),
        }
    }

    #[test]
    fn a_refusal_is_kept_for_its_key_limit_window_and_larger_costs_only() {
        let c = DenialCache::new(1024, Duration::from_secs(10));
        let s = spec(b"k", 5, 60_000, 2);
        let t = ticket(&c, &s);
        c.record(t, 2, &denied(30_000));
        let Lookup::Refused(v) = c.check(&s, Algorithm::Log) else { panic!("not cached") };
        assert_eq!((v.allowed, v.count, v.remaining), (false, 5, 0));
        assert!((29_900..=30_000).contains(&v.retry_after_ms), "{v:?}");
        assert!(v.reset_ms >= v.retry_after_ms);
        assert!(matches!(c.check(&spec(b"k", 5, 60_000, 3), Algorithm::Log), Lookup::Refused(_)), "a larger cost is refused too");
        assert!(matches!(c.check(&spec(b"k", 5, 60_000, 1), Algorithm::Log), Lookup::Miss(_)), "a smaller cost may fit");
        assert!(matches!(c.check(&spec(b"k", 6, 60_000, 2), Algorithm::Log), Lookup::Miss(_)), "another limit is another entry");
        assert!(matches!(c.check(&spec(b"k", 5, 1000, 2), Algorithm::Log), Lookup::Miss(_)), "another window is another entry");
        assert!(matches!(c.check(&spec(b"k2", 5, 60_000, 2), Algorithm::Log), Lookup::Miss(_)));
        assert!(matches!(c.check(&s, Algorithm::Ring), Lookup::Miss(_)), "another algorithm is another entry");
        // Admissions change nothing.
        c.record(ticket(&c, &spec(b"k", 5, 60_000, 1)), 1, &Verdict { allowed: true, ..Verdict::default() });
        assert!(matches!(c.check(&s, Algorithm::Log), Lookup::Refused(_)));
    }

    #[test]
    fn forgetting_a_window_drops_its_entries_of_every_limit_and_refusals_still_in_flight() {
        let c = DenialCache::new(1024, Duration::from_secs(10));
        let (a, b) = (spec(b"k", 5, 60_000, 1), spec(b"k", 9, 60_000, 1));
        c.record(ticket(&c, &a), 1, &denied(30_000));
        c.record(ticket(&c, &b), 1, &denied(30_000));
        let other = spec(b"k", 5, 1000, 1);
        c.record(ticket(&c, &other), 1, &denied(900));
        // A check sent before the removal, answered after it.
        let in_flight = ticket(&c, &spec(b"k", 7, 60_000, 1));
        c.forget_window(b"k", 60_000);
        assert!(matches!(c.check(&a, Algorithm::Log), Lookup::Miss(_)));
        assert!(matches!(c.check(&b, Algorithm::Log), Lookup::Miss(_)), "every limit of the window");
        assert!(matches!(c.check(&a, Algorithm::Ring), Lookup::Miss(_)));
        if c.window(b"k", 1000) != c.window(b"k", 60_000) {
            assert!(matches!(c.check(&other, Algorithm::Log), Lookup::Refused(_)), "another window keeps its entry");
        }
        c.record(in_flight, 1, &denied(30_000));
        assert!(matches!(c.check(&spec(b"k", 7, 60_000, 1), Algorithm::Log), Lookup::Miss(_)), "a refusal sent before the forget is not recorded");
        // Sent after it: recorded.
        c.record(ticket(&c, &a), 1, &denied(30_000));
        assert!(matches!(c.check(&a, Algorithm::Log), Lookup::Refused(_)));
    }

    #[test]
    fn entries_end_early_never_late_and_within_max_age() {
        let t = Ticket { fingerprint: [1, 2], sent_ns: 1_000 * MS, generation: 0, window: 0 };
        // 1 ms for the ms floor and 0.05 % for drift, taken off the end.
        let e = entry(t, 1, &denied(1000), 10_000 * MS).unwrap();
        assert_eq!(e.expires_ns, t.sent_ns + 1000 * MS - MS - 500_000);
        let e = entry(t, 1, &denied(60_000), 1000 * MS).unwrap();
        assert_eq!(e.expires_ns, t.sent_ns + 1000 * MS, "capped at max_age");
        assert!(entry(t, 1, &denied(1), 1000 * MS).is_none(), "nothing left after the margin");
        // Retry-After counts down from the send time.
        let v = refusal(&entry(t, 1, &denied(1000), 10_000 * MS).unwrap(), [1, 2], 1, t.sent_ns + 250 * MS + 1).unwrap();
        assert_eq!(v.retry_after_ms, 749);
    }

    #[test]
    fn readers_never_see_a_torn_entry() {
        let c = Arc::new(DenialCache::new(1, Duration::from_secs(60)));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writers: Vec<_> = (0..2u32)
            .map(|w| {
                let (c, stop) = (c.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut i = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        i = i.wrapping_add(1);
                        let fp = [u64::from(w), u64::from(i)];
                        // Every field derived from i: a torn entry would mix two.
                        let v = Verdict { allowed: false, count: i, remaining: i, retry_after_ms: 50_000 + (i & 0xfff), reset_ms: 50_000 + (i & 0xfff) };
                        c.slot(fp).write(&entry(Ticket { fingerprint: fp, sent_ns: u64::from(i), generation: 0, window: 0 }, i, &v, u64::MAX).unwrap());
                    }
                })
            })
            .collect();
        let (mut seen, started) = (0, Instant::now());
        // Until enough entries were read whole (writers may start late on a busy machine).
        while seen < 50_000 && started.elapsed() < Duration::from_secs(30) {
            if let Some(e) = c.slots[0].read().filter(|e| e.cost != 0) {
                let i = e.fingerprint[1] as u32;
                assert_eq!((e.cost, e.count, e.remaining, e.sent_ns), (i, i, i, u64::from(i)), "{e:?}");
                assert_eq!(e.retry_after_ms, 50_000 + (i & 0xfff));
                seen += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        writers.into_iter().for_each(|w| w.join().unwrap());
        assert!(seen > 0);
    }

    /// The reference: a serial sliding log, exactly the script's rule.
    #[derive(Default)]
    struct Log {
        admitted: BTreeMap<(u8, u32), VecDeque<u64>>,
    }

    impl Log {
        /// The script at Redis time `now_ms`.
        fn check(&mut self, key: u8, limit: u32, window: u32, cost: u32, now_ms: u64) -> Verdict {
            let log = self.admitted.entry((key, window)).or_default();
            while log.front().is_some_and(|&t| t + u64::from(window) <= now_ms) {
                log.pop_front();
            }
            let count = log.len() as u32;
            if count + cost <= limit {
                log.extend(std::iter::repeat_n(now_ms, cost as usize));
                return Verdict { allowed: true, count: count + cost, remaining: limit - count - cost, retry_after_ms: 0, reset_ms: window };
            }
            let oldest = log[(count + cost - limit - 1) as usize];
            let newest = *log.back().unwrap();
            Verdict {
                allowed: false,
                count,
                remaining: limit.saturating_sub(count),
                retry_after_ms: (oldest + u64::from(window) - now_ms) as u32,
                reset_ms: (newest + u64::from(window) - now_ms) as u32,
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        /// Random requests (keys, limits, windows, costs; time moving by
        /// random steps, the Redis clock reading any sub-ms instant) through
        /// the cache in front of the reference, against the reference alone:
        /// every request the cache refuses, the reference refuses too, and
        /// the state of the log is the same as with no cache at all.
        #[test]
        fn the_cache_refuses_only_what_the_reference_refuses(
            ops in proptest::collection::vec((0u8..3, prop_oneof![Just(2u32), Just(3), Just(5)], prop_oneof![Just(7u32), Just(50)], 1u32..4, 0u64..4_000_000, 0u64..1_000_000), 1..300),
            max_age_ms in 1u64..200,
        ) {
            let c = DenialCache::new(2, Duration::from_millis(max_age_ms));
            let (mut with, mut without) = (Log::default(), Log::default());
            // The cache's clock; Redis's runs in step and reads it later, by
            // `lag`. Serial: each request is sent after the last one ran.
            let (mut now_ns, mut ran_ns) = (0u64, 0u64);
            for (key, limit, window, cost, step_ns, lag_ns) in ops {
                now_ns = (now_ns + step_ns).max(ran_ns);
                let cost = cost.min(limit);
                let k = [key];
                let s = spec(&k, limit, window, cost);
                let (fp, _) = c.fingerprint(&s, Algorithm::Log);
                match c.slot(fp).read().and_then(|e| refusal(&e, fp, cost, now_ns)) {
                    Some(v) => {
                        // Decided now, as Redis would with no lag at all.
                        ran_ns = now_ns;
                        let expected = without.check(key, limit, window, cost, now_ns / MS);
                        prop_assert!(!expected.allowed, "the cache refused what Redis admits: {:?}", expected);
                        prop_assert!(v.retry_after_ms <= expected.retry_after_ms, "retry {:?} later than Redis's {:?}", v, expected);
                    }
                    None => {
                        ran_ns = now_ns + lag_ns;
                        let expected = without.check(key, limit, window, cost, ran_ns / MS);
                        let got = with.check(key, limit, window, cost, ran_ns / MS);
                        prop_assert_eq!(got, expected);
                        if !got.allowed {
                            if let Some(e) = entry(Ticket { fingerprint: fp, sent_ns: now_ns, generation: 0, window: 0 }, cost, &got, c.max_age_ns) {
                                c.slot(fp).write(&e);
                            }
                        }
                    }
                }
            }
        }
    }
}
