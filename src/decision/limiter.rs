//! The decision engine's state: the store, the per-host windows of the
//! `local` fail policy, the cache layers in front of the store (denial
//! cache, quota leases), the policies and the rate-limited logs. The
//! pipeline's steps are `impl Limiter` blocks in the sibling files.

use std::sync::Arc;
use std::time::Duration;

use crate::denial_cache::DenialCache;
use crate::live_overrides::LiveOverrides;
use crate::local_store::LocalStore;
use crate::log_limit::RateLimitedLog;
use crate::policies::Policies;
use crate::window_store::Store;

use super::lease::QuotaLeases;

/// The decision engine shared by all connections; replaced whole on reload.
#[derive(Debug)]
pub struct Limiter {
    pub(super) store: Store,
    /// The per-host windows of the `local` fail policy (with the memory
    /// store, the store's own); outlive reloads.
    pub(super) local: Arc<LocalStore>,
    pub(super) failure_log: RateLimitedLog,
    pub(super) capacity_log: RateLimitedLog,
    pub(super) overload_log: RateLimitedLog,
    /// Refusals by Redis, answered again here (Redis backend only).
    pub(super) denials: Option<Arc<DenialCache>>,
    /// The configured `[[policy]]` tables requests name.
    pub(super) policies: Arc<Policies>,
    pub(super) unknown_policy_log: RateLimitedLog,
    /// Overrides set through the admin API; outlives reloads.
    pub(super) live_overrides: Arc<LiveOverrides>,
    /// Quota leases on hot log keys (Redis backend, when enabled).
    pub(super) leases: Option<Arc<QuotaLeases>>,
}


impl Limiter {
    pub fn new(store: Store, local: Arc<LocalStore>) -> Self {
        Self {
            store,
            local,
            failure_log: RateLimitedLog::new(Duration::from_secs(1)),
            capacity_log: RateLimitedLog::new(Duration::from_secs(10)),
            overload_log: RateLimitedLog::new(Duration::from_secs(10)),
            denials: None,
            policies: Arc::default(),
            unknown_policy_log: RateLimitedLog::new(Duration::from_secs(1)),
            live_overrides: Arc::default(),
            leases: None,
        }
    }

    /// A limiter on the memory store, which is also its `local` fallback.
    pub fn memory(local: Arc<LocalStore>) -> Self {
        Self::new(Store::Memory(local.clone()), local)
    }

    /// The policies requests are decided with.
    pub fn with_policies(self, policies: Arc<Policies>) -> Self {
        Self { policies, ..self }
    }

    /// The admin API's overrides, read by `resolve`.
    pub fn with_live_overrides(self, live_overrides: Arc<LiveOverrides>) -> Self {
        Self { live_overrides, ..self }
    }

    pub fn policies(&self) -> &Arc<Policies> {
        &self.policies
    }

    /// Puts `denials` in front of the Redis backend.
    pub fn with_denial_cache(self, denials: Option<Arc<DenialCache>>) -> Self {
        Self { denials, ..self }
    }

    /// Admits hot log keys from quota leases (`super::lease`).
    pub fn with_quota_leases(self, leases: Option<Arc<QuotaLeases>>) -> Self {
        Self { leases, ..self }
    }

    /// The admin API's overrides this limiter reads.
    pub fn live_overrides(&self) -> &Arc<LiveOverrides> {
        &self.live_overrides
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// `key`'s window of `window_ms` was reset (an admin reset removed its
    /// admissions; `at_ms`: when, on Redis's clock, 0 if unknown): every
    /// cache layer in front of the store forgets what it remembered of it,
    /// so none keeps answering from state the store no longer has, and the
    /// quota leases forget the admissions before it (the reset kept their
    /// units in the store, `admin::reset`; their settles would otherwise put
    /// those admissions back). Told by the admin API that made the reset
    /// before it answers, and by the change log on every daemon.
    pub fn window_reset(&self, key: &[u8], window_ms: u32, at_ms: u64) {
        if let Some(d) = &self.denials {
            d.forget_window(key, window_ms);
        }
        if let (Some(l), true) = (&self.leases, at_ms > 0) {
            l.forget_before(key, window_ms, at_ms);
        }
    }

}
