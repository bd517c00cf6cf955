//! `ratelimitd query`: one decision asked of a running daemon; and the
//! check's flags, which `bench` shares.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use ratelimitd::client::Client;
use ratelimitd::protocol::{Algorithm, CheckArgs, FailPolicy};

#[derive(Args)]
pub struct CheckOpts {
    /// The daemon's socket.
    #[arg(long, default_value = "/run/ratelimitd/ratelimitd.sock")]
    pub socket: PathBuf,
    #[arg(long)]
    pub key: String,
    /// Admissions allowed per window.
    #[arg(long)]
    pub limit: u32,
    /// Window length in ms.
    #[arg(long)]
    pub window_ms: u32,
    #[arg(long, default_value_t = 1)]
    pub cost: u32,
    /// Fail policy when Redis cannot decide: open, closed or local. Open
    /// by default, as in the Lua client (docs/CONFIG.md, "on_error").
    #[arg(long, default_value = "open")]
    pub on_error: FailPolicy,
    /// Quota of the local fallback (with --on-error local).
    #[arg(long, default_value_t = 0)]
    pub local_limit: u32,
    /// How the limit counts: log, ring, gcra, sliding_counter, fixed (docs/ALGORITHMS.md).
    #[arg(long, default_value = "log")]
    pub algorithm: Algorithm,
}

impl CheckOpts {
    fn args(&self) -> CheckArgs<'_> {
        CheckArgs {
            key: self.key.as_bytes(),
            limit: self.limit,
            window_ms: self.window_ms,
            cost: self.cost,
            on_error: self.on_error,
            local_limit: self.local_limit,
        }
    }
}

#[derive(Args)]
pub struct QueryArgs {
    #[command(flatten)]
    check: CheckOpts,
    /// Print the response as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(QueryArgs { check, json }: QueryArgs) -> anyhow::Result<ExitCode> {
    let r = super::common::runtime()?.block_on(async {
        let mut c = Client::connect(&check.socket).await.with_context(|| format!("connect to {}", check.socket.display()))?;
        Ok::<_, anyhow::Error>(c.check_with(&check.args(), check.algorithm).await?)
    })?;
    if json {
        let v = serde_json::json!({
            "decision": r.decision.as_str(),
            "source": r.source.as_str(),
            "count": r.count,
            "remaining": r.remaining,
            "retry_after_ms": r.retry_after_ms,
            "reset_ms": r.reset_ms,
            "error": r.error.as_str(),
            "message": r.message,
        });
        println!("{v}");
    } else {
        println!(
            "{} (source {}) count={} remaining={} retry_after_ms={} reset_ms={}",
            r.decision.as_str(),
            r.source.as_str(),
            r.count,
            r.remaining,
            r.retry_after_ms,
            r.reset_ms
        );
        if r.error as u16 != 0 {
            println!("error {}: {}", r.error, r.message);
        }
    }
    // Exit status for scripts: 0 allowed, 1 denied, 2 error.
    Ok(ExitCode::from(r.decision.to_wire()))
}
