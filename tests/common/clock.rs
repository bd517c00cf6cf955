//! The wall clock as the tests read it: now, and how long until the next
//! UTC midnight (where day windows of the fixed window and the sliding
//! counter end).

use std::time::{SystemTime, UNIX_EPOCH};

const DAY_MS: u64 = 86_400_000;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// Milliseconds to the next UTC midnight.
pub fn to_midnight_ms() -> u32 {
    (DAY_MS - now_ms() % DAY_MS) as u32
}
