//! The command line: one file per command, each taking its own flags
//! (clap `Args`) and printing its own output. `run` only dispatches.
//! anyhow is the error type here and in main.rs only: the library's
//! errors are typed.

use std::process::ExitCode;

use clap::Subcommand;

mod admin;
mod bans;
mod bench;
mod check_config;
mod common;
mod config_show;
mod keys;
mod logging;
mod overrides;
mod query;
mod serve;
mod top;

#[derive(Subcommand)]
pub enum Command {
    /// Run the daemon.
    Serve(serve::ServeArgs),
    /// Validate a configuration file and exit; with --nginx, also check
    /// that every policy name the nginx configuration uses is in it (exit 1
    /// if one is not).
    CheckConfig(check_config::CheckConfigArgs),
    /// Print the configuration as the daemon would hold it, as TOML in the
    /// file's own terms (what GET /config shows of the running one),
    /// secrets left out.
    ConfigShow(config_show::ConfigShowArgs),
    /// Ask a running daemon for one decision.
    Query(query::QueryArgs),
    /// Show a key's windows in Redis (same key derivation as the daemon).
    Inspect(keys::InspectArgs),
    /// Delete a key's windows in Redis: its quota is whole again.
    Reset(keys::ResetArgs),
    /// Set, list or delete overrides with an expiry, applied by every daemon
    /// sharing the Redis (through the admin API, `[admin] listen`).
    Override(overrides::OverrideArgs),
    /// List, show or lift the penalty box's bans (through the admin API,
    /// `[admin] listen`): a lift applies on every daemon sharing the Redis.
    Ban(bans::BanArgs),
    /// A live view of a running daemon (like top): decisions per second per
    /// policy and outcome, Redis latency, breaker, in-flight requests, the
    /// keys refused most in the last minute. Reads GET /top.json on the
    /// metrics endpoint.
    Top(top::TopArgs),
    /// Load a running daemon's Envoy rate limit service ([envoy]): N
    /// ShouldRateLimit requests of one descriptor over C connections.
    BenchEnvoy(bench::BenchEnvoyArgs),
    /// Load a running daemon: N requests over C connections.
    Bench(bench::BenchCommandArgs),
}

/// Runs one command; its exit status on success (`query` exits 1 for
/// "denied", `check-config` 1 for a finding).
pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Serve(a) => serve::run(a),
        Command::CheckConfig(a) => check_config::run(a),
        Command::ConfigShow(a) => config_show::run(a),
        Command::Query(a) => query::run(a),
        Command::Inspect(a) => keys::inspect(a),
        Command::Reset(a) => keys::reset(a),
        Command::Override(a) => overrides::run(a),
        Command::Ban(a) => bans::run(a),
        Command::Top(a) => top::run(a),
        Command::BenchEnvoy(a) => bench::run_envoy(a),
        Command::Bench(a) => bench::run(a),
    }
}
