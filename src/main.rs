//! The `ratelimitd` command line; the work is done in the library.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use ratelimitd::bench::{self, BenchArgs};
use ratelimitd::client::Client;
use ratelimitd::config::{preflight, Config, ConfigError, LogFormat, Overrides, Resolved};
use ratelimitd::daemon::{Reload, SetLogLevel};
use ratelimitd::protocol::{Algorithm, CheckArgs, FailPolicy};
use ratelimitd::terminal::{escape, json_ascii_safe};

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
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon.
    Serve {
        /// TOML configuration file (see docs/CONFIG.md).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Socket path; overrides server.listen.
        #[arg(long)]
        listen: Option<PathBuf>,
        /// Redis URL; overrides redis.url (and enables Redis if the file has no [redis]).
        #[arg(long)]
        redis: Option<String>,
    },
    /// Validate a configuration file and exit; with --nginx, also check
    /// that every policy name the nginx configuration uses is in it (exit 1
    /// if one is not).
    CheckConfig {
        #[arg(long, short, default_value = "/etc/ratelimitd/ratelimitd.toml")]
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
    },
    /// Print the configuration as the daemon would hold it, as TOML in the
    /// file's own terms (what GET /config shows of the running one),
    /// secrets left out.
    ConfigShow {
        #[arg(long, short, default_value = "/etc/ratelimitd/ratelimitd.toml")]
        config: PathBuf,
    },
    /// Ask a running daemon for one decision.
    Query {
        #[command(flatten)]
        check: CheckOpts,
        /// Print the response as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Show a key's windows in Redis (same key derivation as the daemon).
    Inspect {
        #[arg(long, short, default_value = "/etc/ratelimitd/ratelimitd.toml")]
        config: PathBuf,
        #[command(flatten)]
        target: TargetOpts,
        #[arg(long)]
        json: bool,
    },
    /// Delete a key's windows in Redis: its quota is whole again.
    Reset {
        #[arg(long, short, default_value = "/etc/ratelimitd/ratelimitd.toml")]
        config: PathBuf,
        #[command(flatten)]
        target: TargetOpts,
    },
    /// Set, list or delete overrides with an expiry, applied by every daemon
    /// sharing the Redis (through the admin API, `[admin] listen`).
    Override {
        #[arg(long, short, default_value = "/etc/ratelimitd/ratelimitd.toml")]
        config: PathBuf,
        #[command(subcommand)]
        action: OverrideAction,
    },
    /// List, show or lift the penalty box's bans (through the admin API,
    /// `[admin] listen`): a lift applies on every daemon sharing the Redis.
    Ban {
        #[arg(long, short, default_value = "/etc/ratelimitd/ratelimitd.toml")]
        config: PathBuf,
        #[command(subcommand)]
        action: BanAction,
    },
    /// A live view of a running daemon (like top): decisions per second per
    /// policy and outcome, Redis latency, breaker, in-flight requests, the
    /// keys refused most in the last minute. Reads GET /top.json on the
    /// metrics endpoint.
    Top {
        /// Where `[metrics] listen` is read from (without --metrics).
        #[arg(long, short, default_value = "/etc/ratelimitd/ratelimitd.toml")]
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
    },
    /// Load a running daemon: N requests over C connections.
    Bench {
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
        /// Send CHECK_POLICY for this configured [[policy]] instead of an inline check (--limit and --window-ms are then not sent).
        #[arg(long)]
        policy: Option<String>,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum OverrideAction {
    /// Give a policy's key another limit until an expiry.
    Set {
        #[arg(long)]
        policy: String,
        #[arg(long)]
        key: String,
        /// A number of admissions per window, or "unlimited".
        #[arg(long)]
        limit: String,
        /// Until this UTC time, e.g. 2026-12-06T09:00:00Z.
        #[arg(long, conflicts_with = "for_", required_unless_present = "for_")]
        until: Option<String>,
        /// For this long from now, e.g. 90m, 1d.
        #[arg(long = "for")]
        for_: Option<String>,
        /// Why (kept with the override, shown by list).
        #[arg(long)]
        note: Option<String>,
    },
    /// The overrides in force.
    List {
        #[arg(long)]
        policy: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Remove an override: the file's limit applies again.
    Delete {
        #[arg(long)]
        policy: String,
        #[arg(long)]
        key: String,
    },
}

#[derive(Subcommand)]
enum BanAction {
    /// The bans in force (every daemon's, from Redis).
    List {
        #[arg(long)]
        policy: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// One key: banned or not, until when, its refusals counted so far.
    Show {
        #[arg(long)]
        policy: String,
        #[arg(long)]
        key: String,
    },
    /// Lift a key's ban (and forget its refusals counted so far).
    Lift {
        #[arg(long)]
        policy: String,
        #[arg(long)]
        key: String,
    },
}

/// The windows `inspect` and `reset` address.
#[derive(Args)]
struct TargetOpts {
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
                ratelimitd::terminal::escape(&self.key)
            );
        }
        Ok(())
    }

    fn target(&self) -> ratelimitd::admin::Target<'_> {
        match &self.policy {
            Some(policy) => ratelimitd::admin::Target::Policy { policy, key: &self.key },
            None => ratelimitd::admin::Target::Inline { key: &self.key, window_ms: self.window_ms },
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
struct CheckOpts {
    /// The daemon's socket.
    #[arg(long, default_value = "/run/ratelimitd/ratelimitd.sock")]
    socket: PathBuf,
    #[arg(long)]
    key: String,
    /// Admissions allowed per window.
    #[arg(long)]
    limit: u32,
    /// Window length in ms.
    #[arg(long)]
    window_ms: u32,
    #[arg(long, default_value_t = 1)]
    cost: u32,
    /// Fail policy when Redis cannot decide: open, closed or local. Open
    /// by default, as in the Lua client (docs/CONFIG.md, "on_error").
    #[arg(long, default_value = "open")]
    on_error: FailPolicy,
    /// Quota of the local fallback (with --on-error local).
    #[arg(long, default_value_t = 0)]
    local_limit: u32,
    /// How the limit counts: log, ring, gcra, sliding_counter, fixed (docs/ALGORITHMS.md).
    #[arg(long, default_value = "log")]
    algorithm: Algorithm,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ratelimitd: {e:#}");
            // 2, not 1: `query` exits 1 for "denied".
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve { config, listen, redis } => {
            // Read, overridden by flags, validated and preflighted: at start
            // and on every SIGHUP.
            let overrides = Overrides { listen, redis_url: redis };
            let load = move || -> Result<(Config, Resolved), ConfigError> {
                let cfg = Config::load_with(config.as_deref(), &overrides)?;
                let origin = config.clone().unwrap_or_else(|| PathBuf::from("command line"));
                let resolved = preflight(&cfg, &origin)?;
                Ok((cfg, resolved))
            };
            let (cfg, resolved) = load()?;
            let set_log_level = init_logging(&cfg.log.level, cfg.log.format);
            let reload = Reload { load: Box::new(load), set_log_level };
            let threads = cfg.server.worker_threads;
            server_runtime(threads)?.block_on(ratelimitd::daemon::serve(cfg, resolved, reload))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::ConfigShow { config } => {
            let cfg = Config::load(&config)?;
            print!("{}", cfg.dump());
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { config, nginx, against } => {
            let cfg = Config::load(&config)?;
            preflight(&cfg, &config)?;
            for line in &cfg.deprecated {
                eprintln!("{}: deprecated: {line}", config.display());
            }
            if let Some(running) = against {
                let report = ratelimitd::daemon::reload_report(&Config::load(&running)?, &cfg);
                for line in &report {
                    println!("{}: {line}", config.display());
                }
                if !report.is_empty() {
                    println!(
                        "{}: a daemon running {} refuses this reload unless forced with SIGUSR1, for each policy above in use (a restart of counts with Redis: always; docs/OPERATIONS.md, \"Reloads a daemon refuses\")",
                        config.display(),
                        running.display()
                    );
                    return Ok(ExitCode::from(1));
                }
                println!("{}: a reload from {} keeps every policy's counts and uses", config.display(), running.display());
            }
            if let Some(nginx) = nginx {
                let used = ratelimitd::config::nginx_policy_names(&nginx)?;
                let mut missing = 0;
                for u in &used {
                    let known = cfg.policies.iter().any(|p| p.name == u.name);
                    missing += usize::from(!known);
                    println!("{}:{}: policy \"{}\": {}", u.file.display(), u.line, escape(&u.name), if known { "ok" } else { "NOT in the ratelimitd configuration: this location would get UNKNOWN_POLICY and its fail policy" });
                }
                // A settle = true limiter naming a policy a reserve cannot
                // take: every request of it would get UNSUPPORTED_COMBINATION.
                let mut unsettleable = 0;
                for u in ratelimitd::config::nginx_settle_policy_names(&nginx)? {
                    let Some(p) = cfg.policies.iter().find(|p| p.name == u.name) else { continue };
                    let why = if p.lease_ms.is_some() {
                        Some("WRONG_POLICY_KIND: a concurrency policy has no window to reserve in".to_string())
                    } else {
                        ratelimitd::config::reserve_refusal(p.algorithm, p.shards).map(|w| format!("UNSUPPORTED_COMBINATION: {w}"))
                    };
                    if let Some(why) = why {
                        unsettleable += 1;
                        println!("{}:{}: policy \"{}\" in a settle = true limiter: every request refused with {why}", u.file.display(), u.line, escape(&u.name));
                    }
                }
                // A multi-item or refundable limiter naming a policy such a
                // check cannot take (not the log, or a penalty box): every
                // request of it would get UNSUPPORTED_COMBINATION.
                let mut unmixable = 0;
                for u in ratelimitd::config::nginx_multi_policy_names(&nginx)? {
                    let Some(p) = cfg.policies.iter().find(|p| p.name == u.name) else { continue };
                    let why = if p.lease_ms.is_some() {
                        Some("WRONG_POLICY_KIND: a concurrency policy is acquired, not checked".to_string())
                    } else {
                        ratelimitd::config::multi_refusal(p.algorithm, p.penalty.is_some()).map(|w| format!("UNSUPPORTED_COMBINATION: {w}"))
                    };
                    if let Some(why) = why {
                        unmixable += 1;
                        println!("{}:{}: policy \"{}\" in a multi-item or refundable limiter: every request refused with {why}", u.file.display(), u.line, escape(&u.name));
                    }
                }
                // A limiter whose options new() refuses is never built: its
                // location answers 500. Checked by the Lua client's own
                // validation (luajit), so the two cannot disagree.
                let mut unbuildable = 0;
                let tables = ratelimitd::config::nginx_limiter_tables(&nginx)?;
                if !tables.is_empty() {
                    match ratelimitd::config::check_limiter_options(&tables) {
                        Ok(answers) => {
                            for (t, why) in tables.iter().zip(answers) {
                                if let Some(why) = why {
                                    unbuildable += 1;
                                    println!("{}:{}: {}{{...}}: {}: the limiter is not built (it returns nil and this message), and its location answers 500", t.file.display(), t.line, t.constructor, escape(&why));
                                }
                            }
                        }
                        Err(e) => eprintln!("{}: {e}", nginx.display()),
                    }
                }
                if missing > 0 || unsettleable > 0 || unmixable > 0 || unbuildable > 0 {
                    println!(
                        "{}: {missing} of {} policy names used by {} are missing, {unsettleable} cannot be reserved, {unmixable} cannot be checked with others or refundably; {unbuildable} limiters have options new() refuses",
                        config.display(),
                        used.len(),
                        nginx.display()
                    );
                    return Ok(ExitCode::from(1));
                }
                println!("{}: all {} policy names used by {} are configured", config.display(), used.len(), nginx.display());
            }
            let backend = match &cfg.redis {
                Some(r) => format!("redis: {}", r.describe()),
                None => "in-memory (per host)".into(),
            };
            let policies = match cfg.policies.len() {
                0 => String::new(),
                n => format!(", {n} {}: {}", if n == 1 { "policy" } else { "policies" }, cfg.policies.iter().map(|p| match p.lease_ms {
                    Some(l) => format!("{} (concurrency, lease {l}ms)", p.name),
                    None if p.shards > 1 => format!("{} ({} shards)", p.name, p.shards),
                    None => p.name.clone(),
                }).collect::<Vec<_>>().join(" ")),
            };
            println!("{}: ok (socket {}, backend {backend}{policies})", config.display(), cfg.server.listen.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect { config, target, json } if admin_listen(&config)?.is_some() => {
            target.refuse_unbounded_scan()?;
            let reply = admin_call(&config, "GET", &format!("/v1/keys?{}", target.query()), None)?;
            if json {
                println!("{}", json_ascii_safe(&serde_json::to_string(&reply)?));
                return Ok(ExitCode::SUCCESS);
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
            Ok(ExitCode::SUCCESS)
        }
        Command::Reset { config, target } if admin_listen(&config)?.is_some() => {
            target.refuse_unbounded_scan()?;
            let reply = admin_call(&config, "DELETE", &format!("/v1/keys?{}", target.query()), None)?;
            let deleted = reply["deleted"].as_array().cloned().unwrap_or_default();
            if deleted.is_empty() {
                println!("{}: no such key", target.describe());
            }
            for k in deleted {
                println!("{}: deleted", escape(k.as_str().unwrap_or("")));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Override { config, action } => {
            use ratelimitd::admin_api::client::encode;
            match action {
                OverrideAction::Set { policy, key, limit, until, for_, note } => {
                    let limit = if limit == "unlimited" { serde_json::json!("unlimited") } else { serde_json::json!(limit.parse::<u64>().map_err(|_| anyhow::anyhow!("--limit {limit:?} is not a number or \"unlimited\""))?) };
                    let body = serde_json::json!({ "policy": policy, "key": key, "limit": limit, "expires_at": until, "ttl": for_, "note": note });
                    let mut body = body.as_object().cloned().unwrap_or_default();
                    body.retain(|_, v| !v.is_null());
                    let reply = admin_call(&config, "PUT", "/v1/overrides", Some(&serde_json::Value::Object(body).to_string()))?;
                    let after = &reply["after"];
                    println!("policy {} key {}: limit {} -> {} until {} (every daemon within {} ms)", escape(&policy), escape(&key), reply["before_limit"], after["limit"], after["expires_at"].as_str().unwrap_or("?"), reply["applies_within_ms"]);
                }
                OverrideAction::List { policy, json } => {
                    let path = match &policy {
                        Some(p) => format!("/v1/overrides?policy={}", encode(p)),
                        None => "/v1/overrides".to_string(),
                    };
                    let reply = admin_call(&config, "GET", &path, None)?;
                    if json {
                        println!("{}", json_ascii_safe(&serde_json::to_string(&reply)?));
                        return Ok(ExitCode::SUCCESS);
                    }
                    let all = reply["overrides"].as_array().cloned().unwrap_or_default();
                    if all.is_empty() {
                        println!("no override in force");
                    }
                    for o in all {
                        let s = |f: &str| escape(o[f].as_str().unwrap_or("-")).into_owned();
                        println!("{} {} limit {} until {} (set by {} at {}{})", s("policy"), s("key"), o["limit"], s("expires_at"), s("set_by"), s("set_at"), o["note"].as_str().map(|n| format!(": {}", escape(n))).unwrap_or_default());
                    }
                }
                OverrideAction::Delete { policy, key } => {
                    let reply = admin_call(&config, "DELETE", &format!("/v1/overrides?policy={}&key={}", encode(&policy), encode(&key)), None)?;
                    println!("policy {} key {}: override deleted; limit now {}", escape(&policy), escape(&key), reply["limit_now"]);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Ban { config, action } => {
            use ratelimitd::admin_api::client::encode;
            match action {
                BanAction::List { policy, json } => {
                    let path = match &policy {
                        Some(p) => format!("/v1/bans?policy={}", encode(p)),
                        None => "/v1/bans".to_string(),
                    };
                    let reply = admin_call(&config, "GET", &path, None)?;
                    if json {
                        println!("{}", json_ascii_safe(&serde_json::to_string(&reply)?));
                        return Ok(ExitCode::SUCCESS);
                    }
                    let all = reply["bans"].as_array().cloned().unwrap_or_default();
                    if all.is_empty() {
                        println!("no key is banned");
                    }
                    for b in all {
                        let s = |f: &str| escape(b[f].as_str().unwrap_or("-")).into_owned();
                        println!("{} {} banned until {} ({} ms left)", s("policy"), s("key"), s("ends_at"), b["ends_in_ms"]);
                    }
                }
                BanAction::Show { policy, key } => {
                    let reply = admin_call(&config, "GET", &format!("/v1/bans?policy={}&key={}", encode(&policy), encode(&key)), None)?;
                    let state = match reply["ban"]["ends_at"].as_str() {
                        Some(end) => format!("banned until {end} ({} ms left)", reply["ban"]["ends_in_ms"]),
                        None => "not banned".to_string(),
                    };
                    println!("policy {} key {}: {state}; {} of {} refusals within {} ms counted towards a ban of {} ms", escape(&policy), escape(&key), reply["strikes"], reply["after"], reply["within_ms"], reply["ban_ms"]);
                }
                BanAction::Lift { policy, key } => {
                    let reply = admin_call(&config, "DELETE", &format!("/v1/bans?policy={}&key={}", encode(&policy), encode(&key)), None)?;
                    println!("policy {} key {}: ban lifted (it ran until {}); every daemon within {} ms", escape(&policy), escape(&key), reply["lifted"]["ends_at"].as_str().unwrap_or("?"), reply["applies_within_ms"]);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect { config, target, json } => {
            target.refuse_unbounded_scan()?;
            let (cfg, resolved) = load_for_admin(&config)?;
            let redis = cfg.redis.as_ref().ok_or_else(|| anyhow::anyhow!("{}: no [redis]: the in-memory windows live inside the daemon", config.display()))?;
            let windows = runtime()?.block_on(ratelimitd::admin::inspect(redis, &resolved.redis, &cfg.policies, target.target()))?;
            if json {
                println!("{}", json_ascii_safe(&serde_json::to_string(&windows)?));
            } else if windows.is_empty() {
                println!("{}: no window in redis", target.describe());
            }
            for (n, i) in windows.iter().enumerate().filter(|_| !json) {
                if n > 0 {
                    println!();
                }
                // A policy's key starts with a control byte (the name's
                // length), and client keys are hostile: escaped.
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
            Ok(ExitCode::SUCCESS)
        }
        Command::Reset { config, target } => {
            target.refuse_unbounded_scan()?;
            let (cfg, resolved) = load_for_admin(&config)?;
            let redis = cfg.redis.as_ref().ok_or_else(|| anyhow::anyhow!("{}: no [redis]: the in-memory windows live inside the daemon", config.display()))?;
            let windows = runtime()?.block_on(ratelimitd::admin::reset(redis, &resolved.redis, &cfg.policies, target.target()))?;
            if windows.is_empty() {
                println!("{}: no such key", target.describe());
            }
            for w in windows {
                let key = ratelimitd::terminal::escape_bytes(&w.redis_key);
                match w.kept_outstanding {
                    0 => println!("{key}: deleted"),
                    kept => println!("{key}: reset; {kept} units of quota leases, worker shares or reservations outstanding still count until settled"),
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Query { check, json } => {
            let r = runtime()?.block_on(async {
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
        Command::Top { config, metrics, json, interval, count, keys } => {
            let addr = match metrics {
                Some(a) => a,
                None => {
                    let cfg = Config::load(&config).with_context(|| format!("reading [metrics] listen from {} (or pass --metrics HOST:PORT)", config.display()))?;
                    let m = cfg.metrics.as_ref().ok_or_else(|| {
                        anyhow::anyhow!("{}: no [metrics] listen: ratelimitd top reads the daemon's metrics endpoint; set [metrics] listen = \"127.0.0.1:9464\" (restart needed) or pass --metrics HOST:PORT", config.display())
                    })?;
                    m.listen.to_string()
                }
            };
            let secs = interval.unwrap_or(1.0);
            if !(secs.is_finite() && (0.1..=3600.0).contains(&secs)) {
                anyhow::bail!("--interval must be between 0.1 and 3600 seconds");
            }
            let output = if json {
                ratelimitd::top::Output::Json
            } else if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                ratelimitd::top::Output::Live
            } else {
                ratelimitd::top::Output::Plain
            };
            // A bare --json is one snapshot, for scripts.
            let count = count.or((json && interval.is_none()).then_some(1));
            ratelimitd::top::run(&addr, output, std::time::Duration::from_secs_f64(secs), count, keys, &mut std::io::stdout().lock())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { check, requests, concurrency, pipeline, rate, distinct_keys, policy, json } => {
            if rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
                anyhow::bail!("--rate must be a positive number of requests per second");
            }
            let args = BenchArgs {
                socket: check.socket.clone(),
                key: check.key.clone(),
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
                policy,
            };
            let report = runtime()?.block_on(bench::run(args)).with_context(|| format!("bench against {}", check.socket.display()))?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("{report}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
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

/// Where the configuration's admin API listens, if it has one: `inspect`
/// and `reset` then go through it (the daemon's own Redis access), else
/// to Redis directly.
fn admin_listen(path: &std::path::Path) -> anyhow::Result<Option<ratelimitd::config::AdminListen>> {
    Ok(Config::load(path)?.admin.listen)
}

/// One admin API call; a response other than 200 is an error carrying the
/// API's message. The token: the write token file's if readable, else the
/// read one's.
fn admin_call(path: &std::path::Path, method: &str, target: &str, body: Option<&str>) -> anyhow::Result<serde_json::Value> {
    use ratelimitd::admin_api::client;
    let cfg = Config::load(path)?;
    let listen = cfg.admin.listen.ok_or_else(|| anyhow::anyhow!("{}: no [admin] listen: the admin API is off", path.display()))?;
    let token = [&cfg.admin.token_file, &cfg.admin.read_token_file].into_iter().flatten().find_map(|f| client::read_token(f).ok());
    let tls = match (&listen, &cfg.admin.tls) {
        (ratelimitd::config::AdminListen::Tcp(_), Some(t)) => Some(ratelimitd::admin_api::tls::client_config(t)?),
        _ => None,
    };
    let reply = client::request_with(&listen, tls, token.as_deref(), method, target, body)?;
    if reply.status != 200 {
        anyhow::bail!("admin API: {} {}", reply.status, escape(reply.body["error"].as_str().unwrap_or("(no message)")));
    }
    Ok(reply.body)
}

/// The configuration and its secrets, for `inspect` and `reset`.
fn load_for_admin(path: &std::path::Path) -> Result<(Config, Resolved), ConfigError> {
    let cfg = Config::load(path)?;
    let resolved = preflight(&cfg, path)?;
    Ok((cfg, resolved))
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

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// Logs to stderr; returns how to change the level later (SIGHUP). A
/// `RUST_LOG` in the environment wins over `log.level`, then and later.
/// The libraries' `log` lines (the Redis client's) come through
/// `LibraryLog`: at most one a second from each of their modules.
fn init_logging(level: &str, format: LogFormat) -> SetLogLevel {
    use ratelimitd::log_limit::LibraryLog;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::{fmt, reload, EnvFilter, Layer};
    let from_env = EnvFilter::try_from_default_env().ok();
    let env_set = from_env.is_some();
    let (filter, handle) = reload::Layer::new(from_env.unwrap_or_else(|| EnvFilter::new(level)));
    // Under systemd (JOURNAL_STREAM set) text logs go to the journal's own
    // socket, with their level as the entry's priority and no timestamp of
    // ours (the journal stamps each entry); if that socket cannot be used,
    // to stderr without a timestamp.
    let journald = std::env::var_os("JOURNAL_STREAM").is_some();
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let output = match (format, journald) {
        (LogFormat::Json, _) => fmt::layer().json().with_writer(std::io::stderr).boxed(),
        (LogFormat::Text, true) => match tracing_journald::layer() {
            Ok(layer) => layer.with_syslog_identifier("ratelimitd".into()).boxed(),
            Err(_) => fmt::layer().without_time().with_ansi(false).with_writer(OneLineStderr).boxed(),
        },
        (LogFormat::Text, false) => fmt::layer().with_ansi(ansi).with_writer(OneLineStderr).boxed(),
    };
    let subscriber = tracing_subscriber::registry().with(filter).with(output);
    // Not `.init()`: that would install tracing-log's own `log` logger,
    // which passes every library line on.
    tracing::subscriber::set_global_default(subscriber).expect("logging is set up once");
    if let Err(e) = LibraryLog::install() {
        tracing::warn!(error = %e, "the libraries' log lines cannot be rate-limited: another logger is installed");
    }
    Box::new(move |level: &str| {
        if env_set {
            return Ok(());
        }
        handle.reload(EnvFilter::new(level)).map_err(|e| e.to_string())?;
        LibraryLog::follow_filter();
        Ok(())
    })
}

/// stderr with one line per event: a value that holds line breaks (a
/// configuration error listing several fields, an error from Redis) has
/// them written as " | ", so a reader or a log shipper that splits on
/// lines never takes its second half for another event. The fmt layer
/// writes each event with one `write_all` of the whole line.
struct OneLineStderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for OneLineStderr {
    type Writer = OneLine;
    fn make_writer(&'a self) -> OneLine {
        OneLine(std::io::stderr())
    }
}

struct OneLine(std::io::Stderr);

impl std::io::Write for OneLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let body = buf.strip_suffix(b"\n").unwrap_or(buf);
        if !body.iter().any(|&b| b == b'\n' || b == b'\r') {
            self.0.write_all(buf)?;
            return Ok(buf.len());
        }
        let mut line = Vec::with_capacity(buf.len() + 16);
        for &b in body {
            match b {
                b'\n' => line.extend_from_slice(b" | "),
                b'\r' => {}
                _ => line.push(b),
            }
        }
        if body.len() < buf.len() {
            line.push(b'\n');
        }
        self.0.write_all(&line)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}
