//! `ratelimitd bench`: N checks over C connections against a running daemon,
//! each connection with one request in flight, as Nginx workers use it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::client::{Client, ClientError};
use crate::protocol::{CheckArgs, Decision, FailPolicy, Source};

#[derive(Debug, Clone)]
pub struct BenchArgs {
    pub socket: PathBuf,
    pub key: String,
    pub limit: u32,
    pub window_ms: u32,
    pub cost: u32,
    pub on_error: FailPolicy,
    pub local_limit: u32,
    pub requests: u64,
    pub concurrency: usize,
}

/// What one run measured. Latencies are per request, send to response, in µs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BenchReport {
    pub requests: u64,
    pub concurrency: usize,
    pub allowed: u64,
    pub denied: u64,
    pub errors: u64,
    /// Decisions not made by Redis or the memory backend (fail policy, fallback).
    pub degraded: u64,
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
    latencies_us: Vec<u64>,
}

pub async fn run(args: BenchArgs) -> Result<BenchReport, ClientError> {
    let concurrency = args.concurrency.max(1);
    let mut clients = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        clients.push(Client::connect(&args.socket).await?);
    }
    let left = Arc::new(AtomicU64::new(args.requests));
    let args = Arc::new(args);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(concurrency);
    for mut client in clients {
        let left = left.clone();
        let args = args.clone();
        tasks.push(tokio::spawn(async move {
            let check = CheckArgs {
                key: args.key.as_bytes(),
                limit: args.limit,
                window_ms: args.window_ms,
                cost: args.cost,
                on_error: args.on_error,
                local_limit: args.local_limit,
            };
            let mut t = WorkerTally { latencies_us: Vec::with_capacity((args.requests as usize / concurrency) + 1), ..Default::default() };
            while left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
                let sent = Instant::now();
                let r = client.check(&check).await?;
                t.latencies_us.push(sent.elapsed().as_micros() as u64);
                match r.decision {
                    Decision::Allowed => t.allowed += 1,
                    Decision::Denied => t.denied += 1,
                    Decision::Error => t.errors += 1,
                }
                if !matches!(r.source, Source::Redis | Source::Memory | Source::DenialCache | Source::None) {
                    t.degraded += 1;
                }
            }
            Ok::<_, ClientError>(t)
        }));
    }
    let mut total = WorkerTally::default();
    for task in tasks {
        let t = task.await.map_err(|e| ClientError::Io(std::io::Error::other(e)))??;
        total.allowed += t.allowed;
        total.denied += t.denied;
        total.errors += t.errors;
        total.degraded += t.degraded;
        total.latencies_us.extend(t.latencies_us);
    }
    let elapsed = start.elapsed().max(Duration::from_nanos(1));
    total.latencies_us.sort_unstable();
    let pct = |p: f64| -> u64 {
        let l = &total.latencies_us;
        if l.is_empty() {
            return 0;
        }
        l[((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1]
    };
    let done = total.latencies_us.len() as u64;
    Ok(BenchReport {
        requests: done,
        concurrency,
        allowed: total.allowed,
        denied: total.denied,
        errors: total.errors,
        degraded: total.degraded,
        elapsed_s: elapsed.as_secs_f64(),
        rps: done as f64 / elapsed.as_secs_f64(),
        p50_us: pct(0.50),
        p90_us: pct(0.90),
        p99_us: pct(0.99),
        max_us: total.latencies_us.last().copied().unwrap_or(0),
    })
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "requests:    {} over {} connections in {:.3} s", self.requests, self.concurrency, self.elapsed_s)?;
        writeln!(f, "allowed:     {}", self.allowed)?;
        writeln!(f, "denied:      {}", self.denied)?;
        writeln!(f, "errors:      {}", self.errors)?;
        writeln!(f, "degraded:    {} (decided by a fail policy or the local fallback)", self.degraded)?;
        writeln!(f, "throughput:  {:.0} req/s", self.rps)?;
        write!(f, "latency µs:  p50 {}  p90 {}  p99 {}  max {}", self.p50_us, self.p90_us, self.p99_us, self.max_us)
    }
}
