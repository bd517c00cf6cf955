//! A circuit breaker for one Redis endpoint, and one per hash slot of a
//! Redis Cluster (`SlotBreakers`).
//!
//! Closed: requests go to Redis. After `threshold` consecutive failures
//! (deadlines during which Redis answered nothing: the link decides what
//! counts), or at once on a lost connection, it opens: requests stop
//! waiting on Redis and the fail policy answers them immediately, while the
//! link's supervisor probes in the background and closes the breaker once a
//! fresh connection has answered and the script is loaded. The request path
//! reads one atomic; it writes only when the state changes.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

#[derive(Debug)]
pub struct Breaker {
    open: AtomicBool,
    failures: AtomicU32,
    threshold: u32,
}

impl Breaker {
    /// A breaker that starts open: nothing is known to work until the first
    /// probe succeeds.
    pub fn new(threshold: u32) -> Self {
        Self { open: AtomicBool::new(true), failures: AtomicU32::new(0), threshold: threshold.max(1) }
    }

    #[inline]
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    #[inline]
    pub fn record_success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    /// Counts one failure; true if this one opened the breaker.
    pub fn record_failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        n >= self.threshold && self.trip()
    }

    /// Opens the breaker now; true if it was closed.
    pub fn trip(&self) -> bool {
        !self.open.swap(true, Ordering::AcqRel)
    }

    /// Closes the breaker (after a successful probe).
    pub fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.open.store(false, Ordering::Release);
    }
}

/// Slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// A Cluster's breakers, one per hash slot: a dead or silent primary opens
/// the breakers of its own slots only, and the other primaries' keys go on
/// being decided in Redis. One breaker for the whole cluster counted a
/// dead primary's timeouts as silence of every node whenever the live ones
/// had no call of ours answered meanwhile, which quota leases make the
/// usual case (a hot key's requests are admitted from its lease, and its
/// node sees a call a lease life): `tests/cluster.rs`
/// `partial_coverage_keeps_other_primaries_serving` and
/// `primary_killed_under_load` with leases on.
///
/// Evidence is the slot's own: a failure counts only if no call on the
/// slot was answered while it waited (a slot has one owner: an answer on it
/// is an answer of that node), and only one per deadline (a call counts
/// only if it was admitted after the last counted one failed), as the
/// link's breaker counts. Open, the slot's calls are refused at once
/// (`CircuitOpen`: the fail policy) and one call every `reprobe_us` is let
/// through as a probe; its answer closes the breaker. 16384 x 32 bytes,
/// allocated once per Cluster link; the request path reads one atomic on
/// the slot and writes one per answer.
pub struct SlotBreakers {
    slots: Box<[SlotBreaker]>,
    threshold: u32,
}

#[derive(Default)]
struct SlotBreaker {
    /// When a call on the slot was last answered (the link's µs clock).
    last_answer_us: AtomicU64,
    /// When the last failure counted happened.
    last_counted_us: AtomicU64,
    failures: AtomicU32,
    /// 0: closed. Else open: calls are refused until this µs, after which
    /// one passes as a probe (and moves it on by `reprobe_us`).
    open_until_us: AtomicU64,
}

impl std::fmt::Debug for SlotBreakers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let open = self.slots.iter().filter(|s| s.open_until_us.load(Ordering::Relaxed) != 0).count();
        f.debug_struct("SlotBreakers").field("open", &open).finish()
    }
}

impl SlotBreakers {
    /// Every slot closed; `threshold` counted failures in a row open one.
    pub fn new(threshold: u32) -> Self {
        Self { slots: (0..SLOTS).map(|_| SlotBreaker::default()).collect(), threshold: threshold.max(1) }
    }

    /// Whether a call on `slot` may go to Redis at `now_us`: closed, or
    /// open and due for a probe (this call is it).
    #[inline]
    pub fn admit(&self, slot: u16, now_us: u64, reprobe_us: u64) -> bool {
        let s = &self.slots[usize::from(slot) % SLOTS];
        let until = s.open_until_us.load(Ordering::Acquire);
        until == 0 || (now_us >= until && s.open_until_us.compare_exchange(until, now_us + reprobe_us, Ordering::AcqRel, Ordering::Relaxed).is_ok())
    }

    /// A call on `slot` was answered at `now_us`; true if that closed its
    /// breaker.
    #[inline]
    pub fn answered(&self, slot: u16, now_us: u64) -> bool {
        let s = &self.slots[usize::from(slot) % SLOTS];
        s.last_answer_us.fetch_max(now_us, Ordering::Relaxed);
        if s.failures.load(Ordering::Relaxed) != 0 {
            s.failures.store(0, Ordering::Relaxed);
        }
        s.open_until_us.load(Ordering::Relaxed) != 0 && s.open_until_us.swap(0, Ordering::AcqRel) != 0
    }

    /// Whether no call on `slot` was answered since `admitted_us`.
    pub fn silent_since(&self, slot: u16, admitted_us: u64) -> bool {
        self.slots[usize::from(slot) % SLOTS].last_answer_us.load(Ordering::Relaxed) <= admitted_us
    }

    /// A call on `slot` admitted at `admitted_us` failed at `now_us` with
    /// the slot silent meanwhile: counts once per deadline of silence; true
    /// if this one opened the breaker (a failed probe keeps it open, and
    /// the next probe is `reprobe_us` away).
    pub fn failed(&self, slot: u16, admitted_us: u64, now_us: u64, reprobe_us: u64) -> bool {
        let s = &self.slots[usize::from(slot) % SLOTS];
        let last = s.last_counted_us.load(Ordering::Relaxed);
        if admitted_us < last || s.last_counted_us.compare_exchange(last, now_us, Ordering::Relaxed, Ordering::Relaxed).is_err() {
            return false;
        }
        let n = s.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n < self.threshold {
            return false;
        }
        s.open_until_us.swap(now_us + reprobe_us, Ordering::AcqRel) == 0
    }

    #[cfg(test)]
    fn is_open(&self, slot: u16) -> bool {
        self.slots[usize::from(slot) % SLOTS].open_until_us.load(Ordering::Acquire) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = Breaker::new(3);
        assert!(b.is_open(), "starts open until a probe succeeds");
        b.close();
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        b.record_success();
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        assert!(b.record_failure(), "the third in a row opens it");
        assert!(b.is_open());
        assert!(!b.record_failure(), "already open");
        b.close();
        assert!(!b.is_open());
        assert!(b.trip());
        assert!(!b.trip());
    }

    #[test]
    fn a_slot_opens_on_its_own_silence_only_and_is_probed_until_answered() {
        let b = SlotBreakers::new(3);
        let reprobe = 100;
        assert!(b.admit(7, 0, reprobe) && b.admit(8, 0, reprobe), "closed at start");
        // Three calls on slot 7, each admitted after the one before failed,
        // with nothing answered on it: the third opens it.
        assert!(!b.failed(7, 10, 30, reprobe));
        assert!(!b.failed(7, 20, 35, reprobe), "admitted before the last counted failure: the same deadline of silence");
        assert!(!b.failed(7, 31, 60, reprobe));
        assert!(b.failed(7, 61, 90, reprobe), "the third deadline of silence opens it");
        assert!(b.is_open(7) && !b.is_open(8), "slot 8 (another primary's, or the same one's) is not touched");
        assert!(!b.admit(7, 100, reprobe), "refused until the probe is due");
        assert!(b.admit(8, 100, reprobe));
        assert!(b.admit(7, 190, reprobe), "the probe");
        assert!(!b.admit(7, 191, reprobe), "one probe at a time");
        assert!(!b.failed(7, 190, 230, reprobe), "a failed probe: still open, not opened again");
        assert!(!b.admit(7, 300, reprobe) && b.admit(7, 330, reprobe), "the next probe 100 µs after the failed one");
        assert!(b.answered(7, 340), "its answer closes it");
        assert!(!b.is_open(7) && b.admit(7, 341, reprobe));
        assert!(!b.answered(7, 342), "already closed");
        // An answer on the slot while a call waited: no evidence.
        assert!(!b.silent_since(7, 341) && b.silent_since(7, 342));
        // A success resets the count.
        assert!(!b.failed(9, 0, 10, reprobe) && !b.failed(9, 11, 20, reprobe));
        assert!(!b.answered(9, 21));
        assert!(!b.failed(9, 22, 30, reprobe) && !b.failed(9, 31, 40, reprobe), "two in a row since the answer");
    }
}
