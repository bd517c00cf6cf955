//! The one store interface the decision pipeline asks, as
//! envoyproxy/ratelimit hides Redis and memcached behind
//! `RateLimitCache.DoLimit`: check, check several all or nothing, check
//! with a penalty box, acquire and release a concurrency lease, refund,
//! reserve and settle (docs/PROTOCOL.md 4f);
//! with one Redis (or Sentinel), a Redis Cluster or the per-host windows
//! behind it. This is the only place that knows which: `decision` never
//! matches on it. A store answers or says why it could not (`NoVerdict`);
//! what a request gets then is its fail policy's business, not the store's.
//!
//! The caches in front of it (quota leases, the denial cache, the ban
//! cache) are layers of the pipeline (`decision::layers`); the store tells
//! them of every removal it makes (refunds, settles, leases given back:
//! `RedisWindow::set_denial_cache`), and the admin API of the resets it
//! makes (`Limiter::window_reset`).

use std::sync::Arc;

use futures_util::future::join_all;

use crate::config::Penalty;
use crate::local_store::{LocalStore, LocalStoreFull};
use crate::penalty_box::{BanTicket, BANS};
use crate::protocol::{Algorithm, Source};
use crate::redis::{MultiAsk, PenaltyState, RedisWindow, RefundItem, RefundOutcome};
use crate::settle_retry::{may_have_run, settle_later};
use crate::window::{LimitSpec, StoreError, Verdict};

/// Where decisions are recorded.
#[derive(Debug, Clone)]
pub enum Store {
    Redis(Arc<RedisWindow>),
    /// No Redis configured: the per-host windows decide; limits are per
    /// host. The same `LocalStore` the `local` fail policy falls back to.
    Memory(Arc<LocalStore>),
}

/// Why a store gave no verdict.
#[derive(Debug)]
pub enum NoVerdict {
    /// Redis failed: the fail policy decides.
    Store(StoreError),
    /// The in-memory windows are full.
    Full(LocalStoreFull),
}

/// A store's verdicts on the items of an all-or-nothing check.
#[derive(Debug)]
pub struct ManyVerdicts {
    /// Every fitting item was recorded (no non-shadow item refused).
    pub committed: bool,
    /// Per item, in order; `None`: no answer for that item (a Cluster
    /// slot's call failed after another slot refused).
    pub verdicts: Vec<Option<(Source, Verdict)>>,
    /// The members' name, to refund them (Redis only: the memory backend
    /// keeps no member ids).
    pub handle: Option<[u8; 16]>,
}

/// One item of a reserve (docs/PROTOCOL.md 4f): its estimate is `spec.cost`.
#[derive(Debug, Clone, Copy)]
pub struct ReserveAsk<'a> {
    pub spec: LimitSpec<'a>,
    pub algorithm: Algorithm,
    /// A shadow policy's item: reserved when it fits, never refuses.
    pub shadow: bool,
}

/// What a reserve did.
#[derive(Debug)]
pub struct Reserved {
    /// Every enforced item reserved (under the handle): the request is
    /// admitted. Else nothing is held.
    pub committed: bool,
    /// Per item, in order: its verdict; an item that had room in a refused
    /// request, its window as it stands without this request (its reserve
    /// cancelled, SEMANTICS S8). `None`: not asked.
    pub verdicts: Vec<Option<Verdict>>,
    /// The store failed: the fail policies decide (nothing is held; what a
    /// failed call may have charged is taken back in the background).
    pub failure: Option<StoreError>,
}

/// Refunds need member ids, which the memory backend does not keep.
#[derive(Debug, Clone, Copy)]
pub struct RefundUnsupported;

impl Store {
    /// Who a stored verdict comes from.
    #[inline]
    pub fn origin(&self) -> Source {
        match self {
            Self::Redis(_) => Source::Redis,
            Self::Memory(_) => Source::Memory,
        }
    }

    /// Who an answer from this daemon's memory of the store (a ban it
    /// knows) comes from: the cache of Redis's, or the memory backend.
    #[inline]
    pub fn cached_source(&self) -> Source {
        match self {
            Self::Redis(_) => Source::DenialCache,
            Self::Memory(_) => Source::Memory,
        }
    }

    /// One item's window: admitted and recorded, or refused.
    pub async fn check(&self, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Result<Verdict, NoVerdict> {
        match self {
            Self::Redis(r) => r.check(spec, algorithm).await.map_err(NoVerdict::Store),
            Self::Memory(m) => m.check(spec, algorithm).map_err(NoVerdict::Full),
        }
    }

    /// Several items (exact logs), all or nothing: every fitting item is
    /// recorded if no non-shadow item refused, else none; members named
    /// by `under` (an admission's handle) or a fresh handle.
    pub async fn check_many(&self, asks: &[MultiAsk<'_>], under: Option<&[u8; 16]>) -> Result<ManyVerdicts, NoVerdict> {
        match self {
            Self::Redis(r) => {
                let answer = match under {
                    Some(h) => r.check_multi_under(h, asks).await,
                    None => r.check_multi(asks).await,
                }
                .map_err(NoVerdict::Store)?;
                Ok(ManyVerdicts { committed: answer.committed, verdicts: answer.verdicts.into_iter().map(|v| v.map(|v| (Source::Redis, v))).collect(), handle: Some(answer.handle) })
            }
            Self::Memory(m) => {
                let specs: Vec<(LimitSpec<'_>, bool)> = asks.iter().map(|a| (a.spec(), a.shadow)).collect();
                let (committed, verdicts) = m.check_multi(&specs).map_err(NoVerdict::Full)?;
                Ok(ManyVerdicts { committed, verdicts: verdicts.into_iter().map(|v| Some((Source::Memory, v))).collect(), handle: None })
            }
        }
    }

    /// One item of a policy with a penalty box (an exact log): the window's
    /// verdict, and whether the key is banned (this refusal may have
    /// banned it; `engaged`). The memory store counts the strikes in the
    /// ban table (`sent`: when the request was taken); the caller writes
    /// the ban there, for both stores.
    pub async fn check_penalized(&self, spec: &LimitSpec<'_>, penalty: Penalty, sent: BanTicket) -> Result<(Verdict, PenaltyState), NoVerdict> {
        match self {
            Self::Redis(r) => r.check_penalized(spec, penalty.after, penalty.within_ms, penalty.ban_ms).await.map_err(NoVerdict::Store),
            Self::Memory(m) => {
                let v = m.check(spec, Algorithm::Log).map_err(NoVerdict::Full)?;
                if !v.allowed && BANS.strike(spec.key, sent.sent_ns, penalty.after, penalty.within_ms) {
                    // Banned from now: the caller writes the ban table, the
                    // memory store's only record of it (no Redis to outlive).
                    let state = PenaltyState { banned_ms: penalty.ban_ms.saturating_add(1), engaged: Some(0) };
                    return Ok((Verdict { remaining: 0, retry_after_ms: penalty.ban_ms, reset_ms: v.reset_ms.max(penalty.ban_ms), ..v }, state));
                }
                Ok((v, PenaltyState::default()))
            }
        }
    }

    /// Lists a ban `check_penalized` engaged, ending at `ends_at_ms`, in
    /// the admin API's index (Redis only: the memory store's bans are its
    /// ban table, which the API reads). One write per ban, in a task of its
    /// own, off the request path.
    pub fn note_ban(&self, scoped: &[u8], ends_at_ms: u64) {
        let Self::Redis(redis) = self else { return };
        let (redis, scoped) = (redis.clone(), scoped.to_vec());
        tokio::spawn(async move {
            let index = redis.penalty_index_key();
            if let Err(e) = redis.note_ban(&index, &scoped, ends_at_ms).await {
                tracing::debug!(error = %e, "could not add a ban to the admin index");
            }
        });
    }

    /// ACQUIRE (`acquire`) or RELEASE of concurrency lease `lease` on
    /// `key`. A release also frees the per-host lease the `local` fail
    /// policy may hold under the same id.
    pub async fn lease(&self, acquire: bool, key: &[u8], lease: &[u8], limit: u32, lease_ms: u32, cost: u32) -> Result<Verdict, NoVerdict> {
        match self {
            Self::Redis(r) => r.lease(acquire, key, lease, limit, lease_ms, cost).await.map_err(NoVerdict::Store),
            Self::Memory(m) if acquire => m.acquire(key, lease, limit, lease_ms, cost).map_err(NoVerdict::Full),
            Self::Memory(m) => Ok(m.release(key, lease)),
        }
    }

    /// Reserves every item's estimate under `handle`, all or nothing. The
    /// memory store does it under its shards' locks; Redis item by item
    /// (each its own script call, its keys one slot), all at once, and
    /// once more one by one in order when one refused while another held
    /// (maybe another request's reserve, cancelled by now), cancelling
    /// whatever a refused request held.
    pub async fn reserve(&self, asks: &[ReserveAsk<'_>], handle: &[u8; 16]) -> Result<Reserved, LocalStoreFull> {
        match self {
            Self::Redis(r) => Ok(reserve_in_redis(r, asks, handle).await),
            Self::Memory(m) => {
                let tuples: Vec<_> = asks.iter().map(|a| (a.spec, a.algorithm, a.shadow)).collect();
                let (committed, verdicts) = m.reserve(&tuples, handle)?;
                Ok(Reserved { committed, verdicts: verdicts.into_iter().map(Some).collect(), failure: None })
            }
        }
    }

    /// Settles the reserve `handle` names on `spec`'s window to the actual
    /// `spec.cost` (0: takes it back). `None`: no such record (forged,
    /// replayed, expired) and nothing changed. A Redis call that fails is
    /// retried in the background until Redis answers or the record's life
    /// ends (src/settle_retry.rs): settling is idempotent.
    pub async fn settle(&self, spec: &LimitSpec<'_>, algorithm: Algorithm, handle: &[u8; 16]) -> Result<Option<Verdict>, StoreError> {
        match self {
            Self::Redis(r) => {
                let settled = r.settle_reserve(spec, algorithm, handle).await;
                if let Err(e) = &settled {
                    settle_later(r, spec, algorithm, handle, e);
                }
                settled
            }
            Self::Memory(m) => Ok(m.settle(spec, algorithm, handle)),
        }
    }

    /// Takes back the members `handle` names in `items`' windows (REFUND):
    /// what the slots that answered removed, and why the others did not.
    pub async fn refund(&self, handle: &[u8; 16], items: &[RefundItem<'_>]) -> Result<RefundOutcome, RefundUnsupported> {
        match self {
            Self::Redis(r) => Ok(r.refund_outcome(handle, items).await),
            Self::Memory(_) => Err(RefundUnsupported),
        }
    }
}

/// One pass of a reserve over Redis: per item its verdict (`None`: not
/// asked, or failed), the first failure, and the items whose call failed
/// after it was sent (Redis may have charged them all the same).
struct Pass {
    verdicts: Vec<Option<Verdict>>,
    failure: Option<StoreError>,
    failed: Vec<usize>,
}

impl Pass {
    /// An enforced item refused.
    fn refused(&self, asks: &[ReserveAsk<'_>]) -> bool {
        asks.iter().zip(&self.verdicts).any(|(a, v)| matches!(v, Some(v) if !v.allowed && !a.shadow))
    }

    /// The items that reserved (and hold a record under the handle).
    fn held(&self) -> Vec<usize> {
        self.verdicts.iter().enumerate().filter(|(_, v)| matches!(v, Some(v) if v.allowed)).map(|(k, _)| k).collect()
    }
}

/// `Store::reserve` on Redis.
async fn reserve_in_redis(redis: &Arc<RedisWindow>, asks: &[ReserveAsk<'_>], handle: &[u8; 16]) -> Reserved {
    let first = reserve_pass(redis, asks, handle, true).await;
    if first.failure.is_none() && !first.refused(asks) {
        return Reserved { committed: true, verdicts: first.verdicts, failure: None };
    }
    let mut verdicts = vec![None; asks.len()];
    undo(redis, asks, &first, handle, &mut verdicts).await;
    if first.failure.is_some() || first.held().is_empty() || asks.len() == 1 {
        return Reserved { committed: false, verdicts, failure: first.failure };
    }
    let second = reserve_pass(redis, asks, handle, false).await;
    if second.failure.is_none() && !second.refused(asks) {
        return Reserved { committed: true, verdicts: second.verdicts, failure: None };
    }
    undo(redis, asks, &second, handle, &mut verdicts).await;
    Reserved { committed: false, verdicts, failure: second.failure }
}

/// Reserves every item under `handle`: all at once, or one by one
/// stopping at the first enforced refusal or failure.
async fn reserve_pass(redis: &RedisWindow, asks: &[ReserveAsk<'_>], handle: &[u8; 16], at_once: bool) -> Pass {
    let mut pass = Pass { verdicts: vec![None; asks.len()], failure: None, failed: Vec::new() };
    if at_once {
        let got = join_all(asks.iter().map(|a| redis.reserve(&a.spec, a.algorithm, handle))).await;
        for (k, g) in got.into_iter().enumerate() {
            match g {
                Ok(v) => pass.verdicts[k] = Some(v),
                Err(e) => {
                    if may_have_run(&e) {
                        pass.failed.push(k);
                    }
                    pass.failure = pass.failure.take().or(Some(e));
                }
            }
        }
        return pass;
    }
    for (k, a) in asks.iter().enumerate() {
        match redis.reserve(&a.spec, a.algorithm, handle).await {
            Ok(v) => {
                pass.verdicts[k] = Some(v);
                if !v.allowed && !a.shadow {
                    break;
                }
            }
            Err(e) => {
                if may_have_run(&e) {
                    pass.failed.push(k);
                }
                pass.failure = Some(e);
                break;
            }
        }
    }
    pass
}

/// A refused (or failed) pass undone: the reserves it holds cancelled
/// (each settled to 0, the window put back as it was; a cancel that fails
/// is retried in the background: the estimate stays charged meanwhile, a
/// refusal too many, never an admission), and the calls that failed after
/// they were sent taken back in the background (one never charged finds
/// no record). Into `verdicts`, per item asked: its refusal, or the window
/// after its cancel.
async fn undo(redis: &Arc<RedisWindow>, asks: &[ReserveAsk<'_>], pass: &Pass, handle: &[u8; 16], verdicts: &mut [Option<Verdict>]) {
    let held = pass.held();
    let zero = |k: usize| LimitSpec { cost: 0, ..asks[k].spec };
    let cancelled = join_all(held.iter().map(|&k| async move { redis.settle_reserve(&zero(k), asks[k].algorithm, handle).await })).await;
    for (&k, c) in held.iter().zip(&cancelled) {
        if let Err(e) = c {
            settle_later(redis, &zero(k), asks[k].algorithm, handle, e);
        }
    }
    if let Some(e) = &pass.failure {
        for &k in &pass.failed {
            settle_later(redis, &zero(k), asks[k].algorithm, handle, e);
        }
    }
    for (k, v) in pass.verdicts.iter().enumerate() {
        let Some(v) = v else { continue };
        verdicts[k] = Some(match held.iter().position(|&h| h == k).map(|p| &cancelled[p]) {
            Some(Ok(Some(after))) => Verdict { allowed: true, retry_after_ms: 0, ..*after },
            _ => *v,
        });
    }
}

