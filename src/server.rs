//! Accepts connections on the Unix socket and serves each with a `Handler`.
//!
//! `run` takes the shutdown future so that `main` and the tests drive it the
//! same way. On shutdown the listener stops accepting, every handler stops
//! reading, answers what it has in flight and closes; the whole drain is
//! bounded by a grace period.
//!
//! Every connection holds one of `max_connections` slots: a few atomics its
//! handler sets when the connection turns idle or busy (a relaxed store
//! each, no lock). The acceptor reads them only when every slot is taken,
//! to ask the connection idle the longest (and for at least
//! `EVICTABLE_AFTER`) to close for the new one.
//!
//! A handler never waits on one direction only: reading frames, deciding
//! them and writing responses are branches of one `select!`, and every wait
//! has a deadline. It stops reading a connection while `OUT_HIGH_WATER`
//! bytes of responses are unsent (or `max_in_flight_per_connection`
//! requests undecided), and closes it when responses wait and none could be
//! written for `write_timeout`: a client that does not read its answers.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::stream::FuturesUnordered;
use futures_util::task::AtomicWaker;
use futures_util::{FutureExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::codec::Decoder;
use tokio_util::task::TaskTracker;

use crate::config::ServerConfig;
use crate::decision::{count_undecoded, Limiter};
use crate::log_limit::RateLimitedLog;
use crate::metrics::{CloseReason, METRICS};
use crate::protocol::{
    encode_response, parse_request, Bounds, ErrorCode, Inbound, RequestCodec, Response, LEN_PREFIX, LIMIT_ENTRY_LEN, MAX_FRAME_LEN, OP_CHECK_POLICY, POLICY_HEADER_LEN, POLICY_ITEM_LEN,
    REQUEST_HEADER_LEN,
};

/// How long a connection must have been idle before the acceptor, at the
/// connection cap, may close it for a new one. A connection used more
/// recently is in use (a pooled connection between two requests of a busy
/// worker): closing it would only move the wait to that worker's next
/// request. So at the cap a new client waits at most about this long while
/// any connection is idle, instead of `idle_timeout`.
const EVICTABLE_AFTER: Duration = Duration::from_secs(1);
/// How often the acceptor, at the cap with no connection evictable yet,
/// looks again.
const EVICT_RESCAN: Duration = Duration::from_millis(25);
/// Unsent response bytes past which a connection's frames are not read
/// (about 2000 responses): what a client that does not read can make the
/// daemon hold, besides its in-flight requests.
const OUT_HIGH_WATER: usize = 64 * 1024;
/// Free space the read buffer is given before each read.
const READ_RESERVE: usize = 4096;

/// What a configuration reload replaces for the frames still to come: the
/// bounds they are validated against and the limiter that decides them.
#[derive(Debug, Clone)]
pub struct Reloadable {
    pub bounds: Bounds,
    pub limiter: Arc<Limiter>,
    /// `[envoy]` in force: its descriptor tree names the limiter's policies,
    /// so both change in one reload.
    pub envoy: Option<Arc<crate::config::EnvoyConfig>>,
}

/// Serves `listener` until `shutdown` completes, then drains. Each request
/// is validated and decided with what is current on `reloadable` when its
/// frame is read; a reload may send a new one at any time.
pub async fn run(listener: UnixListener, reloadable: watch::Receiver<Reloadable>, settings: ServerConfig, shutdown: impl Future) {
    let tracker = TaskTracker::new();
    let shared = Arc::new(Shared {
        slots: Slots::new(settings.max_connections),
        // One line a second per code.
        invalid_logs: ErrorCode::ALL.iter().map(|_| RateLimitedLog::new(Duration::from_secs(1))).collect(),
        settings: settings.clone(),
    });
    let acceptor = Listener { listener, reloadable, shared: shared.clone(), tracker: tracker.clone(), cap_log: RateLimitedLog::new(Duration::from_secs(10)) };
    tokio::select! {
        _ = acceptor.accept_loop() => {}
        _ = shutdown => tracing::info!("shutting down: no new connections; draining"),
    }
    // Close the listener now: new clients get "connection refused" (or, with
    // socket activation, wait in systemd's queue for the next daemon) rather
    // than a connection nobody will serve.
    drop(acceptor);
    shared.slots.ask_all(STOP);
    tracker.close();
    if tokio::time::timeout(settings.shutdown_grace, tracker.wait()).await.is_err() {
        tracing::warn!(
            grace_ms = settings.shutdown_grace.as_millis() as u64,
            still_open = tracker.len(),
            "shutdown grace period expired; dropping the connections still open"
        );
    }
}

/// What every handler shares.
struct Shared {
    /// `[server]`, fixed for the daemon's life.
    settings: ServerConfig,
    slots: Arc<Slots>,
    /// Invalid requests, one log per code (indexed like `ErrorCode::ALL`).
    invalid_logs: Box<[RateLimitedLog]>,
}

/// `Slot::idle_since_us` of a connection that is busy, or of a free slot.
const NOT_IDLE: u64 = u64::MAX;
/// `Slot::asked` bits: close if still idle (the acceptor needs the slot).
const EVICT: u8 = 1;
/// `Slot::asked` bits: stop reading, answer what is in flight, close.
const STOP: u8 = 2;

/// One connection's state as the acceptor sees it.
struct Slot {
    /// When the connection became idle (nothing in flight, nothing buffered
    /// either way), in µs since `Slots::epoch`; `NOT_IDLE` otherwise.
    idle_since_us: AtomicU64,
    /// `EVICT` and `STOP` requests to the handler.
    asked: AtomicU8,
    /// The handler's task, woken when `asked` changes.
    waker: AtomicWaker,
}

/// The connection slots: as many as `max_connections`, allocated at start.
struct Slots {
    slots: Box<[Slot]>,
    /// Indexes of the free slots; touched once per connection, never per request.
    free: Mutex<Vec<usize>>,
    /// One permit per free slot: the acceptor waits on it at the cap.
    permits: Arc<Semaphore>,
    epoch: Instant,
}

impl Slots {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Self {
            slots: (0..n).map(|_| Slot { idle_since_us: AtomicU64::new(NOT_IDLE), asked: AtomicU8::new(0), waker: AtomicWaker::new() }).collect(),
            free: Mutex::new((0..n).rev().collect()),
            permits: Arc::new(Semaphore::new(n)),
            epoch: Instant::now(),
        })
    }

    fn us(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// A slot for a connection accepted at `accepted`: idle from then on,
    /// until its handler reads a byte.
    fn take(self: &Arc<Self>, permit: OwnedSemaphorePermit, accepted: Instant) -> SlotGuard {
        let index = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop().expect("a permit is a free slot");
        let slot = &self.slots[index];
        slot.idle_since_us.store(self.us(accepted), Ordering::Relaxed);
        slot.asked.store(0, Ordering::Relaxed);
        SlotGuard { slots: self.clone(), index, accepted, _permit: permit }
    }

    /// The occupied slot idle the longest, with when it became idle (µs).
    fn longest_idle(&self) -> Option<(usize, u64)> {
        let mut best: Option<(usize, u64)> = None;
        for (i, s) in self.slots.iter().enumerate() {
            let since = s.idle_since_us.load(Ordering::Relaxed);
            if since != NOT_IDLE && best.map_or(true, |(_, b)| since < b) {
                best = Some((i, since));
            }
        }
        best
    }

    fn ask(&self, index: usize, bits: u8) {
        let s = &self.slots[index];
        s.asked.fetch_or(bits, Ordering::AcqRel);
        s.waker.wake();
    }

    fn ask_all(&self, bits: u8) {
        for i in 0..self.slots.len() {
            self.ask(i, bits);
        }
    }
}

/// A connection's hold on its slot; frees it (and its permit) when dropped.
struct SlotGuard {
    slots: Arc<Slots>,
    index: usize,
    accepted: Instant,
    _permit: OwnedSemaphorePermit,
}

impl SlotGuard {
    fn slot(&self) -> &Slot {
        &self.slots.slots[self.index]
    }

    /// Publishes whether the connection is idle, and since when.
    fn set_idle(&self, since: Option<Instant>) {
        let us = since.map_or(NOT_IDLE, |t| self.slots.us(t));
        self.slot().idle_since_us.store(us, Ordering::Relaxed);
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.slot().idle_since_us.store(NOT_IDLE, Ordering::Relaxed);
        self.slots.free.lock().unwrap_or_else(|e| e.into_inner()).push(self.index);
        // The permit is released after this, so whoever gets it finds the index.
    }
}

/// Completes with the `asked` bits once any is set. Lock-free: an atomic
/// load and the waker's registration.
struct Asked<'a>(&'a Slot);

impl Future for Asked<'_> {
    type Output = u8;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u8> {
        let slot = self.0;
        let bits = slot.asked.load(Ordering::Acquire);
        if bits != 0 {
            return Poll::Ready(bits);
        }
        slot.waker.register(cx.waker());
        match slot.asked.load(Ordering::Acquire) {
            0 => Poll::Pending,
            bits => Poll::Ready(bits),
        }
    }
}

struct Listener {
    listener: UnixListener,
    reloadable: watch::Receiver<Reloadable>,
    shared: Arc<Shared>,
    tracker: TaskTracker,
    cap_log: RateLimitedLog,
}

impl Listener {
    /// Never returns: one failed accept (EMFILE, ...) is logged and retried
    /// after a pause, never fatal.
    async fn accept_loop(&self) {
        let mut backoff = Duration::from_millis(1);
        loop {
            let stream = match self.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "accept failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            backoff = Duration::from_millis(1);
            let permit = match self.shared.slots.permits.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => self.make_room().await,
            };
            // Served from now: a client held in `make_room` is not idle for
            // the time it waited there.
            let accepted = Instant::now();
            let handler = Handler { reloadable: self.reloadable.clone(), shared: self.shared.clone(), slot: self.shared.slots.take(permit, accepted) };
            self.tracker.spawn(handler.run(stream));
        }
    }

    /// Every slot is taken and a client waits: asks the connection idle the
    /// longest to close, once it has been idle for `EVICTABLE_AFTER`, and
    /// returns the first slot freed (by it or by any other connection).
    async fn make_room(&self) -> OwnedSemaphorePermit {
        let slots = &self.shared.slots;
        if let Some(suppressed) = self.cap_log.permit() {
            tracing::warn!(
                max_connections = self.shared.settings.max_connections,
                suppressed,
                "connection cap reached: a new client waits for a slot; the connection idle the longest is closed for it once idle for 1 s"
            );
        }
        let evictable_after_us = EVICTABLE_AFTER.as_micros() as u64;
        loop {
            if let Some((index, since)) = slots.longest_idle() {
                if slots.us(Instant::now()).saturating_sub(since) >= evictable_after_us {
                    slots.ask(index, EVICT);
                }
            }
            if let Ok(Ok(p)) = tokio::time::timeout(EVICT_RESCAN, slots.permits.clone().acquire_owned()).await {
                return p;
            }
        }
    }
}

/// One frame split off the read buffer.
enum Frame {
    Body(Bytes),
    TooLarge(usize),
}

/// The next whole frame in `buf`, if any. The same framing as
/// `RequestCodec::decode`, keeping the body so that an invalid request's key
/// can be logged.
fn next_frame(buf: &mut BytesMut) -> Option<Frame> {
    if buf.len() < LEN_PREFIX {
        return None;
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > MAX_FRAME_LEN {
        buf.clear();
        return Some(Frame::TooLarge(len));
    }
    if buf.len() < LEN_PREFIX + len {
        return None;
    }
    buf.advance(LEN_PREFIX);
    Some(Frame::Body(buf.split_to(len).freeze()))
}

/// Answers a frame whose length prefix is beyond `MAX_FRAME_LEN`; the
/// connection is then closed.
fn answer_too_large(len: usize, out: &mut BytesMut) {
    tracing::debug!(len, "frame too large; closing the connection");
    let msg = format!("frame of {len} bytes exceeds the maximum of {MAX_FRAME_LEN}");
    let r = Response::error(0, 0, ErrorCode::FrameTooLarge, msg.into());
    count_undecoded(&r);
    encode_response(&r, out);
}

/// The key of a request body, for logs: escaped, at most 128 bytes shown;
/// `-` when the body does not hold a key of the length it says.
struct KeyOf<'a>(&'a [u8]);

impl fmt::Display for KeyOf<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        let key = if b.len() > 1 && b[1] == OP_CHECK_POLICY {
            // The policy's name, then its key (one item).
            let fixed = POLICY_HEADER_LEN + POLICY_ITEM_LEN;
            if b.len() <= fixed {
                return f.write_str("-");
            }
            let key_len = u16::from_be_bytes([b[fixed - 3], b[fixed - 2]]) as usize;
            let name_len = b[fixed - 1] as usize;
            if fixed + name_len + key_len != b.len() {
                return f.write_str("-");
            }
            write!(f, "{}/", b[fixed..fixed + name_len].escape_ascii())?;
            &b[fixed + name_len..]
        } else {
            let at = REQUEST_HEADER_LEN + LIMIT_ENTRY_LEN;
            if b.len() <= at || u16::from_be_bytes([b[at - 2], b[at - 1]]) as usize != b.len() - at {
                return f.write_str("-");
            }
            &b[at..]
        };
        if key.len() > 128 {
            write!(f, "{}... ({} bytes)", key[..128].escape_ascii(), key.len())
        } else {
            write!(f, "{}", key.escape_ascii())
        }
    }
}

/// The client went away with responses unsent.
fn gone(in_flight: usize, error: &dyn fmt::Display) {
    tracing::debug!(%error, "client went away before its response");
    METRICS.in_flight(-(in_flight as i64));
}

/// Serves one connection: reads frames, decides up to
/// `max_in_flight_per_connection` of them concurrently, and writes each
/// response as soon as it is ready (responses carry the request id, so they
/// may overtake each other). Closes the connection when it has been idle for
/// `idle_timeout`, when a frame stays incomplete for `frame_timeout`, when
/// responses wait and none could be written for `write_timeout`, or when the
/// acceptor needs its slot while it is idle.
struct Handler {
    reloadable: watch::Receiver<Reloadable>,
    shared: Arc<Shared>,
    slot: SlotGuard,
}

impl Handler {
    async fn run(self, stream: UnixStream) {
        METRICS.connection_opened();
        self.serve(stream).await;
        METRICS.connection_closed();
    }

    async fn serve(mut self, stream: UnixStream) {
        let shared = self.shared.clone();
        let s = &shared.settings;
        let (mut rd, mut wr) = stream.into_split();
        let Reloadable { mut bounds, mut limiter, .. } = self.reloadable.borrow_and_update().clone();
        let mut inbuf = BytesMut::with_capacity(READ_RESERVE);
        let mut out = BytesMut::with_capacity(1024);
        let mut in_flight = FuturesUnordered::new();
        // False once the connection is to close: no more frames are taken;
        // what is in flight is answered first.
        let mut reading = true;
        // Idle since it was accepted (as the slot says already).
        let start = self.slot.accepted;
        let mut idle_since = Some(start);
        // Since when a partial frame waits while the daemon reads.
        let mut partial_since: Option<Instant> = None;
        // Since when responses wait unwritten, or the last write that progressed.
        let mut write_since = start;
        // Whether responses were left unwritten at the last look.
        let mut waiting = false;
        let timer = tokio::time::sleep_until(start + s.idle_timeout);
        tokio::pin!(timer);
        loop {
            // Take the frames already received, as far as the limits allow.
            if reading {
                // Before the next frame: a reload's bounds apply to it.
                if self.reloadable.has_changed().unwrap_or(false) {
                    let current = self.reloadable.borrow_and_update().clone();
                    (bounds, limiter) = (current.bounds, current.limiter);
                }
                let mut took = false;
                while in_flight.len() < s.max_in_flight_per_connection && out.len() < OUT_HIGH_WATER {
                    let Some(frame) = next_frame(&mut inbuf) else { break };
                    took = true;
                    match frame {
                        Frame::Body(body) => match parse_request(body.clone(), &bounds) {
                            Inbound::Request(req) => {
                                METRICS.in_flight(1);
                                in_flight.push(limiter.clone().decide(req));
                            }
                            Inbound::Invalid { id, op, code, message } => {
                                if let Some(suppressed) = shared.invalid_logs[code.index()].permit() {
                                    tracing::error!(
                                        id,
                                        %code,
                                        reason = %message,
                                        key = %KeyOf(&body),
                                        suppressed,
                                        "invalid request refused, no decision made: the client's configuration or code is wrong"
                                    );
                                }
                                let r = Response::error(id, op, code, message);
                                count_undecoded(&r);
                                encode_response(&r, &mut out);
                            }
                            // Not from parse_request (next_frame frames), but handled alike.
                            Inbound::TooLarge { len } => {
                                answer_too_large(len, &mut out);
                                reading = false;
                                break;
                            }
                        },
                        Frame::TooLarge(len) => {
                            answer_too_large(len, &mut out);
                            reading = false;
                            break;
                        }
                    }
                }
                if took {
                    // What is left, if anything, came with the last read.
                    partial_since = None;
                }
            }
            let can_read = reading && in_flight.len() < s.max_in_flight_per_connection && out.len() < OUT_HIGH_WATER;
            // The frame clock runs only while the daemon reads: with reading
            // paused, the rest of the frame may be waiting in the socket.
            if !can_read || inbuf.is_empty() {
                partial_since = None;
            } else if partial_since.is_none() {
                partial_since = Some(Instant::now());
            }
            if !out.is_empty() {
                // Write at once what the socket takes; wait in the select
                // only for the rest.
                let before = out.len();
                loop {
                    match wr.try_write(&out) {
                        Ok(0) => return gone(in_flight.len(), &"the socket took no byte"),
                        Ok(n) => {
                            out.advance(n);
                            if out.is_empty() {
                                break;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) => return gone(in_flight.len(), &e),
                    }
                }
                if !out.is_empty() && (out.len() < before || !waiting) {
                    write_since = Instant::now();
                }
            }
            waiting = !out.is_empty();
            if !reading && in_flight.is_empty() && out.is_empty() {
                break;
            }
            let idle = in_flight.is_empty() && out.is_empty() && inbuf.is_empty();
            if idle != idle_since.is_some() {
                idle_since = idle.then(Instant::now);
                self.slot.set_idle(idle_since);
            }
            // The earliest deadline that applies; none while merely busy (the
            // timer is then left where it is, and re-armed if it fires).
            let mut deadline: Option<Instant> = None;
            let mut arm = |d: Instant| deadline = Some(deadline.map_or(d, |e: Instant| e.min(d)));
            if !out.is_empty() {
                arm(write_since + s.write_timeout);
            }
            if let Some(p) = partial_since {
                arm(p + s.frame_timeout);
            }
            if let (true, Some(i)) = (reading, idle_since) {
                arm(i + s.idle_timeout);
            }
            if let Some(d) = deadline {
                if timer.deadline() != d {
                    timer.as_mut().reset(d);
                }
            }
            if can_read && inbuf.capacity() - inbuf.len() < READ_RESERVE / 4 {
                inbuf.reserve(READ_RESERVE);
            }
            tokio::select! {
                biased;
                asked = Asked(self.slot.slot()), if reading => {
                    if asked & STOP != 0 {
                        reading = false;
                    } else {
                        self.slot.slot().asked.fetch_and(!EVICT, Ordering::AcqRel);
                        // Only if still idle, and long enough: it may have
                        // taken a request since the acceptor looked, or one
                        // may be waiting in the socket right now.
                        if idle_since.is_some_and(|t| t.elapsed() >= EVICTABLE_AFTER) && !matches!(rd.try_read_buf(&mut inbuf), Ok(n) if n > 0) {
                            tracing::debug!(idle_ms = idle_since.map_or(0, |t| t.elapsed().as_millis() as u64), "connection cap reached: closing the connection idle the longest for a new one");
                            METRICS.connection_closed_by_daemon(CloseReason::Evicted);
                            reading = false;
                        }
                    }
                }
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
                written = wr.write_buf(&mut out), if !out.is_empty() => match written {
                    Ok(0) => return gone(in_flight.len(), &"the socket took no byte"),
                    Ok(_) => write_since = Instant::now(),
                    Err(e) => return gone(in_flight.len(), &e),
                },
                read = rd.read_buf(&mut inbuf), if can_read => match read {
                    Ok(0) => {
                        reading = false;
                        partial_since = None;
                        // A frame cut off by the end of the stream is answered.
                        if let Ok(Some(Inbound::Invalid { id, op, code, message })) = RequestCodec::new(bounds).decode_eof(&mut inbuf) {
                            tracing::debug!(id, %code, reason = %message, "the stream ended inside a frame");
                            let r = Response::error(id, op, code, message);
                            count_undecoded(&r);
                            encode_response(&r, &mut out);
                        }
                        inbuf.clear();
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "connection read failed");
                        reading = false;
                        inbuf.clear();
                    }
                },
                _ = &mut timer => {
                    let now = Instant::now();
                    if !out.is_empty() && now >= write_since + s.write_timeout {
                        tracing::debug!(timeout_ms = s.write_timeout.as_millis() as u64, unsent = out.len(), "the client does not read its responses; closing the connection");
                        METRICS.connection_closed_by_daemon(CloseReason::WriteTimeout);
                        METRICS.in_flight(-(in_flight.len() as i64));
                        return;
                    } else if partial_since.is_some_and(|p| now >= p + s.frame_timeout) {
                        tracing::debug!(timeout_ms = s.frame_timeout.as_millis() as u64, "frame not completed in time; closing the connection");
                        METRICS.connection_closed_by_daemon(CloseReason::FrameTimeout);
                        reading = false;
                        partial_since = None;
                        inbuf.clear();
                    } else if reading && idle_since.is_some_and(|i| now >= i + s.idle_timeout) {
                        tracing::debug!(idle_ms = s.idle_timeout.as_millis() as u64, "closing an idle connection");
                        METRICS.connection_closed_by_daemon(CloseReason::Idle);
                        reading = false;
                    } else {
                        // Fired while busy, with no deadline of its own.
                        timer.as_mut().reset(now + s.idle_timeout);
                    }
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
    use crate::local_store::LocalStore;
    use crate::protocol::{CheckArgs, Decision, FailPolicy};

    fn settings() -> ServerConfig {
        ServerConfig {
            max_connections: 8,
            max_in_flight_per_connection: 4,
            shutdown_grace: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(60),
            frame_timeout: Duration::from_secs(1),
            write_timeout: Duration::from_secs(1),
            ..ServerConfig::default()
        }
    }

    #[test]
    fn frames_are_split_as_the_codec_splits_them() {
        let mut buf = BytesMut::new();
        let args = CheckArgs { key: b"k\x01y", limit: 2, window_ms: 60_000, cost: 1, on_error: FailPolicy::Closed, local_limit: 0 };
        crate::protocol::encode_request(9, &args, &mut buf);
        let whole = buf.clone();
        buf.extend_from_slice(&whole[..7]);
        let Some(Frame::Body(body)) = next_frame(&mut buf) else { panic!("one whole frame") };
        assert_eq!(body.len(), whole.len() - LEN_PREFIX);
        assert_eq!(KeyOf(&body).to_string(), "k\\x01y");
        assert!(next_frame(&mut buf).is_none(), "7 bytes of the next one stay buffered");
        assert_eq!(buf.len(), 7);
        assert_eq!(KeyOf(&body[..20]).to_string(), "-");
        let mut p = BytesMut::new();
        let pargs = crate::protocol::PolicyCheckArgs { policy: b"order", key: b"t\x7f1", cost: 1, on_error: FailPolicy::Open, local_limit: 0 };
        crate::protocol::encode_policy_request(1, &pargs, &mut p);
        assert_eq!(KeyOf(&p[LEN_PREFIX..]).to_string(), "order/t\\x7f1");
        assert_eq!(KeyOf(&p[LEN_PREFIX..p.len() - 1]).to_string(), "-");
        let mut big = BytesMut::from(&(MAX_FRAME_LEN as u32 + 1).to_be_bytes()[..]);
        assert!(matches!(next_frame(&mut big), Some(Frame::TooLarge(n)) if n == MAX_FRAME_LEN + 1));
    }

    #[tokio::test]
    async fn the_longest_idle_slot_is_found_and_freed_slots_are_reused() {
        let slots = Slots::new(3);
        let take = || slots.take(slots.permits.clone().try_acquire_owned().unwrap(), Instant::now());
        let (a, b, c) = (take(), take(), take());
        assert!(slots.permits.clone().try_acquire_owned().is_err(), "three slots, three permits");
        assert_eq!(slots.longest_idle().map(|(i, _)| i), Some(a.index), "idle since accepted: the first is the oldest");
        a.set_idle(None);
        let t = Instant::now();
        b.set_idle(Some(t));
        c.set_idle(Some(t + Duration::from_millis(5)));
        assert_eq!(slots.longest_idle(), Some((b.index, slots.us(t))));
        b.set_idle(None);
        assert_eq!(slots.longest_idle().map(|(i, _)| i), Some(c.index));
        slots.ask(a.index, EVICT);
        assert_eq!(a.slot().asked.load(Ordering::Relaxed), EVICT);
        let freed = a.index;
        drop(a);
        let again = take();
        assert_eq!(again.index, freed);
        assert_eq!(again.slot().asked.load(Ordering::Relaxed), 0, "a new connection does not inherit the old one's requests");
    }

    #[tokio::test]
    async fn serves_until_shutdown_then_stops_accepting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let limiter = Arc::new(Limiter::memory(Arc::new(LocalStore::new(1000))));
        let (_keep, reloadable) = watch::channel(Reloadable { bounds: Bounds::default(), limiter, envoy: None });
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
