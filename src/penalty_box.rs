//! The penalty box's bans as this daemon knows them (docs/POLICIES.md,
//! "Penalty box"): a policy with `penalty = { after, within, ban }` bans a
//! key refused `after` times within `within` for `ban`.
//!
//! With Redis the ban lives there (src/redis/scripts/penalized_check.lua, one key in the
//! key's slot, checked in the same call as the window), and this table is
//! its cache: once Redis answered that a key is banned for `d` ms, the
//! key's requests are refused here, with no Redis call, until `d` ms after
//! the request that learnt it was *sent* (this host's monotonic clock:
//! Redis read its clock later, so the entry can only end early, never
//! late). A ban lifted through the admin API is dropped from every
//! daemon's table by the refresh of the admin state (`admin_api::store`).
//! On the memory backend this table is the bans themselves, and `strike`
//! counts the refusals.
//!
//! Reads take no lock: the table is split in shards, each an immutable map
//! swapped whole (`ArcSwap`) when a ban is learnt or dropped, which happens
//! once per ban and daemon, not per request. At most `MAX_CACHED_BANS`
//! are held; beyond that a ban is not cached, and Redis answers it (exact
//! all the same, one call per request).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;

/// Shards of the table (a power of two): a write copies one shard.
const SHARDS: usize = 64;

/// Most bans held in the table.
pub const MAX_CACHED_BANS: usize = 100_000;

/// Most keys whose refusals the memory backend counts at once: a flood of
/// keys refused once each fills it; beyond it, once the stale ones are
/// dropped, a new key's refusal is not counted (no ban for it).
pub const MAX_STRIKE_KEYS: usize = 100_000;

const MS: u64 = 1_000_000;

type Shard = HashMap<Box<[u8]>, u64>;

/// The daemon's bans: by scoped key (length byte, policy name, key), the
/// end of the ban in ns since the table's epoch.
pub struct PenaltyBox {
    shards: Box<[ArcSwap<Shard>]>,
    hasher: RandomState,
    epoch: Instant,
    len: AtomicUsize,
    /// Bumped by every lift: a ban learnt by a request sent before a lift
    /// is not cached (Redis may have answered before the lift deleted it).
    lifts: AtomicU64,
    /// The memory backend's strikes: per key, the times of its refusals
    /// within the penalty's `within` (ns since the epoch), and that `within`.
    strikes: Mutex<HashMap<Box<[u8]>, Strikes>>,
}

/// One key's refusals on the memory backend.
#[derive(Debug, Default)]
struct Strikes {
    times: VecDeque<u64>,
    within_ns: u64,
}

impl Strikes {
    /// Drops the strikes older than `within` at `now`; whether any is left.
    fn prune(&mut self, now_ns: u64) -> bool {
        let horizon = now_ns.saturating_sub(self.within_ns);
        while self.times.front().is_some_and(|&t| t <= horizon) {
            self.times.pop_front();
        }
        !self.times.is_empty()
    }
}

/// When a request was sent, and the lifts then (`PenaltyBox::ticket`).
#[derive(Clone, Copy, Debug)]
pub struct BanTicket {
    pub sent_ns: u64,
    lifts: u64,
}

/// The process's table (the request path, the admin API, `top`).
pub static BANS: LazyLock<PenaltyBox> = LazyLock::new(PenaltyBox::new);

impl Default for PenaltyBox {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for PenaltyBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PenaltyBox").field("len", &self.len.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

impl PenaltyBox {
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| ArcSwap::from_pointee(Shard::new())).collect(),
            hasher: RandomState::new(),
            epoch: Instant::now(),
            len: AtomicUsize::new(0),
            lifts: AtomicU64::new(0),
            strikes: Mutex::new(HashMap::new()),
        }
    }

    /// Now, on the table's clock (ns since its epoch).
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Taken when a request is sent, for `ban`: now and the lifts so far.
    pub fn ticket(&self) -> BanTicket {
        BanTicket { sent_ns: self.now_ns(), lifts: self.lifts.load(Ordering::Acquire) }
    }

    fn shard(&self, key: &[u8]) -> &ArcSwap<Shard> {
        &self.shards[self.hasher.hash_one(key) as usize & (SHARDS - 1)]
    }

    /// The ms left of `key`'s ban (at least 1), or `None`: not banned (as
    /// far as this daemon knows). One atomic load; a hash lookup only when
    /// the shard holds a ban.
    #[inline]
    pub fn banned_ms(&self, key: &[u8]) -> Option<u32> {
        let shard = self.shard(key).load();
        if shard.is_empty() {
            return None;
        }
        let end = *shard.get(key)?;
        let now = self.now_ns();
        (end > now).then(|| (end - now).div_ceil(MS).min(u64::from(u32::MAX)) as u32)
    }

    /// Records that `key` is banned for `ms` from when the request that
    /// learnt it was sent (`ticket`). Less 1 ms for Redis's millisecond
    /// floor: it never outlives Redis's ban. Not recorded if a ban was
    /// lifted since the request was sent.
    pub fn ban(&self, key: &[u8], ticket: BanTicket, ms: u32) {
        let Some(life) = (u64::from(ms) * MS).checked_sub(MS).filter(|&l| l > 0) else { return };
        if self.lifts.load(Ordering::Acquire) != ticket.lifts {
            return;
        }
        let end = ticket.sent_ns + life;
        if self.len.load(Ordering::Relaxed) >= MAX_CACHED_BANS {
            self.sweep();
            if self.len.load(Ordering::Relaxed) >= MAX_CACHED_BANS {
                return;
            }
        }
        let mut added = false;
        self.shard(key).rcu(|s| {
            let mut s = Shard::clone(s);
            added = s.insert(key.into(), end).is_none();
            s
        });
        if added {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drops `key`'s ban from the table (and its strikes); whether it held one.
    pub fn lift(&self, key: &[u8]) -> bool {
        self.lifts.fetch_add(1, Ordering::AcqRel);
        self.strikes.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
        let shard = self.shard(key);
        if !shard.load().contains_key(key) {
            return false;
        }
        let mut removed = false;
        shard.rcu(|s| {
            let mut s = Shard::clone(s);
            removed = s.remove(key).is_some();
            s
        });
        if removed {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
        removed
    }

    /// Drops every ban from the table (not the memory backend's strikes):
    /// for a reader of the lifts that may have missed some. Redis answers
    /// each banned key again on its next request, and it is cached anew.
    pub fn forget_all(&self) {
        self.lifts.fetch_add(1, Ordering::AcqRel);
        for shard in self.shards.iter() {
            if shard.load().is_empty() {
                continue;
            }
            let mut dropped = 0;
            shard.rcu(|s| {
                dropped = s.len();
                Shard::new()
            });
            self.len.fetch_sub(dropped, Ordering::Relaxed);
        }
    }

    /// Drops the bans that have ended, and the memory backend's strikes
    /// that have left their window (the daemon calls it every 10 s, and the
    /// admin refresher at each read).
    pub fn sweep(&self) {
        let now = self.now_ns();
        for shard in self.shards.iter() {
            if shard.load().values().all(|&end| end > now) {
                continue;
            }
            let mut dropped = 0;
            shard.rcu(|s| {
                let kept: Shard = s.iter().filter(|(_, &end)| end > now).map(|(k, &e)| (k.clone(), e)).collect();
                dropped = s.len() - kept.len();
                kept
            });
            self.len.fetch_sub(dropped, Ordering::Relaxed);
        }
        let mut strikes = self.strikes.lock().unwrap_or_else(|e| e.into_inner());
        strikes.retain(|_, s| s.prune(now));
    }

    /// Every ban in force, with its ms left (for `top` and the admin API).
    pub fn entries(&self) -> Vec<(Box<[u8]>, u32)> {
        let now = self.now_ns();
        self.shards
            .iter()
            .flat_map(|s| {
                let s = s.load();
                s.iter().filter(|(_, &end)| end > now).map(|(k, &end)| (k.clone(), (end - now).div_ceil(MS).min(u64::from(u32::MAX)) as u32)).collect::<Vec<_>>()
            })
            .collect()
    }

    /// The memory backend: counts a refusal of `key` at `now_ns`; true
    /// when it is the `after`-th within `within_ms` (the strikes are then
    /// cleared, and the caller bans the key).
    pub fn strike(&self, key: &[u8], now_ns: u64, after: u32, within_ms: u32) -> bool {
        let mut strikes = self.strikes.lock().unwrap_or_else(|e| e.into_inner());
        if strikes.len() >= MAX_STRIKE_KEYS && !strikes.contains_key(key) {
            strikes.retain(|_, s| s.prune(now_ns));
            if strikes.len() >= MAX_STRIKE_KEYS {
                return false;
            }
        }
        let s = strikes.entry(key.into()).or_default();
        s.within_ns = u64::from(within_ms) * MS;
        s.prune(now_ns);
        s.times.push_back(now_ns);
        if s.times.len() >= after as usize {
            strikes.remove(key);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ban_answers_until_its_end_and_a_lift_ends_it_at_once() {
        let b = PenaltyBox::new();
        assert_eq!(b.banned_ms(b"k"), None);
        b.ban(b"k", b.ticket(), 10_000);
        let left = b.banned_ms(b"k").unwrap();
        assert!((9_000..10_000).contains(&left), "{left}");
        assert_eq!(b.banned_ms(b"k2"), None, "another key is not banned");
        assert_eq!(b.entries().len(), 1);
        assert!(b.lift(b"k"));
        assert_eq!(b.banned_ms(b"k"), None);
        assert!(!b.lift(b"k"));
        assert_eq!(b.len.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_ban_ends_no_later_than_the_one_it_was_learnt_from() {
        let b = PenaltyBox::new();
        std::thread::sleep(std::time::Duration::from_millis(35));
        // Learnt from a request sent 30 ms ago: 30 ms (and 1) are gone.
        let mut t = b.ticket();
        t.sent_ns = t.sent_ns.saturating_sub(30 * MS);
        b.ban(b"k", t, 50);
        let left = b.banned_ms(b"k").unwrap_or(0);
        assert!(left <= 20, "{left}");
        std::thread::sleep(std::time::Duration::from_millis(25));
        assert_eq!(b.banned_ms(b"k"), None);
        b.sweep();
        assert_eq!(b.len.load(Ordering::Relaxed), 0);
        // A ban of 1 ms is never cached (its margin takes it all).
        b.ban(b"short", b.ticket(), 1);
        assert_eq!(b.banned_ms(b"short"), None);
        // Learnt by a request sent before a lift: not cached.
        let before = b.ticket();
        b.lift(b"other");
        b.ban(b"k", before, 10_000);
        assert_eq!(b.banned_ms(b"k"), None);
    }

    #[test]
    fn strikes_engage_after_n_refusals_within_the_window_only() {
        let b = PenaltyBox::new();
        let s = |t_ms: u64| b.strike(b"k", t_ms * MS, 3, 1000);
        assert!(!s(0));
        assert!(!s(100));
        // The first strike has left the window by 1000 ms.
        assert!(!s(1000));
        assert!(s(1050), "three within 1 s: 100, 1000, 1050");
        assert!(!s(1060), "cleared when the ban engaged");
        // Swept once they have left their window.
        b.sweep();
        assert_eq!(b.strikes.lock().unwrap().len(), 1);
        let late = b.now_ns() + 3000 * MS;
        assert!(!b.strike(b"other", late, 3, 1000));
        b.strikes.lock().unwrap().retain(|_, s| s.prune(late));
        assert_eq!(b.strikes.lock().unwrap().len(), 1, "only the fresh key's strike is left");
    }
}
