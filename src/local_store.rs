//! The per-host store: exact sliding windows held in this process's memory.
//!
//! Same semantics as the Redis script: an admission at time `t` counts while
//! `t > now - window`; a request of cost `c` is admitted whole if
//! `count + c <= limit`, and a denied request records nothing. It serves as
//! the backend when no Redis is configured and as the per-host fallback of
//! the `local` fail policy. A window is named by its key and its length, as
//! in Redis, so two locations sharing a key with different windows never
//! erase each other's history. Windows are spread over shards, each behind
//! a plain mutex that is never held across an await.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;

use crate::park::Parking;
use crate::protocol::Algorithm;
use crate::window::{LimitSpec, Verdict};

const SHARDS: usize = 64;

/// A shard's map is not shrunk below this many slots.
const SHRINK_ABOVE: usize = 128;

/// Names up to this long are composed on the stack.
const INLINE_NAME: usize = 256;

/// A window's name in the map: the algorithm (1 byte), the window length
/// (4 bytes, big-endian), then the key. Composed on the stack for usual key lengths, so a lookup
/// allocates nothing; only a new window copies it to the heap.
// Built on the stack for one call and dropped: the size is the point.
#[allow(clippy::large_enum_variant)]
enum WindowName {
    Inline([u8; INLINE_NAME], usize),
    Heap(Vec<u8>),
}

impl WindowName {
    fn new(spec: &LimitSpec<'_>, algorithm: Algorithm) -> Self {
        let len = 5 + spec.key.len();
        let window = spec.window_ms.to_be_bytes();
        if len <= INLINE_NAME {
            let mut buf = [0u8; INLINE_NAME];
            buf[0] = algorithm.to_wire();
            buf[1..5].copy_from_slice(&window);
            buf[5..len].copy_from_slice(spec.key);
            Self::Inline(buf, len)
        } else {
            let mut v = Vec::with_capacity(len);
            v.push(algorithm.to_wire());
            v.extend_from_slice(&window);
            v.extend_from_slice(spec.key);
            Self::Heap(v)
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline(buf, len) => &buf[..*len],
            Self::Heap(v) => v,
        }
    }
}

/// Admissions of one key: (time in ms, cost) in time order. Admissions in the
/// same millisecond share one entry, so memory is bounded by the window's
/// length in ms rather than by the limit.
#[derive(Debug, Default)]
struct KeyWindow {
    entries: VecDeque<(u64, u32)>,
    total: u64,
    window_ms: u32,
    /// GCRA's theoretical arrival time in ms (GCRA windows only; their
    /// `entries` stay empty).
    tat_ms: f64,
    /// GCRA once a reserve touched the window (src/redis/scripts/gcra.lua,
    /// "Reserved keys"): the ms of tokens charged since, and which
    /// window that is (0: none yet; a new one after a sweep).
    gcra_charged: f64,
    gcra_born: u64,
    /// Fixed windows and the sliding counter: the current fixed window's
    /// start on the wall clock (UTC-aligned), its count and the previous
    /// window's.
    fixed_start: u64,
    fixed_count: u64,
    prev_count: u64,
    /// Until when (store clock) a GCRA, fixed or counter window counts anything.
    until_ms: u64,
}

/// The O(1) algorithms' whole state: what a reserve that another item of
/// its request refused is put back to, exactly.
#[derive(Clone, Copy, Debug)]
struct O1State {
    tat_ms: f64,
    gcra_charged: f64,
    fixed_start: u64,
    fixed_count: u64,
    prev_count: u64,
    until_ms: u64,
}

impl KeyWindow {
    fn o1_state(&self) -> O1State {
        O1State { tat_ms: self.tat_ms, gcra_charged: self.gcra_charged, fixed_start: self.fixed_start, fixed_count: self.fixed_count, prev_count: self.prev_count, until_ms: self.until_ms }
    }

    fn set_o1_state(&mut self, s: O1State) {
        (self.tat_ms, self.gcra_charged, self.fixed_start, self.fixed_count, self.prev_count, self.until_ms) = (s.tat_ms, s.gcra_charged, s.fixed_start, s.fixed_count, s.prev_count, s.until_ms);
    }

    /// Moves a fixed window or sliding counter to the window `wall_ms` is
    /// in; returns its (start, length). A fixed window's count above
    /// `limit` is debt (only a settle makes one): each window since paid
    /// one limit of it, as src/redis/scripts/fixed_window.lua counts.
    fn roll(&mut self, window_ms: u32, limit: u64, wall_ms: u64, sliding: bool) -> (u64, u64) {
        let (start, end) = crate::window::fixed_bounds(window_ms, wall_ms);
        let w = end - start;
        if self.fixed_start != start {
            let debt = !sliding && self.fixed_count > limit && self.fixed_start < start;
            let carried = if debt { self.fixed_count.saturating_sub(windows_between(window_ms, self.fixed_start, start, w).saturating_mul(limit)) } else { 0 };
            self.prev_count = if self.fixed_start + w == start { self.fixed_count } else { 0 };
            self.fixed_count = carried;
            self.fixed_start = start;
        }
        (start, w)
    }

    /// How long (from now) a fixed window holding `count` must live: to
    /// its end, and while debt is left as many windows more as paying it
    /// takes.
    fn keep_fixed(count: u64, limit: u64, to_end: u64, w: u64) -> u64 {
        if count <= limit || limit == 0 {
            return to_end;
        }
        to_end + (count - limit).div_ceil(limit).saturating_mul(w)
    }

    fn evict(&mut self, now: u64, window_ms: u32) {
        while let Some(&(t, c)) = self.entries.front() {
            if t + window_ms as u64 > now {
                break;
            }
            self.entries.pop_front();
            self.total -= c as u64;
        }
    }

    fn newest(&self) -> Option<u64> {
        self.entries.back().map(|e| e.0)
    }

    /// Whether `spec` fits now (after `evict`).
    fn fits(&self, spec: &LimitSpec<'_>) -> bool {
        self.total + u64::from(spec.cost) <= u64::from(spec.limit)
    }

    /// Records an admission that fits.
    fn record(&mut self, spec: &LimitSpec<'_>, now_ms: u64) -> Verdict {
        match self.entries.back_mut() {
            Some((t, c)) if *t == now_ms => *c += spec.cost,
            _ => self.entries.push_back((now_ms, spec.cost)),
        }
        self.total += u64::from(spec.cost);
        Verdict {
            allowed: true,
            count: self.total as u32,
            remaining: (u64::from(spec.limit) - self.total) as u32,
            retry_after_ms: 0,
            reset_ms: spec.window_ms,
        }
    }

    /// The refusal of a request that does not fit: it fits once enough of
    /// the oldest admissions have left the window.
    fn refusal(&self, spec: &LimitSpec<'_>, now_ms: u64) -> Verdict {
        let window = u64::from(spec.window_ms);
        let limit = u64::from(spec.limit);
        let need = self.total + u64::from(spec.cost) - limit;
        let mut freed = 0u64;
        let mut retry_at = now_ms;
        for &(t, c) in &self.entries {
            freed += c as u64;
            if freed >= need {
                retry_at = t + window;
                break;
            }
        }
        let reset_at = self.newest().map_or(now_ms, |t| t + window);
        Verdict {
            allowed: false,
            count: self.total as u32,
            remaining: limit.saturating_sub(self.total) as u32,
            retry_after_ms: (retry_at - now_ms) as u32,
            reset_ms: (reset_at - now_ms) as u32,
        }
    }

    /// Whether anything of it still counts at `now_ms`.
    fn live(&self, now_ms: u64) -> bool {
        self.newest().is_some_and(|t| t + self.window_ms as u64 > now_ms) || self.until_ms > now_ms
    }

    /// The fixed window (`sliding` false) or the sliding counter, as
    /// src/redis/scripts/fixed_window.lua and sliding_counter.lua decide them, at
    /// `wall_ms` on the wall clock (windows are UTC-aligned); `now_ms` is
    /// the store's clock, for the sweep.
    fn fixed(&mut self, spec: &LimitSpec<'_>, wall_ms: u64, now_ms: u64, sliding: bool) -> Verdict {
        const EPS: f64 = 1e-9;
        // Plain windows, or calendar months and UTC offsets (fixed only).
        let (start, w) = self.roll(spec.window_ms, u64::from(spec.limit), wall_ms, sliding);
        let elapsed = wall_ms - start;
        let (limit, cost) = (u64::from(spec.limit), u64::from(spec.cost));
        let (cur, prev) = (self.fixed_count, if sliding { self.prev_count } else { 0 });
        let weighted = prev as f64 * (w - elapsed) as f64 / w as f64;
        let up = |x: f64| (x - EPS).ceil().max(0.0) as u64;
        if weighted + (cur + cost) as f64 <= limit as f64 + EPS {
            self.fixed_count += cost;
            let keep = if sliding { 2 * w - elapsed } else { Self::keep_fixed(self.fixed_count, limit, w - elapsed, w) };
            self.until_ms = self.until_ms.max(now_ms + keep);
            let count = up(weighted + self.fixed_count as f64);
            return Verdict { allowed: true, count: count as u32, remaining: limit.saturating_sub(count) as u32, retry_after_ms: 0, reset_ms: saturate(keep) };
        }
        let count = up(weighted + cur as f64);
        let to_end = w - elapsed;
        let (retry, reset) = if !sliding {
            (debt_end(spec.window_ms, start, w, cur, cost, limit) - wall_ms, to_end)
        } else if limit >= cur + cost {
            let e = w as f64 - (limit - cur - cost) as f64 * w as f64 / prev as f64;
            ((up(e).saturating_sub(elapsed)).max(1), if cur > 0 { to_end + w } else { to_end })
        } else {
            let e = (w as f64 - (limit - cost) as f64 * w as f64 / cur as f64).max(0.0);
            (to_end + up(e), to_end + w)
        };
        Verdict { allowed: false, count: count as u32, remaining: limit.saturating_sub(count) as u32, retry_after_ms: saturate(retry), reset_ms: saturate(reset) }
    }

    /// A check of an O(1) algorithm (the log has none here: resolution
    /// refuses a reserve of it).
    fn decide_o1(&mut self, spec: &LimitSpec<'_>, algorithm: Algorithm, now_ms: u64, wall_ms: u64) -> Verdict {
        match algorithm {
            Algorithm::Gcra => self.gcra(spec, now_ms),
            Algorithm::SlidingCounter => self.fixed(spec, wall_ms, now_ms, true),
            _ => self.fixed(spec, wall_ms, now_ms, false),
        }
    }

    /// The window as it stands, for a response: count, remaining, and
    /// when a cost of 1 fits again; nothing recorded.
    fn view_o1(&mut self, spec: &LimitSpec<'_>, algorithm: Algorithm, now_ms: u64, wall_ms: u64) -> Verdict {
        let before = self.o1_state();
        let mut v = self.decide_o1(&LimitSpec { cost: 1, ..*spec }, algorithm, now_ms, wall_ms);
        self.set_o1_state(before);
        if v.allowed {
            v.count -= 1;
            v.remaining += 1;
            v.retry_after_ms = 0;
        }
        v
    }

    /// GCRA, as src/redis/scripts/gcra.lua decides it (same rounding).
    fn gcra(&mut self, spec: &LimitSpec<'_>, now_ms: u64) -> Verdict {
        const EPS: f64 = 1e-6;
        let (now, window, limit) = (now_ms as f64, f64::from(spec.window_ms), f64::from(spec.limit));
        let t = window / limit;
        let tat = self.tat_ms.max(now);
        let new_tat = tat + f64::from(spec.cost) * t;
        let up = |x: f64| (x - EPS).ceil().max(0.0) as u32;
        if new_tat - now <= window + EPS {
            self.tat_ms = new_tat;
            if self.gcra_born != 0 {
                self.gcra_charged += f64::from(spec.cost) * t;
            }
            self.until_ms = new_tat.ceil() as u64;
            let count = up((new_tat - now) / t);
            return Verdict { allowed: true, count, remaining: spec.limit.saturating_sub(count), retry_after_ms: up(tat - now), reset_ms: up(new_tat - now) };
        }
        let count = up((tat - now) / t);
        Verdict { allowed: false, count, remaining: spec.limit.saturating_sub(count), retry_after_ms: up(new_tat - window - now), reset_ms: up(tat - now) }
    }
}

/// When (wall clock) a fixed window starting at `start` (`w`: a plain
/// window's length) holding `count` takes `cost` again, as
/// src/redis/scripts/fixed_window.lua's `debt_end`: the next window, or, with
/// debt (count above the limit), the first window the carried debt leaves
/// room in. Calendar windows are walked one by one, no further than a
/// response's retry_after can say (u32 ms, 49.7 days).
fn debt_end(window_ms: u32, start: u64, w: u64, count: u64, cost: u64, limit: u64) -> u64 {
    let k = if count > limit && limit > 0 { (count + cost - limit).div_ceil(limit).max(1) } else { 1 };
    if window_ms < crate::window::CALENDAR {
        return start.saturating_add(k.saturating_mul(w));
    }
    let mut at = start;
    for _ in 0..k {
        at = crate::window::fixed_bounds(window_ms, at).1;
        if at - start > u64::from(u32::MAX) {
            break;
        }
    }
    at
}

/// Fixed windows from the one starting at `from` to the one starting at
/// `to` (`w`: a plain window's length; calendar months are counted one by
/// one, a few per year).
fn windows_between(window_ms: u32, from: u64, to: u64, w: u64) -> u64 {
    if window_ms < crate::window::CALENDAR {
        return (to - from) / w;
    }
    let (mut at, mut k) = (from, 0u64);
    while at < to {
        at = crate::window::fixed_bounds(window_ms, at).1;
        k += 1;
    }
    k
}

/// How long a reserve's settle record is kept (as SETTLE_LIFE in the
/// scripts): a reserve not settled by then stays charged its estimate.
const SETTLE_LIFE_MS: u64 = 86_400_000;

/// A reserve's record in memory (docs/PROTOCOL.md 4f): the fixed window
/// it was counted in (wall clock; 0 for GCRA), its estimate, and until
/// when (store clock) it may be settled; GCRA: the window's charged and
/// born after the reserve.
#[derive(Clone, Copy, Debug)]
struct SettleRecord {
    start: u64,
    estimate: u64,
    until_ms: u64,
    charged: f64,
    born: u64,
}

/// Names a GCRA window a reserve touched, never twice in a process (as
/// the time of its first reserve does in Redis).
fn next_born() -> u64 {
    static BORN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    BORN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A duration in ms as the response's `u32` carries it: the sliding
/// counter's reset (and a refusal's retry) reaches twice the window, above
/// `u32::MAX` ms (49.7 days) for a window above 24.8 days. Saturated, as
/// Redis's replies are (src/redis/window.rs `clamp_u32`), never wrapped: a
/// wrapped 58 days read as 8.5 (docs/ALGORITHMS.md, "Windows above 24.8 days").
fn saturate(ms: u64) -> u32 {
    u32::try_from(ms).unwrap_or(u32::MAX)
}

/// Milliseconds since the Unix epoch: fixed windows and the sliding counter
/// align to UTC, as in Redis.
fn wall_clock_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A lease held: its id, when it expires on the store's clock, its slots.
type Lease = (Box<[u8]>, u64, u32);

/// One shard's windows, by window name.
type Windows = HashMap<Box<[u8]>, KeyWindow>;

/// The per-host windows, shared by all connections of the process and kept
/// across configuration reloads, so that a reload forgets no admission.
#[derive(Debug)]
pub struct LocalStore {
    shards: Vec<Mutex<Windows>>,
    hasher: RandomState,
    keys_per_shard: usize,
    /// Origin of the store's monotonic clock: immune to wall-clock steps.
    epoch: Instant,
    /// Concurrency leases by key: (lease id, expiry on the store's clock,
    /// slots). One lock: leases are the memory backend's and the fallback's
    /// only, two short operations per request.
    leases: Mutex<HashMap<Box<[u8]>, Vec<Lease>>>,
    /// Reserves not settled yet, by window name and handle (the memory
    /// backend's settle records; Redis keeps its own).
    settles: Mutex<HashMap<Box<[u8]>, SettleRecord>>,
    max_keys: usize,
    /// The sweeper, parked while the store is empty: woken by whatever
    /// adds a key, a lease or a settle record.
    sweeper: Parking,
}

/// The windows hold `max_keys` keys already, none of them idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the in-memory windows are full ({0} keys)")]
pub struct LocalStoreFull(pub usize);

impl LocalStore {
    /// Windows for at most about `max_keys` keys (spread over shards).
    pub fn new(max_keys: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            keys_per_shard: max_keys.div_ceil(SHARDS).max(1),
            epoch: Instant::now(),
            leases: Mutex::new(HashMap::new()),
            settles: Mutex::new(HashMap::new()),
            max_keys,
            sweeper: Parking::new(),
        }
    }

    /// Milliseconds on the store's monotonic clock.
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Decides one request now, counted by `algorithm`. Each algorithm
    /// has windows of its own. The log and the ring are the same exact
    /// window here (the ring is a Redis memory layout, not other
    /// decisions); GCRA keeps one number, as in Redis.
    pub fn check(&self, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Result<Verdict, LocalStoreFull> {
        self.check_at(spec, algorithm, self.now_ms())
    }

    /// Acquires a lease of `cost` slots on `key` for `lease_ms`, if the
    /// key's slots held stay within `limit`; as src/redis/scripts/concurrency_slots.lua
    /// answers. An id the key holds already is renewed (SEMANTICS S4): its
    /// slots are not counted against the new cost, and a refused renewal
    /// leaves the lease as it was.
    pub fn acquire(&self, key: &[u8], lease: &[u8], limit: u32, lease_ms: u32, cost: u32) -> Result<Verdict, LocalStoreFull> {
        let now = self.now_ms();
        let mut all = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        if !all.contains_key(key) && all.len() >= self.max_keys {
            all.retain(|_, held| {
                held.retain(|&(_, until, _)| until > now);
                !held.is_empty()
            });
            if all.len() >= self.max_keys {
                return Err(LocalStoreFull(self.max_keys));
            }
        }
        self.sweeper.work_arrived();
        let held = all.entry(key.into()).or_default();
        held.retain(|&(_, until, _)| until > now);
        let count: u32 = held.iter().map(|&(_, _, c)| c).sum();
        let own = held.iter().position(|(id, _, _)| **id == *lease);
        let others = count - own.map_or(0, |i| held[i].2);
        if others + cost <= limit {
            let renewed = (lease.into(), now + u64::from(lease_ms), cost);
            match own {
                Some(i) => held[i] = renewed,
                None => held.push(renewed),
            }
            return Ok(Verdict { allowed: true, count: others + cost, remaining: limit - others - cost, retry_after_ms: 0, reset_ms: lease_ms });
        }
        let left = |t: u64| (t - now) as u32;
        let retry = held.iter().map(|&(_, t, _)| t).min().map_or(0, left);
        let reset = held.iter().map(|&(_, t, _)| t).max().map_or(0, left);
        Ok(Verdict { allowed: false, count, remaining: limit.saturating_sub(count), retry_after_ms: retry, reset_ms: reset })
    }

    /// Releases a lease; `allowed` says whether it was held.
    pub fn release(&self, key: &[u8], lease: &[u8]) -> Verdict {
        let now = self.now_ms();
        let mut all = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        let Some(held) = all.get_mut(key) else { return Verdict::default() };
        held.retain(|&(_, until, _)| until > now);
        let before = held.len();
        held.retain(|(id, _, _)| **id != *lease);
        let released = held.len() < before;
        let count = held.iter().map(|&(_, _, c)| c).sum();
        if held.is_empty() {
            all.remove(key);
        }
        Verdict { allowed: released, count, ..Verdict::default() }
    }

    fn shard(&self, key: &[u8]) -> MutexGuard<'_, Windows> {
        // A poisoned shard only means another thread panicked mid-update of
        // plain counters; the data is still usable.
        self.lock(self.shard_index(key))
    }

    /// Decides one request at `now_ms` on a monotonic millisecond clock.
    /// A new key is refused when its shard is full of keys still in use.
    fn check_at(&self, spec: &LimitSpec<'_>, algorithm: Algorithm, now_ms: u64) -> Result<Verdict, LocalStoreFull> {
        let name = WindowName::new(spec, algorithm);
        let name = name.as_bytes();
        let mut shard = self.shard(name);
        // Length first: below capacity the hit path hashes the name once.
        if shard.len() >= self.keys_per_shard && !shard.contains_key(name) {
            shard.retain(|_, w| w.live(now_ms));
            if shard.len() >= self.keys_per_shard {
                return Err(LocalStoreFull(self.keys_per_shard * SHARDS));
            }
        }
        let w = match shard.get_mut(name) {
            Some(w) => w,
            None => {
                self.sweeper.work_arrived();
                shard.entry(name.into()).or_insert_with(|| KeyWindow { window_ms: spec.window_ms, ..KeyWindow::default() })
            }
        };
        match algorithm {
            Algorithm::Log | Algorithm::Ring => {}
            Algorithm::Gcra => return Ok(w.gcra(spec, now_ms)),
            Algorithm::Fixed => return Ok(w.fixed(spec, wall_clock_ms(), now_ms, false)),
            Algorithm::SlidingCounter => return Ok(w.fixed(spec, wall_clock_ms(), now_ms, true)),
        }
        w.evict(now_ms, spec.window_ms);
        if w.fits(spec) {
            return Ok(w.record(spec, now_ms));
        }
        Ok(w.refusal(spec, now_ms))
    }

    /// Decides several windows all or nothing, now: item i fits if its
    /// count + cost <= limit; if every item whose flag is false (not
    /// shadow) fits, every fitting item is recorded, else none is. Returns
    /// whether they were, and per item its verdict (`allowed` = it fitted;
    /// count and remaining after this request only when recorded). The
    /// shards involved are locked in ascending order (a single check
    /// locks one), so two multi checks cannot deadlock. Keys must differ.
    pub fn check_multi(&self, items: &[(LimitSpec<'_>, bool)]) -> Result<(bool, Vec<Verdict>), LocalStoreFull> {
        self.check_multi_at(items, self.now_ms())
    }

    fn check_multi_at(&self, items: &[(LimitSpec<'_>, bool)], now_ms: u64) -> Result<(bool, Vec<Verdict>), LocalStoreFull> {
        let names: Vec<Box<[u8]>> = items.iter().map(|(s, _)| Box::from(WindowName::new(s, Algorithm::Log).as_bytes())).collect();
        // Item k's map is guards[at[k]].
        let (mut guards, at) = self.lock_all(&names);
        for (k, (spec, _)) in items.iter().enumerate() {
            let map = &mut guards[at[k]];
            if !map.contains_key(&names[k]) {
                if map.len() >= self.keys_per_shard {
                    map.retain(|_, w| w.newest().is_some_and(|t| t + w.window_ms as u64 > now_ms));
                    if map.len() >= self.keys_per_shard {
                        return Err(LocalStoreFull(self.keys_per_shard * SHARDS));
                    }
                }
                map.insert(names[k].clone(), KeyWindow { window_ms: spec.window_ms, ..KeyWindow::default() });
                self.sweeper.work_arrived();
            }
        }
        let mut fits = Vec::with_capacity(items.len());
        for (k, (spec, _)) in items.iter().enumerate() {
            let w = guards[at[k]].get_mut(&names[k]).expect("inserted above");
            w.evict(now_ms, spec.window_ms);
            fits.push(w.fits(spec));
        }
        let committed = items.iter().zip(&fits).all(|((_, shadow), &fit)| fit || *shadow);
        let mut verdicts = Vec::with_capacity(items.len());
        for (k, (spec, _)) in items.iter().enumerate() {
            let w = guards[at[k]].get_mut(&names[k]).expect("inserted above");
            verdicts.push(match (fits[k], committed) {
                (true, true) => w.record(spec, now_ms),
                (true, false) => Verdict {
                    allowed: true,
                    count: w.total as u32,
                    remaining: (u64::from(spec.limit) - w.total) as u32,
                    retry_after_ms: 0,
                    reset_ms: w.newest().map_or(spec.window_ms, |t| (t + u64::from(spec.window_ms) - now_ms) as u32),
                },
                (false, _) => w.refusal(spec, now_ms),
            });
        }
        Ok((committed, verdicts))
    }

    /// Reserves every item's cost (an estimate) all or nothing, as the
    /// O(1) algorithms decide a check of it (docs/PROTOCOL.md 4f): item i
    /// (spec, algorithm, shadow) is decided in turn under every shard's
    /// lock (ascending order, as `check_multi`); when an enforced item
    /// refuses, the windows of the items that fitted are put back exactly as
    /// they were, and their verdicts say the window without this request.
    /// Admitted: a settle record under `handle` for each item recorded.
    /// Returns whether the request was admitted, and per item its verdict
    /// (`allowed`: it fitted).
    pub fn reserve(&self, items: &[(LimitSpec<'_>, Algorithm, bool)], handle: &[u8; 16]) -> Result<(bool, Vec<Verdict>), LocalStoreFull> {
        self.reserve_at(items, handle, self.now_ms(), wall_clock_ms())
    }

    fn reserve_at(&self, items: &[(LimitSpec<'_>, Algorithm, bool)], handle: &[u8; 16], now_ms: u64, wall_ms: u64) -> Result<(bool, Vec<Verdict>), LocalStoreFull> {
        let names: Vec<Box<[u8]>> = items.iter().map(|(s, a, _)| Box::from(WindowName::new(s, *a).as_bytes())).collect();
        {
            let settles = self.settles.lock().unwrap_or_else(|e| e.into_inner());
            if settles.len() + items.len() > self.max_keys {
                return Err(LocalStoreFull(self.max_keys));
            }
        }
        // Item k's map is guards[at[k]].
        let (mut guards, at) = self.lock_all(&names);
        for (k, (spec, _, _)) in items.iter().enumerate() {
            let map = &mut guards[at[k]];
            if !map.contains_key(&names[k]) {
                if map.len() >= self.keys_per_shard {
                    map.retain(|_, w| w.live(now_ms));
                    if map.len() >= self.keys_per_shard {
                        return Err(LocalStoreFull(self.keys_per_shard * SHARDS));
                    }
                }
                map.insert(names[k].clone(), KeyWindow { window_ms: spec.window_ms, ..KeyWindow::default() });
                self.sweeper.work_arrived();
            }
        }
        let mut before = Vec::with_capacity(items.len());
        let mut verdicts = Vec::with_capacity(items.len());
        for (k, (spec, algorithm, _)) in items.iter().enumerate() {
            let w = guards[at[k]].get_mut(&names[k]).expect("inserted above");
            if *algorithm == Algorithm::Gcra && w.gcra_born == 0 {
                w.gcra_born = next_born();
            }
            before.push(w.o1_state());
            verdicts.push(w.decide_o1(spec, *algorithm, now_ms, wall_ms));
        }
        let committed = items.iter().zip(&verdicts).all(|((_, _, shadow), v)| v.allowed || *shadow);
        if !committed {
            for (k, (spec, algorithm, _)) in items.iter().enumerate() {
                if verdicts[k].allowed {
                    let w = guards[at[k]].get_mut(&names[k]).expect("inserted above");
                    w.set_o1_state(before[k]);
                    verdicts[k] = w.view_o1(spec, *algorithm, now_ms, wall_ms);
                }
            }
            return Ok((false, verdicts));
        }
        let mut settles = self.settles.lock().unwrap_or_else(|e| e.into_inner());
        for (k, (spec, _, _)) in items.iter().enumerate() {
            if verdicts[k].allowed {
                let (start, charged, born) = guards[at[k]].get(&names[k]).map_or((0, 0.0, 0), |w| (w.fixed_start, w.gcra_charged, w.gcra_born));
                let mut key = names[k].to_vec();
                key.extend_from_slice(handle);
                settles.insert(key.into(), SettleRecord { start, estimate: u64::from(spec.cost), until_ms: now_ms + SETTLE_LIFE_MS, charged, born });
            }
        }
        // Under the settles' lock, as src/park.rs asks.
        self.sweeper.work_arrived();
        Ok((true, verdicts))
    }

    /// Settles the reserve `handle` names in `spec`'s window to the
    /// actual cost (`spec.cost`), as the scripts' 's' mode does: `None`
    /// when no record (forged, replayed, expired: nothing changes); else
    /// the window after it (count past the limit: debt).
    pub fn settle(&self, spec: &LimitSpec<'_>, algorithm: Algorithm, handle: &[u8; 16]) -> Option<Verdict> {
        self.settle_at(spec, algorithm, handle, self.now_ms(), wall_clock_ms())
    }

    fn settle_at(&self, spec: &LimitSpec<'_>, algorithm: Algorithm, handle: &[u8; 16], now_ms: u64, wall_ms: u64) -> Option<Verdict> {
        let name = WindowName::new(spec, algorithm);
        let name = name.as_bytes();
        let mut key = name.to_vec();
        key.extend_from_slice(handle);
        let rec = self.settles.lock().unwrap_or_else(|e| e.into_inner()).remove(&key[..]).filter(|r| r.until_ms > now_ms)?;
        let mut shard = self.shard(name);
        // A window swept since (it counted nothing any more) starts again:
        // a shortfall is charged to the current one. Never refused for
        // room: the cost was incurred.
        let w = match shard.get_mut(name) {
            Some(w) => w,
            None => {
                self.sweeper.work_arrived();
                shard.entry(name.into()).or_insert_with(|| KeyWindow { window_ms: spec.window_ms, ..KeyWindow::default() })
            }
        };
        let (actual, est, limit) = (u64::from(spec.cost), rec.estimate, u64::from(spec.limit));
        match algorithm {
            Algorithm::Gcra => {
                // As src/redis/scripts/gcra.lua: a surplus gives back no more than
                // charging the actual at the reserve's time would have left.
                let t = f64::from(spec.window_ms) / f64::from(spec.limit);
                let now = now_ms as f64;
                let tat = w.tat_ms.max(now);
                if actual >= est {
                    let debt = (actual - est) as f64 * t;
                    w.tat_ms = tat + debt;
                    if w.gcra_born != 0 {
                        w.gcra_charged += debt;
                    }
                } else if rec.born != 0 && rec.born == w.gcra_born {
                    let since = w.gcra_charged - rec.charged;
                    let back = (est - actual) as f64 * t;
                    w.tat_ms = (tat - back).max(tat.min(now + since)).max(now);
                    if since == 0.0 {
                        w.gcra_charged -= back;
                    }
                }
                w.until_ms = w.until_ms.max(w.tat_ms.ceil() as u64);
            }
            Algorithm::Fixed | Algorithm::SlidingCounter => {
                let sliding = algorithm == Algorithm::SlidingCounter;
                let (start, len) = w.roll(spec.window_ms, limit, wall_ms, sliding);
                if actual >= est {
                    w.fixed_count += actual - est;
                } else if rec.start == start {
                    w.fixed_count = w.fixed_count.saturating_sub(est - actual);
                } else if sliding && rec.start + len == start {
                    w.prev_count = w.prev_count.saturating_sub(est - actual);
                }
                let to_end = start + len - wall_ms;
                let keep = if sliding { to_end + len } else { KeyWindow::keep_fixed(w.fixed_count, limit, to_end, len) };
                w.until_ms = w.until_ms.max(now_ms + keep);
            }
            // Resolution refuses a reserve of the log.
            Algorithm::Log | Algorithm::Ring => {}
        }
        Some(w.view_o1(spec, algorithm, now_ms, wall_ms))
    }

    fn shard_index(&self, name: &[u8]) -> usize {
        (self.hasher.hash_one(name) as usize) % SHARDS
    }

    fn lock(&self, i: usize) -> MutexGuard<'_, Windows> {
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The shards of `names` locked, each once and in ascending order (two
    /// calls locking several cannot deadlock), and for each name the index
    /// of its shard's guard.
    fn lock_all(&self, names: &[Box<[u8]>]) -> (Vec<MutexGuard<'_, Windows>>, Vec<usize>) {
        let shard_of: Vec<usize> = names.iter().map(|n| self.shard_index(n)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let guards = order.iter().map(|&i| self.lock(i)).collect();
        let at = shard_of.iter().map(|i| order.binary_search(i).unwrap_or(0)).collect();
        (guards, at)
    }

    /// Frees the memory of idle keys once a second until `shutdown`; parks
    /// while the store holds nothing, until a key, lease or settle record
    /// is added (an idle daemon has no timer firing for it).
    pub async fn sweep_every_second(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            self.sweeper.about_to_park();
            let removed = self.sweep_at(self.now_ms());
            if removed > 0 {
                tracing::trace!(removed, "swept idle per-host keys");
            }
            if !self.is_empty() {
                self.sweeper.stay_awake();
                continue;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.sweeper.parked() => {}
            }
        }
    }

    /// Whether no key, lease or settle record is held (each looked at under
    /// its lock, after `about_to_park`: see src/park.rs).
    fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| s.lock().unwrap_or_else(|e| e.into_inner()).is_empty())
            && self.leases.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
            && self.settles.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// Drops keys whose every admission has left the window; returns how many.
    fn sweep_at(&self, now_ms: u64) -> usize {
        let mut removed = 0;
        self.leases.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, held| {
            held.retain(|&(_, until, _)| until > now_ms);
            !held.is_empty()
        });
        self.settles.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, r| r.until_ms > now_ms);
        for shard in &self.shards {
            let mut map = shard.lock().unwrap_or_else(|e| e.into_inner());
            let before = map.len();
            map.retain(|_, w| {
                let live = w.live(now_ms);
                // A key still in use after a burst keeps its deque's buffer:
                // trimmed the same way as the map below.
                if live && w.entries.capacity() > 64 && w.entries.len() < w.entries.capacity() / 4 {
                    w.entries.shrink_to(w.entries.len() * 2);
                }
                live
            });
            removed += before - map.len();
            // A map keeps its table after a flood of keys has gone: give
            // most of it back once it is mostly empty (a flood of 200,000
            // keys otherwise kept ~40 MB for good). Halving at a quarter
            // full leaves room to grow again without thrashing.
            if map.capacity() > SHRINK_ABOVE && map.len() < map.capacity() / 4 {
                let keep = (map.len() * 2).max(SHRINK_ABOVE);
                map.shrink_to(keep);
            }
        }
        removed
    }

    /// Number of keys held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key: &[u8], limit: u32, window_ms: u32, cost: u32) -> LimitSpec<'_> {
        LimitSpec { key, limit, window_ms, cost }
    }

    #[test]
    fn seed_scenario_admits_exactly_the_limit() {
        let m = LocalStore::new(1000);
        let s = spec(b"order:tenant-1001", 1000, 1000, 1);
        let verdicts: Vec<_> = (0..1005).map(|_| m.check_at(&s, Algorithm::Log, 1_000).unwrap()).collect();
        assert_eq!(verdicts.iter().filter(|v| v.allowed).count(), 1000);
        assert_eq!((verdicts[999].count, verdicts[999].remaining), (1000, 0));
        let denied = &verdicts[1000];
        assert!(!denied.allowed);
        assert_eq!((denied.count, denied.remaining, denied.retry_after_ms), (1000, 0, 1000));
    }

    #[test]
    fn window_slides_and_retry_after_is_exact() {
        let m = LocalStore::new(1000);
        let s = spec(b"k", 3, 100, 1);
        assert!(m.check_at(&s, Algorithm::Log, 10).unwrap().allowed);
        assert!(m.check_at(&s, Algorithm::Log, 20).unwrap().allowed);
        assert!(m.check_at(&s, Algorithm::Log, 30).unwrap().allowed);
        let d = m.check_at(&s, Algorithm::Log, 40).unwrap();
        assert!(!d.allowed);
        assert_eq!((d.retry_after_ms, d.reset_ms), (70, 90));
        // At 110 the admission at 10 has left (10 > 110 - 100 is false).
        assert!(!m.check_at(&s, Algorithm::Log, 109).unwrap().allowed);
        let v = m.check_at(&s, Algorithm::Log, 110).unwrap();
        assert!(v.allowed);
        assert_eq!(v.count, 3);
    }

    #[test]
    fn cost_is_all_or_nothing() {
        let m = LocalStore::new(1000);
        assert!(m.check_at(&spec(b"k", 10, 100, 7), Algorithm::Log, 0).unwrap().allowed);
        let d = m.check_at(&spec(b"k", 10, 100, 4), Algorithm::Log, 1).unwrap();
        assert!(!d.allowed);
        assert_eq!((d.count, d.remaining, d.retry_after_ms), (7, 3, 99));
        let v = m.check_at(&spec(b"k", 10, 100, 3), Algorithm::Log, 2).unwrap();
        assert!(v.allowed);
        assert_eq!((v.count, v.remaining), (10, 0));
    }

    #[test]
    fn retry_after_counts_enough_admissions_for_the_cost() {
        let m = LocalStore::new(1000);
        for t in 0..5 {
            assert!(m.check_at(&spec(b"k", 5, 100, 1), Algorithm::Log, t).unwrap().allowed);
        }
        // Cost 3 needs the three oldest (t = 0, 1, 2) gone: at 102.
        let d = m.check_at(&spec(b"k", 5, 100, 3), Algorithm::Log, 50).unwrap();
        assert_eq!(d.retry_after_ms, 52);
        assert_eq!(d.reset_ms, 54);
    }

    #[test]
    fn several_windows_are_all_or_nothing() {
        let m = LocalStore::new(1000);
        let items = |c: u32| [(spec(b"ip", 3, 100, c), false), (spec(b"tenant", 2, 100, c), false), (spec(b"shadow", 1, 100, c), true)];
        let (ok, v) = m.check_multi_at(&items(1), 0).unwrap();
        assert!(ok);
        assert_eq!(v.iter().map(|v| v.count).collect::<Vec<_>>(), [1, 1, 1]);
        // The shadow item no longer fits: recorded nothing, refused nothing.
        let (ok, v) = m.check_multi_at(&items(1), 1).unwrap();
        assert!(ok);
        assert_eq!(v.iter().map(|v| (v.allowed, v.count)).collect::<Vec<_>>(), [(true, 2), (true, 2), (false, 1)]);
        // The tenant is full: nothing is recorded, the ip window keeps 2.
        let (ok, v) = m.check_multi_at(&items(1), 2).unwrap();
        assert!(!ok);
        assert_eq!(v.iter().map(|v| (v.allowed, v.count, v.remaining)).collect::<Vec<_>>(), [(true, 2, 1), (false, 2, 0), (false, 1, 0)]);
        assert_eq!(v[1].retry_after_ms, 98);
        assert!(m.check_at(&spec(b"ip", 3, 100, 1), Algorithm::Log, 3).unwrap().allowed, "the refused request charged nothing");
        assert!(!m.check_at(&spec(b"ip", 3, 100, 1), Algorithm::Log, 3).unwrap().allowed);
    }

    #[test]
    fn sweep_drops_idle_keys_only() {
        let m = LocalStore::new(1000);
        m.check_at(&spec(b"old", 5, 100, 1), Algorithm::Log, 0).unwrap();
        m.check_at(&spec(b"new", 5, 100, 1), Algorithm::Log, 90).unwrap();
        assert_eq!(m.sweep_at(100), 1);
        assert_eq!(m.len(), 1);
        assert_eq!(m.sweep_at(190), 1);
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn one_key_with_two_windows_keeps_both_histories() {
        let m = LocalStore::new(1000);
        for t in 0..5 {
            assert!(m.check_at(&spec(b"k", 5, 60_000, 1), Algorithm::Log, t).unwrap().allowed);
        }
        // A short window on the same key is its own window...
        assert!(m.check_at(&spec(b"k", 5, 100, 1), Algorithm::Log, 200).unwrap().allowed);
        // ...and does not erase the long one's admissions.
        let d = m.check_at(&spec(b"k", 5, 60_000, 1), Algorithm::Log, 300).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.count, 5);
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn new_keys_are_refused_when_full_of_live_keys() {
        let m = LocalStore::new(SHARDS); // one key per shard
        let mut refused = 0;
        for i in 0..10 * SHARDS {
            let key = format!("k{i}");
            if m.check_at(&spec(key.as_bytes(), 5, 100, 1), Algorithm::Log, 0).is_err() {
                refused += 1;
            }
        }
        assert!(m.len() <= SHARDS);
        assert_eq!(refused, 10 * SHARDS - m.len());
        assert!(refused >= 9 * SHARDS - 2);
        // Once the window has passed, the idle keys make room.
        assert!(m.check_at(&spec(b"later", 5, 100, 1), Algorithm::Log, 200).is_ok());
    }
    #[test]
    fn a_calendar_month_resets_on_the_first() {
        let month = crate::window::calendar_window_ms(0, 0);
        let day = 86_400_000u64;
        // 2028-02-29 and 2028-03-01 00:00 UTC, counted here by hand: 58 years
        // of days (14 leap) then 31 + 28 days of 2028 before February 29.
        let feb29 = (58 * 365 + 14 + 31 + 28) * day;
        let mar1 = feb29 + day;
        let mut w = KeyWindow::default();
        let s = spec(b"k", 2, month, 2);
        let v = w.fixed(&s, feb29 + 1000, 5, false);
        assert!(v.allowed && u64::from(v.reset_ms) == mar1 - feb29 - 1000, "{v:?}");
        let v = w.fixed(&spec(b"k", 2, month, 1), mar1 - 1, 6, false);
        assert_eq!((v.allowed, v.count, v.retry_after_ms, v.reset_ms), (false, 2, 1, 1));
        let v = w.fixed(&s, mar1, 7, false);
        assert!(v.allowed && u64::from(v.reset_ms) == 31 * day, "{v:?}");
        // At +01:00 April starts at 23:00 UTC on March 31.
        let mut w = KeyWindow::default();
        let s = spec(b"k", 1, crate::window::calendar_window_ms(0, 60), 1);
        let apr1 = mar1 + 31 * day - 3_600_000;
        assert!(w.fixed(&s, apr1 - 1, 8, false).allowed);
        assert!(!w.fixed(&s, apr1 - 1, 8, false).allowed);
        assert!(w.fixed(&s, apr1, 9, false).allowed);
    }

    /// GCRA settles against the history they stand for (src/redis/scripts/gcra.lua,
    /// "Reserved keys"; issue 33 item 2): after every operation of a random
    /// trace the bucket leaves no more room than replaying what was
    /// admitted with each settled reserve charged its actual at its
    /// reserve's time (the others their estimate), and exactly as much
    /// while every settle met nothing charged since its reserve.
    #[test]
    fn a_gcra_settle_never_leaves_more_room_than_the_actual_charged_at_the_reserve() {
        let (limit, window) = (10u32, 2000u32);
        let tok = f64::from(window) / f64::from(limit);
        let (mut exact_traces, mut settles) = (0, 0);
        // A third of the traces settle each reserve before anything else
        // is charged: exact throughout.
        for seed in 1..400u64 {
            let m = LocalStore::new(1000);
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut rnd = move |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n.max(1)
            };
            // What was admitted, in order: (time, Some(cost)) for a check,
            // (time, None) then the reserve's index for a reserve.
            let mut admitted: Vec<(u64, Result<u32, usize>)> = Vec::new();
            // Per reserve: estimate, actual once settled, the charge count at it.
            let mut reserves: Vec<(u32, Option<u32>, u64)> = Vec::new();
            let mut open: Vec<usize> = Vec::new();
            let (mut now, mut charges, mut exact) = (1000u64, 0u64, true);
            let orderly = seed % 3 == 0;
            for _ in 0..80 {
                now += rnd(500);
                let op = if orderly && !open.is_empty() { 2 } else { rnd(3) };
                match op {
                    0 => {
                        let c = 1 + rnd(3) as u32;
                        if m.check_at(&spec(b"g", limit, window, c), Algorithm::Gcra, now).unwrap().allowed {
                            admitted.push((now, Ok(c)));
                            charges += 1;
                        }
                    }
                    1 => {
                        let est = 1 + rnd(6) as u32;
                        let id = reserves.len();
                        let handle = (id as u128).to_be_bytes();
                        let (ok, v) = m.reserve_at(&[(spec(b"g", limit, window, est), Algorithm::Gcra, false)], &handle, now, now).unwrap();
                        if ok && v[0].allowed {
                            charges += 1;
                            admitted.push((now, Err(id)));
                            reserves.push((est, None, charges));
                            open.push(id);
                        }
                    }
                    _ if !open.is_empty() => {
                        let id = open.swap_remove(rnd(open.len() as u64) as usize);
                        let est = reserves[id].0;
                        let actual = rnd(u64::from(2 * est) + 1) as u32;
                        // Exact: nothing charged since the reserve, and a
                        // shortfall met its tokens still in the bucket (one
                        // charged after the bucket drained is charged from
                        // now: less room than the history, never more).
                        let name = WindowName::new(&spec(b"g", limit, window, 1), Algorithm::Gcra);
                        let drained = m.shard(name.as_bytes()).get(name.as_bytes()).is_none_or(|w| w.tat_ms < now as f64);
                        exact &= reserves[id].2 == charges && !(actual > est && drained);
                        if actual > est {
                            charges += 1;
                        }
                        m.settle_at(&spec(b"g", limit, window, actual), Algorithm::Gcra, &(id as u128).to_be_bytes(), now, now).expect("its record");
                        reserves[id].1 = Some(actual);
                        settles += 1;
                    }
                    _ => {}
                }
                let history = admitted.iter().fold(0.0f64, |tat, &(t, what)| {
                    let cost = match what {
                        Ok(c) => c,
                        Err(id) => reserves[id].1.unwrap_or(reserves[id].0),
                    };
                    tat.max(t as f64) + f64::from(cost) * tok
                });
                let name = WindowName::new(&spec(b"g", limit, window, 1), Algorithm::Gcra);
                let real = m.shard(name.as_bytes()).get(name.as_bytes()).map_or(0.0, |w| w.tat_ms);
                let (real, history) = (real.max(now as f64), history.max(now as f64));
                assert!(real >= history - 1e-6, "seed {seed} at {now}: the bucket full at {real}, the history's at {history}: more room");
                if exact {
                    assert!((real - history).abs() < 1e-6, "seed {seed} at {now}: {real} where the history has {history}");
                }
            }
            exact_traces += usize::from(exact);
        }
        assert!(settles > 3000 && exact_traces > 20, "the traces settle, some of them exactly throughout: {settles} settles, {exact_traces} exact traces");
    }
}
