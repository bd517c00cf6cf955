//! `ratelimitd serve`: the daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use ratelimitd::config::{preflight, Config, ConfigError, Overrides, Resolved};
use ratelimitd::daemon::Reload;

#[derive(Args)]
pub struct ServeArgs {
    /// TOML configuration file (see docs/CONFIG.md).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Socket path; overrides server.listen.
    #[arg(long)]
    listen: Option<PathBuf>,
    /// Redis URL; overrides redis.url (and enables Redis if the file has no [redis]).
    #[arg(long)]
    redis: Option<String>,
}

pub fn run(ServeArgs { config, listen, redis }: ServeArgs) -> anyhow::Result<ExitCode> {
    // Read, overridden by flags, validated and preflighted: at start and on
    // every SIGHUP.
    let overrides = Overrides { listen, redis_url: redis };
    let load = move || -> Result<(Config, Resolved), ConfigError> {
        let cfg = Config::load_with(config.as_deref(), &overrides)?;
        let origin = config.clone().unwrap_or_else(|| PathBuf::from("command line"));
        let resolved = preflight(&cfg, &origin)?;
        Ok((cfg, resolved))
    };
    let (cfg, resolved) = load()?;
    let set_log_level = super::logging::init(&cfg.log.level, cfg.log.format);
    let reload = Reload { load: Box::new(load), set_log_level };
    let threads = cfg.server.worker_threads;
    server_runtime(threads)?.block_on(ratelimitd::daemon::serve(cfg, resolved, reload))?;
    Ok(ExitCode::SUCCESS)
}

/// The daemon's runtime: `server.worker_threads` threads (1 by default).
/// One thread measured best: with two, tokio wakes the idle one for every
/// Redis command handed to the connection task, so the threads trade each
/// request back and forth (docs/PERFORMANCE.md, "Where the time goes"). An
/// explicit `TOKIO_WORKER_THREADS` in the environment still wins.
fn server_runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        b.worker_threads(threads);
    }
    Ok(b.enable_all().build()?)
}
