//! `ratelimitd check-config`: the file validated and preflighted; with
//! --against, what a reload from the running file would be refused for;
//! with --nginx, every policy the nginx configuration asks for checked
//! against it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use ratelimitd::config::{multi_refusal, preflight, reserve_refusal, Config, NamedPolicy, PolicyConfig, PolicyRule};
use ratelimitd::terminal::escape;

#[derive(Args)]
pub struct CheckConfigArgs {
    #[arg(long, short, default_value = super::common::DEFAULT_CONFIG)]
    config: PathBuf,
    /// An nginx configuration (e.g. /etc/nginx/nginx.conf): its
    /// `include`s and `*_by_lua_file`s are read too.
    #[arg(long)]
    nginx: Option<PathBuf>,
    /// The configuration the daemon runs now: list what a reload from
    /// it to --config would be refused for (a policy removed, counts
    /// restarted, a use made impossible; exit 1 if any).
    #[arg(long, value_name = "RUNNING_CONFIG")]
    against: Option<PathBuf>,
}

pub fn run(CheckConfigArgs { config, nginx, against }: CheckConfigArgs) -> anyhow::Result<ExitCode> {
    let cfg = Config::load(&config)?;
    preflight(&cfg, &config)?;
    for line in &cfg.deprecated {
        eprintln!("{}: deprecated: {line}", config.display());
    }
    if let Some(running) = against {
        if !reload_from(&config, &cfg, &running)? {
            return Ok(ExitCode::from(1));
        }
    }
    if let Some(nginx) = nginx {
        if !nginx_uses(&config, &cfg, &nginx)? {
            return Ok(ExitCode::from(1));
        }
    }
    println!("{}: ok (socket {}, backend {}{})", config.display(), cfg.server.listen.display(), backend(&cfg), policies(&cfg.policies));
    Ok(ExitCode::SUCCESS)
}

/// --against: what a daemon running `running` would refuse of a reload to
/// `cfg`; true when nothing.
fn reload_from(config: &Path, cfg: &Config, running: &Path) -> anyhow::Result<bool> {
    let report = ratelimitd::daemon::reload_report(&Config::load(running)?, cfg);
    for line in &report {
        println!("{}: {line}", config.display());
    }
    if !report.is_empty() {
        println!(
            "{}: a daemon running {} refuses this reload unless forced with SIGUSR1, for each policy above in use (a restart of counts with Redis: always; docs/OPERATIONS.md, \"Reloads a daemon refuses\")",
            config.display(),
            running.display()
        );
        return Ok(false);
    }
    println!("{}: a reload from {} keeps every policy's counts and uses", config.display(), running.display());
    Ok(true)
}

/// --nginx: every finding printed; true when there is none.
fn nginx_uses(config: &Path, cfg: &Config, nginx: &Path) -> anyhow::Result<bool> {
    let used = ratelimitd::config::nginx_policy_names(nginx)?;
    let mut missing = 0;
    for u in &used {
        let known = cfg.policies.iter().any(|p| p.name == u.name);
        missing += usize::from(!known);
        println!("{}:{}: policy \"{}\": {}", u.file.display(), u.line, escape(&u.name), if known { "ok" } else { "NOT in the ratelimitd configuration: this location would get UNKNOWN_POLICY and its fail policy" });
    }
    let unsettleable = unsettleable(cfg, nginx)?;
    let unmixable = unmixable(cfg, nginx)?;
    let unbuildable = unbuildable(nginx)?;
    if missing > 0 || unsettleable > 0 || unmixable > 0 || unbuildable > 0 {
        println!(
            "{}: {missing} of {} policy names used by {} are missing, {unsettleable} cannot be reserved, {unmixable} cannot be checked with others or refundably; {unbuildable} limiters have options new() refuses",
            config.display(),
            used.len(),
            nginx.display()
        );
        return Ok(false);
    }
    println!("{}: all {} policy names used by {} are configured", config.display(), used.len(), nginx.display());
    Ok(true)
}

/// A settle = true limiter naming a policy a reserve cannot take: every
/// request of it would get UNSUPPORTED_COMBINATION. Printed; counted.
fn unsettleable(cfg: &Config, nginx: &Path) -> anyhow::Result<usize> {
    let uses = ratelimitd::config::nginx_settle_policy_names(nginx)?;
    Ok(refused_uses(cfg, &uses, "a settle = true limiter", "has no window to reserve in", |r| reserve_refusal(r.algorithm, r.shards)))
}

/// A multi-item or refundable limiter naming a policy such a check cannot
/// take (not the log, or a penalty box): every request of it would get
/// UNSUPPORTED_COMBINATION. Printed; counted.
fn unmixable(cfg: &Config, nginx: &Path) -> anyhow::Result<usize> {
    let uses = ratelimitd::config::nginx_multi_policy_names(nginx)?;
    Ok(refused_uses(cfg, &uses, "a multi-item or refundable limiter", "is acquired, not checked", |r| multi_refusal(r.algorithm, r.penalty.is_some())))
}

/// The `uses` of configured policies that every request would be refused
/// for, in a limiter of kind `limiter`: a concurrency policy (which
/// `concurrency` says why), or a rate policy `refusal` refuses. Printed;
/// counted.
fn refused_uses(cfg: &Config, uses: &[NamedPolicy], limiter: &str, concurrency: &str, refusal: impl Fn(&PolicyRule) -> Option<&'static str>) -> usize {
    let mut n = 0;
    for u in uses {
        let Some(p) = cfg.policies.iter().find(|p| p.name == u.name) else { continue };
        let why = if p.rule.lease_ms.is_some() {
            Some(format!("WRONG_POLICY_KIND: a concurrency policy {concurrency}"))
        } else {
            refusal(&p.rule).map(|w| format!("UNSUPPORTED_COMBINATION: {w}"))
        };
        if let Some(why) = why {
            n += 1;
            println!("{}:{}: policy \"{}\" in {limiter}: every request refused with {why}", u.file.display(), u.line, escape(&u.name));
        }
    }
    n
}

/// A limiter whose options new() refuses is never built: its location
/// answers 500. Checked by the Lua client's own validation (luajit), so
/// the two cannot disagree. Printed; counted.
fn unbuildable(nginx: &Path) -> anyhow::Result<usize> {
    let tables = ratelimitd::config::nginx_limiter_tables(nginx)?;
    if tables.is_empty() {
        return Ok(0);
    }
    let answers = match ratelimitd::config::check_limiter_options(&tables) {
        Ok(answers) => answers,
        Err(e) => {
            eprintln!("{}: {e}", nginx.display());
            return Ok(0);
        }
    };
    let mut n = 0;
    for (t, why) in tables.iter().zip(answers) {
        if let Some(why) = why {
            n += 1;
            println!("{}:{}: {}{{...}}: {}: the limiter is not built (it returns nil and this message), and its location answers 500", t.file.display(), t.line, t.constructor, escape(&why));
        }
    }
    Ok(n)
}

fn backend(cfg: &Config) -> String {
    match &cfg.redis {
        Some(r) => format!("redis: {}", r.describe()),
        None => "in-memory (per host)".into(),
    }
}

/// ", 2 policies: login api (4 shards)", or nothing without policies.
fn policies(policies: &[PolicyConfig]) -> String {
    if policies.is_empty() {
        return String::new();
    }
    let names: Vec<String> = policies
        .iter()
        .map(|p| match p.rule.lease_ms {
            Some(l) => format!("{} (concurrency, lease {l}ms)", p.name),
            None if p.rule.shards > 1 => format!("{} ({} shards)", p.name, p.rule.shards),
            None => p.name.clone(),
        })
        .collect();
    format!(", {} {}: {}", policies.len(), if policies.len() == 1 { "policy" } else { "policies" }, names.join(" "))
}
