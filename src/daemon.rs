//! `ratelimitd serve`: wires the configuration to a socket, a backend and the
//! server, and runs until SIGTERM or SIGINT.

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::limiter::{Backend, Limiter};
use crate::redis_window::RedisWindow;
use crate::server::{self, ServerSettings};
use crate::socket::{BoundSocket, SocketError};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error(transparent)]
    Redis(#[from] crate::redis_link::ConnectorError),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}

/// How long start-up waits for the first script load before serving anyway.
const READY_WAIT: Duration = Duration::from_secs(2);

/// Runs the daemon until a termination signal; returns once drained.
pub async fn serve(cfg: Config) -> Result<(), DaemonError> {
    let mut term = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let mut hup = signal(SignalKind::hangup()).map_err(DaemonError::Signals)?;
    let background = CancellationToken::new();
    let backend = match &cfg.redis {
        Some(r) => {
            let redis = RedisWindow::start(r, background.clone())?;
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
    // Bound only now: until the script is loaded (or the wait is over),
    // clients get "connection refused" and apply their own fail policy at
    // once, instead of queueing in the backlog.
    let mode = cfg.socket_mode().expect("validated");
    let mut socket = BoundSocket::bind(&cfg.server.listen, mode, cfg.server.socket_group.as_deref())?;
    let listener = socket.take_listener().expect("fresh socket");
    let limiter = Arc::new(Limiter::new(backend));
    let settings = ServerSettings {
        max_connections: cfg.server.max_connections,
        max_in_flight_per_connection: cfg.server.max_in_flight_per_connection,
        shutdown_grace: Duration::from_millis(cfg.server.shutdown_grace_ms),
        bounds: cfg.bounds(),
    };
    tracing::info!(socket = %socket.path().display(), mode = format_args!("{mode:04o}"), group = cfg.server.socket_group.as_deref().unwrap_or("-"), "listening");

    let shutdown = async {
        loop {
            tokio::select! {
                _ = term.recv() => { tracing::info!("SIGTERM received"); break }
                _ = int.recv() => { tracing::info!("SIGINT received"); break }
                _ = hup.recv() => tracing::warn!("SIGHUP received: configuration reload is not supported yet; restart to apply changes"),
            }
        }
    };
    server::run(listener, limiter, settings, shutdown).await;
    background.cancel();
    drop(socket);
    tracing::info!("stopped");
    Ok(())
}
