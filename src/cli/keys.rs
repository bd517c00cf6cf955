//! `ratelimitd inspect` and `reset`: a key's windows, through the admin
//! API when the configuration has one (the daemon's own Redis access),
//! else in Redis directly.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use ratelimitd::admin::{Inspection, Target};
use ratelimitd::config::{preflight, Config, ConfigError, RedisConfig, Resolved};
use ratelimitd::terminal::{escape, escape_bytes};

/// The windows `inspect` and `reset` address.
#[derive(Args)]
pub struct TargetOpts {
    /// The key, as the client sends it (as `ratelimitd top` shows it).
    #[arg(long)]
    key: String,
    /// The `[[policy]]` the key is checked under (as `ratelimitd top` shows
    /// it): its window, algorithm and every shard from the configuration.
    /// Without it, the key of inline checks.
    #[arg(long)]
    policy: Option<String>,
    /// Only the window of this length (inline checks only: a policy has
    /// one window).
    #[arg(long, conflicts_with = "policy")]
    window_ms: Option<u32>,
    /// Every window of an inline key, of any length: found with SCAN over
    /// the whole Redis (its cost grows with the keyspace). Without it, an
    /// inline key needs --window-ms.
    #[arg(long, conflicts_with_all = ["policy", "window_ms"])]
    scan: bool,
}

impl TargetOpts {
    /// An inline key without its window would be found by scanning the
    /// whole Redis: done only when asked for with --scan.
    fn refuse_unbounded_scan(&self) -> anyhow::Result<()> {
        if self.policy.is_none() && self.window_ms.is_none() && !self.scan {
            anyhow::bail!(
                "--key {} names no window: give --policy NAME (the policy's window), or --window-ms MS (the inline window's length); \
                 --scan finds every window of the key by scanning the whole Redis",
                escape(&self.key)
            );
        }
        Ok(())
    }

    fn target(&self) -> Target<'_> {
        match &self.policy {
            Some(policy) => Target::Policy { policy, key: &self.key },
            None => Target::Inline { key: &self.key, window_ms: self.window_ms },
        }
    }

    /// The target as the admin API's query.
    fn query(&self) -> String {
        use ratelimitd::admin_api::client::encode;
        let mut q = format!("key={}", encode(&self.key));
        if let Some(p) = &self.policy {
            q += &format!("&policy={}", encode(p));
        }
        if let Some(w) = self.window_ms {
            q += &format!("&window_ms={w}");
        }
        if self.scan {
            q += "&scan=1";
        }
        q
    }

    /// What the target is called in messages, escaped for the terminal.
    fn describe(&self) -> String {
        let key = escape(&self.key);
        match &self.policy {
            Some(p) => format!("policy {} key {key}", escape(p)),
            None => key.into_owned(),
        }
    }
}

#[derive(Args)]
pub struct InspectArgs {
    #[arg(long, short, default_value = super::common::DEFAULT_CONFIG)]
    config: PathBuf,
    #[command(flatten)]
    target: TargetOpts,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ResetArgs {
    #[arg(long, short, default_value = super::common::DEFAULT_CONFIG)]
    config: PathBuf,
    #[command(flatten)]
    target: TargetOpts,
}

pub fn inspect(InspectArgs { config, target, json }: InspectArgs) -> anyhow::Result<ExitCode> {
    target.refuse_unbounded_scan()?;
    if super::admin::listen(&config)?.is_some() {
        inspect_by_admin(&config, &target, json)?;
    } else {
        inspect_in_redis(&config, &target, json)?;
    }
    Ok(ExitCode::SUCCESS)
}

pub fn reset(ResetArgs { config, target }: ResetArgs) -> anyhow::Result<ExitCode> {
    target.refuse_unbounded_scan()?;
    if super::admin::listen(&config)?.is_some() {
        reset_by_admin(&config, &target)?;
    } else {
        reset_in_redis(&config, &target)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn inspect_by_admin(config: &Path, target: &TargetOpts, json: bool) -> anyhow::Result<()> {
    let reply = super::admin::call(config, "GET", &format!("/v1/keys?{}", target.query()), None)?;
    if json {
        return super::common::print_json(&reply);
    }
    if let Some(limit) = reply.get("limit") {
        println!("limit:        {} ({})", limit, reply["limit_from"].as_str().unwrap_or("-"));
        println!("count:        {}", reply["count"]);
        println!("remaining:    {}", reply["remaining"]);
    }
    for w in reply["windows"].as_array().into_iter().flatten() {
        println!();
        println!("key:          {}", escape(w["redis_key"].as_str().unwrap_or("")));
        for f in ["shard", "window_ms", "algorithm", "members", "in_window", "count", "remaining", "reset_in_ms", "oldest_age_ms", "newest_age_ms", "ttl_ms"] {
            if let Some(v) = w.get(f).filter(|v| !v.is_null()) {
                println!("{:<13} {}", format!("{f}:"), escape(&v.to_string()));
            }
        }
    }
    Ok(())
}

fn reset_by_admin(config: &Path, target: &TargetOpts) -> anyhow::Result<()> {
    let reply = super::admin::call(config, "DELETE", &format!("/v1/keys?{}", target.query()), None)?;
    let reset = reply["reset"].as_array().cloned().unwrap_or_default();
    if reset.is_empty() {
        println!("{}: no such key", target.describe());
    }
    let deleted = reply["deleted"].as_array().cloned().unwrap_or_default();
    for k in reset.iter().filter(|k| deleted.contains(k)) {
        println!("{}: deleted", escape(k.as_str().unwrap_or("")));
    }
    for k in reset.iter().filter(|k| !deleted.contains(k)) {
        println!("{}: admissions deleted; units of quota leases, worker shares or reservations outstanding stay reserved for their holders", escape(k.as_str().unwrap_or("")));
    }
    if reply["announced"] == false {
        eprintln!("warning: the reset is not in the change log: other daemons' quota leases count the admissions it removed until they settle (see the daemon's log)");
    }
    Ok(())
}

fn inspect_in_redis(config: &Path, target: &TargetOpts, json: bool) -> anyhow::Result<()> {
    let (cfg, resolved) = load_for_redis(config)?;
    let redis = redis_of(&cfg, config)?;
    let windows = super::common::runtime()?.block_on(ratelimitd::admin::inspect(redis, &resolved.redis, &cfg.policies, target.target()))?;
    if json {
        return super::common::print_json(&windows);
    }
    if windows.is_empty() {
        println!("{}: no window in redis", target.describe());
    }
    for (n, i) in windows.iter().enumerate() {
        if n > 0 {
            println!();
        }
        print_window(i);
    }
    Ok(())
}

fn print_window(i: &Inspection) {
    // A policy's key starts with a control byte (the name's length), and
    // client keys are hostile: escaped.
    println!("key:          {}", escape(&i.redis_key));
    if let Some(shard) = i.shard {
        println!("shard:        {shard}");
    }
    println!("window:       {} ms", i.window_ms);
    println!("algorithm:    {}", i.algorithm);
    println!("admissions:   {}", i.members);
    println!("in window:    {}", i.in_window);
    let age = |a: Option<i64>| a.map_or("-".to_string(), |ms| format!("{ms} ms ago"));
    println!("oldest:       {}", age(i.oldest_age_ms));
    println!("newest:       {}", age(i.newest_age_ms));
    println!("ttl:          {}", match i.ttl_ms { -2 => "no such key".to_string(), -1 => "none".to_string(), ms => format!("{ms} ms") });
}

fn reset_in_redis(config: &Path, target: &TargetOpts) -> anyhow::Result<()> {
    let (cfg, resolved) = load_for_redis(config)?;
    let redis = redis_of(&cfg, config)?;
    let runtime = super::common::runtime()?;
    let windows = runtime.block_on(ratelimitd::admin::reset(redis, &resolved.redis, &cfg.policies, target.target()))?;
    if windows.is_empty() {
        println!("{}: no such key", target.describe());
    }
    for w in &windows {
        let key = escape_bytes(&w.redis_key);
        match w.kept_outstanding {
            0 => println!("{key}: deleted"),
            kept => println!("{key}: admissions deleted; {kept} units of quota leases, worker shares or reservations outstanding stay reserved for their holders"),
        }
    }
    // The daemons hear of it from the change log, and their quota leases
    // forget the admissions it removed.
    if let Err(e) = runtime.block_on(ratelimitd::admin_api::changes::announce_resets(redis, &resolved.redis, &windows)) {
        eprintln!("warning: the reset is not in the change log ({e}): the daemons' quota leases count the admissions it removed until they settle");
    }
    Ok(())
}

/// The configuration and its secrets.
fn load_for_redis(path: &Path) -> Result<(Config, Resolved), ConfigError> {
    let cfg = Config::load(path)?;
    let resolved = preflight(&cfg, path)?;
    Ok((cfg, resolved))
}

fn redis_of<'a>(cfg: &'a Config, path: &Path) -> anyhow::Result<&'a RedisConfig> {
    cfg.redis.as_ref().with_context(|| format!("{}: no [redis]: the in-memory windows live inside the daemon", path.display()))
}
