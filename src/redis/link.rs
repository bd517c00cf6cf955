//! The daemon's one link to Redis: a multiplexed connection shared by every
//! request, a circuit breaker, and a supervisor task that (re)connects and
//! loads the script.
//!
//! Requests go through one entry point, `eval`, which owns what every call
//! needs: the deadline, the single-flight reload and one retry on
//! `NOSCRIPT`, the breaker's bookkeeping and the latency metric. It takes
//! the current connection from an `ArcSwap` (no lock) and checks the breaker
//! (one atomic). Everything slow happens in the supervisor: connecting
//! (directly, or through Sentinel to the current master), `SCRIPT LOAD` at
//! start-up, after every reconnect and on `NOSCRIPT`, and probing while the
//! breaker is open. A new connection is only put in place once it has loaded
//! the script, so requests never race a half-ready link.

mod breaker;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Cmd, FromRedisValue, RedisError, Script};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use self::breaker::Breaker;
use super::connector::Connector;
use super::sentinel::SentinelConnector;
use crate::config::RedisConfig;
use crate::metrics::METRICS;
use crate::window::StoreError;

/// Timings of the link.
#[derive(Debug, Clone)]
pub struct LinkSettings {
    /// Deadline of one request's Redis call.
    pub timeout: Duration,
    /// Deadline of opening a connection.
    pub connect_timeout: Duration,
    /// Consecutive timeouts that open the breaker.
    pub breaker_failures: u32,
}

impl From<&RedisConfig> for LinkSettings {
    fn from(cfg: &RedisConfig) -> Self {
        Self { timeout: cfg.timeout, connect_timeout: cfg.connect_timeout, breaker_failures: cfg.breaker_failures }
    }
}

pub struct RedisLink {
    conn: ArcSwapOption<MultiplexedConnection>,
    breaker: Breaker,
    /// Bumped after every successful SCRIPT LOAD.
    generation: AtomicU64,
    reconnect_wanted: AtomicBool,
    reload_wanted: AtomicBool,
    /// Wakes the supervisor.
    wake: Notify,
    /// Wakes requests waiting for a reload.
    loaded: Notify,
    settings: LinkSettings,
    script: Script,
}

impl std::fmt::Debug for RedisLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLink")
            .field("breaker_open", &self.breaker.is_open())
            .field("generation", &self.generation.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// How a failed call bears on the link.
enum Failure {
    /// The connection is gone or points at the wrong server: reconnect.
    Link,
    /// The call took too long: counts toward opening the breaker.
    Slow,
    /// The server answered with an error about this call only.
    Call,
}

fn classify(e: &RedisError) -> Failure {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_unrecoverable_error() {
        return Failure::Link;
    }
    if e.is_timeout() {
        return Failure::Slow;
    }
    // A demoted master (READONLY) or a server not ready to serve (LOADING,
    // MASTERDOWN): the link must find the master again.
    match e.code() {
        Some("READONLY" | "LOADING" | "MASTERDOWN" | "NOAUTH" | "WRONGPASS") => Failure::Link,
        _ => Failure::Call,
    }
}

impl RedisLink {
    /// Starts the supervisor; the link is down (breaker open) until it has
    /// connected and loaded `script`. Background tasks stop with `shutdown`.
    pub fn start(connector: Connector, script: Script, settings: LinkSettings, shutdown: CancellationToken) -> Arc<Self> {
        let link = Arc::new(Self {
            conn: ArcSwapOption::empty(),
            breaker: Breaker::new(settings.breaker_failures),
            generation: AtomicU64::new(0),
            reconnect_wanted: AtomicBool::new(true),
            reload_wanted: AtomicBool::new(false),
            wake: Notify::new(),
            loaded: Notify::new(),
            settings,
            script,
        });
        if let Connector::Sentinel(s) = &connector {
            let link = Arc::downgrade(&link);
            let on_switch = move || match link.upgrade() {
                Some(l) => {
                    l.failover_announced();
                    true
                }
                None => false,
            };
            tokio::spawn(SentinelConnector::watch_switches(s.switch_watch(), on_switch, shutdown.clone()));
        }
        tokio::spawn(supervise(link.clone(), connector, shutdown));
        link
    }

    /// The SHA1 that EVALSHA names.
    pub fn script_sha(&self) -> &str {
        self.script.get_hash()
    }

    /// Runs `cmd`, an EVALSHA of the link's script, within the deadline. On
    /// `NOSCRIPT` (Redis lost its script cache) it waits for the one reload
    /// the supervisor does for all requests, then retries once. Every
    /// outcome is reported to the breaker and the latency metric.
    pub async fn eval<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        let mut conn = self.connection()?;
        let attempt = async {
            let seen = self.generation();
            match cmd.query_async::<T>(&mut conn).await {
                Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                    METRICS.noscript_reload();
                    self.wait_for_reload(seen).await;
                    cmd.query_async::<T>(&mut conn).await
                }
                other => other,
            }
        };
        let started = Instant::now();
        let outcome = tokio::time::timeout(self.settings.timeout, attempt).await;
        METRICS.redis_call(started.elapsed());
        match outcome {
            Ok(Ok(v)) => {
                self.breaker.record_success();
                Ok(v)
            }
            Ok(Err(e)) => Err(self.record_failure(&e)),
            Err(_) => {
                self.record_timeout();
                Err(StoreError::Timeout(self.settings.timeout))
            }
        }
    }

    /// A sentinel announced that our master changed: stop using the old one now.
    fn failover_announced(&self) {
        if self.breaker.trip() {
            METRICS.breaker_opened();
        }
        self.want_reconnect();
    }

    pub fn breaker_open(&self) -> bool {
        self.breaker.is_open()
    }

    /// The connection to use now, or why there is none.
    #[inline]
    fn connection(&self) -> Result<MultiplexedConnection, StoreError> {
        if self.breaker.is_open() {
            return Err(StoreError::CircuitOpen);
        }
        match &*self.conn.load() {
            Some(c) => Ok((**c).clone()),
            None => Err(StoreError::CircuitOpen),
        }
    }

    #[inline]
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Reports a failed call and returns the error to answer with.
    fn record_failure(&self, e: &RedisError) -> StoreError {
        match classify(e) {
            Failure::Link => {
                if self.breaker.trip() {
                    METRICS.breaker_opened();
                    tracing::warn!(error = %e, "redis connection lost; breaker open, reconnecting");
                }
                self.want_reconnect();
                StoreError::Unavailable(e.to_string())
            }
            Failure::Slow => {
                self.record_timeout();
                StoreError::Timeout(self.settings.timeout)
            }
            Failure::Call => StoreError::Redis(e.to_string()),
        }
    }

    /// Reports a call that passed its deadline.
    fn record_timeout(&self) {
        if self.breaker.record_failure() {
            METRICS.breaker_opened();
            tracing::warn!(
                failures = self.settings.breaker_failures,
                timeout_ms = self.settings.timeout.as_millis() as u64,
                "redis too slow; breaker open, requests follow their fail policy until a probe succeeds"
            );
            self.want_reconnect();
        }
    }

    fn want_reconnect(&self) {
        self.reconnect_wanted.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Waits for a script load newer than generation `seen` (after NOSCRIPT).
    async fn wait_for_reload(&self, seen: u64) {
        let loaded = self.loaded.notified();
        tokio::pin!(loaded);
        loaded.as_mut().enable();
        if self.generation() != seen {
            return; // a reload finished since this request read the generation
        }
        self.reload_wanted.store(true, Ordering::Release);
        self.wake.notify_one();
        loaded.await;
    }

    /// True once connected with the script loaded, and the breaker closed.
    pub fn is_ready(&self) -> bool {
        !self.breaker.is_open() && self.generation() > 0
    }

    /// Waits up to `limit` for the link to be ready; returns whether it is.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let loaded = self.loaded.notified();
                if self.is_ready() {
                    return;
                }
                loaded.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }

    fn publish_load(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.loaded.notify_waiters();
    }
}

const MIN_BACKOFF: Duration = Duration::from_millis(25);
/// Caps the pause between probes, so a returning Redis is back in use
/// within about half a second plus one connect.
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// (Re)connects, reloads the script and closes the breaker; runs until shutdown.
async fn supervise(link: Arc<RedisLink>, connector: Connector, shutdown: CancellationToken) {
    let script = &link.script;
    let conn_cfg = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(link.settings.connect_timeout))
        .set_response_timeout(Some(link.settings.timeout.max(Duration::from_secs(1))));
    let probe_limit = link.settings.connect_timeout + Duration::from_secs(1);
    let target = connector.describe();
    let mut backoff = MIN_BACKOFF;
    let mut failures = 0u32;
    loop {
        let needs_link = link.reconnect_wanted.load(Ordering::Acquire) || link.breaker.is_open();
        let needs_load = link.reload_wanted.load(Ordering::Acquire);
        if !needs_link && !needs_load {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = link.wake.notified() => continue,
            }
        }
        let attempt = async {
            if needs_link {
                link.reconnect_wanted.store(false, Ordering::Release);
                link.reload_wanted.store(false, Ordering::Release);
                let mut conn = connector.connect(&conn_cfg).await?;
                script.load_async(&mut conn).await?;
                link.conn.store(Some(Arc::new(conn)));
            } else {
                link.reload_wanted.store(false, Ordering::Release);
                let mut conn = match &*link.conn.load() {
                    Some(c) => (**c).clone(),
                    None => return Err(RedisError::from(std::io::Error::other("no connection"))),
                };
                script.load_async(&mut conn).await?;
            }
            Ok::<_, RedisError>(())
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = tokio::time::timeout(probe_limit, attempt) => r,
        };
        match result {
            Ok(Ok(())) => {
                METRICS.script_loaded();
                // Close first, then wake the waiters: they check both.
                let was_open = link.breaker.is_open();
                link.breaker.close();
                link.publish_load();
                if was_open {
                    tracing::info!(redis = %target, sha = script.get_hash(), after_failures = failures, "redis link up; script loaded; breaker closed");
                } else {
                    tracing::debug!(sha = script.get_hash(), "sliding-window script reloaded");
                }
                failures = 0;
                backoff = MIN_BACKOFF;
                continue;
            }
            Ok(Err(e)) => {
                failures += 1;
                log_probe_failure(&target, failures, &e.to_string());
            }
            Err(_) => {
                failures += 1;
                log_probe_failure(&target, failures, &format!("no answer within {probe_limit:?}"));
            }
        }
        // Whatever failed, the next attempt starts from a fresh connection.
        if link.breaker.trip() {
            METRICS.breaker_opened();
        }
        link.reconnect_wanted.store(true, Ordering::Release);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn log_probe_failure(target: &str, failures: u32, reason: &str) {
    // The first failure, then every 60th: about every 30 s when attempts
    // fail at once, longer when each waits out a connect timeout.
    if failures == 1 || failures % 60 == 0 {
        tracing::warn!(redis = %target, failures, reason, "cannot reach redis; requests follow their fail policy");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_classified_by_what_they_mean_for_the_link() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(classify(&io), Failure::Link));
        let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(matches!(classify(&timeout), Failure::Link | Failure::Slow));
    }
}
