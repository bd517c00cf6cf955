//! Accepts connections on the Unix socket and serves each with a `Handler`.
//!
//! `run` takes the shutdown future so that `main` and the tests drive it the
//! same way. On shutdown the listener stops accepting, every handler stops
//! reading, answers what it has in flight and closes; the whole drain is
//! bounded by a grace period.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ServerConfig;
use crate::limiter::Limiter;
use crate::metrics::METRICS;
use crate::protocol::{encode_response, Bounds, Decision, ErrorCode, Inbound, RequestCodec, Response, Source, MAX_FRAME_LEN};

/// Connection handling settings, from `[server]`; fixed for the daemon's life.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub max_connections: usize,
    pub max_in_flight_per_connection: usize,
    pub shutdown_grace: Duration,
    pub idle_timeout: Duration,
    pub frame_timeout: Duration,
}

impl From<&ServerConfig> for ServerSettings {
    fn from(s: &ServerConfig) -> Self {
        Self {
            max_connections: s.max_connections,
            max_in_flight_per_connection: s.max_in_flight_per_connection,
            shutdown_grace: s.shutdown_grace,
            idle_timeout: s.idle_timeout,
            frame_timeout: s.frame_timeout,
        }
    }
}

/// What a configuration reload replaces for the frames still to come: the
/// bounds they are validated against and the limiter that decides them.
#[derive(Debug, Clone)]
pub struct Reloadable {
    pub bounds: Bounds,
    pub limiter: Arc<Limiter>,
}

/// Serves `listener` until `shutdown` completes, then drains. Each request
/// is validated and decided with what is current on `reloadable` when its
/// frame is read; a reload may send a new one at any time.
pub async fn run(listener: UnixListener, reloadable: watch::Receiver<Reloadable>, settings: ServerSettings, shutdown: impl Future) {
    let token = CancellationToken::new();
    let tracker = TaskTracker::new();
    let acceptor = Listener {
        listener,
        reloadable,
        connections: Arc::new(Semaphore::new(settings.max_connections)),
        settings: settings.clone(),
        token: token.clone(),
        tracker: tracker.clone(),
    };
    tokio::select! {
        _ = acceptor.accept_loop() => {}
        _ = shutdown => tracing::info!("shutting down: no new connections; draining"),
    }
    // Close the listener now: new clients get "connection refused" (or, with
    // socket activation, wait in systemd's queue for the next daemon) rather
    // than a connection nobody will serve.
    drop(acceptor);
    token.cancel();
    tracker.close();
    if tokio::time::timeout(settings.shutdown_grace, tracker.wait()).await.is_err() {
        tracing::warn!(
            grace_ms = settings.shutdown_grace.as_millis() as u64,
            still_open = tracker.len(),
            "shutdown grace period expired; dropping the connections still open"
        );
    }
}

struct Listener {
    listener: UnixListener,
    reloadable: watch::Receiver<Reloadable>,
    connections: Arc<Semaphore>,
    settings: ServerSettings,
    token: CancellationToken,
    tracker: TaskTracker,
}

impl Listener {
    /// Never returns: one failed accept (EMFILE, ...) is logged and retried
    /// after a pause, never fatal.
    async fn accept_loop(&self) {
        let mut backoff = Duration::from_millis(1);
        loop {
            let permit = match self.connections.clone().acquire_owned().await {
                Ok(p) => p,
                Err(_) => return, // the semaphore is never closed
            };
            match self.listener.accept().await {
                Ok((stream, _)) => {
                    backoff = Duration::from_millis(1);
                    let handler = Handler { reloadable: self.reloadable.clone(), settings: self.settings.clone(), token: self.token.clone() };
                    self.tracker.spawn(async move {
                        handler.run(stream).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "accept failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// Serves one connection: reads frames, decides up to
/// `max_in_flight_per_connection` of them concurrently, and writes each
/// response as soon as it is ready (responses carry the request id, so they
/// may overtake each other). Closes the connection when it has been idle for
/// `idle_timeout`, or when a frame stays incomplete for `frame_timeout`.
struct Handler {
    reloadable: watch::Receiver<Reloadable>,
    settings: ServerSettings,
    token: CancellationToken,
}

impl Handler {
    async fn run(self, stream: UnixStream) {
        METRICS.connection_opened();
        self.serve(stream).await;
        METRICS.connection_closed();
    }

    async fn serve(mut self, stream: UnixStream) {
        let (rd, mut wr) = stream.into_split();
        let Reloadable { bounds, mut limiter } = self.reloadable.borrow_and_update().clone();
        let mut frames = FramedRead::with_capacity(rd, RequestCodec::new(bounds), 4096);
        let mut out = BytesMut::with_capacity(1024);
        let mut in_flight = FuturesUnordered::new();
        let mut reading = true;
        let mut last_frame = Instant::now();
        let mut partial_since: Option<Instant> = None;
        let timer = tokio::time::sleep_until(last_frame + self.settings.idle_timeout);
        tokio::pin!(timer);
        while reading || !in_flight.is_empty() {
            // Before reading the next frame: a reload's bounds apply to it.
            if self.reloadable.has_changed().unwrap_or(false) {
                let current = self.reloadable.borrow_and_update().clone();
                limiter = current.limiter;
                frames.decoder_mut().set_bounds(current.bounds);
            }
            tokio::select! {
                biased;
                Some(resp) = in_flight.next(), if !in_flight.is_empty() => {
                    encode_response(&resp, &mut out);
                    let mut done = 1;
                    // Batch whatever else is ready into the same write.
                    while let Some(Some(resp)) = in_flight.next().now_or_never() {
                        encode_response(&resp, &mut out);
                        done += 1;
                    }
                    METRICS.in_flight(-done);
                }
                frame = frames.next(), if reading && in_flight.len() < self.settings.max_in_flight_per_connection => {
                    last_frame = Instant::now();
                    partial_since = None;
                    match frame {
                        Some(Ok(Inbound::Check(req))) => {
                            METRICS.in_flight(1);
                            in_flight.push(limiter.clone().decide_owned(req));
                        }
                        Some(Ok(Inbound::Invalid { id, op, code, message })) => {
                            tracing::debug!(id, %code, %message, "invalid request");
                            METRICS.decided(Decision::Error, Source::None, code);
                            encode_response(&Response::error(id, op, code, message), &mut out);
                        }
                        Some(Ok(Inbound::TooLarge { len })) => {
                            tracing::debug!(len, "frame too large; closing the connection");
                            METRICS.decided(Decision::Error, Source::None, ErrorCode::FrameTooLarge);
                            let msg = format!("frame of {len} bytes exceeds the maximum of {MAX_FRAME_LEN}");
                            encode_response(&Response::error(0, 0, ErrorCode::FrameTooLarge, msg.into()), &mut out);
                            reading = false;
                        }
                        Some(Err(e)) => {
                            tracing::debug!(error = %e, "connection read failed");
                            reading = false;
                        }
                        None => reading = false,
                    }
                }
                _ = &mut timer, if reading => {
                    if partial_since.is_some() {
                        tracing::debug!(timeout_ms = self.settings.frame_timeout.as_millis() as u64, "frame not completed in time; closing the connection");
                        reading = false;
                    } else if in_flight.is_empty() {
                        tracing::debug!(idle_ms = self.settings.idle_timeout.as_millis() as u64, "closing an idle connection");
                        reading = false;
                    } else {
                        last_frame = Instant::now();
                    }
                }
                _ = self.token.cancelled(), if reading => reading = false,
            }
            if !out.is_empty() {
                if let Err(e) = wr.write_all_buf(&mut out).await {
                    tracing::debug!(error = %e, "client went away before its response");
                    METRICS.in_flight(-(in_flight.len() as i64));
                    return;
                }
            }
            if reading {
                // A partly received frame must complete within frame_timeout;
                // otherwise the connection may idle for idle_timeout.
                let deadline = if frames.read_buffer().is_empty() {
                    partial_since = None;
                    last_frame + self.settings.idle_timeout
                } else {
                    *partial_since.get_or_insert_with(Instant::now) + self.settings.frame_timeout
                };
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
            }
        }
        let _ = wr.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Client;
    use crate::limiter::Backend;
    use crate::local_store::LocalStore;
    use crate::protocol::{CheckArgs, FailPolicy};

    fn settings() -> ServerSettings {
        ServerSettings {
            max_connections: 8,
            max_in_flight_per_connection: 4,
            shutdown_grace: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(60),
            frame_timeout: Duration::from_secs(1),
        }
    }

    #[tokio::test]
    async fn serves_until_shutdown_then_stops_accepting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let limiter = Arc::new(Limiter::new(Backend::Local, Arc::new(LocalStore::new(1000))));
        let (_keep, reloadable) = watch::channel(Reloadable { bounds: Bounds::default(), limiter });
        let server = tokio::spawn(run(listener, reloadable, settings(), rx));
        let mut c = Client::connect(&path).await.unwrap();
        let args = CheckArgs { key: b"k", limit: 2, window_ms: 60_000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
        let mut decisions = Vec::new();
        for _ in 0..3 {
            decisions.push(c.check(&args).await.unwrap().decision);
        }
        assert_eq!(decisions, [Decision::Allowed, Decision::Allowed, Decision::Denied]);
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(2), server).await.expect("server stops within the grace").unwrap();
        assert!(c.check(&args).await.is_err(), "the connection is closed after shutdown");
    }
}
