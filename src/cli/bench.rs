//! `ratelimitd bench` and `bench-envoy`: load for a running daemon, over
//! its socket or its Envoy rate limit service.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use ratelimitd::bench::{self, BenchArgs, EnvoyBenchArgs, EnvoyTarget};

use super::query::CheckOpts;

#[derive(Args)]
pub struct BenchEnvoyArgs {
    /// The [envoy] listen address (HOST:PORT) or socket path.
    #[arg(long)]
    target: String,
    #[arg(long)]
    domain: String,
    /// The descriptor's one entry, KEY=VALUE.
    #[arg(long)]
    descriptor: String,
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Cycle the values over N (VALUE:0 .. VALUE:N-1).
    #[arg(long)]
    keys: Option<u64>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct BenchCommandArgs {
    #[command(flatten)]
    check: CheckOpts,
    /// Total requests.
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    /// Connections.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Requests in flight on each connection at most (1: one at a time, as an Nginx worker).
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Offer this many requests per second over all connections, sent on a 1 ms tick
    /// whether or not earlier ones were answered; without it, as fast as answered.
    #[arg(long)]
    rate: Option<f64>,
    /// Give every request a key of its own (KEY:CONNECTION:N).
    #[arg(long)]
    distinct_keys: bool,
    /// Cycle the keys over N (KEY:0 .. KEY:N-1).
    #[arg(long)]
    keys: Option<u64>,
    /// Send CHECK_POLICY for this configured [[policy]] instead of an inline check (--limit and --window-ms are then not sent).
    #[arg(long)]
    policy: Option<String>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run_envoy(BenchEnvoyArgs { target, domain, descriptor, requests, concurrency, keys, json }: BenchEnvoyArgs) -> anyhow::Result<ExitCode> {
    let Some((key, value)) = descriptor.split_once('=') else { anyhow::bail!("--descriptor must be KEY=VALUE") };
    let target = match target.parse() {
        Ok(addr) => EnvoyTarget::Tcp(addr),
        Err(_) => EnvoyTarget::Unix(target.into()),
    };
    let args = EnvoyBenchArgs { target, domain, key: key.into(), value: value.into(), requests, concurrency, key_space: keys };
    let report = super::common::runtime()?.block_on(bench::run_envoy(args)).context("bench-envoy")?;
    print_report(&report, json)
}

pub fn run(BenchCommandArgs { check, requests, concurrency, pipeline, rate, distinct_keys, keys, policy, json }: BenchCommandArgs) -> anyhow::Result<ExitCode> {
    if rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
        anyhow::bail!("--rate must be a positive number of requests per second");
    }
    let socket = check.socket.clone();
    let args = BenchArgs {
        socket: check.socket,
        key: check.key,
        limit: check.limit,
        window_ms: check.window_ms,
        cost: check.cost,
        on_error: check.on_error,
        local_limit: check.local_limit,
        algorithm: check.algorithm,
        requests,
        concurrency,
        pipeline,
        rate,
        distinct_keys,
        key_space: keys,
        policy,
    };
    let report = super::common::runtime()?.block_on(bench::run(args)).with_context(|| format!("bench against {}", socket.display()))?;
    print_report(&report, json)
}

/// The report as text, or as one JSON object.
fn print_report(report: &(impl serde::Serialize + std::fmt::Display), json: bool) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}
