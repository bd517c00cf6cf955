//! `ratelimitd override set|list|delete`: overrides with an expiry,
//! through the admin API.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use ratelimitd::terminal::escape;

use super::admin::{call, list, one_key, text};

#[derive(Args)]
pub struct OverrideArgs {
    #[arg(long, short, default_value = super::common::DEFAULT_CONFIG)]
    config: PathBuf,
    #[command(subcommand)]
    action: OverrideAction,
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

pub fn run(OverrideArgs { config, action }: OverrideArgs) -> anyhow::Result<ExitCode> {
    match action {
        OverrideAction::Set { policy, key, limit, until, for_, note } => {
            let limit = if limit == "unlimited" { serde_json::json!("unlimited") } else { serde_json::json!(limit.parse::<u64>().map_err(|_| anyhow::anyhow!("--limit {limit:?} is not a number or \"unlimited\""))?) };
            let body = serde_json::json!({ "policy": policy, "key": key, "limit": limit, "expires_at": until, "ttl": for_, "note": note });
            let mut body = body.as_object().cloned().unwrap_or_default();
            body.retain(|_, v| !v.is_null());
            let reply = call(&config, "PUT", "/v1/overrides", Some(&serde_json::Value::Object(body).to_string()))?;
            let after = &reply["after"];
            println!("policy {} key {}: limit {} -> {} until {} (every daemon within {} ms)", escape(&policy), escape(&key), reply["before_limit"], after["limit"], after["expires_at"].as_str().unwrap_or("?"), reply["applies_within_ms"]);
        }
        OverrideAction::List { policy, json } => list(&config, "/v1/overrides", policy.as_deref(), json, "overrides", "no override in force", |o| {
            let s = |f: &str| text(o, f);
            format!("{} {} limit {} until {} (set by {} at {}{})", s("policy"), s("key"), o["limit"], s("expires_at"), s("set_by"), s("set_at"), o["note"].as_str().map(|n| format!(": {}", escape(n))).unwrap_or_default())
        })?,
        OverrideAction::Delete { policy, key } => {
            let reply = call(&config, "DELETE", &one_key("/v1/overrides", &policy, &key), None)?;
            println!("policy {} key {}: override deleted; limit now {}", escape(&policy), escape(&key), reply["limit_now"]);
        }
    }
    Ok(ExitCode::SUCCESS)
}
