//! The Envoy rate limit service (`envoy.service.ratelimit.v3`, gRPC) on
//! the same daemon as the socket (docs/ENVOY.md): same policies, same
//! pipeline, same windows. A request is `plan`ned (each descriptor to its
//! policy and key by `[envoy]`'s tree), decided as frames of the socket's
//! own protocol by `Limiter::decide`, and answered by `reply`.
//!
//! - `pb`: Envoy's generated types;
//! - `plan`: descriptors to items, keys as the Lua client makes them;
//! - `service`: `ShouldRateLimit`;
//! - `reply`: statuses and headers;
//! - this file: the listeners (TCP and a Unix socket), each connection
//!   holding one of `max_connections` permits.

mod pb;
mod plan;
mod reply;
mod service;

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

use crate::server::Reloadable;



/// Largest request message: 64 descriptors of 16 entries of ~200 bytes
/// fit many times over; a larger one is refused by tonic before it is
/// decoded (RESOURCE_EXHAUSTED).
const MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// Streams one HTTP/2 connection may have open: Envoy multiplexes its
/// requests over a few connections.
const MAX_STREAMS_PER_CONNECTION: u32 = 1024;

/// A connection and the permit it holds until it closes.
struct Capped<T> {
    io: T,
    _permit: OwnedSemaphorePermit,
}

impl<T: Connected> Connected for Capped<T> {
    type ConnectInfo = T::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Capped<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Capped<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// A listener the front accepts on.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// Serves the Envoy API on `listener` until `shutdown`. At most
/// `max_connections` connections at once: the next waits in the listen
/// queue, so a flood of idle connections cannot take the descriptors the
/// socket's clients need.
pub async fn serve(listener: Listener, reloadable: watch::Receiver<Reloadable>, max_connections: usize, shutdown: CancellationToken) {
    let permits = Arc::new(Semaphore::new(max_connections));
    let service = pb::RateLimitServiceServer::new(service::Front { reloadable }).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(service);
    let done = shutdown.clone();
    let result = match listener {
        Listener::Tcp(l) => server.serve_with_incoming_shutdown(accepted(l, permits, |l| Box::pin(async move { l.accept().await.map(|(s, _)| s) })), done.cancelled_owned()).await,
        Listener::Unix(l) => server.serve_with_incoming_shutdown(accepted(l, permits, |l| Box::pin(async move { l.accept().await.map(|(s, _)| s) })), done.cancelled_owned()).await,
    };
    if let Err(e) = result {
        tracing::error!(error = %e, "the Envoy rate limit service stopped");
    }
}

type Accepting<'a, S> = Pin<Box<dyn std::future::Future<Output = io::Result<S>> + Send + 'a>>;

/// The accepted connections of `listener`, each with a permit taken first.
/// An accept error (out of descriptors) is logged at most once a second and
/// retried after 100 ms, never handed to the server as its end.
fn accepted<L, S>(listener: L, permits: Arc<Semaphore>, accept: for<'a> fn(&'a L) -> Accepting<'a, S>) -> impl futures_util::Stream<Item = io::Result<Capped<S>>>
where
    L: Send + Sync + 'static,
    S: Send + 'static,
{
    let log = crate::log_limit::RateLimitedLog::new(Duration::from_secs(1));
    futures_util::stream::unfold((listener, permits, log), move |(l, permits, log)| async move {
        let permit = permits.clone().acquire_owned().await.ok()?;
        loop {
            match accept(&l).await {
                Ok(io) => return Some((Ok(Capped { io, _permit: permit }), (l, permits, log))),
                Err(e) => {
                    if let Some(suppressed) = log.permit() {
                        tracing::warn!(error = %e, suppressed, "the Envoy rate limit service cannot accept a connection; retrying");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    })
}
