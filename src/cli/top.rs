//! `ratelimitd top`: a live view of a running daemon's metrics endpoint.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use ratelimitd::config::Config;
use ratelimitd::top::Output;

#[derive(Args)]
pub struct TopArgs {
    /// Where `[metrics] listen` is read from (without --metrics).
    #[arg(long, short, default_value = super::common::DEFAULT_CONFIG)]
    config: PathBuf,
    /// The metrics endpoint, host:port (instead of the config's `[metrics] listen`).
    #[arg(long)]
    metrics: Option<String>,
    /// Print JSON: one object (rates over --interval), or one line per
    /// --interval when --interval or --count is given.
    #[arg(long)]
    json: bool,
    /// Seconds between refreshes, and the span rates are measured over.
    #[arg(long)]
    interval: Option<f64>,
    /// Stop after this many refreshes (default: until interrupted; 1 for a bare --json).
    #[arg(long)]
    count: Option<u64>,
    /// Refused keys shown in the text views (the JSON has all, up to 64).
    #[arg(long, default_value_t = 20)]
    keys: usize,
}

pub fn run(TopArgs { config, metrics, json, interval, count, keys }: TopArgs) -> anyhow::Result<ExitCode> {
    let addr = match metrics {
        Some(a) => a,
        None => metrics_listen(&config)?,
    };
    let secs = interval.unwrap_or(1.0);
    if !(secs.is_finite() && (0.1..=3600.0).contains(&secs)) {
        anyhow::bail!("--interval must be between 0.1 and 3600 seconds");
    }
    let output = if json {
        Output::Json
    } else if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        Output::Live
    } else {
        Output::Plain
    };
    // A bare --json is one snapshot, for scripts.
    let count = count.or((json && interval.is_none()).then_some(1));
    ratelimitd::top::run(&addr, output, Duration::from_secs_f64(secs), count, keys, &mut std::io::stdout().lock())?;
    Ok(ExitCode::SUCCESS)
}

/// The configuration's `[metrics] listen`, host:port.
fn metrics_listen(config: &Path) -> anyhow::Result<String> {
    let cfg = Config::load(config).with_context(|| format!("reading [metrics] listen from {} (or pass --metrics HOST:PORT)", config.display()))?;
    let m = cfg.metrics.as_ref().ok_or_else(|| {
        anyhow::anyhow!("{}: no [metrics] listen: ratelimitd top reads the daemon's metrics endpoint; set [metrics] listen = \"127.0.0.1:9464\" (restart needed) or pass --metrics HOST:PORT", config.display())
    })?;
    Ok(m.listen.to_string())
}
