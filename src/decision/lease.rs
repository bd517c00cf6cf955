//! Quota leases: admitted requests on a hot key without a Redis call
//! (docs/PERFORMANCE.md, "Quota leases", states where this is exact).
//!
//! A daemon that sees a log key often on this host asks, with the request
//! that finds no lease, for a few units of the key's quota in the same
//! script call (src/redis/scripts/sliding_window.lua, mode 'L'). Redis reserves
//! them only from room to spare (at most half the room left after the
//! request), scored `t0 + life` where `t0` is the script's clock. The
//! daemon admits from them for `life` ms after it *sent* the call, timing
//! each local admission `t0 + ceil(local now - local send)` ms: never
//! earlier than its true time on the script's clock (the script ran after
//! the send), never later than `t0 + life`. When the lease ends (spent,
//! expired, or its limit changed) one call settles it (mode 'S'): used
//! units get their times, unused ones are removed. A spent lease on a key
//! with at least half its limit free is settled when its life is over; then,
//! if the key is still that far from its limit, its used units keep
//! `t0 + life` (no re-score: up to `life` late, which costs nothing unless
//! the key climbs to its limit within a window) and, with no unit to
//! remove, no call is made. Every unit counts in
//! Redis for a full window after the admission it may stand for, settled
//! or not, so no window of Redis's record ever holds fewer members than
//! true admissions: a refusal stays exact and an admission never exceeds
//! the limit. The cost is under-admission: unused units count until the
//! settle (at most `life` + one call), or until `t0 + life + window` if the
//! daemon dies holding them.
//!
//! Only single checks of the log lease (sharded keys lease per shard); a
//! multi-item or refundable check goes through Redis's all-or-nothing path
//! as before (its members are named by the refund handle), and its count
//! includes the units any daemon holds.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::log_limit::RateLimitedLog;
use crate::metrics::METRICS;
use crate::protocol::{Algorithm, MAX_SHARE_UNITS};
use crate::redis::RedisWindow;
use crate::window::{LimitSpec, StoreError, Verdict};

/// Units a lease holds at most: one settle call re-scores them in one ZADD.
pub const MAX_LEASE_UNITS: u32 = 64;
/// Requests on a key within one lease life before it is leased.
const HOT_HITS: u32 = 8;
/// Longest validity of a worker share: an override that lowers a key's
/// limit reaches the workers' shared dicts within this (docs/PERFORMANCE.md,
/// "Worker shares").
pub const MAX_SHARE_MS: u32 = 250;
/// Shorter validity than this is not worth a share.
const MIN_SHARE_MS: u32 = 5;
/// A share is valid for this many times the time the host takes to use its
/// units at its rate: a worker tops a share up before it runs out, and the
/// units added keep the earlier deadline.
const SHARE_USE_FACTOR: u64 = 3;
/// The shortest validity the rate gives a share: a few of a worker's
/// round trips to the daemon.
const MIN_RATE_VALID_MS: u32 = 20;
/// The longest validity the rate gives a share (`MAX_SHARE_MS` bounds it
/// too): its units are scored at its deadline, so a share handed out as a
/// burst begins, when the daemon's count of the key's rate is low (nginx's
/// denial cache answered the refusals before it), holds its room at most
/// this long after its use (`scripts/fleet --ci`: 250 ms let the shared
/// key's window dip to 358 of 2,000).
const MAX_RATE_VALID_MS: u32 = 100;
/// A share lasts at most this part of its window (10 ms for 1 s): its
/// units are scored at its deadline, so a key at its limit loses at most
/// about 1 % of it to shares (`tests/fleet_under_admission.rs`).
const SHARE_WINDOW_PARTS: u32 = 100;
/// What a worker is told to wait before asking again while this daemon's
/// lease call for the key is in flight: about one Redis round trip, after
/// which the new lease can be shared.
const LEASE_IN_FLIGHT_RETRY_MS: u32 = 1;
/// How long after its worker shares' validity ends a lease that admits no
/// more waits for their give-backs before it is settled. A worker gives a
/// share's units back from a timer 2 ms before the share's deadline; an
/// nginx timer runs late on a loaded host (tens of ms), and a give-back
/// that finds its lease settled cannot return its units, which then count
/// for a whole window (`tests/nginx.rs` two_gateways_hold_one_global_limit
/// lost 5 to 24 of 1,000 so, about 1 run in 15). Waiting holds the
/// lease's settle back that much longer instead: its unused units are
/// removed from Redis at the key's next lease call anyway (`refill` trims
/// them), so what waits is mostly the record of its shares' units, scored
/// at their deadline whether settled or not. 50 ms was not enough for a
/// fresh-clone CI run (a debug daemon beside the other tests: 4 of 1,000
/// lost, once); 250 ms is five times that.
const GIVE_BACK_GRACE_US: u64 = 250_000;
/// Leases kept per key after they admit no more (`Slot::retired`), each
/// until `QuotaLease::kept_until_us`: its worker shares' validity (100 ms at
/// most) and the grace for their give-backs, or, spent, the end of its life
/// (a quarter of the window, 1 s at most). Past it, those due are settled,
/// then the oldest (re-scored, as every settle before a lease's life ends):
/// a give-back of its shares' units that comes after finds no lease, and
/// they count for a window (under-admission only; kept until the lease's
/// end, and 8 of them, such early settles cost `tests/nginx.rs`
/// two_gateways_hold_one_global_limit 6 to 15 units of 1,000 in about 1
/// run in 20). 256 covers a host spending 64-unit leases of one key at up
/// to 65,000 admissions a second for a 1 s window (16,000 for windows of
/// 4 s and more); a hotter key's oldest spent leases are settled early,
/// re-scored, and cost Redis what they did before leases were kept
/// (`tests/quota_leases.rs` a_hot_key_far_from_its_limit: a debug daemon
/// spent 100-145 leases of one key within a life). Memory: a lease is
/// about 400 bytes with its unit offsets, and each one kept was a lease call
/// within its life or its shares' validity and grace (1.35 s at most, 0.35
/// s for 1 s windows), so the leases kept over every key are at most 1.35 s
/// of the daemon's lease calls (27,000 at 20,000 calls a second: 11 MB);
/// this cap bounds one key's, 100 KB.
const MAX_RETIRED: usize = 256;

/// Units of a lease handed to an nginx worker's shared dict (op 10).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerShare {
    pub units: u32,
    /// ms from the worker's send of the request during which it may admit
    /// from the units (its monotonic clock, the daemon's too).
    pub valid_ms: u32,
    /// The key's room outside the lease and the share when the lease was
    /// granted, plus the lease's units left after it.
    pub remaining: u32,
}

/// The answer to a worker asking for a share of a key's lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareAnswer {
    Units(WorkerShare),
    /// No units now. `ask_again_ms` > 0: a lease call for the key is in
    /// flight, units may be there that soon; 0: not soon (the key is not
    /// hot, has no room to spare, or is not leased at all).
    NoUnits { ask_again_ms: u32 },
}

impl ShareAnswer {
    pub const NONE: Self = Self::NoUnits { ask_again_ms: 0 };
}

/// A worker share handed out of a lease and not given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Share {
    /// Its deadline, ms after the lease's `t0_ms`: its units' score.
    offset: u32,
    units: u32,
    /// An admin reset after its deadline forgot it (`forget_before`): its
    /// units are in neither `offsets` nor Redis, but a worker's give-back
    /// of them, sent before the deadline, may still be on its way, and must
    /// not be taken from a share still in use.
    forgotten: bool,
}

/// One lease as the daemon holds it: pure state, times passed in (µs on
/// the daemon's monotonic clock), so that a test can run it on virtual time.
#[derive(Debug)]
pub struct QuotaLease {
    seq: u64,
    limit: u32,
    /// The script's clock when it reserved the units, ms.
    t0_ms: u64,
    /// When the reserving call was sent, µs on the local clock.
    sent_us: u64,
    life_ms: u32,
    granted: u32,
    /// The key's room outside this lease when granted.
    outside: u32,
    /// The ms offset from `t0_ms` of each used unit, in unit order.
    offsets: Vec<u32>,
    /// The worker shares handed out of it and not given back, each share's
    /// units being `units` of `offsets` equal to `offset` (its deadline),
    /// unless an admin reset forgot them. No allocation until the first
    /// share.
    shared: Vec<Share>,
    /// When the last of its worker shares' validity ends (local µs; 0: no
    /// share): no worker takes from them after, and their give-backs come
    /// before it, or late by a loaded worker's timer.
    shares_end_us: u64,
    /// Its units still reserved in Redis: `granted`, until units given
    /// back after it retired are removed early (`QuotaLeases::trim_in`).
    reserved: u32,
    /// A lease of an O(1) algorithm: its units are a reserve (settle record
    /// `handle`), given back with one settle of the units used.
    reserve: Option<(Algorithm, [u8; 16])>,
}

impl QuotaLease {
    /// A lease of `granted` units (at most `MAX_LEASE_UNITS`) reserved by
    /// the call sent at `sent_us` that ran at `t0_ms`, for `limit`.
    pub fn new(seq: u64, limit: u32, t0_ms: u64, sent_us: u64, life_ms: u32, granted: u32, outside: u32) -> Self {
        let granted = granted.min(MAX_LEASE_UNITS);
        Self { seq, limit, t0_ms, sent_us, life_ms, granted, outside, offsets: Vec::with_capacity(granted as usize), shared: Vec::new(), shares_end_us: 0, reserved: granted, reserve: None }
    }

    /// A lease of an O(1) algorithm (fixed or calendar window, sliding
    /// counter): `granted` units reserved under `handle` by the call sent at
    /// `sent_us`, admitting for `life_ms`, which the caller cut so that every
    /// local admission falls in the fixed window the units were counted in.
    #[allow(clippy::too_many_arguments)]
    pub fn reserved(seq: u64, algorithm: Algorithm, handle: [u8; 16], limit: u32, sent_us: u64, life_ms: u32, granted: u32, outside: u32) -> Self {
        Self { reserve: Some((algorithm, handle)), ..Self::new(seq, limit, 0, sent_us, life_ms, granted, outside) }
    }

    /// Admits `cost` units at local time `now_us` for a request of `limit`,
    /// or None: the lease is spent, expired, or was granted for another
    /// limit. No allocation (the offsets' capacity is the lease's size).
    pub fn admit(&mut self, now_us: u64, limit: u32, cost: u32) -> Option<Verdict> {
        let used = self.offsets.len() as u32;
        if limit != self.limit || cost == 0 || cost > self.granted - used {
            return None;
        }
        // The true time is at most this many ms after t0: rounded up, and
        // 1000 ppm added for clocks running at different rates (NTP slews
        // at most 500 ppm).
        let elapsed = now_us.saturating_sub(self.sent_us);
        let offset = (elapsed + elapsed / 1000).div_ceil(1000);
        if offset > u64::from(self.life_ms) {
            return None;
        }
        for _ in 0..cost {
            self.offsets.push(offset as u32);
        }
        let remaining = self.outside + (self.granted - used - cost);
        Some(Verdict { allowed: true, count: self.limit.saturating_sub(remaining), remaining, retry_after_ms: 0, reset_ms: 0 })
    }

    /// Hands up to `want` units (at most `MAX_SHARE_UNITS`) to a worker at
    /// local time `now_us`, for `limit`, if at least `least` are left, valid
    /// for at most `max_valid_ms`. The share is valid until the last µs at
    /// which the daemon itself may still admit (offset ⌈1.001 · elapsed⌉ ≤
    /// life), less 1 ms for the worker's whole-ms clock, and for at most
    /// `MAX_SHARE_MS` and `max_valid_ms`. The worker's admissions are never
    /// timed: each unit is scored at the latest true time any of them may
    /// have, its deadline (the worker's send, at or before `now_us`, plus
    /// the validity), timed as `admit` times the daemon's own: never earlier
    /// than the admission it stands for, and a short share is scored close
    /// to its use rather than at the lease's end.
    pub fn share(&mut self, now_us: u64, limit: u32, want: u32, least: u32, max_valid_ms: u32) -> Option<WorkerShare> {
        if limit != self.limit || self.reserve.is_some() {
            return None;
        }
        let used = self.offsets.len() as u32;
        // Not within the last quarter of the limit: there a worker's units
        // (scored at the share's deadline, after their use) would hold room
        // that per-request decisions and the daemon's own leases (re-scored
        // to their times) use more closely.
        if u64::from(self.outside + (self.granted - used)) * 4 < u64::from(self.limit) {
            return None;
        }
        let units = want.min(self.granted - used).min(MAX_SHARE_UNITS);
        let last_us = self.sent_us + u64::from(self.life_ms) * 1_000_000 / 1001;
        let valid_ms = (last_us.saturating_sub(now_us) / 1000).saturating_sub(1).min(u64::from(MAX_SHARE_MS.min(max_valid_ms))) as u32;
        if units == 0 || units < least || valid_ms < MIN_SHARE_MS {
            return None;
        }
        let elapsed = (now_us + u64::from(valid_ms) * 1000).saturating_sub(self.sent_us);
        // At most life: the validity ends before the daemon's last admission.
        let offset = ((elapsed + elapsed / 1000).div_ceil(1000) as u32).min(self.life_ms);
        for _ in 0..units {
            self.offsets.push(offset);
        }
        self.shared.push(Share { offset, units, forgotten: false });
        self.shares_end_us = self.shares_end_us.max(now_us + u64::from(valid_ms) * 1000);
        Some(WorkerShare { units, valid_ms, remaining: self.outside + (self.granted - used - units) })
    }

    /// Takes back up to `units` units of its worker shares that no worker
    /// used (a give-back), the earliest-scored share's first; how many.
    /// They are unused units of the lease again: the daemon admits from
    /// them, shares them again, or its settle removes them from Redis.
    pub fn take_back(&mut self, units: u32) -> u32 {
        let mut taken = 0;
        while taken < units {
            let (back, _) = self.take_back_earliest(units - taken);
            if back == 0 {
                break;
            }
            taken += back;
        }
        taken
    }

    /// The Redis score of its earliest worker share not given back.
    fn earliest_share(&self) -> Option<u64> {
        self.shared.iter().map(|s| self.t0_ms + u64::from(s.offset)).min()
    }

    /// Takes back up to `units` units of its earliest-scored worker share
    /// (see `QuotaLeases::take_back` for why that one): how many, and how
    /// many of those are the lease's again (none of a share a reset forgot:
    /// they are no longer counted anywhere).
    fn take_back_earliest(&mut self, units: u32) -> (u32, u32) {
        let Some(i) = (0..self.shared.len()).min_by_key(|&i| self.shared[i].offset) else { return (0, 0) };
        let Share { offset, units: n, forgotten } = self.shared[i];
        if forgotten {
            let taken = n.min(units);
            if taken == n {
                self.shared.swap_remove(i);
            } else {
                self.shared[i].units = n - taken;
            }
            return (taken, 0);
        }
        let mut taken = 0;
        while taken < n.min(units) {
            // Unit order means nothing in Redis (members are named by
            // position, every one scored at the settle): any unit of this
            // offset will do. It leaves from the end (the last unit takes
            // its place), as `QuotaLeases::trim_in` needs.
            let Some(at) = self.offsets.iter().rposition(|&o| o == offset) else { break };
            self.offsets.swap_remove(at);
            taken += 1;
        }
        if taken == n {
            self.shared.swap_remove(i);
        } else {
            self.shared[i].units = n - taken;
        }
        (taken, taken)
    }

    /// Forgets what an admin reset that ran at `at_ms` on Redis's clock
    /// (the script's `now`, the clock `t0_ms` is read on) removed: the
    /// admissions provably before it, and the worker shares whose deadline
    /// was before it. A unit used at offset `o` was admitted before
    /// `(t0 + o + 1)` ms (t0 is whole ms, up to 1 ms behind the script's
    /// start; `o` rounds the elapsed time up with the clocks' margin), so
    /// `t0 + o < at_ms` means before the reset; every admission after it
    /// has `t0 + o >= at_ms` and is kept. Applied late (the change log's
    /// refresh) or twice, it forgets nothing after the reset: exact either
    /// way. The units forgotten are the lease's again (their members are
    /// still in Redis, scored `t0 + life`, after the reset's now, which
    /// kept them); with `t0 + life <= at_ms` the reset removed every member,
    /// and the lease holds nothing more. Leases of the O(1) algorithms
    /// carry no Redis time: they forget nothing (their admissions count
    /// until the window ends: under-admission only). Units forgotten.
    pub fn forget_before(&mut self, at_ms: u64) -> u32 {
        if self.reserve.is_some() {
            return 0;
        }
        let before = self.used();
        if self.t0_ms + u64::from(self.life_ms) <= at_ms {
            for s in &mut self.shared {
                s.forgotten = true;
            }
            self.offsets.clear();
            (self.granted, self.reserved) = (0, 0);
            return before;
        }
        let cut = at_ms.saturating_sub(self.t0_ms);
        for s in self.shared.iter_mut().filter(|s| u64::from(s.offset) < cut) {
            s.forgotten = true;
        }
        self.offsets.retain(|&o| u64::from(o) >= cut);
        before - self.used()
    }

    /// Its units reserved in Redis that nothing used (its settle, or a
    /// trim, removes them).
    fn reserved_unused(&self) -> u32 {
        self.reserved - self.used()
    }

    /// Units of its worker shares not given back (those a reset forgot
    /// too: their give-back may still come, and must find them).
    pub fn shared_out(&self) -> u32 {
        self.shared.iter().map(|s| s.units).sum()
    }

    /// The key's room outside the lease plus its units left.
    pub fn remaining(&self) -> u32 {
        self.outside + (self.granted - self.used())
    }

    /// The scores of the used units, in unit order, for the settle call;
    /// 0 for a unit already scored right: one used at `t0 + life` keeps the
    /// score it was reserved with, and the settle skips it.
    pub fn used_scores(&self) -> impl Iterator<Item = u64> + '_ {
        self.offsets.iter().map(|&o| if o == self.life_ms { 0 } else { self.t0_ms + u64::from(o) })
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    pub fn granted(&self) -> u32 {
        self.granted
    }

    pub fn used(&self) -> u32 {
        self.offsets.len() as u32
    }

    /// Whether it may still admit a request of `limit` at `now_us` (units
    /// left, life not over, the limit it was granted for).
    fn can_admit(&self, now_us: u64, limit: u32) -> bool {
        let elapsed = now_us.saturating_sub(self.sent_us);
        limit == self.limit && self.used() < self.granted && (elapsed + elapsed / 1000).div_ceil(1000) <= u64::from(self.life_ms)
    }

    /// µs until which it is kept for its worker shares' give-backs, once it
    /// admits no more: their validity, plus `GIVE_BACK_GRACE_US` for a
    /// worker's late timer.
    fn give_backs_by_us(&self) -> u64 {
        self.shares_end_us + GIVE_BACK_GRACE_US
    }

    /// µs until which the slot keeps it, once it admits no more, rather
    /// than settle it (0: settled at once), `far` saying whether the key
    /// has at least half its limit free (`Slot::far_from_limit`): while its
    /// worker shares' give-backs may still come (`give_backs_by_us`), and,
    /// spent with no unit to remove on a key far from its limit, until its
    /// life is over. Settled then, its units' reserved score
    /// (`t0 + life`) has passed, so it needs no re-score and no call at all
    /// if the key is still that far from its limit (`must_rescore`); kept
    /// meanwhile, an admin reset still reaches its admissions
    /// (`forget_before`). Near the limit it is settled at once, re-scored:
    /// a refusal's `reset_ms` (the newest member's score plus the window)
    /// then never counts units scored in the future by this daemon's spent
    /// leases. A log lease only: a reserve is given back at once.
    fn kept_until_us(&self, far: bool) -> u64 {
        if self.reserve.is_some() {
            return 0;
        }
        let shares = if self.shared_out() > 0 { self.give_backs_by_us() } else { 0 };
        let spent = if self.reserved_unused() == 0 && far { self.ends_us() } else { 0 };
        shares.max(spent)
    }

    /// Whether its settle must re-score its used units to their times, at
    /// local time `now_us`, `far` saying whether the key has at least half
    /// its limit free (`Slot::far_from_limit`): before its life is over (an admin reset
    /// then could not remove units scored in the future), and near the
    /// limit, where a unit kept at `t0 + life`, up to `life` after its
    /// admission, would hold its room that much longer. Far from it (at
    /// least half the limit free) that costs nothing unless the key climbs
    /// to its limit within a window, and each unit's re-score costs Redis
    /// more than its lease call did (docs/PERFORMANCE.md, "Redis CPU per
    /// decision").
    pub fn must_rescore(&self, now_us: u64, far: bool) -> bool {
        now_us < self.ends_us() || !far
    }

    /// µs after which it admits nothing more (local clock).
    pub fn ends_us(&self) -> u64 {
        self.sent_us + u64::from(self.life_ms) * 1000
    }
}

/// How long a lease of a window of `window_ms` admits: a quarter of the
/// window, at most 1 s; none under 40 ms windows (0).
pub fn lease_life_ms(window_ms: u32) -> u32 {
    let life = (window_ms / 4).min(1000);
    if life < 10 {
        0
    } else {
        life
    }
}

/// Units to ask for after `hits` requests in the last lease life: the rate
/// on this host with a quarter to spare.
pub fn units_wanted(hits: u32) -> u32 {
    (hits + hits / 4 + 1).clamp(2, MAX_LEASE_UNITS)
}

/// The algorithms a daemon leases: the log (members re-scored at the
/// settle) and, by "reserve then give back", the fixed (and calendar)
/// window and the sliding counter. Not GCRA (a reserve is charged at its
/// own time, earlier than the admissions it stands for: see
/// docs/PERFORMANCE.md) nor the ring (its slots cannot be re-scored by
/// name): those are decided per request, leases on or off.
pub fn leasable(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::Log | Algorithm::Fixed | Algorithm::SlidingCounter)
}

/// ms kept between a reserved lease's last local admission and the end of
/// the fixed window its units were counted in: the script reads whole ms
/// (its `now` is up to 1 ms behind the true time) and 1 ms more of slack.
const WINDOW_END_MARGIN_MS: u32 = 2;

/// ms from a reserve's script run to the end of the fixed window it counted
/// the units in, from the reply's `reset_ms`: the fixed window's reset is
/// that end; the sliding counter's is the end of the *next* window (when
/// the estimate reaches 0), one window later.
fn window_end_ms(algorithm: Algorithm, reset_ms: u32, window_ms: u32) -> u32 {
    match algorithm {
        Algorithm::SlidingCounter => reset_ms.saturating_sub(window_ms),
        _ => reset_ms,
    }
}

/// How long a reserved lease admits: its `life_ms`, cut so that its last
/// local admission (offset ⌈1.001 · elapsed since the send⌉ ≤ the result)
/// falls before the end of the fixed window its units were counted in,
/// `reset_ms` being the reserve's reply.
pub fn reserved_life_ms(algorithm: Algorithm, life_ms: u32, reset_ms: u32, window_ms: u32) -> u32 {
    life_ms.min(window_end_ms(algorithm, reset_ms, window_ms).saturating_sub(WINDOW_END_MARGIN_MS))
}

/// One key's place in the table: its recent rate and its lease.
#[derive(Debug, Default)]
struct Slot {
    fp: u128,
    period_start_us: u64,
    hits: u32,
    last_hits: u32,
    refilling: bool,
    lease: Option<QuotaLease>,
    /// A log lease taken ahead, while `lease` still had units: admitted
    /// from once `lease` can admit no more (`renew_ahead`).
    next: Option<QuotaLease>,
    /// The lease (seq) a renewal ahead was asked for: one per lease, so a
    /// key near its limit (no units granted) costs one call, not one per
    /// admission.
    renewed_for: u64,
    /// Leases that admit no more, oldest first, at most `MAX_RETIRED`: kept
    /// until their shares' give-backs are due, so that the workers'
    /// give-backs of their units reach them, and, spent, until their life is
    /// over (`QuotaLease::kept_until_us`). Empty (no allocation) for a key
    /// that is not hot.
    retired: Vec<QuotaLease>,
    /// Settles of its log leases in flight: a lease call waits for them,
    /// so that the room Redis tells it never counts units being given
    /// back (its `remaining` would be that much lower than the truth).
    settling: u16,
}

impl Slot {
    /// Counts `n` requests (or units handed to workers) of the key at
    /// `now_us` in its rate: the current period of `life_ms` and the one
    /// before.
    fn count(&mut self, now_us: u64, life_ms: u32, n: u32) {
        let period = u64::from(life_ms) * 1000;
        if now_us >= self.period_start_us + period {
            self.last_hits = if now_us < self.period_start_us + 2 * period { self.hits } else { 0 };
            self.hits = 0;
            self.period_start_us = now_us;
        }
        self.hits = self.hits.saturating_add(n);
    }

    /// How many of `want` units to hand a worker at `now_us`, and for how
    /// long: valid `SHARE_USE_FACTOR` times the time this host takes to use
    /// `want` units at its rate (the faster of the last period's and the
    /// current one's), within `MIN_RATE_VALID_MS..=MAX_RATE_VALID_MS` and
    /// at most a `SHARE_WINDOW_PARTS`th of the window; and
    /// fewer units when the host would not use them within that at its
    /// rate (at least 2). A share's units are scored at its deadline and an
    /// unused one counts for a window: the shorter and the closer to the
    /// host's use, the less room a key at its limit loses to them.
    fn share_size(&self, now_us: u64, life_ms: u32, want: u32, window_ms: u32) -> (u32, u32) {
        let since_ms = (now_us.saturating_sub(self.period_start_us) / 1000).max(u64::from(life_ms / 4)).max(1);
        let mut use_ms = u64::MAX;
        if self.last_hits > 0 {
            use_ms = use_ms.min(u64::from(want) * u64::from(life_ms) / u64::from(self.last_hits));
        }
        if self.hits > 0 {
            use_ms = use_ms.min(u64::from(want) * since_ms / u64::from(self.hits));
        }
        let use_ms = use_ms.max(1).saturating_mul(SHARE_USE_FACTOR);
        // At most a 1/SHARE_WINDOW_PARTS of the window: a key at its limit
        // then loses at most that much of it to the shares' scores.
        let most = u64::from(window_ms / SHARE_WINDOW_PARTS).clamp(u64::from(MIN_SHARE_MS), u64::from(MAX_RATE_VALID_MS));
        let valid = use_ms.clamp(u64::from(MIN_RATE_VALID_MS), u64::from(MAX_RATE_VALID_MS)).min(most);
        let units = (u64::from(want) * valid).div_ceil(use_ms).max(2).min(u64::from(want));
        (units as u32, valid as u32)
    }

    /// The units of the key's next lease if it is due to be taken ahead:
    /// the lease in hand is 3/4 used (or, `for_shares`, has too few units
    /// left for a worker's share), and no next lease is held, in flight or
    /// already asked for this lease. Marks it asked.
    fn renewal_due(&mut self, for_shares: bool) -> Option<u32> {
        let lease = self.lease.as_ref()?;
        let seq = lease.seq();
        if (!for_shares && lease.used() * 4 < lease.granted() * 3) || self.next.is_some() || self.refilling || self.renewed_for == seq {
            return None;
        }
        self.refilling = true;
        self.renewed_for = seq;
        Some(units_wanted(self.last_hits.max(self.hits)))
    }

    /// Whether the key has at least half of `lease`'s limit free, as its
    /// lease in hand (else the one taken ahead) tells, else as `lease`'s
    /// own room at its grant, within a life, does. (Taking "no lease in
    /// hand" as near instead re-scored every lease spent before its
    /// successor's call landed: 85 of 189 leases of a fast hot key, 0.024-0.029
    /// Redis calls per admission against 0.016. A key that climbs from far to
    /// its limit within a life is the bound PERFORMANCE.md states.)
    fn far_from_limit(&self, lease: &QuotaLease) -> bool {
        let room = self.lease.as_ref().or(self.next.as_ref()).filter(|l| l.limit == lease.limit).map_or_else(|| lease.remaining(), QuotaLease::remaining);
        u64::from(room) * 2 >= u64::from(lease.limit)
    }

    /// Takes the lease out (for its settle) and puts the one taken ahead in
    /// its place. The one taken ahead was granted while every unit of the
    /// ended one was reserved in Redis: the ended one's units left (its
    /// settle removes them) are room outside it, which its answers then
    /// tell (a key's `remaining` goes down one by one across leases).
    fn retire(&mut self) -> Option<QuotaLease> {
        let ended = self.lease.take();
        self.lease = self.next.take();
        if let (Some(e), Some(l)) = (&ended, &mut self.lease) {
            l.outside += e.reserved_unused();
        }
        ended
    }
}

/// What the table says of one request.
pub(super) enum Take {
    /// Admitted from the key's lease.
    Admitted(Verdict),
    /// Ask Redis with a lease of this many units (slot `fp`); then
    /// `lease`, or `abandon` if something else answers.
    Lease { fp: u128, want: u32 },
    /// The key's lease call is in flight (a renewal ahead, a share's or
    /// another request's): wait for it (`lease_done`, at most
    /// `LEASE_WAIT`), then take again. Sent to Redis meanwhile, the request
    /// would be counted against this daemon's own units in flight, and its
    /// answer would tell less room than the lease's next admission does.
    Wait,
    /// Decide as without leases.
    Pass,
}

/// Longest a request waits for its key's lease call in flight before it is
/// decided without the lease.
pub(super) const LEASE_WAIT: Duration = Duration::from_millis(100);

/// The leases of this daemon: a fixed table of slots by key fingerprint
/// (no allocation per request, bounded memory), one short lock per slot.
pub struct QuotaLeases {
    slots: Box<[Mutex<Slot>]>,
    /// Two keyed hashes of (key, window): slots are found by a 128-bit
    /// fingerprint no client can aim at.
    hashers: (RandomState, RandomState),
    epoch: Instant,
    /// The store; it tells the denial cache of every settle (units
    /// removed: Redis may admit sooner than a cached refusal says).
    redis: Arc<RedisWindow>,
    settle_log: RateLimitedLog,
    /// Cancelled at shutdown: every lease is settled at once (`give_back`).
    closing: CancellationToken,
    /// Woken when a lease call ends (granted, refused or failed).
    pub(super) lease_done: Notify,
    /// Lease timers and settles not finished yet.
    pending: AtomicUsize,
}

impl std::fmt::Debug for QuotaLeases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaLeases").field("slots", &self.slots.len()).finish()
    }
}

impl QuotaLeases {
    /// A table of `slots` keys (rounded up to a power of two) over `redis`.
    pub fn new(redis: Arc<RedisWindow>, slots: usize) -> Arc<Self> {
        let n = slots.max(1).next_power_of_two();
        Arc::new(Self {
            slots: (0..n).map(|_| Mutex::default()).collect(),
            hashers: Default::default(),
            epoch: Instant::now(),
            redis,
            settle_log: RateLimitedLog::new(Duration::from_secs(10)),
            closing: CancellationToken::new(),
            lease_done: Notify::new(),
            pending: AtomicUsize::new(0),
        })
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn slot(&self, fp: u128) -> MutexGuard<'_, Slot> {
        // Every change under the lock is a few assignments: a panic cannot
        // leave a slot half-changed.
        self.slots[fp as usize & (self.slots.len() - 1)].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits from the key's lease, or says whether to ask for one. A
    /// lease that can no longer admit this request is taken out and
    /// settled in a task of its own.
    pub(super) fn take(self: &Arc<Self>, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Take {
        let life = lease_life_ms(spec.window_ms);
        if life == 0 || !leasable(algorithm) {
            return Take::Pass;
        }
        let fp = self.fingerprint(spec, algorithm);
        let now = self.now_us();
        let mut slot = self.slot(fp);
        if slot.fp != fp {
            if slot.lease.is_some() || slot.next.is_some() || !slot.retired.is_empty() || slot.refilling || slot.settling > 0 {
                // Another key holds the slot until its lease ends.
                return Take::Pass;
            }
            *slot = Slot { fp, ..Slot::default() };
            slot.period_start_us = now;
        }
        slot.count(now, life, 1);
        // The lease, else the one taken ahead of it.
        while let Some(lease) = slot.lease.as_mut() {
            if let Some(mut v) = lease.admit(now, spec.limit, spec.cost) {
                v.reset_ms = spec.window_ms;
                if let Some(want) = (algorithm == Algorithm::Log).then(|| slot.renewal_due(false)).flatten() {
                    drop(slot);
                    self.renew_ahead(fp, spec, want);
                }
                return Take::Admitted(v);
            }
            let ended = slot.retire().expect("checked above");
            self.end(&mut slot, ended, spec.key, spec.window_ms);
        }
        if slot.refilling && spec.cost <= spec.limit / 4 {
            return Take::Wait;
        }
        if slot.refilling || slot.last_hits.max(slot.hits) < HOT_HITS || spec.cost > spec.limit / 4 {
            return Take::Pass;
        }
        slot.refilling = true;
        Take::Lease { fp, want: units_wanted(slot.last_hits.max(slot.hits)) }
    }

    /// Takes the key's next lease ahead, in a task of its own, while the
    /// lease in hand still has a quarter of its units: the requests that
    /// come meanwhile are admitted from those, not sent to Redis behind the
    /// lease call, and no request waits for a lease call (a cost-0 lease
    /// call, the same script and bounds as any lease). Only the log: a
    /// reserve lease's call decides a request.
    fn renew_ahead(self: &Arc<Self>, fp: u128, spec: &LimitSpec<'_>, want: u32) {
        let leases = self.clone();
        let (key, limit, window_ms) = (Box::<[u8]>::from(spec.key), spec.limit, spec.window_ms);
        tokio::spawn(async move {
            // An error leaves the lease in hand; the next one is taken as
            // without renewal, by the request that finds none.
            let _ = leases.lease(fp, &LimitSpec { key: &key, limit, window_ms, cost: 0 }, Algorithm::Log, want).await;
        });
    }

    /// The slot of (key, window, algorithm): a 128-bit keyed hash no client
    /// can aim.
    fn fingerprint(&self, spec: &LimitSpec<'_>, algorithm: Algorithm) -> u128 {
        let hash = |s: &RandomState| s.hash_one((spec.key, spec.window_ms, algorithm as u8));
        (u128::from(hash(&self.hashers.0)) << 64) | u128::from(hash(&self.hashers.1))
    }

    /// Units of the key's lease for a worker (op 10), if the key is hot on
    /// this host (`HOT_HITS` requests within a lease life, the share units
    /// handed out counted as requests) and has room to spare; none
    /// otherwise (the worker decides per request). A lease in hand is
    /// split (no Redis call); without one, one lease call of cost 0
    /// reserves units for the key (the same script and bound as a lease
    /// taken with a request: at most half the room left), and the share
    /// comes from it. A lease that can no longer share (spent, ending, or
    /// granted for a limit no longer in force) is settled first.
    /// While a lease call for the key is in flight (a request's or another
    /// worker's), the answer says to ask again in about a round trip: the
    /// new lease is shared then, rather than the host's workers deciding
    /// every request through the daemon for their whole back-off.
    pub(super) async fn share(self: &Arc<Self>, spec: &LimitSpec<'_>, want: u32) -> Result<ShareAnswer, StoreError> {
        let life = lease_life_ms(spec.window_ms);
        if life == 0 {
            return Ok(ShareAnswer::NONE);
        }
        let fp = self.fingerprint(spec, Algorithm::Log);
        let lease_want = {
            let now = self.now_us();
            let mut slot = self.slot(fp);
            if slot.fp != fp {
                return Ok(ShareAnswer::NONE);
            }
            // From the lease, or the one taken ahead of it, or a fresh lease.
            let (units, valid) = slot.share_size(now, life, want, spec.window_ms);
            while let Some(lease) = slot.lease.as_mut() {
                // What it has, if fewer: the worker tops up from the lease
                // taken ahead, which this share's use asks for.
                if let Some(share) = lease.share(now, spec.limit, units, 1, valid) {
                    // A key admitted from shares rarely reaches the daemon's
                    // own admissions: its next lease is taken ahead here too,
                    // so the worker's next ask finds units without a call.
                    slot.count(now, life, share.units);
                    if let Some(ahead) = slot.renewal_due(false) {
                        drop(slot);
                        self.renew_ahead(fp, spec, ahead);
                    }
                    return Ok(ShareAnswer::Units(share));
                }
                if lease.can_admit(now, spec.limit) {
                    // Within the last quarter, or at the end of its life:
                    // the daemon admits from its units itself (retired now,
                    // they would stay reserved in Redis until its settle).
                    let (left, near_limit) = (lease.granted - lease.used(), u64::from(lease.remaining()) * 4 < u64::from(spec.limit));
                    let ends_ms = (lease.ends_us().saturating_sub(now) / 1000) as u32 + 1;
                    // The lease taken ahead shares instead; its room
                    // outside counts these units once it is in hand
                    // (`retire`): told now.
                    if let Some(mut share) = slot.next.as_mut().and_then(|n| n.share(now, spec.limit, units, 1, valid)) {
                        share.remaining += left;
                        slot.count(now, life, share.units);
                        return Ok(ShareAnswer::Units(share));
                    }
                    if near_limit {
                        return Ok(ShareAnswer::NONE);
                    }
                    // Else one is on its way, or taken ahead now, or the
                    // lease ends within a few ms: the worker asks again
                    // then, not after its 100 ms back-off.
                    if slot.refilling {
                        return Ok(ShareAnswer::NoUnits { ask_again_ms: LEASE_IN_FLIGHT_RETRY_MS });
                    }
                    if let Some(ahead) = slot.renewal_due(true) {
                        drop(slot);
                        self.renew_ahead(fp, spec, ahead);
                        return Ok(ShareAnswer::NoUnits { ask_again_ms: LEASE_IN_FLIGHT_RETRY_MS });
                    }
                    return Ok(ShareAnswer::NoUnits { ask_again_ms: ends_ms.min(MIN_SHARE_MS + 1) });
                }
                let ended = slot.retire().expect("checked above");
                self.end(&mut slot, ended, spec.key, spec.window_ms);
            }
            if slot.refilling {
                return Ok(ShareAnswer::NoUnits { ask_again_ms: LEASE_IN_FLIGHT_RETRY_MS });
            }
            if slot.last_hits.max(slot.hits) < HOT_HITS {
                return Ok(ShareAnswer::NONE);
            }
            let hits = slot.last_hits.max(slot.hits);
            slot.refilling = true;
            units_wanted(hits).max(want).min(MAX_LEASE_UNITS)
        };
        self.lease(fp, &LimitSpec { cost: 0, ..*spec }, Algorithm::Log, lease_want).await?;
        let now = self.now_us();
        let mut slot = self.slot(fp);
        let (units, valid) = slot.share_size(now, life, want, spec.window_ms);
        let Some(share) = slot.lease.as_mut().and_then(|l| l.share(now, spec.limit, units, 1, valid)) else { return Ok(ShareAnswer::NONE) };
        slot.count(now, life, share.units);
        Ok(ShareAnswer::Units(share))
    }

    /// A lease that admits no more: settled now, or kept in the slot until
    /// `QuotaLease::kept_until_us` (its shares' give-backs may still come,
    /// or it is spent before its life's end), settled then by `settle_at`
    /// or `settle_due`; past `MAX_RETIRED` kept, those due are settled, then
    /// the oldest: its shares' units left stay counted, under-admission
    /// only, and its used units are re-scored.
    fn end(self: &Arc<Self>, slot: &mut Slot, ended: QuotaLease, key: &[u8], window_ms: u32) {
        if self.now_us() < ended.kept_until_us(slot.far_from_limit(&ended)) {
            if slot.retired.len() == MAX_RETIRED && !slot.refilling {
                self.settle_due(slot, key, window_ms);
            }
            if slot.retired.len() == MAX_RETIRED {
                let oldest = slot.retired.remove(0);
                self.settle_in(slot, oldest, key, window_ms);
            }
            slot.retired.push(ended);
            return;
        }
        self.settle_in(slot, ended, key, window_ms);
    }

    /// Takes back `units` of the host's worker shares of the key that no
    /// worker used (a give-back, op 10 with flag 0x0001), from the
    /// earliest-scored shares of the leases in the slot (the one kept for
    /// its settle, the one in hand, the one taken ahead). The units taken
    /// back, and the key's room as the lease in hand tells it (0 without
    /// one). No Redis call: the lease's settle removes the units its daemon
    /// does not admit from.
    ///
    /// Exact whichever worker gives them back: each admission from a share
    /// is earlier than its worker's deadline, which is no later than the
    /// Redis score of every share whose units its dict entry holds (a
    /// top-up keeps the earlier deadline). The units a give-back returns
    /// were taken by no worker, so with them removed from the shares they
    /// came from every admission still has a score at or after its time;
    /// removing the earliest scores instead leaves scores that are each as
    /// late or later, so that still holds (two dicts of one daemon, say,
    /// each giving back units of its own entry).
    pub(super) fn take_back(self: &Arc<Self>, spec: &LimitSpec<'_>, units: u32) -> (u32, u32) {
        let fp = self.fingerprint(spec, Algorithm::Log);
        let mut slot = self.slot(fp);
        if slot.fp != fp {
            return (0, 0);
        }
        let s = &mut *slot;
        let mut taken = 0;
        while taken < units {
            let retired = s.retired.len();
            let earliest = s.retired.iter().chain(s.lease.as_ref()).chain(s.next.as_ref()).enumerate().filter(|(_, l)| l.limit == spec.limit).filter_map(|(i, l)| l.earliest_share().map(|score| (score, i))).min();
            let Some((_, i)) = earliest else { break };
            let lease = match i.checked_sub(retired) {
                None => &mut s.retired[i],
                Some(0) if s.lease.is_some() => s.lease.as_mut().expect("checked"),
                Some(_) => s.next.as_mut().expect("counted above"),
            };
            let (back, regained) = lease.take_back_earliest(units - taken);
            if back == 0 {
                break;
            }
            taken += back;
            if i < retired {
                let back = regained;
                // It admits no more: the units it took back are removed
                // from Redis now, not at its settle (they would be refused
                // until then); with all its shares back, it is settled.
                if s.retired[i].shared_out() == 0 {
                    let done = s.retired.remove(i);
                    self.settle_in(s, done, spec.key, spec.window_ms);
                } else if !s.refilling {
                    // (With a lease call in flight, after it: the room it
                    // reads counts them, and the new lease is told so.)
                    self.trim_in(s, i, spec.key, spec.window_ms);
                }
                // Room outside the lease in hand and the one taken ahead,
                // each granted while they were reserved (see `retire` and
                // the grant in `refill`).
                for l in [s.lease.as_mut(), s.next.as_mut()].into_iter().flatten() {
                    l.outside += back;
                }
            }
        }
        (taken, s.lease.as_ref().map_or(0, QuotaLease::remaining))
    }

    /// An admin reset of (`key`, `window_ms`) ran at `at_ms` on Redis's
    /// clock: every lease of the key forgets the admissions and worker
    /// shares before it (`QuotaLease::forget_before`), so that their settles
    /// do not put the admissions the reset removed back into the window. The
    /// units forgotten are the lease in hand's again; those of the leases
    /// that admit no more are removed from Redis now (a trim, or their
    /// settle once no share is out), after the key's lease call in flight
    /// if there is one (`lease_call` trims then). A settle already in
    /// flight is not reached: its admissions stay counted (under-admission,
    /// one lease at most). Log leases only: see `forget_before`.
    pub fn forget_before(self: &Arc<Self>, key: &[u8], window_ms: u32, at_ms: u64) {
        let fp = self.fingerprint(&LimitSpec { key, limit: 0, window_ms, cost: 0 }, Algorithm::Log);
        let mut slot = self.slot(fp);
        if slot.fp != fp {
            return;
        }
        let s = &mut *slot;
        let forgotten: u32 = s.retired.iter_mut().chain(s.lease.as_mut()).chain(s.next.as_mut()).map(|l| l.forget_before(at_ms)).sum();
        if forgotten == 0 || s.refilling {
            return;
        }
        self.settle_due(s, key, window_ms);
        for at in 0..s.retired.len() {
            if s.retired[at].reserved_unused() > 0 {
                self.trim_in(s, at, key, window_ms);
            }
        }
    }

    /// The request that was to ask for a lease was answered otherwise.
    pub(super) fn abandon(&self, fp: u128) {
        self.slot(fp).refilling = false;
        self.lease_done.notify_waiters();
    }

    /// Decides the request in a lease call and installs the lease granted.
    /// Runs in a task of its own, so that a lease granted is installed (and
    /// settled) even if the request's future is dropped meanwhile.
    pub(super) async fn lease(self: &Arc<Self>, fp: u128, spec: &LimitSpec<'_>, algorithm: Algorithm, want: u32) -> Result<Verdict, StoreError> {
        let leases = self.clone();
        let (key, limit, window_ms, cost) = (Box::<[u8]>::from(spec.key), spec.limit, spec.window_ms, spec.cost);
        let life = lease_life_ms(window_ms);
        let task = tokio::spawn(async move {
            let spec = LimitSpec { key: &key, limit, window_ms, cost };
            let answer = leases.lease_call(fp, &spec, algorithm, want, life, key.clone()).await;
            leases.lease_done.notify_waiters();
            answer
        });
        match task.await {
            Ok(answer) => answer,
            Err(e) => Err(StoreError::Unavailable(format!("lease call abandoned: {e}"))),
        }
    }

    /// The body of `lease`, in its task.
    async fn lease_call(self: &Arc<Self>, fp: u128, spec: &LimitSpec<'_>, algorithm: Algorithm, want: u32, life: u32, key: Box<[u8]>) -> Result<Verdict, StoreError> {
        let leases = self;
        let (limit, window_ms) = (spec.limit, spec.window_ms);
        {
            if algorithm != Algorithm::Log {
                return leases.lease_reserved(fp, spec, algorithm, want, life).await;
            }
            // After the key's settles in flight (one Redis round trip each).
            loop {
                let settled = leases.lease_done.notified();
                if leases.slot(fp).settling == 0 {
                    break;
                }
                settled.await;
            }
            let sent = leases.now_us();
            let answer = leases.redis.lease_now(spec, want, life).await;
            let mut slot = leases.slot(fp);
            slot.refilling = false;
            let grant = match answer {
                Ok(g) => g,
                Err(e) => {
                    leases.settle_due(&mut slot, &key, window_ms);
                    return Err(e);
                }
            };
            // The lease kept for its shares' give-backs has its units left
            // reserved in Redis until its settle: room outside this one,
            // as in `retire`.
            let retired_left = slot.retired.iter().filter(|r| r.limit == limit).map(QuotaLease::reserved_unused).sum::<u32>();
            // Units given back to them during the call: removed now; and
            // the settles held back during it.
            leases.settle_due(&mut slot, &key, window_ms);
            for at in 0..slot.retired.len() {
                if slot.retired[at].reserved_unused() > 0 {
                    leases.trim_in(&mut slot, at, &key, window_ms);
                }
            }
            if grant.granted > 0 {
                METRICS.lease_granted(grant.granted);
                let mut lease = QuotaLease::new(grant.seq, limit, grant.now_ms, sent, life, grant.granted, grant.verdict.remaining);
                lease.outside += retired_left;
                let ends = lease.ends_us();
                // The slot is ours while refilling: no other key took it.
                // Taken ahead: admitted from once the lease in hand is done.
                if slot.lease.is_some() {
                    slot.next = Some(lease);
                } else {
                    slot.lease = Some(lease);
                }
                drop(slot);
                leases.settle_at(fp, grant.seq, ends, key, window_ms);
            }
            // The request's own answer counts the lease's units as this
            // host's room, as every admission from the lease then does
            // (its `remaining` is the room outside plus the units left):
            // one daemon's answers go down one by one, as without leases.
            let mut v = grant.verdict;
            v.count = v.count.saturating_sub(grant.granted);
            v.remaining = v.remaining.saturating_add(grant.granted).saturating_add(retired_left);
            v.count = v.count.saturating_sub(retired_left);
            Ok(v)
        }
    }

    /// "Reserve then give back" for an O(1) algorithm: the request is
    /// decided by an ordinary check; if admitted with room to spare, a
    /// reserve (the CHECK_POLICY settle machinery, 'r' mode of the
    /// algorithm's script) of at most half the room left, whose units the
    /// daemon admits from until the lease's life or the end of the fixed
    /// window they were counted in, whichever is first; one settle of the
    /// units used gives back the rest (docs/PERFORMANCE.md, "Quota leases
    /// for the O(1) algorithms"). Two calls, once per lease.
    async fn lease_reserved(self: &Arc<Self>, fp: u128, spec: &LimitSpec<'_>, algorithm: Algorithm, want: u32, life: u32) -> Result<Verdict, StoreError> {
        let decided = self.redis.check(spec, algorithm).await;
        let units = match &decided {
            // As the log's lease call: half the room left at most, none
            // below a quarter of the limit.
            Ok(v) if v.allowed && u64::from(v.remaining) * 4 >= u64::from(spec.limit) => want.min(v.remaining / 2).min(MAX_LEASE_UNITS),
            _ => 0,
        };
        if units < 2 {
            self.slot(fp).refilling = false;
            return decided;
        }
        let handle: [u8; 16] = rand::random();
        let sent = self.now_us();
        let reserved = self.redis.reserve(&LimitSpec { cost: units, ..*spec }, algorithm, &handle).await;
        let mut slot = self.slot(fp);
        slot.refilling = false;
        let Some(r) = reserved.as_ref().ok().filter(|r| r.allowed) else { return decided };
        METRICS.lease_granted(units);
        let life = reserved_life_ms(algorithm, life, r.reset_ms, spec.window_ms);
        if life == 0 {
            // Too near the window's end to admit anything: give it all back.
            drop(slot);
            self.settle(QuotaLease::reserved(0, algorithm, handle, spec.limit, sent, 0, units, r.remaining), spec.key.into(), spec.window_ms);
            return decided;
        }
        let seq = u64::from_le_bytes(handle[..8].try_into().expect("8 bytes"));
        let lease = QuotaLease::reserved(seq, algorithm, handle, spec.limit, sent, life, units, r.remaining);
        let ends = lease.ends_us();
        slot.lease = Some(lease);
        drop(slot);
        self.settle_at(fp, seq, ends, spec.key.into(), spec.window_ms);
        decided
    }

    /// Settles lease `seq` of slot `fp` once it has ended, if it is still
    /// there (a request may have settled it first); with worker shares out,
    /// `GIVE_BACK_GRACE_US` later, kept with the retired leases meanwhile
    /// (`end`), so that their late give-backs find it.
    fn settle_at(self: &Arc<Self>, fp: u128, seq: u64, ends_us: u64, key: Box<[u8]>, window_ms: u32) {
        let leases = self.clone();
        self.pending.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let mut settle_by = ends_us + 1000;
            loop {
                let wait = settle_by.saturating_sub(leases.now_us());
                // At shutdown, now: the unused units go back to the other hosts.
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_micros(wait)) => {}
                    _ = leases.closing.cancelled() => {}
                }
                let mut slot = leases.slot(fp);
                let ended = match (&slot.lease, &slot.next, slot.retired.iter().position(|r| r.seq() == seq)) {
                    (Some(l), _, _) if l.seq() == seq => slot.retire(),
                    (_, Some(n), _) if n.seq() == seq => slot.next.take(),
                    (_, _, Some(at)) => Some(slot.retired.remove(at)),
                    _ => None,
                };
                let Some(l) = ended else { break };
                let kept_until = l.kept_until_us(slot.far_from_limit(&l));
                if !leases.closing.is_cancelled() && leases.now_us() < kept_until {
                    // Kept (or settled now past MAX_RETIRED) by `end`.
                    settle_by = kept_until;
                    leases.end(&mut slot, l, &key, window_ms);
                    continue;
                }
                leases.settle_in(&mut slot, l, &key, window_ms);
                break;
            }
            leases.pending.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// At shutdown: settles every lease now (used units re-scored, unused
    /// ones removed), so that a daemon stopped or restarted on purpose
    /// leaves no unit counted for a window that nobody admits from. Waits
    /// at most `limit`; whether every settle finished.
    pub async fn give_back(&self, limit: Duration) -> bool {
        self.closing.cancel();
        let deadline = Instant::now() + limit;
        while self.pending.load(Ordering::Relaxed) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        true
    }

    /// One call: used units re-scored, unused removed (the log), or the
    /// reserve settled to the units used (O(1) algorithms). If it fails,
    /// the units stay until `t0 + life + window` (the log) or the end of
    /// their fixed window: under-admission only.
    fn settle(self: &Arc<Self>, lease: QuotaLease, key: Box<[u8]>, window_ms: u32) {
        let leases = self.clone();
        METRICS.lease_returned(lease.granted() - lease.used());
        self.pending.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            // (A reserve: `rescore` means nothing to it.)
            leases.settle_now(lease, &key, window_ms, true).await;
            leases.pending.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// `settle` of a log lease of the key of `slot` (locked by the
    /// caller), counted in the slot's settles in flight until it is done.
    /// While a lease call for the key is in flight it is kept with the
    /// retired ones instead, and settled once the call is answered
    /// (`settle_due`): the room that call reads counts its units either
    /// way, and the new lease is told them.
    fn settle_in(self: &Arc<Self>, slot: &mut Slot, lease: QuotaLease, key: &[u8], window_ms: u32) {
        if lease.reserve.is_some() {
            return self.settle(lease, key.into(), window_ms);
        }
        if slot.refilling {
            slot.retired.push(lease);
            return;
        }
        METRICS.lease_returned(lease.granted() - lease.used());
        let rescore = lease.must_rescore(self.now_us(), slot.far_from_limit(&lease));
        if !rescore && lease.reserved_unused() == 0 {
            // Nothing to move and nothing to remove: Redis's record is
            // final (each unit at `t0 + life`, at or after its admission).
            return;
        }
        let (leases, fp, key) = (self.clone(), slot.fp, Box::<[u8]>::from(key));
        self.pending.fetch_add(1, Ordering::Relaxed);
        slot.settling += 1;
        tokio::spawn(async move {
            leases.settle_now(lease, &key, window_ms, rescore).await;
            // The slot is the key's until this is done (`take`).
            leases.slot(fp).settling -= 1;
            leases.lease_done.notify_waiters();
            leases.pending.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Settles the retired leases of `slot` that wait for nothing more:
    /// life over or no share out (kept while a lease call was in flight,
    /// `settle_in`), or all of them at shutdown.
    fn settle_due(self: &Arc<Self>, slot: &mut Slot, key: &[u8], window_ms: u32) {
        let (now, closing) = (self.now_us(), self.closing.is_cancelled());
        while let Some(at) = slot.retired.iter().position(|r| closing || r.kept_until_us(slot.far_from_limit(r)) <= now) {
            let done = slot.retired.remove(at);
            self.settle_in(slot, done, key, window_ms);
        }
    }

    /// Removes from Redis the unused units of the retired lease `at` of
    /// `slot` (locked by the caller), leaving every used unit's score as
    /// reserved (its settle re-scores them): the settle call with no unit
    /// re-scored. Any number of these and the settle may run in any order:
    /// each removes the units past the used ones it saw, and a give-back
    /// only lowers that count (its units leave from the end, `take_back`).
    fn trim_in(self: &Arc<Self>, slot: &mut Slot, at: usize, key: &[u8], window_ms: u32) {
        let lease = &mut slot.retired[at];
        let (seq, granted, used) = (lease.seq(), lease.granted(), lease.used());
        lease.reserved = used;
        let (leases, fp, key) = (self.clone(), slot.fp, Box::<[u8]>::from(key));
        self.pending.fetch_add(1, Ordering::Relaxed);
        slot.settling += 1;
        tokio::spawn(async move {
            if let Err(e) = leases.redis.settle_lease(&key, window_ms, seq, granted, &vec![0; used as usize]).await {
                if let Some(suppressed) = leases.settle_log.permit() {
                    tracing::warn!(error = %e, suppressed, "giving back a worker share's units failed: they count until the lease's settle");
                }
            }
            leases.slot(fp).settling -= 1;
            leases.lease_done.notify_waiters();
            leases.pending.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Settles `lease`; a log lease's used units re-scored to their times
    /// only if `rescore` (`QuotaLease::must_rescore`), else left at the
    /// score they were reserved with (an argument 0 each).
    async fn settle_now(&self, lease: QuotaLease, key: &[u8], window_ms: u32, rescore: bool) {
        if let Some((algorithm, handle)) = lease.reserve {
            let spec = LimitSpec { key, limit: lease.limit, window_ms, cost: lease.used() };
            if let Err(e) = self.redis.settle_reserve(&spec, algorithm, &handle).await {
                if let Some(suppressed) = self.settle_log.permit() {
                    tracing::warn!(error = %e, suppressed, "settling a quota lease failed: its unused units count until their window ends");
                }
            }
            return;
        }
        let scores: Vec<u64> = if rescore { lease.used_scores().collect() } else { vec![0; lease.used() as usize] };
        if let Err(e) = self.redis.settle_lease(key, window_ms, lease.seq(), lease.granted(), &scores).await {
            if let Some(suppressed) = self.settle_log.permit() {
                tracing::warn!(error = %e, suppressed, "settling a quota lease failed: its unused units count until they leave the window");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_admits_its_units_within_its_life_and_times_them_from_the_send() {
        let mut l = QuotaLease::new(7, 100, 1_000_000, 5_000, 250, 4, 40);
        assert_eq!(l.admit(5_000, 100, 1).map(|v| v.remaining), Some(43));
        assert!(l.admit(6_000, 99, 1).is_none(), "another limit");
        assert_eq!(l.admit(6_001, 100, 2).map(|v| v.remaining), Some(41));
        assert!(l.admit(7_000, 100, 2).is_none(), "one unit left");
        assert!(l.admit(254_752, 100, 1).is_none(), "expired: 249.752 ms after the send, 250.001 with the 1000 ppm margin");
        assert_eq!(l.admit(254_751, 100, 1).map(|v| v.remaining), Some(40));
        assert!(l.admit(254_751, 100, 1).is_none(), "spent");
        // Rounded up to whole ms after t0.
        assert_eq!(l.used_scores().collect::<Vec<_>>(), [1_000_000, 1_000_002, 1_000_002, 0], "the last is at t0 + life, as reserved: unchanged (0)");
    }

    #[test]
    fn a_share_takes_the_units_asked_for_scores_them_at_its_deadline_and_ends_before_the_daemon_may_not_admit() {
        // Sent at 5 ms local, life 250 ms: the daemon admits until
        // 5 ms + 249.750 ms (the 1000 ppm margin).
        let mut l = QuotaLease::new(7, 100, 1_000_000, 5_000, 250, 20, 40);
        assert!(l.share(6_000, 99, 8, 1, 250).is_none(), "another limit: an override changed it");
        assert_eq!(l.share(6_000, 100, 8, 4, 250), Some(WorkerShare { units: 8, valid_ms: 247, remaining: 52 }));
        assert!(l.share(6_000, 100, 100, 50, 250).is_none(), "12 left, at least 50 asked");
        // Valid for 30 ms from 1 ms after the send: scored at 1.001 x 31 ms, rounded up.
        assert_eq!(l.share(6_000, 100, 6, 1, 30).map(|s| (s.units, s.valid_ms)), Some((6, 30)));
        // 200 ms after the send: valid for 254.750 - 200 - 1 ms, whole ms.
        assert_eq!(l.share(205_000, 100, 3, 1, 250).map(|s| (s.units, s.valid_ms)), Some((3, 48)));
        assert!(l.share(250_000, 100, 1, 1, 250).is_none(), "under 5 ms of validity left");
        assert!(l.share(6_000, 100, 1, 1, 4).is_none(), "under 5 ms of validity asked");
        // Within the last quarter of the limit (room outside plus units
        // left below 25 of 100): the daemon admits, no worker shares.
        assert!(QuotaLease::new(1, 100, 0, 5_000, 250, 10, 14).share(6_000, 100, 4, 1, 250).is_none());
        assert!(QuotaLease::new(1, 100, 0, 5_000, 250, 10, 15).share(6_000, 100, 4, 1, 250).is_some());
        assert_eq!(l.used(), 17);
        assert_eq!(l.admit(250_000, 100, 1).map(|v| v.remaining), Some(42), "the daemon admits from what is left");
        let scores: Vec<u64> = l.used_scores().collect();
        // The first share ends at 6 + 247 = 253 ms local, 248 ms after the
        // send: 248.248 ms, 249 after t0; the second at 36 ms local: 31.031,
        // 32; the third at 205 + 48 ms: 249 again; the daemon's own
        // admission at 250 ms local, 245.245: 246.
        assert_eq!(&scores[..8], &[1_000_249; 8]);
        assert_eq!(&scores[8..14], &[1_000_032; 6]);
        assert_eq!(&scores[14..], &[1_000_249, 1_000_249, 1_000_249, 1_000_246]);
        // The worker's last admission (before send + valid_ms, send at or
        // before the daemon's now) is at most the score of its units, which
        // is at most t0 + life.
        for now_us in [5_000u64, 100_000, 200_000, 240_000, 249_000] {
            for max_valid in [5, 20, 100, 250] {
                let mut l = QuotaLease::new(1, 100, 0, 5_000, 250, 200, 0);
                if let Some(s) = l.share(now_us, 100, 1, 1, max_valid) {
                    assert!(s.valid_ms <= max_valid);
                    let worker_last_us = now_us + u64::from(s.valid_ms) * 1000;
                    let elapsed = worker_last_us - 5_000;
                    let true_ms = (elapsed + elapsed / 1000).div_ceil(1000);
                    let score = l.used_scores().next().map(|s| if s == 0 { 250 } else { s }).unwrap();
                    assert!(true_ms <= score && score <= 250, "a worker admission at {worker_last_us} µs (t0 + {true_ms} ms) is scored {score}");
                }
            }
        }
    }

    #[test]
    fn a_spent_lease_is_kept_until_its_life_ends_and_re_scored_only_before_then_or_near_the_limit() {
        // Sent at 5 ms local, life 250 ms: it admits until 255 ms.
        let mut l = QuotaLease::new(7, 100, 1_000_000, 5_000, 250, 4, 40);
        assert!(l.admit(6_000, 100, 3).is_some());
        assert_eq!(l.kept_until_us(true), 0, "a unit left to remove: settled at once");
        assert!(l.admit(7_000, 100, 1).is_some());
        assert_eq!(l.kept_until_us(true), 255_000, "spent, far from the limit: kept until its life is over");
        assert_eq!(l.kept_until_us(false), 0, "spent, near the limit: settled at once, re-scored");
        assert!(l.must_rescore(254_999, true), "before its life ends, however far from the limit");
        assert!(!l.must_rescore(255_000, true), "after, far from the limit: units stay at t0 + life");
        assert!(l.must_rescore(255_000, false), "after, near the limit");
        // With a worker share out: until its give-backs are due, if later.
        let mut s = QuotaLease::new(8, 100, 1_000_000, 5_000, 250, 4, 40);
        assert_eq!(s.share(6_000, 100, 4, 1, 30).map(|w| w.units), Some(4));
        assert_eq!(s.kept_until_us(true), 255_000.max(6_000 + 30_000 + GIVE_BACK_GRACE_US));
        assert_eq!(s.take_back(2), 2);
        assert_eq!(s.kept_until_us(true), 6_000 + 30_000 + GIVE_BACK_GRACE_US, "units to remove: only the give-backs keep it");
        // A reserve is given back at once.
        let mut r = QuotaLease::reserved(1, Algorithm::Fixed, [7; 16], 100, 5_000, 200, 2, 40);
        assert!(r.admit(6_000, 100, 2).is_some());
        assert_eq!(r.kept_until_us(true), 0);
    }

    #[test]
    fn units_a_worker_gives_back_are_the_lease_s_again_and_only_its_shares_units() {
        let mut l = QuotaLease::new(7, 100, 1_000_000, 5_000, 250, 20, 40);
        // A share of 8 (scored at its deadline, 32 ms after t0), then the
        // daemon's own admission 2 ms after the send (3 ms after t0).
        assert_eq!(l.share(6_000, 100, 8, 1, 30).map(|s| s.units), Some(8));
        assert_eq!(l.admit(7_000, 100, 1).map(|v| v.remaining), Some(40 + 20 - 9));
        assert_eq!((l.used(), l.shared_out()), (9, 8));
        assert_eq!(l.take_back(5), 5);
        assert_eq!((l.used(), l.shared_out(), l.remaining()), (4, 3, 40 + 16), "the units given back are the lease's again");
        assert_eq!(l.take_back(10), 3, "no more than its shares hold: the daemon's own admission stays");
        assert_eq!(l.used_scores().collect::<Vec<_>>(), [1_000_003]);
        // The daemon admits from them, and a later share may hand them out again.
        assert_eq!(l.admit(8_000, 100, 19).map(|v| v.remaining), Some(40));
        assert!(l.share(8_000, 100, 1, 1, 30).is_none(), "spent");
        assert_eq!(l.take_back(1), 0);
    }

    #[test]
    fn a_reset_forgets_the_admissions_and_shares_before_it_and_no_later_one() {
        // t0 = 1,000,000 ms, sent at 5 ms local, life 250 ms, 20 units.
        let mut l = QuotaLease::new(7, 100, 1_000_000, 5_000, 250, 20, 40);
        // Own admissions at 1, 3 and 10 ms after the send (offsets 1, 3, 11
        // with the margin), a share valid 20 ms from 2 ms after the send
        // (deadline offset 23), a share valid 100 ms (offset 103).
        for now in [6_000, 8_000] {
            assert!(l.admit(now, 100, 1).is_some());
        }
        assert_eq!(l.share(7_000, 100, 4, 1, 20).map(|s| s.units), Some(4));
        assert!(l.admit(15_000, 100, 1).is_some());
        assert_eq!(l.share(7_000, 100, 5, 1, 100).map(|s| s.units), Some(5));
        assert_eq!(l.used(), 12);
        // A reset at t0 + 11: offsets 1 and 3 were before it; 11 may not
        // have been (t0 is up to 1 ms behind the script's start); the share
        // whose deadline is offset 23 neither.
        assert_eq!(l.forget_before(1_000_011), 2);
        assert_eq!((l.used(), l.shared_out(), l.remaining()), (10, 9, 40 + 10));
        // Again later, or twice: nothing after the reset is forgotten.
        assert_eq!(l.forget_before(1_000_011), 0);
        assert!(l.admit(30_000, 100, 1).is_some(), "offset 26, after the reset");
        // A reset at t0 + 24: the own admission at 11 and the 4 units of the
        // share that ended at 23 (forgotten: a give-back of them finds no
        // unit to free); the one at 26 and the share ending at 103 stay.
        assert_eq!(l.forget_before(1_000_024), 5);
        assert_eq!((l.used(), l.shared_out()), (6, 9), "the forgotten share waits for its give-back");
        assert_eq!(l.take_back(3), 3, "taken from the forgotten share, the earliest");
        assert_eq!((l.used(), l.shared_out()), (6, 6), "no unit of a live share freed");
        assert_eq!(l.take_back(3), 3);
        assert_eq!((l.used(), l.shared_out()), (4, 3), "the forgotten share's last unit, then two of the live share's");
        let scores: Vec<u64> = l.used_scores().collect();
        assert_eq!(scores.iter().filter(|&&s| s == 1_000_103).count(), 3, "{scores:?}");
        assert!(scores.contains(&1_000_026));
        // A reset at or after t0 + life removed every member of the lease:
        // it admits, shares and settles nothing more.
        assert_eq!(l.forget_before(1_000_250), 4);
        assert!(l.admit(30_000, 100, 1).is_none());
        assert!(l.share(30_000, 100, 1, 1, 100).is_none());
        assert_eq!((l.used(), l.granted(), l.used_scores().count()), (0, 0, 0));
        // A reserved lease carries no Redis time: nothing forgotten.
        let mut r = QuotaLease::reserved(1, Algorithm::Fixed, [7; 16], 100, 5_000, 398, 20, 40);
        assert!(r.admit(6_000, 100, 1).is_some());
        assert_eq!(r.forget_before(u64::MAX), 0);
    }

    #[test]
    fn a_give_back_takes_the_earliest_scored_share_s_units_first() {
        let mut l = QuotaLease::new(7, 100, 1_000_000, 5_000, 250, 40, 40);
        // A share valid 30 ms (scored 32 ms after t0), then one valid 10 ms
        // handed out later but scored earlier (13 ms after t0).
        assert_eq!(l.share(6_000, 100, 8, 1, 30).map(|s| s.units), Some(8));
        assert_eq!(l.share(7_000, 100, 4, 1, 10).map(|s| s.units), Some(4));
        assert_eq!(l.take_back(6), 6);
        // The 4 scored at 13 ms and 2 of the 8 scored at 32 ms went back:
        // what stays scored is as late as any choice could leave it.
        assert_eq!(l.used_scores().collect::<Vec<_>>(), [1_000_032; 6]);
        assert_eq!((l.shared_out(), l.remaining()), (6, 40 + 34));
    }

    #[test]
    fn a_share_is_sized_and_timed_to_the_host_s_rate() {
        let life = 250;
        let mut slot = Slot::default();
        slot.count(0, life, 8);
        // 8 in the first 62.5 ms (a quarter of the life at least): 64 units
        // take 496 ms at that rate, three times that beyond the most (100):
        // as many as the host uses in 100 ms at a third of its rate, 5.
        assert_eq!(slot.share_size(10_000, life, 64, 60_000), (5, MAX_RATE_VALID_MS));
        slot.count(100_000, life, 1000);
        // 1008 in 100 ms: 64 units take 6 ms; three times that, 18: the floor.
        assert_eq!(slot.share_size(100_000, life, 64, 60_000), (64, MIN_RATE_VALID_MS));
        assert_eq!(slot.share_size(100_000, life, 1, 60_000), (1, MIN_RATE_VALID_MS), "never more than asked");
        // The next period: the last one's rate (1008 in 250 ms) until this one's is faster.
        slot.count(300_000, life, 1);
        assert_eq!(slot.share_size(300_000, life, 64, 60_000), (64, 45), "64 x 250 / 1008 = 15 ms, x 3");
        // Quiet for two periods: its rate is forgotten; 2 units at least.
        slot.count(900_000, life, 1);
        assert_eq!(slot.share_size(900_000, life, 64, 60_000), (2, MAX_RATE_VALID_MS));
    }

    #[test]
    fn a_reserved_lease_ends_before_its_fixed_window_and_is_never_shared() {
        // Fixed: the reserve's reset is the window's end; the sliding
        // counter's is one window later.
        assert_eq!(reserved_life_ms(Algorithm::Fixed, 1000, 400, 60_000), 398);
        assert_eq!(reserved_life_ms(Algorithm::Fixed, 1000, 30_000, 60_000), 1000);
        assert_eq!(reserved_life_ms(Algorithm::SlidingCounter, 1000, 60_400, 60_000), 398);
        assert_eq!(reserved_life_ms(Algorithm::Fixed, 1000, 2, 60_000), 0, "too near the end: nothing");
        assert!(leasable(Algorithm::Log) && leasable(Algorithm::Fixed) && leasable(Algorithm::SlidingCounter));
        assert!(!leasable(Algorithm::Gcra) && !leasable(Algorithm::Ring));
        let mut l = QuotaLease::reserved(1, Algorithm::Fixed, [7; 16], 100, 5_000, 398, 20, 40);
        assert!(l.share(6_000, 100, 8, 1, 250).is_none(), "worker shares come from log leases only");
        assert_eq!(l.admit(5_000 + 397_000, 100, 1).map(|v| v.remaining), Some(59));
        assert!(l.admit(5_000 + 399_000, 100, 1).is_none(), "past the cut life");
        assert_eq!(l.used(), 1);
    }

    #[test]
    fn lease_sizes_follow_the_rate_and_lives_the_window() {
        assert_eq!((units_wanted(0), units_wanted(8), units_wanted(10_000)), (2, 11, MAX_LEASE_UNITS));
        assert_eq!((lease_life_ms(39), lease_life_ms(1000), lease_life_ms(60_000)), (0, 250, 1000));
    }
}
