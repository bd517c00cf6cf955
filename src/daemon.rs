//! `ratelimitd serve`: wires the configuration to a socket, a backend and the
//! server; reloads on SIGHUP; runs until SIGTERM or SIGINT.

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::admin_api::{self, View};
use crate::config::{Config, ConfigError, Resolved};
use crate::denial_cache::DenialCache;
use crate::decision::{kind_refusal, Kind, Limiter, QuotaLeases};
use crate::window_store::Store;
use crate::live_overrides::LiveOverrides;
use crate::local_store::LocalStore;
use crate::metrics::METRICS;
use crate::metrics_server::{self, BreakerState, ConfigStatus, Live, RefusalReason};
use crate::policies::{counts_restart, Policies, Policy};
use crate::protocol::{PolicyUse, PolicyUses};
use crate::redis::{RedisWindow, StartError};
use crate::server::{self, Reloadable};
use crate::socket::{BoundSocket, SocketError};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error(transparent)]
    Redis(#[from] StartError),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error("the listener passed by systemd (LISTEN_FDS) cannot be used: {0}")]
    Inherited(std::io::Error),
    #[error("metrics.listen: {0}")]
    Metrics(std::io::Error),
    #[error("admin.listen: {0}")]
    Admin(#[from] admin_api::BindError),
    #[error("envoy.listen {0}: {1}")]
    Envoy(std::net::SocketAddr, std::io::Error),
}

/// Tells systemd (Type=notify) about the daemon's state; a no-op elsewhere.
fn notify_systemd(state: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

/// Takes the Unix listener systemd passed (LISTEN_FDS), if any.
fn inherited_listener() -> Result<Option<tokio::net::UnixListener>, DaemonError> {
    let mut fds = listenfd::ListenFd::from_env();
    if fds.len() == 0 {
        return Ok(None);
    }
    let std_listener = fds.take_unix_listener(0).map_err(DaemonError::Inherited)?;
    match std_listener {
        Some(l) => {
            l.set_nonblocking(true).map_err(DaemonError::Inherited)?;
            Ok(Some(tokio::net::UnixListener::from_std(l).map_err(DaemonError::Inherited)?))
        }
        None => Ok(None),
    }
}

/// Changes the log filter of the running process.
pub type SetLogLevel = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Reads the configuration again (file plus command-line overrides) and
/// runs its preflight.
pub type LoadConfig = Box<dyn Fn() -> Result<(Config, Resolved), ConfigError> + Send + Sync>;

/// What SIGHUP needs from the edge: loading the configuration again and
/// changing the log filter.
pub struct Reload {
    pub load: LoadConfig,
    pub set_log_level: SetLogLevel,
}

/// How long a reload waits for its new Redis link before going on (the
/// running backend serves meanwhile), and start-up at most for Redis's
/// first answer (connections queue in the socket meanwhile).
const READY_WAIT: Duration = Duration::from_secs(2);

/// Whether `ActiveBackend::start` waits for its Redis link.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Up to `READY_WAIT` for the link to be ready (a reload: the running
    /// backend serves meanwhile).
    UntilReady,
    /// Not at all: start-up binds the socket first, then waits for Redis's
    /// first answer (`wait_for_redis_at_start`).
    No,
}

/// How long the exit waits for multi-item checks to settle across Cluster
/// slots: a reservation's life, after which nothing is left to do.
const SETTLE_LIMIT: Duration = crate::redis::RESERVATION_LIFE;

/// A backend and the token that stops its background tasks.
struct ActiveBackend {
    backend: Store,
    /// With the Redis backend, unless `[denial_cache]` turns it off; new with
    /// each backend, so no entry outlives the link (and key prefix) it came from.
    denials: Option<Arc<DenialCache>>,
    /// With the Redis backend and `redis.quota_leases`: new with each
    /// backend, like the denial cache.
    leases: Option<Arc<QuotaLeases>>,
    token: CancellationToken,
}

impl ActiveBackend {
    async fn start(cfg: &Config, resolved: &Resolved, local: &Arc<LocalStore>, wait: Wait) -> Result<Self, StartError> {
        let token = CancellationToken::new();
        let backend = match &cfg.redis {
            Some(r) => {
                let redis = RedisWindow::start(r, &resolved.redis, token.clone())?;
                if wait == Wait::UntilReady {
                    log_readiness(r, &redis, redis.wait_ready(READY_WAIT).await);
                }
                Store::Redis(redis)
            }
            None => {
                tracing::warn!("no [redis] configured: using the in-memory backend; limits are per host, not shared between gateways");
                Store::Memory(local.clone())
            }
        };
        let denials = match &backend {
            Store::Redis(_) => DenialCache::from_config(&cfg.denial_cache).map(Arc::new),
            Store::Memory(_) => None,
        };
        // Refunds and reservations taken back forget what they free.
        if let (Store::Redis(r), Some(d)) = (&backend, &denials) {
            r.set_denial_cache(d.clone());
        }
        let leases = match (&backend, &cfg.redis) {
            (Store::Redis(r), Some(c)) if c.quota_leases => Some(QuotaLeases::new(r.clone(), 4096)),
            _ => None,
        };
        Ok(Self { backend, denials, leases, token })
    }

    fn is_ready(&self) -> bool {
        match &self.backend {
            Store::Redis(r) => r.is_ready(),
            Store::Memory(_) => true,
        }
    }

    /// Stops the background tasks once requests still using it are done.
    fn retire(self, grace: Duration) {
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            self.token.cancel();
        });
    }
}

/// The breaker gauge of whatever backend `reloadable` holds at scrape time.
fn breaker_state(reloadable: watch::Receiver<Reloadable>) -> BreakerState {
    Arc::new(move || {
        let current = reloadable.borrow();
        let (breaker_open, backend_ready) = match current.limiter.store() {
            Store::Redis(r) => {
                let open = r.breaker_open();
                (Some(open), !open && r.is_ready())
            }
            Store::Memory(_) => (None, true),
        };
        Live { breaker_open, backend_ready, policies: current.limiter.policies().clone(), live_overrides: current.limiter.live_overrides().clone() }
    })
}

/// A policy that decided a request, or that nginx described (named at a
/// worker's start, DESCRIBE_POLICY), within this long is "in use": a reload
/// that removes (or renames) it is refused unless forced (SIGUSR1), since
/// every location naming it would get UNKNOWN_POLICY from then on; so is
/// one that restarts its counts (`Breaks`). A use nginx described within
/// this long must stay possible as well.
pub const POLICY_IN_USE_WINDOW: Duration = Duration::from_secs(15 * 60);

/// The kind of request a use sends, as resolve judges it: a worker share
/// resolves as a single check, a refund as a multi-item check, a settle as
/// its reserve.
fn kind_of(u: PolicyUse) -> Kind {
    match u {
        PolicyUse::Single | PolicyUse::Share => Kind::Check,
        PolicyUse::Multi | PolicyUse::Refundable => Kind::Multi,
        PolicyUse::Reserve => Kind::Reserve,
        PolicyUse::Acquire => Kind::Lease { release: false },
    }
}

/// The uses of `uses` that `old` takes and `new` would refuse with every
/// request (resolve's own rule, `kind_refusal`), each with the error code
/// and message its requests would get. A use `old` refuses already is not
/// `new`'s doing.
pub fn uses_lost(old: &Policy, new: &Policy, uses: PolicyUses) -> Vec<(PolicyUse, String)> {
    uses.iter()
        .filter(|u| kind_refusal(old, kind_of(*u)).is_none())
        .filter_map(|u| kind_refusal(new, kind_of(u)).map(|(code, why)| (u, format!("{}: {why}", code.as_str()))))
        .collect()
}

/// What a reload changes of one running policy that a daemon refuses
/// (unless forced) while the policy is in use (docs/OPERATIONS.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReloadChange {
    /// No policy of its name in the new configuration: UNKNOWN_POLICY.
    Removed,
    /// Its counts would restart (`counts_restart`): what changes.
    CountsRestart(String),
    /// A use it takes would be refused (`uses_lost`): the use, and the
    /// error code and message its requests would get.
    UseLost(PolicyUse, String),
}

/// Every `ReloadChange` from `running` to `new`, policy by policy in
/// `running`'s order; `uses(p)`: the uses of `p` to check. The daemon's
/// reload (with the uses nginx described) and `check-config --against`
/// (with every use) both ask it.
pub fn reload_changes<'a>(running: &'a Policies, new: &Policies, uses: impl Fn(&Policy) -> PolicyUses) -> Vec<(&'a Policy, ReloadChange)> {
    let mut out = Vec::new();
    for p in running.iter() {
        let Some(n) = new.get(p.name.as_bytes()) else {
            out.push((p, ReloadChange::Removed));
            continue;
        };
        if let Some(change) = counts_restart(p, n) {
            out.push((p, ReloadChange::CountsRestart(change)));
        }
        out.extend(uses_lost(p, n, uses(p)).into_iter().map(|(u, why)| (p, ReloadChange::UseLost(u, why))));
    }
    out
}

/// Every use, for a check without a live daemon (`check-config --against`).
pub fn every_use(_: &Policy) -> PolicyUses {
    PolicyUse::ALL.into_iter().fold(PolicyUses::default(), PolicyUses::with)
}

/// What makes `p` in use now, or None: a request within
/// `POLICY_IN_USE_WINDOW` ("last request 3s ago"), else a description
/// within it ("no request yet, named by nginx: described 40s ago").
/// `any_request`: a request since start counts however long ago (a
/// policy's counts may live a month).
fn in_use(p: &Policy, now: u64, any_request: bool) -> Option<String> {
    let recent = |at: u64| (at != 0 && now.saturating_sub(at) <= POLICY_IN_USE_WINDOW.as_secs()).then(|| now.saturating_sub(at));
    let used = p.counters.last_used();
    match (recent(used), recent(p.counters.last_described())) {
        (Some(ago), _) => Some(format!("last request {ago}s ago")),
        (None, _) if any_request && used != 0 => Some(format!("last request {}s ago", now.saturating_sub(used))),
        (None, Some(ago)) => Some(format!("no request yet, named by nginx: described {ago}s ago")),
        (None, None) => None,
    }
}

/// What a reload from `running` to `new` would break, each a reason to
/// refuse it unless forced (SIGUSR1).
#[derive(Default)]
struct Breaks {
    /// Policies in use that `new` no longer has (removed or renamed), each
    /// with what makes it in use: their locations would get UNKNOWN_POLICY.
    removed: Vec<(String, String)>,
    /// Policies in use whose keys `new` changes, each with the change and
    /// what makes it in use: their counts would restart from zero.
    restarted: Vec<(String, String)>,
    /// Uses nginx described within `POLICY_IN_USE_WINDOW` that `new`'s
    /// policy of the same name refuses: the policy, the use, why.
    unusable: Vec<(String, PolicyUse, String)>,
}

impl Breaks {
    /// `shared`: the running backend is Redis, whose counts outlive this
    /// daemon's start and are shared with other daemons: a change of a
    /// policy's keys is refused whatever this daemon saw of it.
    fn of(running: &Policies, new: &Config, shared: bool) -> Self {
        let now = crate::use_clock::now();
        let recent = |at: u64| at != 0 && now.saturating_sub(at) <= POLICY_IN_USE_WINDOW.as_secs();
        // The uses nginx described lately: the only ones a reload must keep.
        let described = |p: &Policy| PolicyUse::ALL.into_iter().filter(|u| recent(p.counters.last_described_use(*u))).fold(PolicyUses::default(), PolicyUses::with);
        let mut b = Self::default();
        for (p, change) in reload_changes(running, &Policies::build(&new.policies, None), described) {
            let name = crate::terminal::escape(&p.name).to_string();
            match change {
                ReloadChange::Removed => {
                    if let Some(why) = in_use(p, now, false) {
                        b.removed.push((name, why));
                    }
                }
                ReloadChange::CountsRestart(change) => {
                    let why = in_use(p, now, true).or_else(|| shared.then(|| "counted in Redis, which other daemons and this one before its start may have written".to_string()));
                    if let Some(why) = why {
                        b.restarted.push((name, format!("{change}; {why}")));
                    }
                }
                ReloadChange::UseLost(u, why) => b.unusable.push((name, u, why)),
            }
        }
        b
    }

    fn reasons(&self) -> Vec<RefusalReason> {
        [(RefusalReason::PolicyInUse, self.removed.is_empty()), (RefusalReason::CountsRestart, self.restarted.is_empty()), (RefusalReason::UseUnsupported, self.unusable.is_empty())]
            .into_iter()
            .filter_map(|(r, none)| (!none).then_some(r))
            .collect()
    }

    fn list(pairs: &[(String, String)]) -> String {
        pairs.iter().map(|(name, why)| format!("{name} ({why})")).collect::<Vec<_>>().join(", ")
    }

    fn uses(&self) -> String {
        self.unusable.iter().map(|(name, u, why)| format!("{name}: {} ({why})", u.as_str())).collect::<Vec<_>>().join("; ")
    }

    /// One error line per reason, each saying how to force it.
    fn log_refused(&self) {
        let minutes = POLICY_IN_USE_WINDOW.as_secs() / 60;
        if !self.removed.is_empty() {
            tracing::error!(
                policies = %Self::list(&self.removed),
                window_s = POLICY_IN_USE_WINDOW.as_secs(),
                "configuration reload refused: it removes or renames policies that decided requests or that nginx described in the last {minutes} minutes, and the locations naming them would get UNKNOWN_POLICY; still serving with the previous configuration. Rename in nginx first, or keep both names until nginx is reloaded; to remove them anyway send SIGUSR1 (systemctl kill -s USR1 ratelimitd)"
            );
        }
        if !self.restarted.is_empty() {
            tracing::error!(
                policies = %Self::list(&self.restarted),
                "configuration reload refused: it changes the window, algorithm, utc_offset or shards of policies in use (with Redis: of any policy), which names other keys: their counts would restart from zero and let up to a whole limit more through; still serving with the previous configuration. Keep those settings (limits, overrides, on_error, shadow and penalty change without a restart), or add a policy of another name and move nginx to it; to restart the counts anyway send SIGUSR1 (systemctl kill -s USR1 ratelimitd)"
            );
        }
        if !self.unusable.is_empty() {
            tracing::error!(
                uses = %self.uses(),
                window_s = POLICY_IN_USE_WINDOW.as_secs(),
                "configuration reload refused: policies would refuse every request of a use nginx described in the last {minutes} minutes (multi-item, refundable, reserve and settle, worker share, concurrency acquire), and those locations would answer 500; still serving with the previous configuration. Change the nginx limiters first, or keep what they need; to apply it anyway send SIGUSR1 (systemctl kill -s USR1 ratelimitd)"
            );
        }
    }

    /// A forced reload puts the file in force anyway, and says what breaks.
    fn log_forced(&self) {
        if !self.removed.is_empty() {
            let list = self.removed.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>().join(", ");
            tracing::warn!(policies = %list, "forced reload removes policies in use: their locations get UNKNOWN_POLICY and their fail policy");
        }
        if !self.restarted.is_empty() {
            tracing::warn!(policies = %Self::list(&self.restarted), "forced reload restarts the counts of policies in use: their new keys start from zero");
        }
        if !self.unusable.is_empty() {
            tracing::warn!(uses = %self.uses(), "forced reload makes policies unusable by the nginx limiters that described them: their requests get the error said, and those locations answer 500");
        }
    }
}

/// What a reload from `running` to `new` would refuse while the policies
/// concerned are in use, one line per change (`ratelimitd check-config
/// --against`): without a live daemon, every change that breaks a policy
/// for some client, whether a daemon sees that use or not.
pub fn reload_report(running: &Config, new: &Config) -> Vec<String> {
    let (old, fresh) = (Policies::build(&running.policies, None), Policies::build(&new.policies, None));
    reload_changes(&old, &fresh, every_use)
        .into_iter()
        .map(|(p, change)| {
            let name = crate::terminal::escape(&p.name);
            match change {
                ReloadChange::Removed => format!("policy \"{name}\": removed or renamed: the locations naming it would get UNKNOWN_POLICY"),
                ReloadChange::CountsRestart(change) => format!("policy \"{name}\": counts restart from zero ({change}: other keys)"),
                ReloadChange::UseLost(u, why) => format!("policy \"{name}\": a {} would be refused: {why}", u.as_str()),
            }
        })
        .collect()
}

/// One line per old spelling the file still uses.
fn log_deprecated(cfg: &Config) {
    for line in &cfg.deprecated {
        tracing::warn!(deprecated = %line, "the configuration uses an old spelling; accepted for now");
    }
}

/// The next frames' bounds and limiter. `previous` is the limiter in force,
/// whose policies' counters carry over to the policies of the same name.
fn reloadable(cfg: &Config, active: &ActiveBackend, local: &Arc<LocalStore>, live: &Arc<LiveOverrides>, previous: Option<&Limiter>) -> Reloadable {
    let policies = Arc::new(Policies::build(&cfg.policies, previous.map(|l| &**l.policies())));
    let limiter = Limiter::new(active.backend.clone(), local.clone()).with_denial_cache(active.denials.clone()).with_quota_leases(active.leases.clone()).with_policies(policies).with_live_overrides(live.clone());
    Reloadable { bounds: cfg.limits.bounds, limiter: Arc::new(limiter), envoy: cfg.envoy.clone().map(Arc::new) }
}

/// The metrics endpoint in force: `[metrics]` changes are applied by a
/// reload (the new address bound first, then the old endpoint stopped).
struct MetricsEndpoint {
    live: BreakerState,
    status: Arc<ConfigStatus>,
    /// Stops the running endpoint; `None` without `[metrics]`.
    running: Option<CancellationToken>,
    background: CancellationToken,
}

impl MetricsEndpoint {
    /// Serves `cfg` (none: stops serving); on a bind error the running
    /// endpoint is kept and the error returned.
    async fn switch_to(&mut self, cfg: Option<&crate::config::MetricsConfig>) -> std::io::Result<()> {
        let fresh = match cfg {
            Some(m) => {
                let listener = metrics_server::bind(m.listen).await?;
                let token = self.background.child_token();
                tracing::info!(listen = %m.listen, "serving metrics at /metrics, /healthz, /config, and /top.json for ratelimitd top");
                tokio::spawn(metrics_server::serve(listener, self.live.clone(), self.status.clone(), token.clone()));
                Some(token)
            }
            None => None,
        };
        if let Some(old) = std::mem::replace(&mut self.running, fresh) {
            old.cancel();
        }
        Ok(())
    }
}

fn log_readiness(r: &crate::config::RedisConfig, redis: &RedisWindow, ready: bool) {
    if ready {
        tracing::info!(redis = %r.describe(), sha = redis.script_sha(), timeout_ms = r.timeout.as_millis() as u64, clock = ?r.clock, "redis backend ready");
    } else {
        tracing::warn!(redis = %r.describe(), "redis not reachable yet; serving with each request's fail policy until it is");
    }
}

/// Start-up, with the request socket bound: waits for Redis's first answer
/// (ready, or refused: not for a Redis that is down), at most `READY_WAIT`
/// (one that neither answers nor refuses: about `connect_timeout`). The
/// connections that arrive meanwhile wait in the socket's queue, to be
/// decided by Redis rather than by their fail policy; a Redis that is down
/// holds them only as long as it takes to refuse.
async fn wait_for_redis_at_start(cfg: &Config, active: &ActiveBackend) {
    if let (Some(r), Store::Redis(redis)) = (&cfg.redis, &active.backend) {
        log_readiness(r, redis, redis.wait_first_answer(READY_WAIT).await);
    }
}

/// Runs the daemon until a termination signal; returns once drained.
pub async fn serve(cfg: Config, resolved: Resolved, reload: Reload) -> Result<(), DaemonError> {
    let mut term = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let mut hup = signal(SignalKind::hangup()).map_err(DaemonError::Signals)?;
    let mut usr1 = signal(SignalKind::user_defined1()).map_err(DaemonError::Signals)?;

    // A socket passed by systemd is already listening: connections wait in
    // its queue while the backend starts, so a restart loses none.
    let inherited = inherited_listener()?;
    let local = Arc::new(LocalStore::new(cfg.limits.max_local_keys));
    let background = CancellationToken::new();
    tokio::spawn(local.clone().sweep_every_second(background.clone()));
    tokio::spawn(crate::spin::run(cfg.server.spin, background.clone()));
    log_deprecated(&cfg);
    // The penalty box's ended bans and stale strikes (memory backend; with
    // Redis the admin refresher sweeps too), every 10 s while the clock runs.
    tokio::spawn(crate::use_clock::run(background.clone(), || crate::penalty_box::BANS.sweep()));
    let status = Arc::new(ConfigStatus::default());
    status.loaded(cfg.dump());
    tokio::spawn(crate::top_refused::TOP_REFUSED.rotate_every_slot(background.clone()));
    let mut active = ActiveBackend::start(&cfg, &resolved, &local, Wait::No).await?;
    let s = &cfg.server;
    if !cfg.policies.is_empty() {
        tracing::info!(policies = cfg.policies.len(), "named policies loaded");
    }
    // The admin API's overrides: one table for the process's life, kept
    // equal to Redis's by a background task (never on the request path).
    let live = Arc::new(LiveOverrides::default());
    let (reloadable_tx, reloadable_rx) = watch::channel(reloadable(&cfg, &active, &local, &live, None));
    if let Some(r) = &cfg.redis {
        // Resets reach the limiter in force when they are read.
        let current = reloadable_rx.clone();
        let on_reset = move |w: &admin_api::changes::WindowReset| current.borrow().limiter.window_reset(&w.key, w.window_ms, w.at_ms);
        tokio::spawn(admin_api::store::refresh(r.clone(), resolved.redis.clone(), live.clone(), on_reset, cfg.admin.overrides_refresh, background.clone()));
    }
    let (view_tx, view_rx) = watch::channel(Arc::new(View { config: cfg.clone(), secrets: resolved.redis.clone() }));
    // Every check that can fail before any socket file is touched: a second
    // daemon started with a running one's configuration exits here, leaving
    // the running one's sockets alone (each bind checks its own file again).
    if inherited.is_none() {
        crate::socket::refuse_if_live(&s.listen)?;
    }
    if let Some(crate::config::AdminListen::Unix { path, .. }) = &cfg.admin.listen {
        crate::socket::refuse_if_live(path)?;
    }
    // The request socket's directory before the admin socket is bound:
    // an admin socket beside it (mode 0600) would otherwise make the
    // directory 0700, closed to the nginx workers.
    if inherited.is_none() {
        crate::socket::make_directory(&s.listen, s.socket_mode, resolved.socket_gid)?;
    }
    if let Some(path) = cfg.envoy.as_ref().and_then(|e| e.socket.as_ref()) {
        crate::socket::refuse_if_live(path)?;
    }
    let mut endpoint = MetricsEndpoint { live: breaker_state(reloadable_rx.clone()), status: status.clone(), running: None, background: background.clone() };
    endpoint.switch_to(cfg.metrics.as_ref()).await.map_err(DaemonError::Metrics)?;
    let _admin_listener_guard = match &cfg.admin.listen {
        Some(listen) => {
            let listener = admin_api::bind(listen, cfg.admin.tls.as_ref()).await?;
            tracing::info!(listen = ?listen, tokens = cfg.admin.token_file.is_some() || cfg.admin.read_token_file.is_some(), tls = cfg.admin.tls.is_some(), "serving the admin API");
            let token = background.child_token();
            tokio::spawn(admin_api::serve(listener, view_rx, live.clone(), reloadable_rx.clone(), token.clone()));
            Some(token.drop_guard())
        }
        None => None,
    };
    let _envoy_guard = match &cfg.envoy {
        Some(e) => Some(serve_envoy(e, &resolved, reloadable_rx.clone(), &background).await?),
        None => None,
    };
    // The request socket last: once clients can connect, the admin API and
    // the metrics endpoint answer too (tests and health checks wait for it).
    // A socket bound here is removed when `socket_file` drops; one passed by
    // systemd belongs to the socket unit and is left alone.
    let (listener, socket_file) = match inherited {
        Some(l) => {
            tracing::info!("using the socket passed by systemd (LISTEN_FDS); server.listen, socket_mode and socket_group are the socket unit's business");
            (l, None)
        }
        None => {
            // Bound before Redis's first answer (below), so that a restart
            // leaves the socket absent only from the old daemon's exit to
            // this line: the Lua client tries again within its connect
            // budget meanwhile (docs/OPERATIONS.md §3).
            let mut bound = BoundSocket::bind(&s.listen, s.socket_mode, resolved.socket_gid)?;
            let l = bound.take_listener().expect("fresh socket");
            tracing::info!(socket = %bound.path().display(), mode = format_args!("{:04o}", s.socket_mode), group = s.socket_group.as_deref().unwrap_or("-"), "listening");
            (l, Some(bound))
        }
    };
    wait_for_redis_at_start(&cfg, &active).await;
    let settings = s.clone();
    notify_systemd(&[sd_notify::NotifyState::Ready]);

    let mut current = cfg.clone();
    let control = async {
        loop {
            tokio::select! {
                _ = term.recv() => { tracing::info!("SIGTERM received"); break }
                _ = int.recv() => { tracing::info!("SIGINT received"); break }
                _ = hup.recv() => reload_once(false, &mut current, &mut active, &local, &live, &reloadable_tx, &view_tx, &reload, &mut endpoint).await,
                _ = usr1.recv() => reload_once(true, &mut current, &mut active, &local, &live, &reloadable_tx, &view_tx, &reload, &mut endpoint).await,
            }
        }
    };
    server::run(listener, reloadable_rx, settings, async {
        control.await;
        notify_systemd(&[sd_notify::NotifyState::Stopping]);
    })
    .await;
    // Quota leases go back now: their unused units would otherwise count
    // for the other hosts until their window ends (bounded wait).
    if let Some(l) = &active.leases {
        if !l.give_back(SETTLE_LIMIT).await {
            tracing::warn!(limit_ms = SETTLE_LIMIT.as_millis() as u64, "quota leases still unsettled at exit: their unused units leave the windows by themselves");
        }
    }
    // Multi-item checks cut by the shutdown still finish across their
    // slots (docs/PROTOCOL.md 4b): wait for them, bounded.
    if let Store::Redis(r) = &active.backend {
        if !r.settle(SETTLE_LIMIT).await {
            tracing::warn!(limit_ms = SETTLE_LIMIT.as_millis() as u64, "multi-item checks still unsettled at exit: their reservations leave the windows by themselves");
        }
    }
    active.token.cancel();
    background.cancel();
    drop(socket_file);
    tracing::info!("stopped");
    Ok(())
}

/// The Envoy rate limit service's listeners (`[envoy]`): bound at start;
/// a reload changes the descriptors and policies they serve, not where
/// they listen. Dropping the guard stops them (and removes the socket).
async fn serve_envoy(e: &crate::config::EnvoyConfig, resolved: &Resolved, reloadable: watch::Receiver<Reloadable>, background: &CancellationToken) -> Result<(tokio_util::sync::DropGuard, Option<BoundSocket>), DaemonError> {
    let token = background.child_token();
    if let Some(addr) = e.listen {
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|err| DaemonError::Envoy(addr, err))?;
        tracing::info!(listen = %addr, "serving the Envoy rate limit service (gRPC)");
        tokio::spawn(crate::envoy::serve(crate::envoy::Listener::Tcp(l), reloadable.clone(), e.max_connections, token.clone()));
    }
    let socket = match &e.socket {
        Some(path) => {
            let mut bound = BoundSocket::bind(path, e.socket_mode, resolved.socket_gid)?;
            let l = bound.take_listener().expect("fresh socket");
            tracing::info!(socket = %path.display(), "serving the Envoy rate limit service (gRPC)");
            tokio::spawn(crate::envoy::serve(crate::envoy::Listener::Unix(l), reloadable, e.max_connections, token.clone()));
            Some(bound)
        }
        None => None,
    };
    Ok((token.drop_guard(), socket))
}

/// One reload (SIGHUP; SIGUSR1: `force`, breaking policies in use too).
/// A file that does not load, or (unless forced) that breaks a policy in
/// use (`Breaks`: removed, counts restarted, a described use refused),
/// leaves the running configuration in force, logged and counted.
#[allow(clippy::too_many_arguments)]
async fn reload_once(force: bool, current: &mut Config, active: &mut ActiveBackend, local: &Arc<LocalStore>, live: &Arc<LiveOverrides>, reloadable_tx: &watch::Sender<Reloadable>, view_tx: &watch::Sender<Arc<View>>, reload: &Reload, endpoint: &mut MetricsEndpoint) {
    let status = endpoint.status.clone();
    if force {
        tracing::info!("SIGUSR1 received: reloading the configuration, even if it removes policies in use, restarts their counts or makes them refuse a use nginx described");
    } else {
        tracing::info!("SIGHUP received: reloading the configuration");
    }
    notify_systemd(&[sd_notify::NotifyState::Reloading, sd_notify::NotifyState::monotonic_usec_now().unwrap_or(sd_notify::NotifyState::Status("reloading"))]);
    match (reload.load)() {
        Ok((new, resolved)) => {
            let running = reloadable_tx.borrow().limiter.policies().clone();
            let breaks = Breaks::of(&running, &new, matches!(active.backend, Store::Redis(_)));
            let reasons = breaks.reasons();
            if !reasons.is_empty() && !force {
                METRICS.reloaded(false);
                status.reload_failed(&reasons);
                breaks.log_refused();
                notify_systemd(&[sd_notify::NotifyState::Status("configuration reload refused: it would break policies in use; still serving with the previous configuration"), sd_notify::NotifyState::Ready]);
                return;
            }
            breaks.log_forced();
            log_deprecated(&new);
            apply(current, new, &resolved, active, local, live, reloadable_tx, reload, endpoint).await;
            view_tx.send_replace(Arc::new(View { config: current.clone(), secrets: resolved.redis.clone() }));
            status.loaded(current.dump());
            METRICS.reloaded(true);
            // Said once everything shows it (the view, /config, the
            // metrics): a reader of this line finds the reload counted.
            tracing::info!(policies = current.policies.len(), "configuration reloaded");
        }
        Err(e) => {
            METRICS.reloaded(false);
            status.reload_failed(&[]);
            tracing::error!(error = %e, "configuration reload failed; still serving with the previous configuration");
            notify_systemd(&[sd_notify::NotifyState::Status("configuration reload failed; still serving with the previous configuration")]);
        }
    }
    notify_systemd(&[sd_notify::NotifyState::Ready]);
}

/// Puts a new, valid configuration in force without dropping a connection.
#[allow(clippy::too_many_arguments)]
async fn apply(current: &mut Config, mut new: Config, resolved: &Resolved, active: &mut ActiveBackend, local: &Arc<LocalStore>, live: &Arc<LiveOverrides>, reloadable_tx: &watch::Sender<Reloadable>, reload: &Reload, endpoint: &mut MetricsEndpoint) {
    if new.metrics != current.metrics {
        match endpoint.switch_to(new.metrics.as_ref()).await {
            Ok(()) if new.metrics.is_none() => tracing::info!("[metrics] removed: metrics no longer served"),
            Ok(()) => {}
            Err(e) => {
                tracing::error!(error = %e, "the new [metrics] listen address cannot be bound; keeping the running endpoint");
                new.metrics = current.metrics.clone();
            }
        }
    }
    if new.log.format != current.log.format {
        tracing::warn!("log.format takes effect at the next restart");
        new.log.format = current.log.format;
    }
    if new.server != current.server {
        tracing::warn!("[server] changes (socket path, mode, limits on connections, timeouts, worker threads) take effect at the next restart; keeping the running ones");
        new.server = current.server.clone();
    }
    if new.admin.listen != current.admin.listen || new.admin.overrides_refresh != current.admin.overrides_refresh {
        tracing::warn!("admin.listen and admin.overrides_refresh take effect at the next restart (tokens apply at once); keeping the running ones");
        new.admin.listen = current.admin.listen.clone();
        new.admin.overrides_refresh = current.admin.overrides_refresh;
    }
    if new.limits.max_local_keys != current.limits.max_local_keys {
        tracing::warn!("limits.max_local_keys takes effect at the next restart; keeping {}", current.limits.max_local_keys);
        new.limits.max_local_keys = current.limits.max_local_keys;
    }
    if new.log.level != current.log.level {
        if let Err(e) = (reload.set_log_level)(&new.log.level) {
            tracing::error!(error = %e, "cannot apply log.level");
        }
    }
    // Always a fresh link when Redis is configured: secrets and certificate
    // files may have changed behind the same paths.
    if new.redis.is_some() || current.redis.is_some() {
        match ActiveBackend::start(&new, resolved, local, Wait::UntilReady).await {
            Ok(fresh) if fresh.is_ready() || !active.is_ready() => {
                let old = std::mem::replace(active, fresh);
                old.retire(current.server.shutdown_grace);
                if let Store::Redis(r) = &active.backend {
                    crate::settle_retry::use_backend(r);
                }
            }
            Ok(fresh) => {
                tracing::error!("the new [redis] settings do not reach a working Redis; keeping the running backend");
                fresh.token.cancel();
                new.redis = current.redis.clone();
            }
            Err(e) => {
                tracing::error!(error = %e, "the new [redis] settings cannot be used; keeping the running backend");
                new.redis = current.redis.clone();
            }
        }
    }
    let previous = reloadable_tx.borrow().limiter.clone();
    reloadable_tx.send_replace(reloadable(&new, active, local, live, Some(&previous)));
    *current = new;
}
