//! A circuit breaker for one Redis endpoint.
//!
//! Closed: requests go to Redis. After `threshold` consecutive failures
//! (deadlines during which Redis answered nothing: the link decides what
//! counts), or at once on a lost connection, it opens: requests stop
//! waiting on Redis and the fail policy answers them immediately, while the
//! link's supervisor probes in the background and closes the breaker once a
//! fresh connection has answered and the script is loaded. The request path
//! reads one atomic; it writes only when the state changes.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

#[derive(Debug)]
pub struct Breaker {
    open: AtomicBool,
    failures: AtomicU32,
    threshold: u32,
}

impl Breaker {
    /// A breaker that starts open: nothing is known to work until the first
    /// probe succeeds.
    pub fn new(threshold: u32) -> Self {
        Self { open: AtomicBool::new(true), failures: AtomicU32::new(0), threshold: threshold.max(1) }
    }

    #[inline]
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    #[inline]
    pub fn record_success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    /// Counts one failure; true if this one opened the breaker.
    pub fn record_failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        n >= self.threshold && self.trip()
    }

    /// Opens the breaker now; true if it was closed.
    pub fn trip(&self) -> bool {
        !self.open.swap(true, Ordering::AcqRel)
    }

    /// Closes the breaker (after a successful probe).
    pub fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.open.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = Breaker::new(3);
        assert!(b.is_open(), "starts open until a probe succeeds");
        b.close();
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        b.record_success();
        assert!(!b.record_failure());
        assert!(!b.record_failure());
        assert!(b.record_failure(), "the third in a row opens it");
        assert!(b.is_open());
        assert!(!b.record_failure(), "already open");
        b.close();
        assert!(!b.is_open());
        assert!(b.trip());
        assert!(!b.trip());
    }
}
