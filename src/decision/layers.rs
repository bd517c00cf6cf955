//! The cache layers in front of the store, in one order. For one item's
//! window (`verdict`): a quota lease first (admits with no store call), then the
//! denial cache (refuses again what the store refused, for the algorithms
//! it is exact for), then the store, whose refusal the denial cache
//! records. Each layer hears of what the store removes from the store
//! itself (`RedisWindow::set_denial_cache`) and of admin resets from the
//! admin API (`Limiter::window_reset`), so none keeps answering from
//! state the store no longer has. For several items all or nothing
//! (`many_verdicts`): the denial cache, then the store (never leased). No
//! fail policy here.

use crate::denial_cache::{is_exact_for, Lookup};
use crate::protocol::{Algorithm, Source};
use crate::redis::MultiAsk;
use crate::window_store::{ManyVerdicts, NoVerdict};
use crate::window::{LimitSpec, Verdict};

use super::lease::{Take, LEASE_WAIT};
use super::limiter::Limiter;

impl Limiter {
    /// The verdict of the layers and the store on `spec`.
    pub(super) async fn verdict(&self, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Result<(Source, Verdict), NoVerdict> {
        // 1. A quota lease (log, fixed, sliding counter; Redis only); while
        // the key's lease call is in flight, after it (waiting registered
        // before looking again, so its end cannot be missed).
        let mut taken = self.leases.as_ref().map(|l| (l, l.take(spec, algorithm)));
        if let Some((l, Take::Wait)) = taken {
            let done = l.lease_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            let mut again = l.take(spec, algorithm);
            if matches!(again, Take::Wait) {
                let _ = tokio::time::timeout(LEASE_WAIT, done).await;
                again = l.take(spec, algorithm);
            }
            taken = Some((l, if matches!(again, Take::Wait) { Take::Pass } else { again }));
        }
        let leased = match taken {
            Some((_, Take::Admitted(v))) => return Ok((self.store.origin(), v)),
            Some((l, Take::Lease { fp, want })) => Some((l, fp, want)),
            _ => None,
        };
        // 2. The denial cache (Redis only).
        let denials = self.denials.as_deref().filter(|_| is_exact_for(algorithm));
        let ticket = match denials.map(|d| d.check(spec, algorithm)) {
            Some(Lookup::Refused(v)) => {
                if let Some((l, fp, _)) = leased {
                    l.abandon(fp);
                }
                return Ok((Source::DenialCache, v));
            }
            Some(Lookup::Miss(ticket)) => Some(ticket),
            None => None,
        };
        // 3. The store: the call that also takes the key's next lease, or
        // a plain check.
        let v = match leased {
            Some((l, fp, want)) => l.lease(fp, spec, algorithm, want).await.map_err(NoVerdict::Store)?,
            None => self.store.check(spec, algorithm).await?,
        };
        if let (Some(d), Some(t)) = (denials, ticket) {
            d.record(t, spec.cost, &v);
        }
        Ok((self.store.origin(), v))
    }

    /// The verdicts of the layers and the store on several exact-log items,
    /// all or nothing: an enforced item the denial cache refuses decides
    /// (exact: the store would refuse it), else one store call, whose
    /// refusals the cache records.
    pub(super) async fn many_verdicts(&self, asks: &[MultiAsk<'_>], under: Option<&[u8; 16]>) -> Result<ManyVerdicts, NoVerdict> {
        let mut tickets = Vec::with_capacity(asks.len());
        if let Some(d) = self.denials.as_deref() {
            let mut cached = vec![None; asks.len()];
            let mut refused = false;
            for (k, a) in asks.iter().enumerate() {
                match d.check(&a.spec(), Algorithm::Log) {
                    Lookup::Refused(v) if !a.shadow => {
                        cached[k] = Some((Source::DenialCache, v));
                        refused = true;
                    }
                    Lookup::Refused(_) => tickets.push(None),
                    Lookup::Miss(t) => tickets.push(Some(t)),
                }
            }
            if refused {
                return Ok(ManyVerdicts { committed: false, verdicts: cached, handle: None });
            }
        }
        let answer = self.store.check_many(asks, under).await?;
        if let Some(d) = &self.denials {
            for ((a, v), t) in asks.iter().zip(&answer.verdicts).zip(&tickets) {
                if let (Some((_, v)), Some(t)) = (v, t) {
                    d.record(*t, a.cost, v);
                }
            }
        }
        Ok(answer)
    }
}
