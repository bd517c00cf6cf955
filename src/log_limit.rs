//! `RateLimitedLog`: lets one log line of a kind through per interval and
//! counts the ones held back, so that a condition hit 50k times a second
//! gives one line a second (with `suppressed=N`), not 50k. Lock-free: one
//! clock read and one or two relaxed atomic operations per call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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

    /// For a line that must never be held back (a recovery after a failure
    /// that was logged): counts as the interval's line, and returns how many
    /// were held back before it.
    pub fn force(&self) -> u64 {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.next_ms.fetch_max(now + self.interval_ms, Ordering::Relaxed);
        self.suppressed.swap(0, Ordering::Relaxed)
    }
}

/// How often a library's module may log: the promise CONFIG.md makes for
/// Redis failures ("at most once a second").
pub const LIBRARY_LOG_INTERVAL: Duration = Duration::from_secs(1);
/// Modules given a limit of their own; the rest share one (a library has a
/// handful, and a map that grows with what it logs would be unbounded).
const LIBRARY_TARGETS: usize = 64;

/// The `log` records of the libraries the daemon uses (the Redis client's
/// "Failed to connect to node", "beginning slot refresh": about two per
/// request during a Cluster failover), passed on to `tracing` at most once
/// per `LIBRARY_LOG_INTERVAL` per module, with a line that says how many
/// were held back before each one let through. The daemon's own lines
/// (`tracing`) do not come here; they have their own `RateLimitedLog`s.
pub struct LibraryLog {
    targets: Mutex<HashMap<String, Arc<RateLimitedLog>>>,
    others: Arc<RateLimitedLog>,
}

impl Default for LibraryLog {
    fn default() -> Self {
        Self { targets: Mutex::new(HashMap::new()), others: Arc::new(RateLimitedLog::new(LIBRARY_LOG_INTERVAL)) }
    }
}

impl LibraryLog {
    fn limit_of(&self, target: &str) -> Arc<RateLimitedLog> {
        let mut targets = self.targets.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(log) = targets.get(target) {
            return log.clone();
        }
        if targets.len() >= LIBRARY_TARGETS {
            return self.others.clone();
        }
        let log = Arc::new(RateLimitedLog::new(LIBRARY_LOG_INTERVAL));
        targets.insert(target.to_owned(), log.clone());
        log
    }

    /// Has `log` records go through this, and lets `log` call it only for
    /// levels the `tracing` filter may pass (`set_max_level`, again after
    /// every change of the filter).
    pub fn install() -> Result<(), log::SetLoggerError> {
        log::set_boxed_logger(Box::<Self>::default())?;
        Self::follow_filter();
        Ok(())
    }

    /// `log`'s own level check before it calls us, from the `tracing`
    /// filter's most verbose level: a library's `trace!` on a request's
    /// path then costs a compare, not a call.
    pub fn follow_filter() {
        use tracing_log::AsLog;
        log::set_max_level(tracing::level_filters::LevelFilter::current().as_log());
    }
}

impl log::Log for LibraryLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        use tracing_log::AsTrace;
        tracing::dispatcher::get_default(|d| d.enabled(&metadata.as_trace()))
    }

    fn log(&self, record: &log::Record<'_>) {
        // A line the filter drops is not counted as held back.
        if !self.enabled(record.metadata()) {
            return;
        }
        let Some(held_back) = self.limit_of(record.target()).permit() else { return };
        if held_back > 0 {
            tracing::warn!(library = record.target(), held_back, "log lines of a library held back (each of its modules logs at most once a second)");
        }
        let _ = tracing_log::format_trace(record);
    }

    fn flush(&self) {}
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

    /// A library's lines: one per module per second, the others counted
    /// and said before the next one let through; a line the filter drops
    /// is not counted.
    #[test]
    fn a_library_logs_once_a_second_per_module_and_says_how_many_it_held_back() {
        use log::Log;
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let subscriber = tracing_subscriber::fmt().with_writer(move || out.clone()).with_ansi(false).with_max_level(tracing::Level::INFO).finish();
        let lib = LibraryLog::default();
        let line = |target: &str, level: log::Level| lib.log(&log::Record::builder().level(level).target(target).args(format_args!("Failed to connect to node")).build());
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..5 {
                line("redis::cluster", log::Level::Warn);
                line("redis::cluster", log::Level::Debug);
            }
            line("redis::aio", log::Level::Warn);
            std::thread::sleep(LIBRARY_LOG_INTERVAL + Duration::from_millis(100));
            line("redis::cluster", log::Level::Warn);
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].contains("WARN redis::cluster: Failed to connect to node"), "{text}");
        assert!(lines[1].contains("WARN redis::aio: Failed to connect to node"), "{text}");
        assert!(lines[2].contains("log lines of a library held back") && lines[2].contains("library=\"redis::cluster\" held_back=4"), "{text}");
        assert!(lines[3].contains("WARN redis::cluster: Failed to connect to node"), "{text}");
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
