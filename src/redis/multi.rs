//! Several items all or nothing (docs/PROTOCOL.md 4b), and refunds (4c), in
//! Redis: the "m", "c" and "r" modes of the log's script
//! (src/redis/scripts/sliding_window.lua).
//!
//! On one Redis, or a Cluster when every key shares a slot, a check is one
//! atomic script call. On a Cluster with keys in several slots it is one
//! call per slot group, and a group that admits holds a *reservation*: its
//! members are written with a score that makes them leave the window
//! `RESERVATION_LIFE` after the call (unless the window is shorter), so a
//! reservation nobody confirms or takes back goes by itself, whatever
//! happened to the daemon. Every group is called at once, within one
//! deadline. When every group reserved, the request is answered admitted
//! and the reservations are confirmed (their members re-scored to the
//! call's time: a normal admission from then on). When a group refused
//! and none of ours held anything, the request is refused; when some
//! reserved, they are taken back (ZREM) and, requests over the same slots
//! having maybe refused each other, the groups are tried once more in one
//! global order, one after another by ascending slot, what is reserved
//! kept while the next is asked, a slot that refuses asked again up to 4
//! times, 1 to 8 ms apart (another request's first-round reservation may
//! be what refused it, its take-back on the way). Of requests crossing
//! each other one gets through (docs/PROTOCOL.md 4b, "Crossing
//! requests", has the proof). When a call failed, the
//! request gets the error and the groups that reserved, or may have, are
//! taken back. The work runs in a task of its own that the request only
//! awaits: a request dropped half-way (a client gone, a connection closed
//! by the daemon) does not stop it, and the daemon waits for these tasks
//! before it exits (`settle`). Confirmations and take-backs that fail are
//! tried again until the reservation's life is over (then there is nothing
//! left to do: it is gone, or, for a confirmation, the admission counted
//! for that life only).
//!
//! Whatever removes members (a take-back, a refund) bumps the generation of
//! the windows it touched in the denial cache, before and after, so no
//! refusal that depended on them is answered again from the cache.
//!
//! Members are named by a 16-byte nonce drawn from a CSPRNG per check (32
//! hex digits), then `.<item>` and `:<unit>`: the refund handle is the
//! nonce itself, so a handle names only the members of the admission it was
//! issued for, survives a restart, and cannot be guessed from another. A
//! single check's or a coalesced batch's members (`<instance>:<seq>`, see
//! `window`) can never match a handle.

use std::io::Write;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use redis::{RedisWrite, ToRedisArgs};
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use super::link::RedisLink;
use super::keys::{key_slot, verdict, WindowKey};
use crate::denial_cache::DenialCache;
use crate::log_limit::RateLimitedLog;
use crate::metrics::METRICS;
use crate::protocol::Algorithm;
use crate::window::{LimitSpec, StoreError, Verdict};

/// How long an unconfirmed reservation counts: long enough for the
/// confirmation to be retried through a short outage, short enough that a
/// reservation nobody could take back frees its window soon.
pub const RESERVATION_LIFE: Duration = Duration::from_secs(2);

/// Pause between tries of a confirmation or take-back that failed.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// In the ordered try: how many more times a slot that refused is asked
/// again, and the first pause (doubled each time: 1 + 2 + 4 + 8 = 15 ms
/// in all, the `W` of docs/PROTOCOL.md 4b), within the request's deadline.
const ORDERED_RETRIES: usize = 4;
const ORDERED_FIRST_PAUSE: Duration = Duration::from_millis(1);

/// One item of an all-or-nothing call (`check_multi`).
#[derive(Clone, Copy, Debug, Default)]
pub struct MultiAsk<'a> {
    /// The client key (a policy's scoped key), before the prefix.
    pub key: &'a [u8],
    pub window_ms: u32,
    pub limit: u32,
    pub cost: u32,
    /// A shadow policy's item: recorded when it fits, never refuses.
    pub shadow: bool,
    /// The item's number in its request, 1-based: names its members.
    pub number: u8,
}

impl<'a> MultiAsk<'a> {
    /// The item as one window's limit.
    pub fn spec(&self) -> LimitSpec<'a> {
        LimitSpec { key: self.key, limit: self.limit, window_ms: self.window_ms, cost: self.cost }
    }
}

/// The answer of `check_multi`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MultiAnswer {
    /// Every fitting item was recorded (no non-shadow item refused).
    pub committed: bool,
    /// Per item, in order: `allowed` = the item fitted; count and remaining
    /// as the window stands without this request when it was not
    /// committed (the same on one Redis and a Cluster). `None`: no answer
    /// for that item (its slot's call failed after another slot refused).
    pub verdicts: Vec<Option<Verdict>>,
    /// Names the members written: the refund handle.
    pub handle: [u8; 16],
}

/// One item of a refund.
#[derive(Clone, Copy, Debug, Default)]
pub struct RefundItem<'a> {
    pub key: &'a [u8],
    pub window_ms: u32,
    pub cost: u32,
    pub number: u8,
}

/// What a refund took back: all of it when `failure` is none; else what
/// the slots that answered removed, and why the others did not answer.
#[derive(Clone, Debug, Default)]
pub struct RefundOutcome {
    pub removed: u64,
    pub failure: Option<StoreError>,
}

/// The members' common name: the check's nonce, as 32 hex digits.
#[derive(Clone, Copy, Debug)]
struct Base([u8; 16]);

impl ToRedisArgs for Base {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut w = out.writer_for_next_arg();
        for b in self.0 {
            let _ = write!(w, "{b:02x}");
        }
    }
}

/// What the "m" mode does with the items when every enforced one fits.
#[derive(Clone, Copy, Debug)]
enum Hold {
    /// Record them (one atomic call decides the request).
    Commit,
    /// Reserve them for `RESERVATION_LIFE` (one slot of several).
    Reserve,
}

/// An item, owned by the task that decides across slots.
#[derive(Clone, Debug)]
struct Item {
    /// The client key: the denial cache's name of the window.
    key: Vec<u8>,
    /// The window's Redis key.
    redis_key: Vec<u8>,
    window_ms: u32,
    limit: u32,
    cost: u32,
    shadow: bool,
    number: u8,
}

/// What a request waiting on a decision across slots gets.
type Answer = Result<(bool, Vec<Option<Verdict>>), StoreError>;

/// The outcome of reserving some slot groups at once.
#[derive(Default)]
struct Round<'g> {
    /// Reserved, with the slot's time of the call.
    held: Vec<(&'g Vec<usize>, i64)>,
    /// The call failed: reserved or not.
    unsure: Vec<&'g Vec<usize>>,
    refused: Vec<&'g Vec<usize>>,
    failure: Option<StoreError>,
}

impl<'g> Round<'g> {
    fn complete(&self) -> bool {
        self.refused.is_empty() && self.failure.is_none()
    }

    fn to_take_back(&self) -> Vec<&'g Vec<usize>> {
        self.held.iter().map(|(g, _)| *g).chain(self.unsure.iter().copied()).collect()
    }
}

/// One slot group's answer.
struct GroupAnswer {
    committed: bool,
    /// The slot's Redis time of the call: the members' score once confirmed.
    now_ms: i64,
    verdicts: Vec<Verdict>,
}

/// What the multi-item calls share with the tasks they outlive.
pub struct Reservations {
    link: Arc<RedisLink>,
    prefix: Box<[u8]>,
    /// Told of every removal; set once at start (`RedisWindow::set_denial_cache`).
    pub(super) denials: OnceLock<Arc<DenialCache>>,
    /// The tasks deciding across slots, confirming and taking back.
    tasks: TaskTracker,
    /// Confirmations or take-backs given up, logged at most once per interval.
    lost_log: RateLimitedLog,
    failed_log: RateLimitedLog,
}

impl Reservations {
    pub(super) fn new(link: Arc<RedisLink>, prefix: &[u8]) -> Self {
        Self {
            link,
            prefix: prefix.into(),
            denials: OnceLock::new(),
            tasks: TaskTracker::new(),
            lost_log: RateLimitedLog::new(Duration::from_secs(10)),
            failed_log: RateLimitedLog::new(Duration::from_secs(10)),
        }
    }

    fn item(&self, key: &[u8], window_ms: u32, limit: u32, cost: u32, shadow: bool, number: u8) -> Item {
        let redis_key = WindowKey { prefix: &self.prefix, key, window_ms, algorithm: Algorithm::Log }.to_vec();
        Item { key: key.to_vec(), redis_key, window_ms, limit, cost, shadow, number }
    }

    /// Decides `asks` all or nothing (see the module doc); `cluster`: group
    /// them by slot. `handle`: the members' name, `None` for a fresh one
    /// (`Some`: an admission's own, whose refund must take these back too).
    pub(super) async fn check(self: &Arc<Self>, asks: &[MultiAsk<'_>], cluster: bool, now_ms: u64, handle: Option<[u8; 16]>) -> Result<MultiAnswer, StoreError> {
        let handle: [u8; 16] = handle.unwrap_or_else(rand::random);
        let deadline = Instant::now() + self.link.timeout();
        let items: Vec<Item> = asks.iter().map(|a| self.item(a.key, a.window_ms, a.limit, a.cost, a.shadow, a.number)).collect();
        let groups = if cluster { slot_groups(&items) } else { vec![(0..items.len()).collect()] };
        if groups.len() <= 1 {
            let all: Vec<&Item> = items.iter().collect();
            let a = self.multi_call(&all, Base(handle), now_ms, Hold::Commit, deadline).await?;
            return Ok(MultiAnswer { committed: a.committed, verdicts: a.verdicts.into_iter().map(Some).collect(), handle });
        }
        let (tx, rx) = oneshot::channel();
        let this = self.clone();
        self.tasks.spawn(async move { this.decide_across_slots(items, groups, Base(handle), now_ms, deadline, tx).await });
        match rx.await {
            Ok(answer) => answer.map(|(committed, verdicts)| MultiAnswer { committed, verdicts, handle }),
            Err(_) => Err(StoreError::Unavailable("the multi-item check's task ended without an answer".into())),
        }
    }

    /// Reserves every slot group at once; when some reserved and another
    /// refused, takes them back and tries once more in the global order
    /// (one group after another by ascending slot). Answers on `tx`,
    /// then confirms or takes back.
    async fn decide_across_slots(self: Arc<Self>, items: Vec<Item>, groups: Vec<Vec<usize>>, base: Base, now_ms: u64, deadline: Instant, tx: oneshot::Sender<Answer>) {
        let started = Instant::now();
        let mut verdicts: Vec<Option<Verdict>> = vec![None; items.len()];
        let all: Vec<&Vec<usize>> = groups.iter().collect();
        let round = self.reserve(&items, &all, base, now_ms, deadline, &mut verdicts).await;
        if round.complete() {
            return self.admit(&items, &round.held, verdicts, base, started, tx).await;
        }
        if round.refused.is_empty() {
            let back = round.to_take_back();
            let _ = tx.send(Err(round.failure.expect("a failure")));
            let pending = self.take_back_once(&items, &back, base).await;
            return self.take_back_rest(&items, pending, base, started).await;
        }
        let held = !round.held.is_empty();
        let pending = self.take_back_once(&items, &round.to_take_back(), base).await;
        if !held || !pending.is_empty() || Instant::now() >= deadline {
            // Nothing of ours stood in another request's way (or it still
            // may): the refusal stands.
            let _ = tx.send(Ok((false, verdicts)));
            return self.take_back_rest(&items, pending, base, started).await;
        }
        // Some slots reserved and another refused: requests over the same
        // slots may have refused each other. The ordered try: one group
        // after another in ascending slot order, each kept while the next
        // is asked, a refusing one asked again a few times (a first-round
        // reservation of another request, its take-back on the way, may be
        // what refused it). Of crossing requests one gets through (the
        // proof is in docs/PROTOCOL.md 4b, "Crossing requests").
        let mut held: Vec<(&Vec<usize>, i64)> = Vec::with_capacity(all.len());
        for group in &all {
            let mut pause = ORDERED_FIRST_PAUSE;
            let mut retries = 0;
            loop {
                let round = self.reserve(&items, std::slice::from_ref(group), base, now_ms, deadline, &mut verdicts).await;
                held.extend(round.held.iter().copied());
                if round.complete() {
                    break;
                }
                if round.failure.is_some() || retries == ORDERED_RETRIES || Instant::now() + pause >= deadline {
                    let back: Vec<&Vec<usize>> = held.iter().map(|(g, _)| *g).chain(round.unsure.iter().copied()).collect();
                    let pending = self.take_back_once(&items, &back, base).await;
                    let _ = tx.send(Ok((false, verdicts)));
                    return self.take_back_rest(&items, pending, base, started).await;
                }
                retries += 1;
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
        }
        self.admit(&items, &held, verdicts, base, started, tx).await
    }

    /// One round: reserves `groups` at once within `deadline`, filling
    /// `verdicts` with their numbers.
    async fn reserve<'g>(&self, items: &[Item], groups: &[&'g Vec<usize>], base: Base, now_ms: u64, deadline: Instant, verdicts: &mut [Option<Verdict>]) -> Round<'g> {
        let calls = groups.iter().map(|g| self.multi_call_unless_late(g.iter().map(|&i| &items[i]).collect(), base, now_ms, Hold::Reserve, deadline));
        let mut round = Round::default();
        for (g, r) in groups.iter().zip(join_all(calls).await) {
            match r {
                Ok(a) => {
                    for (&i, v) in g.iter().zip(&a.verdicts) {
                        verdicts[i] = Some(*v);
                    }
                    if a.committed {
                        round.held.push((g, a.now_ms));
                    } else {
                        round.refused.push(g);
                    }
                }
                Err(e) => {
                    round.unsure.push(g);
                    round.failure.get_or_insert(e);
                }
            }
        }
        round
    }

    /// Every slot reserved: answers admitted (each fitting item reported
    /// as recorded), then confirms.
    async fn admit(&self, items: &[Item], held: &[(&Vec<usize>, i64)], mut verdicts: Vec<Option<Verdict>>, base: Base, started: Instant, tx: oneshot::Sender<Answer>) {
        for (v, it) in verdicts.iter_mut().zip(items) {
            if let Some(v) = v.as_mut().filter(|v| v.allowed) {
                v.count = v.count.saturating_add(it.cost);
                v.remaining = it.limit.saturating_sub(v.count);
                v.retry_after_ms = 0;
                v.reset_ms = it.window_ms;
            }
        }
        let _ = tx.send(Ok((true, verdicts)));
        self.confirm(items, held, base, started).await;
    }

    /// Confirms the reserved groups (`held`: each with its slot's time),
    /// trying a failed one again until its reservation is over.
    async fn confirm(&self, items: &[Item], held: &[(&Vec<usize>, i64)], base: Base, started: Instant) {
        let mut pending: Vec<(&Vec<usize>, i64)> = held.to_vec();
        loop {
            let deadline = Instant::now() + self.link.timeout();
            let results = join_all(pending.iter().map(|(g, now)| self.confirm_call(g.iter().map(|&i| &items[i]).collect(), base, *now, deadline))).await;
            let mut last = None;
            pending = pending.into_iter().zip(results).filter_map(|(p, r)| r.map_err(|e| last = Some(e)).err().map(|()| p)).collect();
            if pending.is_empty() {
                return;
            }
            if started.elapsed() + RETRY_PAUSE >= RESERVATION_LIFE {
                if let Some(suppressed) = self.lost_log.permit() {
                    let error = last.map(|e| e.to_string()).unwrap_or_default();
                    tracing::warn!(%error, slots = pending.len(), suppressed, "could not confirm an admitted multi-item check's reservation in time: on those slots it counted for its reservation's life only");
                }
                return;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }

    /// Takes back the reservations of `groups` (one try each, at once),
    /// telling the denial cache before and after; returns the groups whose
    /// call failed.
    async fn take_back_once<'g>(&self, items: &[Item], groups: &[&'g Vec<usize>], base: Base) -> Vec<&'g Vec<usize>> {
        self.forget(items, groups);
        let deadline = Instant::now() + self.link.timeout();
        let results = join_all(groups.iter().map(|g| self.refund_call(g.iter().map(|&i| &items[i]).collect(), base, deadline))).await;
        self.forget(items, groups);
        groups.iter().zip(results).filter(|(_, r)| r.is_err()).map(|(g, _)| *g).collect()
    }

    /// Tries the take-back of `pending` again until the reservations' life
    /// is over (then they are gone by themselves).
    async fn take_back_rest(&self, items: &[Item], mut pending: Vec<&Vec<usize>>, base: Base, started: Instant) {
        while !pending.is_empty() {
            if started.elapsed() + RETRY_PAUSE >= RESERVATION_LIFE {
                if let Some(suppressed) = self.failed_log.permit() {
                    tracing::warn!(slots = pending.len(), suppressed, "could not take back a refused or failed multi-item check's reservations: they leave their windows by themselves, at most 2 s after the check");
                }
                return;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
            pending = self.take_back_once(items, &pending, base).await;
        }
    }

    /// Forgets the windows of `groups` in the denial cache.
    fn forget(&self, items: &[Item], groups: &[&Vec<usize>]) {
        if let Some(d) = self.denials.get() {
            for g in groups {
                for &i in g.iter() {
                    d.forget_window(&items[i].key, items[i].window_ms);
                }
            }
        }
    }

    async fn multi_call_unless_late(&self, items: Vec<&Item>, base: Base, now_ms: u64, hold: Hold, deadline: Instant) -> Result<GroupAnswer, StoreError> {
        if Instant::now() >= deadline {
            return Err(StoreError::Timeout(self.link.timeout()));
        }
        self.multi_call(&items, base, now_ms, hold, deadline).await
    }

    /// One "m" call: the items of one slot.
    async fn multi_call(&self, items: &[&Item], base: Base, now_ms: u64, hold: Hold, deadline: Instant) -> Result<GroupAnswer, StoreError> {
        let mut cmd = redis::Cmd::with_capacity(7 + 6 * items.len(), 96 + items.iter().map(|a| a.redis_key.len() + 48).sum::<usize>());
        cmd.arg("EVALSHA").arg(self.link.script_sha(Algorithm::Log.index())).arg(items.len());
        for a in items {
            cmd.arg(&a.redis_key[..]);
        }
        cmd.arg("m").arg(now_ms).arg(base);
        match hold {
            Hold::Commit => cmd.arg(0),
            Hold::Reserve => cmd.arg(RESERVATION_LIFE.as_millis() as u64),
        };
        for a in items {
            cmd.arg(a.window_ms).arg(a.limit).arg(a.cost).arg(u8::from(a.shadow)).arg(a.number);
        }
        let flat: Vec<i64> = self.link.eval_by(&cmd, deadline).await?;
        if flat.len() != 2 + 5 * items.len() {
            return Err(StoreError::Redis(format!("the script answered {} values for {} items", flat.len(), items.len())));
        }
        Ok(GroupAnswer { committed: flat[0] == 1, now_ms: flat[1], verdicts: flat[2..].chunks_exact(5).map(|v| verdict(v[0], v[1], v[2], v[3], v[4])).collect() })
    }

    /// One "c" call: the slot's reserved members become admissions at `now_ms`.
    async fn confirm_call(&self, items: Vec<&Item>, base: Base, now_ms: i64, deadline: Instant) -> Result<(), StoreError> {
        let mut cmd = redis::Cmd::new();
        cmd.arg("EVALSHA").arg(self.link.script_sha(Algorithm::Log.index())).arg(items.len());
        for a in &items {
            cmd.arg(&a.redis_key[..]);
        }
        cmd.arg("c").arg(base).arg(now_ms);
        for a in &items {
            cmd.arg(a.cost).arg(a.number);
        }
        let _: i64 = self.link.eval_by(&cmd, deadline).await?;
        Ok(())
    }

    /// One "r" call: removes the members `base` names in the slot's keys.
    async fn refund_call(&self, items: Vec<&Item>, base: Base, deadline: Instant) -> Result<u64, StoreError> {
        let mut cmd = redis::Cmd::new();
        cmd.arg("EVALSHA").arg(self.link.script_sha(Algorithm::Log.index())).arg(items.len());
        for r in &items {
            cmd.arg(&r.redis_key[..]);
        }
        cmd.arg("r").arg(base);
        for r in &items {
            cmd.arg(r.cost).arg(r.number);
        }
        self.link.eval_by(&cmd, deadline).await
    }

    /// Takes back what a refundable check recorded: every slot group at
    /// once, within one deadline (see `RedisWindow::refund_outcome`).
    pub(super) async fn refund(&self, handle: &[u8; 16], items: &[RefundItem<'_>], cluster: bool) -> RefundOutcome {
        let deadline = Instant::now() + self.link.timeout();
        let items: Vec<Item> = items.iter().map(|r| self.item(r.key, r.window_ms, 0, r.cost, false, r.number)).collect();
        let groups = if cluster { slot_groups(&items) } else { vec![(0..items.len()).collect()] };
        let results = join_all(groups.iter().map(|g| self.refund_call(g.iter().map(|&i| &items[i]).collect(), Base(*handle), deadline))).await;
        let mut outcome = RefundOutcome::default();
        for r in results {
            match r {
                Ok(n) => outcome.removed += n,
                Err(e) => {
                    outcome.failure.get_or_insert(e);
                }
            }
        }
        // Every window, answered or not: a call cut by its deadline may
        // have removed its members all the same.
        if let Some(d) = self.denials.get() {
            for it in &items {
                d.forget_window(&it.key, it.window_ms);
            }
        }
        if outcome.removed == 0 && outcome.failure.is_none() {
            // Forged, replayed, foreign, or out of the window already.
            METRICS.refund_unmatched();
        }
        outcome
    }

    /// Waits up to `limit` for the tasks deciding, confirming and taking
    /// back (at shutdown: no reservation is left to expire on its own
    /// unless Redis could not be reached).
    pub(super) async fn settle(&self, limit: Duration) -> bool {
        self.tasks.close();
        tokio::time::timeout(limit, self.tasks.wait()).await.is_ok()
    }
}

/// The items' indices by Cluster slot, groups in ascending slot order (one
/// global order: two requests over the same slots take them alike).
fn slot_groups(items: &[Item]) -> Vec<Vec<usize>> {
    let mut slots: Vec<(u16, usize)> = items.iter().enumerate().map(|(i, a)| (key_slot(&a.redis_key), i)).collect();
    slots.sort_unstable();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut last = None;
    for (slot, i) in slots {
        if last == Some(slot) {
            groups.last_mut().expect("a group").push(i);
        } else {
            groups.push(vec![i]);
            last = Some(slot);
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_is_the_handle_in_hex() {
        let mut out = Vec::new();
        Base([0xab; 16]).write_redis_args(&mut out);
        assert_eq!(out, vec![b"abababababababababababababababab".to_vec()]);
    }

    #[test]
    fn slot_groups_come_in_ascending_slot_order_whatever_the_item_order() {
        let item = |k: &str| Item { key: k.into(), redis_key: format!("rl:{{{k}}}:1000ms").into_bytes(), window_ms: 1000, limit: 1, cost: 1, shadow: false, number: 1 };
        let a = [item("a"), item("b"), item("c"), item("a")];
        let b = [item("c"), item("a"), item("b")];
        let slots = |items: &[Item], groups: Vec<Vec<usize>>| -> Vec<u16> { groups.iter().map(|g| key_slot(&items[g[0]].redis_key)).collect() };
        let (sa, sb) = (slots(&a, slot_groups(&a)), slots(&b, slot_groups(&b)));
        assert_eq!(sa, sb);
        assert!(sa.windows(2).all(|w| w[0] < w[1]));
        assert!(slot_groups(&a).iter().any(|g| g == &vec![0, 3]), "one slot, one group");
    }
}
