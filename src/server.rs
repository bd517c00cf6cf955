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

use bytes::{Buf, BytesMut};
use futures_util::stream::FuturesUnordered;
use futures_util::task::AtomicWaker;
use futures_util::{FutureExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::config::ServerConfig;
use crate::decision::{count_undecoded, Limiter};
use crate::log_limit::RateLimitedLog;
use crate::metrics::{CloseReason, METRICS};
use crate::protocol::{encode_response, next_frame, parse_request, too_large, truncated, Bounds, ErrorCode, Frame, Inbound, LoggedKey, Request, Response};

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

/// Why a connection ends before it has answered all it took.
enum Abort {
    /// The client went away, or its socket failed, with responses unsent.
    Gone(Box<dyn fmt::Display + Send>),
    /// Responses wait and none could be written for `write_timeout`.
    WriteTimeout,
}

/// One connection's state between the steps of `Handler::serve`: read,
/// frames, write, timers.
struct Conn<'h> {
    settings: &'h ServerConfig,
    shared: &'h Shared,
    slot: &'h SlotGuard,
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    inbuf: BytesMut,
    out: BytesMut,
    /// The frames taken from now on are validated against these.
    bounds: Bounds,
    /// False once the connection is to close: no more frames are taken;
    /// what is in flight is answered first.
    reading: bool,
    /// Since when nothing is in flight or buffered either way.
    idle_since: Option<Instant>,
    /// Since when a partial frame waits while the daemon reads.
    partial_since: Option<Instant>,
    /// Since when responses wait unwritten, or the last write that progressed.
    write_since: Instant,
    /// Whether responses were left unwritten at the last look.
    waiting: bool,
}

impl Handler {
    async fn run(self, stream: UnixStream) {
        METRICS.connection_opened();
        self.serve(stream).await;
        METRICS.connection_closed();
    }

    /// The steps, in a loop: take the frames received (`Conn::next_request`),
    /// write what the socket takes (`Conn::write_now`), arm the timer
    /// (`Conn::deadline`), then wait for whichever comes first: a request
    /// from the acceptor, decided responses, room to write, bytes to read,
    /// the timer.
    async fn serve(mut self, stream: UnixStream) {
        let (rd, wr) = stream.into_split();
        let Reloadable { bounds, mut limiter, .. } = self.reloadable.borrow_and_update().clone();
        // Idle since it was accepted (as the slot says already).
        let start = self.slot.accepted;
        let mut c = Conn {
            settings: &self.shared.settings,
            shared: &self.shared,
            slot: &self.slot,
            rd,
            wr,
            inbuf: BytesMut::with_capacity(READ_RESERVE),
            out: BytesMut::with_capacity(1024),
            bounds,
            reading: true,
            idle_since: Some(start),
            partial_since: None,
            write_since: start,
            waiting: false,
        };
        let mut in_flight = FuturesUnordered::new();
        let timer = tokio::time::sleep_until(start + c.settings.idle_timeout);
        tokio::pin!(timer);
        let aborted = loop {
            if c.reading {
                // Before the next frame: a reload's bounds apply to it.
                if self.reloadable.has_changed().unwrap_or(false) {
                    let current = self.reloadable.borrow_and_update().clone();
                    (c.bounds, limiter) = (current.bounds, current.limiter);
                }
                let mut took = false;
                while let Some(frame) = c.next_frame(in_flight.len()) {
                    took = true;
                    if let Some(req) = c.answer_or_take(frame) {
                        METRICS.in_flight(1);
                        in_flight.push(limiter.clone().decide(req));
                    }
                }
                if took {
                    crate::spin::frames_read();
                    // What is left, if anything, came with the last read.
                    c.partial_since = None;
                }
            }
            let can_read = c.has_room(in_flight.len());
            c.frame_clock(can_read);
            if let Err(e) = c.write_now() {
                break Some(e);
            }
            if !c.reading && in_flight.is_empty() && c.out.is_empty() {
                break None;
            }
            c.publish_idle(in_flight.is_empty());
            if let Some(d) = c.deadline() {
                if timer.deadline() != d {
                    timer.as_mut().reset(d);
                }
            }
            if can_read && c.inbuf.capacity() - c.inbuf.len() < READ_RESERVE / 4 {
                c.inbuf.reserve(READ_RESERVE);
            }
            tokio::select! {
                biased;
                asked = Asked(c.slot.slot()), if c.reading => c.on_asked(asked),
                Some(resp) = in_flight.next(), if !in_flight.is_empty() => {
                    encode_response(&resp, &mut c.out);
                    let mut done = 1;
                    // Batch whatever else is ready into the same write.
                    while let Some(Some(resp)) = in_flight.next().now_or_never() {
                        encode_response(&resp, &mut c.out);
                        done += 1;
                    }
                    METRICS.in_flight(-done);
                }
                written = c.wr.write_buf(&mut c.out), if !c.out.is_empty() => match written {
                    Ok(0) => break Some(Abort::Gone(Box::new("the socket took no byte"))),
                    Ok(_) => c.write_since = Instant::now(),
                    Err(e) => break Some(Abort::Gone(Box::new(e))),
                },
                read = c.rd.read_buf(&mut c.inbuf), if can_read => c.on_read(read),
                _ = &mut timer => {
                    if let Err(e) = c.on_timer(&mut timer) {
                        break Some(e);
                    }
                }
            }
        };
        match aborted {
            None => {
                let _ = c.wr.shutdown().await;
                return;
            }
            Some(Abort::Gone(error)) => tracing::debug!(%error, "client went away before its response"),
            Some(Abort::WriteTimeout) => {
                let s = c.settings;
                tracing::debug!(timeout_ms = s.write_timeout.as_millis() as u64, unsent = c.out.len(), "the client does not read its responses; closing the connection");
                METRICS.connection_closed_by_daemon(CloseReason::WriteTimeout);
            }
        }
        // Decided or not, none of these will be answered.
        METRICS.in_flight(-(in_flight.len() as i64));
    }
}

impl Conn<'_> {
    /// Whether another frame may be taken: reading, and within the
    /// connection's limits of requests in flight and unsent bytes.
    fn has_room(&self, in_flight: usize) -> bool {
        self.reading && in_flight < self.settings.max_in_flight_per_connection && self.out.len() < OUT_HIGH_WATER
    }

    /// Frames step: the next whole frame received, while there is room for it.
    fn next_frame(&mut self, in_flight: usize) -> Option<Frame> {
        if !self.has_room(in_flight) {
            return None;
        }
        next_frame(&mut self.inbuf)
    }

    /// A frame's request to decide; a frame that is none is answered here
    /// (a too-large one also stops the reading).
    fn answer_or_take(&mut self, frame: Frame) -> Option<Request> {
        let body = match frame {
            Frame::Body(body) => body,
            Frame::TooLarge(len) => {
                self.answer_too_large(len);
                return None;
            }
        };
        match parse_request(body.clone(), &self.bounds) {
            Inbound::Request(req) => Some(req),
            Inbound::Invalid { id, op, code, message } => {
                if let Some(suppressed) = self.shared.invalid_logs[code.index()].permit() {
                    tracing::error!(
                        id,
                        %code,
                        reason = %message,
                        key = %LoggedKey(&body),
                        suppressed,
                        "invalid request refused, no decision made: the client's configuration or code is wrong"
                    );
                }
                self.answer(Response::error(id, op, code, message));
                None
            }
            // Not from parse_request (next_frame frames), but handled alike.
            Inbound::TooLarge { len } => {
                self.answer_too_large(len);
                None
            }
        }
    }

    /// Answers a frame whose length prefix is beyond the protocol's most; the
    /// connection is then closed.
    fn answer_too_large(&mut self, len: usize) {
        tracing::debug!(len, "frame too large; closing the connection");
        self.answer(too_large(len));
        self.reading = false;
    }

    /// An answer made without a decision: counted, and queued to write.
    fn answer(&mut self, r: Response) {
        count_undecoded(&r);
        encode_response(&r, &mut self.out);
    }

    /// Timers step: the frame clock runs only while the daemon reads (with
    /// reading paused, the rest of the frame may be waiting in the socket).
    fn frame_clock(&mut self, can_read: bool) {
        if !can_read || self.inbuf.is_empty() {
            self.partial_since = None;
        } else if self.partial_since.is_none() {
            self.partial_since = Some(Instant::now());
        }
    }

    /// Write step: writes at once what the socket takes; the select waits
    /// only for the rest.
    fn write_now(&mut self) -> Result<(), Abort> {
        if !self.out.is_empty() {
            let before = self.out.len();
            loop {
                match self.wr.try_write(&self.out) {
                    Ok(0) => return Err(Abort::Gone(Box::new("the socket took no byte"))),
                    Ok(n) => {
                        self.out.advance(n);
                        if self.out.is_empty() {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(Abort::Gone(Box::new(e))),
                }
            }
            if !self.out.is_empty() && (self.out.len() < before || !self.waiting) {
                self.write_since = Instant::now();
            }
        }
        self.waiting = !self.out.is_empty();
        Ok(())
    }

    /// Tells the acceptor, through the slot, whether the connection is idle
    /// and since when.
    fn publish_idle(&mut self, nothing_in_flight: bool) {
        let idle = nothing_in_flight && self.out.is_empty() && self.inbuf.is_empty();
        if idle != self.idle_since.is_some() {
            self.idle_since = idle.then(Instant::now);
            self.slot.set_idle(self.idle_since);
        }
    }

    /// Timers step: the earliest deadline that applies; none while merely
    /// busy (the timer is then left where it is, and re-armed if it fires).
    fn deadline(&self) -> Option<Instant> {
        let s = self.settings;
        let write = (!self.out.is_empty()).then(|| self.write_since + s.write_timeout);
        let frame = self.partial_since.map(|p| p + s.frame_timeout);
        let idle = self.idle_since.filter(|_| self.reading).map(|i| i + s.idle_timeout);
        [write, frame, idle].into_iter().flatten().min()
    }

    /// Timers step: the timer fired; which deadline passed decides.
    fn on_timer(&mut self, timer: &mut Pin<&mut tokio::time::Sleep>) -> Result<(), Abort> {
        let s = self.settings;
        let now = Instant::now();
        if !self.out.is_empty() && now >= self.write_since + s.write_timeout {
            return Err(Abort::WriteTimeout);
        }
        if self.partial_since.is_some_and(|p| now >= p + s.frame_timeout) {
            tracing::debug!(timeout_ms = s.frame_timeout.as_millis() as u64, "frame not completed in time; closing the connection");
            METRICS.connection_closed_by_daemon(CloseReason::FrameTimeout);
            self.reading = false;
            self.partial_since = None;
            self.inbuf.clear();
        } else if self.reading && self.idle_since.is_some_and(|i| now >= i + s.idle_timeout) {
            tracing::debug!(idle_ms = s.idle_timeout.as_millis() as u64, "closing an idle connection");
            METRICS.connection_closed_by_daemon(CloseReason::Idle);
            self.reading = false;
        } else {
            // Fired while busy, with no deadline of its own.
            timer.as_mut().reset(now + s.idle_timeout);
        }
        Ok(())
    }

    /// Read step: what a read brought. At the end of the stream a frame it
    /// cut off is answered.
    fn on_read(&mut self, read: std::io::Result<usize>) {
        match read {
            Ok(0) => {
                self.reading = false;
                self.partial_since = None;
                if let Some(Inbound::Invalid { id, op, code, message }) = truncated(&mut self.inbuf) {
                    tracing::debug!(id, %code, reason = %message, "the stream ended inside a frame");
                    self.answer(Response::error(id, op, code, message));
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "connection read failed");
                self.reading = false;
                self.inbuf.clear();
            }
        }
    }

    /// The acceptor asked: stop (shutdown), or close if still idle, and
    /// long enough (it may have taken a request since the acceptor looked,
    /// or one may be waiting in the socket right now).
    fn on_asked(&mut self, asked: u8) {
        if asked & STOP != 0 {
            self.reading = false;
            return;
        }
        self.slot.slot().asked.fetch_and(!EVICT, Ordering::AcqRel);
        if self.idle_since.is_some_and(|t| t.elapsed() >= EVICTABLE_AFTER) && !matches!(self.rd.try_read_buf(&mut self.inbuf), Ok(n) if n > 0) {
            tracing::debug!(idle_ms = self.idle_since.map_or(0, |t| t.elapsed().as_millis() as u64), "connection cap reached: closing the connection idle the longest for a new one");
            METRICS.connection_closed_by_daemon(CloseReason::Evicted);
            self.reading = false;
        }
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
