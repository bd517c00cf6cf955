//! `ratelimitd bench`: N checks over C connections against a running daemon.
//!
//! By default each connection has one request in flight, as Nginx workers
//! use it. `pipeline` puts up to that many in flight on each connection
//! (a gateway host with many workers in a spike), and `rate` offers a fixed
//! load instead of as much as the daemon takes: requests are sent on a 1 ms
//! tick whether or not earlier ones were answered (open loop), so an
//! overloaded daemon shows up as latency and refusals, not as a slower
//! generator. `distinct_keys` gives every request a key of its own.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::client::{Client, ClientError};
use crate::protocol::{decode_response, encode_policy_request, encode_request_with, Algorithm, CheckArgs, Decision, ErrorCode, FailPolicy, PolicyCheckArgs, Response, Source};

#[derive(Debug, Clone)]
pub struct BenchArgs {
    pub socket: PathBuf,
    pub key: String,
    pub limit: u32,
    pub window_ms: u32,
    pub cost: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
    /// How the limit counts (docs/ALGORITHMS.md).
    pub algorithm: Algorithm,
    pub requests: u64,
    pub concurrency: usize,
    /// Requests in flight on each connection (at most; 1: one at a time).
    pub pipeline: usize,
    /// Offered load in requests per second over all connections; None: as
    /// fast as the daemon answers.
    pub rate: Option<f64>,
    /// Every request its own key (`<key>:<connection>:<n>`).
    pub distinct_keys: bool,
    /// Keys cycled over this many (`<key>:<i>`, i = 0..N): a key space
    /// of N, each key met again every N requests.
    pub key_space: Option<u64>,
    /// Send CHECK_POLICY for this `[[policy]]` (its limit and window are
    /// the daemon's; `limit` and `window_ms` are not sent).
    pub policy: Option<String>,
}

impl BenchArgs {
    /// One check at a time per connection, as fast as answered, one key.
    pub fn new(socket: PathBuf, key: &str, limit: u32, window_ms: u32, requests: u64, concurrency: usize) -> Self {
        Self {
            socket,
            algorithm: Algorithm::Log,
            key: key.to_string(),
            limit,
            window_ms,
            cost: 1,
            on_error: FailPolicy::Closed,
            local_limit: 0,
            requests,
            concurrency,
            pipeline: 1,
            rate: None,
            distinct_keys: false,
            key_space: None,
            policy: None,
        }
    }
}

/// What one run measured. Latencies are per request, send to response, in µs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BenchReport {
    pub requests: u64,
    pub concurrency: usize,
    pub pipeline: usize,
    /// Requests sent per second until the last was sent (with `rate`: what
    /// the generator managed to offer).
    pub offered_rps: f64,
    pub allowed: u64,
    pub denied: u64,
    pub errors: u64,
    /// Decisions not made by Redis or the memory backend (fail policy, fallback).
    pub degraded: u64,
    /// Responses by error code (codes other than OK only).
    pub codes: BTreeMap<String, u64>,
    pub elapsed_s: f64,
    pub rps: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

#[derive(Default)]
struct WorkerTally {
    allowed: u64,
    denied: u64,
    errors: u64,
    degraded: u64,
    codes: BTreeMap<&'static str, u64>,
    latencies_us: Vec<u64>,
    /// When the last request was sent, from the start.
    sending: Duration,
}

impl WorkerTally {
    fn count(&mut self, r: &Response, latency: Duration) {
        self.latencies_us.push(latency.as_micros() as u64);
        match r.decision {
            Decision::Allowed | Decision::ShadowDenied | Decision::ShadowAllowed => self.allowed += 1,
            Decision::Denied => self.denied += 1,
            Decision::Error => self.errors += 1,
        }
        if !matches!(r.source, Source::Redis | Source::Memory | Source::DenialCache | Source::None) {
            self.degraded += 1;
        }
        if r.error != ErrorCode::None {
            *self.codes.entry(r.error.as_str()).or_default() += 1;
        }
    }

    fn add(&mut self, t: WorkerTally) {
        self.allowed += t.allowed;
        self.denied += t.denied;
        self.errors += t.errors;
        self.degraded += t.degraded;
        for (code, n) in t.codes {
            *self.codes.entry(code).or_default() += n;
        }
        self.latencies_us.extend(t.latencies_us);
        self.sending = self.sending.max(t.sending);
    }
}

pub async fn run(args: BenchArgs) -> Result<BenchReport, ClientError> {
    if args.pipeline <= 1 && args.rate.is_none() && !args.distinct_keys && args.key_space.is_none() {
        return run_one_at_a_time(args).await;
    }
    let pipeline = args.pipeline.max(1);
    drive(args, pipeline, |socket| async move { UnixStream::connect(socket).await }, pipelined).await
}

/// Both ways of running: `concurrency` connections opened by `open` (all
/// before the clock starts), each driven by `work` in a task of its own
/// until `args.requests` are spent; their tallies summed into the report.
async fn drive<C, O, W>(args: BenchArgs, pipeline: usize, open: impl Fn(PathBuf) -> O, work: fn(C, usize, usize, Arc<BenchArgs>, Arc<AtomicU64>, Instant) -> W) -> Result<BenchReport, ClientError>
where
    O: std::future::Future<Output = std::io::Result<C>>,
    W: std::future::Future<Output = Result<WorkerTally, ClientError>> + Send + 'static,
{
    let concurrency = args.concurrency.max(1);
    let mut connections = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        connections.push(open(args.socket.clone()).await?);
    }
    let left = Arc::new(AtomicU64::new(args.requests));
    let args = Arc::new(args);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for (n, connection) in connections.into_iter().enumerate() {
        tasks.push(tokio::spawn(work(connection, n, concurrency, args.clone(), left.clone(), start)));
    }
    let mut total = WorkerTally::default();
    for task in tasks {
        total.add(task.await.map_err(|e| ClientError::Io(std::io::Error::other(e)))??);
    }
    Ok(report(total, concurrency, pipeline, start.elapsed()))
}

/// Slots for send times, indexed by request id: more than can ever be in
/// flight on one connection.
const SENT_SLOTS: usize = 1 << 16;

/// One connection: sends while fewer than `pipeline` are in flight (and,
/// with a rate, when due), reads whatever is answered, until `left` is spent
/// and everything is answered.
async fn pipelined(mut stream: UnixStream, conn: usize, conns: usize, args: Arc<BenchArgs>, left: Arc<AtomicU64>, start: Instant) -> Result<WorkerTally, ClientError> {
    let pipeline = args.pipeline.max(1);
    let mut t = WorkerTally { latencies_us: Vec::with_capacity((args.requests as usize / conns) + 1), ..Default::default() };
    let mut sent_at = vec![start; SENT_SLOTS];
    let (mut rbuf, mut wbuf) = (BytesMut::with_capacity(64 * 1024), BytesMut::with_capacity(64 * 1024));
    let mut key = String::with_capacity(args.key.len() + 24);
    let per_conn_rate = args.rate.map(|r| r / conns as f64);
    // At most 2 ms of requests at once: a generator that was not scheduled
    // for a while skips what it missed rather than sending it in one burst.
    let burst = per_conn_rate.map_or(u64::MAX, |r| ((r * 0.002).ceil() as u64).max(1));
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let (mut next_id, mut in_flight, mut sent, mut skipped) = (1u32, 0usize, 0u64, 0u64);
    let mut exhausted = false;
    loop {
        let due = match per_conn_rate {
            Some(r) => {
                let owed = (start.elapsed().as_secs_f64() * r) as u64;
                let behind = owed.saturating_sub(sent + skipped);
                skipped += behind.saturating_sub(burst);
                behind.min(burst)
            }
            None => u64::MAX,
        };
        let room = (pipeline - in_flight).min(due.min(usize::MAX as u64) as usize);
        wbuf.clear();
        let now = Instant::now();
        for _ in 0..room {
            let Some(n) = (!exhausted).then(|| left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).ok()).flatten() else {
                exhausted = true;
                break;
            };
            key.clear();
            key.push_str(&args.key);
            if args.distinct_keys {
                let _ = write!(key, ":{conn}:{sent}");
            } else if let Some(space) = args.key_space {
                let _ = write!(key, ":{}", n % space);
            }
            match &args.policy {
                Some(p) => {
                    let check = PolicyCheckArgs { policy: p.as_bytes(), key: key.as_bytes(), cost: args.cost, on_error: args.on_error, local_limit: args.local_limit };
                    encode_policy_request(next_id, &check, &mut wbuf);
                }
                None => {
                    let check = CheckArgs { key: key.as_bytes(), limit: args.limit, window_ms: args.window_ms, cost: args.cost, on_error: args.on_error, local_limit: args.local_limit };
                    encode_request_with(next_id, &check, args.algorithm, &mut wbuf);
                }
            }
            sent_at[next_id as usize % SENT_SLOTS] = now;
            next_id = next_id.wrapping_add(1).max(1);
            in_flight += 1;
            sent += 1;
        }
        if !wbuf.is_empty() {
            t.sending = now - start;
            stream.write_all(&wbuf).await?;
        }
        if exhausted && in_flight == 0 {
            return Ok(t);
        }
        let paced = per_conn_rate.is_some() && !exhausted;
        tokio::select! {
            read = stream.read_buf(&mut rbuf) => {
                if read? == 0 {
                    return Err(ClientError::Closed);
                }
                let now = Instant::now();
                while let Some(r) = decode_response(&mut rbuf)? {
                    in_flight = in_flight.saturating_sub(1);
                    t.count(&r, now - sent_at[r.id as usize % SENT_SLOTS]);
                }
            }
            _ = tick.tick(), if paced => {}
        }
    }
}

async fn run_one_at_a_time(args: BenchArgs) -> Result<BenchReport, ClientError> {
    drive(args, 1, |socket| async move { Client::connect(&socket).await }, one_at_a_time).await
}

/// One connection with one request in flight, as an Nginx worker uses it.
async fn one_at_a_time(mut client: Client, _conn: usize, conns: usize, args: Arc<BenchArgs>, left: Arc<AtomicU64>, start: Instant) -> Result<WorkerTally, ClientError> {
    let check = CheckArgs {
        key: args.key.as_bytes(),
        limit: args.limit,
        window_ms: args.window_ms,
        cost: args.cost,
        on_error: args.on_error,
        local_limit: args.local_limit,
    };
    let mut t = WorkerTally { latencies_us: Vec::with_capacity((args.requests as usize / conns) + 1), ..Default::default() };
    while left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
        let sent = Instant::now();
        let r = match &args.policy {
            Some(p) => client.check_policy(&PolicyCheckArgs { policy: p.as_bytes(), key: check.key, cost: check.cost, on_error: check.on_error, local_limit: check.local_limit }).await?,
            None => client.check_with(&check, args.algorithm).await?,
        };
        t.count(&r, sent.elapsed());
        t.sending = sent - start;
    }
    Ok(t)
}

fn report(mut total: WorkerTally, concurrency: usize, pipeline: usize, elapsed: Duration) -> BenchReport {
    let elapsed = elapsed.max(Duration::from_nanos(1));
    total.latencies_us.sort_unstable();
    let pct = |p: f64| -> u64 {
        let l = &total.latencies_us;
        if l.is_empty() {
            return 0;
        }
        l[((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1]
    };
    let done = total.latencies_us.len() as u64;
    BenchReport {
        requests: done,
        concurrency,
        pipeline,
        offered_rps: done as f64 / total.sending.max(Duration::from_millis(1)).as_secs_f64(),
        allowed: total.allowed,
        denied: total.denied,
        errors: total.errors,
        degraded: total.degraded,
        codes: total.codes.into_iter().map(|(c, n)| (c.to_string(), n)).collect(),
        elapsed_s: elapsed.as_secs_f64(),
        rps: done as f64 / elapsed.as_secs_f64(),
        p50_us: pct(0.50),
        p90_us: pct(0.90),
        p99_us: pct(0.99),
        max_us: total.latencies_us.last().copied().unwrap_or(0),
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "requests:    {} over {} connections ({} in flight each at most) in {:.3} s", self.requests, self.concurrency, self.pipeline, self.elapsed_s)?;
        writeln!(f, "allowed:     {}", self.allowed)?;
        writeln!(f, "denied:      {}", self.denied)?;
        writeln!(f, "errors:      {}", self.errors)?;
        writeln!(f, "degraded:    {} (decided by a fail policy or the local fallback)", self.degraded)?;
        for (code, n) in &self.codes {
            writeln!(f, "  {code}: {n}")?;
        }
        writeln!(f, "throughput:  {:.0} req/s", self.rps)?;
        write!(f, "latency µs:  p50 {}  p90 {}  p99 {}  max {}", self.p50_us, self.p90_us, self.p99_us, self.max_us)
    }
}

/// Where `ratelimitd bench-envoy` sends: the `[envoy]` TCP listener or its
/// Unix socket.
#[derive(Debug, Clone)]
pub enum EnvoyTarget {
    Tcp(std::net::SocketAddr),
    Unix(PathBuf),
}

/// `ratelimitd bench-envoy`: `ShouldRateLimit` requests of one descriptor
/// over C HTTP/2 connections, one in flight on each (as `bench` sends to
/// the socket), to compare the gRPC front with the socket in one run.
#[derive(Debug, Clone)]
pub struct EnvoyBenchArgs {
    pub target: EnvoyTarget,
    pub domain: String,
    pub key: String,
    /// The descriptor's one entry's value; with `key_space`, `<value>:<i>`.
    pub value: String,
    pub requests: u64,
    pub concurrency: usize,
    pub key_space: Option<u64>,
}

pub async fn run_envoy(args: EnvoyBenchArgs) -> Result<BenchReport, ClientError> {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{rate_limit_descriptor::Entry, RateLimitDescriptor};
    use envoy_types::pb::envoy::service::ratelimit::v3::{rate_limit_response::Code, rate_limit_service_client::RateLimitServiceClient, RateLimitRequest};
    let concurrency = args.concurrency.max(1);
    let mut clients = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        clients.push(RateLimitServiceClient::new(envoy_channel(&args.target).await?));
    }
    let left = Arc::new(AtomicU64::new(args.requests));
    let args = Arc::new(args);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for mut client in clients {
        let (left, args) = (left.clone(), args.clone());
        tasks.push(tokio::spawn(async move {
            let mut t = WorkerTally { latencies_us: Vec::with_capacity((args.requests as usize / concurrency) + 1), ..Default::default() };
            while let Ok(n) = left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)) {
                let value = match args.key_space {
                    Some(space) => format!("{}:{}", args.value, n % space),
                    None => args.value.clone(),
                };
                let request = RateLimitRequest { domain: args.domain.clone(), descriptors: vec![RateLimitDescriptor { entries: vec![Entry { key: args.key.clone(), value }], ..Default::default() }], hits_addend: 1 };
                let sent = Instant::now();
                let answer = client.should_rate_limit(request).await;
                t.latencies_us.push(sent.elapsed().as_micros() as u64);
                t.sending = sent - start;
                match answer {
                    Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => t.allowed += 1,
                    Ok(_) => t.denied += 1,
                    Err(status) => {
                        t.errors += 1;
                        *t.codes.entry(grpc_code_name(status.code())).or_default() += 1;
                    }
                }
            }
            Ok::<_, ClientError>(t)
        }));
    }
    let mut total = WorkerTally::default();
    for task in tasks {
        total.add(task.await.map_err(|e| ClientError::Io(std::io::Error::other(e)))??);
    }
    Ok(report(total, concurrency, 1, start.elapsed()))
}

/// One HTTP/2 connection to `target` (also the tests' gRPC client).
pub async fn envoy_channel(target: &EnvoyTarget) -> Result<tonic::transport::Channel, ClientError> {
    let io = |e: tonic::transport::Error| ClientError::Io(std::io::Error::other(e));
    match target {
        EnvoyTarget::Tcp(addr) => tonic::transport::Endpoint::from_shared(format!("http://{addr}")).map_err(io)?.connect().await.map_err(io),
        EnvoyTarget::Unix(path) => {
            let path = path.clone();
            tonic::transport::Endpoint::from_static("http://[::]:50051")
                .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                    let path = path.clone();
                    async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(UnixStream::connect(path).await?)) }
                }))
                .await
                .map_err(io)
        }
    }
}

fn grpc_code_name(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
        tonic::Code::Unavailable => "UNAVAILABLE",
        tonic::Code::FailedPrecondition => "FAILED_PRECONDITION",
        tonic::Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        tonic::Code::Internal => "INTERNAL",
        _ => "OTHER",
    }
}
