//! The `ratelimitd` command line: parse the arguments, run the command
//! (src/cli/, one file per command); the work is done in the library.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;

mod cli;

/// jemalloc, built with a background thread that hands freed pages back to
/// the kernel after 1 s (`.cargo/config.toml`): after a flood of keys has
/// expired, glibc's malloc kept the daemon's RSS at its peak for good
/// (docs/OPERATIONS.md, "The daemon's memory").
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(name = "ratelimitd", version, about = "Sliding-window rate limits for Nginx, shared through Redis")]
struct Cli {
    #[command(subcommand)]
    command: cli::Command,
}

fn main() -> ExitCode {
    match cli::run(Cli::parse().command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ratelimitd: {e:#}");
            // 2, not 1: `query` exits 1 for "denied".
            ExitCode::from(2)
        }
    }
}
