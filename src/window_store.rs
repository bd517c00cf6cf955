//! The one store interface the decision pipeline asks, as
//! envoyproxy/ratelimit hides Redis and memcached behind
//! `RateLimitCache.DoLimit`: check, check several all or nothing, check
//! with a penalty box, acquire and release a concurrency lease, refund;
//! with one Redis (or Sentinel), a Redis Cluster or the per-host windows
//! behind it. This is the only place that knows which: `decision` never
//! matches on it. A store answers or says why it could not (`NoVerdict`);
//! what a request gets then is its fail policy's business, not the store's.
//!
//! The caches in front of it (quota leases, the denial cache, the ban
//! cache) are layers of the pipeline (`decision::layers`); the store tells
//! them of every removal it makes (refunds, settles, leases given back:
//! `RedisWindow::set_denial_cache`), and the admin API of the resets it
//! makes (`Limiter::window_changed`).

use std::sync::Arc;

use crate::config::Penalty;
use crate::local_store::{LocalStore, LocalStoreFull};
use crate::penalty_box::{BanTicket, BANS};
use crate::protocol::{Algorithm, Source};
use crate::redis::{MultiAsk, PenaltyState, RedisWindow, RefundItem, RefundOutcome};
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

    /// The Redis behind it, for the layers only Redis has (quota leases).
    pub fn as_redis(&self) -> Option<&Arc<RedisWindow>> {
        match self {
            Self::Redis(r) => Some(r),
            Self::Memory(_) => None,
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

    /// Takes back the members `handle` names in `items`' windows (REFUND):
    /// what the slots that answered removed, and why the others did not.
    pub async fn refund(&self, handle: &[u8; 16], items: &[RefundItem<'_>]) -> Result<RefundOutcome, RefundUnsupported> {
        match self {
            Self::Redis(r) => Ok(r.refund_outcome(handle, items).await),
            Self::Memory(_) => Err(RefundUnsupported),
        }
    }
}
