//! The Redis scripts as the daemon runs them: the text build.rs assembled
//! from src/redis/scripts/ (src/redis/scripts.rs names the same files).

/// The assembled text of src/redis/scripts/`$name`.lua.
macro_rules! assembled {
    ($name:literal) => {
        include_str!(concat!(env!("OUT_DIR"), "/scripts/", $name, ".lua"))
    };
}

pub const LOG: &str = assembled!("sliding_window");
pub const RING: &str = assembled!("ring");
pub const GCRA: &str = assembled!("gcra");
pub const SLIDING_COUNTER: &str = assembled!("sliding_counter");
pub const FIXED: &str = assembled!("fixed_window");
pub const CONCURRENCY: &str = assembled!("concurrency_slots");
pub const PENALIZED_CHECK: &str = assembled!("penalized_check");
pub const RESET_LOG: &str = assembled!("reset_log");
pub const RESET_COUNTER: &str = assembled!("reset_counter");
pub const CHANGE_LOG_APPEND: &str = assembled!("change_log_append");
pub const CHANGE_LOG_READ: &str = assembled!("change_log_read");

/// Every script by its file's stem, for the tests that go through them all.
pub const ALL: [(&str, &str); 11] = [
    ("sliding_window", LOG),
    ("ring", RING),
    ("gcra", GCRA),
    ("sliding_counter", SLIDING_COUNTER),
    ("fixed_window", FIXED),
    ("concurrency_slots", CONCURRENCY),
    ("penalized_check", PENALIZED_CHECK),
    ("reset_log", RESET_LOG),
    ("reset_counter", RESET_COUNTER),
    ("change_log_append", CHANGE_LOG_APPEND),
    ("change_log_read", CHANGE_LOG_READ),
];

/// The assembled text of the script named `stem`.
pub fn named(stem: &str) -> &'static str {
    ALL.iter().find(|(s, _)| *s == stem).unwrap_or_else(|| panic!("no script named {stem}")).1
}

/// Loads `script` into the Redis of `conn` (`SCRIPT LOAD`): its SHA, for
/// the tests that call the scripts themselves.
pub fn load(conn: &mut redis::Connection, script: &str) -> String {
    redis::cmd("SCRIPT").arg("LOAD").arg(script).query(conn).unwrap()
}
