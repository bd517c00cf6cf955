//! Per-key coalescing of Redis calls.
//!
//! While one call for a window (key, window length and algorithm: each
//! algorithm has its own Redis key and script) is in flight, later
//! checks of the same window do not make calls of their own: they queue
//! here, and when the call in flight returns, the queue goes to Redis as one
//! call carrying each request's limit and cost in arrival order. The script
//! judges them in turn exactly as if each had been a call of its own at that
//! instant (admit if count + cost <= limit, otherwise refuse and record
//! nothing), so the decisions are those of some serial order of the
//! requests: coalescing changes how many calls Redis runs, not what it
//! decides. There is no timer: a request whose key has no call in flight is
//! sent at once, so at low load nothing waits.
//!
//! A window is found by a 128-bit fingerprint of (key, window) from two
//! keyed hashers (random per process, so keys cannot be chosen to collide).
//! The first waiter stores the real key and window, and a request that
//! shares the fingerprint but not the key is sent on its own: a collision
//! costs a call, never a wrong decision.
//!
//! The table is 64 shards of a map, each behind a mutex held for a map
//! operation only (never across an await). A request that finds no call in
//! flight takes the lock twice (to mark the call, then to clear it) and
//! allocates nothing once the map has grown; only a request that waits
//! allocates (its channel), and a batch copies its key once.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

use tokio::sync::oneshot;

use crate::protocol::Algorithm;
use crate::window::{StoreError, Verdict};

const SHARDS: usize = 64;

/// Requests in one batched call at most; more wait for the next call.
pub const MAX_BATCH: usize = 128;

/// What a waiting request gets: its own verdict, or the batch's error.
pub type Answer = Result<Verdict, StoreError>;

/// A request waiting for the next call of its window.
#[derive(Debug)]
pub struct Waiter {
    pub limit: u32,
    pub cost: u32,
    pub tx: oneshot::Sender<Answer>,
}

/// The next call of a window: its key, its length and the requests, in
/// arrival order.
#[derive(Debug)]
pub struct Batch {
    pub key: Box<[u8]>,
    pub window_ms: u32,
    pub algorithm: Algorithm,
    pub waiters: Vec<Waiter>,
}

/// A window with a call in flight.
#[derive(Debug, Default)]
struct Pending {
    /// The key and window of the waiters (set by the first of them).
    window: Option<(Box<[u8]>, u32, Algorithm)>,
    waiters: Vec<Waiter>,
}

/// How a request takes part.
#[derive(Debug)]
pub enum Join {
    /// No call in flight for its window: it makes the call, and must call
    /// `InFlight::next_batch` when the call is over (or abandoned).
    Lead,
    /// A call is in flight: the answer comes on this channel.
    Wait(oneshot::Receiver<Answer>),
    /// Its fingerprint is taken by another window (a hash collision): it
    /// makes a call of its own and leaves the table alone.
    Alone,
}

/// The windows with a call in flight.
#[derive(Debug)]
pub struct InFlight {
    shards: Vec<Mutex<HashMap<u128, Pending>>>,
    hi: RandomState,
    lo: RandomState,
}

impl Default for InFlight {
    fn default() -> Self {
        Self { shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(), hi: RandomState::new(), lo: RandomState::new() }
    }
}

impl InFlight {
    pub fn fingerprint(&self, key: &[u8], window_ms: u32, algorithm: Algorithm) -> u128 {
        let hash = |s: &RandomState| s.hash_one((key, window_ms, algorithm));
        ((hash(&self.hi) as u128) << 64) | hash(&self.lo) as u128
    }

    fn shard(&self, fp: u128) -> MutexGuard<'_, HashMap<u128, Pending>> {
        // A panic elsewhere cannot leave a map half-changed: every change
        // here is one map operation.
        self.shards[fp as usize % SHARDS].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Joins the window's call in flight, or marks one as started.
    pub fn join(&self, fp: u128, key: &[u8], window_ms: u32, algorithm: Algorithm, limit: u32, cost: u32) -> Join {
        let mut map = self.shard(fp);
        match map.entry(fp) {
            Entry::Vacant(v) => {
                v.insert(Pending::default());
                Join::Lead
            }
            Entry::Occupied(mut o) => {
                let p = o.get_mut();
                match &p.window {
                    Some((k, w, a)) if **k != *key || *w != window_ms || *a != algorithm => return Join::Alone,
                    Some(_) => {}
                    None => p.window = Some((key.into(), window_ms, algorithm)),
                }
                let (tx, rx) = oneshot::channel();
                p.waiters.push(Waiter { limit, cost, tx });
                Join::Wait(rx)
            }
        }
    }

    /// The window's call is over: the requests that queued meanwhile, to be
    /// sent next (the window stays marked in flight), or `None` when none
    /// did (the mark is cleared).
    pub fn next_batch(&self, fp: u128) -> Option<Batch> {
        let mut map = self.shard(fp);
        let Entry::Occupied(mut o) = map.entry(fp) else { return None };
        if o.get().waiters.is_empty() {
            o.remove();
            return None;
        }
        let p = o.get_mut();
        let (key, window_ms, algorithm) = p.window.take().expect("waiters set the window");
        Some(Batch { key, window_ms, algorithm, waiters: std::mem::take(&mut p.waiters) })
    }

    /// Windows marked in flight (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_request_leads_later_ones_queue_in_order() {
        let t = InFlight::default();
        let fp = t.fingerprint(b"k", 1000, Algorithm::Log);
        assert!(matches!(t.join(fp, b"k", 1000, Algorithm::Log, 10, 1), Join::Lead));
        let mut rxs = Vec::new();
        for cost in 1..=3 {
            match t.join(fp, b"k", 1000, Algorithm::Log, 10, cost) {
                Join::Wait(rx) => rxs.push(rx),
                other => panic!("{other:?}"),
            }
        }
        let b = t.next_batch(fp).expect("three waited");
        assert_eq!((&*b.key, b.window_ms), (&b"k"[..], 1000));
        assert_eq!(b.waiters.iter().map(|w| w.cost).collect::<Vec<_>>(), [1, 2, 3]);
        // Still in flight while the batch runs: a newcomer queues.
        assert!(matches!(t.join(fp, b"k", 1000, Algorithm::Log, 10, 1), Join::Wait(_)));
        assert!(t.next_batch(fp).is_some());
        assert!(t.next_batch(fp).is_none(), "nobody queued: the mark is cleared");
        assert_eq!(t.len(), 0);
        assert!(matches!(t.join(fp, b"k", 1000, Algorithm::Log, 10, 1), Join::Lead));
    }

    #[test]
    fn a_fingerprint_collision_is_sent_alone() {
        let t = InFlight::default();
        // Force the same fingerprint for two windows.
        let fp = t.fingerprint(b"a", 1000, Algorithm::Log);
        assert!(matches!(t.join(fp, b"a", 1000, Algorithm::Log, 10, 1), Join::Lead));
        assert!(matches!(t.join(fp, b"a", 1000, Algorithm::Log, 10, 1), Join::Wait(_)));
        assert!(matches!(t.join(fp, b"b", 1000, Algorithm::Log, 10, 1), Join::Alone));
        assert!(matches!(t.join(fp, b"a", 2000, Algorithm::Log, 10, 1), Join::Alone));
        assert!(matches!(t.join(fp, b"a", 1000, Algorithm::Ring, 10, 1), Join::Alone));
        let b = t.next_batch(fp).unwrap();
        assert_eq!(b.waiters.len(), 1);
    }

    #[test]
    fn windows_differ_by_key_and_length() {
        let t = InFlight::default();
        assert_ne!(t.fingerprint(b"k", 1000, Algorithm::Log), t.fingerprint(b"k", 2000, Algorithm::Log));
        assert_ne!(t.fingerprint(b"k", 1000, Algorithm::Log), t.fingerprint(b"k", 1000, Algorithm::Ring));
        assert_ne!(t.fingerprint(b"k", 1000, Algorithm::Log), t.fingerprint(b"j", 1000, Algorithm::Log));
        assert_eq!(t.fingerprint(b"k", 1000, Algorithm::Log), t.fingerprint(b"k", 1000, Algorithm::Log));
    }
}

/// Cold keys batched across keys (`[redis] batch_cold_keys`, log only, one
/// Redis): at most `COLD_LANES` single-key calls in flight; a check that
/// finds them all busy queues here, and when one returns, the queue goes to
/// Redis as one call of different keys (src/redis/scripts/sliding_window.lua, mode
/// 'B'), each decided exactly as a call of its own at that instant. No
/// timer: with a lane free a check is sent at once.
pub const COLD_LANES: u32 = 4;

/// A check queued for the next cross-key call.
#[derive(Debug)]
pub struct ColdWaiter {
    pub key: Box<[u8]>,
    pub window_ms: u32,
    pub limit: u32,
    pub cost: u32,
    pub tx: oneshot::Sender<Answer>,
}

/// What `ColdLanes::enter` says.
pub enum Lane {
    /// A lane is ours: send the call, then `leave`.
    Send,
    /// Queued: the answer comes on this channel.
    Queued(oneshot::Receiver<Answer>),
}

/// The lanes in use and the queue behind them, under one lock held for a
/// counter change or a push only.
#[derive(Debug, Default)]
pub struct ColdLanes {
    state: Mutex<(u32, Vec<ColdWaiter>)>,
}

impl ColdLanes {
    fn lock(&self) -> MutexGuard<'_, (u32, Vec<ColdWaiter>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a lane, or queues the check.
    pub fn enter(&self, key: &[u8], window_ms: u32, limit: u32, cost: u32) -> Lane {
        let mut s = self.lock();
        if s.0 < COLD_LANES {
            s.0 += 1;
            return Lane::Send;
        }
        let (tx, rx) = oneshot::channel();
        s.1.push(ColdWaiter { key: key.into(), window_ms, limit, cost, tx });
        Lane::Queued(rx)
    }

    /// A lane's call returned: the queue (up to `MAX_BATCH`) to send next
    /// on the same lane, or the lane is freed.
    pub fn leave(&self) -> Option<Vec<ColdWaiter>> {
        let mut s = self.lock();
        if s.1.is_empty() {
            s.0 -= 1;
            return None;
        }
        let rest = if s.1.len() > MAX_BATCH { s.1.split_off(MAX_BATCH) } else { Vec::new() };
        Some(std::mem::replace(&mut s.1, rest))
    }
}
