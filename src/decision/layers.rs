//! The cache layers in front of the store, in one order, for one item's
//! window: a quota lease first (admits with no store call), then the
//! denial cache (refuses again what the store refused, for the algorithms
//! it is exact for), then the store, whose refusal the denial cache
//! records. Each layer hears of what the store removes from the store
//! itself (`RedisWindow::set_denial_cache`) and of admin resets from the
//! admin API (`Limiter::window_changed`), so none keeps answering from
//! state the store no longer has. No fail policy here.

use crate::denial_cache::{is_exact_for, Lookup};
use crate::protocol::{Algorithm, Source};
use crate::window_store::NoVerdict;
use crate::window::{LimitSpec, Verdict};

use super::lease::Take;
use super::limiter::Limiter;

impl Limiter {
    /// The verdict of the layers and the store on `spec`.
    pub(super) async fn verdict(&self, spec: &LimitSpec<'_>, algorithm: Algorithm) -> Result<(Source, Verdict), NoVerdict> {
        // 1. A quota lease (log, fixed, sliding counter; Redis only).
        let leased = match self.leases.as_ref().map(|l| (l, l.take(spec, algorithm))) {
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
}
