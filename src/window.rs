//! The vocabulary every store shares: what to check (`LimitSpec`), what a
//! store answers (`Verdict`), and why a shared store could not answer
//! (`StoreError`). It imports nothing of this crate, so every layer can use
//! it and none has to reach upwards for it.

use std::time::Duration;

/// One limit to check, borrowed from the request.
#[derive(Clone, Copy, Debug)]
pub struct LimitSpec<'a> {
    pub key: &'a [u8],
    pub limit: u32,
    pub window_ms: u32,
    pub cost: u32,
}

/// A store's answer for one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Verdict {
    pub allowed: bool,
    /// Admissions in the window after this request.
    pub count: u32,
    pub remaining: u32,
    /// 0 when allowed; else ms until a retry of the same cost can pass.
    pub retry_after_ms: u32,
    /// ms until the window holds no admissions.
    pub reset_ms: u32,
}

/// Why the shared store could not decide.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StoreError {
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis is unavailable: {0}")]
    Unavailable(String),
    #[error("redis error: {0}")]
    Redis(String),
    #[error("circuit open: redis is down or too slow; waiting for a probe to succeed")]
    CircuitOpen,
    /// Refused before reaching Redis: the calls in flight were at the
    /// adaptive limit (the value given), so this one could not meet its
    /// deadline. Not a failure of Redis.
    #[error("overloaded: {0} redis calls in flight, the adaptive limit; decided at once by the fail policy")]
    Overloaded(u32),
}
