//! The daemon's Redis keys as the tests name them (docs/CONFIG.md, "Redis
//! key layout"), computed here rather than by the crate, so that a change
//! of layout fails a test.

/// A policy's scoped key: the name's length as one byte, the name, the key.
pub fn scoped(name: &str, key: &str) -> String {
    format!("{}{name}{key}", name.len() as u8 as char)
}

/// The 60 s log window key of `key` under policy `name`: the scoped key as
/// the hash tag, or behind `~` when the key holds a brace of its own.
pub fn policy_key(name: &str, key: &str) -> String {
    let scoped = scoped(name, key);
    if key.contains('{') {
        format!("ratelimitd:~{scoped}:60000ms")
    } else {
        format!("ratelimitd:{{{scoped}}}:60000ms")
    }
}
