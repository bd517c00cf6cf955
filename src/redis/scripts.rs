//! The Redis scripts, as build.rs assembled them from src/redis/scripts/:
//! each top-level `<name>.lua` there with its `--@include <file>` lines
//! replaced by that file (a shared part in `parts/`, or a mode's body in
//! `<name>/`). The text is fixed at build time, so each script's SHA is too.

macro_rules! assembled {
    ($name:literal) => {
        include_str!(concat!(env!("OUT_DIR"), "/scripts/", $name, ".lua"))
    };
}

/// The log (sliding_window.lua): single checks, coalesced batches, cold
/// keys in one call, quota leases and their settles, all-or-nothing
/// reserves, confirms and refunds.
pub const LOG: &str = assembled!("sliding_window");
/// The ring: same arguments and reply as the log's single check.
pub const RING: &str = assembled!("ring");
/// GCRA: same arguments and reply layout, and reserve/settle.
pub const GCRA: &str = assembled!("gcra");
/// The sliding-window counter: the same again.
pub const SLIDING_COUNTER: &str = assembled!("sliding_counter");
/// The fixed window (calendar windows too): the same again.
pub const FIXED: &str = assembled!("fixed_window");
/// Concurrency leases (ACQUIRE and RELEASE).
pub const CONCURRENCY: &str = assembled!("concurrency_slots");
/// The penalty box: the log's single check, the ban and the strikes.
pub const PENALIZED_CHECK: &str = assembled!("penalized_check");
/// An admin reset of a log window (src/admin.rs).
pub const RESET_LOG: &str = assembled!("reset_log");
/// An admin reset of a fixed window or sliding counter (src/admin.rs).
pub const RESET_COUNTER: &str = assembled!("reset_counter");
/// The admin change log (src/admin_api/changes.rs): an override's write
/// or a ban's lift appended for every daemon...
pub const CHANGE_LOG_APPEND: &str = assembled!("change_log_append");
/// ...and a daemon's read of what it has not applied yet.
pub const CHANGE_LOG_READ: &str = assembled!("change_log_read");
