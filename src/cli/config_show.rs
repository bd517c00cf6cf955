//! `ratelimitd config-show`: the file as the daemon would hold it, as TOML.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use ratelimitd::config::Config;

#[derive(Args)]
pub struct ConfigShowArgs {
    #[arg(long, short, default_value = super::common::DEFAULT_CONFIG)]
    config: PathBuf,
}

pub fn run(ConfigShowArgs { config }: ConfigShowArgs) -> anyhow::Result<ExitCode> {
    print!("{}", Config::load(&config)?.dump());
    Ok(ExitCode::SUCCESS)
}
