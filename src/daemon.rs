//! `ratelimitd serve`: wires the configuration to a socket, a backend and the
//! server; reloads on SIGHUP; runs until SIGTERM or SIGINT.

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigError};
use crate::limiter::{Backend, Limiter, LocalWindows};
use crate::redis_link::ConnectorError;
use crate::redis_window::RedisWindow;
use crate::server::{self, ServerSettings};
use crate::socket::{BoundSocket, SocketError};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error(transparent)]
    Redis(#[from] ConnectorError),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}

/// What SIGHUP needs from the edge: reading the configuration again (file
/// plus command-line overrides) and changing the log filter.
pub struct Reload {
    pub load: Box<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>,
    pub set_log_level: Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>,
}

/// How long start-up and reload wait for a new Redis link before going on.
const READY_WAIT: Duration = Duration::from_secs(2);

/// A backend and the token that stops its background tasks.
struct ActiveBackend {
    backend: Backend,
    token: CancellationToken,
}

impl ActiveBackend {
    async fn start(cfg: &Config) -> Result<Self, ConnectorError> {
        let token = CancellationToken::new();
        let backend = match &cfg.redis {
            Some(r) => {
                let redis = RedisWindow::start(r, token.clone())?;
                if redis.wait_ready(READY_WAIT).await {
                    tracing::info!(redis = %r.describe(), sha = redis.script_sha(), timeout_ms = r.timeout_ms, clock = ?r.clock, "redis backend ready");
                } else {
                    tracing::warn!(redis = %r.describe(), "redis not reachable yet; serving with each request's fail policy until it is");
                }
                Backend::Redis(redis)
            }
            None => {
                tracing::warn!("no [redis] configured: using the in-memory backend; limits are per host, not shared between gateways");
                Backend::Memory
            }
        };
        Ok(Self { backend, token })
    }

    fn is_ready(&self) -> bool {
        match &self.backend {
            Backend::Redis(r) => r.link().is_ready(),
            Backend::Memory => true,
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

/// Runs the daemon until a termination signal; returns once drained.
pub async fn serve(cfg: Config, reload: Reload) -> Result<(), DaemonError> {
    let mut term = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let mut hup = signal(SignalKind::hangup()).map_err(DaemonError::Signals)?;

    let local = Arc::new(LocalWindows::new(cfg.limits.max_local_keys));
    let mut active = ActiveBackend::start(&cfg).await?;
    // Bound only now: until the script is loaded (or the wait is over),
    // clients get "connection refused" and apply their own fail policy at
    // once, instead of queueing in the backlog.
    let mode = cfg.socket_mode().expect("validated");
    let mut socket = BoundSocket::bind(&cfg.server.listen, mode, cfg.server.socket_group.as_deref())?;
    let listener = socket.take_listener().expect("fresh socket");
    let (limiter_tx, limiter_rx) = watch::channel(Arc::new(Limiter::new(active.backend.clone(), local.clone(), cfg.bounds())));
    let s = &cfg.server;
    let settings = ServerSettings {
        max_connections: s.max_connections,
        max_in_flight_per_connection: s.max_in_flight_per_connection,
        shutdown_grace: Duration::from_millis(s.shutdown_grace_ms),
        idle_timeout: Duration::from_millis(s.idle_timeout_ms),
        frame_timeout: Duration::from_millis(s.frame_timeout_ms),
    };
    tracing::info!(socket = %socket.path().display(), mode = format_args!("{mode:04o}"), group = s.socket_group.as_deref().unwrap_or("-"), "listening");

    let mut current = cfg.clone();
    let control = async {
        loop {
            tokio::select! {
                _ = term.recv() => { tracing::info!("SIGTERM received"); break }
                _ = int.recv() => { tracing::info!("SIGINT received"); break }
                _ = hup.recv() => {
                    tracing::info!("SIGHUP received: reloading the configuration");
                    match (reload.load)() {
                        Ok(new) => apply(&mut current, new, &mut active, &local, &limiter_tx, &reload).await,
                        Err(e) => tracing::error!(error = %e, "configuration reload failed; still serving with the previous configuration"),
                    }
                }
            }
        }
    };
    server::run(listener, limiter_rx, settings, control).await;
    active.token.cancel();
    drop(socket);
    tracing::info!("stopped");
    Ok(())
}

/// Puts a new, valid configuration in force without dropping a connection.
async fn apply(current: &mut Config, mut new: Config, active: &mut ActiveBackend, local: &Arc<LocalWindows>, limiter_tx: &watch::Sender<Arc<Limiter>>, reload: &Reload) {
    if new.server != current.server {
        tracing::warn!("[server] changes (socket path, mode, limits on connections, timeouts) take effect at the next restart; keeping the running ones");
        new.server = current.server.clone();
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
        match ActiveBackend::start(&new).await {
            Ok(fresh) if fresh.is_ready() || !active.is_ready() => {
                let old = std::mem::replace(active, fresh);
                old.retire(Duration::from_millis(current.server.shutdown_grace_ms));
            }
            Ok(fresh) => {
                tracing::error!("the new [redis] settings do not reach a working Redis; keeping the running link");
                fresh.token.cancel();
                new.redis = current.redis.clone();
            }
            Err(e) => {
                tracing::error!(error = %e, "the new [redis] settings cannot be used; keeping the running link");
                new.redis = current.redis.clone();
            }
        }
    }
    limiter_tx.send_replace(Arc::new(Limiter::new(active.backend.clone(), local.clone(), new.bounds())));
    *current = new;
    tracing::info!("configuration reloaded");
}
