//! The keys refused most in the last minute: a bounded top-k (space-saving,
//! Metwally et al. 2005) for `GET /top.json` and `ratelimitd top`.
//!
//! The request path adds a refusal with `record`: one hash of the key, a
//! `try_lock` on its thread's shard (never waits: when the shard is busy,
//! e.g. a reader copying it, the refusal is counted as skipped instead), a
//! scan of at most `K` hashes and, for a key not yet tracked, a copy of at
//! most `KEY_BYTES` bytes over the least-counted entry. No allocation, no
//! syscall. Shards are per thread, so runtime threads never contend; a
//! key's counts in several shards are merged when read.
//!
//! Time: each shard keeps the current slot and the `PAST_SLOTS` before it;
//! a background task (`rotate_every_slot`) closes a slot every `SLOT`. A
//! snapshot merges them all: 50 to 60 s of refusals.
//!
//! Exactness (space-saving): in each summary a tracked key's count is an
//! upper bound of its true count and `count - error` a lower bound, with
//! `error` at most the summary's least count, itself at most `N_s / K` for
//! `N_s` refusals recorded in that summary. Merged over summaries, the
//! listed `refused` is an upper bound, `refused - error` a lower bound, and
//! `error <= N / K` with `N` the refusals recorded in the window; any key
//! refused more than `N / K` times in the window is tracked (listed unless
//! `K` others have a higher upper bound).

use std::cell::Cell;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::park::Parking;

/// Keys tracked per summary.
pub const K: usize = 64;
/// Bytes of a key kept for display (the first ones); the identity is the
/// key's full 64-bit hash.
pub const KEY_BYTES: usize = 128;
/// One time slot.
pub const SLOT: Duration = Duration::from_secs(10);
/// Closed slots kept besides the current one.
pub const PAST_SLOTS: usize = 5;
/// Shards (runtime threads beyond this share one, with `try_lock`). With
/// the slots, at most 32 summaries: a snapshot tracks them in a `u32`.
const SHARDS: usize = 4;
const _: () = assert!(SHARDS * (PAST_SLOTS + 1) <= 32);

/// One space-saving summary, as arrays so the scans touch few cache lines.
#[derive(Clone)]
struct Summary {
    len: usize,
    /// Refusals recorded in this summary.
    total: u64,
    hashes: [u64; K],
    counts: [u64; K],
    errors: [u64; K],
    key_lens: [u32; K],
    keys: [[u8; KEY_BYTES]; K],
}

impl Summary {
    const EMPTY: Summary = Summary { len: 0, total: 0, hashes: [0; K], counts: [0; K], errors: [0; K], key_lens: [0; K], keys: [[0; KEY_BYTES]; K] };

    #[inline]
    fn add(&mut self, hash: u64, key: &[u8]) {
        self.total += 1;
        if let Some(i) = self.hashes[..self.len].iter().position(|&h| h == hash) {
            self.counts[i] += 1;
            return;
        }
        let i = if self.len < K {
            self.len += 1;
            self.counts[self.len - 1] = 0;
            self.errors[self.len - 1] = 0;
            self.len - 1
        } else {
            // Space-saving: the new key takes the least-counted entry and
            // inherits its count as the error.
            let i = min_index(&self.counts);
            self.errors[i] = self.counts[i];
            i
        };
        self.counts[i] += 1;
        self.hashes[i] = hash;
        let n = key.len().min(KEY_BYTES);
        self.keys[i][..n].copy_from_slice(&key[..n]);
        self.key_lens[i] = u32::try_from(key.len()).unwrap_or(u32::MAX);
    }

    /// The bound on the count of a key absent from this summary.
    fn absent_bound(&self) -> u64 {
        if self.len < K {
            0
        } else {
            self.counts[min_index(&self.counts)]
        }
    }
}

#[inline]
fn min_index(counts: &[u64; K]) -> usize {
    let mut best = 0;
    for (i, &c) in counts.iter().enumerate().skip(1) {
        if c < counts[best] {
            best = i;
        }
    }
    best
}

/// One shard: the current slot's summary and the closed ones.
#[derive(Clone)]
struct Shard {
    current: Summary,
    past: [Summary; PAST_SLOTS],
    next_past: usize,
}

impl Shard {
    const EMPTY: Shard = Shard { current: Summary::EMPTY, past: [Summary::EMPTY; PAST_SLOTS], next_past: 0 };
}

/// A refused key as a snapshot reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopKey {
    /// The key's first `KEY_BYTES` bytes.
    pub key: Vec<u8>,
    /// The key's full length.
    pub key_len: usize,
    /// Refusals in the window, an upper bound.
    pub refused: u64,
    /// `refused - error` is a lower bound.
    pub error: u64,
}

/// The merged summaries of the window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopSnapshot {
    /// The most refused keys, most first, at most the number asked.
    pub keys: Vec<TopKey>,
    /// Refusals recorded in the window (N of the error bound).
    pub recorded: u64,
    /// Refusals not recorded since start because their shard was busy.
    pub skipped: u64,
    /// How far back the window reaches, in ms.
    pub window_ms: u64,
}

/// The process's refused-key summaries; see the module doc.
pub struct TopRefused {
    shards: [Mutex<Shard>; SHARDS],
    skipped: AtomicU64,
    rotations: AtomicU64,
    /// When the current slot began, in ms since `epoch()`.
    slot_started_ms: AtomicU64,
    /// The rotating task, parked while every slot is empty.
    rotator: Parking,
}

/// The process's summaries, fed by the limiter.
pub static TOP_REFUSED: TopRefused = TopRefused::new();

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD_SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The keyed hasher: random per process, so that no one can pick keys
/// whose hashes collide with another's.
fn hasher() -> &'static RandomState {
    static STATE: OnceLock<RandomState> = OnceLock::new();
    STATE.get_or_init(RandomState::new)
}

fn epoch() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64
}

/// Milliseconds on a monotonic clock that starts with the daemon (the
/// first `rotate_every_slot`), for rates between two snapshots.
pub fn uptime_ms() -> u64 {
    now_ms()
}

impl Default for TopRefused {
    fn default() -> Self {
        Self::new()
    }
}

impl TopRefused {
    pub const fn new() -> Self {
        Self {
            shards: [const { Mutex::new(Shard::EMPTY) }; SHARDS],
            skipped: AtomicU64::new(0),
            rotations: AtomicU64::new(0),
            slot_started_ms: AtomicU64::new(0),
            rotator: Parking::new(),
        }
    }

    /// Counts one refusal of `key` (the wire key, or the policy-scoped key).
    #[inline]
    pub fn record(&self, key: &[u8]) {
        let hash = hasher().hash_one(key);
        let shard = THREAD_SHARD.with(|s| {
            let mut i = s.get();
            if i == usize::MAX {
                i = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
                s.set(i);
            }
            i
        });
        self.record_in(shard, hash, key);
    }

    #[inline]
    fn record_in(&self, shard: usize, hash: u64, key: &[u8]) {
        match self.shards[shard].try_lock() {
            Ok(mut s) => {
                s.current.add(hash, key);
                // Under the shard's lock, as src/park.rs asks.
                self.rotator.work_arrived();
            }
            Err(_) => {
                self.skipped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Closes the current slot: it becomes the newest past one, replacing
    /// the oldest.
    pub fn rotate(&self) {
        for shard in &self.shards {
            let mut guard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let s = &mut *guard;
            s.past[s.next_past] = std::mem::replace(&mut s.current, Summary::EMPTY);
            s.next_past = (s.next_past + 1) % PAST_SLOTS;
        }
        self.rotations.fetch_add(1, Ordering::Relaxed);
        self.slot_started_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Rotates every `SLOT` until `token` is cancelled; parks once every
    /// slot is empty, until the next refusal (an idle daemon has no timer
    /// firing for it).
    pub async fn rotate_every_slot(&'static self, token: CancellationToken) {
        epoch();
        loop {
            self.slot_started_ms.store(now_ms(), Ordering::Relaxed);
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + SLOT, SLOT);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = tick.tick() => self.rotate(),
                }
                self.rotator.about_to_park();
                if !self.is_empty() {
                    self.rotator.stay_awake();
                    continue;
                }
                break;
            }
            tokio::select! {
                _ = token.cancelled() => return,
                _ = self.rotator.parked() => {}
            }
        }
    }

    /// Whether every slot of every shard is empty (each shard looked at
    /// under its lock, after `about_to_park`: see src/park.rs).
    fn is_empty(&self) -> bool {
        self.shards.iter().all(|shard| {
            let s = shard.lock().unwrap_or_else(|p| p.into_inner());
            s.current.total == 0 && s.past.iter().all(|p| p.total == 0)
        })
    }

    /// The `n` (at most `K`) most refused keys of the window, merged over
    /// shards and slots.
    pub fn snapshot(&self, n: usize) -> TopSnapshot {
        let mut summaries: Vec<Box<Shard>> = Vec::with_capacity(SHARDS);
        for shard in &self.shards {
            // Copied under the lock, merged after it.
            let copy = Box::new(shard.lock().unwrap_or_else(|p| p.into_inner()).clone());
            summaries.push(copy);
        }
        let all: Vec<&Summary> = summaries.iter().flat_map(|s| std::iter::once(&s.current).chain(s.past.iter())).filter(|s| s.total > 0).collect();
        // hash -> (a summary holding it, its entry there, the summaries
        // holding it as bits, lower bound, sum of the counts where held)
        let mut merged: HashMap<u64, (usize, usize, u32, u64, u64)> = HashMap::new();
        for (si, s) in all.iter().enumerate() {
            for e in 0..s.len {
                let m = merged.entry(s.hashes[e]).or_insert((si, e, 0, 0, 0));
                m.2 |= 1 << si;
                m.3 += s.counts[e] - s.errors[e];
                m.4 += s.counts[e];
            }
        }
        let bounds: Vec<u64> = all.iter().map(|s| s.absent_bound()).collect();
        let mut keys: Vec<TopKey> = merged
            .values()
            .map(|&(si, e, held, lower, present)| {
                // Where a key is not held, it was refused at most the least count there.
                let absent: u64 = bounds.iter().enumerate().filter(|(i, _)| held & (1 << i) == 0).map(|(_, b)| b).sum();
                let s = all[si];
                let key_len = s.key_lens[e] as usize;
                TopKey { key: s.keys[e][..key_len.min(KEY_BYTES)].to_vec(), key_len, refused: present + absent, error: present + absent - lower }
            })
            .collect();
        keys.sort_by(|a, b| b.refused.cmp(&a.refused).then(a.error.cmp(&b.error)).then_with(|| a.key.cmp(&b.key)));
        keys.truncate(n.min(K));
        let rotations = self.rotations.load(Ordering::Relaxed);
        let slot_ms = SLOT.as_millis() as u64;
        let window_ms = rotations.min(PAST_SLOTS as u64) * slot_ms + now_ms().saturating_sub(self.slot_started_ms.load(Ordering::Relaxed));
        TopSnapshot { keys, recorded: all.iter().map(|s| s.total).sum(), skipped: self.skipped.load(Ordering::Relaxed), window_ms }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The serial reference: exact counts.
    fn exact(trace: &[Vec<u8>]) -> HashMap<Vec<u8>, u64> {
        let mut m = HashMap::new();
        for k in trace {
            *m.entry(k.clone()).or_insert(0) += 1;
        }
        m
    }

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn exact_below_k_keys() {
        let t = TopRefused::new();
        for i in 0..10u64 {
            for _ in 0..=i {
                t.record(format!("k{i}").as_bytes());
            }
        }
        let s = t.snapshot(K);
        assert_eq!(s.recorded, 55);
        assert_eq!(s.keys.len(), 10);
        assert_eq!(s.keys[0], TopKey { key: b"k9".to_vec(), key_len: 2, refused: 10, error: 0 });
        assert!(s.keys.iter().all(|k| k.error == 0));
        assert_eq!(t.snapshot(3).keys.len(), 3);
    }

    /// Skewed random traces over many more keys than K, across slots and
    /// shards: every listed count brackets the exact one, the error is at
    /// most N/K, every key above N/K is listed, and the heaviest key is first.
    #[test]
    fn bounds_hold_against_exact_counts() {
        for seed in 1..=5u64 {
            let t = TopRefused::new();
            let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut trace = Vec::new();
            for _ in 0..20_000 {
                let r = xorshift(&mut state);
                // A heavy key, a few warm ones, a long tail of cold ones.
                let key = match r % 100 {
                    0..=29 => b"heavy".to_vec(),
                    30..=49 => format!("warm{}", r % 8).into_bytes(),
                    _ => format!("cold{}", r % 5000).into_bytes(),
                };
                trace.push(key);
            }
            let (a, b) = trace.split_at(trace.len() / 2);
            // Half in a past slot, half now, over two threads (two shards).
            let feed = |part: &[Vec<u8>], shard: usize| part.iter().for_each(|k| t.record_in(shard, hasher().hash_one(k), k));
            feed(&a[..a.len() / 2], 0);
            feed(&a[a.len() / 2..], 1);
            t.rotate();
            feed(&b[..b.len() / 2], 1);
            feed(&b[b.len() / 2..], 2);
            let truth = exact(&trace);
            let s = t.snapshot(K);
            assert_eq!((s.recorded, s.skipped), (trace.len() as u64, 0));
            assert_eq!(s.keys[0].key, b"heavy", "seed {seed}");
            for k in &s.keys {
                let real = truth[&k.key];
                assert!(k.refused >= real && k.refused - k.error <= real, "seed {seed}: {k:?} vs {real}");
                assert!(k.error <= s.recorded / K as u64 + 1, "seed {seed}: {k:?}, N {}", s.recorded);
            }
            for (key, &c) in &truth {
                if c > s.recorded / K as u64 {
                    assert!(s.keys.iter().any(|k| &k.key == key), "seed {seed}: {key:?} refused {c} times is not listed");
                }
            }
        }
    }

    #[test]
    fn old_slots_leave_the_window_and_long_keys_are_cut() {
        let t = TopRefused::new();
        let long = vec![b'x'; 300];
        for _ in 0..3 {
            t.record(&long);
        }
        t.record(b"later");
        assert_eq!(t.snapshot(K).keys[0], TopKey { key: vec![b'x'; KEY_BYTES], key_len: 300, refused: 3, error: 0 });
        for _ in 0..PAST_SLOTS {
            t.rotate();
            t.record(b"later");
        }
        let s = t.snapshot(K);
        assert_eq!(s.keys[0].key, b"later");
        assert_eq!(s.keys[0].refused, 6);
        assert_eq!(s.keys.len(), 2, "the long key is still in the oldest slot");
        t.rotate();
        let s = t.snapshot(K);
        assert_eq!((s.keys.len(), s.keys[0].refused), (1, 5), "the oldest slot left the window");
    }

    /// The cost of `record` per refusal, against one relaxed atomic add (what
    /// a counter costs) in the same run. Run with
    /// `cargo test --release --lib top_refused::tests::cost -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn cost_per_refusal() {
        const N: u64 = 20_000_000;
        let counter = AtomicU64::new(0);
        let keys: Vec<Vec<u8>> = (0..10_000).map(|i| format!("order:tenant-{i:06}").into_bytes()).collect();
        let time = |f: &mut dyn FnMut(u64)| {
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t = Instant::now();
                for i in 0..N {
                    f(i);
                }
                best = best.min(t.elapsed().as_nanos() as f64 / N as f64);
            }
            best
        };
        let base = time(&mut |_| {
            counter.fetch_add(1, Ordering::Relaxed);
        });
        let t = TopRefused::new();
        let hot = time(&mut |_| t.record(std::hint::black_box(b"order:attacker-1")));
        let t = TopRefused::new();
        let mut few = 0usize;
        let warm = time(&mut |_| {
            few = (few + 1) % 32;
            t.record(&keys[few]);
        });
        let t = TopRefused::new();
        let mut state = 88172645463325252u64;
        let cold = time(&mut |_| t.record(&keys[(xorshift(&mut state) % keys.len() as u64) as usize]));
        println!("record() per refusal: one hot key {hot:.1} ns, 32 keys {warm:.1} ns, 10k keys (every one a replacement) {cold:.1} ns; one relaxed atomic add {base:.1} ns");
        println!("ratios to the atomic add: {:.1}x, {:.1}x, {:.1}x", hot / base, warm / base, cold / base);
    }
}
