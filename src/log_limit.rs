//! `RateLimitedLog`: lets one log line of a kind through per interval and
//! counts the ones held back, so that a condition hit 50k times a second
//! gives one line a second (with `suppressed=N`), not 50k. Lock-free: one
//! clock read and one or two relaxed atomic operations per call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One kind of log line, let through at most once per interval.
#[derive(Debug)]
pub struct RateLimitedLog {
    interval_ms: u64,
    epoch: Instant,
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimitedLog {
    pub fn new(interval: Duration) -> Self {
        Self { interval_ms: interval.as_millis() as u64, epoch: Instant::now(), next_ms: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// `Some(n)` when a line may be logged now (n lines were held back since
    /// the last one); `None` when it must be held back.
    pub fn permit(&self) -> Option<u64> {
        let now = self.epoch.elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next && self.next_ms.compare_exchange(next, now + self.interval_ms, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_it_holds_back() {
        let log = RateLimitedLog::new(Duration::from_secs(60));
        assert_eq!(log.permit(), Some(0));
        assert_eq!(log.permit(), None);
        assert_eq!(log.permit(), None);
        assert_eq!(log.suppressed.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn lets_the_next_one_through_after_the_interval() {
        let log = RateLimitedLog::new(Duration::from_millis(30));
        assert_eq!(log.permit(), Some(0));
        assert_eq!(log.permit(), None);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(log.permit(), Some(1));
    }
}
