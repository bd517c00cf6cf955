//! What the commands share: the runtime, `--config`'s default, JSON out.

/// The runtime of the commands that talk to a daemon or to Redis.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// `--config`'s default: where packages install the file.
pub const DEFAULT_CONFIG: &str = "/etc/ratelimitd/ratelimitd.toml";

/// Prints `value` as one line of JSON, non-ASCII escaped (client keys are
/// hostile: a terminal never gets their raw bytes).
pub fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", ratelimitd::terminal::json_ascii_safe(&serde_json::to_string(value)?));
    Ok(())
}
