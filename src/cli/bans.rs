//! `ratelimitd ban list|show|lift`: the penalty box's bans, through the
//! admin API.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use ratelimitd::terminal::escape;

use super::admin::{call, list, one_key, text};

#[derive(Args)]
pub struct BanArgs {
    #[arg(long, short, default_value = super::common::DEFAULT_CONFIG)]
    config: PathBuf,
    #[command(subcommand)]
    action: BanAction,
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

pub fn run(BanArgs { config, action }: BanArgs) -> anyhow::Result<ExitCode> {
    match action {
        BanAction::List { policy, json } => list(&config, "/v1/bans", policy.as_deref(), json, "bans", "no key is banned", |b| {
            format!("{} {} banned until {} ({} ms left)", text(b, "policy"), text(b, "key"), text(b, "ends_at"), b["ends_in_ms"])
        })?,
        BanAction::Show { policy, key } => {
            let reply = call(&config, "GET", &one_key("/v1/bans", &policy, &key), None)?;
            let state = match reply["ban"]["ends_at"].as_str() {
                Some(end) => format!("banned until {end} ({} ms left)", reply["ban"]["ends_in_ms"]),
                None => "not banned".to_string(),
            };
            println!("policy {} key {}: {state}; {} of {} refusals within {} ms counted towards a ban of {} ms", escape(&policy), escape(&key), reply["strikes"], reply["after"], reply["within_ms"], reply["ban_ms"]);
        }
        BanAction::Lift { policy, key } => {
            let reply = call(&config, "DELETE", &one_key("/v1/bans", &policy, &key), None)?;
            println!("policy {} key {}: ban lifted (it ran until {}); every daemon within {} ms", escape(&policy), escape(&key), reply["lifted"]["ends_at"].as_str().unwrap_or("?"), reply["applies_within_ms"]);
        }
    }
    Ok(ExitCode::SUCCESS)
}
